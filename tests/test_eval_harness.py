"""The evaluation harness on tiny-llama: the CLI end to end, resuming an interrupted run, bad input."""

from __future__ import annotations

import csv
import json

import pytest
import torch

from zoomkv.cli import main
from zoomkv.errors import ZoomKVError
from zoomkv.eval import harness
from zoomkv.eval.harness import EvalConfig, run_eval
from zoomkv.eval.rows import row_key


@pytest.fixture(autouse=True)
def one_thread():
    # A tiny model's ops are microseconds: extra threads only add contention on a shared CPU.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _rows(out):
    return [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]


def test_cli_end_to_end(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["eval", "--model", "tiny-llama", "--methods", "streamingllm,snapkv", "--budgets", "48,96",
                 "--tasks", "niah_single_1,vt", "--length", "1024", "--samples", "2", "--batch-size", "2",
                 "--grid-lengths", "512,1024", "--grid-depths", "0,1", "--max-new-tokens", "3",
                 "--method-args", "snapkv.kernel_size=5", "--out", str(out), "--quiet"])
    printed = capsys.readouterr().out
    assert code == 0
    rows = _rows(out)
    # (full + 2 methods × 2 budgets) × (2 tasks × 2 samples + 2 lengths × 2 depths × 2 samples)
    assert len(rows) == 5 * (4 + 8) and len({row_key(r) for r in rows}) == len(rows)
    for r in rows:
        assert 0 <= r["score"] <= 100 and r["batch_size"] == 2
        assert r["device_bytes"] > 0 and r["full_kv_bytes"] > 0 and r["decode_ms_per_token"] > 0
        if r["method"] == "full":
            # every row, plus the room its buffers keep for the next rows (zoomkv.protocol.dense.ROOM)
            assert r["budget"] is None and r["full_kv_bytes"] <= r["device_bytes"] < 3 * r["full_kv_bytes"]
        if r["method"] == "streamingllm":
            assert r["device_bytes"] < r["full_kv_bytes"]
        if r["method"] == "snapkv":
            assert r["method_args"] == "kernel_size=5"
    with open(out / "rows.csv", encoding="utf-8") as fh:
        table = list(csv.DictReader(fh))
    assert len(table) == len(rows) and {"method", "budget", "task", "length", "sample", "score", "device_bytes",
                                        "host_bytes", "full_kv_bytes", "prefill_s", "decode_ms_per_token"} <= set(table[0])
    assert len(json.loads((out / "rows.json").read_text())) == len(rows)
    summary = (out / "summary.md").read_text()
    assert "| full | – |" in summary and "| snapkv(kernel_size=5) | 48 |" in summary and "niah_grid" in summary
    assert "decode × full" in summary and summary in printed
    for png in ("score_vs_budget_niah_single_1", "score_vs_budget_vt", "score_vs_budget_niah_grid",
                "score_vs_budget_all", "pareto", "niah_heatmap_full", "niah_heatmap_streamingllm",
                "niah_heatmap_snapkv_kernel_size_5"):
        assert (out / f"{png}.png").stat().st_size > 1000, png


class _Counting:
    """Stands in for generate_methods: records what each prompt batch asked for; can fail on call N."""

    def __init__(self, real, fail_at: int | None = None):
        self.real, self.fail_at = real, fail_at
        self.calls: list[tuple[list[str], list[str]]] = []

    def __call__(self, model, tokenizer, prompts, runs, **kw):
        if kw.get("max_new_tokens") != 2:  # 2: the warm-up before the first batch
            if self.fail_at is not None and len(self.calls) + 1 == self.fail_at:
                raise KeyboardInterrupt
            self.calls.append((list(prompts), [f"{r.label}:{r.budget}" for r in runs]))
        return self.real(model, tokenizer, prompts, runs, **kw)


@pytest.fixture
def counting(monkeypatch):
    real = harness.generate_methods

    def install(fail_at: int | None = None) -> _Counting:
        fake = _Counting(real, fail_at)
        monkeypatch.setattr(harness, "generate_methods", fake)
        return fake

    return install


def _cfg(out, **kw):
    base = dict(model="tiny-llama", out=out, methods=["streamingllm"], budgets=["64"], tasks=["niah_single_1"],
                lengths=[600], samples=3, max_new_tokens=3, progress=False, plots=False)
    return EvalConfig(**{**base, **kw})


def test_interrupted_run_resumes_without_redoing_rows(tmp_path, tiny, counting):
    out = tmp_path / "run"
    first = counting(fail_at=3)
    with pytest.raises(KeyboardInterrupt):
        run_eval(_cfg(out), *tiny)
    done = _rows(out)
    assert len(done) == 2 * 2 and len(first.calls) == 2  # two prompts finished, both configs each
    finished_prompts = {p for prompts, _ in first.calls for p in prompts}
    with open(out / "rows.jsonl", "a") as fh:  # a row cut off mid-write by the interruption
        fh.write('{"method": "full", "task": "niah_sin')

    second = counting()
    rows = run_eval(_cfg(out), *tiny)
    assert len(second.calls) == 1 and not finished_prompts & set(second.calls[0][0])
    assert len(rows) == 6 and len({row_key(r) for r in rows}) == 6
    assert len(_rows(out)) == 6  # the torn line is gone

    third = counting()
    run_eval(_cfg(out), *tiny)
    assert third.calls == []  # nothing left to do


