"""The command line's log: what a command says about its work is ``logging`` on stderr (INFO by default,
``--quiet`` warnings only, ``-v`` debug), through ``tqdm.write``; stdout carries only what a command
produces, and no library module prints."""

from __future__ import annotations

import ast
import logging
from pathlib import Path

import pytest

from tests.test_adapter_artifact import _checkpoint, llama, probe_method  # noqa: F401  (fixtures)
from zoomkv.cli import main
from zoomkv.logs import LOGGER_NAME

ROOT = Path(__file__).resolve().parent.parent / "zoomkv"
# Modules whose prints are their command's output (a table, JSON, generated text, a list, the summary) or the
# CLI's one error path (the package face's too: a Ctrl-C while the zoomkv command imports it); `zoomkv train
# --dry-run`'s sizes.
PRINTS_OUTPUT = {"cli.py", "bench.py", "demo.py", "commands/chat.py", "commands/eval.py", "commands/generate.py",
                 "commands/methods.py", "commands/models.py", "calibrate/compresskv.py", "train/sizing.py",
                 "__init__.py"}


def test_no_module_prints_but_command_output():
    printing = set()
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
                printing.add(rel)
    assert printing <= PRINTS_OUTPUT, sorted(printing - PRINTS_OUTPUT)


@pytest.mark.usefixtures("probe_method")
def test_export_logs_on_stderr_and_quiet_silences_it(tmp_path, llama, capsys):  # noqa: F811
    ckpt = _checkpoint(tmp_path, llama[0])
    assert main(["export", str(ckpt), "--out", str(tmp_path / "a")]) == 0
    out, err = capsys.readouterr()
    assert out == "" and f"exported adapter to {tmp_path / 'a'}" in err
    assert main(["export", str(ckpt), "--out", str(tmp_path / "b"), "--quiet"]) == 0
    assert capsys.readouterr() == ("", "")
    assert (tmp_path / "b" / "adapter_config.json").is_file()


def test_levels_from_the_command_line(capsys):
    logger = logging.getLogger(LOGGER_NAME)
    for flags, level in (([], logging.INFO), (["-q"], logging.WARNING), (["--verbose"], logging.DEBUG),
                         (["-v"], logging.DEBUG)):
        assert main(["models", *flags]) == 0
        assert logger.level == level, flags
        assert "tiny-llama" in capsys.readouterr().out  # the command's output is unchanged
    main(["models"])
    logging.getLogger("zoomkv.some.module").warning("check %s", "this")
    logging.getLogger("zoomkv.some.module").debug("not shown at INFO")
    out, err = capsys.readouterr()
    assert "warning: check this" in err and "not shown" not in err and "check" not in out


def test_log_lines_go_through_tqdm_write(monkeypatch, capsys):
    """A line logged while a progress bar runs is written above it, never on the bar's line."""
    import zoomkv.logs

    written = []
    monkeypatch.setattr(zoomkv.logs.tqdm, "write", lambda text, file=None: written.append(text))
    main(["models"])
    logging.getLogger("zoomkv.x").info("hello")
    assert written == ["hello"]


def test_calibrate_profiles_take_the_flags_after_their_own_arguments(capsys):
    from zoomkv.cli import build_parser

    args = build_parser().parse_args(["calibrate", "infinigen", "--model", "tiny-llama", "-q"])
    assert args.quiet and not args.verbose
    args = build_parser().parse_args(["eval", "--out", "x", "-q", "-v"])
    assert args.quiet and args.verbose
