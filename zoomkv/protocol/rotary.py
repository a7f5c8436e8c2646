"""Rotary position embedding for methods that work on keys before it (rotate-half layout, the one
Llama, Gemma and most Hugging Face decoders use).

The runtime hands methods keys after RoPE. A key before RoPE is the same row rotated back by its
position's angles; ShadowKV's observation is that keys are low-rank there and not after, where each
position turns them a different way. ``PrefillContext.rotary`` carries the layer's table
(``compat.rotary_frequencies``: inverse frequencies and the attention scaling the model multiplies
cos and sin by).
"""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def angles(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` ``[..., d]`` at integer ``positions`` ``[...]``, as the model's rotary module computes them
    (float32)."""
    freqs = positions[..., None].float() * inv_freq.to(positions.device, torch.float)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rows before RoPE → after (``cos``/``sin`` broadcast against ``x``)."""
    return x * cos + rotate_half(x) * sin


def undo(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rows after RoPE → before: the inverse rotation, divided by the scaling squared (cos² + sin²)."""
    return (x * cos - rotate_half(x) * sin) / (cos * cos + sin * sin)
