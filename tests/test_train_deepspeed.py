"""DeepSpeed ZeRO-2 under the trainer, on DeepSpeed's CPU accelerator (DS_ACCELERATOR=cpu, gloo), with
1 and 2 processes started by ``accelerate launch --config_file recipes/accelerate/deepspeed_zero2_cpu.yaml``:
the run finishes, writes the adapter and checkpoints in the trainer's own format, resumes after SIGKILL,
and trains the adapter a plain run with the same global batch trains (bitwise on the machine this was
written on while clipping does not engage; asserted to float tolerance). The first DeepSpeed run on a
machine JIT-compiles DeepSpeed's shared-memory comm op (C++, ~45 s, cached in ~/.cache/torch_extensions)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install 'zoomkv[deepspeed]')")
pytestmark = pytest.mark.heavy  # launcher subprocesses; the first compiles DeepSpeed's comm op

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "recipes" / "tiny-llama-sekv.yaml"
CONFIG = ROOT / "recipes" / "accelerate" / "deepspeed_zero2_cpu.yaml"
# CPU everywhere, so the DeepSpeed runs and the plain one compute alike even on a GPU host
ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}


def _train(tmp: Path, out: str, *extra: str, processes: int | None = None,
           launch: list[str] | tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    launch = [] if processes is None else ["-m", "accelerate.commands.launch", "--config_file", str(CONFIG),
                                           "--num_processes", str(processes), *launch]
    args = [sys.executable, *launch, "-m", "zoomkv.train", "--recipe", str(TINY), f"output_dir={tmp / out}",
            f"teacher_cache={tmp / 'teacher'}", "num_samples=2", "queries_per_sample=3", "steps=4", "save_every=2",
            *extra]
    return subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=900, env=ENV)


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "adapter_model.safetensors")


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=1e-5, msg=name)


def test_zero2_one_and_two_processes_train_what_a_plain_run_trains(tmp_path):
    # the reference: one plain process, 2 samples a step
    plain = _train(tmp_path, "plain", "samples_per_step=2")
    assert plain.returncode == 0, plain.stderr[-3000:]
    reference = _weights(tmp_path / "plain" / "sekv-tiny" / "adapter")

    # 1 DeepSpeed process accumulating the 2 samples; SIGKILLed at step 3, resumed from the step-2 checkpoint
    killed = _train(tmp_path, "one", "samples_per_step=2", "kill_at_step=3", processes=1)
    assert killed.returncode != 0 and "1 process(es), deepspeed ZeRO-2, cpu" in killed.stderr, killed.stderr[-3000:]
    run = tmp_path / "one" / "sekv-tiny"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000002"]
    # the checkpoint holds AdamW's moments per parameter, as a plain run's does (ZeRO's partitions gathered)
    step2 = tmp_path / "plain" / "sekv-tiny" / "checkpoints" / "step_000002"
    _assert_same(load_file(run / "checkpoints" / "step_000002" / "optimizer.safetensors"),
                 load_file(step2 / "optimizer.safetensors"))
    resumed = _train(tmp_path, "one", "samples_per_step=2", "resume=latest", processes=1)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr and "adapter saved to" in resumed.stderr
    _assert_same(_weights(run / "adapter"), reference)

    # 2 DeepSpeed processes, 1 sample each: ZeRO-2 partitions the gradients and moments over the two
    two = _train(tmp_path, "two", processes=2)
    assert two.returncode == 0, two.stderr[-3000:]
    assert "2 process(es), deepspeed ZeRO-2, cpu" in two.stderr
    assert "all 2 processes hold the same adapter" in two.stderr
    assert (tmp_path / "two" / "sekv-tiny" / "checkpoints" / "step_000004" / "DONE").is_file()
    _assert_same(_weights(tmp_path / "two" / "sekv-tiny" / "adapter"), reference)


def test_zero3_is_refused_before_the_model_loads(tmp_path):
    """``--zero_stage 3`` once failed deep in the model's load ("num_parameters ... got 0": ZeRO-3 had
    partitioned the frozen base); the trainer's process exits with one line naming the reason and ZeRO-2
    (the launcher then reports its child's exit status 2 in its own words), and nothing is written."""
    done = _train(tmp_path, "z3", processes=1, launch=["--zero_stage", "3"])
    assert done.returncode != 0 and "(exitcode: 2)" in done.stderr, done.stderr[-3000:]
    err = [line for line in done.stderr.splitlines() if line.startswith("python -m zoomkv.train: error:")]
    assert len(err) == 1 and "ZeRO stage 3 is not supported" in err[0] and "--zero_stage 2" in err[0], err
    assert "num_parameters" not in done.stderr
    assert not (tmp_path / "z3").exists()
