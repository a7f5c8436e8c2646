"""Behaviour of the recallable methods ``quest`` and ``clusterkv`` on hand-built tensors, plus a few
end-to-end runs through ``generate`` for what only the runtime exercises (dense layers, reclustering)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import assert_all_tensors_in_tiers, load_tiny, padded_batch
from zoomkv import ZoomCache
from zoomkv.compat import generate_cache_kwargs
from zoomkv.memory import LayerMemory
from zoomkv.methods import get_method
from zoomkv.methods._kmeans import cosine_kmeans
from zoomkv.methods.quest import page_bounds, page_upper_bound
from zoomkv.models import load_model
from zoomkv.protocol.dense import ROOM
from zoomkv.protocol.method import PrefillContext, Selection


def make_layer(method, budget: int, keys: torch.Tensor, layer_idx: int = 2) -> LayerMemory:
    """A LayerMemory owned by a real ZoomCache (tiny-llama: 4 layers), initialised for ``keys``' shape."""
    memory = ZoomCache(load_tiny()[0], method, budget).layers[layer_idx]
    memory.lazy_initialization(keys, keys)
    return memory


def prefill(method, memory, keys, values, budget, valid=None, groups=1, layer_idx=2) -> None:
    b, h, t, d = keys.shape
    queries = torch.zeros(b, h * groups, t, d)
    ctx = PrefillContext(layer_idx, 4, keys, values, queries, valid, budget, d**-0.5, groups)
    method.compress(memory, ctx)
    memory.compressed = True


def row_ids(sel: Selection, b: int = 0, h: int = 0) -> list[int]:
    """The rows a selection attends to, read back from values that carry their row id in channel 0."""
    ids = sel.values[b, h, :, 0]
    if sel.bias is not None:
        ids = ids[torch.isfinite(sel.bias[b, h])]
    return [int(v) for v in ids.tolist()]


def id_values(b: int, h: int, n: int, d: int, start: int = 0) -> torch.Tensor:
    return torch.arange(start, start + n, dtype=torch.float32).view(1, 1, n, 1).expand(b, h, n, d).clone()




def snapkv_keeps(queries: torch.Tensor, keys: torch.Tensor, budget: int, window: int = 8) -> set[int]:
    """Rows a SnapKV-style eviction would keep: the observation window plus the rows its queries attend
    to most. Used only to show that a planted needle is one an eviction method drops."""
    q = queries[0, 0, -window:]
    attn = torch.softmax(q @ keys[0, 0].T / math.sqrt(keys.shape[-1]), dim=-1).sum(0)
    n = keys.shape[2]
    attn[n - window :] = float("inf")
    return set(attn.topk(budget).indices.tolist())


# ---------------------------------------------------------------------------------------------------------
# Quest
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(5))
def test_quest_bound_is_an_upper_bound_of_every_page(seed):
    g = torch.Generator().manual_seed(seed)
    b, h, groups, n, d, ps = 2, 2, 3, 75, 8, 16
    keys = torch.randn(b, h, n, d, generator=g) * torch.rand(1, 1, 1, d, generator=g) * 3
    valid = torch.ones(b, n, dtype=torch.bool)
    valid[1, :21] = False  # left padding spanning a whole page and part of the next
    # Padding rows carry huge keys: if they widened the bounds the check below would still pass, so
    # compare against bounds recomputed from the valid rows only as well.
    keys[1, :, :21] = 100.0
    q = torch.randn(b, h, groups, d, generator=g)
    lo, hi, page_valid = page_bounds(keys, valid, ps)
    bound = page_upper_bound(q, lo, hi)  # [b, h, g, P]
    pages = math.ceil(n / ps)
    assert bound.shape == (b, h, groups, pages)
    assert page_valid[1].tolist() == [False, True, True, True, True]
    for bi in range(b):
        for p in range(pages):
            rows = [r for r in range(p * ps, min(n, (p + 1) * ps)) if valid[bi, r]]
            if not rows:
                continue
            page_keys = keys[bi, :, rows]  # [h, r, d]
            true_max = (q[bi] @ page_keys.transpose(-1, -2)).amax(-1)  # [h, g]
            assert (bound[bi, :, :, p] >= true_max - 1e-4).all()
            torch.testing.assert_close(lo[bi, :, p], page_keys.amin(1))
            torch.testing.assert_close(hi[bi, :, p], page_keys.amax(1))


