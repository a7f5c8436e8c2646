"""The Triton kernels against their torch references, run by Triton's interpreter on the CPU.

``TRITON_INTERPRET=1`` runs a kernel's program instances with numpy on CPU tensors: the same indexing, masks and
arithmetic the GPU compiles, so a wrong stride, mask or unpacking fails here. Fresh random inputs every time,
the output poisoned before each run so an unwritten element shows. On a GPU ``tests/test_cuda.py`` runs them
compiled.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from zoomkv import kernels  # noqa: E402
from zoomkv.kernels import codes as kernel_codes  # noqa: E402
from zoomkv.kernels import encode as kernel_encode  # noqa: E402
from zoomkv.kernels.gather import gather_rows, gather_rows_reference  # noqa: E402
from zoomkv.methods.sekv import codes  # noqa: E402


@pytest.fixture
def interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("ZOOMKV_TRITON", "1")
    assert kernels.usable(torch.zeros(1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.uint8, torch.bool])
@pytest.mark.parametrize("dim", [1, 16, 80, 300])
def test_gather_rows_reads_the_rows_the_indices_name(interpreter, dtype, dim):
    g = torch.Generator().manual_seed(dim)
    whole = (torch.randn(3, 2, 57, dim, generator=g) * 50).to(dtype)
    src = whole[:, :, :41]  # a buffer's view: rows up to its length, strides of its capacity
    idx = torch.randint(0, 41, (3, 2, 37), generator=g)
    out = torch.full((3, 2, 37, dim), 7, dtype=dtype)
    gather_rows(src, idx, out)
    assert torch.equal(out, gather_rows_reference(src, idx))


def test_gather_rows_into_a_slice_of_a_larger_buffer(interpreter):
    src = torch.randn(2, 4, 30, 8)
    idx = torch.randint(0, 30, (2, 4, 5))
    buf = torch.full((2, 4, 9, 8), float("nan"))
    gather_rows(src, idx, buf[:, :, :5])
    assert torch.equal(buf[:, :, :5], gather_rows_reference(src, idx)) and buf[:, :, 5:].isnan().all()


def test_the_sync_audit_counts_a_kernel_as_one_launch(interpreter):
    """``SyncAudit.ops`` is what a GPU step launches: a Triton kernel is one, whatever the interpreter does inside
    it on the CPU (no op of it counted, no host read reported)."""
    from zoomkv.memory.sync_audit import SyncAudit

    src, idx = torch.randn(2, 3, 50, 16), torch.randint(0, 50, (2, 3, 7))
    out = torch.empty(2, 3, 7, 16)
    with SyncAudit() as audit:
        gather_rows(src, idx, out)
    assert audit.ops == 1 and audit.clean
    assert torch.equal(out, gather_rows_reference(src, idx))


def test_without_a_kernel_the_reference_runs():
    """On the CPU without the interpreter no kernel applies: the same rows through torch."""
    src, idx = torch.randn(2, 2, 10, 4), torch.randint(0, 10, (2, 2, 3))
    assert not kernels.usable(src, idx)
    assert torch.equal(gather_rows(src, idx), gather_rows_reference(src, idx))


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("dim,groups", [(64, 3), (128, 4), (96, 1), (32, 3), (16, 2)])  # 32, 16: a trained hash
def test_score_codes_kernel_matches_the_byte_tables(interpreter, monkeypatch, bits, dim, groups):
    g = torch.Generator().manual_seed(bits * dim)
    keys = torch.randn(2, 3, 70, dim, generator=g)
    packed, rms = codes.encode(keys, bits)
    query = torch.randn(2, 3, groups, dim, generator=g)
    got = kernel_codes.score_codes(query, packed[:, :, :61], rms[:, :, :61], bits, codes.level_step(bits))
    monkeypatch.setenv("ZOOMKV_TRITON", "0")  # score_codes' own table path: the reference
    ref = codes.score_codes(query, packed[:, :, :61], rms[:, :, :61], bits)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("dim", [16, 32, 64, 96, 128, 256])
def test_encode_kernel_writes_the_codes_torch_writes(interpreter, monkeypatch, bits, dim):
    """The same bytes as ``encode``'s torch path, bit for bit, and the same RMS within one fp16 step: levels past
    the outer ones clamped, a row of zeros, a bf16 input and a strided one (a buffer's slice)."""
    g = torch.Generator().manual_seed(bits + dim)
    keys = torch.randn(2, 3, 45, dim, generator=g) * torch.rand(2, 3, 45, 1, generator=g) * 4
    keys[0, 0, 3] = 0.0
    keys[1, 2, 7, : dim // 2] = 40.0  # beyond the outer levels once normalised
    for x in (keys, keys[:, :, 5:38], keys.to(torch.bfloat16)):
        packed = torch.full((*x.shape[:-1], dim * bits // 8), 7, dtype=torch.uint8)
        got, rms = kernel_encode.encode_codes(x, bits, codes.level_step(bits))
        packed.copy_(got)
        monkeypatch.setenv("ZOOMKV_TRITON", "0")  # encode's own torch path: the reference
        ref, ref_rms = codes.encode(x, bits)
        monkeypatch.setenv("ZOOMKV_TRITON", "1")
        assert torch.equal(packed, ref)
        torch.testing.assert_close(rms, ref_rms, rtol=1e-3, atol=0)  # the sum's order differs: an fp16 step at most
    called = []
    monkeypatch.setattr(kernel_encode, "encode_codes", lambda *a: called.append(1) or (ref, ref_rms))
    codes.encode(keys, bits)
    assert called  # encode takes the kernel where one runs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["plain", "padding and merged rows", "trained offset", "nothing left out"])
def test_tail_kernel_writes_the_row_with_tail_writes(interpreter, monkeypatch, dtype, case):
    """The softmax tail's row by the kernel against ``with_tail``'s torch path: key, value and bias, with a
    selection of plain rows, of padding (bias -inf) and merged rows (bias log c), a trained bias offset, and a
    selection covering every row (the row must weigh nothing), over more rows than one tile reads."""
    from types import SimpleNamespace

    from zoomkv.kernels import tail as kernel_tail
    from zoomkv.memory.tail import with_tail
    from zoomkv.protocol.method import Selection

    g = torch.Generator().manual_seed(len(case))
    b, h, k, dk, dv, n = 2, 3, 75, 64, 48, 300
    every = torch.randn(b, h, n, dk, generator=g), torch.randn(b, h, n, dv, generator=g)
    tier = {"tail_key_sum": every[0].sum(2, keepdim=True), "tail_value_sum": every[1].sum(2, keepdim=True),
            "tail_count": torch.full((b, h, 1), float(n))}
    if case == "nothing left out":
        tier["tail_count"] = torch.full((b, h, 1), float(k))
    keys, values = every[0][:, :, 100:100 + k].to(dtype), every[1][:, :, 100:100 + k].to(dtype)
    bias = None
    if case == "padding and merged rows":
        bias = torch.zeros(b, h, k, dtype=dtype)
        bias[0, :, :5] = float("-inf")
        bias[1, 1, 10:14] = math.log(6.0)
    offset = torch.tensor([0.5, -1.0, 2.0]) if case == "trained offset" else None
    memory = SimpleNamespace(device_tier=tier)
    sel = Selection(keys, values, bias)
    called = []
    real = kernel_tail.tail_row
    monkeypatch.setattr(kernel_tail, "tail_row", lambda *a: called.append(1) or real(*a))
    got = with_tail(memory, sel, offset=offset)
    assert called  # with_tail takes the kernel where one runs
    monkeypatch.setenv("ZOOMKV_TRITON", "0")  # with_tail's torch path: the reference
    ref = with_tail(memory, sel, offset=offset)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype is torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    for a, r in zip((got.keys, got.values, got.bias), (ref.keys, ref.values, ref.bias), strict=True):
        assert a.dtype == r.dtype and a.shape == r.shape
        torch.testing.assert_close(a, r, **tol)
    if case == "nothing left out":
        assert torch.isneginf(got.bias[..., -1]).all()


@pytest.mark.parametrize("fmt", ["int8", "int4", "k8v4", "int2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_coded_host_tiers_rows_are_decoded_by_the_kernel_as_torch_decodes_them(interpreter, monkeypatch, fmt,
                                                                                dtype):
    """A per-token coded buffer's recall by the kernel (``zoomkv.kernels.dequant``) against its torch path: the
    rows named, into slots, only the fetched ones (the others untouched), and into a buffer in order."""
    from zoomkv.kernels import dequant as kernel_dequant
    from zoomkv.memory.quant import QuantSpec, row_buffer

    g = torch.Generator().manual_seed(len(fmt))
    rows = (torch.randn(2, 3, 90, 64, generator=g) * 3).to(dtype)
    buf = row_buffer(rows[:, :, :70], QuantSpec.parse(fmt).for_rows("values"))
    buf.append(rows[:, :, 70:])
    idx = torch.stack([torch.stack([torch.randperm(90, generator=g)[:40] for _ in range(3)]) for _ in range(2)])
    dest = torch.stack([torch.stack([torch.randperm(40, generator=g) for _ in range(3)]) for _ in range(2)])
    fetch = torch.rand(2, 3, 40, generator=g) < 0.5
    called = []
    real = kernel_dequant.gather_dequantized
    monkeypatch.setattr(kernel_dequant, "gather_dequantized", lambda *a, **k: called.append(1) or real(*a, **k))
    slots, ordered = torch.full((2, 3, 44, 64), 5.0, dtype=dtype), torch.full((2, 3, 40, 64), 5.0, dtype=dtype)
    buf.gather_to_slots(idx, dest, fetch, slots)
    buf.gather(idx, out=ordered)
    assert len(called) == 2
    monkeypatch.setenv("ZOOMKV_TRITON", "0")  # the torch path: the reference
    ref_slots, ref_ordered = torch.full_like(slots, 5.0), torch.full_like(ordered, 5.0)
    buf.gather_to_slots(idx, dest, fetch, ref_slots)
    buf.gather(idx, out=ref_ordered)
    if dtype is torch.float32:
        assert torch.equal(slots, ref_slots) and torch.equal(ordered, ref_ordered)
    else:  # the interpreter rounds float32 to bf16 by cutting bits (a GPU rounds to nearest): one bf16 step
        torch.testing.assert_close(slots, ref_slots, rtol=2**-7, atol=0)
        torch.testing.assert_close(ordered, ref_ordered, rtol=2**-7, atol=0)
    assert (slots[:, :, 40:] == 5).all()


# a constant row's scale floor (1e-8) is 0 in fp16: its codes are 0 / 0 in both paths (and decode to its value)
@pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("group,dim", [(32, 64), (32, 128), (64, 64), (16, 48)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_quantize_kernel_codes_rows_as_torch_codes_them(interpreter, monkeypatch, bits, group, dim, dtype):
    """Per-token codes, scales and minimums by the kernel against ``quantize``'s torch path, bit for bit: random
    rows, a constant row (scale at its floor), rows whose values sit on half steps (ties round to even), a
    strided input."""
    from zoomkv.kernels import quantize as kernel_quantize
    from zoomkv.memory import quant

    g = torch.Generator().manual_seed(bits * dim + group)
    x = torch.randn(2, 3, 40, dim, generator=g) * torch.rand(2, 3, 40, 1, generator=g) * 5
    x[0, 0, 1] = 0.75
    levels = (1 << bits) - 1
    ties = torch.arange(dim, dtype=torch.float32) % levels + 0.5  # every group from 0 to levels: a scale of 1,
    ties[0::group], ties[1::group] = 0.0, float(levels)  # so the other values fall on half steps: ties
    x[1, 2, 3] = ties
    x = x.to(dtype)
    called = []
    real = kernel_quantize.quantize_rows
    monkeypatch.setattr(kernel_quantize, "quantize_rows", lambda *a: called.append(1) or real(*a))
    for rows in (x, x[:, :, 3:30]):
        got = quant.quantize(rows, bits, group)
        monkeypatch.setenv("ZOOMKV_TRITON", "0")  # quantize's torch path: the reference
        ref = quant.quantize(rows, bits, group)
        monkeypatch.setenv("ZOOMKV_TRITON", "1")
        for a, r in zip(got, ref, strict=True):
            assert a.dtype == r.dtype and torch.equal(a, r)
    assert len(called) == 2


def test_level_step_gives_the_levels():
    for bits in codes.BITS:
        c = torch.arange(2**bits, dtype=torch.float32)
        torch.testing.assert_close((c - 2 ** (bits - 1) + 0.5) * codes.level_step(bits), codes.levels(bits))


def test_sekv_selects_the_same_rows_with_the_kernel_scoring(interpreter, monkeypatch):
    """sekv's torch step (the one a GPU runs) with its codes scored by the kernel picks what the byte tables
    pick: the same greedy tokens on a padded batch."""
    from tests.helpers import greedy, max_logit_diff, padded_batch
    from zoomkv import ZoomCache, native
    from zoomkv.models import load_model

    model, _ = load_model("tiny-llama")
    ids, mask = padded_batch(model.config.vocab_size, lengths=(90, 61))
    called = []
    real = kernel_codes.score_codes
    monkeypatch.setattr(kernel_codes, "score_codes", lambda *a: called.append(1) or real(*a))
    with native.torch_path():
        fast = greedy(model, ids, mask, ZoomCache(model, "sekv", 40), new=6)
        monkeypatch.setenv("ZOOMKV_TRITON", "0")
        ref = greedy(model, ids, mask, ZoomCache(model, "sekv", 40), new=6)
    assert called
    assert torch.equal(fast.sequences, ref.sequences)
    assert max_logit_diff(fast.scores, ref.scores) < 1e-4  # the tail row and the codes as torch makes them


@pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")  # padding rows: 0 / 0
def test_sekv_with_a_coded_host_tier_decodes_the_same_tokens_through_the_kernels(interpreter, monkeypatch):
    """The GPU's step on the CPU: sekv as the quickstart runs it (host rescoring, a `k8v4` host tier read only
    where the recall buffer misses) with its kernels (scoring, coding, the tail row, the host rows coded and
    decoded into their slots) gives the greedy tokens of its torch path. The plan stays torch's here: its kernel's
    reductions run under the interpreter only in a process of their own (tests/test_recall_misses.py)."""
    from tests.helpers import greedy, max_logit_diff, padded_batch
    from zoomkv import ZoomCache, native
    from zoomkv.kernels import dequant as kernel_dequant
    from zoomkv.kernels import quantize as kernel_quantize
    from zoomkv.kernels import tail as kernel_tail
    from zoomkv.models import load_model
    from zoomkv.protocol.recallable import recall_misses_only

    model, _ = load_model("tiny-llama")
    ids, mask = padded_batch(model.config.vocab_size, lengths=(90, 61))
    from zoomkv.kernels import plan as kernel_plan

    monkeypatch.setattr(kernel_plan, "plan_swaps_fits", lambda idx: False)
    called = {"quantize": 0, "dequant": 0, "tail": 0}
    for module, fn, key in ((kernel_quantize, "quantize_rows", "quantize"), (kernel_dequant, "gather_dequantized", "dequant"),
                            (kernel_tail, "tail_row", "tail")):
        real = getattr(module, fn)
        monkeypatch.setattr(module, fn, lambda *a, _real=real, _key=key, **k: called.__setitem__(_key, called[_key] + 1)
                            or _real(*a, **k))

    def run():
        return greedy(model, ids, mask, ZoomCache(model, "sekv", 40, kv_quant="k8v4", rescore_from="host"), new=6)

    with native.torch_path(), recall_misses_only(True):
        fast = run()
        monkeypatch.setenv("ZOOMKV_TRITON", "0")
        ref = run()
    assert all(called.values()), called
    assert torch.equal(fast.sequences, ref.sequences)
    assert max_logit_diff(fast.scores, ref.scores) < 1e-4  # the same rows, decoded to the same values


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # unfilled rows, masked after
def test_a_step_in_fixed_shapes_gives_its_torch_paths_tokens_through_the_kernels(interpreter, monkeypatch):
    """The step a GPU captures in a CUDA graph (zoomkv.memory.graphs: rows written at a position read on the device,
    every allocated row scored and the unfilled ones masked), run here uncaptured with its kernels: the scoring over
    rows no token has reached yet, the coding into the buffers, the tail row, the coded host tier read into slots.
    The greedy tokens and logits of the same step's torch path."""
    from tests.helpers import greedy, max_logit_diff, padded_batch
    from zoomkv import ZoomCache, native
    from zoomkv.kernels import plan as kernel_plan
    from zoomkv.memory import graphs
    from zoomkv.models import load_model
    from zoomkv.protocol.recallable import recall_misses_only

    model, _ = load_model("tiny-llama")
    ids, mask = padded_batch(model.config.vocab_size, lengths=(400, 290))  # past sekv's stage one (156 rows)
    monkeypatch.setattr(kernel_plan, "plan_swaps_fits", lambda idx: False)  # (its kernel: tests/test_recall_misses.py)
    launched = kernels.launches()

    def run():  # sekv as the quickstart runs it (Quest's step has no kernel on the CPU but the plan's)
        return greedy(model, ids, mask, ZoomCache(model, "sekv", 40, kv_quant="k8v4", rescore_from="host"), new=6)

    with native.torch_path(), recall_misses_only(True), graphs.emulated(capture=False):
        fast = run()
        assert kernels.launches() > launched
        monkeypatch.setenv("ZOOMKV_TRITON", "0")
        ref = run()
    assert torch.equal(fast.sequences, ref.sequences)
    assert max_logit_diff(fast.scores, ref.scores) < 1e-4


def test_score_codes_kernel_tiles_a_long_group(interpreter, monkeypatch):
    """A chunk of new tokens asks with heads x tokens query rows at once: tiled over the grid, not one block."""
    g = torch.Generator().manual_seed(3)
    packed, rms = codes.encode(torch.randn(1, 2, 40, 64, generator=g), 1)
    query = torch.randn(1, 2, 150, 64, generator=g)
    got = kernel_codes.score_codes(query, packed, rms, 1, codes.level_step(1))
    monkeypatch.setenv("ZOOMKV_TRITON", "0")
    torch.testing.assert_close(got, codes.score_codes(query, packed, rms, 1), rtol=1e-5, atol=1e-4)
