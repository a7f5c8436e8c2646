"""The runtime's rotary tables (``compat.rotary_frequencies``, ``zoomkv.protocol.rotary``): the same table as
the model's own rotary module, and keys rotated back by it are the keys the attention module made before RoPE."""

from __future__ import annotations

import pytest
import torch

from zoomkv import compat
from zoomkv.memory.replay import record_prefill
from zoomkv.models import load_model
from zoomkv.protocol import rotary


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3", "tiny-gemma3"])
def test_undo_gives_the_keys_before_rope(name):
    model, _ = load_model(name)
    layer = compat.layer_types(model.config).index("full_attention")
    attn = model.model.layers[layer].self_attn
    captured = {}
    norm = getattr(attn, "k_norm", None)
    hooked = norm if norm is not None else attn.k_proj  # the key just before RoPE
    handle = hooked.register_forward_hook(lambda m, a, out: captured.update(k=out))
    ids = torch.randint(3, 200, (1, 40))
    record = record_prefill(model, ids)
    handle.remove()
    ctx = record.contexts[layer]
    b, h, t, d = ctx.keys.shape
    before = captured["k"]
    # k_proj's output is [b, t, h·d]; a k_norm's [b, t, h, d] (Qwen3) or already [b, h, t, d] (Gemma 3)
    before = before if before.shape[1:3] == (h, t) else before.reshape(b, t, h, d).transpose(1, 2)
    table = compat.rotary_frequencies(model.config, layer)
    assert table is not None
    cos, sin = rotary.angles(torch.arange(t)[None, None], *table)
    assert torch.allclose(rotary.undo(ctx.keys.float(), cos, sin), before.float(), atol=1e-5)
    assert torch.allclose(rotary.apply(before.float(), cos, sin), ctx.keys.float(), atol=1e-5)


def test_scaled_tables_round_trip():
    x = torch.randn(2, 3, 10, 8)
    cos, sin = rotary.angles(torch.arange(10)[None, None] + 5, 1.0 / 1000 ** (torch.arange(0, 8, 2) / 8), 1.7)
    assert torch.allclose(rotary.undo(rotary.apply(x, cos, sin), cos, sin), x, atol=1e-5)


def test_tables_the_runtime_cannot_rebuild_are_none():
    config = load_model("tiny-llama")[0].config
    config.rope_parameters = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    assert compat.rotary_frequencies(config, 0) is None
    config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    assert compat.rotary_frequencies(config, 0) is None
