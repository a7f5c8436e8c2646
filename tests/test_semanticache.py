"""``semanticache``: greedy seed-based clustering inside chunks, merged rows with proportional attention,
the per-head threshold search that meets the budget, and decode-time merging, on hand-built tensors; plus
a run through ``generate`` with real token ids (the generic invariants cover the fallback path)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers import load_tiny
from zoomkv import ZoomCache
from zoomkv.compat import generate_cache_kwargs
from zoomkv.errors import ConfigError
from zoomkv.memory import LayerMemory
from zoomkv.memory.attention import attend
from zoomkv.methods import get_method
from zoomkv.methods.semanticache import (
    ChunkSimilarity,
    cluster_counts,
    fit_threshold,
    greedy_seed_clusters,
    merge_clusters,
    proportional_bias,
)
from zoomkv.protocol.method import PrefillContext, Selection

COMMA, DOT = 3 + ord(","), 3 + ord(".")


def make_layer(method, budget: int, keys: torch.Tensor, layer_idx: int = 2) -> LayerMemory:
    memory = ZoomCache(load_tiny()[0], method, budget).layers[layer_idx]
    memory.lazy_initialization(keys, keys)
    return memory


def context(keys, values, budget, input_ids=None, valid=None):
    b, h, t, d = keys.shape
    return PrefillContext(2, 4, keys, values, torch.zeros(b, h, t, d), valid, budget, d**-0.5, 1, input_ids=input_ids)


def axis(d: int, i: int, scale: float = 1.0) -> torch.Tensor:
    v = torch.zeros(d)
    v[i] = scale
    return v


# -- proportional attention ----------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 5, 13])
def test_a_merged_row_of_n_identical_keys_attends_exactly_like_the_n_originals(n):
    g = torch.Generator().manual_seed(n)
    d = 8
    others = torch.randn(1, 1, 4, d, generator=g)
    same_k, same_v = torch.randn(d, generator=g), torch.randn(d, generator=g)
    keys = torch.cat([others[:, :, :2], same_k.expand(1, 1, n, d), others[:, :, 2:]], dim=2)
    values = torch.cat([torch.randn(1, 1, 2, d, generator=g), same_v.expand(1, 1, n, d),
                        torch.randn(1, 1, 2, d, generator=g)], dim=2)
    # One chunk per group: the n identical keys cluster together at any threshold, the others stay alone.
    chunk = torch.tensor([[0, 1] + [2] * n + [3, 4]])
    label = greedy_seed_clusters(keys, chunk, torch.tensor([[0.99]]))
    mk, mv, size, _ = merge_clusters(keys, values, label, chunk)
    assert size[0, 0].tolist() == [1, 1, n, 1, 1]
    merged = Selection(mk, mv, proportional_bias(size, torch.float32))
    assert merged.bias[0, 0, 2].item() == pytest.approx(math.log(n))
    query = torch.randn(1, 3, 1, d, generator=g)  # three query heads on the one KV head
    full = attend(query, Selection(keys, values), scaling=d**-0.5)
    torch.testing.assert_close(attend(query, merged, scaling=d**-0.5), full, atol=1e-6, rtol=1e-6)
    # without the log n the merged row would be under-weighted
    plain = attend(query, Selection(mk, mv), scaling=d**-0.5)
    assert (plain - full).abs().max() > 1e-3


# -- greedy seed-based clustering ----------------------------------------------------------------------------
def test_gsc_seeds_gather_similar_keys_and_never_cross_chunks():
    d = 4
    a, b_, c = axis(d, 0), axis(d, 1), axis(d, 0) * 0.9 + axis(d, 2) * 0.1
    keys = torch.stack([a, a * 2, b_, c, a, a, b_]).view(1, 1, 7, d)
    chunk = torch.tensor([[0, 0, 0, 0, 1, 1, 1]])
    label = greedy_seed_clusters(keys, chunk, torch.tensor([[0.95]]))
    # row 0 seeds {0, 1, 3} (cosine, not norm); row 2 its own; chunk 1 starts afresh although row 4 == row 0
    assert label[0, 0].tolist() == [0, 0, 2, 0, 4, 4, 6]
    assert cluster_counts(label).tolist() == [[4]]
    # a stricter threshold leaves the near-duplicate row 3 alone
    assert greedy_seed_clusters(keys, chunk, torch.tensor([[0.999]]))[0, 0].tolist() == [0, 0, 2, 3, 4, 4, 6]


def test_gsc_ignores_padding_and_uses_one_threshold_per_head():
    torch.manual_seed(0)
    keys = torch.randn(2, 2, 12, 8)
    chunk = torch.tensor([[-1, -1, -1, 0, 0, 0, 0, 1, 1, 1, 1, 1], [0] * 6 + [1] * 6])
    thr = torch.tensor([[-2.0, 1.0], [-2.0, 0.5]])
    label = greedy_seed_clusters(keys, chunk, thr)
    assert (label[0, :, :3] == -1).all()
    assert cluster_counts(label)[:, 0].tolist() == [2, 2]  # threshold below every cosine: one per chunk
    assert cluster_counts(label)[0, 1].item() == 9  # above every cosine: one per real row
    # each head alone clusters exactly as it does inside the batch
    alone = greedy_seed_clusters(keys[1:, 1:], chunk[1:], thr[1:, 1:])
    assert torch.equal(alone, label[1:, 1:])


def test_threshold_search_keeps_the_configured_value_when_it_fits_and_lowers_it_when_not():
    torch.manual_seed(1)
    keys = torch.randn(1, 2, 40, 8)
    keys[0, 0] = keys[0, 0, :1] + 0.01 * torch.randn(40, 8)  # head 0: near-identical keys
    chunk = torch.zeros(1, 40, dtype=torch.long)
    thr = fit_threshold(ChunkSimilarity.build(keys, chunk), 0.8, target=10, steps=12)
    assert thr[0, 0].item() == pytest.approx(0.8)  # head 0 fits at the configured threshold
    assert thr[0, 1].item() < 0.8
    counts = cluster_counts(greedy_seed_clusters(keys, chunk, thr))
    assert (counts <= 10).all() and counts[0, 1] >= 5  # head 1 uses its rows, not just one cluster


def test_config_rejects_bad_settings():
    with pytest.raises(ConfigError):
        get_method("semanticache", threshold=1.5)
    with pytest.raises(ConfigError):
        get_method("semanticache", window=0)


# -- prefill and decode --------------------------------------------------------------------------------------
def clause_keys(clauses: int, length: int, d: int = 16, seed: int = 0):
    """Clause c's keys point along axis c (noisy); ids end every clause with a comma."""
    g = torch.Generator().manual_seed(seed)
    t = clauses * length
    keys = torch.randn(1, 1, t, d, generator=g) * 0.05
    ids = torch.full((1, t), 3 + ord("a"))
    for c in range(clauses):
        keys[0, 0, c * length : (c + 1) * length, c] += 2.0
        ids[0, (c + 1) * length - 1] = COMMA
    return keys, ids


