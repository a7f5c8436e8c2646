"""List the KV methods, their kind and their default hyper-parameters; with a NAME, every hyper-parameter
of that method with its default and what it does.

    zoomkv methods
    zoomkv methods quest
"""

from __future__ import annotations

import argparse
import dataclasses

from zoomkv.errors import MethodNotFoundError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", nargs="?", help="one method: its citation and each hyper-parameter's help")


def _kind(cls: type) -> str:
    return "recallable" if cls.recallable else ("no budget" if not cls.uses_budget else "eviction")


def _default(f: dataclasses.Field) -> object:
    """A field's default as a user would write it (a list's factory called, not shown as an object)."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return "required"


def run(args: argparse.Namespace) -> int:
    from zoomkv.methods import METHODS, TRAINING, list_methods

    if args.name is None:
        for cls in list_methods():
            params = ", ".join(f"{f.name}={_default(f)!r}" for f in dataclasses.fields(cls.config_class))
            kind = _kind(cls) + (", trainable" if cls.name in TRAINING else "")
            print(f"{cls.name:14s} [{kind}] {cls.summary}" + (f"\n{'':14s}   defaults: {params}" if params else ""))
        print("\n`zoomkv methods NAME` explains each hyper-parameter; set one with --method-arg key=value")
        return 0
    if args.name not in METHODS:
        raise MethodNotFoundError(f"unknown method {args.name!r}; valid methods: {', '.join(sorted(METHODS))}")
    cls = METHODS[args.name]
    print(f"{cls.name} [{_kind(cls)}{', trainable' if cls.name in TRAINING else ''}]: {cls.summary}")
    if cls.citation:
        print(f"  {cls.citation}")
    fields = dataclasses.fields(cls.config_class)
    width = max((len(f"{f.name}={f.default!r}") for f in fields), default=0)
    for f in fields:
        print(f"  {f'{f.name}={f.default!r}':{width}s}  {f.metadata.get('help', '')}".rstrip())
    return 0
