"""Offline calibration profiles (``zoomkv calibrate NAME --model M``) for methods that need one.

Each profile module (``zoomkv/calibrate/<name>.py``) defines ``add_arguments(parser)``, ``run(args)`` and
a one-line ``HELP``; profiles are small JSON/safetensors files stored under ``profile_dir(model)``,
next to the model's cache, and loaded by their method at prefill.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil


def profile_modules() -> dict[str, object]:
    mods = {}
    for info in pkgutil.iter_modules(__path__):
        if not info.name.startswith("_"):
            mods[info.name] = importlib.import_module(f"{__name__}.{info.name}")
    return mods


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("calibrate", help="build the offline profile a method needs (compresskv, infinigen)")
    profiles = parser.add_subparsers(dest="profile", required=True)
    for name, module in profile_modules().items():
        p = profiles.add_parser(name, help=getattr(module, "HELP", ""))
        module.add_arguments(p)
        p.set_defaults(func=module.run)
