"""A decode step's selection compiles as one graph: no graph break, no value read back to Python.

What lets a GPU step be captured in a CUDA graph (``torch.compile(mode="reduce-overhead")``) is that the
selection is a fixed sequence of tensor ops with shapes Python already knows. ``torch.compile(fullgraph=True)``
fails on any ``.item()``, data-dependent shape or untraceable call, so compiling each recallable method's
``select`` on the CPU (its torch path: what a GPU runs) holds that line, and the compiled step picks what the eager
one picks.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import padded_batch
from zoomkv import ZoomCache, native
from zoomkv.compat import generate_cache_kwargs
from zoomkv.memory import LayerMemory
from zoomkv.models import load_model
from zoomkv.protocol.recallable import recall_misses_only


@pytest.mark.parametrize("misses_only", [False, True])  # True: the recall a GPU runs (recallable.plan_swaps)
@pytest.mark.parametrize("name", ["quest", "oracle_topk", pytest.param("sekv", marks=pytest.mark.heavy)])
def test_a_decode_steps_selection_compiles_as_one_graph(name, misses_only):
    torch._dynamo.reset()
    model, _ = load_model("tiny-llama")
    ids, mask = padded_batch(model.config.vocab_size, lengths=(90, 61))
    cache = ZoomCache(model, name, 40)
    with torch.no_grad(), native.torch_path(), recall_misses_only(misses_only):
        model(input_ids=ids, attention_mask=mask, **generate_cache_kwargs(cache), use_cache=True)
        layer = next(layer for layer in cache.layers if isinstance(layer, LayerMemory) and layer.compressed)
        query = torch.randn(2, model.config.num_attention_heads, 1, layer.key_dim,
                            generator=torch.Generator().manual_seed(0))

        def select(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            sel = cache.method.select(layer, q)
            return sel.keys.clone(), sel.values.clone()

        compiled = torch.compile(select, fullgraph=True, dynamic=False)(query)  # raises on a graph break
        eager = select(query)
    for got, ref in zip(compiled, eager, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["quest", pytest.param("sekv", marks=pytest.mark.heavy)])
def test_a_decode_step_in_fixed_shapes_compiles_as_one_graph(name):
    """The step a GPU captures in a CUDA graph (zoomkv.memory.graphs: the append at a position read on the device,
    then the selection in fixed shapes) compiles with ``fullgraph=True``, and the compiled step computes what the
    step computes run as it is, step after step, on a second cache prefilled alike. (Dynamo still guards on the
    Python lengths the step reads to decide its path; a CUDA graph replays without asking, which
    tests/test_graphs.py holds.)"""
    from zoomkv.memory import graphs
    from zoomkv.methods import get_method

    torch._dynamo.reset()
    model, _ = load_model("tiny-llama")
    ids, mask = padded_batch(model.config.vocab_size, lengths=(400, 290))
    options = {"rescore_from": "host"} if name == "sekv" else {}
    caches = [ZoomCache(model, get_method(name, **options), 40) for _ in range(2)]
    g = torch.Generator().manual_seed(0)
    with torch.no_grad(), native.torch_path(), recall_misses_only(True), graphs.emulated():
        layers = []
        for cache in caches:
            model(input_ids=ids, attention_mask=mask, **generate_cache_kwargs(cache), use_cache=True)
            layers.append(next(layer for layer in cache.layers if isinstance(layer, LayerMemory) and layer.compressed
                               and not layer.meta.get("dense")))
        kv, d = model.config.num_key_value_heads, layers[0].key_dim

        def run(cache, layer, k, v, q, compiled=False):
            def step(k, v, q):
                sel = graphs._device_step(cache.method, layer, k, v, q)
                return sel.keys.clone(), sel.values.clone(), sel.bias.clone()

            cache.method.prepare_step(layer, 1)
            assert cache.method.graph_key(layer, q) is not None
            out = torch.compile(step, fullgraph=True, dynamic=False)(k, v, q) if compiled else step(k, v, q)
            cache.method.appended(layer, 1)
            return out

        for i in range(4):
            k, v = (torch.randn(2, kv, 1, d, generator=g) for _ in range(2))
            q = torch.randn(2, model.config.num_attention_heads, 1, d, generator=g)
            eager = run(caches[0], layers[0], k, v, q)
            compiled = run(caches[1], layers[1], k, v, q, compiled=i >= 2)  # the first two: counters and slots made
            for got, ref in zip(compiled, eager, strict=True):
                torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
