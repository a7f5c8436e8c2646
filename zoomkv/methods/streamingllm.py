"""``streamingllm``: attention sinks plus a sliding window of the most recent rows.

Xiao et al., "Efficient Streaming Language Models with Attention Sinks", ICLR 2024. The first few tokens
soak up attention mass whatever their content ("attention sinks"), so keeping them next to a window of
recent tokens keeps the softmax stable where a plain sliding window collapses. The method reads no
scores: it is the query-agnostic baseline.

Deviation: the paper re-assigns positions inside the cache (rotary positions by cache slot) so a model can
stream past its trained length. Keys here are stored after RoPE at their true positions (zoomkv's design:
generation continues at the real position), so this is StreamingLLM's eviction rule without the position
shift; within the model's context length that is the setting the paper's comparisons use.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from zoomkv.errors import ZoomKVError
from zoomkv.protocol.eviction import NEG_INF, EvictionMethod, store_rows
from zoomkv.protocol.method import MethodConfig, PrefillContext

if TYPE_CHECKING:
    from zoomkv.memory.layer import LayerMemory


@dataclass
class StreamingLLMConfig(MethodConfig):
    sinks: int = field(
        default=4,
        metadata={"help": "the paper's default: 4 initial tokens suffice as attention sinks"},
    )

    def __post_init__(self) -> None:
        if self.sinks < 0:
            raise ZoomKVError(f"sinks must be non-negative, got {self.sinks}")


class StreamingLLM(EvictionMethod):
    """Keep the first ``sinks`` real tokens and the most recent ``B - sinks`` rows; while decoding, the
    oldest non-sink row leaves as each new row arrives (a ring buffer behind the sinks).

    Citation: Xiao et al., "Efficient Streaming Language Models with Attention Sinks", ICLR 2024.
    """

    name = "streamingllm"
    config_class = StreamingLLMConfig
    summary = "keep 4 attention-sink rows + the most recent rows; slide the window while decoding"
    citation = "Xiao et al., Efficient Streaming Language Models with Attention Sinks, ICLR 2024"
    config: StreamingLLMConfig
    new_row_score = 0.0  # a generated row is an ordinary real row (only padding is -inf)

    def min_budget(self) -> int:
        return self.config.sinks + 1  # the sinks plus at least the current token

    def compress(self, memory: LayerMemory, ctx: PrefillContext) -> None:
        capacity = self.capacity(ctx)
        b, kv_heads, length, _ = ctx.keys.shape
        # Only a padded batch needs per-row state: 0 for real rows, -inf for padding (masked, evicted first).
        scores = None
        if ctx.valid is not None:
            scores = torch.zeros(b, kv_heads, length, device=ctx.keys.device)
            scores = scores.masked_fill(~ctx.valid[:, None, :].to(scores.device), NEG_INF)
        if length <= capacity:
            store_rows(memory, ctx, None, scores, capacity)
            return
        sinks = self.config.sinks
        device = ctx.keys.device
        recent = torch.arange(length - (capacity - sinks), length, device=device)
        if ctx.valid is None:
            idx = torch.cat([torch.arange(sinks, device=device), recent])[None].expand(b, -1)
        else:
            # Sinks are each sequence's first *real* tokens, not the padding in front of them.
            real = ctx.valid.to(device).sum(dim=1)  # [b]
            start = length - real
            idx = torch.cat([start[:, None] + torch.arange(sinks, device=device), recent.expand(b, -1)], dim=1)
            # A sequence with no more real tokens than the budget keeps all of them (the last `capacity`
            # rows, its leading padding masked): sinks and window would overlap.
            short = real <= capacity
            idx = torch.where(short[:, None], torch.arange(length - capacity, length, device=device), idx)
        idx = idx[:, None, :].expand(-1, kv_heads, -1).contiguous()
        store_rows(memory, ctx, idx, scores, capacity)

    def _victim(self, memory: LayerMemory) -> torch.Tensor:
        keys = memory.device_tier["keys"]
        victim = torch.full(keys.shape[:2], self.config.sinks, dtype=torch.long, device=keys.device)
        scores = memory.device_tier.get("scores")
        if scores is not None:
            # Rows stay in sequence order with left padding in front: while a padding row remains it is
            # row 0 and goes first; after that rows 0..sinks-1 are the first real tokens (the sinks).
            victim = torch.where(scores[:, :, 0] == NEG_INF, torch.zeros_like(victim), victim)
        return victim
