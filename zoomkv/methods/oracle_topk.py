"""``oracle_topk``: every row lives on the host tier; each decode step recalls that step's exact top-B
rows by attention score. Not a practical method (it reads every key each step) but the upper bound
every recallable method is compared with: no method choosing B rows per step can do better by score.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zoomkv.methods.base import KVMethod, MethodConfig, PrefillContext, Selection, group_query
from zoomkv.methods.registry import register_method


@dataclass
class OracleTopKConfig(MethodConfig):
    # How a GQA group's query heads vote for a KV head's rows: "mass" sums each head's softmax
    # probability (the rows carrying most attention of the group), "max" takes the largest logit.
    group_score: str = "mass"


@register_method
class OracleTopK(KVMethod):
    name = "oracle_topk"
    config_class = OracleTopKConfig
    summary = "recall each step's exact top-B rows by q·k from the host tier (the recall upper bound)"
    recallable = True

    def compress(self, memory, ctx: PrefillContext) -> None:
        memory.host_tier["keys"] = memory.host_rows(ctx.keys)
        memory.host_tier["values"] = memory.host_rows(ctx.values)
        if ctx.valid is not None:
            memory.host_tier["valid"] = memory.host_rows(ctx.valid[:, None, :, None])
        memory.meta["budget"] = ctx.budget
        self._reserve(memory, min(ctx.budget, ctx.keys.shape[2]))

    @staticmethod
    def _reserve(memory, rows: int) -> None:
        """The device-tier recall buffer: B rows per KV head (fewer while the sequence is shorter than B)."""
        buf = memory.device_tier.get("recall_keys")
        if buf is None or buf.shape[2] < rows:
            memory.device_tier["recall_keys"] = memory.device_buffer(rows, memory.key_dim)
            memory.device_tier["recall_values"] = memory.device_buffer(rows, memory.value_dim)

    def append(self, memory, key: torch.Tensor, value: torch.Tensor) -> None:
        memory.host_tier["keys"].append(key)
        memory.host_tier["values"].append(value)
        if "valid" in memory.host_tier:
            ones = torch.ones(key.shape[0], 1, key.shape[2], 1, dtype=torch.bool, device=key.device)
            memory.host_tier["valid"].append(ones)

    def select(self, memory, query: torch.Tensor) -> Selection:
        keys = memory.host_tier["keys"].view()
        values = memory.host_tier["values"].view()
        n = keys.shape[2]
        k = min(memory.meta["budget"], n)
        q = group_query(query, keys.shape[1]).to(keys.device, non_blocking=True)  # [b, h, g, d]
        logits = torch.matmul(q, keys.transpose(-1, -2)).float()  # [b, h, g, n]
        valid = None
        if "valid" in memory.host_tier:
            valid = memory.host_tier["valid"].view()[:, :, :, 0]  # [b, 1, n]
            logits = logits.masked_fill(~valid[:, :, None, :], float("-inf"))
        if self.config.group_score == "max":
            score = logits.amax(dim=2)
        else:
            score = torch.softmax(logits, dim=-1).sum(dim=2)
        if k < n:
            # Sorted so that, at budgets covering everything, rows keep the sequence order of full attention.
            idx = score.topk(k, dim=-1).indices.sort(dim=-1).values  # [b, h, k]
            sel_k = torch.gather(keys, 2, idx[..., None].expand(-1, -1, -1, keys.shape[-1]))
            sel_v = torch.gather(values, 2, idx[..., None].expand(-1, -1, -1, values.shape[-1]))
        else:
            idx = None
            sel_k, sel_v = keys, values
        self._reserve(memory, k)
        rk = memory.device_tier["recall_keys"][:, :, :k]
        rv = memory.device_tier["recall_values"][:, :, :k]
        rk.copy_(sel_k, non_blocking=True)
        rv.copy_(sel_v, non_blocking=True)
        bias = None
        if valid is not None:
            row_valid = valid.expand(-1, keys.shape[1], -1)
            if idx is not None:
                row_valid = torch.gather(row_valid, 2, idx)
            bias = torch.zeros(row_valid.shape, dtype=query.dtype, device=query.device)
            bias.masked_fill_(~row_valid.to(query.device), float("-inf"))
        return Selection(rk, rv, bias)