def test_quest_recalls_the_needle_page_and_the_newest_page():
    method = get_method("quest")
    torch.manual_seed(0)
    b, h, n, d = 1, 2, 100, 16
    keys = torch.randn(b, h, n, d) * 0.1
    needle = torch.zeros(d)
    needle[3] = 4.0
    keys[0, :, 37] = needle
    values = id_values(b, h, n, d)
    memory = make_layer(method, 32, keys)
    prefill(method, memory, keys, values, 32)
    query = torch.zeros(b, h, 1, d)
    query[..., 3] = 1.0
    sel = method.select(memory, query)
    assert sel.keys.shape[2] <= 32 and method.device_rows(memory) <= 32
    for head in range(h):
        ids = row_ids(sel, 0, head)
        assert ids == list(range(32, 48)) + list(range(96, 100))  # needle page 2 + the newest (partial) page 6
    assert_all_tensors_in_tiers(memory)


def test_quest_pages_update_on_append_and_stay_recallable():
    method = get_method("quest")
    torch.manual_seed(1)
    b, h, n, d = 2, 2, 20, 8
    keys = torch.randn(b, h, n, d)
    valid = torch.ones(b, n, dtype=torch.bool)
    valid[1, :18] = False  # sequence 1: one real prompt token
    memory = make_layer(method, 32, keys)
    prefill(method, memory, keys, id_values(b, h, n, d), 32, valid=valid)
    new = torch.randn(b, h, 30, d) * 0.3
    new[:, :, 2] = 0.0
    new[:, :, 2, 5] = 5.0  # a needle generated while decoding (row 22)
    for i in range(30):
        method.append(memory, new[:, :, i : i + 1], id_values(b, h, 1, d, start=n + i))
        rows = memory.host_tier["keys"].view()
        host_valid = memory.device_tier["valid"].view()[:, 0, :, 0]  # the rows' padding mask: an index
        lo, hi, page_valid = page_bounds(rows, host_valid, 16)
        assert memory.device_tier["page_min"].length == math.ceil((n + i + 1) / 16)
        torch.testing.assert_close(memory.device_tier["page_min"].view(), lo)
        torch.testing.assert_close(memory.device_tier["page_max"].view(), hi)
        assert torch.equal(memory.device_tier["page_valid"].view()[:, 0, :, 0], page_valid)
    # The needle generated while decoding (row 22, page 1) is recalled once a query points at it.
    query = torch.zeros(b, 4, 1, d)  # 4 query heads over 2 KV heads
    query[..., 5] = 1.0
    sel = method.select(memory, query)
    for bi in range(b):
        assert 22 in row_ids(sel, bi, 0)
        # padding rows are never attended
        assert all(r >= 18 for r in row_ids(sel, 1, 0))
    assert_all_tensors_in_tiers(memory)


def test_quest_padding_only_page_is_never_chosen():
    method = get_method("quest")
    b, h, n, d = 2, 1, 64, 4
    keys = torch.zeros(b, h, n, d)
    keys[:, :, :16, 0] = 50.0  # page 0 would win every query... but for sequence 1 it is padding
    valid = torch.ones(b, n, dtype=torch.bool)
    valid[1, :16] = False
    memory = make_layer(method, 32, keys)
    prefill(method, memory, keys, id_values(b, h, n, d), 32, valid=valid)
    sel = method.select(memory, torch.tensor([1.0, 0, 0, 0]).view(1, 1, 1, d).expand(b, 1, 1, d))
    assert row_ids(sel, 0) == list(range(0, 16)) + list(range(48, 64))
    assert all(r >= 16 for r in row_ids(sel, 1))


