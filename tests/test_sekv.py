"""sekv's behaviour on hand-built tensors: anchors, span summaries, SVD bases, routing, the summary's
log-size bias, generated rows, the budget, and loading an adapter. (The generic invariants — B ≥ context is
exactly full attention, the budget is never exceeded in generate() — run in test_method_invariants.py.)"""

from __future__ import annotations

import math

import pytest
import torch

from zoomkv import ZoomCache
from zoomkv.adapters.errors import AdapterNotFoundError
from zoomkv.adapters.model import ZoomAdapter, build_adapter_modules
from zoomkv.errors import ConfigError
from zoomkv.memory.attention import attend
from zoomkv.methods import get_method
from zoomkv.methods.sekv.layout import _factor, build_spans, reconstruct, segment_row
from zoomkv.methods.sekv.method import SeKV
from zoomkv.methods.sekv.modules import SeKVAdapter
from zoomkv.models import load_model
from zoomkv.protocol.method import PrefillContext
from zoomkv.protocol.shape import ModelShape, base_fingerprint

H, D, G = 2, 16, 2  # KV heads, head dim, query heads per KV head


@pytest.fixture(scope="module")
def config():
    return load_model("tiny-llama")[0].config


def _memory(config, method, keys, values, surprisal, budget, valid=None):
    cache = ZoomCache(config, method, budget)
    memory = cache.layers[0]
    memory.lazy_initialization(keys, values)
    memory.seen = keys.shape[2]
    ctx = PrefillContext(layer_idx=0, num_layers=len(cache.layers), keys=keys, values=values,
                         queries=torch.zeros(keys.shape[0], H * G, keys.shape[2], D), valid=valid, budget=budget,
                         scaling=D**-0.5, num_kv_groups=G, zoom_layers=cache.zoom_layer_indices, surprisal=surprisal)
    method.compress(memory, ctx)
    return memory


def _exact_attention(query, keys, values, scaling):
    k = keys.repeat_interleave(G, dim=1)
    v = values.repeat_interleave(G, dim=1)
    w = torch.softmax(torch.matmul(query, k.transpose(-1, -2)) * scaling, -1)
    return torch.matmul(w, v).transpose(1, 2)


def test_anchors_are_the_high_surprisal_tokens():
    s = torch.ones(120)
    s[[30, 31, 60, 90]] = 9.0  # four surprising tokens (two adjacent)
    lay = segment_row(s, 0, 112, tau=1.0, sinks=4, min_span=4, max_span=32, room=40)
    assert lay.anchors == [30, 31, 60, 90]
    assert all(p in lay.exact for p in (0, 1, 2, 3, 30, 31, 60, 90))
    # runs between anchors are spans, none crosses an anchor, every region token is in exactly one place
    covered = sorted(lay.exact + [p for a, b in lay.spans for p in range(a, b)])
    assert covered == list(range(112))
    assert all(not (a <= x < b) for a, b in lay.spans for x in lay.anchors)
    # a run shorter than min_span stays exact
    s2 = torch.ones(60)
    s2[[20, 23]] = 9.0
    lay2 = segment_row(s2, 0, 52, tau=1.0, sinks=4, min_span=4, max_span=32, room=40)
    assert {21, 22} <= set(lay2.exact)


def test_anchors_are_capped_by_the_room_and_spans_split_to_max_span():
    s = torch.ones(400)
    s[torch.arange(10, 390, 7)] = 9.0  # 55 anchors would cut 55 spans
    s[[150, 220]] = 12.0  # the two most surprising
    lay = segment_row(s, 0, 392, tau=1.0, sinks=4, min_span=4, max_span=16, room=20)
    assert len(lay.exact) - 4 <= 20  # anchors + loose rows fit the room...
    assert {150, 220} <= set(lay.anchors)  # ...the most surprising kept
    assert all(e - s <= 16 for s, e in lay.spans)  # spans are index entries: as many as the context needs
    covered = sorted(lay.exact + [p for a, b in lay.spans for p in range(a, b)])
    assert covered == list(range(392))
    # no room at all: no anchor, the whole region in spans
    lay0 = segment_row(s, 0, 392, tau=1.0, sinks=4, min_span=4, max_span=16, room=0)
    assert lay0.anchors == [] and lay0.exact == [0, 1, 2, 3]
    assert sum(e - s for s, e in lay0.spans) == 388


