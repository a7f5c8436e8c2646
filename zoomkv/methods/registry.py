"""Methods by name, so the CLI and the evaluation pick up every method that registers itself."""

from __future__ import annotations

from typing import Any

from zoomkv.errors import MethodNotFoundError
from zoomkv.methods.base import KVMethod

METHODS: dict[str, type[KVMethod]] = {}


def register_method(cls: type[KVMethod]) -> type[KVMethod]:
    if cls.name in METHODS and METHODS[cls.name] is not cls:
        raise ValueError(f"method {cls.name!r} is registered twice")
    METHODS[cls.name] = cls
    return cls


def get_method(name: str | KVMethod, **hyperparameters: Any) -> KVMethod:
    if isinstance(name, KVMethod):
        return name
    if name not in METHODS:
        raise MethodNotFoundError(f"unknown method {name!r}; valid methods: {', '.join(sorted(METHODS))}")
    return METHODS[name](**hyperparameters)


def list_methods() -> list[type[KVMethod]]:
    return [METHODS[n] for n in sorted(METHODS)]
