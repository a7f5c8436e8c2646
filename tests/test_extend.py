"""Compress once, ask many: a compressed ZoomCache takes more input of any length (a follow-up question, the
next chat turn, the next chunk of a long prompt) through ``generate()`` again on the same cache.

- With a budget covering everything, every registered method equals plain attention over three turns.
- At a small budget the device tier holds at most B rows per KV head at every step of every turn.
- Chunked prefill equals the one-shot prefill for ``full``, and bounds the peak device rows by B + chunk.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from tests.helpers import max_logit_diff
from tests.helpers import padded_batch as _batch
from tests.method_matrix import method_kwargs
from zoomkv import ZoomCache
from zoomkv.compat import generate_cache_kwargs
from zoomkv.methods import METHODS, get_method
from zoomkv.protocol.eviction import EvictionMethod
from zoomkv.protocol.method import KVMethod

BUDGETED = sorted(name for name, cls in METHODS.items() if cls.uses_budget)
TINY_MODELS = ["tiny-llama", "tiny-gemma3"]


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    return tmp_path_factory.mktemp("extend-matrix")


def turns(model, cache, first_ids, first_mask, follow_ups: list[int], new: int = 4, seed: int = 7):
    """Three turns on one cache: the prompt, then ``follow_ups[i]`` new random tokens after each answer."""
    g = torch.Generator().manual_seed(seed)
    ids, mask = first_ids, first_mask
    outs = []
    for n in [0, *follow_ups]:
        if n:
            extra = torch.randint(5, model.config.vocab_size, (ids.shape[0], n), generator=g)
            ids = torch.cat([ids, extra], dim=1)
            mask = torch.cat([mask, torch.ones_like(extra)], dim=1)
        kwargs = generate_cache_kwargs(cache)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0,
                             **kwargs)
        ids = out.sequences
        mask = torch.cat([mask, torch.ones(ids.shape[0], new, dtype=mask.dtype)], dim=1)
        outs.append(out)
    return outs


@pytest.mark.parametrize("name", BUDGETED)
def test_more_turns_with_a_large_budget_are_exactly_plain_attention(tiny, name, fixtures):
    model, _ = tiny
    ids, mask = _batch(model.config.vocab_size)
    ref = turns(model, DynamicCache(), ids, mask, [9, 17])
    method = get_method(name, **method_kwargs(name, model, fixtures))
    out = turns(model, ZoomCache(model, method, 4096), ids, mask, [9, 17])
    for turn, (a, b) in enumerate(zip(out, ref, strict=True)):
        assert torch.equal(a.sequences, b.sequences), (name, turn)
        assert max_logit_diff(a.scores, b.scores) < 1e-4, (name, turn)


@pytest.mark.parametrize("name", BUDGETED)
def test_more_turns_never_exceed_the_budget(tiny, name, fixtures):
    model, _ = tiny
    ids, mask = _batch(model.config.vocab_size, lengths=(90, 90))
    method = get_method(name, **method_kwargs(name, model, fixtures))
    budget = max(method.min_budget(), 40)
    cache = ZoomCache(model, method, budget)
    turns(model, cache, ids, mask, [23, 61])  # the runtime raises BudgetExceededError at any step over B
    zoom = [cache.layers[i] for i in cache.zoom_layer_indices
            if not method.dense_layer(i, cache.num_layers_total)]
    assert zoom and all(
        layer.max_device_rows <= method.layer_budget(layer.layer_idx, cache.num_layers_total, budget,
                                                     cache.zoom_layer_indices) for layer in zoom)
    assert cache.get_seq_length() == 90 + 4 + 23 + 4 + 61 + 4 - 1  # the last answer token is not fed back


@pytest.mark.parametrize("name", ["full", "snapkv", "quest", "oracle_topk"])
def test_chunked_prefill_with_a_large_budget_equals_the_one_shot_prefill(tiny, name):
    model, _ = tiny
    ids, mask = _batch(model.config.vocab_size, lengths=(70, 52))
    one = turns(model, ZoomCache(model, name, 4096), ids, mask, [30])
    chunked = turns(model, ZoomCache(model, name, 4096, prefill_chunk=16), ids, mask, [30])
    for a, b in zip(chunked, one, strict=True):
        assert torch.equal(a.sequences, b.sequences), name
        assert max_logit_diff(a.scores, b.scores) < 1e-4, name


@pytest.mark.parametrize("name", ["streamingllm", "snapkv", "quest", "oracle_topk", "sekv"])
def test_chunked_prefill_holds_at_most_budget_plus_chunk_rows(tiny, name):
    model, _ = tiny
    ids, mask = _batch(model.config.vocab_size, lengths=(200, 200))
    budget, chunk = 48, 32
    method = get_method(name)
    chunked = ZoomCache(model, method, budget, prefill_chunk=chunk)
    turns(model, chunked, ids, mask, [])
    one_shot = ZoomCache(model, get_method(name), budget)
    turns(model, one_shot, ids, mask, [])
    zoom = [i for i in chunked.zoom_layer_indices if not method.dense_layer(i, chunked.num_layers_total)]
    assert max(chunked.layers[i].peak_device_rows for i in zoom) <= budget + chunk
    assert min(one_shot.layers[i].peak_device_rows for i in zoom) >= 200  # the whole prompt at once
    report, full = chunked.memory_report(), one_shot.memory_report()
    assert report.peak_device_bytes < full.peak_device_bytes


def test_a_chunked_prefill_makes_room_for_the_rest_of_the_prompt_once(tiny, monkeypatch):
    """A pinned host tier (a GPU machine's) is made, at the first piece, with room for every row still to come,
    so later pieces append without growing (and page-locking again) the whole buffer; after the prompt, decode
    steps' room alone."""
    from zoomkv.memory import LayerMemory

    model, _ = tiny
    ids, mask = _batch(model.config.vocab_size, lengths=(200, 200))
    rooms = []
    real = LayerMemory.host_rows
    monkeypatch.setattr(LayerMemory, "host_rows", lambda self, *a, **k: rooms.append(self.host_room) or real(self, *a, **k))
    cache = ZoomCache(model, "quest", 48, prefill_chunk=32)
    turns(model, cache, ids, mask, [])
    from zoomkv.memory.layer import HOST_ROOM

    assert rooms and set(rooms) == {HOST_ROOM + 200 - 32}  # every host buffer made at the first piece
    assert cache.rows_to_come == 0 and cache.layers[-1].host_room == HOST_ROOM


def test_prefill_chunk_is_checked():
    from zoomkv.errors import ConfigError
    from zoomkv.models import load_model

    model, _ = load_model("tiny-llama")
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ConfigError, match="prefill_chunk"):
            ZoomCache(model, "full", prefill_chunk=bad)


