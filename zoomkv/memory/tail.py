"""The softmax tail: one extra row per KV head standing for every row a step did not select.

Its key and value are the mean of the unselected rows, and its logit gets ``+log(count)``, so in the
softmax it weighs about what those rows weighed together (exactly, when they share one key). Measured
(BENCHMARKS.md): on SmolLM2-135M at ~4K tokens, exact top-256 alone loses about one passkey answer in
eight, and adding this row loses none. An option (``ZoomCache(..., tail_summary=True)``) for every
recallable method: the runtime keeps running sums of all real rows on the device tier (two rows and a
count per KV head), so the mean of the rest is ``(sum - selected) / (count - selected)`` at O(k) a step.
The row counts against the budget: the method is given the rest (``CacheSpec.method_budget``).
"""

from __future__ import annotations

import math

import torch

from zoomkv.kernels import tail as kernel_tail
from zoomkv.protocol.method import PrefillContext, Selection


def init_tail(memory, ctx: PrefillContext, prefix: str = "tail") -> None:
    keys, values = ctx.keys.float(), ctx.values.float()
    if ctx.valid is not None:
        w = ctx.valid[:, None, :, None].to(keys.device, keys.dtype)
        keys, values = keys * w, values * w
        count = ctx.valid.sum(-1).to(keys.dtype)[:, None, None].expand(-1, keys.shape[1], 1).clone()
    else:
        count = torch.full((keys.shape[0], keys.shape[1], 1), float(keys.shape[2]), device=keys.device)
    memory.device_tier[f"{prefix}_key_sum"] = keys.sum(2, keepdim=True)
    memory.device_tier[f"{prefix}_value_sum"] = values.sum(2, keepdim=True)
    memory.device_tier[f"{prefix}_count"] = count


def append_tail(memory, key: torch.Tensor, value: torch.Tensor, prefix: str = "tail") -> None:
    tier = memory.device_tier
    # a decode step's one row is its own sum; both sums in one fused add (one launch on a GPU, not four)
    rows = [t.float() if t.shape[2] == 1 else t.float().sum(2, keepdim=True) for t in (key, value)]
    torch._foreach_add_([tier[f"{prefix}_key_sum"], tier[f"{prefix}_value_sum"]], rows)
    tier[f"{prefix}_count"] += key.shape[2]


def with_tail(memory, sel: Selection, prefix: str = "tail", offset: torch.Tensor | None = None) -> Selection:
    """``sel`` plus the tail row. Selected rows must be original rows or means of originals whose bias is
    ``log(count)`` (merged rows), so the rest's sums are the totals minus what the selection covers.
    ``prefix``: whose running sums (a method keeping its own summary row names its own); ``offset``
    (``[kv_heads]``, a trained method's) is added to the row's ``log(count)`` bias."""
    tier = memory.device_tier
    if kernel_tail.tail_row_usable(sel.keys, sel.values):  # on a GPU: one kernel for the row, not ~18 ops
        row = kernel_tail.tail_row(sel.keys, sel.values, sel.bias, tier[f"{prefix}_key_sum"],
                                   tier[f"{prefix}_value_sum"], tier[f"{prefix}_count"], offset,
                                   sel.bias.dtype if sel.bias is not None else sel.keys.dtype)
        bias = sel.bias if sel.bias is not None else torch.zeros(sel.keys.shape[:3], dtype=row[2].dtype,
                                                                 device=sel.keys.device)
        return Selection(torch.cat([sel.keys, row[0]], dim=2), torch.cat([sel.values, row[1]], dim=2),
                         torch.cat([bias, row[2]], dim=2))
    keys, values = sel.keys.float(), sel.values.float()
    if sel.bias is not None:
        # A row with bias log n stands for n originals (merged rows); -inf (padding) for none.
        weight = torch.exp(sel.bias.float()).nan_to_num(0.0)[..., None]
        keys, values = keys * weight, values * weight
        chosen = weight.sum(2)  # [b, h, 1]
    else:
        chosen = torch.full_like(tier[f"{prefix}_count"], float(keys.shape[2]))
    rest = tier[f"{prefix}_count"] - chosen
    denom = rest.clamp_min(1.0)[..., None]
    mean_k = (tier[f"{prefix}_key_sum"] - keys.sum(2, keepdim=True)) / denom
    mean_v = (tier[f"{prefix}_value_sum"] - values.sum(2, keepdim=True)) / denom
    # No row left out → the tail row must weigh nothing (keeps budgets ≥ context exactly full attention).
    log_rest = rest.clamp_min(1.0).log()
    if offset is not None:
        log_rest = log_rest + offset.to(log_rest)[None, :, None]
    tail_bias = torch.where(rest > 0.5, log_rest, torch.full_like(rest, -math.inf))
    dtype = sel.keys.dtype
    bias = sel.bias if sel.bias is not None else torch.zeros(sel.keys.shape[:3], dtype=dtype, device=sel.keys.device)
    return Selection(
        torch.cat([sel.keys, mean_k.to(dtype)], dim=2),
        torch.cat([sel.values, mean_v.to(dtype)], dim=2),
        torch.cat([bias, tail_bias.to(bias.dtype)], dim=2),
    )