# ---------------------------------------------------------------------------------------------------------
# ClusterKV
# ---------------------------------------------------------------------------------------------------------
def direction_keys(b: int, h: int, block: int, directions: int, d: int, sinks: int = 16, seed: int = 0):
    """Random sink rows, then ``directions`` contiguous blocks of keys along orthogonal axes (noisy)."""
    g = torch.Generator().manual_seed(seed)
    n = sinks + block * directions
    keys = torch.randn(b, h, n, d, generator=g) * 0.05
    keys[:, :, :sinks] = torch.randn(b, h, sinks, d, generator=g)
    for k in range(directions):
        keys[:, :, sinks + k * block : sinks + (k + 1) * block, k] += 2.0 + torch.rand(b, h, block, generator=g)
    return keys


def test_kmeans_groups_keys_by_direction():
    keys = direction_keys(2, 3, 40, 4, 16, sinks=0)
    found = cosine_kmeans(keys, None, 4, 20)
    labels = found.labels.view(2, 3, 4, 40)
    assert (labels == labels[..., :1]).all()  # each direction is one cluster
    assert labels[..., 0].unique(dim=-1).shape[-1] == 4  # and the four are distinct
    assert (found.sizes == 40).all()


def test_clusterkv_recalls_the_cluster_the_query_points_to():
    method = get_method("clusterkv", cluster_size=40)
    b, h, block, dirs, d = 1, 2, 40, 4, 16
    keys = direction_keys(b, h, block, dirs, d)
    n = keys.shape[2]
    values = id_values(b, h, n, d)
    budget = 16 + block + 8  # sinks, one whole cluster, and room to spare
    memory = make_layer(method, budget, keys)
    prefill(method, memory, keys, values, budget)
    assert memory.device_tier["centroids"].shape[2] == 4
    method.append(memory, torch.zeros(b, h, 1, d), id_values(b, h, 1, d, start=n))
    query = torch.zeros(b, 2 * h, 1, d)
    query[..., 2] = 1.0  # direction 2: rows 96..135
    sel = method.select(memory, query)
    assert sel.keys.shape[2] <= budget and method.device_rows(memory) <= budget
    for head in range(h):
        ids = row_ids(sel, 0, head)
        assert ids[:16] == list(range(16))  # sinks first
        assert set(range(16 + 2 * block, 16 + 3 * block)) <= set(ids)  # the whole cluster of direction 2
        assert ids[-1] == n  # the newest, pending row last
        assert ids == sorted(ids)
    assert_all_tensors_in_tiers(memory)


def test_clusterkv_cuts_the_boundary_cluster_by_member_score():
    method = get_method("clusterkv", cluster_size=40)
    b, h, block, d = 1, 1, 40, 16
    keys = direction_keys(b, h, block, 2, d)
    # Inside direction 0, the members' scores along axis 0 rise with the row index.
    keys[0, 0, 16 : 16 + block, 0] = torch.linspace(1.0, 5.0, block)
    n = keys.shape[2]
    budget = 16 + 10 + 1  # sinks + 10 recalled + the pending row
    memory = make_layer(method, budget, keys)
    prefill(method, memory, keys, id_values(b, h, n, d), budget)
    method.append(memory, torch.zeros(b, h, 1, d), id_values(b, h, 1, d, start=n))
    query = torch.zeros(b, 2, 1, d)
    query[..., 0] = 1.0
    sel = method.select(memory, query)
    assert sel.keys.shape[2] == budget
    assert row_ids(sel) == list(range(16)) + list(range(16 + block - 10, 16 + block)) + [n]


