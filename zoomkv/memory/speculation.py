"""What a method needs to look one layer ahead (InfiniGen): each attention module's input at a decode step.

The attention function only sees its own layer's query, keys and values. A method with
``needs_attention_inputs`` gets, on ``cache.attention_inputs[layer]``, every attention module's input
hidden state (the newest token, after its layer norm) and rotary embedding of the step in progress, plus
the module itself, so layer ``i``'s select can compute the query layer ``i``'s weights would make from
layer ``i-1``'s input: ``speculative_query``. Captured by a forward pre-hook that ``attach`` puts on
every attention module; decode steps only (one new token), so prefill costs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from zoomkv.protocol.rotary import rotate_half


@dataclass
class AttentionInput:
    module: torch.nn.Module  # the attention module (q_proj, q_norm, head_dim)
    hidden: torch.Tensor  # [b, 1, hidden]: its input at this step (already layer-normed)
    cos: torch.Tensor | None  # [b, 1, head_dim]: its rotary embedding at this step
    sin: torch.Tensor | None


def capture(cache: Any, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    if hidden is None or hidden.shape[1] != 1:  # prefill, or not a decode step of one token
        return
    rope = kwargs.get("position_embeddings", args[1] if len(args) > 1 else None)
    cos, sin = (rope[0][:, -1:], rope[1][:, -1:]) if rope is not None else (None, None)
    cache.attention_inputs[module.layer_idx] = AttentionInput(module, hidden[:, -1:].detach(), cos, sin)


def speculative_query(own: AttentionInput, hidden: torch.Tensor) -> torch.Tensor:
    """``[b, heads, 1, head_dim]``: the post-RoPE query ``own.module`` would compute from ``hidden``
    (``[b, 1, hidden]``) at this step (q_proj, then q_norm where the model has one, then RoPE)."""
    module = own.module
    b = hidden.shape[0]
    q = module.q_proj(hidden.to(module.q_proj.weight.dtype)).view(b, 1, -1, module.head_dim)
    q_norm = getattr(module, "q_norm", None)
    if q_norm is not None:
        q = q_norm(q)
    q = q.transpose(1, 2)
    if own.cos is None:
        return q
    cos, sin = own.cos[:, None].to(q.dtype), own.sin[:, None].to(q.dtype)
    return q * cos + rotate_half(q) * sin
