"""The runtime on an accelerator: every method on CUDA, tiers where they belong, results as on the CPU.

Skipped where no GPU is present (this repository's CI has none); ``scripts/cuda_check.sh`` runs it on a
CUDA machine. ``ZOOMKV_TEST_DEVICE=cpu`` runs the same checks on the CPU, to try the file anywhere;
``ZOOMKV_TEST_DEVICE=standin`` (with ``TRITON_INTERPRET=1``) on the CUDA stand-in, tests/cuda_standin.py: what
a GPU run would fail on, found on the CPU (tests/test_cuda_standin.py runs a selection in ``make test``).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers import greedy, max_logit_diff, padded_batch, tensors_in
from tests.method_matrix import method_kwargs
from tests.test_sync_audit import KNOWN_SYNCING
from zoomkv import ZoomCache
from zoomkv.compat import generate_cache_kwargs
from zoomkv.memory import LayerMemory
from zoomkv.memory.sync_audit import audit_decode
from zoomkv.methods import METHODS, get_method
from zoomkv.models import load_model

# ZOOMKV_TEST_DEVICE=standin: "cuda" is tests/cuda_standin.py's stand-in on the CPU (tests/test_cuda_standin.py runs
# this file so, in a process of its own that starts Triton's interpreter before Triton loads)
STANDIN = os.environ.get("ZOOMKV_TEST_DEVICE") == "standin"
DEVICE = "cuda" if STANDIN else os.environ.get("ZOOMKV_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else None)
pytestmark = pytest.mark.skipif(DEVICE is None, reason="no CUDA device (set ZOOMKV_TEST_DEVICE to force one)")


def _steps(n: int) -> int:
    """Decode steps a check runs: on the stand-in a quarter (its kernels run under Triton's interpreter, ~0.1 s a
    launch), at least 3 (a step after the one that grows the buffers)."""
    return max(3, n // 4) if STANDIN else n


@pytest.fixture(scope="module", autouse=True)
def _standin():
    """The stand-in on for the whole module (the model fixture included) when it is the device."""
    if not STANDIN:
        yield
        return
    from tests import cuda_standin

    with pytest.MonkeyPatch.context() as patch, cuda_standin.active(patch):
        yield

NEEDS_PROFILE = {name for name, cls in METHODS.items() if getattr(cls, "needs_profile", False)}
BUDGETED = sorted(name for name, cls in METHODS.items() if cls.uses_budget and name not in NEEDS_PROFILE)
RECALLABLE = sorted(n for n in BUDGETED if METHODS[n].recallable)


TINY_MODELS = ["tiny-llama", "tiny-gemma3"]  # the `tiny` fixture (conftest.py), loaded on TINY_DEVICE
TINY_DEVICE = DEVICE


@pytest.fixture(scope="module")
def tiny(tiny):
    """This file's tests take the model alone."""
    return tiny[0]


def _batch(model, lengths=(70, 52)):
    ids, mask = padded_batch(model.config.vocab_size, lengths=lengths)
    return ids.to(DEVICE), mask.to(DEVICE)


def _assert_tiers_placed(cache: ZoomCache) -> None:
    """Device tier on the model's device; host tier in CPU memory, page-locked when the device is CUDA."""
    layers = [layer for layer in cache.layers if isinstance(layer, LayerMemory)]
    assert layers
    for layer in layers:
        for t in tensors_in(dict(layer.device_tier)):
            assert t.device.type == torch.device(DEVICE).type, f"layer {layer.layer_idx}: device-tier tensor on {t.device}"
        for t in tensors_in(dict(layer.host_tier)):
            assert t.device.type == "cpu", f"layer {layer.layer_idx}: host-tier tensor on {t.device}"
            # Rows that travel to the device (float K/V, SVD factors, int8/int4 codes) must be page-locked;
            # index tensors (int64/int32/bool) are only read on the host.
            if torch.device(DEVICE).type == "cuda" and t.dtype not in (torch.int64, torch.int32, torch.bool):
                assert t.is_pinned(), f"layer {layer.layer_idx}: host tier not pinned (no async recall)"