def test_clusterkv_sinks_are_the_first_real_tokens_and_padding_never_clusters():
    method = get_method("clusterkv", cluster_size=20)
    b, h, n, d = 2, 2, 70, 8
    torch.manual_seed(3)
    keys = torch.randn(b, h, n, d)
    valid = torch.ones(b, n, dtype=torch.bool)
    valid[1, :30] = False
    keys[1, :, :30] = 1000.0  # padding rows would drag any centroid they joined
    memory = make_layer(method, 40, keys)
    prefill(method, memory, keys, id_values(b, h, n, d), 40, valid=valid)
    perm, sizes = memory.device_tier["perm"], memory.device_tier["cluster_sizes"]
    assert sizes[0].sum(-1).tolist() == [n - 16] * h
    assert sizes[1].sum(-1).tolist() == [n - 30 - 16] * h
    clustered = perm[1, :, : n - 46]
    assert bool((clustered >= 46).all())  # neither padding nor sinks of sequence 1
    assert memory.device_tier["centroids"].abs().max() < 100
    for _ in range(3):
        method.append(memory, torch.randn(b, h, 1, d), torch.zeros(b, h, 1, d))
        sel = method.select(memory, torch.randn(b, 2 * h, 1, d))
        assert row_ids(sel, 1)[:16] == list(range(30, 46))
        assert row_ids(sel, 0)[:16] == list(range(16))
        assert sel.keys.shape[2] <= 40


def test_clusterkv_short_sequence_masks_missing_sinks():
    method = get_method("clusterkv")
    b, h, n, d = 2, 1, 24, 4
    keys = torch.randn(b, h, n, d)
    valid = torch.ones(b, n, dtype=torch.bool)
    valid[1, :19] = False  # 5 real tokens: fewer than 16 sinks
    memory = make_layer(method, 64, keys)
    prefill(method, memory, keys, id_values(b, h, n, d), 64, valid=valid)
    method.append(memory, torch.randn(b, h, 1, d), id_values(b, h, 1, d, start=n))
    sel = method.select(memory, torch.randn(b, 2, 1, d))
    assert row_ids(sel, 1) == [19, 20, 21, 22, 23, 24]
    assert row_ids(sel, 0) == list(range(25))


def test_clusterkv_reclusters_generated_rows_and_recalls_them():
    method = get_method("clusterkv", cluster_size=4, recluster_interval=8)
    b, h, d = 1, 2, 16
    keys = direction_keys(b, h, 8, 2, d)  # 32 rows: 16 sinks + 16 clustered
    n = keys.shape[2]
    budget = 16 + 8 + 8 + 1
    memory = make_layer(method, budget, keys)
    prefill(method, memory, keys, id_values(b, h, n, d), budget)
    clusters0 = memory.device_tier["centroids"].shape[2]
    torch.manual_seed(0)
    needle = torch.zeros(b, h, 1, d)
    needle[..., 9] = 5.0
    for i in range(20):
        key = needle if i == 3 else torch.randn(b, h, 1, d) * 0.05
        method.append(memory, key, id_values(b, h, 1, d, start=n + i))
        sel = method.select(memory, torch.randn(b, 2 * h, 1, d))
        assert sel.keys.shape[2] <= budget and method.device_rows(memory) <= budget
    meta = memory.meta
    assert meta["reclusters"] == 2 and meta["pending"] == 4  # clustered after 8 and 16 generated rows
    assert memory.device_tier["centroids"].shape[2] == clusters0 + 4  # 2 new clusters each time
    assert int(memory.device_tier["cluster_sizes"].sum(-1).max()) == 16 + 16
    assert memory.device_tier["perm"].shape[-1] == n + 16
    # the needle (row n + 3) now sits in a decode cluster, off the device; a query for it recalls it
    query = torch.zeros(b, 2 * h, 1, d)
    query[..., 9] = 1.0
    sel = method.select(memory, query)
    assert n + 3 in row_ids(sel, 0, 0) and n + 3 in row_ids(sel, 0, 1)
    assert_all_tensors_in_tiers(memory)


