"""``zoomkv bench`` on a tiny model: a batch of sequences decoded together, and the sync audit column."""

from __future__ import annotations

import argparse
import json

import pytest

from zoomkv.bench import run_bench as _run_bench
from zoomkv.cli_args import runs_from_args
from zoomkv.commands import bench as bench_command
from zoomkv.errors import ZoomKVError


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_command.add_arguments(parser)
    return parser.parse_args(["--model", "tiny-llama", "--length", "96", "--new-tokens", "3", "--repeats", "1",
                              "--no-warmup", *argv])


def run_bench(args: argparse.Namespace) -> list[dict]:
    """What ``zoomkv bench`` does with its arguments: the runs parsed, then timed."""
    return _run_bench(args, runs_from_args(args, default_budgets=bench_command.DEFAULT_BUDGETS))


def test_a_batch_decodes_together_and_counts_every_sequence(capsys):
    rows = run_bench(_args("--methods", "full,quest", "--budgets", "48", "--batch-size", "3", "--sync-audit",
                           "--json"))
    report = json.loads(capsys.readouterr().out)
    assert report["batch_size"] == 3 and [r["method"] for r in rows] == ["hf", "full", "quest"]
    for r in rows[1:]:
        assert r["batch_size"] == 3
        assert r["decode_tokens_per_s"] == pytest.approx(3000 / r["decode_ms_per_token"], rel=0.01)
    for r in rows:  # every row audited, hf's plain cache too; each step computes something
        assert r["syncs_per_step"] == 0 and r["ops_per_step"] > 0  # sync-free on the CPU (tests/test_sync_audit.py)


def test_the_table_shows_tokens_per_second_and_no_audit_column_unasked(capsys):
    run_bench(_args("--methods", "full", "--budgets", "48"))
    out = capsys.readouterr().out
    assert "decode tok/s" in out and "syncs/step" not in out


def test_the_header_names_the_processor_and_threads(capsys, monkeypatch):
    """A time is read with its machine: the header and the JSON say which processor ran it, with how many threads."""
    import torch

    from zoomkv import bench

    monkeypatch.setattr(bench, "processor_name", lambda device: "Test CPU 9000")
    run_bench(_args("--methods", "full", "--budgets", "48"))
    header = capsys.readouterr().out.splitlines()[0]
    assert f"on cpu (Test CPU 9000, {torch.get_num_threads()} threads) in float32" in header
    run_bench(_args("--methods", "full", "--budgets", "48", "--json"))
    report = json.loads(capsys.readouterr().out)
    assert report["processor"] == "Test CPU 9000" and report["threads"] == torch.get_num_threads()


def test_the_processor_name_is_the_cpus_own():
    import torch

    from zoomkv.bench import processor_name

    name = processor_name(torch.device("cpu"))
    assert name and "\n" not in name
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            listed = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        listed = []
    if listed:
        assert name == listed[0]


def test_a_batch_of_none_is_refused():
    with pytest.raises(ZoomKVError, match="--batch-size"):
        run_bench(_args("--batch-size", "0"))


def test_profile_splits_a_decode_step_into_its_phases(capsys):
    rows = run_bench(_args("--methods", "full,sekv,quest", "--budgets", "48", "--new-tokens", "4", "--profile"))
    out = capsys.readouterr().out
    assert "| method | budget | step ms | selection | recall | append | attention | rest |" in out
    hf, full, sekv, quest = (r["profile_ms"] for r in rows)
    assert hf is None  # plain transformers has no zoomkv phases
    for p in (full, sekv, quest):
        assert sum(p[name] for name in ("selection", "recall", "append", "attention", "rest")) == \
            pytest.approx(p["step"], abs=0.05)
    for p in (sekv, quest):  # the recallable methods score, recall and attend every compressed layer
        assert p["selection"] > 0 and p["recall"] > 0 and p["attention"] > 0 and p["append"] > 0
    assert full["recall"] == 0  # full recalls nothing: its rows are all on the device