def test_full_on_the_device_matches_the_cpu(tiny):
    ids, mask = _batch(tiny)
    on_device = greedy(tiny, ids, mask, ZoomCache(tiny, "full"))
    cpu_model, _ = load_model(tiny.zoomkv_name)
    on_cpu = greedy(cpu_model, ids.cpu(), mask.cpu(), ZoomCache(cpu_model, "full"))
    assert torch.equal(on_device.sequences.cpu(), on_cpu.sequences)
    assert max_logit_diff(on_device.scores, on_cpu.scores) < 1e-3


@pytest.mark.parametrize("name", BUDGETED)
def test_large_budget_is_exactly_full_on_the_device(tiny, name):
    ids, mask = _batch(tiny)
    ref = greedy(tiny, ids, mask, ZoomCache(tiny, "full"))
    out = greedy(tiny, ids, mask, ZoomCache(tiny, name, 4096))
    assert torch.equal(out.sequences, ref.sequences), name
    assert max_logit_diff(out.scores, ref.scores) < 1e-3, name


@pytest.mark.parametrize("name", BUDGETED)
def test_small_budget_holds_and_tiers_are_placed(tiny, name):
    ids, mask = _batch(tiny, lengths=(90, 90))
    method = get_method(name)
    budget = max(method.min_budget(), 40)
    cache = ZoomCache(tiny, method, budget)
    out = greedy(tiny, ids, mask, cache, new=_steps(24))  # the runtime raises if a step holds more than B rows
    assert out.sequences.device.type == torch.device(DEVICE).type
    _assert_tiers_placed(cache)
    report = cache.memory_report()
    zoom = [r for r in report.layers if r.kind == "zoom"]
    assert zoom and sum(r.device_bytes for r in zoom) < sum(r.full_kv_bytes for r in zoom)
    if METHODS[name].recallable:
        assert report.host_bytes > 0, f"{name} keeps everything: the host tier cannot be empty"


@pytest.mark.parametrize("name", RECALLABLE)
def test_tail_summary_on_the_device(tiny, name):
    ids, mask = _batch(tiny)
    method = get_method(name)
    cache = ZoomCache(tiny, method, max(method.min_budget() + 1, 40), tail_summary=True)
    greedy(tiny, ids, mask, cache, new=_steps(16))
    _assert_tiers_placed(cache)


@pytest.mark.parametrize("bits", ["int8", "int4"])
def test_quantized_host_tier_on_the_device(tiny, bits):
    ids, mask = _batch(tiny, lengths=(90, 90))
    plain = ZoomCache(tiny, "oracle_topk", 40)
    greedy(tiny, ids, mask, plain, new=_steps(8))
    quant = ZoomCache(tiny, "oracle_topk", 40, kv_quant=bits)
    greedy(tiny, ids, mask, quant, new=_steps(8))
    _assert_tiers_placed(quant)
    ratio = quant.memory_report().host_bytes / plain.memory_report().host_bytes
    assert ratio < (0.6 if bits == "int8" else 0.35), ratio


def test_full_with_quantized_device_tier_stays_close(tiny):
    ids, mask = _batch(tiny)
    ref = greedy(tiny, ids, mask, ZoomCache(tiny, "full"))
    out = greedy(tiny, ids, mask, ZoomCache(tiny, "full", kv_quant="int8", kv_quant_tiers="all"))
    assert max_logit_diff(out.scores[:1], ref.scores[:1]) < 0.5  # first step: same prompt, int8 keys/values


def test_bfloat16_model_runs_every_recallable_method():
    if torch.device(DEVICE).type != "cuda":
        pytest.skip("bf16 matmuls are a GPU path")
    model, _ = load_model("tiny-llama", device=DEVICE, dtype=torch.bfloat16)
    ids, mask = _batch(model, lengths=(90, 90))
    for name in RECALLABLE:
        method = get_method(name)
        cache = ZoomCache(model, method, max(method.min_budget(), 40))
        out = greedy(model, ids, mask, cache, new=_steps(8))
        assert all(torch.isfinite(s).any() for s in out.scores), name
        _assert_tiers_placed(cache)


