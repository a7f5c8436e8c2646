"""``chunkkv``: keep whole 10-token chunks, chosen by SnapKV's observation-window scores.

Liu et al., "ChunkKV: Semantic-Preserving KV Cache Compression for Efficient Long-Context LLM
Inference", 2025 (arXiv:2502.00299). Scoring tokens one by one keeps fragments ("the", a digit)
stripped of the words around them; ChunkKV scores fixed chunks of consecutive tokens (the sum of their
observation-window attention) and keeps the best chunks whole, plus the observation window. It also
observes that adjacent layers keep very similar indices and *reuses* them: within each group of
``reuse_layers`` consecutive compressed layers, the first computes the selection and the others take it
as is, skipping the scoring.

Choices and deviations:

- Chunks are laid from each sequence's first real token (a left-padded sequence is chunked as it would
  be alone); the prefix's last chunk may be shorter than 10. The window's attention is summed per chunk
  without pooling, as in the authors' implementation (the chunk sum does what SnapKV's pooling does:
  keep neighbours together); ``kernel_size > 1`` pools first.
- ``B - window`` need not be a multiple of 10: the top chunks are kept whole and the next-best chunk
  fills the remainder with its best-scored rows (the authors keep only whole chunks and leave it unused).
- Chunks are chosen per KV head (scores summed over the head's GQA group), as SnapKV does.
- Index reuse is over the layers the cache compresses (for hybrid models, the full-attention ones).
  The leader of a group publishes its kept positions and their scores in its own device tier, under
  ``reuse_indices`` / ``reuse_scores`` (counted in the memory report while they exist); the last layer of
  the group reads them and deletes them, so after prefill nothing extra is held. Every layer of a group
  shares one budget (ChunkKV's budget is uniform), so the indices always fit.
- Decoding (forced by the fixed budget): once full, each new row evicts a row of the lowest-scored kept
  chunk, so chunks leave as units, oldest row first; window and generated rows are protected.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from zoomkv.errors import ZoomKVError
from zoomkv.protocol.eviction import (
    EvictionMethod,
    check_pooling,
    gather_rows,
    observation_scores,
    pool_scores,
    store_rows,
    window_scores,
    with_window,
)
from zoomkv.protocol.method import MethodConfig, PrefillContext

if TYPE_CHECKING:
    from zoomkv.memory.layer import LayerMemory

REUSE_INDICES = "reuse_indices"
REUSE_SCORES = "reuse_scores"


@dataclass
class ChunkKVConfig(MethodConfig):
    window: int = field(default=32, metadata={"help": "observation window, as SnapKV"})
    chunk_size: int = field(default=10, metadata={"help": "rows per chunk: a chunk is kept or evicted whole (paper default)"})
    reuse_layers: int = field(
        default=2,
        metadata={"help": "layer-wise index reuse: groups of this many compressed layers share indices"},
    )
    kernel_size: int = field(
        default=1,
        metadata={"help": "no pooling before chunking (the authors' implementation)"},
    )
    pooling: str = field(default="max", metadata={"help": "pooling of the window votes: \"max\" or \"avg\""})

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ZoomKVError(f"window must be at least 1, got {self.window}")
        if self.chunk_size < 1:
            raise ZoomKVError(f"chunk_size must be at least 1, got {self.chunk_size}")
        if self.reuse_layers < 1:
            raise ZoomKVError(f"reuse_layers must be at least 1 (1 = no reuse), got {self.reuse_layers}")
        check_pooling(self.kernel_size, self.pooling)


class ChunkKV(EvictionMethod):
    """Whole top-scoring chunks + the observation window; adjacent compressed layers reuse the indices.

    Citation: Liu et al., "ChunkKV: Semantic-Preserving KV Cache Compression for Efficient Long-Context
    LLM Inference", arXiv:2502.00299, 2025.
    """

    name = "chunkkv"
    config_class = ChunkKVConfig
    summary = "keep whole 10-token chunks by observation-window attention + the window; reuse indices per 2 layers"
    citation = (
        "Liu et al., ChunkKV: Semantic-Preserving KV Cache Compression for Efficient Long-Context LLM "
        "Inference, arXiv 2025"
    )
    config: ChunkKVConfig

    def min_budget(self) -> int:
        return self.config.window + 1

    # -- layer-wise index reuse --------------------------------------------------------------------------
    def _group(self, memory: LayerMemory) -> tuple[LayerMemory, bool, bool]:
        """(the group's leader, whether this layer leads a group with followers, whether it is the group's
        last follower). Groups run over the cache's compressed layers, in order."""
        cache = getattr(memory, "cache", None)
        layers = getattr(cache, "layers", None) or [memory]
        zoom = [layer for layer in layers if isinstance(layer, type(memory))]
        if memory not in zoom:  # a layer used outside its cache: no group
            return memory, False, False
        rank = zoom.index(memory)
        first = rank - rank % self.config.reuse_layers
        end = min(first + self.config.reuse_layers, len(zoom))
        leads = rank == first and end - first > 1
        last_follower = rank != first and rank == end - 1
        return zoom[first], leads, last_follower

    def compress(self, memory: LayerMemory, ctx: PrefillContext) -> None:
        capacity = self.capacity(ctx)
        leader, leads, last_follower = self._group(memory)
        shared = leader.device_tier.get(REUSE_INDICES) if leader is not memory else None
        if shared is not None and shared.shape[:2] == ctx.keys.shape[:2] and shared.shape[2] <= capacity:
            # A follower: take the leader's selection, compute nothing.
            memory.device_tier["keys"] = gather_rows(ctx.keys, shared)
            memory.device_tier["values"] = gather_rows(ctx.values, shared)
            memory.device_tier["scores"] = leader.device_tier[REUSE_SCORES].clone()
            memory.meta.update(capacity=capacity, padded=ctx.valid is not None, reused_from=leader.layer_idx)
            if last_follower:  # nobody else needs them: the leader stops holding them
                del leader.device_tier[REUSE_INDICES]
                del leader.device_tier[REUSE_SCORES]
            return
        idx, scores = self.chunk_selection(ctx, capacity)
        if leads:
            b, kv_heads, length, _ = ctx.keys.shape
            kept = idx if idx is not None else torch.arange(length, device=ctx.keys.device).expand(b, kv_heads, -1)
            leader_scores = gather_rows(scores, kept)
            memory.device_tier[REUSE_INDICES] = kept.contiguous()
            memory.device_tier[REUSE_SCORES] = leader_scores.contiguous()
        store_rows(memory, ctx, idx, scores, capacity)

    # -- selection -----------------------------------------------------------------------------------------
    def chunk_selection(self, ctx: PrefillContext, capacity: int) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Rows to keep (``[b, h, capacity]`` in sequence order; None when the prompt fits) and each prompt
        row's score (``[b, h, T]``: its chunk's score on the prefix, +inf on the window, -inf on padding)."""
        b, kv_heads, length, _ = ctx.keys.shape
        device = ctx.keys.device
        window = min(self.config.window, length)
        prefix = length - window
        votes = observation_scores(ctx, window)[..., :prefix]
        votes = pool_scores(votes, self.config.kernel_size, self.config.pooling)
        pos = torch.arange(prefix, device=device)
        if ctx.valid is not None:
            # Chunk from each sequence's first real token; padding goes to an extra chunk, dropped below.
            start = (~ctx.valid.to(device)).sum(dim=1, keepdim=True)  # [b, 1] padding rows in front
            real = pos[None, :] >= start
            votes = votes.masked_fill(~real[:, None, :], 0.0)
        else:
            start = torch.zeros(1, 1, dtype=torch.long, device=device)
            real = torch.ones(1, prefix, dtype=torch.bool, device=device)
        num_chunks = -(-prefix // self.config.chunk_size)
        chunk = torch.where(real, (pos[None, :] - start) // self.config.chunk_size, num_chunks)  # [b|1, prefix]
        chunk = chunk[:, None, :].expand(b, kv_heads, -1)
        totals = torch.zeros(b, kv_heads, num_chunks + 1, device=device).scatter_add_(2, chunk, votes)
        row_chunk_score = torch.gather(totals, 2, chunk)  # every row carries its chunk's score
        scores = window_scores(row_chunk_score, ctx, window)
        if length <= capacity:
            return None, scores
        # Rank prefix rows by (chunk score desc, chunk position asc, own vote desc), least significant key
        # sorted first with stable sorts: the first capacity - window rows are the best chunks whole, then
        # the best rows of the next chunk.
        order = votes.argsort(dim=-1, descending=True, stable=True)
        order = order.gather(2, chunk.gather(2, order).argsort(dim=-1, stable=True))
        order = order.gather(2, scores[..., :prefix].gather(2, order).argsort(dim=-1, descending=True, stable=True))
        return with_window(order[..., : capacity - window].sort(dim=-1).values, length, window), scores
