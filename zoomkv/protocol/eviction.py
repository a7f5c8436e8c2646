"""Shared machinery of the eviction methods (``streamingllm``, ``snapkv``, ``pyramidkv``, ``chunkkv``, ``h2o``).

Eviction methods keep a subset of the rows on the device tier and drop the rest for good: nothing goes to
the host tier, so what the memory report counts is really all that is held. Per layer they store

- ``device_tier["keys"]`` / ``["values"]``: the kept rows ``[batch, kv_heads, n, d]``, in sequence order;
- ``device_tier["scores"]`` (float32 ``[batch, kv_heads, n]``, optional): each kept row's eviction priority.
  The lowest goes first; ``-inf`` marks a left-padding row, which is also never attended (its logit gets a
  ``-inf`` bias), and ``+inf`` marks a row the method protects;
- ``meta["capacity"]``: the rows this layer may hold (its layer budget), ``meta["padded"]``: whether any
  ``-inf`` row may be present (so unpadded batches skip building a bias every step).

The batch shares one tensor, so every batch row and KV head keeps the same *number* of rows; a sequence
shorter than the others keeps some of its padding rows, masked, rather than getting a ragged tensor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from zoomkv.errors import ZoomKVError
from zoomkv.protocol.method import KVMethod, Memory, PrefillContext, Selection
from zoomkv.protocol.recallable import padding_bias

NEG_INF = float("-inf")
POS_INF = float("inf")

# Largest logits block (elements) one prefill scoring step materialises: 2**24 float32 = 64 MiB, so a long
# prompt is scored in query chunks instead of allocating heads x T x T at once.
_SCORE_BLOCK_ELEMENTS = 2**24


# -- scoring at prefill -------------------------------------------------------------------------------------
def key_valid(ctx: PrefillContext) -> torch.Tensor | None:
    """``[batch, 1, T]`` bool (False on left padding), or None when nothing is padded."""
    return None if ctx.valid is None else ctx.valid[:, None, :].to(ctx.keys.device)


def observation_scores(ctx: PrefillContext, window: int) -> torch.Tensor:
    """SnapKV's vote: the attention each key receives from the last ``window`` prompt queries.

    Each window query's softmax runs over its whole causal row (every earlier key, padding masked), as the
    exact prefill attention did; the probabilities are then summed over the window and over the query heads
    of each KV head's GQA group. Returns float32 ``[batch, kv_heads, T]``.
    """
    b, kv_heads, length, d = ctx.keys.shape
    groups = ctx.num_kv_groups
    # Query head h serves KV head h // groups, so consecutive heads reshape into their group.
    q = ctx.queries[:, :, length - window :].float().reshape(b, kv_heads, groups * window, d)
    logits = torch.matmul(q, ctx.keys.float().transpose(-1, -2)) * ctx.scaling  # [b, h, g*w, T]
    q_pos = torch.arange(length - window, length, device=q.device)
    allowed = torch.arange(length, device=q.device)[None, :] <= q_pos[:, None]  # causal, [w, T]
    allowed = allowed.repeat(groups, 1)[None, None]  # [1, 1, g*w, T]
    valid = key_valid(ctx)
    if valid is not None:
        allowed = allowed & valid[:, :, None, :]
    logits = logits.masked_fill(~allowed, NEG_INF)
    # A padded window query sees only padding: its row is all -inf and softmax gives NaN; it casts no vote.
    probs = torch.softmax(logits, dim=-1).nan_to_num_(0.0)
    return probs.sum(dim=2)


def accumulated_scores(ctx: PrefillContext) -> torch.Tensor:
    """H2O's prefill statistic: the attention each key receives summed over *every* prompt query (and the
    query heads of its GQA group). Computed in query chunks so memory stays bounded; float32
    ``[batch, kv_heads, T]``, ``-inf`` on padding keys. Computed once per prefill: methods and budgets
    replaying the same one get a copy (``PrefillContext.derived``)."""
    kept = ctx.derived.get("accumulated_scores")
    if kept is not None:
        return kept.clone()
    b, kv_heads, length, d = ctx.keys.shape
    groups = ctx.num_kv_groups
    q = ctx.queries.float().reshape(b, kv_heads, groups, length, d)
    keys = ctx.keys.float()
    valid = key_valid(ctx)
    total = torch.zeros(b, kv_heads, length, dtype=torch.float32, device=keys.device)
    chunk = max(1, _SCORE_BLOCK_ELEMENTS // max(1, b * kv_heads * groups * length))
    for start in range(0, length, chunk):
        end = min(length, start + chunk)
        # Causal: queries start..end-1 see only keys 0..end-1, so later keys are never computed.
        logits = torch.matmul(q[:, :, :, start:end], keys[:, :, None, :end].transpose(-1, -2)) * ctx.scaling
        q_pos = torch.arange(start, end, device=keys.device)
        allowed = torch.arange(end, device=keys.device)[None, :] <= q_pos[:, None]  # [c, end]
        allowed = allowed[None, None, None]
        if valid is not None:
            allowed = allowed & valid[:, :, None, None, :end]
        probs = torch.softmax(logits.masked_fill(~allowed, NEG_INF), dim=-1).nan_to_num_(0.0)
        total[:, :, :end] += probs.sum(dim=(2, 3))
    total = mask_padding(total, ctx)
    ctx.derived["accumulated_scores"] = total.clone()
    return total


def pool_scores(scores: torch.Tensor, kernel_size: int, pooling: str) -> torch.Tensor:
    """SnapKV's clustering: 1-D pooling along the sequence (stride 1, same length), so the neighbours of a
    strongly attended row score high too and the kept rows come in small runs rather than isolated tokens."""
    if kernel_size <= 1 or scores.shape[-1] == 0:
        return scores
    pad = kernel_size // 2
    if pooling == "max":
        out = F.max_pool1d(scores, kernel_size=kernel_size, stride=1, padding=pad)
    elif pooling == "avg":
        out = F.avg_pool1d(scores, kernel_size=kernel_size, stride=1, padding=pad)
    else:  # pragma: no cover - configs validate this
        raise ZoomKVError(f"unknown pooling {pooling!r}; use 'max' or 'avg'")
    return out[..., : scores.shape[-1]]  # an even kernel yields one extra position


def mask_padding(scores: torch.Tensor, ctx: PrefillContext) -> torch.Tensor:
    """Scores ``[b, h, T]`` with padding rows set to ``-inf``: never chosen over a real row, never attended."""
    valid = key_valid(ctx)
    if valid is None:
        return scores
    return scores.masked_fill(~valid, NEG_INF)


def window_scores(prefix_scores: torch.Tensor, ctx: PrefillContext, window: int) -> torch.Tensor:
    """Every prompt row's score ``[b, h, T]``: the prefix rows' votes, ``+inf`` on the observation window
    (always kept), ``-inf`` on padding."""
    b, h, _ = prefix_scores.shape
    protected = torch.full((b, h, window), POS_INF, device=prefix_scores.device)
    return mask_padding(torch.cat([prefix_scores, protected], dim=-1), ctx)


def with_window(top: torch.Tensor, length: int, window: int) -> torch.Tensor:
    """The chosen prefix rows ``top`` (``[b, h, k]``, in order) followed by the window's rows."""
    tail = torch.arange(length - window, length, device=top.device).expand(*top.shape[:2], -1)
    return torch.cat([top, tail], dim=-1)


