"""Argument parsing the subcommands share: the run grammar's flags (``add_run_arguments``, parsed by
``zoomkv.runspec``: the same for ``generate``, ``chat``, ``bench`` and ``eval``), ``--method-arg``
hyper-parameter overrides, and whole numbers held to a range (``int_option``) so that
``--samples 99999999999999999999`` is refused, not run for ever.

``--method-arg`` takes repeatable, comma-separated items whose values are YAML scalars (``16`` an int,
``0.5`` a float, ``true`` a bool):

* ``key=value`` for every run the command names (``zoomkv generate --method snapkv --method-arg window=16``);
* ``method.key=value`` for that method's runs only (``zoomkv eval --method-args snapkv.window=16``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from typing import Any

from zoomkv.errors import ZoomKVError
from zoomkv.memory.quant import FORMATS_HELP, is_format

__all__ = ["add_loudness", "add_run_arguments", "int_option", "parse_method_args", "parse_run_method_args",
           "parse_scoped_method_args", "parse_value", "run_from_args", "runs_from_args"]


def add_loudness(parser: argparse.ArgumentParser) -> None:
    """``-q/--quiet`` (warnings only, no progress bars) and ``-v/--verbose`` (debug lines too) on a command's
    parser, each unless the command defines it already. A parser with subcommands of its own gets them on
    each subcommand instead (argparse lets a subcommand's defaults overwrite what its parent parsed)."""
    if parser._subparsers is not None:
        return
    taken = parser._option_string_actions
    if "--quiet" not in taken:
        parser.add_argument(*(["-q"] if "-q" not in taken else []), "--quiet", action="store_true",
                            help="warnings only, no progress bars")
    if "--verbose" not in taken:
        parser.add_argument(*(["-v"] if "-v" not in taken else []), "--verbose", action="store_true",
                            help="debug lines too")


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


def parse_run_method_args(items: list[str] | None) -> dict[str, dict[str, Any]]:
    """``--method-arg`` of the run grammar → ``{method: {key: value}}``; ``key=value`` items (no method) under
    ``zoomkv.runspec.ALL_METHODS``: every run the command names."""
    from zoomkv.runspec import ALL_METHODS

    out: dict[str, dict[str, Any]] = {}
    for item in _items(items):
        name, eq, value = item.partition("=")
        method, dot, key = name.strip().rpartition(".")
        if not eq or not key.strip() or (dot and not method.strip()):
            raise ZoomKVError(f"--method-arg expects key=value or method.key=value (e.g. window=16, "
                              f"snapkv.window=16), got {item!r}")
        out.setdefault(method.strip() if dot else ALL_METHODS, {})[key.strip()] = parse_value(value, name.strip())
    return out


def _kv_format(text: str) -> str:
    if text != "none" and not is_format(text):
        raise argparse.ArgumentTypeError(f"unknown KV quantization {text!r}; valid: {FORMATS_HELP}, none")
    return text


def _nonempty(what: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if not text.strip():
            raise argparse.ArgumentTypeError(f"needs {what}, got an empty name")
        return text

    parse.__name__ = "name"
    return parse


def add_run_arguments(parser: argparse.ArgumentParser, *, several: bool, methods: str | None = None,
                      budgets: str | None = None, prefill_chunk: bool = True) -> None:
    """The run grammar's flags (``zoomkv.runspec``): the same names and meaning on every command that runs a
    method. ``several``: eval and bench (comma-separated lists, repeated adapters, ``full`` as the reference);
    otherwise one configuration (generate, chat). ``methods``/``budgets``: the command's defaults."""
    plural = "comma-separated; " if several else ""
    parser.add_argument("--method", "--methods", dest="methods", default=methods, metavar="METHOD[+VARIANT]",
                        help=f"{plural}a name from `zoomkv methods`, with variants +tail, +int8, +int4 "
                             f"(quest+tail+int8)" + ("; full is always included as the reference" if several else
                                                     "; default full"))
    parser.add_argument("--adapter", action="append", type=_nonempty("an adapter folder or Hub id"),
                        metavar="DIR_OR_HUB_ID[+VARIANT]",
                        help="a trained adapter (folder from `zoomkv export`, training run, or Hub id): its method "
                             "with its modules, at its own budget unless --budget is given; DIR+int8 / +int4 / +tail "
                             "as for --method" + ("; repeatable, comma-separated" if several else
                                                  "; not with --method (the adapter sets the method)"))
    parser.add_argument("--budget", "--budgets", dest="budgets", default=budgets, metavar="B" + ("[,B...]" if several else ""),
                        help=f"{plural}device-tier rows per layer per KV head: 512, or 0.1 of the prompt")
    parser.add_argument("--method-arg", "--method-args", dest="method_args", action="append",
                        metavar="[METHOD.]KEY=VALUE",
                        help="a hyper-parameter: KEY=VALUE for every run named, METHOD.KEY=VALUE for that method's "
                             "(repeatable, or comma-separated)")
    parser.add_argument("--tail-summary", action="store_true",
                        help="+tail on every run named: one mean row (log-count bias) for every row not selected "
                             "(recallable methods; one of the B rows)")
    parser.add_argument("--kv-quant", type=_kv_format, default=None, metavar="FORMAT",
                        help=f"+FORMAT on every run named: the host tier as codes with fp16 scales ({FORMATS_HELP}; "
                             "none) (full, which has no host tier: its device tier)")
    parser.add_argument("--kv-quant-tiers", choices=["host", "all"], default=None,
                        help="where --kv-quant quantizes: host (methods with a budget) or all (full, the default "
                             "there); the other choice is refused")
    if prefill_chunk:
        parser.add_argument("--prefill-chunk", type=int, metavar="N",
                            help="put the prompt through in pieces of N tokens, compressed as they go (peak device "
                                 "KV per layer: the budget plus N rows)")


def _names(groups: list[str] | None) -> list[str]:
    return [t.strip() for group in groups or [] if group for t in group.split(",") if t.strip()]


def runs_from_args(args: argparse.Namespace, *, reference: bool = True, default_budgets: tuple[str, ...] = (),
                   prefill_chunk: int | None = None) -> list[Any]:
    """eval's and bench's runs: ``full`` first, then every method and adapter at every budget;
    ``default_budgets``: the methods' when ``--budgets`` is not given at all."""
    from zoomkv.runspec import parse_runs

    return parse_runs(_names([args.methods]), _names(args.adapter), _names([args.budgets]),
                      method_args=parse_run_method_args(args.method_args), tail_summary=args.tail_summary,
                      kv_quant=args.kv_quant, kv_quant_tiers=args.kv_quant_tiers, prefill_chunk=prefill_chunk,
                      reference=reference, default_budgets=default_budgets if args.budgets is None else ())


def run_from_args(args: argparse.Namespace) -> Any:
    """generate's and chat's one configuration."""
    from zoomkv.runspec import parse_run

    adapters = args.adapter or []
    if len(adapters) > 1:
        raise ZoomKVError(f"--adapter: this command runs one adapter, got {len(adapters)}")
    return parse_run(args.methods, adapters[0] if adapters else None, args.budgets,
                     method_args=parse_run_method_args(args.method_args), tail_summary=args.tail_summary,
                     kv_quant=args.kv_quant, kv_quant_tiers=args.kv_quant_tiers,
                     prefill_chunk=getattr(args, "prefill_chunk", None))
