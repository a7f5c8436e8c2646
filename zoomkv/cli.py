"""The ``zoomkv`` command line (also ``python -m zoomkv``).

    zoomkv generate --model smollm2-135m --method oracle_topk --budget 0.1 --prompt "..." [--json]
    zoomkv bench --model smollm2-135m --length 4096 --methods full,oracle_topk --budgets 256
    zoomkv models | zoomkv methods

Every subcommand is a module with ``add_arguments(parser)`` and ``run(args) -> int`` (its docstring is
its ``--help`` text), listed once in ``COMMANDS``. Errors caused by the input (unknown names, bad
budgets, empty or over-long prompts) print one line and exit with status 2; they never print a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import typing
from collections.abc import Callable
from types import ModuleType

from zoomkv.cli_args import add_loudness
from zoomkv.errors import ZoomKVError
from zoomkv.logs import show_on_console, verbosity

# (name, module, help), in the order `zoomkv --help` lists them.
COMMANDS: tuple[tuple[str, str, str], ...] = (
    ("generate", "zoomkv.commands.generate", "generate from a prompt with a KV method and print the memory report"),
    ("chat", "zoomkv.commands.chat", "talk about a long document compressed once into a persistent cache"),
    ("bench", "zoomkv.commands.bench", "time prefill and decode of methods against full, interleaved, in one process"),
    ("eval", "zoomkv.commands.eval", "evaluate methods × budgets × tasks: accuracy, bytes per tier, decode speed"),
    ("calibrate", "zoomkv.commands.calibrate", "build the offline profile a method needs (compresskv, infinigen)"),
    ("train", "zoomkv.commands.train", "distil a trainable method's modules against full attention from a recipe"),
    ("export", "zoomkv.commands.export", "write a training checkpoint as a shareable adapter folder"),
    ("push", "zoomkv.commands.push", "upload an exported adapter folder to the Hugging Face Hub"),
    ("models", "zoomkv.commands.models", "list the registered models"),
    ("methods", "zoomkv.commands.methods", "list the KV methods and their defaults"),
)


class Parser(argparse.ArgumentParser):
    """argparse's parser whose usage errors (a missing argument, ``--length abc``, an unknown choice) are one
    line on stderr and exit status 2, like every other input error; ``--help`` still prints the usage."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _command(name: str) -> tuple[ModuleType, str]:
    for command, module_name, help_text in COMMANDS:
        if command == name:
            return importlib.import_module(module_name), help_text
    raise KeyError(f"no zoomkv command {name!r}")


def _help_parts(module: ModuleType, fallback: str) -> dict[str, str]:
    """A command's description (its module docstring's first paragraph, whole: a sentence may run over several
    lines) and epilog (the rest: examples)."""
    doc = (module.__doc__ or fallback).strip("\n")
    first, _, rest = doc.partition("\n\n")
    return {"description": first, "epilog": rest.strip("\n") or None}


def build_parser() -> argparse.ArgumentParser:
    """The ``zoomkv`` parser: one subparser per entry of ``COMMANDS``, each with the module's flags."""
    from zoomkv.version import __version__

    parser = Parser(prog="zoomkv", description=__doc__.split("\n")[0])
    parser.add_argument("--version", action="version", version=f"zoomkv {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, _, help_text in COMMANDS:
        module, _ = _command(name)
        command = sub.add_parser(name, help=help_text, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 **_help_parts(module, help_text))
        module.add_arguments(command)
        add_loudness(command)
        command.set_defaults(func=module.run)
    return parser


# Packages whose import name is not their distribution's name.
DISTRIBUTIONS = {"yaml": "pyyaml"}


def missing_dependency(err: ModuleNotFoundError) -> str | None:
    """What to install when ``err`` is a package zoomkv requires that the environment lacks (many are imported only
    where a command needs them: ``datasets`` for text sources, ``gguf`` for a conversion); None for anything else."""
    from importlib import metadata

    from packaging.requirements import InvalidRequirement, Requirement

    top = (err.name or "").partition(".")[0]
    wanted = DISTRIBUTIONS.get(top, top).lower().replace("_", "-")
    try:
        declared = metadata.requires("zoomkv") or []
    except metadata.PackageNotFoundError:  # zoomkv run from a source tree, not installed: nothing to compare with
        return None
    for line in declared:
        try:
            requirement = Requirement(line)
        except InvalidRequirement:
            continue
        required = requirement.marker is None or requirement.marker.evaluate({"extra": ""})  # not an extra's
        if required and requirement.name.lower().replace("_", "-") == wanted:
            return (f"the package {requirement.name!r}, which zoomkv requires, is not installed: "
                    f"pip install '{requirement.name}{requirement.specifier}'")
    return None


def _run(prog: str, run: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """The one error path: input errors are one line on stderr and exit status 2, never a traceback. The
    command's log goes to stderr at the level ``--quiet`` / ``-v`` ask for (``zoomkv.logs``)."""
    show_on_console(verbosity(getattr(args, "quiet", False), getattr(args, "verbose", False)))
    try:
        return run(args)
    except ZoomKVError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as err:
        missing = missing_dependency(err)
        if missing is None:  # not a package zoomkv declares: a bug, shown whole
            raise
        print(f"{prog}: error: {missing}", file=sys.stderr)
        return 2
    except OSError as err:
        if err.filename is None:
            raise
        # a path the system refused (no permission, read-only, a file where a folder goes, disk full)
        print(f"{prog}: error: {err.filename}: {err.strerror or err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


def _parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """argparse, except that a command's ``key=value`` overrides may come on either side of its flags
    (``train --recipe R run_name=a --eval-only eval_samples=20``): plain argparse takes the positionals
    before a flag only and refuses the rest."""
    args, extra = parser.parse_known_args(argv)
    if extra and isinstance(getattr(args, "overrides", None), list) and all(
            "=" in e and not e.startswith("-") for e in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run ``zoomkv ARGV`` (the ``zoomkv`` script and ``python -m zoomkv``); its exit status, 2 for bad input."""
    try:  # building the parser imports every command's module: a Ctrl-C can land there too
        parser = build_parser()
        args = _parse(parser, argv)
    except KeyboardInterrupt:
        print("zoomkv: interrupted", file=sys.stderr)
        return 130
    return _run(parser.prog, args.func, args)


def run_command(name: str, argv: list[str] | None = None, *, prog: str) -> int:
    """One subcommand as a program of its own (``python -m zoomkv.train`` is ``zoomkv train``), with the
    same arguments and error path."""
    try:
        module, help_text = _command(name)
        parser = Parser(prog=prog, formatter_class=argparse.RawDescriptionHelpFormatter,
                        **_help_parts(module, help_text))
        module.add_arguments(parser)
        add_loudness(parser)
        args = _parse(parser, argv)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    return _run(parser.prog, module.run, args)


if __name__ == "__main__":
    sys.exit(main())
