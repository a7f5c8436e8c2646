"""What makes each eviction method that method, on hand-built tensors (plus a few short generate runs):
streamingllm's sinks + sliding window, snapkv's window vote and max pooling, pyramidkv's layer budgets,
chunkkv's whole chunks and index reuse, h2o's accumulated heavy hitters; padding never attended, budgets
too small refused, nothing held outside the tiers."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.helpers import max_logit_diff, padded_batch, tensors_in
from zoomkv import ZoomCache
from zoomkv.compat import generate_cache_kwargs
from zoomkv.errors import BudgetError
from zoomkv.memory import LayerMemory
from zoomkv.methods import get_method
from zoomkv.methods.pyramidkv import pyramid_budgets
from zoomkv.models import load_model
from zoomkv.protocol import eviction
from zoomkv.protocol.method import KVMethod, PrefillContext, Selection

EVICTION = ["streamingllm", "snapkv", "pyramidkv", "chunkkv", "h2o"]
NEG_INF = float("-inf")


@pytest.fixture(scope="module")
def llama():
    model, _ = load_model("tiny-llama")
    return model


def _rows(length: int, d: int = 4, batch: int = 1, offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero keys and values whose channel 0 is the row's position (+ offset), so kept rows can be read back."""
    keys = torch.zeros(batch, 1, length, d)
    values = torch.zeros(batch, 1, length, d)
    values[..., 0] = torch.arange(length, dtype=torch.float32) + offset
    return keys, values