# -- decode steps that never wait for the GPU (issue 16) ------------------------------------------------------
# tests/test_sync_audit.py holds every method's decode step to no value read back and no data-dependent shape
# on the CPU; here the same steps run under torch.cuda.set_sync_debug_mode("error"), which also raises on a
# blocking copy between host and device.
# The recallable methods keep every row in pinned host memory: a step writes its new row there by an
# asynchronous copy and reads the rows it recalls from the GPU (zoomkv.kernels.gather_rows), so nothing waits.
# Every index a step ranks and addresses (ClusterKV's cluster tables too) is on the device.


@pytest.mark.parametrize("name", sorted(set(METHODS) - KNOWN_SYNCING))
def test_decode_steps_never_synchronise_the_device(tiny, name, tmp_path):
    method = get_method(name, **method_kwargs(name, tiny, tmp_path))
    _steps_without_a_wait(tiny, ZoomCache(tiny, method, max(method.min_budget(), 40) if method.uses_budget else None))


@pytest.mark.parametrize("host_format", ["k8v4", "int4", "kivi4g64"])
def test_a_coded_host_tier_never_synchronises_the_device(tiny, host_format):
    """The quickstart adapter's host tier (keys at 8 bits, values at 4, rescored from the host keys): codes
    gathered from pinned memory by the kernel and decoded on the GPU; KIVI's keys with their open block on the
    GPU (a filled block coded there and copied out without waiting)."""
    method = get_method("sekv", rescore_from="host")
    _steps_without_a_wait(tiny, ZoomCache(tiny, method, 40, kv_quant=host_format))


@pytest.mark.parametrize("name", ["sekv", "quest"])
def test_a_coded_host_tier_within_the_budget_never_synchronises_the_device(tiny, name):
    """A context the budget holds whole: every row recalled each step, the codes decoded on the GPU (where the
    host would wait for the copies in flight and decode them all)."""
    _steps_without_a_wait(tiny, ZoomCache(tiny, name, 400, kv_quant="k8v4"), steps=4)


def test_host_tiers_in_exactly_sized_page_locked_memory_never_synchronise_the_device(tiny, monkeypatch):
    """Every host tier page-locked where it lies (zoomkv.memory.pinned; above EXACT_BYTES where it is not 0): read
    by the kernels, written by asynchronous copies, pinned as torch's own blocks are."""
    from zoomkv.memory import pinned

    monkeypatch.setattr(pinned, "EXACT_BYTES", 0)
    for name, fmt in (("sekv", "k8v4"), ("quest", None), ("sekv", "kivi4g64")):
        cache = ZoomCache(tiny, get_method(name, **({"rescore_from": "host"} if name == "sekv" else {})), 40,
                          kv_quant=fmt)
        _steps_without_a_wait(tiny, cache, steps=4)
        _assert_tiers_placed(cache)


def _steps_without_a_wait(tiny, cache: ZoomCache, lengths=(90, 61), steps: int = 12) -> None:
    steps = _steps(steps)
    if torch.device(DEVICE).type != "cuda":
        pytest.skip("torch.cuda.set_sync_debug_mode is CUDA's")
    ids, mask = _batch(tiny, lengths=lengths)
    with torch.no_grad():
        out = tiny(input_ids=ids, attention_mask=mask, **generate_cache_kwargs(cache), use_cache=True)
        for _ in range(steps):
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones_like(token)], dim=1)
            position = mask.sum(-1, keepdim=True) - 1
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                out = tiny(input_ids=token, attention_mask=mask, position_ids=position, **generate_cache_kwargs(cache),
                           use_cache=True)
            finally:
                torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(out.logits).any()


def test_the_audit_names_a_host_copy_on_the_device(tiny):
    """On a GPU the CPU audit also sees tensors cross devices: the torch path's recall (ZOOMKV_TRITON=0) moves
    the indices to the host."""
    if torch.device(DEVICE).type != "cuda":
        pytest.skip("both tiers are CPU memory without a GPU")
    ids, mask = _batch(tiny, lengths=(90, 61))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ZOOMKV_TRITON", "0")
        audits = audit_decode(tiny, ZoomCache(tiny, "quest", 40), ids, mask, steps=2)
    kinds = {e.kind for a in audits for e in a.events}
    assert "device-to-host copy" in kinds, kinds


def test_the_recall_reads_nothing_back_in_the_audit(tiny):
    ids, mask = _batch(tiny, lengths=(90, 61))
    for name in ("quest", "sekv", "oracle_topk", "clusterkv"):
        audits = audit_decode(tiny, ZoomCache(tiny, name, 40), ids, mask, steps=3)
        assert all(a.clean for a in audits), (name, [str(e) for a in audits for e in a.events])