@pytest.mark.parametrize("budget", [18, 19, 25, 40, 77])
def test_clusterkv_never_exceeds_a_small_budget(budget):
    """Pending generated rows are clustered early enough that sinks + pending + recall fit any budget."""
    method = get_method("clusterkv", cluster_size=8)
    b, h, n, d = 2, 2, 60, 8
    torch.manual_seed(budget)
    keys = torch.randn(b, h, n, d)
    valid = torch.ones(b, n, dtype=torch.bool)
    valid[0, :7] = False
    memory = make_layer(method, budget, keys)
    prefill(method, memory, keys, id_values(b, h, n, d), budget, valid=valid)
    for i in range(50):
        method.append(memory, torch.randn(b, h, 1, d), id_values(b, h, 1, d, start=n + i))
        sel = method.select(memory, torch.randn(b, 2 * h, 1, d))
        assert method.device_rows(memory) <= budget
        assert sel.keys.shape[2] <= budget
        ids = row_ids(sel, 1)
        assert ids == sorted(ids) and len(set(ids)) == len(ids) and ids[-1] == n + i
        assert len(ids) == min(budget, n + i + 1)  # the budget is used fully
    assert memory.meta["reclusters"] > 0
    assert_all_tensors_in_tiers(memory)


# ---------------------------------------------------------------------------------------------------------
# Both
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["quest", "clusterkv"])
def test_recalls_a_needle_that_eviction_drops(name):
    """The needle gets no attention from the prompt's own last queries, so an eviction method (scoring
    rows by the observation window's attention) drops it; a later query that needs it recalls it."""
    g = torch.Generator().manual_seed(7)
    b, h, n, d, budget = 1, 1, 160, 16, 48
    keys = torch.randn(b, h, n, d, generator=g)
    keys[..., 15] = 0.0
    keys[0, 0, 70] = 0.0
    keys[0, 0, 70, 15] = 6.0  # the needle: along an axis no other key uses
    queries = torch.randn(b, h, n, d, generator=g)
    queries[..., 15] = 0.0  # the prompt never looks for it
    assert 70 not in snapkv_keeps(queries, keys, budget)
    method = get_method(name, cluster_size=16) if name == "clusterkv" else get_method(name)
    memory = make_layer(method, budget, keys)
    ctx = PrefillContext(2, 4, keys, id_values(b, h, n, d), queries, None, budget, d**-0.5, 1)
    method.compress(memory, ctx)
    method.append(memory, torch.randn(b, h, 1, d, generator=g), id_values(b, h, 1, d, start=n))
    query = torch.zeros(b, 2, 1, d)
    query[..., 15] = 1.0
    sel = method.select(memory, query)
    assert 70 in row_ids(sel)
    assert sel.keys.shape[2] <= budget


@pytest.mark.parametrize("name", ["quest", "clusterkv"])
def test_dense_layers_keep_everything_and_can_be_turned_off(name):
    keys = torch.randn(1, 2, 40, 8)
    values = id_values(1, 2, 40, 8)
    method = get_method(name)
    assert method.dense_layer(0, 4) and method.dense_layer(1, 4) and not method.dense_layer(2, 4)
    memory = make_layer(method, 18, keys, layer_idx=1)
    prefill(method, memory, keys, values, 18, layer_idx=1)
    method.append(memory, torch.randn(1, 2, 1, 8), id_values(1, 2, 1, 8, start=40))
    sel = method.select(memory, torch.randn(1, 4, 1, 8))
    assert sel.bias is None and row_ids(sel) == list(range(41))
    # every row, in buffers with room for the next ones (zoomkv.protocol.dense: written in place)
    assert method.device_rows(memory) == 40 + ROOM and not memory.host_tier

    strict = get_method(name, dense_layers=0)
    assert not strict.dense_layer(0, 4)
    memory = make_layer(strict, 18, keys, layer_idx=0)
    prefill(strict, memory, keys, values, 18, layer_idx=0)
    strict.append(memory, torch.randn(1, 2, 1, 8), id_values(1, 2, 1, 8, start=40))
    sel = strict.select(memory, torch.randn(1, 4, 1, 8))
    assert not sel.use_model_mask and strict.device_rows(memory) <= 18


def _padded(vocab: int, lengths: tuple[int, ...]):
    return padded_batch(vocab, lengths, seed=5)


def _generate(model, ids, mask, cache, new: int):
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                          do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0,
                          **generate_cache_kwargs(cache))