def _prefill(memory: LayerMemory, method: KVMethod, keys, values, queries, budget: int, valid=None,
             layer_idx: int = 0, num_layers: int = 1) -> None:
    memory.lazy_initialization(keys, values)
    ctx = PrefillContext(layer_idx, num_layers, keys, values, queries, valid, budget, 1.0,
                         queries.shape[1] // keys.shape[1])
    method.compress(memory, ctx)
    memory.compressed = True


def _kept(memory: LayerMemory, batch: int = 0) -> list[int]:
    return [int(v) for v in memory.device_tier["values"][batch, 0, :, 0].tolist()]


def _step(memory: LayerMemory, method: KVMethod, position: int, query=None, key=None) -> Selection:
    """One decode step: append row ``position`` (zero key unless given), then select."""
    d = memory.device_tier["keys"].shape[-1]
    b = memory.device_tier["keys"].shape[0]
    new_k = torch.zeros(b, 1, 1, d) if key is None else key
    new_v = torch.zeros(b, 1, 1, d)
    new_v[..., 0] = position
    method.append(memory, new_k, new_v)
    return method.select(memory, torch.zeros(b, 1, 1, d) if query is None else query)


def _memory(model, method: KVMethod, budget: int, layer: int = 0) -> LayerMemory:
    return ZoomCache(model, method, budget).layers[layer]


# -- streamingllm -------------------------------------------------------------------------------------------
def test_streamingllm_keeps_sinks_and_recent_rows_and_slides(llama):
    method = get_method("streamingllm")
    memory = _memory(llama, method, 8)
    keys, values = _rows(20)
    _prefill(memory, method, keys, values, torch.randn(1, 1, 20, 4), 8)
    assert _kept(memory) == [0, 1, 2, 3, 16, 17, 18, 19]
    for pos in (20, 21, 22):
        sel = _step(memory, method, pos)
        assert sel.keys.shape[2] == 8
    assert _kept(memory) == [0, 1, 2, 3, 19, 20, 21, 22]  # the oldest non-sink rows left, the sinks stayed
    assert memory.host_bytes == 0 and "scores" not in memory.device_tier  # unpadded: keys and values only


def test_streamingllm_sinks_are_the_first_real_tokens(llama):
    method = get_method("streamingllm")
    memory = _memory(llama, method, 8)
    keys, values = _rows(20, batch=3)
    valid = torch.ones(3, 20, dtype=torch.bool)
    valid[1, :5] = False  # 15 real tokens: more than the budget
    valid[2, :14] = False  # 6 real tokens: fewer than the budget
    _prefill(memory, method, keys, values, torch.randn(3, 1, 20, 4), 8, valid=valid)
    assert _kept(memory, 1) == [5, 6, 7, 8, 16, 17, 18, 19]
    assert _kept(memory, 2) == [12, 13, 14, 15, 16, 17, 18, 19]  # all 6 real rows, 2 padding rows masked
    sel = method.select(memory, torch.zeros(3, 1, 1, 4))
    assert torch.isinf(sel.bias[2, 0, :2]).all() and (sel.bias[2, 0, 2:] == 0).all()
    sel = _step(memory, method, 20)
    assert _kept(memory, 2) == [13, 14, 15, 16, 17, 18, 19, 20]  # padding goes first, never a real row
    assert _kept(memory, 1) == [5, 6, 7, 8, 17, 18, 19, 20]


# -- snapkv -------------------------------------------------------------------------------------------------
def _snap_case(length: int = 20, window: int = 4):
    """Window queries look along channel 0; row 9 is a strong peak, row 3 a weaker one."""
    keys, values = _rows(length)
    keys[0, 0, 9, 0] = 6.0
    keys[0, 0, 3, 0] = 3.0
    queries = torch.zeros(1, 1, length, 4)
    queries[0, 0, -window:, 0] = 1.0
    return keys, values, queries


def test_snapkv_keeps_what_the_window_attends_to(llama):
    method = get_method("snapkv", window=4, kernel_size=1)
    memory = _memory(llama, method, 6)
    _prefill(memory, method, *_snap_case(), 6)
    assert _kept(memory) == [3, 9, 16, 17, 18, 19]  # the two peaks + the observation window


def test_snapkv_max_pooling_keeps_neighbours_of_a_peak(llama):
    method = get_method("snapkv", window=4)  # kernel 7, max pooling
    memory = _memory(llama, method, 11)
    _prefill(memory, method, *_snap_case(), 11)
    # 7 prefix rows: the peak at 9 and its neighbours 6..12, which outrank the weaker peak at 3 only
    # because max pooling hands them the peak's score.
    assert _kept(memory) == [6, 7, 8, 9, 10, 11, 12, 16, 17, 18, 19]
    unpooled = get_method("snapkv", window=4, kernel_size=1)
    memory = _memory(llama, unpooled, 11)
    _prefill(memory, unpooled, *_snap_case(), 11)
    assert 3 in _kept(memory)


def test_snapkv_scores_gqa_groups_and_full_causal_rows():
    """The vote of a KV head sums its query heads; each window row's softmax spans its causal prefix."""
    torch.manual_seed(0)
    b, kv, g, t, w, d = 2, 2, 3, 12, 4, 5
    keys, queries = torch.randn(b, kv, t, d), torch.randn(b, kv * g, t, d)
    valid = torch.ones(b, t, dtype=torch.bool)
    valid[1, :3] = False
    ctx = PrefillContext(0, 1, keys, keys, queries, valid, 8, 0.5, g)
    got = eviction.observation_scores(ctx, w)
    ref = torch.zeros(b, kv, t)
    for bi in range(b):
        for h in range(kv * g):
            for i in range(t - w, t):
                allowed = torch.arange(t) <= i
                allowed &= valid[bi]
                logits = (keys[bi, h // g] @ queries[bi, h, i]) * 0.5
                ref[bi, h // g] += torch.softmax(logits.masked_fill(~allowed, NEG_INF), 0)
    torch.testing.assert_close(got, ref)


def test_snapkv_evicts_lowest_prompt_row_while_decoding(llama):
    method = get_method("snapkv", window=4, kernel_size=1)
    memory = _memory(llama, method, 6)
    _prefill(memory, method, *_snap_case(), 6)
    _step(memory, method, 20)
    assert _kept(memory) == [9, 16, 17, 18, 19, 20]  # the weaker peak goes first
    _step(memory, method, 21)
    assert _kept(memory) == [16, 17, 18, 19, 20, 21]
    _step(memory, method, 22)  # no prompt row outside the window left: the oldest leaves
    assert _kept(memory) == [17, 18, 19, 20, 21, 22]


# -- pyramidkv ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layers,budget", [(30, 256), (4, 40), (32, 128), (18, 33), (2, 2048)])
def test_pyramid_budgets_decrease_with_depth_and_sum_to_l_times_b(layers, budget):
    method = get_method("pyramidkv")
    caps = [method.layer_budget(i, layers, budget) for i in range(layers)]
    assert sum(caps) == layers * budget
    assert all(a >= b for a, b in zip(caps, caps[1:], strict=False))
    assert min(caps) >= method.min_budget()
    if budget - 32 >= 40:  # no clamping: the top layer gets about (B - window) / beta non-window rows
        assert caps[-1] - 32 == pytest.approx((budget - 32) / 20, abs=1)
        assert caps[0] > budget > caps[-1]


def test_pyramid_over_compressed_layers_only():
    method = get_method("pyramidkv")
    zoom = [5, 11, 17]  # Gemma 3's full-attention layers out of 18
    caps = [method.layer_budget(i, 18, 256, zoom_layers=zoom) for i in zoom]
    assert caps == list(pyramid_budgets(3, 256, 32, 20.0)) and sum(caps) == 3 * 256
    assert caps[0] > caps[1] > caps[2]


def test_pyramidkv_layers_hold_their_budgets_during_generation(llama):
    ids = torch.randint(5, llama.config.vocab_size, (1, 90), generator=torch.Generator().manual_seed(0))
    cache = ZoomCache(llama, "pyramidkv", 40)
    llama.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                   pad_token_id=0, **generate_cache_kwargs(cache))
    caps = [cache.method.layer_budget(i, 4, 40) for i in range(4)]
    assert caps == [47, 42, 38, 33]
    assert [layer.max_device_rows for layer in cache.layers] == caps


# -- chunkkv ------------------------------------------------------------------------------------------------
def _chunk_case(peaks: dict[int, float], length: int = 40, window: int = 4, offset: float = 0.0):
    keys, values = _rows(length, offset=offset)
    for row, score in peaks.items():
        keys[0, 0, row, 0] = score
    queries = torch.zeros(1, 1, length, 4)
    queries[0, 0, -window:, 0] = 1.0
    return keys, values, queries


CHUNK_PEAKS = {14: 8.0, 31: 3.0, 33: 2.5, 35: 2.0, 30: 1.5}


def test_chunkkv_keeps_whole_chunks(llama):
    method = get_method("chunkkv", window=4, reuse_layers=1)
    memory = _memory(llama, method, 14)
    _prefill(memory, method, *_chunk_case(CHUNK_PEAKS), 14)
    assert _kept(memory) == list(range(10, 20)) + [36, 37, 38, 39]  # chunk 10..19 whole, not the top tokens
    # 3 more rows: the next-best chunk (30..35) fills them with its best-scored rows
    memory = _memory(llama, method, 17)
    _prefill(memory, method, *_chunk_case(CHUNK_PEAKS), 17)
    assert _kept(memory) == list(range(10, 20)) + [31, 33, 35, 36, 37, 38, 39]


def test_chunkkv_next_layer_reuses_indices(llama):
    method = get_method("chunkkv", window=4)  # reuse_layers=2: layers 0+1 and 2+3 share
    cache = ZoomCache(llama, method, 14)
    layer0, layer1, layer2 = cache.layers[0], cache.layers[1], cache.layers[2]
    _prefill(layer0, method, *_chunk_case({14: 8.0}), 14, num_layers=4)
    assert "reuse_indices" in layer0.device_tier  # published (and counted) until the group's last layer reads it
    # layer 1's own scores would pick chunk 20..29; it reuses layer 0's selection, gathering its own rows
    _prefill(layer1, method, *_chunk_case({24: 8.0}, offset=100.0), 14, layer_idx=1, num_layers=4)
    assert _kept(layer1) == [100 + i for i in [*range(10, 20), 36, 37, 38, 39]]
    assert layer1.meta["reused_from"] == 0
    assert "reuse_indices" not in layer0.device_tier and "reuse_scores" not in layer0.device_tier
    _prefill(layer2, method, *_chunk_case({24: 8.0}), 14, layer_idx=2, num_layers=4)
    assert _kept(layer2) == [*range(20, 30), 36, 37, 38, 39]  # a new group computes its own


def test_chunkkv_evicts_a_chunk_at_a_time_while_decoding(llama):
    method = get_method("chunkkv", window=4, reuse_layers=1, chunk_size=5)
    memory = _memory(llama, method, 14)
    _prefill(memory, method, *_chunk_case({12: 8.0, 27: 5.0}), 14)
    assert _kept(memory) == [*range(10, 15), *range(25, 30), 36, 37, 38, 39]
    for pos in range(40, 45):
        _step(memory, method, pos)
    assert _kept(memory) == [*range(10, 15), 36, 37, 38, 39, *range(40, 45)]  # the weaker chunk left whole


# -- h2o ------------------------------------------------------------------------------------------------------
def test_h2o_accumulated_scores_match_a_naive_reference(monkeypatch):
    monkeypatch.setattr(eviction, "_SCORE_BLOCK_ELEMENTS", 64)  # force many query chunks
    torch.manual_seed(1)
    b, kv, g, t, d = 2, 2, 2, 10, 3
    keys, queries = torch.randn(b, kv, t, d), torch.randn(b, kv * g, t, d)
    valid = torch.ones(b, t, dtype=torch.bool)
    valid[0, :4] = False
    ctx = PrefillContext(0, 1, keys, keys, queries, valid, 8, 0.7, g)
    got = eviction.accumulated_scores(ctx)
    ref = torch.zeros(b, kv, t)
    for bi in range(b):
        for h in range(kv * g):
            logits = queries[bi, h] @ keys[bi, h // g].T * 0.7
            allowed = torch.ones(t, t, dtype=torch.bool).tril() & valid[bi][None, :] & valid[bi][:, None]
            probs = torch.softmax(logits.masked_fill(~allowed, NEG_INF), -1).nan_to_num(0.0)
            ref[bi, h // g] += probs.sum(0)
    ref = ref.masked_fill(~valid[:, None, :], NEG_INF)
    torch.testing.assert_close(got, ref)
    # once per prefill: a copy of the context (another method or budget replaying it) reuses the scores, and
    # whoever changes its copy does not change the next one's
    got.zero_()
    again = eviction.accumulated_scores(dataclasses.replace(ctx, keys=keys.clone()))
    torch.testing.assert_close(again, ref)
    monkeypatch.setattr(torch, "softmax", None)  # nothing is recomputed
    torch.testing.assert_close(eviction.accumulated_scores(dataclasses.replace(ctx)), ref)


def test_h2o_keeps_heavy_hitters_and_evicts_while_decoding(llama):
    method = get_method("h2o")
    memory = _memory(llama, method, 6)  # 3 heavy + 3 recent
    keys, values = _rows(20)
    keys[0, 0, 2, 0] = 5.0  # every prompt query looks at row 2
    keys[0, 0, 18, 1] = 6.0  # decode queries will look at row 18
    queries = torch.zeros(1, 1, 20, 4)
    queries[..., 0] = 1.0
    _prefill(memory, method, keys, values, queries, 6)
    assert _kept(memory) == [0, 1, 2, 17, 18, 19]  # row 2 the heaviest; 0 and 1 gather early attention
    scores = memory.device_tier["scores"][0, 0]
    assert scores[2] == scores.max()
    query = torch.zeros(1, 1, 1, 4)
    query[..., 1] = 2.0
    for pos in range(20, 26):
        sel = _step(memory, method, pos, query=query)
        assert sel.keys.shape[2] == 6
    # row 18 earned its place while decoding and outlived the recent window; row 1 (weak heavy) and the
    # rows nobody attends to were evicted
    assert _kept(memory) == [0, 2, 18, 23, 24, 25]


# -- shared: padding, budgets, memory -------------------------------------------------------------------------
def _method_small(name: str) -> KVMethod:
    small = {"streamingllm": {}, "snapkv": {"window": 4}, "pyramidkv": {"window": 4},
             "chunkkv": {"window": 4, "chunk_size": 5, "reuse_layers": 1}, "h2o": {}}
    return get_method(name, **small[name])


@pytest.mark.parametrize("name", EVICTION)
@pytest.mark.parametrize("real", [22, 6])
def test_padding_rows_never_kept_or_attended(llama, name, real):
    method = _method_small(name)
    budget = 12
    memory = _memory(llama, method, budget)
    torch.manual_seed(2)
    keys, values = _rows(30, batch=2)
    keys += torch.randn_like(keys)
    valid = torch.ones(2, 30, dtype=torch.bool)
    valid[1, : 30 - real] = False
    _prefill(memory, method, keys, values, torch.randn(2, 1, 30, 4), budget, valid=valid)
    cap = method.layer_budget(0, 1, budget)
    for step in range(4):
        sel = method.select(memory, torch.randn(2, 1, 1, 4)) if step == 0 else _step(memory, method, 30 + step)
        kept = memory.device_tier["values"][1, 0, :, 0]
        padding = kept < 30 - real
        if real > cap:
            assert not padding.any(), f"{name} kept padding rows {kept[padding].tolist()}"
        else:
            # a sequence shorter than the budget keeps all its real rows; the padding it keeps is masked
            assert {int(p) for p in kept[~padding] if p < 30} == set(range(30 - real, 30))
        if padding.any():
            assert torch.isneginf(sel.bias[1, 0, padding]).all()
        if sel.bias is not None:
            assert not torch.isinf(sel.bias[1, 0, ~padding]).any()
            assert not torch.isinf(sel.bias[0]).any()
        assert memory.device_tier["keys"].shape[2] <= cap


@pytest.mark.parametrize("name,too_small", [("streamingllm", 4), ("snapkv", 32), ("pyramidkv", 32),
                                            ("chunkkv", 32), ("h2o", 1)])
def test_min_budget_errors(llama, name, too_small):
    assert get_method(name).min_budget() == too_small + 1
    with pytest.raises(BudgetError, match="at least"):
        ZoomCache(llama, name, too_small)
    ZoomCache(llama, name, too_small + 1)  # the smallest budget the method can meet is accepted


def test_fractional_budget_too_small_for_the_prompt(llama):
    ids = torch.randint(5, llama.config.vocab_size, (1, 70))
    cache = ZoomCache(llama, "snapkv", 0.1)  # 7 rows for this prompt: under the 32-row window
    with pytest.raises(BudgetError, match="at least 33"):
        llama.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=2,
                       pad_token_id=0, **generate_cache_kwargs(cache))


def _padded(vocab: int, lengths=(60, 41)):
    return padded_batch(vocab, lengths, seed=3)


def _generate(model, ids, mask, cache, new: int):
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                          do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0,
                          **generate_cache_kwargs(cache))


@pytest.mark.parametrize("name", ["streamingllm", "snapkv", "chunkkv", "h2o"])
def test_budget_exactly_the_context_is_full_attention(llama, name):
    """B = prompt + generated rows (the last token is never fed back): nothing is evicted, outputs equal."""
    ids, mask = _padded(llama.config.vocab_size)
    new = 8
    ref = _generate(llama, ids, mask, ZoomCache(llama, "full"), new)
    out = _generate(llama, ids, mask, ZoomCache(llama, name, ids.shape[1] + new - 1), new)
    assert torch.equal(out.sequences, ref.sequences)
    assert max_logit_diff(out.scores, ref.scores) < 1e-4  # a suppressed token (-inf) must stay suppressed


@pytest.mark.parametrize("name", EVICTION)
def test_everything_held_is_in_the_device_tier(llama, name):
    ids, mask = _padded(llama.config.vocab_size, lengths=(80, 64))
    cache = ZoomCache(llama, name, 40)
    _generate(llama, ids, mask, cache, 6)
    for layer in cache.layers:
        state = {k: v for k, v in vars(layer).items() if k != "cache"}
        held = sum(t.nbytes for t in tensors_in(state))
        assert held == layer.device_bytes, "a tensor is held outside the device tier"
        assert layer.host_bytes == 0
        assert set(layer.device_tier) <= {"keys", "values", "scores"}  # chunkkv's reuse indices are gone
        rows = layer.device_tier["keys"].shape[2]
        assert rows == cache.method.layer_budget(layer.layer_idx, 4, 40)
        assert layer.device_tier["keys"].nbytes < layer.full_kv_bytes / 2
    if name == "chunkkv":
        assert [layer.meta.get("reused_from") for layer in cache.layers] == [None, 0, None, 2]
