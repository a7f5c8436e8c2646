"""`zoomkv eval` under a multi-process launcher: two gloo CPU processes (torchrun; accelerate launch with the
repository's multi-CPU config) share the prompts and the merged rows are those of one process; a killed run
resumes per shard; a resumed run with nothing left to do loads no model; run.json's haystack."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zoomkv.cli import main
from zoomkv.eval.rows import PART_GLOB, part_name, row_key

REPO = Path(__file__).resolve().parent.parent
TIMING = {"prefill_s", "decode_ms_per_token"}  # wall-clock: never equal between two runs
ARGS = ["eval", "--model", "tiny-llama", "--methods", "streamingllm,snapkv", "--budgets", "48",
        "--tasks", "niah_single_1,niah_multiturn", "--length", "800", "--samples", "3", "--max-new-tokens", "3",
        "--no-plots", "--threads", "1"]


def _rows(out: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING}
            for line in (out / "rows.jsonl").read_text().splitlines()]


def _launch(launcher: list[str], out: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([*launcher, "-m", "zoomkv", *ARGS, "--out", str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("one") / "run"
    assert main([*ARGS, "--out", str(out), "--quiet"]) == 0
    return out


@pytest.mark.heavy
def test_two_processes_give_the_rows_of_one(one_process, tmp_path):
    """torchrun --nproc_per_node 2: the merged rows.jsonl is the one-process run's, row for row and in the same
    order (timings aside); no part file is left; the summary says two processes ran; only the main process
    prints the summary."""
    out = tmp_path / "run"
    done = _launch([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"], out)
    assert _rows(out) == _rows(one_process)
    assert not list(out.glob(PART_GLOB))
    summary = (out / "summary.md").read_text()
    assert "- processes: `2`" in summary and "- processes: `1`" in (one_process / "summary.md").read_text()
    assert done.stdout.count("# zoomkv eval: tiny-llama") == 1
    scores = [{k: s[k] for k in ("config", "budget", "score", "interval95", "device_ratio", "host_ratio")}
              for s in json.loads((out / "summary.json").read_text())["summary"]]
    assert scores == [{k: s[k] for k in ("config", "budget", "score", "interval95", "device_ratio", "host_ratio")}
                      for s in json.loads((one_process / "summary.json").read_text())["summary"]]


@pytest.mark.heavy
def test_a_killed_sharded_run_resumes_per_shard(one_process, tmp_path):
    """What a kill leaves: rank 1's part file with its first batch done and a torn last line, rank 0's with
    nothing. accelerate launch (the multi-CPU config) runs only what is missing: the kept rows are not redone
    (their marked predictions survive) and the merge equals the one-process run."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "run.json").write_text((one_process / "run.json").read_text())
    rows = [json.loads(line) for line in (one_process / "rows.jsonl").read_text().splitlines()]
    # batch 1 of the plan (niah_single_1, sample 1) is rank 1's: its rows, marked
    kept = [{**r, "prefill_s": -1.0} for r in rows if r["task"] == "niah_single_1" and r["sample"] == 1]
    (out / part_name(1)).write_text("".join(json.dumps(r) + "\n" for r in kept) + '{"method": "full", "ta')
    _launch([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(REPO / "recipes/accelerate/multi_cpu.yaml")], out)
    merged = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    assert {row_key(r) for r in merged if r["prefill_s"] == -1.0} == {row_key(r) for r in kept}  # not redone
    assert len(merged) == len(rows) and not list(out.glob(PART_GLOB))
    assert sorted(map(json.dumps, _rows(out))) == sorted(map(json.dumps, _rows(one_process)))


def test_nothing_left_to_do_loads_no_model(one_process, tmp_path, monkeypatch, capsys):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(one_process, out)
    import zoomkv.models

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(zoomkv.models, "load_model", refuse)
    assert main([*ARGS, "--out", str(out)]) == 0
    printed = capsys.readouterr()
    assert "nothing left to do" in printed.err and "# zoomkv eval: tiny-llama" in printed.out
    assert _rows(out) == _rows(one_process)
    with pytest.raises(AssertionError, match="loaded"):  # one more sample is work: the model loads
        more = list(ARGS)
        more[more.index("--samples") + 1] = "4"
        main([*more, "--out", str(out), "--quiet"])


def test_run_json_records_the_haystack_only_when_a_task_reads_it(tmp_path):
    from zoomkv.eval.harness import EvalConfig, run_eval
    from zoomkv.models import load_model

    tiny = load_model("tiny-llama")
    out = tmp_path / "run"
    cfg = dict(model="tiny-llama", out=out, methods=["full"], tasks=["niah_single_1"], lengths=[800], samples=1,
               max_new_tokens=2, progress=False, plots=False, haystack="python-docs")
    rows = run_eval(EvalConfig(**cfg), *tiny)
    assert {r["haystack"] for r in rows} == {"noise"} and "haystack" not in json.loads((out / "run.json").read_text())
    rows = run_eval(EvalConfig(**{**cfg, "tasks": ["niah_single_1", "niah_single_2"]}), *tiny)
    assert json.loads((out / "run.json").read_text())["haystack"] == "python-docs"
    assert {r["haystack"] for r in rows} == {"noise", "prose (python-docs)"}


@pytest.mark.heavy
def test_calibrate_compresskv_shares_its_prompts(tmp_path):
    """`zoomkv calibrate compresskv` under torchrun with two processes: each decodes every other passkey prompt,
    and the main process writes the profile one process writes, bit for bit."""
    calibrate = ["calibrate", "compresskv", "--model", "tiny-llama", "--samples", "4", "--length", "300",
                 "--error-budget", "32", "--accept-all"]
    assert main([*calibrate, "--out", str(tmp_path / "one.json"), "--quiet"]) == 0
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "zoomkv",
                           *calibrate, "--out", str(tmp_path / "two.json")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "two.json").read_text() == (tmp_path / "one.json").read_text()
    assert done.stdout.count("compresskv profile for tiny-llama (4/4 samples used)") == 1
    assert "2 processes share the prompts" in done.stderr
