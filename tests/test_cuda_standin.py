"""The GPU's code paths on a CPU machine: tests/test_cuda.py on the CUDA stand-in (tests/cuda_standin.py).

The stand-in's own rules are held here first (each a way a GPU run fails that a CPU run does not show), then
tests/test_cuda.py's checks run on it. Both in a child process (``ZOOMKV_TEST_DEVICE=standin``): the stand-in
registers a device guard for CUDA in the process that runs it, and the kernels need Triton's interpreter on
before Triton is first imported.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests import cuda_standin

ROOT = Path(__file__).resolve().parent.parent
IN_STANDIN = os.environ.get("ZOOMKV_TEST_DEVICE") == "standin"

# tests/test_cuda.py's checks the stand-in runs in `make test`, on tiny-llama (tiny-gemma3's layout runs the same
# code), in two processes at once: ~2 minutes of the ~30 the whole file takes here (its kernels run under Triton's
# interpreter, ~0.1 s a launch). `ZOOMKV_TEST_DEVICE=standin TRITON_INTERPRET=1 pytest tests/test_cuda.py` runs it all.
SELECTIONS = (  # (about as long each: ~100 s)
    "standin_runs_a_trained_adapter or standin_trains_on or (tiny-llama and (test_decode_steps_never_synchronise_the"
    "_device or test_a_fitted_index_selects_on_the_gpu or test_tail_summary_on_the_device))",
    "(standin_ and not (standin_runs_a_trained_adapter or standin_trains_on)) or (tiny-llama and"
    " (test_full_on_the_device_matches_the_cpu or test_small_budget_holds_and_tiers_are"
    " or test_the_gpu_step_selects_what_the_cpu_step"
    " or (test_a_coded_host_tier_never_synchronises_the_device and k8v4)"
    " or (within_the_budget_never_synchronises and sekv)))",
)


@pytest.mark.skipif(IN_STANDIN or torch.cuda.is_available(), reason="the driver runs the children")
def test_the_standins_rules_and_the_gpu_checks_hold_on_it():
    pytest.importorskip("triton")
    env = {**os.environ, "ZOOMKV_TEST_DEVICE": "standin", "TRITON_INTERPRET": "1"}
    # asked in a child too: a device guard for CUDA registered in this process would stay for every later test (a
    # forked child of tests/test_user_files.py then fails)
    probe = subprocess.run([sys.executable, "-c", "from tests import cuda_standin; assert cuda_standin.available()"],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if probe.returncode:
        pytest.skip(f"the stand-in needs a CPU-only torch and a C++ compiler for its device guard: {probe.stderr[-300:]}")
    children = [subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
                                  "tests/test_cuda.py", "-k", selection], cwd=ROOT, env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                for selection in SELECTIONS]
    for child in children:
        out, _ = child.communicate(timeout=1500)
        assert child.returncode == 0, out[-8000:]
        assert " passed" in out.splitlines()[-1], out[-2000:]


# -- the stand-in's rules (in the child) ------------------------------------------------------------------------
standin_only = pytest.mark.skipif(not IN_STANDIN, reason="runs in the stand-in's child process")


@pytest.fixture
def standin(monkeypatch):
    with cuda_standin.active(monkeypatch):
        cuda_standin.reset()
        yield


@standin_only
def test_standin_tensors_say_cuda_and_compute_as_the_cpu(standin):
    x = torch.arange(12.0).view(3, 4)
    on = x.to("cuda")
    assert on.is_cuda and on.device == torch.device("cuda", 0) and not x.is_cuda
    y = (on * 2 + 1)[:, 1:]
    y.add_(1)
    assert y.is_cuda and torch.equal(y.cpu(), (x * 2 + 2)[:, 1:])
    assert torch.zeros(2, device="cuda").is_cuda and torch.tensor([1, 2], device="cuda").is_cuda


@standin_only
def test_standin_refuses_a_cpu_tensor_beside_a_cuda_one(standin):
    on = torch.ones(4, device="cuda")
    with pytest.raises(RuntimeError, match="same device"):
        on.masked_fill(torch.ones(4, dtype=torch.bool), 0.0)  # the mask GPU run e123a67 failed on
    assert (on + torch.tensor(2.0)).is_cuda  # a 0-dim CPU tensor is a scalar, as on CUDA
    assert on[torch.tensor([0, 2])].shape == (2,)  # indices on the host are moved
    with pytest.raises(RuntimeError, match="indices"):
        torch.ones(4)[torch.tensor([0, 2], device="cuda")]


@standin_only
def test_standin_counts_what_waits_for_the_gpu_and_raises_in_error_mode(standin):
    on = torch.arange(6.0, device="cuda")
    host = torch.empty(6)
    pinned = torch.empty(6, pin_memory=True)
    assert pinned.is_pinned() and not host.is_pinned() and not torch.empty(6, device="cuda").is_pinned()
    assert on.sum().item() == 15.0 and len(cuda_standin.syncs()) == 1
    pinned.copy_(on, non_blocking=True)  # asynchronous: no wait
    assert len(cuda_standin.syncs()) == 1
    torch.cuda.synchronize()
    cuda_standin.reset()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for waits in (lambda: on.max().item(), lambda: torch.nonzero(on), lambda: on[on > 2], lambda: on.cpu(),
                      lambda: host.copy_(on, non_blocking=True), lambda: bool(on[0]), lambda: on.tolist(),
                      torch.cuda.synchronize):
            with pytest.raises(RuntimeError, match="synchronizing"):
                waits()
        on.topk(2), pinned.copy_(on, non_blocking=True), on.to("cpu", non_blocking=True)  # none of these waits
    finally:
        torch.cuda.set_sync_debug_mode("default")


@standin_only
def test_standin_refuses_the_host_reading_rows_a_copy_is_still_writing(standin):
    on = torch.arange(8.0, device="cuda")
    pinned = torch.zeros(16, pin_memory=True)
    pinned[:8].copy_(on, non_blocking=True)
    pinned[8:].fill_(1.0)  # other bytes: the host may write them
    assert pinned[8:].sum().item() == 8.0
    with pytest.raises(cuda_standin.RaceError):
        pinned[:8].sum()
    back = torch.empty(8, device="cuda")
    back.copy_(pinned[:8], non_blocking=True)  # the GPU reads it in stream order
    torch.cuda.synchronize()
    assert torch.equal(pinned[:8], torch.arange(8.0)) and torch.equal(back.cpu(), torch.arange(8.0))


@standin_only
def test_standin_counts_device_memory_as_cudas_allocator(standin):
    """Each device storage counts once while it lives, in 512-byte blocks; views and host memory do not count;
    the peak since the last reset, and the lines behind it."""
    base = torch.cuda.memory_allocated()
    cuda_standin.trace(True)
    x = torch.zeros(1000, device="cuda")  # 4,000 bytes: 4,096 allocated
    views = (x[10:], x.view(10, 100), x.unsqueeze(0))
    torch.ones(3000).pin_memory()
    assert torch.cuda.memory_allocated() == base + 4096
    torch.cuda.reset_peak_memory_stats()
    doubled = x * 2  # a second 4,096
    del doubled
    assert torch.cuda.memory_allocated() == base + 4096 and torch.cuda.max_memory_allocated() == base + 8192
    peak = cuda_standin.peak_by_location()
    assert sum(peak.values()) == base + 8192
    assert any(line.startswith("tests/test_cuda_standin.py:") and size == 4096 for line, size in peak.items()), peak
    del x, views
    assert torch.cuda.memory_allocated() == base


@standin_only
def test_standin_runs_a_kernel_where_a_gpu_runs_it(standin):
    from zoomkv import kernels
    from zoomkv.kernels.gather import gather_rows, gather_rows_reference

    host = torch.randn(2, 3, 50, 8).pin_memory()
    idx = torch.randint(0, 50, (2, 3, 7), device="cuda")
    before = kernels.launches()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = gather_rows(host, idx)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert kernels.launches() == before + 1 and out.is_cuda
    assert torch.equal(out.cpu(), gather_rows_reference(host.cpu(), idx.cpu()))


@standin_only
def test_standin_runs_the_gpu_benchmark(standin, monkeypatch, capsys):
    """``zoomkv bench --device cuda`` (what ``scripts/cuda_check.sh`` runs first on a GPU): the hf row, the methods'
    timed runs, ``--profile``'s synchronised phases and ``--sync-audit`` on CUDA tensors; the decode steps of sekv
    and Quest wait for nothing; the CUDA peak column is the device memory the stand-in counts. The runtime calls
    torch makes on a GPU answer as a GPU's would (one device, its name and size)."""
    import json

    sys.path.insert(0, str(ROOT / "scripts"))
    import standin_bench

    rc = standin_bench.bench_on_standin(
        monkeypatch, ["--model", "tiny-llama", "--device", "cuda", "--length", "300", "--new-tokens", "4",
                      "--repeats", "1", "--no-warmup", "--methods", "full,sekv,quest", "--budgets", "40", "--profile",
                      "--sync-audit", "--json"], peak_lines=3)
    out = capsys.readouterr().out
    assert rc == 0, out
    rows = {r["method"]: r for r in json.loads(out)["rows"]}
    assert set(rows) == {"hf", "full", "sekv", "quest"}, sorted(rows)
    assert json.loads(out)["device"] == "cuda:0"
    for method, row in rows.items():
        assert row["syncs_per_step"] == 0, (method, row.get("sync_events"))
        assert row["decode_hf_ratio"] > 0 and (method == "hf" or row["profile_ms"]["step"] > 0), row
    assert rows["sekv"]["host_bytes"] > 0 and rows["sekv"]["device_bytes"] < rows["full"]["device_bytes"]
    # the device memory the stand-in counted: sekv's prompt rows leave the device during the prefill
    assert all(row["cuda_peak_bytes"] > 0 for row in rows.values())
    assert rows["sekv"]["cuda_peak_bytes"] < min(rows["full"]["cuda_peak_bytes"], rows["hf"]["cuda_peak_bytes"])
    # and which lines allocated each run's peak (scripts/standin_bench.py): full's own rows among full's
    assert all(len(row["cuda_peak_lines"]) == 3 for row in rows.values())
    assert any(line.startswith("zoomkv/memory/tiers.py") for line in rows["full"]["cuda_peak_lines"]), rows["full"]


