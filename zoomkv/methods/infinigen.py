"""``infinigen``: speculative recall with skewed partial queries and keys (Lee et al., OSDI 2024).

Offline (``zoomkv calibrate infinigen --model M``): per layer and KV head, an orthogonal skew ``A`` (the
right singular vectors of the layer's post-RoPE queries on calibration text) and the 20% of skewed
channels that carry most of ``q·k`` (see ``zoomkv.methods._infinigen``).

Prefill: every row goes to the host tier; the device tier keeps the *partial skewed keys*, ``(k A)[:, C]``
for the chosen channels C (20% of a key's bytes, counted in bytes, not rows), plus ``A[:, C]``.

Decode: the attention scores are estimated from the partial query and partial keys,
``s = (q A)[C] · (k A)[C] · scaling``. Per query head, the rows with ``s > max(s) − alpha`` are the
important ones; as in the authors' code, their count is averaged over all heads (and the batch) and that
many rows with the highest estimates are recalled for every KV head, capped at the budget (the newest
row is always one of them). ``alpha`` is 5, the authors' setting for Llama models (their OPT runs use 4).

Deviations, on purpose:
- **Same-layer speculation.** InfiniGen estimates layer i+1's scores while layer i runs, from layer i's
  attention input pushed through layer i+1's query projection, so the recall can be prefetched. A method
  here sees only its own layer's query (the attention function gets no hidden states and no other layer's
  weights), so layer i estimates its own scores from its own exact query. That removes InfiniGen's
  cross-layer error (hidden states drift between layers) and keeps only the partial-channel error: its
  selections are an upper bound of InfiniGen's. The faithful version needs a runtime hook: a forward
  pre-hook on every attention module that stashes its input hidden states and position embeddings on the
  cache, plus access to each attention module (its ``q_proj``, ``q_norm``); layer i+1's select would then
  compute ``RoPE(q_proj_{i+1}(hidden_i))`` and estimate from that query instead of its own.
- GQA: the skew is per KV head, fitted on the stacked queries of its group, and a KV head's rows are
  ranked by the best estimate among its query heads (each head's important rows stay eligible).
- The newest row is always recalled; while every row fits the budget all are attended (so B ≥ context is
  exactly full attention).
- The first layer is kept dense (``dense_layers=1``): InfiniGen has no previous layer to speculate it from.

Measured on SmolLM2-135M (1000-token prompt, B = 512): alpha = 5 fetches 17 to 354 rows per layer (mean
over heads), far fewer than B allows. That is InfiniGen's trade (bandwidth for accuracy); a larger alpha
uses more of B.

``needs_profile``: without a profile the method raises, naming the calibration command. The profile is
looked up as ``profile_dir(ctx.model_name)/infinigen.safetensors`` unless ``profile`` names one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from zoomkv.errors import ConfigError
from zoomkv.memory.recall import padding_bias, recall_rows, reserve_recall_buffer
from zoomkv.memory.tiers import RowBuffer
from zoomkv.methods._infinigen import load_layer, resolve_profile
from zoomkv.methods._recallable import (
    append_host_rows,
    check_dense_layers,
    dense_append,
    dense_select,
    host_length,
    host_valid,
    is_dense,
    keep_dense,
    kv_rows,
    store_host_rows,
)
from zoomkv.methods.base import KVMethod, MethodConfig, PrefillContext, Selection, group_query
from zoomkv.methods.registry import register_method

if TYPE_CHECKING:
    from zoomkv.memory.layer import LayerMemory


@dataclass
class InfiniGenConfig(MethodConfig):
    alpha: float = 5.0  # recall rows whose estimated logit is within alpha of the head's best (Llama: 5)
    profile: str | None = None  # profile file, folder or calibrated model name (None: the running model's)
    dense_layers: int = 1  # the first layer has no previous layer to speculate from: kept whole

    def __post_init__(self) -> None:
        if self.alpha <= 0:
            raise ConfigError(f"alpha must be > 0, got {self.alpha}")
        check_dense_layers(self.dense_layers)


def estimate_scores(query: torch.Tensor, partial_keys: torch.Tensor, skew: torch.Tensor, scaling: float) -> torch.Tensor:
    """Estimated logits ``[b, h, g, n]`` of every query head of each KV head's group: the skewed partial
    query (``q · A[:, C]``, ``skew`` ``[h, d, k]``) against the skewed partial keys ``[b, h, n, k]``."""
    kv_heads = partial_keys.shape[1]
    q = group_query(query, kv_heads).float()  # [b, h, g, d]
    partial_q = torch.matmul(q, skew.float()[None])  # [b, h, g, k]
    return torch.matmul(partial_q, partial_keys.float().transpose(-1, -2)) * scaling


def fetch_count(scores: torch.Tensor, alpha: float) -> int:
    """InfiniGen's fetch size: per query head, the rows scoring above ``max − alpha``, averaged over every
    head and sequence (one count for all, as in the authors' code)."""
    best = scores.amax(dim=-1, keepdim=True)
    counts = (scores > best - alpha).sum(dim=-1).float()
    return int(counts.mean().item())


@register_method
class InfiniGen(KVMethod):
    """Skewed partial keys on the device tier; recall the rows whose estimated score is near the best.

    Citation: Lee et al., "InfiniGen: Efficient Generative Inference of Large Language Models with Dynamic
    KV Cache Management", OSDI 2024.
    """

    name = "infinigen"
    config_class = InfiniGenConfig
    citation = ("Lee et al., InfiniGen: Efficient Generative Inference of Large Language Models with Dynamic KV "
                "Cache Management, OSDI 2024")
    summary = "SVD-skewed 20% partial keys on device; recall rows scoring within alpha of the best estimate"
    recallable = True
    needs_profile = True

    config: InfiniGenConfig

    def min_budget(self) -> int:
        return 2  # the newest row and one recalled row

    def dense_layer(self, layer_idx: int, num_layers: int) -> bool:
        return layer_idx < self.config.dense_layers

    def device_rows(self, memory: LayerMemory) -> int:
        # Dense layers hold "keys"; the others only the recall buffer (partial keys are counted in bytes).
        return kv_rows(memory.device_tier.get("keys")) + kv_rows(memory.device_tier.get("recall_keys"))

    # -- prefill ------------------------------------------------------------------------------------------
    def compress(self, memory: LayerMemory, ctx: PrefillContext) -> None:
        if self.dense_layer(ctx.layer_idx, ctx.num_layers):
            keep_dense(memory, ctx)
            return
        b, h, t, d = ctx.keys.shape
        path = resolve_profile(self.config.profile, ctx.model_name)
        skew, channels = load_layer(path, ctx.layer_idx, h, d)
        # Only the chosen columns of A are ever used: q·A[:, C] is the partial skewed query.
        partial = torch.gather(skew, 2, channels[:, None, :].expand(h, d, -1)).to(ctx.keys.device)
        memory.device_tier["skew"] = partial.contiguous()
        store_host_rows(memory, ctx)
        partial_keys = torch.matmul(ctx.keys.float(), partial[None]).to(ctx.keys.dtype)
        memory.device_tier["partial_keys"] = RowBuffer(partial_keys.contiguous())
        budget = self.layer_budget(ctx.layer_idx, ctx.num_layers, ctx.budget, ctx.zoom_layers)
        memory.meta.update(budget=budget, scaling=ctx.scaling, profile=str(path))
        reserve_recall_buffer(memory, min(budget, t))

    # -- decode -------------------------------------------------------------------------------------------
    def append(self, memory: LayerMemory, key: torch.Tensor, value: torch.Tensor) -> None:
        if is_dense(memory):
            dense_append(memory, key, value)
            return
        append_host_rows(memory, key, value)
        skew = memory.device_tier["skew"]
        memory.device_tier["partial_keys"].append(torch.matmul(key.float(), skew[None]).to(key.dtype))

    def select(self, memory: LayerMemory, query: torch.Tensor) -> Selection:
        if is_dense(memory):
            return dense_select(memory)
        keys = memory.host_tier["keys"].view()
        values = memory.host_tier["values"].view()
        n, budget = host_length(memory), memory.meta["budget"]
        valid = host_valid(memory)
        idx = None
        if n > budget:
            scores = estimate_scores(query, memory.device_tier["partial_keys"].view(), memory.device_tier["skew"],
                                     memory.meta["scaling"])
            if valid is not None:
                scores = scores.masked_fill(~valid.to(scores.device)[:, :, None, :], float("-inf"))
            count = min(max(fetch_count(scores, self.config.alpha), 1), budget - 1)
            rank = scores.amax(dim=2)  # [b, h, n]: a row one query head needs is eligible for the group
            rank[..., -1] = float("inf")  # the newest row is always attended
            idx = rank.topk(count + 1, dim=-1).indices.sort(dim=-1).values
        rk, rv = recall_rows(memory, keys, values, idx)
        return Selection(rk, rv, padding_bias(valid, idx, keys.shape[1], query.dtype, query.device))