# -- the GPU kernels, compiled (tests/test_kernels.py runs them under Triton's interpreter) ------------------
def _cuda_only():
    if torch.device(DEVICE).type != "cuda":
        pytest.skip("the compiled kernels run on CUDA")
    pytest.importorskip("triton")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.uint8])
def test_gather_rows_reads_pinned_host_memory_from_the_gpu(dtype):
    from zoomkv.kernels.gather import gather_rows, gather_rows_reference

    _cuda_only()
    src = (torch.randn(4, 8, 3000, 128) * 40).to(dtype).pin_memory()[:, :, :2900]
    idx = torch.randint(0, 2900, (4, 8, 1000), device=DEVICE)
    out = torch.full((4, 8, 1000, 128), 3, dtype=dtype, device=DEVICE)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        gather_rows(src, idx, out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(out.cpu(), gather_rows_reference(src, idx.cpu()))


def test_exactly_sized_pinned_memory_is_read_by_the_gpu_and_given_back():
    """zoomkv.memory.pinned: the bytes asked for, page-locked (is_pinned, the gather kernel reads them, a copy from
    the GPU into them runs without a host wait), unlocked and freed with their last view: torch's pinned
    allocator's cache does not grow."""
    from zoomkv.kernels.gather import gather_rows, gather_rows_reference
    from zoomkv.memory import pinned

    _cuda_only()
    shape = (2, 8, 33_024, 64)  # 67.6 MB of fp32: torch's allocator would pin 128 MiB
    stats = getattr(torch.cuda, "host_memory_stats", None)
    before = stats().get("allocated_bytes.current") if stats else None
    host = pinned.empty(shape, torch.float32)
    assert host.is_pinned() and host.shape == shape
    rows = torch.randn(shape, device=DEVICE)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        host.copy_(rows, non_blocking=True)
        idx = torch.randint(0, shape[2], (2, 8, 1000), device=DEVICE)
        out = torch.empty(2, 8, 1000, 64, device=DEVICE)
        gather_rows(host, idx, out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), gather_rows_reference(rows.cpu(), idx.cpu()))
    if stats:
        assert stats().get("allocated_bytes.current") == before  # not torch's block
    del host
    import gc
    gc.collect()
    again = pinned.empty(shape, torch.float32)  # (the first was unlocked and freed: no overlap refused)
    assert again.is_pinned()


def test_a_row_appended_asynchronously_is_recalled_by_the_next_step():
    """The append's copy into pinned memory and the kernel's read are ordered by the stream alone."""
    from zoomkv.memory.tiers import RowBuffer

    _cuda_only()
    buf = RowBuffer.empty_like(2, 4, 600, 64, dtype=torch.float32, device=torch.device("cpu"), pinned=True)
    rows = torch.randn(2, 4, 500, 64, device=DEVICE)
    for i in range(0, 500, 50):
        buf.append(rows[:, :, i : i + 50])
        idx = torch.full((2, 4, 1), i + 49, device=DEVICE)
        assert torch.equal(buf.gather(idx)[:, :, 0], rows[:, :, i + 49])
    assert torch.equal(buf.view(), rows.cpu())


