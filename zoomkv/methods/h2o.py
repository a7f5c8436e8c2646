"""``h2o``: heavy hitters by accumulated attention, plus the most recent rows.

Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models",
NeurIPS 2023. A few rows collect most of the attention over time ("heavy hitters"); H2O keeps the rows
with the largest *accumulated* attention (summed over every query so far) next to a window of recent
rows, and keeps evicting greedily as it decodes. Budget split: ``heavy_ratio`` and ``recent_ratio`` of B
(half each by default, as in the paper's main setting).

- Prefill: each prompt key's score is the attention it got from every prompt query (causal softmax,
  summed over the query heads of its GQA group), computed in query chunks so a long prompt never
  materialises heads x T x T at once. The top ``heavy`` rows outside the last ``recent`` rows are kept.
- Decoding: ``select`` computes this step's softmax over the kept rows itself and adds it to the scores
  (the runtime's attention over the same Selection is the plain softmax; the probabilities are recomputed
  here because the runtime does not hand them back). When a new row arrives at a full layer, the row with
  the lowest accumulated score outside the recent window is evicted.

Deviation (forced by the fixed budget): published H2O attends over ``B + 1`` rows at each step (the new
row included) and evicts afterwards; here the eviction happens as the new row is appended, using the
scores accumulated up to the previous step, so no step ever holds more than ``B`` rows.
GQA: scores are kept per KV head (the group's query heads summed), since a GQA cache can only drop a
row for the whole group; the published code is per (MHA) head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from zoomkv.errors import ZoomKVError
from zoomkv.protocol.eviction import EvictionMethod, accumulated_scores, kept_padding_bias, store_rows
from zoomkv.protocol.method import MethodConfig, PrefillContext, Selection, group_query

if TYPE_CHECKING:
    from zoomkv.memory.layer import LayerMemory

_EPS = 1e-9


@dataclass
class H2OConfig(MethodConfig):
    heavy_ratio: float = field(default=0.5, metadata={"help": "share of B for heavy hitters"})
    recent_ratio: float = field(default=0.5, metadata={"help": "share of B for the recent window"})

    def __post_init__(self) -> None:
        if self.heavy_ratio < 0 or self.recent_ratio <= 0:
            raise ZoomKVError("heavy_ratio must be >= 0 and recent_ratio > 0 (the current row is always recent)")
        if self.heavy_ratio + self.recent_ratio > 1 + _EPS:
            raise ZoomKVError(
                f"heavy_ratio + recent_ratio must be at most 1, got {self.heavy_ratio} + {self.recent_ratio}"
            )


class H2O(EvictionMethod):
    """Heavy hitters (largest accumulated attention) + recent window, evicting greedily while decoding.

    Citation: Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large
    Language Models", NeurIPS 2023.
    """

    name = "h2o"
    config_class = H2OConfig
    summary = "keep the heavy hitters (most accumulated attention) + recent rows; evict greedily while decoding"
    citation = "Zhang et al., H2O: Heavy-Hitter Oracle for Efficient Generative Inference of LLMs, NeurIPS 2023"
    config: H2OConfig
    new_row_score = 0.0  # a new row has received no attention yet; this step's attention is added in select

    def split(self, budget: int) -> tuple[int, int]:
        """(heavy, recent) rows for a layer budget. Rounding leftovers go to the recent window when the
        ratios cover the whole budget."""
        heavy = math.floor(budget * self.config.heavy_ratio + _EPS)
        if self.config.heavy_ratio + self.config.recent_ratio >= 1 - _EPS:
            recent = budget - heavy
        else:
            recent = math.floor(budget * self.config.recent_ratio + _EPS)
        return heavy, recent

    def min_budget(self) -> int:
        # The smallest budget giving the recent window a row (the current token) and, unless the heavy
        # share is 0, at least one heavy hitter.
        budget = 1
        while True:
            heavy, recent = self.split(budget)
            if recent >= 1 and (heavy >= 1 or self.config.heavy_ratio == 0):
                return budget
            budget += 1

    def compress(self, memory: LayerMemory, ctx: PrefillContext) -> None:
        heavy, recent = self.split(self.capacity(ctx))
        capacity = heavy + recent
        scores = accumulated_scores(ctx)
        b, kv_heads, length, _ = ctx.keys.shape
        idx = None
        if length > capacity:
            top = scores[..., : length - recent].topk(heavy, dim=-1).indices.sort(dim=-1).values
            tail = torch.arange(length - recent, length, device=top.device).expand(b, kv_heads, -1)
            idx = torch.cat([top, tail], dim=-1)
        store_rows(memory, ctx, idx, scores, capacity)
        memory.meta["recent"] = recent
        memory.meta["scaling"] = ctx.scaling  # select recomputes this step's softmax

    def _victim(self, memory: LayerMemory) -> torch.Tensor:
        scores = memory.device_tier["scores"]
        # The newest `recent - 1` rows stay in the window with the row now arriving; the rest compete.
        candidates = scores.shape[2] - memory.meta["recent"] + 1
        return scores[..., :candidates].argmin(dim=-1)

    def select(self, memory: LayerMemory, query: torch.Tensor) -> Selection:
        keys, values = memory.device_tier["keys"], memory.device_tier["values"]
        bias = kept_padding_bias(memory)
        q = group_query(query, keys.shape[1]).float()  # [b, h, groups, d]
        logits = torch.matmul(q, keys.float().transpose(-1, -2)) * memory.meta["scaling"]
        if bias is not None:
            logits = logits + bias[:, :, None, :]
        # Accumulate this step's attention (summed over the group's query heads); -inf padding stays -inf.
        memory.device_tier["scores"].add_(torch.softmax(logits, dim=-1).sum(dim=2))
        return Selection(keys, values, bias)
