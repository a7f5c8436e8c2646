"""Helpers shared by the test files (import as ``from tests.helpers import ...``)."""

from __future__ import annotations

import functools

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


def padded_batch(vocab: int, lengths: tuple[int, ...] = (70, 52), seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Random prompts of ``lengths`` tokens, left padded (pad id 0) to the longest: ids and attention mask."""
    g = torch.Generator().manual_seed(seed)
    total = max(lengths)
    ids = torch.randint(5, vocab, (len(lengths), total), generator=g)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        mask[i, total - n :] = 1
        ids[i, : total - n] = 0
    return ids, mask


def max_logit_diff(a_scores, b_scores) -> float:
    """Largest difference between two runs' step logits (``-inf`` entries, e.g. a suppressed EOS, must match)."""
    worst = 0.0
    for a, b in zip(a_scores, b_scores, strict=True):
        a, b = a.float().cpu(), b.float().cpu()
        finite = torch.isfinite(a)
        assert torch.equal(finite, torch.isfinite(b))
        worst = max(worst, (a[finite] - b[finite]).abs().max().item())
    return worst


def greedy(model, ids: torch.Tensor, mask: torch.Tensor, cache=None, new: int = 10):
    """Exactly ``new`` greedy tokens with their step logits, through ``cache`` (plain generate when None)."""
    from zoomkv.compat import generate_cache_kwargs

    kwargs = generate_cache_kwargs(cache) if cache is not None else {}
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                          do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0,
                          **kwargs)


@functools.cache
def load_tiny(name: str = "tiny-llama"):
    """A tiny random model and its tokenizer, loaded once per test session: for tests that only read it
    (the ``tiny`` fixture in conftest.py loads a fresh one per module)."""
    from zoomkv.models import load_model

    return load_model(name)
