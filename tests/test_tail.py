"""The softmax tail row: it weighs what the unselected rows weigh, costs one budget row, and vanishes
when everything is selected."""

from __future__ import annotations

import pytest
import torch

from zoomkv import ZoomCache
from zoomkv.compat import generate_cache_kwargs
from zoomkv.errors import ConfigError
from zoomkv.memory.attention import attend
from zoomkv.memory.tail import append_tail, init_tail, with_tail
from zoomkv.models import load_model
from zoomkv.protocol.method import PrefillContext, Selection


def _memory():
    model, _ = load_model("tiny-llama")
    return ZoomCache(model, "oracle_topk", 8, tail_summary=True).layers[1]


def test_tail_of_identical_rows_attends_exactly_like_them():
    memory = _memory()
    d = 4
    keys = torch.zeros(1, 1, 10, d)
    keys[0, 0, :6] = torch.tensor([1.0, 2.0, 0.0, -1.0])  # six identical rows, never selected
    keys[0, 0, 6:] = torch.randn(4, d)
    values = torch.randn(1, 1, 10, d)
    values[0, 0, :6] = torch.tensor([0.5, 0.5, -2.0, 1.0])
    ctx = PrefillContext(1, 4, keys, values, torch.zeros(1, 1, 10, d), None, 8, 1.0, 1)
    init_tail(memory, ctx)
    q = torch.randn(1, 1, 1, d)
    sel = with_tail(memory, Selection(keys[:, :, 6:], values[:, :, 6:]))
    assert sel.keys.shape[2] == 5  # 4 selected + 1 tail row
    assert sel.bias[0, 0, -1].item() == pytest.approx(torch.log(torch.tensor(6.0)).item())
    full = attend(q, Selection(keys, values), scaling=1.0)
    torch.testing.assert_close(attend(q, sel, scaling=1.0), full, atol=1e-5, rtol=1e-5)
    # a decode row counts into the sums
    append_tail(memory, keys[:, :, :1], values[:, :, :1])
    assert memory.device_tier["tail_count"].item() == 11


def test_tail_costs_one_budget_row_and_is_exact_at_large_budget():
    model, _ = load_model("tiny-llama")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 250, (2, 40), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0

    def run(cache):
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8,
                              do_sample=False, pad_token_id=0, **generate_cache_kwargs(cache))

    small = ZoomCache(model, "oracle_topk", 12, tail_summary=True)
    run(small)
    assert small.max_device_rows == 12  # 11 recalled + the tail row
    assert all(layer.meta["budget"] == 11 for layer in small.layers)
    ref = run(ZoomCache(model, "full"))
    assert torch.equal(run(ZoomCache(model, "oracle_topk", 4096, tail_summary=True)), ref)
    assert torch.equal(run(ZoomCache(model, "quest", 4096, tail_summary=True)), ref)


def test_tail_needs_a_recallable_method():
    model, _ = load_model("tiny-llama")
    with pytest.raises(ConfigError, match="recallable"):
        ZoomCache(model, "snapkv", 64, tail_summary=True)