@pytest.mark.parametrize("fmt", [None, "k8v4"])
def test_rows_written_at_a_count_on_the_gpu_land_in_pinned_memory(fmt):
    """``write_at``: a step's row written into pinned host memory by the gather kernel at the position a device
    count holds (what a captured step replays), read back by the next step's kernel and by the host; a per-token
    coded buffer codes it on the GPU and writes each part so."""
    from zoomkv.memory.quant import QuantizedRowBuffer, QuantSpec
    from zoomkv.memory.tiers import RowBuffer

    _cuda_only()
    rows = torch.randn(2, 4, 40, 64, device=DEVICE)
    if fmt is None:
        buf = RowBuffer.with_room(rows[:, :, :8].cpu(), 64, pinned=True)
    else:
        buf = QuantizedRowBuffer(rows[:, :, :8].cpu(), QuantSpec.parse(fmt).for_rows("keys", 0), pinned=True)
    reference = QuantizedRowBuffer(rows[:, :, :8].cpu(), QuantSpec.parse(fmt).for_rows("keys", 0)) if fmt else None
    at = torch.full((1,), 8, dtype=torch.long, device=DEVICE)
    for i in range(8, 40):
        buf.reserve(1)
        buf.write_at(rows[:, :, i : i + 1], at)
        at.add_(1)
        buf.note_written(1, from_gpu=True)
        idx = torch.full((2, 4, 1), i, device=DEVICE)
        got = buf.gather(idx)[:, :, 0]
        if reference is None:
            assert torch.equal(got.cpu(), rows[:, :, i].cpu())
        else:
            reference.append(rows[:, :, i : i + 1].cpu())
            assert torch.equal(got.cpu(), reference.view()[:, :, i])
    assert buf.length == 40
    if reference is None:
        assert torch.equal(buf.view(), rows.cpu())


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_score_codes_on_the_gpu_matches_the_byte_tables(bits, monkeypatch):
    from zoomkv.kernels import codes as kernel_codes
    from zoomkv.methods.sekv import codes

    _cuda_only()
    keys = torch.randn(4, 8, 5000, 128, device=DEVICE)
    packed, rms = codes.encode(keys, bits)
    query = torch.randn(4, 8, 4, 128, device=DEVICE)
    got = kernel_codes.score_codes(query, packed, rms, bits, codes.level_step(bits))
    monkeypatch.setenv("ZOOMKV_TRITON", "0")
    ref = codes.score_codes(query.double().float(), packed, rms, bits)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_encode_on_the_gpu_writes_the_cpus_codes(bits):
    """The encode kernel, compiled, against the torch path on the CPU: the same bytes (a coordinate on a level's
    edge may round the other way: at most one in 10^4) and RMS within fp16's step."""
    from zoomkv.kernels import encode as kernel_encode
    from zoomkv.methods.sekv import codes

    _cuda_only()
    keys = torch.randn(4, 8, 3000, 128) * 3
    got, rms = kernel_encode.encode_codes(keys.to(DEVICE), bits, codes.level_step(bits))
    ref, ref_rms = codes.encode(keys, bits)  # CPU tensors: the torch path
    assert (got.cpu() != ref).float().mean() < 1e-4
    torch.testing.assert_close(rms.cpu(), ref_rms, rtol=1e-3, atol=0)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_rows_are_coded_on_the_gpu_as_on_the_cpu(bits):
    """The per-token quantize kernel, compiled, against quantize's torch path on the CPU: the same codes,
    scales and minimums."""
    from zoomkv.memory import quant

    _cuda_only()
    rows = torch.randn(4, 8, 3000, 128) * torch.rand(4, 8, 3000, 1) * 5
    got = quant.quantize(rows.to(DEVICE), bits, 32)
    ref = quant.quantize(rows, bits, 32)  # CPU tensors: the torch path
    for a, r in zip(got, ref, strict=True):
        assert torch.equal(a.cpu(), r)


