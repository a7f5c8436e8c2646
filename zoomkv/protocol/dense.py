"""Rows kept whole on the device tier: ``full``, and the dense first layers Quest, ClusterKV and InfiniGen keep.

The rows live in a preallocated ``RowBuffer`` that a decode step writes its new row into, rather than a tensor
concatenated anew at every step (transformers' ``DynamicLayer`` copies a layer's whole KV each step: at 32K
tokens that copy is most of a step on a GPU). A step attends to them through ``zoomkv.memory.attention.attend``,
each KV head with its own group of query heads (no ``repeat_kv`` copy of the keys per query head); left
padding is a ``-inf`` logit bias kept beside the rows, so the step needs no 4-D mask from the model.
"""

from __future__ import annotations

import torch

from zoomkv.protocol.method import Memory, PrefillContext, Selection

# Rows of room a dense layer gets past its prompt, so the first decode steps write in place instead of growing
# (and copying) the buffer; RowBuffer grows by ~3% when they are used up.
ROOM = 128


def keep_all(memory: Memory, ctx: PrefillContext) -> None:
    """Hold every prompt row of the layer on the device tier (``full``'s compress, a dense layer's)."""
    tier = memory.device_tier
    tier["keys"] = memory.device_rows_buffer(ctx.keys, role="keys", room=ROOM)
    tier["values"] = memory.device_rows_buffer(ctx.values, role="values", room=ROOM)
    if ctx.valid is not None:  # [b, 1, n, 1] so it grows along the row axis like the keys
        bias = torch.zeros(ctx.valid.shape, dtype=ctx.keys.dtype, device=ctx.keys.device)
        bias.masked_fill_(~ctx.valid, float("-inf"))
        tier["pad_bias"] = memory.device_rows_buffer(bias[:, None, :, None], room=ROOM)


def append_all(memory: Memory, key: torch.Tensor, value: torch.Tensor) -> None:
    """A step's (or a turn's) rows after the layer's own, in place."""
    tier = memory.device_tier
    tier["keys"].append(key)
    tier["values"].append(value)
    if "pad_bias" in tier:  # generated and appended rows are real tokens
        tier["pad_bias"].append(key.new_zeros(key.shape[0], 1, key.shape[2], 1))


def select_all(memory: Memory) -> Selection:
    """Every row, in sequence order, with the padding's bias (``[b, h, n]``, a broadcast view) when the batch
    is padded."""
    tier = memory.device_tier
    keys = tier["keys"].view()
    pad = tier.get("pad_bias")
    bias = None if pad is None else pad.view()[..., 0].expand(-1, keys.shape[1], -1)
    return Selection(keys, tier["values"].view(), bias)