def test_span_summary_is_the_surprisal_weighted_mean():
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(1, H, 20, D, generator=g), torch.randn(1, H, 20, D, generator=g)
    w = torch.rand(1, 20, generator=g) * 5
    sp = build_spans(keys, values, w, [[(2, 9), (9, 20)]], r_max=32)
    for j, (a, b) in enumerate([(2, 9), (9, 20)]):
        ww = (w[0, a:b] + 1e-3) / (w[0, a:b] + 1e-3).sum()
        torch.testing.assert_close(sp.sum_keys[0, :, j], (ww[:, None] * keys[0, :, a:b]).sum(1))
        torch.testing.assert_close(sp.sum_values[0, :, j], (ww[:, None] * values[0, :, a:b]).sum(1))
        assert sp.count[0, j] == b - a


def test_svd_full_rank_is_exact_and_low_rank_is_truncated():
    g = torch.Generator().manual_seed(1)
    rows = torch.randn(3, 24, D, generator=g)
    coef, basis = _factor(rows, r_max=32)
    torch.testing.assert_close(reconstruct(coef, basis, torch.ones(32)), rows, atol=1e-5, rtol=1e-5)
    gate = torch.zeros(32)
    gate[:4] = 1
    low = reconstruct(coef, basis, gate)
    u, s, vh = torch.linalg.svd(rows, full_matrices=False)
    best = (u[..., :4] * s[..., None, :4]) @ vh[..., :4, :]
    torch.testing.assert_close(low, best, atol=1e-4, rtol=1e-4)  # the optimal rank-4 approximation
    assert (low - rows).abs().max() > 0.1


def _pointed_keys(t=200, target=(100, 130)):
    g = torch.Generator().manual_seed(2)
    keys = torch.randn(1, H, t, D, generator=g) * 0.1
    values = torch.randn(1, H, t, D, generator=g)
    direction = torch.zeros(D)
    direction[0] = 1.0
    keys[:, :, target[0] : target[1]] += 4.0 * direction
    query = torch.zeros(1, H * G, 1, D)
    query[..., 0] = 8.0
    return keys, values, query


def test_router_zooms_into_the_span_the_query_points_to(config):
    keys, values, query = _pointed_keys(target=(98, 129))  # rows of two whole spans (16-row pieces)
    method = SeKV(max_span=16, anchor_fraction=0.3)
    memory = _memory(config, method, keys, values, torch.ones(1, 200), budget=100)
    sel = method.select(memory, query)
    n_exact, n_sum = memory.device_tier["keys"].shape[2], memory.device_tier["sum_keys"].shape[2]
    # the recalled rows are original rows (full-rank reconstruction of 16-row spans), and every pointed-to
    # row is among them (31 rows, within the 50 zoom rows)
    exact = "donot_use_mm_for_euclid_dist"
    for head in range(H):
        rows = sel.keys[0, head, n_exact + n_sum :][sel.bias[0, head, n_exact + n_sum :] == 0]
        dist, which = torch.cdist(rows, keys[0, head], compute_mode=exact).min(-1)
        assert dist.max() < 1e-4
        assert set(range(98, 129)) <= set(which.tolist())
        assert len(rows) <= 50
    # and the zoomed spans' summaries are hidden
    assert torch.isinf(sel.bias[:, :, n_exact : n_exact + n_sum]).any()
    # the output is close to exact attention, much closer than through summaries only
    out = attend(query, sel, D**-0.5)
    ref = _exact_attention(query, keys, values, D**-0.5)
    with torch.no_grad():
        method.adapter = SeKVAdapter(4, H, D, proj_dim=4, share_projector=True)
        method.adapter.route_tau.fill_(float("inf"))  # never zoom
    memory_nozoom = _memory(config, method, keys, values, torch.ones(1, 200), budget=100)
    out_nozoom = attend(query, method.select(memory_nozoom, query), D**-0.5)
    assert (out - ref).abs().max() < 0.5 * (out_nozoom - ref).abs().max()


