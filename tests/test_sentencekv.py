"""``sentencekv``: sentence boundaries (token ids, tokenizer-derived boundary ids, fixed-length fallback),
per-sentence mean keys, and sentence-level recall on hand-built tensors; plus runs through ``generate``
with real token ids (the generic invariants in test_method_invariants.py cover the fallback path)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import assert_all_tensors_in_tiers, load_tiny
from zoomkv import ZoomCache
from zoomkv.compat import generate_cache_kwargs
from zoomkv.errors import ConfigError
from zoomkv.memory import LayerMemory
from zoomkv.methods import get_method
from zoomkv.methods._segments import CLAUSE_MARKS, boundary_token_ids, segment_ids
from zoomkv.protocol.method import PrefillContext, Selection

DOT, NL = 3 + ord("."), 3 + ord("\n")  # the tiny byte tokenizer: byte b is id 3 + b


def make_layer(method, budget: int, keys: torch.Tensor, layer_idx: int = 2) -> LayerMemory:
    memory = ZoomCache(load_tiny()[0], method, budget).layers[layer_idx]
    memory.lazy_initialization(keys, keys)
    return memory


def context(keys, values, budget, input_ids=None, valid=None, groups=1, queries=None):
    b, h, t, d = keys.shape
    queries = torch.zeros(b, h * groups, t, d) if queries is None else queries
    return PrefillContext(2, 4, keys, values, queries, valid, budget, d**-0.5, groups, input_ids=input_ids)


def id_values(b, h, n, d, start=0):
    return torch.arange(start, start + n, dtype=torch.float32).view(1, 1, n, 1).expand(b, h, n, d).clone()


def row_ids(sel: Selection, b: int = 0, h: int = 0) -> list[int]:
    ids = sel.values[b, h, :, 0]
    if sel.bias is not None:
        ids = ids[torch.isfinite(sel.bias[b, h])]
    return [int(v) for v in ids.tolist()]




def sentences_along_axes(lengths: list[int], d: int = 16, seed: int = 0):
    """Keys whose sentence s points along axis s (noisy), and ids ending each sentence with a period."""
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    keys = torch.randn(1, 1, t, d, generator=g) * 0.05
    ids = torch.full((1, t), 3 + ord("a"))
    at = 0
    for s, n in enumerate(lengths):
        keys[0, 0, at : at + n, s] += 2.0
        ids[0, at + n - 1] = DOT
        at += n
    return keys, ids


# -- boundaries ------------------------------------------------------------------------------------------------
def test_boundary_ids_come_from_the_tokenizer_vocabulary():
    _, tok = load_tiny()
    assert boundary_token_ids(tok) == tuple(sorted(3 + ord(c) for c in ".!?\n"))
    clause = boundary_token_ids(tok, CLAUSE_MARKS)
    assert all(3 + ord(c) in clause for c in ".,;:!?\n") and 3 + ord("a") not in clause
    assert tok.bos_token_id not in clause


def test_sentences_end_after_punctuation_and_padding_belongs_to_none():
    ids = torch.tensor([[0, 0, 40, DOT, 41, 42, DOT, NL, 43],
                        [40, 41, DOT, 42, 43, 44, 45, DOT, 46]])
    valid = torch.ones_like(ids, dtype=torch.bool)
    valid[0, :2] = False
    boundary = torch.isin(ids, torch.tensor([DOT, NL])) & valid
    seg = segment_ids(2, 9, torch.device("cpu"), valid, boundary, None)
    assert seg.tolist() == [[-1, -1, 0, 0, 1, 1, 1, 2, 3], [0, 0, 0, 1, 1, 1, 1, 1, 2]]
    # the boundary token stays in the sentence it ends, and max_length cuts long sentences too
    seg = segment_ids(2, 9, torch.device("cpu"), valid, boundary, 3)
    assert seg[1].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 3]


def test_fixed_length_fallback_counts_from_the_first_real_token():
    valid = torch.tensor([[False, False, True, True, True, True, True], [True] * 7])
    seg = segment_ids(2, 7, torch.device("cpu"), valid, None, 2)
    assert seg.tolist() == [[-1, -1, 0, 0, 1, 1, 2], [0, 0, 1, 1, 2, 2, 3]]


def test_config_rejects_bad_settings():
    with pytest.raises(ConfigError):
        get_method("sentencekv", semantic_factor=0.5)
    with pytest.raises(ConfigError):
        get_method("sentencekv", boundary_token_ids=["x"])
    assert get_method("sentencekv", boundary_token_ids=[49, 13, 49]).config.boundary_token_ids == (13, 49)


# -- prefill ---------------------------------------------------------------------------------------------------
def test_each_sentence_gets_the_mean_of_its_kept_keys():
    keys, ids = sentences_along_axes([5, 7, 4])
    method = get_method("sentencekv", boundary_token_ids=[DOT])
    memory = make_layer(method, 64, keys)
    method.compress(memory, context(keys, id_values(1, 1, 16, 16), 64, input_ids=ids))
    assert memory.meta["token_boundaries"]
    sizes = memory.device_tier["sentence_sizes"][0, 0]
    assert sizes[:4].tolist() == [5, 7, 4, 0]  # sentence 3 is the one being generated: empty so far
    means = memory.device_tier["sentence_keys"][0, 0]
    torch.testing.assert_close(means[1], keys[0, 0, 5:12].mean(0))
    assert memory.host_tier["keys"].length == 16 and memory.device_tier["next_sentence"].tolist() == [3]
    assert_all_tensors_in_tiers(memory)


def test_prefilter_keeps_five_budgets_of_rows_on_the_host():
    torch.manual_seed(0)
    keys = torch.randn(1, 2, 300, 16)
    method = get_method("sentencekv")
    memory = make_layer(method, 40, keys)
    method.compress(memory, context(keys, keys.clone(), 40, queries=torch.randn(1, 4, 300, 16), groups=2))
    assert memory.host_tier["keys"].length == 200  # 5 x B rows; the rest are dropped for good
    assert memory.device_tier["recall_keys"].shape[2] == 40


# -- decode ----------------------------------------------------------------------------------------------------
def test_the_sentence_matching_the_query_comes_back_whole():
    lengths = [10, 10, 10, 10]
    keys, ids = sentences_along_axes(lengths)
    n = keys.shape[2]
    method = get_method("sentencekv", boundary_token_ids=[DOT], start_budget=2, recent_budget=2)
    budget = 2 + 2 + 10  # start, recent, and room for exactly one sentence
    memory = make_layer(method, budget, keys)
    method.compress(memory, context(keys, id_values(1, 1, n, 16), budget, input_ids=ids, groups=2))
    method.append(memory, torch.zeros(1, 1, 1, 16), id_values(1, 1, 1, 16, start=n))
    query = torch.zeros(1, 2, 1, 16)  # two query heads share the KV head
    query[..., 2] = 1.0  # sentence 2: rows 20..29
    sel = method.select(memory, query)
    assert sel.keys.shape[2] == budget and method.device_rows(memory) <= budget
    assert row_ids(sel) == [0, 1] + list(range(20, 30)) + [39, 40]  # start, sentence 2 whole, recent
    assert_all_tensors_in_tiers(memory)


def test_the_mean_query_of_the_open_sentence_ranks_sentences():
    keys, ids = sentences_along_axes([10, 10, 10])
    n = keys.shape[2]
    method = get_method("sentencekv", boundary_token_ids=[DOT], start_budget=0, recent_budget=1, segment_length=99)
    memory = make_layer(method, 11, keys)  # 1 recent + 10: one sentence
    method.compress(memory, context(keys, id_values(1, 1, n, 16), 11, input_ids=ids))
    picks = []
    for step, axis in enumerate([0, 0, 1, 1, 1]):  # the sentence being generated asks about 0, then 1
        method.append(memory, torch.zeros(1, 1, 1, 16), id_values(1, 1, 1, 16, start=n + step))
        query = torch.zeros(1, 1, 1, 16)
        query[..., axis] = 1.0
        picks.append(row_ids(method.select(memory, query))[:-1])
    sentence0, sentence1 = list(range(0, 10)), list(range(10, 20))
    assert picks[0] == picks[1] == sentence0
    assert picks[2] == sentence0  # this query alone points to sentence 1, the sentence's mean does not yet
    assert picks[4] == sentence1  # three of five queries: the mean now leans to sentence 1
    torch.testing.assert_close(memory.device_tier["query_sum"][0, 0], 2 * torch.eye(16)[0] + 3 * torch.eye(16)[1])


def test_generated_sentences_close_at_boundary_tokens_and_can_be_recalled():
    keys, ids = sentences_along_axes([8, 8])
    n = keys.shape[2]
    method = get_method("sentencekv", boundary_token_ids=[DOT], start_budget=0, recent_budget=1)
    memory = make_layer(method, 9, keys)
    method.compress(memory, context(keys, id_values(1, 1, n, 16), 9, input_ids=ids))
    cache = memory.cache
    generated = torch.zeros(6, 16)
    generated[:, 9] = 3.0  # a generated sentence about axis 9, ended by a period at its 6th token
    for i in range(6):
        cache.step_ids = torch.tensor([[DOT if i == 5 else 3 + ord("b")]])  # what the proposed hook records
        method.append(memory, generated[i].view(1, 1, 1, 16), id_values(1, 1, 1, 16, start=n + i))
        method.select(memory, torch.randn(1, 1, 1, 16))
    tier = memory.device_tier
    assert tier["next_sentence"].tolist() == [3] and tier["open_length"].tolist() == [0]
    assert tier["sentence_sizes"][0, 0, 2].item() == 6
    torch.testing.assert_close(tier["sentence_keys"][0, 0, 2], generated.mean(0))
    assert tier["query_sum"].abs().sum() == 0  # the new sentence starts with no query
    # a later query about axis 9 recalls the generated sentence (rows n..n+5) whole
    cache.step_ids = torch.tensor([[3 + ord("c")]])
    method.append(memory, torch.zeros(1, 1, 1, 16), id_values(1, 1, 1, 16, start=n + 6))
    query = torch.zeros(1, 1, 1, 16)
    query[..., 9] = 1.0
    assert row_ids(method.select(memory, query)) == [0, 1] + list(range(n, n + 7))


def test_without_generated_ids_a_sentence_closes_every_segment_length_steps():
    keys, ids = sentences_along_axes([8, 8])
    n = keys.shape[2]
    method = get_method("sentencekv", boundary_token_ids=[DOT], segment_length=4)
    memory = make_layer(method, 8, keys)
    method.compress(memory, context(keys, id_values(1, 1, n, 16), 8, input_ids=ids))
    for i in range(9):
        method.append(memory, torch.randn(1, 1, 1, 16), id_values(1, 1, 1, 16, start=n + i))
        sel = method.select(memory, torch.randn(1, 1, 1, 16))
        assert sel.keys.shape[2] == 8 and row_ids(sel)[-1] == n + i
    assert memory.device_tier["next_sentence"].tolist() == [4]  # 2 prompt sentences + 2 closed ones
    assert memory.device_tier["sentence_sizes"][0, 0, 2:4].tolist() == [4, 4]


def test_left_padding_is_never_a_sentence_row_nor_attended():
    keys, _ = sentences_along_axes([6, 6, 6, 6])
    b, t = 2, keys.shape[2]
    keys = keys.expand(b, 1, t, 16).clone()
    valid = torch.ones(b, t, dtype=torch.bool)
    valid[1, :9] = False
    keys[1, 0, :9] = 50.0  # padding rows would dominate any mean they joined
    method = get_method("sentencekv", start_budget=4, recent_budget=4)
    memory = make_layer(method, 16, keys)
    method.compress(memory, context(keys, id_values(b, 1, t, 16), 16, valid=valid))
    assert memory.device_tier["sentence_keys"][1].abs().max() < 10
    assert memory.device_tier["sentence_sizes"][1].sum() == t - 9
    for i in range(3):
        method.append(memory, torch.randn(b, 1, 1, 16), id_values(b, 1, 1, 16, start=t + i))
        sel = method.select(memory, torch.randn(b, 1, 1, 16))
        real = row_ids(sel, 1)
        assert all(r >= 9 for r in real) and real[:4] == [9, 10, 11, 12]  # start = first real rows
        assert len(row_ids(sel, 0)) == 16


# -- through generate ------------------------------------------------------------------------------------------
PROMPTS = ["The grass is green. The sky is blue!\nThe sun is yellow? Here we go. " * 2,
           "Pack my box. With five dozen liquor jugs."]


def _generate(model, enc, cache, new):
    return model.generate(**enc, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
                          output_scores=True, return_dict_in_generate=True, **generate_cache_kwargs(cache))


def _record_step_ids(model, cache):
    """Simulate the proposed runtime change: the ids of every forward call land on the cache."""
    def hook(module, args, kwargs):
        cache.step_ids = kwargs.get("input_ids")
    return model.register_forward_pre_hook(hook, with_kwargs=True)


def test_token_boundaries_through_generate_are_exact_at_large_budget_and_bounded_at_small():
    model, tok = load_tiny()
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    ref = _generate(model, enc, ZoomCache(model, "full"), 12)
    big = ZoomCache(model, "sentencekv", 4096, tokenizer=tok)
    out = _generate(model, enc, big, 12)
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.scores, ref.scores, strict=True):
        finite = torch.isfinite(b)
        assert torch.equal(finite, torch.isfinite(a)) and (a[finite] - b[finite]).abs().max() < 1e-4
    assert big.layers[0].meta["token_boundaries"]
    small = ZoomCache(model, "sentencekv", 24, tokenizer=tok)
    handle = _record_step_ids(model, small)
    try:
        _generate(model, enc, small, 30)  # the runtime raises if a step holds more than B rows
    finally:
        handle.remove()
    assert small.max_device_rows <= 24
    layer = small.layers[1]
    # sentences ended by generated punctuation (or not), and every kept row belongs to one
    assert int(layer.device_tier["sentence_sizes"].sum(-1).max()) <= layer.host_tier["keys"].length
