"""Build the offline profile a method needs: ``zoomkv calibrate PROFILE --model M``.

    zoomkv calibrate compresskv --model smollm2-135m
    zoomkv calibrate infinigen --model smollm2-135m

Each profile is a module ``zoomkv/calibrate/<name>.py`` with the same ``add_arguments(parser)`` and
``run(args)`` as every subcommand, and a one-line ``HELP`` (the profiles are found, not listed).
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from zoomkv.calibrate import profile_modules
    from zoomkv.cli_args import add_loudness

    profiles = parser.add_subparsers(dest="profile", required=True)
    for name, module in profile_modules().items():
        p = profiles.add_parser(name, help=module.HELP)
        module.add_arguments(p)
        add_loudness(p)
        p.set_defaults(run_profile=module.run)


def run(args: argparse.Namespace) -> int:
    return args.run_profile(args)