def test_the_hf_row_is_plain_transformers_and_every_ratio_reads_against_it(capsys, monkeypatch):
    """The reference row runs transformers' own DynamicCache with sdpa: no ZoomCache is built for it, and the
    model runs transformers' own attention; its bytes are the full KV it held."""
    from zoomkv.memory import cache as cache_module

    built = []
    real_init = cache_module.ZoomCache.__init__
    monkeypatch.setattr(cache_module.ZoomCache, "__init__", lambda self, *a, **k: (built.append(1), real_init(self, *a, **k))[1])
    rows = run_bench(_args("--methods", "full", "--budgets", "48", "--json"))
    report = json.loads(capsys.readouterr().out)
    hf, full = rows
    assert [r["method"] for r in report["rows"]] == ["hf", "full"]
    assert len(built) == 1  # full's cache only
    assert hf["decode_hf_ratio"] == 1.0 and hf["prefill_hf_ratio"] == 1.0
    assert full["decode_hf_ratio"] == pytest.approx(full["decode_ms_per_token"] / hf["decode_ms_per_token"], rel=0.01)
    assert hf["device_bytes"] == full["full_kv_bytes"] and hf["host_bytes"] == 0


def test_no_hf_leaves_the_reference_row_out(capsys):
    rows = run_bench(_args("--methods", "full", "--budgets", "48", "--no-hf"))
    out = capsys.readouterr().out
    assert [r["method"] for r in rows] == ["full"] and "× hf" not in out and rows[0]["decode_hf_ratio"] is None


def test_the_hf_row_decodes_the_tokens_full_decodes():
    """Same model, same prompts, greedy: plain transformers and zoomkv's full agree token for token."""
    from zoomkv.generation import generate_plain, generate_text
    from zoomkv.memory import CacheSpec
    from zoomkv.models import load_model

    model, tokenizer = load_model("tiny-llama")
    prompts = ["the quick brown fox jumps over the lazy dog " * 6, "a b c d e f g " * 5]
    plain = generate_plain(model, tokenizer, prompts, max_new_tokens=6, chat=False, stop_at_eos=False)
    ours = generate_text(model, tokenizer, prompts, CacheSpec.build("full", None), max_new_tokens=6, chat=False,
                         stop_at_eos=False)
    assert plain.token_ids == ours.token_ids
    assert model.config._attn_implementation == "zoomkv"  # put back after the plain run


def test_a_configuration_out_of_device_memory_is_a_row_and_the_others_go_on(capsys, monkeypatch):
    """The shape a GPU cannot hold with full KV: hf and full run out of memory, a budgeted method decodes."""
    import torch

    from zoomkv import bench

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")

    real, real_plain = bench.generate_text, bench.generate_plain
    monkeypatch.setattr(bench, "generate_plain", out_of_memory)
    monkeypatch.setattr(bench, "generate_text", lambda model, tok, texts, spec, **kw: out_of_memory()
                        if spec.method.name == "full" else real(model, tok, texts, spec, **kw))
    rows = run_bench(_args("--methods", "full,quest", "--budgets", "48", "--repeats", "2", "--sync-audit"))
    out = capsys.readouterr().out
    assert [(r["method"], r["out_of_memory"]) for r in rows] == [("hf", True), ("full", True), ("quest", False)]
    quest = rows[2]
    assert quest["decode_ms_per_token"] > 0 and quest["decode_ratio"] is None and quest["decode_hf_ratio"] is None
    assert out.count("out of device memory") == 2
    table = [line for line in out.splitlines() if line.startswith("|")]
    assert len({line.count("|") for line in table}) == 1  # every row as wide as the header

    # a host tier the host cannot page-lock (zoomkv.memory.pinned) is a row of its own too, saying which memory
    from zoomkv.memory.pinned import HostMemoryError

    def out_of_host_memory(*args, **kwargs):
        raise HostMemoryError("could not page-lock 51.00 GiB of host memory for the host tier")

    monkeypatch.setattr(bench, "generate_plain", real_plain)
    monkeypatch.setattr(bench, "generate_text", lambda model, tok, texts, spec, **kw: out_of_host_memory()
                        if spec.method.name == "quest" else real(model, tok, texts, spec, **kw))
    rows = run_bench(_args("--methods", "full,quest", "--budgets", "48", "--no-hf"))
    out = capsys.readouterr().out
    assert [(r["method"], r["out_of_memory"], r["out_of"]) for r in rows] == [("full", False, None),
                                                                              ("quest", True, "host")]
    assert out.count("out of host memory") == 1 and "out of device memory" not in out

    monkeypatch.setattr(bench, "generate_plain", out_of_memory)
    monkeypatch.setattr(bench, "generate_text", out_of_memory)
    with pytest.raises(ZoomKVError, match="every configuration ran out"):
        run_bench(_args("--methods", "full,quest", "--budgets", "48"))


