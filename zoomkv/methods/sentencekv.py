"""``sentencekv``: sentence-level semantic KV caching (Zhu et al., 2025).

Prefill: a SnapKV prefilter (observation window 32, max pooling 7) keeps ``semantic_factor`` (5) × B
rows of each KV head; the other rows are dropped for good. The prompt is cut into sentences after every
punctuation token, each kept row belongs to its position's sentence, and each sentence gets one semantic
vector per KV head, the mean of its kept keys, on the device tier. The kept rows themselves go to the host
tier.

Decode: the mean query of the sentence being generated (every query since the last boundary, this one
included, kept as a running sum on the device tier) scores each sentence by ``q̄ · mean key``. Each step
attends to ``start`` first rows and ``recent`` newest rows (32 each) plus whole sentences recalled in score
order until the budget is full; the last sentence that fits only partly contributes its first rows. When a
generated sentence ends, it becomes a sentence like the prompt's (its mean key joins the index).

Sentence boundaries: the prompt's ids come from ``ctx.input_ids`` and the sentence-ending ids from
``boundary_token_ids``, or else from ``ctx.tokenizer``'s vocabulary (every token made only of
``. ! ? 。 ！ ？ …`` and newlines). Generated tokens' ids are not handed to methods by today's runtime; they are
read from ``memory.cache.step_ids`` when present, and otherwise a generated sentence closes every
``segment_length`` (24) steps. Without prompt ids or boundary ids the prompt is cut into fixed segments of
24 real tokens, about one English sentence.

Budget: B counts every KV row a step attends to (start + recent + recalled ≤ B). The semantic vectors are
keys only and never attended: like ClusterKV's centroids and Quest's page bounds they are device-tier
metadata, counted in bytes, not rows.

Deviations, on purpose:
- ``start`` and ``recent`` are ``min(32, B // 4)`` each (the paper's 32 at its budget of 128), so small
  budgets still leave at least half of B for recalled sentences.
- While the current sentence holds a single query the reference attends to *every* kept row; a fixed
  budget cannot, so sentences are then ranked by that single query (the mean of one).
- GQA: a KV head ranks sentences by the sum over its query group of ``q̄_g · mean key`` (the reference
  repeats KV per query head).
- At the step that feeds a boundary token the reference has already emptied its query buffer (and attends
  to every kept row); here that step still ranks with the sentence it ends, which closes right after.
- While every kept row fits B all of them are attended (so B ≥ context is exactly full attention).
- Left padding never belongs to a sentence and is never attended.

``recallable`` holds for what the prefilter keeps: the rows it drops are gone, as in the paper. With the
runtime's ``tail_summary`` row, the tail's running sums still stand for them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from zoomkv.errors import ConfigError
from zoomkv.methods._segments import (
    SENTENCE_MARKS,
    boundary_mask,
    normalize_ids,
    prompt_token_ids,
    resolve_boundary_ids,
    segment_ids,
    step_token_ids,
)
from zoomkv.methods.snapkv import SnapKV
from zoomkv.protocol.eviction import check_pooling, gather_rows
from zoomkv.protocol.method import KVMethod, MethodConfig, PrefillContext, Selection, group_query, kv_rows
from zoomkv.protocol.recallable import padding_bias, recall_rows, reserve_recall_buffer

if TYPE_CHECKING:
    from zoomkv.memory.layer import LayerMemory

# Sentence slots added at a time when generated sentences outgrow the index (a few bytes per KV head each).
_SENTENCE_SLOTS = 16


@dataclass
class SentenceKVConfig(MethodConfig):
    start_budget: int = field(default=32, metadata={"help": "first kept rows always attended (paper: 32)"})
    recent_budget: int = field(default=32, metadata={"help": "newest rows always attended (paper: 32)"})
    semantic_factor: float = field(
        default=5.0,
        metadata={"help": "the prefilter keeps this × B rows on the host tier (paper: 5)"},
    )
    window: int = field(
        default=32,
        metadata={"help": "prefilter: SnapKV observation window (paper code: 32)"},
    )
    kernel_size: int = field(default=7, metadata={"help": "prefilter: pooling kernel (paper code: 7)"})
    pooling: str = field(default="max", metadata={"help": "prefilter: pooling (paper code: max)"})
    boundary_token_ids: tuple[int, ...] | None = field(
        default=None,
        metadata={"help": "token ids that end a sentence (None: found from ctx.tokenizer)"},
    )
    segment_length: int = field(
        default=24,
        metadata={"help": "fallback without token ids: fixed segments of this many real tokens"},
    )

    def __post_init__(self) -> None:
        if self.start_budget < 0 or self.recent_budget < 1:
            raise ConfigError("start_budget must be >= 0 and recent_budget >= 1")
        if self.semantic_factor < 1.0:
            raise ConfigError(f"semantic_factor must be >= 1 (the prefilter keeps factor x B rows), got "
                              f"{self.semantic_factor}")
        if self.window < 1 or self.segment_length < 1:
            raise ConfigError("window and segment_length must be >= 1")
        check_pooling(self.kernel_size, self.pooling)
        self.boundary_token_ids = normalize_ids(self.boundary_token_ids)


class SentenceKV(KVMethod):
    """Sentence-level semantic vectors on the device tier; recall whole sentences by mean query · mean key.

    Citation: Zhu et al., "SentenceKV: Efficient LLM Inference via Sentence-Level Semantic KV Caching", 2025.
    """

    name = "sentencekv"
    config_class = SentenceKVConfig
    citation = "Zhu et al., SentenceKV: Efficient LLM Inference via Sentence-Level Semantic KV Caching, 2025"
    summary = "SnapKV prefilter to 5B rows; per-sentence mean keys; recall sentences by the sentence's mean query"
    recallable = True

    config: SentenceKVConfig

    def min_budget(self) -> int:
        return 2  # the newest row and one recalled row

    def device_rows(self, memory: LayerMemory) -> int:
        # Only the recall buffer holds KV rows; semantic vectors and query sums are metadata.
        return kv_rows(memory.device_tier.get("recall_keys"))

    def fixed_rows(self, budget: int) -> tuple[int, int]:
        """``(start, recent)`` rows attended at every step under a layer budget of ``budget`` rows."""
        cfg = self.config
        quarter = budget // 4
        return min(cfg.start_budget, quarter), max(1, min(cfg.recent_budget, quarter))

    # -- prefill ------------------------------------------------------------------------------------------
    def compress(self, memory: LayerMemory, ctx: PrefillContext) -> None:
        cfg = self.config
        b, h, t, d = ctx.keys.shape
        budget = self.layer_budget(ctx.layer_idx, ctx.num_layers, ctx.budget, ctx.zoom_layers)
        keep = max(budget, int(cfg.semantic_factor * budget))
        idx = None
        if t > keep:
            # The prefilter is SnapKV itself, with a window that leaves room for voted rows at tiny budgets.
            snap = SnapKV(window=min(cfg.window, keep - 1), kernel_size=cfg.kernel_size, pooling=cfg.pooling)
            idx, _ = snap.snap_selection(ctx, keep)
        keys = ctx.keys if idx is None else gather_rows(ctx.keys, idx)
        values = ctx.values if idx is None else gather_rows(ctx.values, idx)
        memory.host_tier["keys"] = memory.host_rows(keys.contiguous(), role="keys")
        memory.host_tier["values"] = memory.host_rows(values.contiguous(), role="values")

        ids = prompt_token_ids(ctx)
        boundary_ids = resolve_boundary_ids(cfg.boundary_token_ids, ctx.tokenizer, SENTENCE_MARKS)
        memory.meta["boundary_ids"] = boundary_ids  # decoding needs them too
        boundary = None
        if ids is not None and boundary_ids:
            boundary = boundary_mask(ids.to(ctx.keys.device), boundary_ids)
        seg = segment_ids(b, t, ctx.keys.device, ctx.valid, boundary,
                          None if boundary is not None else cfg.segment_length)
        seg_rows = seg[:, None, :].expand(b, h, t)
        if idx is not None:
            seg_rows = seg_rows.gather(-1, idx)
        row_valid = seg_rows >= 0  # [b, h, m]: False on kept left-padding rows
        if ctx.valid is not None:
            memory.host_tier["valid"] = memory.host_rows(row_valid[..., None].contiguous())

        # One semantic vector per sentence and KV head: the mean of the sentence's kept keys.
        sentences = int(seg.max()) + 1
        slots = sentences + _SENTENCE_SLOTS
        index = seg_rows.clamp(min=0)
        weight = row_valid.to(torch.float32)
        sums = torch.zeros(b, h, slots, d, dtype=torch.float32, device=ctx.keys.device)
        sums.scatter_add_(2, index[..., None].expand(b, h, -1, d), keys.float() * weight[..., None])
        sizes = torch.zeros(b, h, slots, dtype=torch.float32, device=ctx.keys.device)
        sizes.scatter_add_(2, index, weight)
        memory.device_tier["sentence_keys"] = (sums / sizes.clamp(min=1.0)[..., None]).to(ctx.keys.dtype)
        memory.device_tier["sentence_sizes"] = sizes
        # Generated rows belong to sentence `next_sentence[b]` until it ends (each sequence its own count).
        memory.host_tier["sentence"] = memory.host_rows(seg_rows.clamp(min=0).to(torch.int32)[..., None].contiguous())
        memory.device_tier["next_sentence"] = (seg.max(dim=1).values + 1).clamp(min=0)
        # The sentence being generated: running sums of its queries and keys, and its length.
        memory.device_tier["query_sum"] = torch.zeros(b, ctx.queries.shape[1], d, dtype=torch.float32,
                                                      device=ctx.keys.device)
        memory.device_tier["key_sum"] = torch.zeros(b, h, d, dtype=torch.float32, device=ctx.keys.device)
        memory.device_tier["open_length"] = torch.zeros(b, dtype=torch.long, device=ctx.keys.device)
        memory.device_tier["closing"] = torch.zeros(b, dtype=torch.bool, device=ctx.keys.device)
        memory.meta.update(budget=budget, token_boundaries=boundary is not None,
                           # Python values, so a decode step reads nothing back to learn them: an upper bound of
                           # next_sentence (exact while every row's open sentence has the same length), that
                           # length (None once sentences end on tokens), and whether a sentence may close
                           sentence_bound=max(sentences, 0), open_steps=0, may_close=False)
        reserve_recall_buffer(memory, min(budget, keys.shape[2]))

    # -- decode -------------------------------------------------------------------------------------------
    def append(self, memory: LayerMemory, key: torch.Tensor, value: torch.Tensor) -> None:
        tier = memory.device_tier
        b, h = key.shape[:2]
        memory.host_tier["keys"].append(key)
        memory.host_tier["values"].append(value)
        if "valid" in memory.host_tier:
            memory.host_tier["valid"].append(torch.ones(b, h, 1, 1, dtype=torch.bool, device=key.device))
        sentence = tier["next_sentence"].to(torch.int32)[:, None, None, None].expand(b, h, 1, 1)
        memory.host_tier["sentence"].append(sentence)
        tier["key_sum"] += key[:, :, 0].float()
        tier["open_length"] += 1
        # Does this token end its sentence? Closed after this step's selection, which it still belongs to.
        ids = step_token_ids(memory, b)
        meta = memory.meta
        boundary_ids = meta["boundary_ids"]
        if ids is not None and boundary_ids:
            tier["closing"] = boundary_mask(ids.to(key.device), boundary_ids)
            meta["open_steps"], meta["may_close"] = None, True  # which rows close is data from now on
        else:
            tier["closing"] = tier["open_length"] >= self.config.segment_length
            if meta["open_steps"] is None:
                meta["may_close"] = True
            else:  # every row's open sentence is this long: whether they close is known without reading it
                meta["open_steps"] += 1
                meta["may_close"] = meta["open_steps"] >= self.config.segment_length

    def select(self, memory: LayerMemory, query: torch.Tensor) -> Selection:
        tier = memory.device_tier
        tier["query_sum"] += query[:, :, 0].float()
        keys, values = memory.host_tier["keys"], memory.host_tier["values"]
        n, budget = keys.length, memory.meta["budget"]
        idx = None
        if n > budget:
            idx = self._recall_index(memory, budget)
        rk, rv, idx = recall_rows(memory, keys, values, idx)
        valid = memory.host_tier["valid"].view()[..., 0] if "valid" in memory.host_tier else None
        bias = padding_bias(valid, idx, rk.shape[1], query.dtype, query.device)
        if memory.meta["may_close"]:
            self._close_sentences(memory)
        return Selection(rk, rv, bias)

    # -- internals ----------------------------------------------------------------------------------------
    def _recall_index(self, memory: LayerMemory, budget: int) -> torch.Tensor:
        """Host rows ``[b, h, budget]`` in sequence order: start + recent rows, then sentences by score."""
        tier = memory.device_tier
        start, recent = self.fixed_rows(budget)
        sentence_keys, sizes = tier["sentence_keys"], tier["sentence_sizes"]
        b, h, slots, _ = sentence_keys.shape
        mean_q = tier["query_sum"] / tier["open_length"].clamp(min=1)[:, None, None].float()
        q = group_query(mean_q[:, :, None, :], h)  # [b, h, g, d]
        score = torch.matmul(q, sentence_keys.float().transpose(-1, -2)).sum(dim=2)  # [b, h, slots]
        score = score.masked_fill(sizes == 0, float("-inf"))  # the open sentence and unused slots
        # Rank of each sentence (0 = best); only these small tensors cross to the host, next to the rows.
        order = score.argsort(dim=-1, descending=True, stable=True)
        rank = torch.empty_like(order).scatter_(-1, order, torch.arange(slots, device=order.device).expand(b, h, -1))
        rank = rank.cpu()
        sentence = memory.host_tier["sentence"].view()[..., 0]  # [b, h, n]
        n = sentence.shape[-1]
        priority = rank.gather(-1, sentence.to(device=rank.device, dtype=torch.long))
        pos = torch.arange(n, device=priority.device)
        fixed = pos >= n - recent
        valid = memory.host_tier["valid"].view()[..., 0].to(priority.device) if "valid" in memory.host_tier else None
        if valid is None:
            fixed = fixed | (pos < start)
        else:
            fixed = fixed | (valid & (valid.long().cumsum(-1) <= start))  # the first `start` real rows
        priority = priority.masked_fill(fixed, -1)
        if valid is not None:
            priority = priority.masked_fill(~valid, slots + 1)  # padding only fills slots nothing else can
        # Whole sentences in rank order, each in sequence order: the budget cuts the last one's tail.
        order_key = priority.long() * (n + 1) + pos
        return order_key.topk(budget, dim=-1, largest=False).indices.sort(dim=-1).values

    def _close_sentences(self, memory: LayerMemory) -> None:
        """Generated sentences that just ended join the index; their sequences start a new sentence. Masks, not
        the closing rows' indices: rows that do not close are written back unchanged."""
        tier, meta = memory.device_tier, memory.meta
        closing, nxt = tier["closing"], tier["next_sentence"]
        slots = tier["sentence_keys"].shape[2]
        if meta["sentence_bound"] + 2 > slots:  # the next open sentence may need a slot too
            grow = True
            if meta["open_steps"] is None:
                # Sentences end on tokens, so the bound only bounds: read how many there are (once per several
                # steps), and grow with room to spare so the next read is as far away.
                meta["sentence_bound"] = int(nxt.max())
                grow = meta["sentence_bound"] + 2 + _SENTENCE_SLOTS // 2 > slots
            if grow:
                extra = _SENTENCE_SLOTS
                sk, sz = tier["sentence_keys"], tier["sentence_sizes"]
                tier["sentence_keys"] = torch.cat([sk, sk.new_zeros(sk.shape[0], sk.shape[1], extra, sk.shape[3])], dim=2)
                tier["sentence_sizes"] = torch.cat([sz, sz.new_zeros(sz.shape[0], sz.shape[1], extra)], dim=2)
        sentence_keys, sizes = tier["sentence_keys"], tier["sentence_sizes"]
        b, h, _, d = sentence_keys.shape
        at = nxt.view(b, 1, 1).expand(b, h, 1)
        length = tier["open_length"].float()  # >= 1 on closing rows
        mean = (tier["key_sum"] / length.clamp(min=1)[:, None, None]).to(sentence_keys.dtype)  # [b, h, d]
        at_d = at[..., None].expand(b, h, 1, d)
        sentence_keys.scatter_(2, at_d, torch.where(closing[:, None, None, None], mean[:, :, None],
                                                    sentence_keys.gather(2, at_d)))
        sizes.scatter_(2, at, torch.where(closing[:, None, None], length[:, None, None].expand(b, h, 1),
                                          sizes.gather(2, at)))
        tier["next_sentence"] = nxt + closing.long()
        keep = (~closing).to(torch.float32)
        tier["query_sum"] *= keep[:, None, None]
        tier["key_sum"] *= keep[:, None, None]
        tier["open_length"] *= (~closing).long()
        tier["closing"] = torch.zeros_like(closing)
        meta["sentence_bound"] += 1
        if meta["open_steps"] is not None:  # they all closed together
            meta["open_steps"] = 0