def test_resume_runs_only_missing_configs(tmp_path, tiny, counting):
    out = tmp_path / "run"
    counting()
    run_eval(_cfg(out, samples=2), *tiny)
    kept = [r for r in _rows(out) if not (r["method"] == "streamingllm" and r["sample"] == 1)]
    (out / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    again = counting()
    run_eval(_cfg(out, samples=2), *tiny)
    assert [runs for _, runs in again.calls] == [["streamingllm:64"]]
    # growing the run (one more budget) adds only the new rows
    grown = counting()
    rows = run_eval(_cfg(out, samples=2, budgets=["64", "128"]), *tiny)
    assert all(runs == ["streamingllm:128"] for _, runs in grown.calls) and len(rows) == 2 * 3


def test_report_only_runs_nothing_and_reports_the_rows_stored(tmp_path, tiny, counting):
    """Rows of two runs put in one folder are reported together; missing rows are not computed."""
    out = tmp_path / "run"
    counting()
    run_eval(_cfg(out, samples=2), *tiny)
    kept = [r for r in _rows(out) if not (r["method"] == "streamingllm" and r["sample"] == 1)]
    full = [r for r in kept if r["method"] == "full"]  # another run's copy of the same full rows: counted once
    (out / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept + full))
    (out / "summary.md").unlink()
    again = counting()
    rows = run_eval(_cfg(out, samples=9, budgets=["64", "128"], report_only=True, plots=False), *tiny)
    assert again.calls == [] and len(rows) == len(kept)
    assert "streamingllm" in (out / "summary.md").read_text()
    assert "- samples: `1,2`" in (out / "summary.md").read_text()  # the rows' counts, not --samples
    with pytest.raises(ZoomKVError, match="--overwrite would discard"):
        run_eval(_cfg(out, report_only=True, overwrite=True), *tiny)
    with pytest.raises(ZoomKVError, match="no rows"):
        run_eval(_cfg(tmp_path / "empty", report_only=True), *tiny)
    assert not (tmp_path / "empty").exists()  # refused before anything is written


def test_refuses_to_mix_runs(tmp_path, tiny):
    out = tmp_path / "run"
    run_eval(_cfg(out, samples=1), *tiny)
    with pytest.raises(ZoomKVError, match="different run.*seed"):
        run_eval(_cfg(out, samples=1, seed=5), *tiny)
    run_eval(_cfg(out, samples=1, seed=5, overwrite=True), *tiny)


def _err(capsys, argv):
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    return err


def test_bad_input(capsys, tmp_path):
    base = ["eval", "--model", "tiny-llama", "--out", str(tmp_path / "o"), "--quiet"]
    err = _err(capsys, [*base, "--tasks", "niah_single_1,bogus"])
    assert "bogus" in err and "niah_multikey_3" in err and "fwe" in err
    err = _err(capsys, [*base, "--tasks", "niah_single_1", "--length", "5000"])
    assert "5000" in err and "4096" in err
    assert "missing-adapter" in _err(capsys, [*base, "--tasks", "niah_single_1", "--adapter",
                                              str(tmp_path / "missing-adapter")])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "p", "answers": ["a"]}\n{"prompt": oops}\n')
    err = _err(capsys, [*base, "--data", str(bad)])
    assert f"{bad}:2" in err and "bad JSON" in err
    assert "none is named" in _err(capsys, [*base, "--method-args", "window=3"])
    assert "valid methods" in _err(capsys, [*base, "--methods", "nope", "--budgets", "64"])
    assert "needs a budget" in _err(capsys, [*base, "--methods", "snapkv"])
    assert "too short" in _err(capsys, [*base, "--tasks", "niah_multiquery", "--length", "300"])
    assert "--out" in _err(capsys, ["eval", "--model", "tiny-llama", "--quiet"])


def test_method_variants_parse_and_refuse():
    from zoomkv.runspec import parse_runs, split_variants

    assert split_variants("quest+tail+int8") == ("quest", ["tail", "int8"])
    quest, full = parse_runs(["quest+tail+int8", "full+int4"], [], ["32"])
    assert (quest.label, quest.cache.tail_summary, quest.cache.kv_quant.bits, quest.cache.kv_quant.tiers) == (
        "quest+tail+int8", True, 8, "host")
    assert (full.label, full.cache.kv_quant.bits, full.cache.kv_quant.tiers) == ("full+int4", 4, "all")
    with pytest.raises(ZoomKVError, match=r"valid: \+tail, \+FORMAT \(int8, int4, int2"):
        split_variants("quest+fp8")
    with pytest.raises(ZoomKVError, match="one quantization"):
        split_variants("quest+int8+int4")


@pytest.mark.heavy
def test_every_method_runs_every_synthetic_task_at_128_and_512(tmp_path, tiny):
    """Each registered method (those needing a calibration profile are covered in their own files) on all
    of RULER's synthetic families at budgets 128 and 512: rows for every cell, none over budget."""
    from zoomkv.eval.tasks import SYNTHETIC_TASKS
    from zoomkv.methods import METHODS

    methods = sorted(n for n, c in METHODS.items() if c.uses_budget and not getattr(c, "needs_profile", False))
    cfg = _cfg(tmp_path / "all", methods=methods, budgets=["128", "512"], tasks=list(SYNTHETIC_TASKS),
               lengths=[700], samples=1, max_new_tokens=2)
    rows = run_eval(cfg, *tiny)
    # one row per task cell and configuration; a multi-turn task has one cell per turn
    assert len(rows) == sum(t.turns for t in SYNTHETIC_TASKS.values()) * (1 + 2 * len(methods))
    for r in rows:
        assert 0 <= r["score"] <= 100
        # (at 512 of ~700 rows, semantic_id's per-slot key variance can outweigh what it saves)
        if r["method"] != "full" and r["budget"] == "128":
            assert r["device_bytes"] < r["full_kv_bytes"], (r["method"], r["task"])
