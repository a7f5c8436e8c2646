"""Prefill once, compress many times.

Prefill is exact attention whatever the method (methods only differ in what they keep afterwards), so
an evaluation comparing methods on the same prompt can run the prompt through the model once, record
what each layer handed ``compress`` (post-RoPE keys, values, queries, padding) plus the last logits,
and then build each method's cache from that record. The decoding that follows is the ordinary
``model.generate`` path; the tokens are exactly those of running each method from scratch.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from zoomkv import compat
from zoomkv.budget import Budget
from zoomkv.memory.attention import compress_layer, note_peak
from zoomkv.memory.cache import ZoomCache
from zoomkv.memory.layer import LayerMemory
from zoomkv.memory.spec import CacheSpec
from zoomkv.memory.surprisal import token_surprisal
from zoomkv.protocol.method import KVMethod, PrefillContext


@dataclass
class PrefillRecord:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    last_logits: torch.Tensor  # [batch, vocab]: the logits that pick the first new token
    contexts: dict[int, PrefillContext] = field(default_factory=dict)
    passthrough: dict[int, Any] = field(default_factory=dict)  # sliding-window layers as they were
    prefill_s: float = 0.0
    final_hidden: torch.Tensor | None = None  # [batch, T, hidden] after the final norm (for surprisal)
    surprisal: torch.Tensor | None = None  # computed on first use

    @property
    def length(self) -> int:
        return self.input_ids.shape[1]


@torch.inference_mode()
def prefill_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions as generate() computes them: left padding does not shift the real tokens' positions."""
    return (attention_mask.long().cumsum(-1) - 1).masked_fill_(attention_mask == 0, 1)


def record_prefill(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> PrefillRecord:
    """One full-attention prefill of ``input_ids`` (moved to the model's device, as a tokenizer's ids are made on
    the host), every layer's queries, keys and values recorded for the methods that replay it."""
    device = getattr(model, "device", input_ids.device)
    input_ids = input_ids.to(device)
    attention_mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(device)
    cache = ZoomCache(model, "full")
    cache.recorder = {}
    captured: dict[str, torch.Tensor] = {}
    norm = compat.final_norm(model)
    handle = norm.register_forward_hook(lambda m, a, out: captured.update(hidden=out)) if norm is not None else None
    start = time.perf_counter()
    position_ids = prefill_positions(attention_mask)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=True,
                logits_to_keep=1, **compat.generate_cache_kwargs(cache))
    elapsed = time.perf_counter() - start
    if handle is not None:
        handle.remove()
    record = PrefillRecord(input_ids, attention_mask, out.logits[:, -1].float(), prefill_s=elapsed,
                           final_hidden=captured.get("hidden"))
    record.contexts = cache.recorder
    for i, layer in enumerate(cache.layers):
        if not isinstance(layer, LayerMemory):
            record.passthrough[i] = layer
    # The recording cache is in reference cycles (ZoomCache.release says why): left to the cyclic GC it would
    # keep the record's contexts (every layer's queries, keys and values) alive long after the record.
    cache.release()
    return record


def cache_from_record(
    model: Any, record: PrefillRecord, method: CacheSpec | str | KVMethod,
    budget: str | int | float | Budget | None = None, *, tokenizer: Any = None, **cache_kwargs: Any,
) -> ZoomCache:
    """A ZoomCache in the state it would have right after prefilling ``record``'s prompt with ``method``: a
    ``CacheSpec``, or a method with ``budget`` and ZoomCache's keywords (``cache_kwargs``: ``kv_quant``,
    method hyper-parameters, ``diagnose``)."""
    cache = ZoomCache(model, method, budget, tokenizer=tokenizer, **cache_kwargs)
    cache.prompt_ids = record.input_ids
    resolved = cache.resolve_budget(record.length)
    surprisal = record_surprisal(model, record, fast=True) if cache.method.needs_surprisal else None
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, LayerMemory):
            ctx = record.contexts[i]
            # Methods may keep (and later update in place) what they are handed: give each its own copy.
            ctx = dataclasses.replace(ctx, keys=ctx.keys.clone(), values=ctx.values.clone(), budget=resolved,
                                      zoom_layers=cache.zoom_layer_indices, input_ids=record.input_ids,
                                      tokenizer=tokenizer, model_name=cache.model_name, surprisal=surprisal,
                                      rotary=cache.rotary.get(i))
            layer.lazy_initialization(ctx.keys, ctx.values)
            layer.seen = record.length
            note_peak(layer, ctx.keys.nbytes + ctx.values.nbytes, ctx.keys.shape[2])  # as a live prefill holds it
            compress_layer(cache, layer, ctx)
        else:
            # transformers' sliding-window layer replaces (never mutates) its tensors: a shallow copy is safe
            cache.layers[i] = copy.copy(record.passthrough[i])
    return cache


def record_surprisal(model: Any, record: PrefillRecord, fast: bool = False) -> torch.Tensor:
    """The record's token surprisal, computed once (``fast``: inference's bf16 projection where it pays, as a
    live cache computes it; a training teacher keeps float32)."""
    if record.surprisal is None:
        if record.final_hidden is None:
            raise RuntimeError("this prefill record has no final hidden states to compute surprisal from")
        valid = record.attention_mask.bool()
        record.surprisal = token_surprisal(
            record.final_hidden, record.input_ids, model.get_output_embeddings(),
            valid=None if bool(valid.all()) else valid,
            softcap=getattr(compat.text_config(model.config), "final_logit_softcapping", None), fast=fast,
        )
    return record.surprisal
