"""The trainer's log (issue 31): ``logging`` under ``zoomkv.train`` (shown by ``zoomkv.logs``) with
``--quiet`` / ``-v``, its lines written above the progress bar rather than on its line; a warning when the launcher asked for more
processes than the run got; the ZeRO stage named, and ZeRO-3 refused before the model loads."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from zoomkv.cli import run_command
from zoomkv.errors import ConfigError
from zoomkv.train.deepspeed_engine import check_stage
from zoomkv.train.guards import launch_mismatch

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "recipes" / "tiny-llama-sekv.yaml"


def _train_in_process(tmp: Path, out: str, *flags: str) -> str:
    """``python -m zoomkv.train`` on the tiny recipe, stdout and stderr into one stream (as a terminal shows
    them); returns what was written."""
    both = io.StringIO()
    args = ["--recipe", str(TINY), *flags, f"output_dir={tmp / out}", f"teacher_cache={tmp / 'teacher'}",
            "num_samples=2", "queries_per_sample=3", "steps=3", "save_every=2", "layers_per_step=2"]
    with contextlib.redirect_stdout(both), contextlib.redirect_stderr(both):
        assert run_command("train", args, prog="python -m zoomkv.train") == 0
    return both.getvalue()


def _shown(stream: str) -> list[str]:
    """The lines a terminal ends up showing: what follows the last carriage return of each line."""
    return [line.rsplit("\r", 1)[-1].rstrip() for line in stream.split("\n")]


def test_step_lines_start_their_own_line_and_verbosity_is_a_flag(tmp_path):
    shown = _shown(_train_in_process(tmp_path, "v", "-v"))
    steps = [line for line in shown if "step 1:" in line or "step 2:" in line or "step 3:" in line]
    assert len(steps) == 3 and all(line.startswith("step ") for line in steps), steps  # not after the bar
    assert any(line.startswith("trainable parameters: ") for line in shown)
    assert any(line.startswith("adapter saved to ") for line in shown)
    # -v: where the teacher cache and each checkpoint went
    assert any(line.startswith("teacher signals in ") for line in shown)
    assert "checkpoint of step 2 written" in shown and "checkpoint of step 3 written" in shown

    quiet = _train_in_process(tmp_path, "q", "--quiet")
    assert quiet.strip() == "", quiet[-2000:]  # no info lines, no progress bars
    assert (tmp_path / "q" / "sekv-tiny" / "adapter" / "adapter_model.safetensors").is_file()

    default = _shown(_train_in_process(tmp_path, "d"))
    assert any(line.startswith("step 3:") for line in default) and "checkpoint of step 2 written" not in default


def test_a_launch_that_started_fewer_processes_than_asked_is_said():
    # accelerate launch --num_processes 2 --cpu: one process, only the rendezvous address says two were asked
    cpu_launch = {"ACCELERATE_USE_CPU": "True", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    warning = launch_mismatch(1, cpu_launch)
    assert warning and "starts one" in warning and "multi_cpu.yaml" in warning
    assert launch_mismatch(1, {"ACCELERATE_USE_CPU": "True"}) is None  # --cpu with one process: as asked
    assert launch_mismatch(2, {**cpu_launch, "WORLD_SIZE": "2"}) is None  # torchrun's two, joined
    assert "started 4 processes but this run has 1" in launch_mismatch(1, {"WORLD_SIZE": "4"})
    assert launch_mismatch(1, {}) is None and launch_mismatch(1, {"WORLD_SIZE": "1"}) is None


def _deepspeed(stage):
    config = {} if stage is None else {"zero_optimization": {"stage": stage}}
    return SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(deepspeed_config=config)))


def test_zero_3_is_refused_with_the_reason_and_the_alternative():
    check_stage(_deepspeed(1))
    check_stage(_deepspeed(2))
    with pytest.raises(ConfigError, match=r"ZeRO stage 3 is not supported.*never sits on the accelerator.*"
                                          r"use ZeRO stage 2 \(--zero_stage 2"):
        check_stage(_deepspeed(3))
    for stage in (0, None):  # DeepSpeed's plain optimiser: no ZeRO partitions for the checkpoints to gather
        with pytest.raises(ConfigError, match="stage 0 is not supported.*use --zero_stage 2"):
            check_stage(_deepspeed(stage))


@pytest.mark.heavy
def test_accelerate_launch_cpu_with_two_processes_warns_that_it_runs_one(tmp_path):
    args = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--cpu", "--num_machines",
            "1", "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "zoomkv.train", "--recipe", str(TINY),
            f"output_dir={tmp_path}", f"teacher_cache={tmp_path / 'teacher'}", "num_samples=2",
            "queries_per_sample=3", "steps=1", "save_every=1"]
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "MASTER_ADDR", "RANK")}
    done = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    warnings = [line for line in done.stderr.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 1 and "with --cpu (use_cpu) it starts one" in warnings[0], done.stderr[-3000:]
    assert "1 process(es), no, cpu" in done.stderr
