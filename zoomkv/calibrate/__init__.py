"""Offline calibration profiles (``zoomkv calibrate NAME --model M``) for methods that need one.

Each profile module (``zoomkv/calibrate/<name>.py``) defines ``add_arguments(parser)``, ``run(args)`` and
a one-line ``HELP`` (``zoomkv.commands.calibrate`` makes each a ``zoomkv calibrate`` subcommand);
profiles are small JSON/safetensors files stored under ``profile_dir(model)``, next to the model's
cache, and loaded by their method at prefill.
"""

from __future__ import annotations

import importlib
import pkgutil


def profile_modules() -> dict[str, object]:
    mods = {}
    for info in pkgutil.iter_modules(__path__):
        if not info.name.startswith("_"):
            mods[info.name] = importlib.import_module(f"{__name__}.{info.name}")
    return mods