@pytest.mark.parametrize("fmt", ["int8", "int4", "k8v4"])
def test_a_coded_host_tier_is_decoded_on_the_gpu_as_on_the_cpu(fmt):
    """The dequantizing recall kernel, compiled: pinned codes read by GPU indices, decoded into slots, no host
    wait; the rows the CPU's torch path decodes (within one ulp of fp32: the GPU may fuse the multiply-add)."""
    from zoomkv.memory.quant import QuantSpec, row_buffer

    _cuda_only()
    rows = torch.randn(4, 8, 3000, 128) * 3
    pinned = row_buffer(rows, QuantSpec.parse(fmt).for_rows("values"), pinned=True)
    on_cpu = row_buffer(rows, QuantSpec.parse(fmt).for_rows("values"))
    idx = torch.stack([torch.randperm(3000)[:1000] for _ in range(32)]).view(4, 8, 1000)
    dest = torch.stack([torch.randperm(1000) for _ in range(32)]).view(4, 8, 1000)
    fetch = torch.rand(4, 8, 1000) < 0.3
    out = torch.zeros(4, 8, 1000, 128, device=DEVICE)
    ref = torch.zeros(4, 8, 1000, 128)
    on_device = [t.to(DEVICE) for t in (idx, dest, fetch)]  # (a blocking copy is a wait: before the check)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        pinned.gather_to_slots(*on_device, out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    on_cpu.gather_to_slots(idx, dest, fetch, ref)
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_tail_row_on_the_gpu_is_the_cpus(dtype):
    """The softmax tail's kernel, compiled, against with_tail's torch path on the CPU (padding, a merged row)."""
    from types import SimpleNamespace

    from zoomkv.memory.tail import with_tail
    from zoomkv.protocol.method import Selection

    _cuda_only()
    every = torch.randn(2, 8, 4000, 128), torch.randn(2, 8, 4000, 128)
    bias = torch.zeros(2, 8, 1000)
    bias[0, :, :7] = float("-inf")
    bias[1, 3, 5] = 2.0
    sel = [t[:, :, 500:1500] for t in every]

    def tail(device):
        tier = {"tail_key_sum": every[0].sum(2, keepdim=True).to(device),
                "tail_value_sum": every[1].sum(2, keepdim=True).to(device),
                "tail_count": torch.full((2, 8, 1), 4000.0, device=device)}
        picked = Selection(*(t.to(device, dtype) for t in sel), bias.to(device, dtype))
        return with_tail(SimpleNamespace(device_tier=tier), picked, offset=torch.linspace(-1, 1, 8, device=device))

    got, ref = tail(DEVICE), tail("cpu")
    tol = {"rtol": 1e-4, "atol": 1e-4} if dtype is torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    for a, r in zip((got.keys, got.values, got.bias), (ref.keys, ref.values, ref.bias), strict=True):
        torch.testing.assert_close(a.cpu(), r, **tol)


@pytest.mark.parametrize("name", ["sekv", "quest", "oracle_topk", "streamingllm"])
def test_the_gpu_step_selects_what_the_cpu_step_selects(tiny, name):
    """The same greedy tokens from the GPU's step (torch ops and Triton kernels) as from the CPU's (the
    compiled CPU step for sekv), on a padded batch at a small budget."""
    ids, mask = _batch(tiny, lengths=(90, 61))
    on_device = greedy(tiny, ids, mask, ZoomCache(tiny, name, 40), new=_steps(12))
    cpu_model, _ = load_model(tiny.zoomkv_name)
    on_cpu = greedy(cpu_model, ids.cpu(), mask.cpu(), ZoomCache(cpu_model, name, 40), new=_steps(12))
    assert torch.equal(on_device.sequences.cpu(), on_cpu.sequences), name


@pytest.mark.parametrize("name", ["sekv", "quest", "oracle_topk"])
def test_reading_only_the_missed_rows_gives_the_tokens_of_reading_every_row(tiny, name):
    """On a GPU the recall reads only the rows its buffer misses (the kernel skips the others); the same greedy
    tokens as reading every row each step."""
    from zoomkv.protocol.recallable import recall_misses_only

    ids, mask = _batch(tiny, lengths=(90, 61))
    runs = []
    for on in (True, False):
        with recall_misses_only(on):
            runs.append(greedy(tiny, ids, mask, ZoomCache(tiny, name, 40), new=_steps(12)))
    assert torch.equal(runs[0].sequences, runs[1].sequences), name


def test_a_trained_hash_selects_on_the_gpu_what_it_selects_on_the_cpu(tiny):
    """sekv's trained hash index (one format for both devices): the GPU's torch step and Triton scorer give the
    greedy tokens of the compiled CPU step."""
    from zoomkv.methods.sekv.method import SeKV
    from zoomkv.methods.sekv.modules import SeKVAdapter
    from zoomkv.protocol.shape import ModelShape

    cfg = tiny.config
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    torch.manual_seed(0)
    layers = len(ModelShape.from_config(cfg).full_attention_layers)  # the layers sekv compresses (not sliding ones)
    adapter = SeKVAdapter(layers, cfg.num_key_value_heads, d, hash_bits=8)
    with torch.no_grad():
        adapter.hash_key.add_(torch.randn_like(adapter.hash_key) * 0.1)
        adapter.hash_query.mul_(1.5)
    ids, mask = _batch(tiny, lengths=(90, 61))
    on_device = greedy(tiny, ids, mask, ZoomCache(tiny, SeKV(adapter=adapter), 40), new=_steps(12))
    cpu_model, _ = load_model(tiny.zoomkv_name)
    on_cpu = greedy(cpu_model, ids.cpu(), mask.cpu(), ZoomCache(cpu_model, SeKV(adapter=adapter), 40), new=_steps(12))
    assert torch.equal(on_device.sequences.cpu(), on_cpu.sequences)