def test_prompt_is_merged_per_clause_within_the_budget():
    keys, ids = clause_keys(6, 10)  # 60 rows: 6 clauses of 10 similar keys
    values = torch.randn(1, 1, 60, 16)
    method = get_method("semanticache", boundary_token_ids=[COMMA], window=4, threshold=0.8, sinks=0)
    memory = make_layer(method, 12, keys)
    method.compress(memory, context(keys, values, 12, input_ids=ids))
    tier = memory.device_tier
    assert tier["keys"].shape[2] <= 12 and not memory.host_tier
    # 4 window rows exact; the 56 before merge into one row per clause (the last clause lost 4 to the window)
    assert tier["sizes"][0, 0].tolist() == [10, 10, 10, 10, 10, 6, 1, 1, 1, 1]
    assert tier["chunks"][0, 0].tolist() == [0, 1, 2, 3, 4, 5, 5, 5, 5, 5]
    torch.testing.assert_close(tier["keys"][0, 0, 1], keys[0, 0, 10:20].mean(0))
    torch.testing.assert_close(tier["values"][0, 0, 5], values[0, 0, 50:56].mean(0))
    torch.testing.assert_close(tier["keys"][0, 0, 6:], keys[0, 0, 56:])
    assert memory.meta["thresholds"] == [[pytest.approx(0.8)]]  # fits without lowering it