def test_summary_with_identical_keys_attends_like_the_originals(config):
    g = torch.Generator().manual_seed(3)
    t = 160
    keys = torch.randn(1, H, 1, D, generator=g).expand(1, H, t, D).clone()  # one key everywhere...
    keys[:, :, :4] = torch.randn(1, H, 4, D, generator=g)  # ...but the sinks
    values = torch.randn(1, H, t, D, generator=g)
    query = torch.randn(1, H * G, 1, D, generator=g)
    adapter = SeKVAdapter(4, H, D, proj_dim=4, share_projector=True)
    with torch.no_grad():
        adapter.route_tau.fill_(float("inf"))  # nothing is zoomed: spans go through their summary
    method = SeKV(adapter=adapter)
    memory = _memory(config, method, keys, values, torch.ones(1, t), budget=64)  # uniform surprisal
    sel = method.select(memory, query)
    n_exact = memory.device_tier["keys"].shape[2]
    assert memory.device_tier["sum_keys"].shape[2] >= 1
    assert torch.allclose(sel.bias[0, 0, n_exact : n_exact + 1], memory.device_tier["sum_count"][0, 0, :1].log())
    torch.testing.assert_close(attend(query, sel, D**-0.5), _exact_attention(query, keys, values, D**-0.5),
                               atol=1e-5, rtol=1e-5)


def _represented_rows(memory) -> int:
    valid = int((memory.device_tier["bias"][0, 0] == 0).sum())
    return valid + int(memory.device_tier["sum_count"][0, 0].sum())


def test_generated_rows_are_appended_then_summarised_and_budget_holds(config):
    keys, values, query = _pointed_keys()
    method = SeKV()
    budget = 60
    surprisal = torch.rand(1, 200, generator=torch.Generator().manual_seed(0)) * 3
    memory = _memory(config, method, keys, values, surprisal, budget=budget)
    spans_before = memory.device_tier["sum_keys"].shape[2]
    assert _represented_rows(memory) == 200
    g = torch.Generator().manual_seed(4)
    for step in range(1, 81):
        method.append(memory, torch.randn(1, H, 1, D, generator=g), torch.randn(1, H, 1, D, generator=g))
        sel = method.select(memory, query)
        assert method.device_rows(memory) <= budget
        assert sel.index_rows == memory.device_tier["sum_keys"].shape[2]
        assert sel.kv_rows <= budget  # exact + zoom buffer; the rest through the span index
        assert _represented_rows(memory) == 200 + step  # nothing generated is dropped
    # every `chunk` (8) generated rows became one new span
    assert memory.device_tier["sum_keys"].shape[2] == spans_before + 10
    assert memory.device_tier["sum_count"][0, 0, -10:].tolist() == [8.0] * 10


def test_everything_exact_while_it_fits(config):
    keys, values, query = _pointed_keys(t=50, target=(10, 20))
    method = SeKV()
    memory = _memory(config, method, keys, values, torch.rand(1, 50), budget=64)
    assert memory.meta["mode"] == "exact"
    out = attend(query, method.select(memory, query), D**-0.5)
    torch.testing.assert_close(out, _exact_attention(query, keys, values, D**-0.5), atol=1e-5, rtol=1e-5)
    g = torch.Generator().manual_seed(5)
    for _ in range(20):  # outgrows the budget while decoding: compresses then, never exceeds it
        method.append(memory, torch.randn(1, H, 1, D, generator=g), torch.randn(1, H, 1, D, generator=g))
        method.select(memory, query)
        assert method.device_rows(memory) <= 64
    assert memory.meta["mode"] == "zoom"


def test_adapter_by_module_or_folder(config, tmp_path):
    shape = ModelShape.from_config(config, num_parameters=10**6)
    adapter = build_adapter_modules("sekv", shape, {"max_trainable_fraction": 0.01})
    with torch.no_grad():
        adapter.route_tau.add_(1.5)
    assert get_method("sekv", adapter=adapter).adapter is adapter
    ZoomAdapter.from_modules(adapter, "sekv", {**adapter.hyper()}, shape=shape,
                             fingerprint=base_fingerprint(config, name="tiny-llama")).save_pretrained(tmp_path / "ad")
    loaded = ZoomAdapter.from_pretrained(tmp_path / "ad").make_method().adapter
    # the settings an adapter was trained with come with it, unless given explicitly
    ZoomAdapter.from_modules(adapter, "sekv", {**adapter.hyper(), "max_span": 16, "anchor_fraction": 0.2},
                             shape=shape, fingerprint=base_fingerprint(config, name="tiny-llama")
                             ).save_pretrained(tmp_path / "ad16")
    assert ZoomAdapter.from_pretrained(tmp_path / "ad16").make_method().config.max_span == 16
    assert ZoomAdapter.from_pretrained(str(tmp_path / "ad16")).make_method().config.anchor_fraction == 0.2
    assert ZoomAdapter.from_pretrained(tmp_path / "ad16").make_method(max_span=8).config.max_span == 8
    for (k, a), (_, b) in zip(adapter.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), k
    with pytest.raises(AdapterNotFoundError, match="no such folder"):
        ZoomAdapter.from_pretrained(tmp_path / "missing")
    with pytest.raises(ConfigError, match="SeKVAdapter"):
        get_method("sekv", adapter=str(tmp_path / "ad16"))
    wrong = SeKVAdapter(3, H, D, proj_dim=2, share_projector=True)
    keys, values, _ = _pointed_keys()
    with pytest.raises(ConfigError, match="built for 3 layers"):
        _memory(config, SeKV(adapter=wrong), keys, values, torch.ones(1, 200), budget=100)
    # a fresh adapter routes by plain q·k (B = 0) and keeps every rank
    fresh = SeKVAdapter(4, H, D, proj_dim=4, share_projector=False)
    q, k = torch.randn(3, D), torch.randn(5, D)
    torch.testing.assert_close(fresh.router_scores(0, q, k), q @ k.T)
    assert bool(fresh.hard_gates(0).all())
    assert math.isclose(float(fresh.span_tau[0]), 1.0)


