"""Helpers shared by the test files (import as ``from tests.helpers import ...``)."""

from __future__ import annotations

import torch

from zoomkv.memory.layer import LayerMemory
from zoomkv.memory.quant import QuantizedRowBuffer
from zoomkv.memory.tiers import RowBuffer


def tensors_in(obj, seen: set[int] | None = None) -> list[torch.Tensor]:
    """Every tensor reachable from ``obj`` (tiers, meta, row buffers, quantized buffers), once each."""
    seen = seen if seen is not None else set()
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, QuantizedRowBuffer):
        return [t for part in obj.tensors() for t in tensors_in(part, seen)]
    if isinstance(obj, RowBuffer):
        return tensors_in(obj.data, seen)
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors_in(v, seen)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors_in(v, seen)]
    return []


def assert_all_tensors_in_tiers(memory: LayerMemory) -> None:
    """A layer holds no tensor outside its two tiers (so the memory report counts everything)."""
    state = {k: v for k, v in vars(memory).items() if k != "cache"}
    held = sum(t.nbytes for t in tensors_in(state))
    tiers = sum(t.nbytes for t in tensors_in(dict(memory.device_tier))) + sum(
        t.nbytes for t in tensors_in(dict(memory.host_tier)))
    assert held == tiers, "a tensor is held outside both tiers"