def test_a_fitted_index_selects_on_the_gpu_what_it_selects_on_the_cpu(tiny):
    """sekv's ``fit_bits`` (codes fitted to each context at the prefill, from the query moment the runtime keeps):
    the GPU's fit, torch step and Triton scorers give the greedy tokens of the compiled CPU step."""
    from zoomkv.methods.sekv.method import SeKV

    cfg = tiny.config
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    ids, mask = _batch(tiny, lengths=(300, 220))
    on_device = greedy(tiny, ids, mask, ZoomCache(tiny, SeKV(fit_bits=d), 40), new=_steps(12))
    cpu_model, _ = load_model(tiny.zoomkv_name)
    on_cpu = greedy(cpu_model, ids.cpu(), mask.cpu(), ZoomCache(cpu_model, SeKV(fit_bits=d), 40), new=_steps(12))
    assert torch.equal(on_device.sequences.cpu(), on_cpu.sequences)


# -- a decode step's selection as a CUDA graph (zoomkv.memory.graphs; tests/test_graphs.py emulates it on the CPU) --
# 400 and 290 tokens at B=40: more rows than sekv's stage one keeps (156), so its step has fixed shapes
GRAPH_CASES = {"codes-rescoring": ("sekv", {}, None), "quickstart-shape": ("sekv", {"rescore_from": "host"}, "k8v4"),
               "fitted-index": ("sekv", {"fit_bits": 16, "rescore_from": "host"}, "k8v4"), "quest": ("quest", {}, None)}


@pytest.mark.parametrize("mode", ["1", "step"])  # whole decoder layers (the default), or the cache's steps alone
@pytest.mark.parametrize("case", list(GRAPH_CASES))
def test_a_captured_step_gives_the_tokens_of_a_step_run_as_it_is(tiny, case, mode, monkeypatch):
    """sekv's and Quest's decode steps captured in CUDA graphs per layer and replayed: the greedy tokens of the same
    model with graphs off (``ZOOMKV_CUDA_GRAPHS=0``: the step as it ran before graphs)."""
    from zoomkv.memory import graphs

    if torch.device(DEVICE).type != "cuda" or STANDIN:
        pytest.skip("CUDA graphs are CUDA's (tests/test_graphs.py emulates them on the CPU)")
    name, kwargs, host_format = GRAPH_CASES[case]
    ids, mask = _batch(tiny, lengths=(400, 290))

    def run():
        return greedy(tiny, ids, mask, ZoomCache(tiny, get_method(name, **kwargs), 40, kv_quant=host_format), new=24)

    monkeypatch.setenv("ZOOMKV_CUDA_GRAPHS", mode)
    before = graphs.counts()
    captured = run()
    after = graphs.counts()
    assert (after["layer_captures"] > before["layer_captures"]) == (mode == "1")
    monkeypatch.setenv("ZOOMKV_CUDA_GRAPHS", "0")
    plain = run()
    assert after["captures"] > before["captures"] and after["replays"] > before["replays"], (before, after)
    assert torch.equal(captured.sequences, plain.sequences)
    assert max_logit_diff(captured.scores, plain.scores) < 1e-3


@pytest.mark.parametrize("mode", ["1", "step"])
@pytest.mark.parametrize("case", list(GRAPH_CASES))
def test_captured_steps_never_synchronise_the_device(tiny, case, mode, monkeypatch):
    """The steps that capture and replay, under ``set_sync_debug_mode("error")``."""
    if STANDIN:
        pytest.skip("CUDA graphs are CUDA's (the stand-in runs with them off)")
    monkeypatch.setenv("ZOOMKV_CUDA_GRAPHS", mode)
    name, kwargs, host_format = GRAPH_CASES[case]
    cache = ZoomCache(tiny, get_method(name, **kwargs), 40, kv_quant=host_format)
    _steps_without_a_wait(tiny, cache, lengths=(400, 290), steps=8)
