"""List the KV methods, their kind and their default hyper-parameters."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace) -> int:
    import dataclasses

    from zoomkv.methods import list_methods

    for cls in list_methods():
        params = ", ".join(f"{f.name}={f.default!r}" for f in dataclasses.fields(cls.config_class))
        kind = "recallable" if cls.recallable else ("no budget" if not cls.uses_budget else "eviction")
        print(f"{cls.name:14s} [{kind}] {cls.summary}" + (f"\n{'':14s}   defaults: {params}" if params else ""))
    return 0
