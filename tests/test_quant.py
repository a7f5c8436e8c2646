"""KV quantization: error bounds, the bytes really held, and generation that stays close to full."""

from __future__ import annotations

import pytest
import torch

from tests.method_matrix import method_kwargs
from zoomkv import ZoomCache
from zoomkv import native as zoomkv_native
from zoomkv.compat import generate_cache_kwargs
from zoomkv.errors import ConfigError
from zoomkv.memory.quant import ROW_QUANTIZER, QuantizedRowBuffer, QuantSpec, dequantize, quantize
from zoomkv.methods.sekv import native
from zoomkv.models import load_model


@pytest.mark.parametrize("bits", [8, 4])
def test_dequantizes_within_half_a_step(bits):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 50, 64) * torch.linspace(0.1, 5, 64)
    codes, scale, lo = quantize(x, bits, 32)
    assert codes.dtype == torch.uint8 and codes.shape[-1] == (64 if bits == 8 else 32)
    y = dequantize(codes, scale, lo, bits, torch.float32)
    step = scale.float().repeat_interleave(32, dim=-1)
    # half a step, plus the fp16 rounding of the stored minimum
    bound = step / 2 + lo.float().abs().repeat_interleave(32, dim=-1) * 2**-10 + 1e-6
    assert bool(((y - x).abs() <= bound).all())
    # and the step itself is what the bit width promises
    spread = x.reshape(2, 3, 50, 2, 32)
    expected = (spread.amax(-1) - spread.amin(-1)) / (2**bits - 1)
    torch.testing.assert_close(scale.float(), expected, rtol=2e-3, atol=1e-4)


@pytest.mark.parametrize("bits,ratio", [(8, 0.5 + 4 / 64), (4, 0.25 + 4 / 64)])
def test_bytes_are_half_or_quarter_of_fp16_plus_scales(bits, ratio):
    x = torch.randn(1, 3, 128, 64, dtype=torch.float16)
    buf = QuantizedRowBuffer(x, QuantSpec(bits=bits, group_size=32))
    assert buf.nbytes == pytest.approx(x.nbytes * ratio)  # codes + fp16 scale and minimum per 32 channels
    buf.append(torch.randn(1, 3, 1, 64, dtype=torch.float16))
    assert buf.view().shape == (1, 3, 129, 64) and buf.view().dtype == torch.float16


def _gen(model, ids, cache, new=8):
    return model.generate(input_ids=ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                          output_scores=True, return_dict_in_generate=True, pad_token_id=0,
                          **generate_cache_kwargs(cache))


@pytest.mark.parametrize("method,budget,tiers", [("oracle_topk", 4096, "host"), ("full", None, "all"),
                                                 ("quest", 4096, "host"), ("clusterkv", 4096, "host"),
                                                 ("sekv", 4096, "host")])
@pytest.mark.parametrize("bits,tol", [("int8", 0.02), ("int4", 0.3)])
def test_quantized_generation_stays_close_to_full(method, budget, tiers, bits, tol):
    """Stated logit tolerance on the tiny random model: int8 within 0.02, int4 within 0.3 (of logits ~±1)."""
    model, _ = load_model("tiny-llama")
    ids = torch.randint(3, 250, (1, 60), generator=torch.Generator().manual_seed(0))
    ref = _gen(model, ids, ZoomCache(model, "full"))
    cache = ZoomCache(model, method, budget, kv_quant=bits, kv_quant_tiers=tiers)
    out = _gen(model, ids, cache)
    worst, steps = 0.0, 0
    for i, (a, b) in enumerate(zip(out.scores, ref.scores, strict=True)):
        finite = torch.isfinite(b)
        worst = max(worst, (a[finite] - b[finite]).abs().max().item())
        steps += 1
        if out.sequences[0, 60 + i] != ref.sequences[0, 60 + i]:
            break  # after a different token the two runs see different inputs
    assert steps >= 2 and worst < tol
    report = cache.memory_report()
    per_value = {"int8": 1 + 4 / 16, "int4": 0.5 + 4 / 16}[bits]  # head_dim 16: one fp16 scale+min per row
    for layer, row in zip(cache.layers, report.layers, strict=True):
        if row.kind != "zoom":
            continue  # dense layers (quest's/clusterkv's first two) keep full-precision rows on the device
        tier = layer.device_tier if tiers == "all" else layer.host_tier
        bufs = [b for b in tier.values() if isinstance(b, QuantizedRowBuffer)]
        assert len(bufs) == 2, "keys and values are quantized"
        for b in bufs:  # the bytes held are codes + scales for every row of capacity, nothing hidden
            assert b.nbytes == pytest.approx(b.capacity * 2 * 16 * per_value)  # batch 1 × 2 KV heads × 16 dims
            assert b.nbytes < 0.35 * b.capacity * 2 * 16 * 4  # vs the same rows in fp32