def test_by_default_it_merges_only_as_much_as_the_budget_demands():
    keys, ids = clause_keys(6, 10)
    values = torch.randn(1, 1, 60, 16)
    method = get_method("semanticache", boundary_token_ids=[COMMA], window=4, sinks=0)
    memory = make_layer(method, 40, keys)  # 36 merged rows for 56 prompt rows: 20 merges needed, not 46
    method.compress(memory, context(keys, values, 40, input_ids=ids))
    sizes = memory.device_tier["sizes"][0, 0]
    assert 30 <= int((sizes > 0).sum()) <= 40 and sizes.sum().item() == 60
    assert memory.meta["thresholds"][0][0] > 0.8
    fixed = get_method("semanticache", boundary_token_ids=[COMMA], window=4, threshold=0.8, sinks=0)
    other = make_layer(fixed, 40, keys)
    fixed.compress(other, context(keys, values, 40, input_ids=ids))
    assert int((other.device_tier["sizes"] > 0).sum()) == 10  # the fixed threshold merges every clause


def test_sinks_stay_exact_in_front_and_are_never_merged_while_decoding():
    keys, ids = clause_keys(6, 10)
    b = 2
    keys = keys.expand(b, 1, 60, 16).clone()
    valid = torch.ones(b, 60, dtype=torch.bool)
    valid[1, :7] = False
    method = get_method("semanticache", boundary_token_ids=[COMMA], window=4, sinks=3)
    memory = make_layer(method, 16, keys)
    method.compress(memory, context(keys, torch.randn(b, 1, 60, 16), 16, input_ids=ids.expand(b, 60), valid=valid))
    tier = memory.device_tier
    torch.testing.assert_close(tier["keys"][0, 0, :3], keys[0, 0, :3])
    torch.testing.assert_close(tier["keys"][1, 0, :3], keys[1, 0, 7:10])  # the first *real* tokens
    assert tier["sizes"][:, 0, :3].tolist() == [[1, 1, 1], [1, 1, 1]]
    for _ in range(20):
        method.append(memory, keys[:, :, 3:4], torch.randn(b, 1, 1, 16))  # new rows just like the sinks
        method.select(memory, torch.randn(b, 1, 1, 16))
        assert tier["sizes"][:, 0, :3].tolist() == [[1, 1, 1], [1, 1, 1]]
    assert tier["sizes"][0].sum().item() == 80 and tier["sizes"][1].sum().item() == 73


def test_a_sequence_shorter_than_the_window_is_kept_once_and_exact():
    torch.manual_seed(3)
    b, t, d = 2, 60, 8
    keys = torch.randn(b, 1, t, d)
    valid = torch.ones(b, t, dtype=torch.bool)
    valid[1, :57] = False  # three real tokens, all inside the newest window
    method = get_method("semanticache", window=8, sinks=4)
    memory = make_layer(method, 16, keys)
    method.compress(memory, context(keys, torch.randn(b, 1, t, d), 16, valid=valid))
    sizes = memory.device_tier["sizes"]
    assert sizes[1].sum().item() == 3 and sizes[0].sum().item() == t
    torch.testing.assert_close(memory.device_tier["keys"][1, 0, -3:], keys[1, 0, -3:])


