"""Invariants every registered method must keep (run automatically for each method in the registry, with
what it needs from tests/method_matrix.py — e.g. a calibration profile):

- with a budget covering the whole context it is exactly ``full`` (greedy tokens equal, logits within 1e-4);
- with a small budget the device tier never holds more rows per KV head than the layer's budget, at any
  decode step, and the memory report counts no more device bytes than the rows it may hold.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import greedy as _generate
from tests.helpers import max_logit_diff
from tests.helpers import padded_batch as _batch
from tests.method_matrix import PROFILE_BUILDERS, method_kwargs
from zoomkv import ZoomCache
from zoomkv.memory import LayerMemory
from zoomkv.methods import METHODS, get_method

BUDGETED = sorted(name for name, cls in METHODS.items() if cls.uses_budget)


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    return tmp_path_factory.mktemp("method-matrix")


def make(name: str, model, folder):
    return get_method(name, **method_kwargs(name, model, folder))


def test_every_method_needing_a_profile_has_a_builder():
    assert {n for n, c in METHODS.items() if c.needs_profile} <= set(PROFILE_BUILDERS)


TINY_MODELS = ["tiny-llama", "tiny-gemma3"]  # the `tiny` fixture (conftest.py) runs each test on both


@pytest.mark.parametrize("name", BUDGETED)
def test_large_budget_is_exactly_full(tiny, name, fixtures):
    model, _ = tiny
    ids, mask = _batch(model.config.vocab_size)
    ref = _generate(model, ids, mask, ZoomCache(model, "full"))
    out = _generate(model, ids, mask, ZoomCache(model, make(name, model, fixtures), 4096))
    assert torch.equal(out.sequences, ref.sequences), name
    assert max_logit_diff(out.scores, ref.scores) < 1e-4, name


@pytest.mark.parametrize("name", BUDGETED)
def test_small_budget_never_exceeded(tiny, name, fixtures):
    model, _ = tiny
    ids, mask = _batch(model.config.vocab_size, lengths=(90, 90))
    method = make(name, model, fixtures)
    budget = max(method.min_budget(), 40)
    cache = ZoomCache(model, method, budget)
    inner = method.select
    checked = []

    def select(memory, query):
        sel = inner(memory, query)
        n = cache.num_layers_total
        if not method.dense_layer(memory.layer_idx, n):
            cap = method.layer_budget(memory.layer_idx, n, budget, cache.zoom_layer_indices)
            assert method.device_rows(memory) <= cap
            assert sel.keys.shape[2] <= cap  # every attended row counts, summary rows included
            checked.append(memory.layer_idx)
        return sel

    method.select = select
    _generate(model, ids, mask, cache, new=24)
    assert checked, "no decode step was checked"
    zoom = [layer for layer in cache.layers if isinstance(layer, LayerMemory)]
    caps = [method.layer_budget(layer.layer_idx, cache.num_layers_total, budget, cache.zoom_layer_indices)
            for layer in zoom]
    assert sum(caps) <= budget * len(zoom)  # spread over layers or not, L·B in total
    report = cache.memory_report()
    compressed = [r for r in report.layers if r.kind == "zoom"]  # dense layers keep everything by design
    assert compressed and sum(r.device_bytes for r in compressed) < sum(r.full_kv_bytes for r in compressed)


RECALLABLE = sorted(n for n in BUDGETED if METHODS[n].recallable)


@pytest.mark.parametrize("name", RECALLABLE)
def test_tail_summary_keeps_the_invariants(tiny, name, fixtures):
    model, _ = tiny
    ids, mask = _batch(model.config.vocab_size)
    ref = _generate(model, ids, mask, ZoomCache(model, "full"))
    out = _generate(model, ids, mask, ZoomCache(model, make(name, model, fixtures), 4096, tail_summary=True))
    assert torch.equal(out.sequences, ref.sequences), name
    method = make(name, model, fixtures)
    budget = max(method.min_budget() + 1, 40)
    cache = ZoomCache(model, method, budget, tail_summary=True)
    _generate(model, ids, mask, cache, new=16)  # the runtime raises if any step holds more than B rows
    assert 0 < cache.max_device_rows <= budget + sum(
        cache.layers[i].max_device_rows for i in cache.zoom_layer_indices
        if method.dense_layer(i, cache.num_layers_total)
    )