def test_device_tier_quantization_needs_support():
    model, _ = load_model("tiny-llama")
    with pytest.raises(ConfigError, match="device tier"):
        ZoomCache(model, "snapkv", 64, kv_quant="int8", kv_quant_tiers="all")
    with pytest.raises(ConfigError, match="valid: int8, int4"):
        ZoomCache(model, "full", kv_quant="int3")


@pytest.mark.parametrize("bits", ["int8", "int4"])
def test_sekv_recalls_quantized_rows_under_a_small_budget(bits):
    """sekv's second stage reads its finer codes' scales from the host tier: they are no KV rows and stay as
    they are (quantizing their one-channel rows broke the rescoring), while keys and values are quantized."""
    model, _ = load_model("tiny-llama")
    ids = torch.randint(3, 250, (1, 80), generator=torch.Generator().manual_seed(1))
    cache = ZoomCache(model, "sekv", 32, kv_quant=bits)
    out = _gen(model, ids, cache, new=6)
    assert out.sequences.shape[1] == 86
    zoom = [layer for layer, row in zip(cache.layers, cache.memory_report().layers, strict=True) if row.kind == "zoom"]
    assert zoom
    for layer in zoom:
        quantized = sorted(k for k, b in layer.host_tier.items() if isinstance(b, QuantizedRowBuffer))
        assert quantized == ["keys", "values"]
        assert not isinstance(layer.host_tier["fine_rms"], QuantizedRowBuffer)


@pytest.mark.parametrize("bits,width", [(8, 64), (4, 64), (8, 19), (4, 19)])
def test_gather_decodes_the_same_rows_as_the_whole_view(bits, width):
    x = torch.randn(2, 3, 40, width, dtype=torch.float16)
    buf = QuantizedRowBuffer(x, QuantSpec(bits=bits, group_size=32))
    buf.append(torch.randn(2, 3, 5, width, dtype=torch.float16))
    idx = torch.randint(0, 45, (2, 3, 7), generator=torch.Generator().manual_seed(0))
    whole = buf.view().gather(2, idx[..., None].expand(-1, -1, -1, width))
    assert torch.equal(buf.gather(idx), whole)
    assert torch.equal(buf.gather(None), buf.view())