def top_rows_and_window(scores: torch.Tensor, window: int, capacity: int) -> torch.Tensor:
    """``[b, h, capacity]`` rows in sequence order: the best ``capacity - window`` of the prefix by
    ``scores`` (``window_scores``), then the window."""
    length = scores.shape[-1]
    top = scores[..., : length - window].topk(capacity - window, dim=-1).indices.sort(dim=-1).values
    return with_window(top, length, window)


def check_pooling(kernel_size: int, pooling: str) -> None:
    if kernel_size < 1:
        raise ZoomKVError(f"kernel_size must be at least 1, got {kernel_size}")
    if pooling not in ("max", "avg"):
        raise ZoomKVError(f"pooling must be 'max' or 'avg', got {pooling!r}")


# -- row bookkeeping ----------------------------------------------------------------------------------------
def gather_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Rows ``idx`` (``[b, h, k]``) of ``x`` (``[b, h, n]`` or ``[b, h, n, d]``) along the row axis."""
    if x.dim() == 4:
        return torch.gather(x, 2, idx[..., None].expand(-1, -1, -1, x.shape[-1]))
    return torch.gather(x, 2, idx)


def replace_row(x: torch.Tensor, victim: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Drop row ``victim[b, h]`` of ``x`` and put ``new`` (``[b, h, 1(, d)]``) at the end, keeping the other
    rows in order: one gather of the ``n`` rows, no reallocation beyond what ``torch.cat`` would do."""
    n = x.shape[2]
    j = torch.arange(n, device=x.device)
    # Row j of the result is old row j, or j + 1 once past the victim; the last slot is overwritten below.
    idx = (j + (j >= victim[..., None])).clamp_(max=n - 1)
    out = gather_rows(x, idx)
    out[:, :, n - 1 :] = new
    return out


def store_rows(
    memory: Memory,
    ctx: PrefillContext,
    idx: torch.Tensor | None,
    scores: torch.Tensor | None,
    capacity: int,
) -> None:
    """Keep prompt rows ``idx`` (``[b, h, k]`` in sequence order; None keeps all) with their per-row
    ``scores`` (``[b, h, T]`` over the prompt, or None), on the device tier only."""
    keys, values = ctx.keys, ctx.values
    if idx is not None:
        keys, values = gather_rows(keys, idx), gather_rows(values, idx)
        scores = gather_rows(scores, idx) if scores is not None else None
    # contiguous(): a view into the prefill tensors would keep the whole prompt's KV alive.
    memory.device_tier["keys"] = keys.contiguous()
    memory.device_tier["values"] = values.contiguous()
    if scores is not None:
        memory.device_tier["scores"] = scores.float().contiguous()
    memory.meta["capacity"] = capacity
    memory.meta["padded"] = ctx.valid is not None