@standin_only
@pytest.mark.parametrize(("recipe", "options", "waits"), [
    ("tiny-llama-sekv.yaml", [], 4),
    ("tiny-llama-semantic-id.yaml", [], 3),
    ("tiny-llama-semantic-id.yaml", ["loss=neighbours", "design=pca_correction"], 3),
])
def test_standin_trains_on_the_gpu(standin, monkeypatch, tmp_path, recipe, options, waits):
    """``zoomkv train`` with the accelerator on the GPU (what ``scripts/cuda_check.sh`` times there): the teacher
    signals are extracted on the device and saved from the host, each micro-batch's sample goes to the adapter's
    device, the method's objective's loss is computed there, the report, the held-out scores and the export read the
    trained adapter there.
    A step waits for the GPU only where it needs numbers: the guard before the update and the one after it, the
    step's logs, sekv's integer layer budgets; the sample is read from disk while the step before trains, and its
    copies are queued from pinned memory (sekv's step waited 41 times, semantic_id's 60, and the listwise loss put
    a CPU mask on the GPU's tensors). The first step also copies sekv's constant tables, once. Autograd's engine
    and the optimiser's step ask torch for a real accelerator, which the stand-in is not: the backward and the
    update are left out (their gradients are the CPU's, tests/test_train.py)."""
    import accelerate

    import zoomkv.train.loop as loop
    from zoomkv.cli import run_command
    from zoomkv.models import load_model
    from zoomkv.train import teacher

    cuda_standin.as_gpu(monkeypatch)
    losses: list[torch.device] = []
    monkeypatch.setattr(accelerate.Accelerator, "backward", lambda self, loss, **kwargs: losses.append(loss.device))
    monkeypatch.setattr(accelerate.optimizer.AcceleratedOptimizer, "step", lambda self, closure=None: None)
    step_waits: list[list[str]] = []

    def counted(*args, **kwargs):
        cuda_standin.reset()
        out = real_step(*args, **kwargs)
        step_waits.append(cuda_standin.syncs())
        return out

    real_step = loop.train_step
    monkeypatch.setattr(loop, "train_step", counted)
    readers: list[teacher.SampleReader] = []

    class Noted(teacher.SampleReader):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            readers.append(self)

    monkeypatch.setattr(loop, "SampleReader", Noted)
    model, tokenizer = load_model("tiny-llama")
    shape = tmp_path / "shape"
    model.config.save_pretrained(shape)
    tokenizer.save_pretrained(shape)
    # accelerate keeps its device for the process: a later run on the CPU starts from a fresh state
    monkeypatch.setattr(accelerate.state.AcceleratorState, "_shared_state", {})
    monkeypatch.setattr(accelerate.state.PartialState, "_shared_state", {})
    monkeypatch.setattr(accelerate.state.GradientState, "_shared_state", {})
    code = run_command("train", ["--recipe", str(ROOT / "recipes" / recipe), f"model={shape}",
                                 "random_weights=true", "dtype=bfloat16", f"output_dir={tmp_path / 'out'}",
                                 "num_samples=2", "queries_per_sample=2", "steps=2", "layers_per_step=2",
                                 "eval_samples=1", "tensorboard=false", *options], prog="python -m zoomkv.train")
    assert code == 0
    assert losses and set(losses) == {torch.device("cuda", 0)}, losses
    assert len(step_waits) == 2 and len(step_waits[1]) == waits, step_waits
    assert readers[0].ahead_used == 1  # the second step's sample, read while the first trained
    assert len(list((tmp_path / "out").glob("*/adapter/adapter_model.safetensors"))) == 1
    assert len(list((tmp_path / "out").glob("*/eval.json"))) == 1  # the held-out scores, computed on the GPU