@pytest.mark.parametrize("method", ["quest", "clusterkv", "infinigen", "sentencekv", "sekv"])
def test_a_decode_step_decodes_only_the_rows_it_gathers(method, monkeypatch, tmp_path):
    """Under int8 a recallable method's step dequantizes the rows it gathers, not the whole host tier."""
    import zoomkv.memory.quant as quant

    model, _ = load_model("tiny-llama")
    n, budget = 300, 32
    ids = torch.randint(3, 250, (1, n), generator=torch.Generator().manual_seed(2))
    cache = ZoomCache(model, method, budget, kv_quant="int8", **method_kwargs(method, model, tmp_path))
    kwargs = generate_cache_kwargs(cache)
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, **kwargs)
    decoded: list[int] = []
    real = quant.dequantize

    def counting(codes, *args):
        decoded.append(codes.shape[2])
        return real(codes, *args)

    monkeypatch.setattr(quant, "dequantize", counting)
    # sekv's compiled recall decodes the rows it gathers in C++ (tests/test_sekv_native.py): here, its torch path
    with torch.no_grad(), native.torch_path():
        model(input_ids=ids[:, :1], use_cache=True, **kwargs)
    zoom = sum(row.kind == "zoom" for row in cache.memory_report().layers)
    assert decoded and len(decoded) <= 2 * zoom * 2  # keys and values, a method may gather twice
    # before, every gather decoded all n rows; clusterkv also decodes the members of the cluster it cuts
    assert max(decoded) <= (n // 2 if method == "clusterkv" else 2 * budget) < n


FORMATS = ["int8", "int4", "int2", "k4v2", "kivi4", "kivi2", "kivi4v2", "int2o4", "int4g16", "kivi4g64"]


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("role", ["keys", "values"])
def test_every_format_gathers_the_rows_its_view_decodes_and_counts_its_bytes(name, role):
    from zoomkv.memory.quant import row_buffer

    torch.manual_seed(0)
    x = torch.randn(2, 3, 1000, 64)
    spec = QuantSpec.parse(name)
    assert spec.name == name
    buf = row_buffer(x[:, :, :990], spec.for_rows(role))
    for i in range(990, 1000):  # decoding appends one row at a time: KIVI's open block fills and is coded
        buf.append(x[:, :, i:i + 1])
    view = buf.view()
    assert view.shape == x.shape and buf.length == 1000
    idx = torch.randint(0, 1000, (2, 3, 17))
    assert torch.equal(buf.gather(idx), view.gather(2, idx[..., None].expand(-1, -1, -1, 64)))
    q = spec.for_rows(role)
    err = float((view - x).norm() / x.norm())
    assert err < {8: 0.01, 4: 0.12, 2: 0.5}[q.bits]
    held = q.bits + 32 / q.group_size + (16 * q.outliers / 64 if role == "keys" else 0)
    # the bytes really held: codes, fp16 scales and minimums, exact channels; plus the room grown for appends
    # (128 rows) and KIVI's open block (8 exact rows here)
    assert held / 32 <= buf.nbytes / x.nbytes <= held / 32 * 1.25


def test_kivi_keys_hold_outlier_channels_better_than_per_token_groups():
    """KIVI's reason for per-channel keys: a few channels of every key are large, and a per-token group
    containing one spends its levels on it."""
    from zoomkv.memory.quant import row_buffer

    torch.manual_seed(0)
    keys = torch.randn(1, 2, 512, 64)
    keys[..., [3, 40]] += 12.0  # fixed outlier channels, as in real keys
    errs = {}
    for name in ("int2", "kivi2", "int2o4"):
        view = row_buffer(keys, QuantSpec.parse(name).for_rows("keys")).view()
        errs[name] = float((view - keys).norm() / keys.norm())
    assert errs["kivi2"] < errs["int2"] / 2 and errs["int2o4"] < errs["int2"] / 2


def test_exact_channels_and_kivis_open_block_stay_exact():
    from zoomkv.memory.quant import row_buffer

    torch.manual_seed(1)
    keys = torch.randn(1, 2, 100, 64)
    keys[..., 7] *= 30
    buf = row_buffer(keys, QuantSpec.parse("int2o1").for_rows("keys"))
    assert torch.equal(buf.view()[..., 7], keys[..., 7].half().float())
    kivi = row_buffer(keys, QuantSpec.parse("kivi2").for_rows("keys"))
    assert torch.equal(kivi.view()[:, :, 96:], keys[:, :, 96:])  # 100 = 3 blocks of 32 + 4 rows not yet coded


@pytest.mark.parametrize("bad", ["int3", "kivi2o4", "k4v", "int2o", "int16", "int4g7", "kivi4g0", "int4g"])
def test_unknown_formats_are_refused(bad):
    with pytest.raises(ConfigError):
        QuantSpec.parse(bad)


def test_a_fitted_pattern_sets_each_layers_bits():
    spec = QuantSpec(bits=4, layers=((8, 4), (4, 2)), fitted="fit25")
    assert spec.for_rows("keys", 0).bits == 8 and spec.for_rows("values", 1).bits == 2
    assert spec.name == "fit25"
    with pytest.raises(ConfigError):
        QuantSpec(layers=((8, 3),))


@pytest.mark.skipif(ROW_QUANTIZER.library() is None, reason="no C++ compiler: appends take the torch path")
@pytest.mark.parametrize("spec", ["int8", "int4", "int2", "k8v4"])
@pytest.mark.parametrize("width", [64, 16])
def test_compiled_append_codes_rows_bit_for_bit_as_torch(spec, width):
    # Rows of every scale (large, tiny, a constant group, one outlier), one and several at a time, past the
    # buffer's capacity: the compiled append's codes, scales and minimums equal quantize()'s exactly.
    g = torch.Generator().manual_seed(width)
    rows = [torch.randn(2, 3, 5, width, generator=g)]
    for i in range(140):
        r = torch.randn(2, 3, 1 + (i % 3 == 0) * 2, width, generator=g) * 10.0 ** ((i % 7) - 3)
        if i % 11 == 0:
            r[0, 1, 0, :] = 0.5  # a constant row: its scale clamps to 1e-8, which fp16 rounds to 0 (the torch path)
        if i % 13 == 0:
            r[1, 2, -1, 3] = 300.0
        rows.append(r)
    for role in ("keys", "values"):
        spec_rows = QuantSpec.parse(spec).for_rows(role)
        fast, ref = (QuantizedRowBuffer(rows[0], spec_rows) for _ in range(2))
        with zoomkv_native.torch_path():
            for r in rows[1:]:
                ref.append(r)
        for r in rows[1:]:
            fast.append(r)
        assert fast.length == ref.length == sum(r.shape[2] for r in rows)
        for a, b in zip(fast.tensors(), ref.tensors(), strict=True):
            assert torch.equal(a[:, :, : fast.length], b[:, :, : ref.length])
        assert torch.equal(fast.view(), ref.view())


def test_compiled_append_leaves_what_it_cannot_code_to_torch():
    rows = torch.randn(1, 2, 4, 64)
    spec = QuantSpec.parse("int4")
    fast, ref = QuantizedRowBuffer(rows, spec), QuantizedRowBuffer(rows, spec)
    bad = torch.randn(1, 2, 1, 64)
    bad[0, 0, 0, 5] = float("inf")
    fast.append(bad)
    with zoomkv_native.torch_path():
        ref.append(bad)
    for a, b in zip(fast.tensors(), ref.tensors(), strict=True):
        assert torch.equal(a[:, :, :5], b[:, :, :5])


def _prefill_rows(width: int, n: int) -> torch.Tensor:
    """Rows of every scale across heads and tokens, signed zeros and an outlier: what the compiled quantizer
    must code as torch does."""
    g = torch.Generator().manual_seed(n + width)
    rows = torch.randn(2, 3, n, width, generator=g) * 10.0 ** torch.randint(-3, 4, (2, 3, n, 1), generator=g)
    # groups (per token and per channel) whose least value is a zero of either sign: which zero is the minimum
    # depends on the order of the comparisons (torch's differs by shape), the decoded rows do not (0·s + -0 = +0)
    rows[1, 1, :, :32] = rows[1, 1, :, :32].abs()
    rows[1, 1, 0::4, 0], rows[1, 1, 0::4, 1], rows[1, 1, 1::4, 0], rows[1, 1, 1::4, 1] = 0.0, -0.0, -0.0, 0.0
    rows[1, 2, min(7, n - 1), 3] = 300.0
    return rows


def _held(buf) -> list[torch.Tensor]:
    """The rows a quantized buffer holds, part by part (codes, scales, minimums, KIVI's open block), without the
    room grown for appends."""
    return [buf.codes.view(), buf.scale.view(), buf.lo.view(), *([buf.residual] if hasattr(buf, "residual") else [])]


@pytest.mark.skipif(ROW_QUANTIZER.library() is None, reason="no C++ compiler: prefills take the torch path")
@pytest.mark.parametrize("name", ["int8", "int4", "int2", "k8v4", "kivi4", "kivi2", "kivi4g64", "int4g16"])
@pytest.mark.parametrize(("width", "n"), [(64, 100), (64, 128), (16, 37), (64, 5)])
def test_compiled_prefill_codes_rows_bit_for_bit_as_torch(name, width, n, monkeypatch):
    # The prefill's rows (a buffer's construction) coded by the kernel: the same codes, scales, minimums and
    # bytes held as the torch path's, per token and in KIVI's blocks; then appends on both stay equal.
    from zoomkv.memory import quant

    torch_coded = []
    for coder in ("quantize", "quantize_channels"):  # counts the torch path's calls: the kernel's buffer makes none
        real = getattr(quant, coder)
        monkeypatch.setattr(quant, coder, lambda *a, _real=real, **k: torch_coded.append(1) or _real(*a, **k))
    rows = _prefill_rows(width, n)
    more = [torch.randn(2, 3, k, width) for k in (1, 1, 30, 3, 64)]
    for role in ("keys", "values"):
        spec = QuantSpec.parse(name).for_rows(role)
        torch_coded.clear()
        fast = quant.row_buffer(rows, spec)
        assert not torch_coded
        with zoomkv_native.torch_path():
            ref = quant.row_buffer(rows, spec)
        for step in range(len(more) + 1):
            assert fast.length == ref.length and fast.nbytes == ref.nbytes and fast.capacity == ref.capacity
            for a, b in zip(_held(fast), _held(ref), strict=True):
                assert torch.equal(a, b)
            assert torch.equal(fast.view().view(torch.int32), ref.view().view(torch.int32))  # bit for bit
            if step < len(more):
                coded = len(torch_coded)
                fast.append(more[step])
                assert len(torch_coded) == coded
                with zoomkv_native.torch_path():
                    ref.append(more[step])


def test_compiled_prefill_leaves_what_it_cannot_code_to_torch():
    from zoomkv.memory.quant import row_buffer

    # a NaN, and rows of one value (the scale, clamped to 1e-8, rounds to 0 in fp16): torch's codes, whatever
    # they are, from torch
    nan, constant = _prefill_rows(64, 64), _prefill_rows(64, 64)
    nan[1, 0, 40, 9] = float("nan")
    constant[0, 1, :, :] = 0.5
    for rows in (nan, constant):
        for name in ("int4", "kivi4"):
            spec = QuantSpec.parse(name).for_rows("keys")
            fast = row_buffer(rows, spec)
            with zoomkv_native.torch_path():
                ref = row_buffer(rows, spec)
            for a, b in zip(_held(fast), _held(ref), strict=True):
                assert torch.equal(a.view(torch.int16) if a.dtype == torch.float16 else a,
                                   b.view(torch.int16) if b.dtype == torch.float16 else b)  # NaN's bits too


def test_without_a_compiler_appends_take_the_torch_path_and_say_so(monkeypatch):
    monkeypatch.setattr(ROW_QUANTIZER, "_lib", None)
    monkeypatch.setattr(ROW_QUANTIZER, "_failed", None)

    def no_compiler():
        raise RuntimeError("Error building extension: c++: command not found")

    monkeypatch.setattr(ROW_QUANTIZER, "_build", no_compiler)
    rows, new = torch.randn(1, 2, 4, 64), torch.randn(1, 2, 1, 64)
    with pytest.warns(RuntimeWarning, match="row quantizer could not be built.*torch path"):
        buf = QuantizedRowBuffer(rows, QuantSpec.parse("int8"))
    ref = QuantizedRowBuffer(rows, QuantSpec.parse("int8"))
    buf.append(new)
    with zoomkv_native.torch_path():
        ref.append(new)
    assert torch.equal(buf.view(), ref.view())