def test_too_many_chunks_are_grouped_so_one_row_each_fits():
    keys, ids = clause_keys(12, 5)  # 12 clauses of 5 rows, budget 8 with a window of 2: 6 merged rows
    method = get_method("semanticache", boundary_token_ids=[COMMA], window=2)
    memory = make_layer(method, 8, keys)
    method.compress(memory, context(keys, torch.randn(1, 1, 60, 16), 8, input_ids=ids))
    sizes = memory.device_tier["sizes"][0, 0]
    assert memory.device_tier["keys"].shape[2] <= 8
    assert sizes.sum().item() == 60 and sizes[-2:].tolist() == [1, 1]


def test_decode_merges_the_most_similar_adjacent_pair_and_conserves_mass():
    keys, ids = clause_keys(4, 6)
    method = get_method("semanticache", boundary_token_ids=[COMMA], window=3, segment_length=4)
    memory = make_layer(method, 10, keys)
    method.compress(memory, context(keys, torch.randn(1, 1, 24, 16), 10, input_ids=ids))
    tier = memory.device_tier
    total = tier["sizes"].sum().item()
    assert total == 24
    g = torch.Generator().manual_seed(0)
    for i in range(12):
        key = torch.randn(1, 1, 1, 16, generator=g)
        method.append(memory, key, torch.randn(1, 1, 1, 16, generator=g))
        sel = method.select(memory, torch.randn(1, 1, 1, 16))
        assert sel.keys.shape[2] <= 10 and method.device_rows(memory) <= 10
        assert tier["sizes"].sum().item() == total + i + 1  # every row is still represented, once
        torch.testing.assert_close(tier["keys"][:, :, -1:], key)  # the newest row is exact
        assert tier["sizes"][0, 0, -3:].tolist() == [1, 1, 1]  # the window stays exact
    assert sel.bias is not None and torch.isfinite(sel.bias).all()


def test_padding_is_never_kept_or_attended_and_its_slots_are_reused_first():
    torch.manual_seed(2)
    b, t, d = 2, 30, 8
    keys = torch.randn(b, 1, t, d)
    valid = torch.ones(b, t, dtype=torch.bool)
    valid[1, :14] = False
    keys[1, 0, :14] = 100.0  # padding would dominate any mean it joined
    method = get_method("semanticache", window=4)
    memory = make_layer(method, 12, keys)
    method.compress(memory, context(keys, torch.randn(b, 1, t, d), 12, valid=valid))
    tier = memory.device_tier
    assert tier["sizes"][1].sum().item() == t - 14 and tier["keys"][1].abs().max() < 50
    for _ in range(4):
        method.append(memory, torch.randn(b, 1, 1, d), torch.randn(b, 1, 1, d))
        sel = method.select(memory, torch.randn(b, 1, 1, d))
        assert sel.keys.shape[2] <= 12
        empty = tier["sizes"] == 0
        assert torch.equal(torch.isinf(sel.bias), empty)
    assert tier["sizes"][1].sum().item() == t - 14 + 4


def test_token_chunks_through_generate_are_exact_at_large_budget_and_bounded_at_small():
    model, tok = load_tiny()
    prompts = ["The grass is green, the sky is blue; the sun is yellow. Here we go, there and back. " * 2,
               "Pack my box, with five dozen jugs."]
    enc = tok(prompts, return_tensors="pt", padding=True)

    def run(cache, new):
        return model.generate(**enc, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
                              output_scores=True, return_dict_in_generate=True, **generate_cache_kwargs(cache))

    ref = run(ZoomCache(model, "full"), 10)
    out = run(ZoomCache(model, "semanticache", 4096, tokenizer=tok), 10)
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.scores, ref.scores, strict=True):
        finite = torch.isfinite(b)
        assert torch.equal(finite, torch.isfinite(a)) and (a[finite] - b[finite]).abs().max() < 1e-4
    small = ZoomCache(model, "semanticache", 24, tokenizer=tok)
    run(small, 20)  # the runtime raises if a step holds more than B rows
    assert small.max_device_rows <= 24
    layer = small.layers[2]
    assert layer.meta["boundary_ids"] and layer.device_tier["sizes"].sum(-1).max().item() == enc["input_ids"].shape[1] + 19