@pytest.mark.parametrize(
    "name,overrides",
    [("quest", {"dense_layers": 0, "page_size": 4}),
     ("clusterkv", {"dense_layers": 0, "recluster_interval": 5, "cluster_size": 6, "num_sinks": 8})],
)
def test_large_budget_is_exactly_full_across_page_and_cluster_updates(name, overrides):
    """Every layer compressed, pages filling up and generated rows reclustered several times, one
    sequence shorter than the sinks: at a budget covering everything it is still exactly full attention."""
    model = load_tiny()[0]
    ids, mask = _padded(model.config.vocab_size, (40, 6))
    ref = _generate(model, ids, mask, ZoomCache(model, "full"), new=14)
    cache = ZoomCache(model, name, 4096, **overrides)
    out = _generate(model, ids, mask, cache, new=14)
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.scores, ref.scores, strict=True):
        finite = torch.isfinite(a)
        assert torch.equal(finite, torch.isfinite(b))
        assert (a[finite] - b[finite]).abs().max() < 1e-4
    if name == "clusterkv":
        assert all(layer.meta["reclusters"] == 2 for layer in cache.layers)
    assert [r.kind for r in cache.memory_report().layers] == ["zoom"] * 4


@pytest.mark.parametrize("name", ["quest", "clusterkv"])
def test_budget_exactly_the_context_is_exactly_full(name):
    """B = prompt + generated rows (not a multiple of Quest's page): still exactly full attention."""
    model = load_model("tiny-qwen3")[0]
    ids, mask = _padded(model.config.vocab_size, (40, 31))
    ref = _generate(model, ids, mask, ZoomCache(model, "full"), new=12)
    cache = ZoomCache(model, name, 40 + 11, dense_layers=0)  # the 12th token is never fed back
    out = _generate(model, ids, mask, cache, new=12)
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.scores, ref.scores, strict=True):
        finite = torch.isfinite(a)
        assert (a[finite] - b[finite]).abs().max() < 1e-4
    assert cache.max_device_rows == 51


@pytest.mark.parametrize("name", ["quest", "clusterkv"])
def test_generate_reports_dense_layers_and_meets_a_strict_budget(name):
    model = load_tiny()[0]
    ids, mask = _padded(model.config.vocab_size, (80, 64))
    cache = ZoomCache(model, name, 20)
    _generate(model, ids, mask, cache, new=6)
    assert [r.kind for r in cache.memory_report().layers] == ["dense", "dense", "zoom", "zoom"]
    overrides = {"recluster_interval": 4} if name == "clusterkv" else {}
    strict = ZoomCache(model, name, 20, dense_layers=0, **overrides)
    _generate(model, ids, mask, strict, new=12)  # the runtime raises if any layer goes over budget
    assert strict.max_device_rows <= 20
    report = strict.memory_report()
    assert all(r.kind == "zoom" for r in report.layers) and report.device_bytes < report.full_kv_bytes


def test_kmeans_is_deterministic_and_vectorised_over_heads():
    torch.manual_seed(0)
    keys = torch.randn(2, 3, 500, 16)
    members = torch.ones(2, 500, dtype=torch.bool)
    members[1, :50] = False
    a = cosine_kmeans(keys, members, 7, 20)
    b = cosine_kmeans(keys, members, 7, 20)
    assert torch.equal(a.labels, b.labels)
    # one (batch, head) alone clusters exactly as it does inside the batch
    alone = cosine_kmeans(keys[1:2, 2:3], members[1:2], 7, 20)
    assert torch.equal(alone.labels, a.labels[1:2, 2:3])
    assert (a.labels[1, :, :50] == 7).all() and a.sizes[1].sum(-1).tolist() == [450] * 3
    # the centroid is the members' mean raw key
    member = a.labels[0, 0] == 3
    torch.testing.assert_close(a.centroids[0, 0, 3], keys[0, 0][member].mean(0))
    assert F.cosine_similarity(keys[0, 0][member], a.centroids[0, 0, 3][None], dim=-1).mean() > 0