@standin_only
def test_standin_runs_a_trained_adapter_as_the_readme_does(standin, monkeypatch, tmp_path, capsys):
    """The README's snippet on the GPU: a trained sekv adapter's cache on a model on CUDA (its modules follow the
    model there) gives the CPU's greedy tokens; so does ``zoomkv generate --device cuda`` prefilling in chunks."""
    import json

    from zoomkv.adapters import cache_from_adapter
    from zoomkv.cli import run_command
    from zoomkv.compat import generate_cache_kwargs
    from zoomkv.models import load_model

    with cuda_standin.off():  # trained on the CPU
        assert run_command("train", ["--recipe", str(ROOT / "recipes" / "tiny-llama-sekv.yaml"),
                                     f"output_dir={tmp_path}", "num_samples=2", "queries_per_sample=2", "steps=2",
                                     "eval_samples=0", "tensorboard=false"], prog="python -m zoomkv.train") == 0
    adapter = str(next(tmp_path.glob("*/adapter")))
    text = "The archive keeps every letter. " * 10

    def tokens(device: str) -> list[int]:
        model, tokenizer = load_model("tiny-llama", device=device)
        cache = cache_from_adapter(model, adapter, budget=32)
        inputs = tokenizer([text], return_tensors="pt").to(device)
        out = model.generate(**inputs, max_new_tokens=6, do_sample=False, **generate_cache_kwargs(cache))
        return out[0, inputs["input_ids"].shape[1]:].tolist()

    def generated(device: str) -> str:
        capsys.readouterr()
        assert run_command("generate", ["--model", "tiny-llama", "--device", device, "--adapter", adapter, "--budget",
                                        "32", "--prompt", text, "--max-new-tokens", "4", "--prefill-chunk", "64",
                                        "--chat", "off", "--json"], prog="zoomkv generate") == 0
        return json.loads(capsys.readouterr().out)["text"]

    with cuda_standin.off():
        on_cpu = tokens("cpu"), generated("cpu")
    cuda_standin.as_gpu(monkeypatch)  # (the command line asks torch for a GPU first)
    assert (tokens("cuda"), generated("cuda")) == on_cpu
