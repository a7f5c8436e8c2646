"""Recall: copy chosen host-tier rows into the layer's device-tier recall buffer.

On a CUDA machine the host tier is pinned CPU memory: rows are gathered on the host and copied into a
preallocated device buffer without blocking. On a CPU-only machine both tiers are RAM and the copy is a
plain gather, but the buffer is still the device tier's and still counted.
"""

from __future__ import annotations

import torch


def reserve_recall_buffer(memory, rows: int, prefix: str = "recall") -> None:
    """Make sure the device tier has ``rows`` recall rows per KV head (reallocated only when growing)."""
    buf = memory.device_tier.get(f"{prefix}_keys")
    if buf is None or buf.shape[2] < rows:
        memory.device_tier[f"{prefix}_keys"] = memory.device_buffer(rows, memory.key_dim)
        memory.device_tier[f"{prefix}_values"] = memory.device_buffer(rows, memory.value_dim)


def recall_rows(
    memory, keys: torch.Tensor, values: torch.Tensor, idx: torch.Tensor | None, prefix: str = "recall"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather rows ``idx`` (``[b, h, k]``, or None for all rows) of host-tier ``keys``/``values``
    (``[b, h, n, d]``) into the device recall buffer; returns views of the filled part."""
    k = keys.shape[2] if idx is None else idx.shape[2]
    reserve_recall_buffer(memory, k, prefix)
    if idx is None:
        sel_k, sel_v = keys, values
    else:
        idx = idx.to(keys.device)
        sel_k = torch.gather(keys, 2, idx[..., None].expand(-1, -1, -1, keys.shape[-1]))
        sel_v = torch.gather(values, 2, idx[..., None].expand(-1, -1, -1, values.shape[-1]))
    rk = memory.device_tier[f"{prefix}_keys"][:, :, :k]
    rv = memory.device_tier[f"{prefix}_values"][:, :, :k]
    rk.copy_(sel_k, non_blocking=True)
    rv.copy_(sel_v, non_blocking=True)
    return rk, rv


def padding_bias(valid: torch.Tensor | None, idx: torch.Tensor | None, heads: int, dtype, device) -> torch.Tensor | None:
    """``-inf`` logit bias for selected rows that are left padding. ``valid`` is ``[b, n]`` or ``[b, 1, n]``."""
    if valid is None:
        return None
    if valid.dim() == 2:
        valid = valid[:, None, :]
    rows = valid.expand(-1, heads, -1)
    if idx is not None:
        rows = torch.gather(rows, 2, idx.to(rows.device))
    bias = torch.zeros(rows.shape, dtype=dtype, device=device)
    return bias.masked_fill_(~rows.to(device), float("-inf"))