DEFAULT_VICTIM = sorted(name for name, cls in METHODS.items()
                        if issubclass(cls, EvictionMethod) and cls._victim is EvictionMethod._victim)


@pytest.mark.parametrize("name", DEFAULT_VICTIM)
@pytest.mark.parametrize("stored,capacity,arriving", [(6, 8, 1), (6, 8, 2), (6, 8, 5), (8, 8, 3), (8, 8, 20), (3, 1, 4)])
def test_eviction_extend_in_one_gather_equals_row_by_row(name, stored, capacity, arriving):
    """The eviction family's vectorised extend leaves the layer exactly as appending the rows one at a time
    does, ties (equal scores, +inf, -inf padding) included."""
    from types import SimpleNamespace

    method = object.__new__(METHODS[name])  # extend reads no hyper-parameter (compresskv's profile is not needed)
    g = torch.Generator().manual_seed(stored * 100 + arriving)
    scores = torch.randint(0, 3, (2, 3, stored), generator=g).float()
    scores[0, 0, :2] = float("inf")
    scores[1, 2, 0] = float("-inf")

    def layer():
        keys = torch.randn(2, 3, stored, 4, generator=torch.Generator().manual_seed(1))
        return SimpleNamespace(device_tier={"keys": keys, "values": keys + 1, "scores": scores.clone()},
                               meta={"capacity": capacity})

    new = torch.randn(2, 3, arriving, 4, generator=g)
    one_by_one, at_once = layer(), layer()
    KVMethod.extend(method, one_by_one, new, new * 2)
    method.extend(at_once, new, new * 2)
    for key in ("keys", "values", "scores"):
        assert torch.equal(one_by_one.device_tier[key], at_once.device_tier[key]), key


def test_query_blocks_cover_every_position_within_the_bound(monkeypatch):
    from zoomkv.protocol import method as protocol

    query = torch.randn(2, 6, 50, 8)
    assert [b is query for b in protocol.query_blocks(query, 1000)] == [True]  # a decode step: one block, no copy
    monkeypatch.setattr(protocol, "SCORES_AT_ONCE", 2 * 6 * 7 * 100)
    blocks = list(protocol.query_blocks(query, 100))
    assert [b.shape[2] for b in blocks] == [7] * 7 + [1]
    assert torch.equal(torch.cat(blocks, dim=2), query)


@pytest.mark.parametrize("name", ["sekv", "sekv-torch", "oracle_topk", "oracle_topk-max", "quest", "quest-max"])
def test_a_long_chunk_scored_a_block_at_a_time_gives_the_same_answers(tiny, name, monkeypatch):
    """A chunk's votes summed block by block, and its attention a block of positions at a time, are the
    chunk scored at once (what keeps a 4K chunk over 32K rows from holding every query's scores)."""
    from zoomkv import native
    from zoomkv.protocol import method as protocol

    model, _ = tiny
    ids, mask = _batch(model.config.vocab_size, lengths=(200, 170))
    method, _, variant = name.partition("-")
    kwargs = {"group_score": "max"} if variant == "max" else {}  # oracle_topk and quest: the largest vote

    def run():
        cache = ZoomCache(model, get_method(method, **kwargs), 48, prefill_chunk=64)
        if variant != "torch":
            return turns(model, cache, ids, mask, [40])
        with native.torch_path():
            return turns(model, cache, ids, mask, [40])

    whole = run()
    monkeypatch.setattr(protocol, "SCORES_AT_ONCE", 1)  # one query position a block
    blocked = run()
    for a, b in zip(blocked, whole, strict=True):
        assert torch.equal(a.sequences, b.sequences), name
        assert max_logit_diff(a.scores, b.scores) < 1e-4, name
