"""``snapkv``: keep the prompt rows the last prompt queries attend to most.

Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation", NeurIPS 2024. The attention
pattern of the prompt's last tokens (the *observation window*) predicts which earlier rows generation
will need. Each prefix row gets the attention mass the window's queries give it (softmax over their full
causal rows, summed over the window and the query heads of its GQA group), 1-D max pooling (kernel 7)
spreads a peak's score to its neighbours so kept rows come with their context, and each KV head keeps
its top ``B - window`` prefix rows plus the whole window. A prompt no longer than ``B`` is kept whole.

Deviation (forced by the fixed budget): the published method compresses the prompt once and lets the
cache grow while decoding. Here a layer never holds more than its budget, so once full, each new row
evicts the kept prompt row with the lowest prefill score; window and generated rows are protected, and
only when no prompt row outside the window remains does the oldest row leave (the window slides).
GQA: the published code scores per query head on repeated KV; here a KV head's score sums its group's
query heads, so each KV head stores one compressed cache (what a GQA cache actually holds).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from zoomkv.errors import ZoomKVError
from zoomkv.protocol.eviction import (
    EvictionMethod,
    check_pooling,
    observation_scores,
    pool_scores,
    store_rows,
    top_rows_and_window,
    window_scores,
)
from zoomkv.protocol.method import MethodConfig, PrefillContext

if TYPE_CHECKING:
    from zoomkv.memory.layer import LayerMemory


@dataclass
class SnapKVConfig(MethodConfig):
    window: int = field(
        default=32,
        metadata={"help": "observation window: the last prompt queries that vote (paper: 32)"},
    )
    kernel_size: int = field(default=7, metadata={"help": "pooling kernel (paper's LongBench setting: 7)"})
    pooling: str = field(default="max", metadata={"help": "\"max\" (published) or \"avg\""})

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ZoomKVError(f"window must be at least 1, got {self.window}")
        check_pooling(self.kernel_size, self.pooling)


class SnapKV(EvictionMethod):
    """Observation-window voting + max pooling; top ``B - window`` prefix rows per KV head + the window.

    Citation: Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation", NeurIPS 2024.
    """

    name = "snapkv"
    config_class = SnapKVConfig
    summary = "keep the prompt rows the last 32 prompt queries attend to most (max-pooled) + that window"
    citation = "Li et al., SnapKV: LLM Knows What You are Looking for Before Generation, NeurIPS 2024"
    config: SnapKVConfig

    def min_budget(self) -> int:
        return self.config.window + 1  # the whole window plus at least one voted-for prefix row

    def compress(self, memory: LayerMemory, ctx: PrefillContext) -> None:
        capacity = self.capacity(ctx)
        idx, scores = self.snap_selection(ctx, capacity)
        store_rows(memory, ctx, idx, scores, capacity)

    def snap_selection(self, ctx: PrefillContext, capacity: int) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Rows to keep (``[b, h, capacity]`` in sequence order, None when the prompt fits) and every prompt
        row's score (``[b, h, T]``: pooled votes on the prefix, +inf on the window, -inf on padding)."""
        b, kv_heads, length, _ = ctx.keys.shape
        window = min(self.config.window, length)
        prefix = length - window
        votes = observation_scores(ctx, window)[..., :prefix]
        # Pool over the prefix only, as published: the window is kept anyway and must not lend its votes.
        votes = pool_scores(votes, self.config.kernel_size, self.config.pooling)
        scores = window_scores(votes, ctx, window)
        if length <= capacity:
            return None, scores
        return top_rows_and_window(scores, window, capacity), scores
