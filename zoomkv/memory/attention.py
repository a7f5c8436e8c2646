"""The zoomkv attention function, registered with transformers as ``"zoomkv"``.

Query-aware selection needs the query, and only the attention call sees it. So ``ZoomCache.update``
marks which layer is being run, and this function, called right after by the attention module, does:

- prefill: exact attention over the prompt (transformers' sdpa), then hands the layer's post-RoPE keys,
  values and queries to ``method.compress``;
- decode: ``method.append`` the new row, ``method.select(query)``, and one softmax over the chosen rows
  with their per-row logit bias;
- more input after compression (a follow-up question, the next chat turn, the next chunk of a long
  prompt): ``method.select`` for the new queries over what the layer holds, one softmax over those rows
  and the new tokens' own causal rows, then ``method.extend`` stores the new rows by the method's rule.

Anything that is not a ``ZoomCache`` full-attention layer (sliding-window layers, plain generate without a
ZoomCache, training forwards) goes straight to sdpa, untouched.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import torch
import torch.nn.functional as F

from zoomkv.compat import register_attention, sdpa_attention_forward
from zoomkv.errors import BudgetExceededError, ZoomKVError
from zoomkv.memory import graphs
from zoomkv.memory.tail import append_tail, init_tail, with_tail
from zoomkv.protocol.method import PrefillContext, Selection, query_blocks
from zoomkv.protocol.phases import phase

ATTENTION_NAME = "zoomkv"

_active = threading.local()


def mark_active(cache: Any, layer_idx: int) -> None:
    _active.cache = cache
    _active.layer_idx = layer_idx


def _take_active(layer_idx: int) -> Any:
    cache = getattr(_active, "cache", None)
    if cache is None or getattr(_active, "layer_idx", None) != layer_idx:
        return None
    _active.cache = None
    return cache


def valid_rows_from_mask(attention_mask: torch.Tensor | None, length: int) -> torch.Tensor | None:
    """``[batch, length]`` bool: which prompt rows are real tokens (False on left padding)."""
    if attention_mask is None or attention_mask.dim() != 4:
        return None
    last = attention_mask[:, 0, -1, :length]  # the last query sees every real token before it
    valid = last if last.dtype == torch.bool else last > torch.finfo(last.dtype).min / 2
    if bool(valid.all()):
        return None
    return valid


def attend(query: torch.Tensor, sel: Selection, scaling: float) -> torch.Tensor:
    """One softmax over the selected rows. ``query`` ``[b, hq, 1, d]`` → output ``[b, 1, hq, dv]``."""
    b, hq, q_len, d = query.shape
    kv_heads = sel.keys.shape[1]
    grouped = query.reshape(b, kv_heads, (hq // kv_heads) * q_len, d)  # query head h → KV head h // groups
    mask = None
    if sel.bias is not None:
        mask = sel.bias.to(query.dtype)[:, :, None, :]
    out = F.scaled_dot_product_attention(grouped, sel.keys, sel.values, attn_mask=mask, scale=scaling)
    return out.reshape(b, hq, q_len, -1).transpose(1, 2)


def attend_extension(query: torch.Tensor, sel: Selection, key: torch.Tensor, value: torch.Tensor,
                     scaling: float) -> torch.Tensor:
    """New queries ``[b, hq, n, d]`` over the selected stored rows (all earlier than them) and their own rows
    ``key``/``value`` ``[b, kv, n, d]`` causally, in one softmax. Returns ``[b, n, hq, dv]``. A long chunk goes
    a block of positions at a time (``query_blocks``): its mask never spans every query against every row."""
    width = sel.keys.shape[2] + key.shape[2]
    outs, start = [], 0
    for block in query_blocks(query, width):
        end = start + block.shape[2]
        outs.append(_attend_block(block, sel, key[:, :, :end], value[:, :, :end], scaling, start))
        start = end
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def _attend_block(query: torch.Tensor, sel: Selection, key: torch.Tensor, value: torch.Tensor, scaling: float,
                  start: int) -> torch.Tensor:
    """``attend_extension`` for the new positions ``start ..`` (``query``), whose own rows so far are ``key``."""
    b, hq, n, d = query.shape
    kv_heads, own = key.shape[1], key.shape[2]
    groups = hq // kv_heads
    grouped = query.reshape(b, kv_heads, groups * n, d)  # row r is query position start + r % n of its group
    stored = sel.keys.shape[2]
    keys = torch.cat([sel.keys, key.to(sel.keys.dtype)], dim=2)
    values = torch.cat([sel.values, value.to(sel.values.dtype)], dim=2)
    mask = torch.zeros(b, kv_heads, groups * n, stored + own, dtype=query.dtype, device=query.device)
    if sel.bias is not None:
        mask[..., :stored] = sel.bias.to(query.dtype)[:, :, None, :]
    pos = start + torch.arange(groups * n, device=query.device) % n
    later = torch.arange(own, device=query.device)[None, :] > pos[:, None]  # [g*n, own]: the chunk's future rows
    mask[..., stored:] = mask[..., stored:].masked_fill(later, float("-inf"))
    out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=scaling)
    return out.reshape(b, hq, n, -1).transpose(1, 2)


def zoomkv_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    layer_idx = getattr(module, "layer_idx", None)
    cache = _take_active(layer_idx) if layer_idx is not None else None
    memory = cache.zoom_layer(layer_idx) if cache is not None else None
    if memory is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if kwargs.get("softcap") is not None:
        raise ZoomKVError("attention logit soft-capping is not supported by zoomkv's attention")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    method = cache.method

    if not memory.compressed:
        out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=scale, **kwargs)
        note_peak(memory, key.nbytes + value.nbytes, key.shape[2])
        length = key.shape[2]
        budget = cache.resolve_budget(length)
        ctx = PrefillContext(
            layer_idx=layer_idx,
            num_layers=cache.num_layers_total,
            keys=key,
            values=value,
            queries=query,
            valid=valid_rows_from_mask(attention_mask, length),
            budget=budget,
            scaling=scale,
            num_kv_groups=query.shape[1] // key.shape[1],
            zoom_layers=cache.zoom_layer_indices,
            input_ids=cache.prompt_ids,
            tokenizer=cache.tokenizer,
            model_name=cache.model_name,
            rotary=cache.rotary.get(layer_idx),
        )
        recorder = getattr(cache, "recorder", None)
        if recorder is not None:  # zoomkv.memory.replay: keep what compress saw, to replay other methods
            recorder[layer_idx] = ctx
        if method.needs_surprisal:
            # Surprisal needs the model's logits, which exist only after the last layer: the model's
            # final-norm hook (see cache.attach) compresses every pending layer then.
            if not method.reads_queries and recorder is None:  # not held until then (an empty tensor, no view)
                method.keep_query_statistics(ctx)
                ctx.queries = query.new_empty(*query.shape[:2], 0, query.shape[3])
            if memory.pin_host and key.is_cuda and recorder is None:
                # The layer's prompt rows wait in pinned host memory, not on the GPU: every layer's KV on the device
                # at once until the last layer is what full holds. Asynchronous both ways (back at finish_prefill).
                ctx.keys, ctx.values = memory.to_host(key, non_blocking=True), memory.to_host(value, non_blocking=True)
            cache.pending[layer_idx] = ctx
            return out, None
        compress_layer(cache, memory, ctx)
        return out, None

    if layer_idx in cache.pending:
        raise ZoomKVError(
            f"method {method.name!r} needs token surprisal, but the prefill ended without the model's final-norm "
            "hook firing; attach the model with zoomkv.attach(model) (ZoomCache(model, ...) does) and run a "
            "decoder with a `norm` module"
        )
    if query.shape[2] > 1:
        return extend_layer(module, cache, memory, query, key, value, attention_mask, scale, **kwargs), None
    # append, then select: replayed from a CUDA graph where the method's step allows (zoomkv.memory.graphs)
    sel = graphs.step(method, memory, key, value, query)
    if cache.tail_summary:  # (the rest's running sums: read by with_tail below, not by the selection)
        with phase("append"):
            append_tail(memory, key, value)
    _check_budget(cache, memory, cache.budget_rows)
    if cache.probe is not None:
        cache.probe.step(layer_idx, query, key, sel, scale)
    with phase("attend"):
        if cache.tail_summary:
            sel = with_tail(memory, sel)
        if sel.use_model_mask:
            out, _ = sdpa_attention_forward(module, query, sel.keys, sel.values, attention_mask, dropout=0.0,
                                            scaling=scale, **kwargs)
            return out, None
        return attend(query, sel, scale), None


def extend_layer(module: torch.nn.Module, cache: Any, memory: Any, query: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, attention_mask: torch.Tensor | None, scale: float, **kwargs: Any) -> torch.Tensor:
    """Several new tokens on a compressed layer: they attend to what the method selects for them plus their
    own causal rows; then the method stores their rows (``extend``) and the budget is checked again."""
    method = cache.method
    sel = method.select(memory, query)
    _check_budget(cache, memory, cache.budget_rows)
    if cache.probe is not None:
        cache.probe.step(memory.layer_idx, query, key, sel, scale)
    # The new rows sit on the device tier next to the layer's own while they are attended.
    note_peak(memory, key.nbytes + value.nbytes, key.shape[2])
    if cache.tail_summary:
        sel = with_tail(memory, sel)
    if sel.use_model_mask:  # every stored row, in order: the model's own mask applies to them and the new ones
        keys = torch.cat([sel.keys, key.to(sel.keys.dtype)], dim=2)
        values = torch.cat([sel.values, value.to(sel.values.dtype)], dim=2)
        out, _ = sdpa_attention_forward(module, query, keys, values, attention_mask, dropout=0.0, scaling=scale,
                                        **kwargs)
    else:
        out = attend_extension(query, sel, key, value, scale)
    method.extend(memory, key, value)
    if cache.tail_summary:
        append_tail(memory, key, value)
    _check_budget(cache, memory, cache.budget_rows)
    return out


def note_peak(memory: Any, transient_bytes: int, transient_rows: int) -> None:
    """The layer's device-tier high-water mark: what it holds plus KV rows attended exactly in passing (the
    prompt at a one-shot prefill, a chunk or a turn while it goes through)."""
    memory.peak_device_bytes = max(memory.peak_device_bytes, memory.device_bytes + transient_bytes)
    memory.peak_device_rows = max(memory.peak_device_rows, memory.cache.method.device_rows(memory) + transient_rows)


def finish_prefill(cache: Any, surprisal: torch.Tensor) -> None:
    """Compress the layers that waited for surprisal (``needs_surprisal`` methods), in layer order."""
    for layer_idx in sorted(cache.pending):
        ctx = cache.pending.pop(layer_idx)
        if ctx.keys.device != surprisal.device:  # waited on the host (a GPU's pinned memory): back for compress
            ctx.keys = ctx.keys.to(surprisal.device, non_blocking=True)
            ctx.values = ctx.values.to(surprisal.device, non_blocking=True)
        ctx.surprisal = surprisal.to(ctx.keys.device)
        compress_layer(cache, cache.zoom_layer(layer_idx), ctx)


def compress_layer(cache: Any, memory: Any, ctx: PrefillContext) -> None:
    """Hand a prefilled layer to its method (live, after surprisal, or replayed from a record)."""
    budget = ctx.budget
    if cache.tail_summary:
        # The tail row is one of the B device rows: the method gets the rest (CacheSpec.method_budget).
        ctx = dataclasses.replace(ctx, budget=cache.spec.method_budget(budget))
        init_tail(memory, ctx)
    if cache.probe is not None:
        cache.probe.prefill(memory.layer_idx, ctx.keys, ctx.valid)
    cache.method.compress(memory, ctx)
    memory.compressed = True
    _check_budget(cache, memory, budget)


def _check_budget(cache: Any, memory: Any, budget: int | None) -> None:
    rows = cache.method.device_rows(memory) + cache.spec.tail_rows
    memory.max_device_rows = max(memory.max_device_rows, rows)
    note_peak(memory, 0, 0)
    method, n = cache.method, cache.num_layers_total
    if not method.uses_budget or budget is None or method.dense_layer(memory.layer_idx, n):
        return
    cap = method.layer_budget(memory.layer_idx, n, budget, cache.zoom_layer_indices)
    if rows > cap:
        raise BudgetExceededError(
            f"method {method.name!r} holds {rows} device-tier rows per KV head in layer "
            f"{memory.layer_idx}, over its budget of {cap}"
        )


register_attention(ATTENTION_NAME, zoomkv_attention_forward)