def test_left_padded_batch_compresses_within_budget():
    from zoomkv.compat import generate_cache_kwargs

    model, _ = load_model("tiny-llama")
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(5, 250, (2, 120), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :50] = 0  # the second row has 70 real tokens
    ids[1, :50] = 0
    method = SeKV()
    cache = ZoomCache(model, method, 56)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30, min_new_tokens=30, do_sample=False,
                         pad_token_id=0, **generate_cache_kwargs(cache))
    assert out.shape[1] == 150
    assert 0 < cache.max_device_rows <= 56
    memory = cache.layers[0]
    # padding is never represented; every real prompt row and every generated row is (29 appended: the 30th
    # token is sampled from the last step and never enters the cache)
    for row, real in ((0, 120), (1, 70)):
        valid = int((memory.device_tier["bias"][row, 0] == 0).sum())
        assert valid + int(memory.device_tier["sum_count"][row, 0].sum()) == real + 29


def test_host_tier_holds_rows_at_full_rank_and_factors_when_gates_drop_ranks(config):
    keys, values, query = _pointed_keys(target=(98, 129))
    full = SeKV(max_span=16, anchor_fraction=0.3)
    memory = _memory(config, full, keys, values, torch.ones(1, 200), budget=100)
    host = memory.host_tier
    assert set(host) == {"rows_k", "rows_v"}  # every gate on: the rows, not their larger factors
    span_rows = int(memory.device_tier["sum_count"].sum())
    assert host["rows_k"].numel() <= span_rows * H * D * 1.1  # padding of uneven spans only
    exact_sel = full.select(memory, query)
    # gates keep 4 of 16 components for keys and values: the factors are stored, and a zoomed span comes
    # back as its best rank-4 approximation
    adapter = SeKVAdapter(4, H, D, proj_dim=4, share_projector=True)
    with torch.no_grad():
        adapter.rank_gate[:, :, :, 4:] = -1.0
    low = SeKV(adapter=adapter, max_span=16, anchor_fraction=0.3)
    memory_low = _memory(config, low, keys, values, torch.ones(1, 200), budget=100)
    assert {"coef_k", "basis_k", "coef_v", "basis_v"} <= set(memory_low.host_tier)
    assert "rows_k" not in memory_low.host_tier
    sel = low.select(memory_low, query)
    n = memory_low.device_tier["keys"].shape[2] + memory_low.device_tier["sum_keys"].shape[2]
    recalled = sel.keys[0, 0, n:][sel.bias[0, 0, n:] == 0]
    exact_recalled = exact_sel.keys[0, 0, n:][exact_sel.bias[0, 0, n:] == 0]
    assert recalled.shape == exact_recalled.shape
    assert (recalled - exact_recalled).abs().max() > 1e-3  # approximate...
    lo, hi = 98, 114  # ...with the error of a rank-4 SVD of one zoomed span
    u, sv, vh = torch.linalg.svd(keys[0, 0, lo:hi], full_matrices=False)
    best = (u[:, :4] * sv[:4]) @ vh[:4]
    assert torch.cdist(best, recalled, compute_mode="donot_use_mm_for_euclid_dist").min(-1).values.max() < 1e-4
