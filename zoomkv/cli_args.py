"""Argument parsing the subcommands share: ``--method-arg`` hyper-parameter overrides, and whole numbers
held to a range (``int_option``) so that ``--samples 99999999999999999999`` is refused, not run for ever.

Both forms take repeatable, comma-separated items whose values are YAML scalars (``16`` an int, ``0.5`` a
float, ``true`` a bool):

* ``key=value`` for one method (``zoomkv generate --method-arg window=16``);
* ``method.key=value`` when a run has several methods (``zoomkv eval --method-args snapkv.window=16``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from typing import Any

from zoomkv.errors import ZoomKVError

__all__ = ["int_option", "parse_method_args", "parse_scoped_method_args", "parse_value"]


def int_option(low: int | None = None, high: int | None = None) -> Callable[[str], int]:
    """An argparse ``type``: a whole number from ``low`` to ``high`` (either end open when None); anything
    else is argparse's one-line error naming the option (``argument --samples: must be 1 to 1000000, got 0``)."""

    def parse(text: str) -> int:
        value = int(text)  # ValueError: argparse says "invalid int value: 'abc'"
        if (low is not None and value < low) or (high is not None and value > high):
            bound = (f"{low} to {high}" if low is not None and high is not None
                     else f"at least {low}" if low is not None else f"at most {high}")
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value

    parse.__name__ = "int"
    return parse


def parse_value(text: str, key: str = "") -> Any:
    """A value given on the command line, read as a YAML scalar (unparsable YAML: one ``ZoomKVError``)."""
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        what = f"the value of {key!r}" if key else "a value"
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ZoomKVError(f"{what}, {text!r}, is not a YAML value ({first})") from None


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
        out[key.strip()] = parse_value(value, key.strip())
    return out


def parse_scoped_method_args(items: list[str] | None) -> dict[str, dict[str, Any]]:
    """``--method-args method.key=value[,...]`` (repeatable) → ``{method: {key: value}}``."""
    out: dict[str, dict[str, Any]] = {}
    for item in _items(items):
        name, eq, value = item.partition("=")
        method, dot, key = name.partition(".")
        if not eq or not dot or not method.strip() or not key.strip():
            raise ZoomKVError(f"--method-args expects method.key=value (e.g. snapkv.window=16), got {item!r}")
        out.setdefault(method.strip(), {})[key.strip()] = parse_value(value, name.strip())
    return out