def kept_padding_bias(memory: Memory) -> torch.Tensor | None:
    """``-inf`` logit bias for the kept rows that are left padding (rows whose score is ``-inf``)."""
    scores = memory.device_tier.get("scores")
    if scores is None or not memory.meta.get("padded", False):
        return None
    return padding_bias(scores != NEG_INF, None, scores.shape[1], scores.dtype, scores.device)


class EvictionMethod(KVMethod):
    """Base of the eviction methods: keep ``meta["capacity"]`` rows at most; once full, each decode step
    evicts the row ``_victim`` names and appends the new one. Subclasses implement ``compress``."""

    recallable = False  # evicted rows are gone: host bytes stay 0

    # Score a freshly generated row gets. SnapKV-style methods protect generated rows (+inf); H2O starts
    # them at 0 and lets attention accumulate.
    new_row_score: float = POS_INF

    def capacity(self, ctx: PrefillContext) -> int:
        """Rows per KV head this layer keeps: its share of the budget (``layer_budget``)."""
        if ctx.budget is None:  # check_budget refuses this before any prefill; kept for direct callers
            raise ZoomKVError(f"method {self.name!r} needs a budget")
        return self.layer_budget(ctx.layer_idx, ctx.num_layers, ctx.budget, ctx.zoom_layers)

    def _victim(self, memory: Memory) -> torch.Tensor:
        """``[b, h]`` index of the row to evict when the layer is full. Default: the lowest score; among
        equal scores the first, i.e. the oldest (``argmin`` returns the first minimum), so once only
        protected (+inf) rows remain the window slides."""
        return memory.device_tier["scores"].argmin(dim=-1)

    def append(self, memory: Memory, key: torch.Tensor, value: torch.Tensor) -> None:
        tier = memory.device_tier
        scores = tier.get("scores")
        new_score = None
        if scores is not None:
            new_score = torch.full(scores.shape[:2] + (1,), self.new_row_score, dtype=scores.dtype, device=scores.device)
        if tier["keys"].shape[2] < memory.meta["capacity"]:
            tier["keys"] = torch.cat([tier["keys"], key], dim=2)
            tier["values"] = torch.cat([tier["values"], value], dim=2)
            if scores is not None:
                tier["scores"] = torch.cat([scores, new_score], dim=2)
            return
        # Full: evict before attending, so the budget holds at every step (the runtime checks right after).
        victim = self._victim(memory)
        tier["keys"] = replace_row(tier["keys"], victim, key)
        tier["values"] = replace_row(tier["values"], victim, value)
        if scores is not None:
            tier["scores"] = replace_row(scores, victim, new_score)

    def extend(self, memory: Memory, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Several rows at once, exactly as appending them one by one would leave the layer, in one gather.

        One by one, each arriving row is kept and the lowest-scored row already there (the first among equal
        scores) makes room. By induction the layer then holds the newest row plus the best ``capacity - 1``
        of all rows before it, ranked by (score, position): the earlier of two equal scores goes first. A
        method with its own ``_victim`` rule (H2O, StreamingLLM) appends row by row."""
        tier = memory.device_tier
        scores = tier.get("scores")
        if type(self)._victim is not EvictionMethod._victim or scores is None:
            super().extend(memory, keys, values)
            return
        m = keys.shape[2]
        new_scores = torch.full(scores.shape[:2] + (m,), self.new_row_score, dtype=scores.dtype, device=scores.device)
        all_keys = torch.cat([tier["keys"], keys], dim=2)
        all_values = torch.cat([tier["values"], values], dim=2)
        all_scores = torch.cat([scores, new_scores], dim=2)
        # one by one never shrinks a layer: one that already holds more than its capacity keeps its size
        capacity, total = max(memory.meta["capacity"], scores.shape[2]), all_keys.shape[2]
        if total <= capacity:
            tier["keys"], tier["values"], tier["scores"] = all_keys, all_values, all_scores
            return
        # best first: by score, then the later position (a stable sort of the reversed rows)
        earlier = all_scores[..., : total - 1].flip(-1)
        order = earlier.sort(dim=-1, descending=True, stable=True).indices[..., : capacity - 1]
        last = torch.full(order.shape[:2] + (1,), total - 1, dtype=order.dtype, device=order.device)
        idx = torch.cat([total - 2 - order, last], dim=-1).sort(dim=-1).values  # back in sequence order
        tier["keys"] = gather_rows(all_keys, idx)
        tier["values"] = gather_rows(all_values, idx)
        tier["scores"] = gather_rows(all_scores, idx)

    def select(self, memory: Memory, query: torch.Tensor) -> Selection:
        return Selection(memory.device_tier["keys"], memory.device_tier["values"], kept_padding_bias(memory))
