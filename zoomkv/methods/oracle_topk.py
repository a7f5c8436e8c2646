"""``oracle_topk``: every row lives on the host tier; each decode step recalls that step's exact top-B
rows by attention score. Not a practical method (it reads every key each step) but the upper bound
every recallable method is compared with: no method choosing B rows per step can do better by score.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from zoomkv.protocol.method import (
    KVMethod,
    MethodConfig,
    PrefillContext,
    Selection,
    group_query,
    summed_over_queries,
)
from zoomkv.protocol.recallable import (
    append_valid,
    host_valid,
    padding_bias,
    recall_rows,
    reserve_recall_buffer,
    store_valid,
)


@dataclass
class OracleTopKConfig(MethodConfig):
    group_score: str = field(
        default="mass",
        metadata={"help": "How a GQA group's query heads vote for a KV head's rows: \"mass\" sums each head's softmax probability (the rows carrying most attention of the group), \"max\" takes the largest logit."},
    )


class OracleTopK(KVMethod):
    name = "oracle_topk"
    config_class = OracleTopKConfig
    summary = "recall each step's exact top-B rows by q·k from the host tier (the recall upper bound)"
    recallable = True

    def compress(self, memory, ctx: PrefillContext) -> None:
        memory.host_tier["keys"] = memory.host_rows(ctx.keys, role="keys")
        memory.host_tier["values"] = memory.host_rows(ctx.values, role="values")
        store_valid(memory, ctx.valid)
        memory.meta["budget"] = ctx.budget
        memory.meta["scaling"] = ctx.scaling  # the mass vote uses the model's own softmax temperature
        reserve_recall_buffer(memory, min(ctx.budget, ctx.keys.shape[2]))

    def append(self, memory, key: torch.Tensor, value: torch.Tensor) -> None:
        memory.host_tier["keys"].append(key)
        memory.host_tier["values"].append(value)
        append_valid(memory, key)

    def select(self, memory, query: torch.Tensor) -> Selection:
        # Every row is scored: the oracle reads the whole tier, on the query's device (pinned rows copied there
        # without a host wait; on the CPU, where they are).
        keys = memory.host_tier["keys"].rows_on(query.device)
        n = keys.shape[2]
        k = min(memory.meta["budget"], n)
        valid = host_valid(memory)  # [b, 1, n]
        if valid is not None:
            valid = valid.to(keys.device)
        keys_t, scaling = keys.transpose(-1, -2), memory.meta.get("scaling", 1.0)
        largest = self.config.group_score == "max"

        def vote(block: torch.Tensor) -> torch.Tensor:  # [b, h, n] from a block of the query's positions
            logits = torch.matmul(group_query(block, keys.shape[1]), keys_t).float() * scaling  # [b, h, g·q, n]
            if valid is not None:
                logits = logits.masked_fill(~valid[:, :, None, :], float("-inf"))
            return logits.amax(dim=2) if largest else torch.softmax(logits, dim=-1).sum(dim=2)

        score = summed_over_queries(vote, query, n, largest=largest)
        idx = None
        if k < n:
            # Sorted so that rows keep sequence order (at budgets covering everything: exactly full attention).
            idx = score.topk(k, dim=-1).indices.sort(dim=-1).values  # [b, h, k]
        rk, rv, idx = recall_rows(memory, memory.host_tier["keys"], memory.host_tier["values"], idx)
        return Selection(rk, rv, padding_bias(valid, idx, keys.shape[1], query.dtype, query.device))