def test_the_gpu_targets_are_read_from_the_tables_bench_prints(capsys, tmp_path):
    """scripts/gpu_targets.py reads cuda_check.sh's tables as ``zoomkv bench`` prints them (here a CPU run stands
    in for the 16K x 1 profile part, its phase table below the first): ratios to ``hf`` and host waits per method,
    a part not run said so."""
    import importlib.util
    from pathlib import Path

    run_bench(_args("--methods", "full,sekv,quest", "--budgets", "48", "--sync-audit", "--profile"))
    (tmp_path / "llama8b_16k_profile.md").write_text(capsys.readouterr().out, encoding="utf-8")
    path = Path(__file__).resolve().parents[1] / "scripts" / "gpu_targets.py"
    spec = importlib.util.spec_from_file_location("gpu_targets", path)
    gpu_targets = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_targets)
    found = {target: (measured, verdict) for target, measured, verdict in gpu_targets.targets(tmp_path)}
    measured, verdict = found["2. `full` <= 1.0x `hf`, 16K x 1"]
    assert measured.endswith("x `hf` (321 tokens x 1)") and verdict in ("met", "not met (limit 1.0)")
    assert found["4. 0 host waits a step, `sekv`"] == ("0", "met")
    assert found["4. 0 host waits a step, `clusterkv`"] == ("not measured", "?")  # no row in this table
    assert found["3. `sekv` <= 0.35x `hf`, 32K x 8"][1] == "?"  # that part's table is missing


def test_cpu_info_reads_one_field_and_nothing_for_a_missing_one():
    from zoomkv.native import cpu_info

    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = next((line.split(":", 1)[1].strip() for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    assert cpu_info("flags") == flags  # the build's name hashes it: one line, no key
    assert cpu_info("no such field") == ""


def test_cuda_check_runs_the_parts_named_in_their_order_with_arguments_the_commands_take(tmp_path, monkeypatch):
    """scripts/cuda_check.sh on a CPU with a python that only notes what it is asked to run: the parts come in
    the order PARTS names them (the GPU's time is short: the most wanted first), an unknown part is said, and every
    command it would run parses as zoomkv's own (a flag renamed since would waste a GPU run)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from zoomkv.cli import _parse, build_parser
    from zoomkv.train.config import load_recipe

    root = Path(__file__).resolve().parents[1]
    calls, python = tmp_path / "calls.jsonl", tmp_path / "python"
    python.write_text(f"#!/bin/sh\nexec {sys.executable} -c 'import json, sys; open(sys.argv[1], \"a\")"
                      f".write(json.dumps(sys.argv[2:]) + \"\\n\")' {calls} \"$@\"\n", encoding="utf-8")
    python.chmod(0o755)
    parts = "profile,tests,bogus,long,every,chunked,fit,graphs,train,small"
    env = {**os.environ, "PYTHON": str(python), "TMPDIR": str(tmp_path), "SMOLLM2_DIR": str(tmp_path / "none")}
    done = subprocess.run(["bash", "scripts/cuda_check.sh", str(tmp_path / "out"), parts], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)
    assert "cuda_check: no part 'bogus'" in done.stdout, done.stdout + done.stderr
    ran = [json.loads(line) for line in calls.read_text(encoding="utf-8").splitlines()]
    benches = [call[3:] for call in ran if call[:3] == ["-m", "zoomkv", "bench"]]
    kinds = [f"bench {call[call.index('--length') + 1]}" if call[:3] == ["-m", "zoomkv", "bench"]
             else call[1] if call[0] == "-m" else call[0] for call in ran[1:]]  # ran[0]: the versions printed
    assert kinds == ["bench 16384", "pytest", "bench 32768", "bench 32768", "bench 32768", "bench 32768",
                     "bench 16384", "zoomkv.train", "bench 8000", "scripts/gpu_targets.py"]
    for argv in benches:
        args = _parse(build_parser(), ["bench", *argv])
        assert runs_from_args(args, default_budgets=bench_command.DEFAULT_BUDGETS), argv
    train = next(call for call in ran if call[:2] == ["-m", "zoomkv.train"])
    recipe = load_recipe(root / train[3], train[4:])
    assert recipe.steps == 40 and recipe.random_weights
    # the GPU machine's image has no `datasets`: the training part's samples must not need it
    monkeypatch.setitem(sys.modules, "datasets", None)
    from zoomkv.data.training import make_samples
    from zoomkv.models import load_model
    from zoomkv.train.config import load_corpus

    assert load_corpus(recipe) is None
    tokenizer = load_model("tiny-llama")[1]
    assert len(make_samples(tokenizer, recipe.task_mix, 2, 200, 300, recipe.seed, None)) == 2
