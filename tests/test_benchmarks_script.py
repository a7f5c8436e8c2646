"""``make benchmarks`` (scripts/benchmarks.py): its plumbing, without running a model. Every command it would run
parses with zoomkv's own command line, names registered methods and variants, and points at recipes and
scripts that exist; ``--quick`` reruns the README table's rows."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("benchmarks_script", ROOT / "scripts" / "benchmarks.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def _printed(script, *argv: str) -> list[str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert script.main(list(argv)) == 0
    return [line for line in out.getvalue().splitlines() if line.strip()]


def _check_command(command: str) -> None:
    """A printed command runs as written: zoomkv's parser takes it, its methods and variants are registered, and
    the files it reads are in the repository."""
    from zoomkv.cli import _parse, build_parser
    from zoomkv.protocol.registry import METHODS
    from zoomkv.runspec import split_variants, trailing_variants

    env, argv = {}, shlex.split(command)
    while "=" in argv[0] and not argv[0].startswith("-"):
        key, _, value = argv.pop(0).partition("=")
        env[key] = value
    assert set(env) <= {"ZOOMKV_NATIVE"}, command
    if argv[0] == "python":
        if argv[1] == "-m":
            assert argv[2] == "pip", command
            return
        assert (ROOT / argv[1]).is_file(), command
        return
    assert argv[0] == "zoomkv", command
    args = _parse(build_parser(), argv[1:])
    for label in (getattr(args, "methods", None) or getattr(args, "method", None) or "").split(","):
        if label:
            assert split_variants(label)[0] in METHODS, command
    for folder in getattr(args, "adapter", None) or []:
        for one in folder.split(","):
            trailing_variants(one)  # every suffix a known variant
    recipe = getattr(args, "recipe", None)
    if recipe:
        assert (ROOT / recipe).is_file(), command


def test_the_quick_run_reruns_the_readme_tables_rows(script):
    commands = _printed(script, "--quick", "--dry-run")
    for command in commands:
        _check_command(command)
    # the quickstart adapter first, as `make demo` trains it; then the rows of every README table method
    assert commands[0] == "zoomkv train --recipe recipes/smollm2-135m/quickstart.yaml resume=latest"
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    evals = " ".join(c for c in commands if c.startswith("zoomkv eval"))
    for method in ("full", "oracle_topk", "semantic_id", "clusterkv", "quest", "snapkv"):
        assert f"`{method}`" in readme and method in evals.split("--methods ")[1].split()[0].split(",")
    assert "--samples 2" in evals and any(c.startswith("zoomkv bench") for c in commands)


def test_every_table_command_parses(script):
    names = [line.split()[0] for line in _printed(script, "--list")]
    assert "heldout" in names and len(names) == len(set(names))
    commands = _printed(script, "--dry-run")
    assert len(commands) > len(names)
    for command in commands:
        _check_command(command)
    # one table alone brings its prerequisites along
    only = _printed(script, "--only", "decode", "--dry-run")
    assert only[0].startswith("zoomkv train --recipe recipes/smollm2-135m/quickstart.yaml")
    assert all(c in commands for c in only)


def test_every_benchmarks_section_a_table_regenerates_exists(script):
    """The tables name BENCHMARKS.md's headings, so a rerun's TABLES.md lines up with the page."""
    headings = {line.lstrip("#").strip() for line in (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8").splitlines()
                if line.startswith("### ")}
    missing = [t.section for t in script.tables("runs/x", quick=False) if t.section not in headings]
    assert missing == []


def test_a_trained_adapter_is_not_trained_again(script, tmp_path, monkeypatch):
    monkeypatch.setattr(script, "ROOT", tmp_path)
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "r.yaml").write_text("model: tiny-llama\nrun_name: mine\n")
    command = "zoomkv train --recipe recipes/r.yaml resume=latest"
    assert not script.already_done(command)
    written = tmp_path / "checkpoints" / "mine" / "adapter" / "adapter_config.json"
    written.parent.mkdir(parents=True)
    written.write_text("{}")
    assert script.already_done(command)
    assert not script.already_done(command.replace("resume=latest", "run_name=other"))
    assert not script.already_done("zoomkv train --recipe recipes/r.yaml --eval-only")
