"""Argument parsing the subcommands share: ``--method-arg`` hyper-parameter overrides.

Both forms take repeatable, comma-separated items whose values are YAML scalars (``16`` an int, ``0.5`` a
float, ``true`` a bool):

* ``key=value`` for one method (``zoomkv generate --method-arg window=16``);
* ``method.key=value`` when a run has several methods (``zoomkv eval --method-args snapkv.window=16``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from zoomkv.errors import ZoomKVError

__all__ = ["parse_method_args", "parse_scoped_method_args", "parse_value"]


def parse_value(text: str) -> Any:
    """A value given on the command line, read as a YAML scalar."""
    import yaml

    return yaml.safe_load(text)


def _items(groups: list[str] | None) -> Iterator[str]:
    """Every non-empty ``a=b`` item of a repeatable, comma-separated option, stripped."""
    for group in groups or []:
        for item in group.split(","):
            if item.strip():
                yield item.strip()


def parse_method_args(items: list[str] | None) -> dict[str, Any]:
    """``--method-arg key=value[,key=value]`` (repeatable) → hyper-parameter overrides."""
    out: dict[str, Any] = {}
    for item in _items(items):
        key, eq, value = item.partition("=")
        if not eq:
            raise ZoomKVError(f"--method-arg expects key=value, got {item!r}")
        out[key.strip()] = parse_value(value)
    return out


def parse_scoped_method_args(items: list[str] | None) -> dict[str, dict[str, Any]]:
    """``--method-args method.key=value[,...]`` (repeatable) → ``{method: {key: value}}``."""
    out: dict[str, dict[str, Any]] = {}
    for item in _items(items):
        name, eq, value = item.partition("=")
        method, dot, key = name.partition(".")
        if not eq or not dot or not method.strip() or not key.strip():
            raise ZoomKVError(f"--method-args expects method.key=value (e.g. snapkv.window=16), got {item!r}")
        out.setdefault(method.strip(), {})[key.strip()] = parse_value(value)
    return out
