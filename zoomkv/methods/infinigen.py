"""``infinigen``: speculative recall with skewed partial queries and keys (Lee et al., OSDI 2024).

Offline (``zoomkv calibrate infinigen --model M``): per layer and KV head, an orthogonal skew ``A`` (the
right singular vectors of the layer's post-RoPE queries on calibration text) and the 20% of skewed
channels that carry most of ``q·k`` (see ``zoomkv.methods.infinigen_profile``).

Prefill: every row goes to the host tier; the device tier keeps the *partial skewed keys*, ``(k A)[:, C]``
for the chosen channels C (20% of a key's bytes, counted in bytes, not rows), plus ``A[:, C]``.

Decode: the attention scores are estimated from the partial query and partial keys,
``s = (q A)[C] · (k A)[C] · scaling``. Per query head, the rows with ``s > max(s) − alpha`` are the
important ones; as in the authors' code, their count is averaged over all heads (and the batch) and that
many rows with the highest estimates are recalled for every KV head, capped at the budget (the newest
row is always one of them). ``alpha`` is 5, the authors' setting for Llama models (their OPT runs use 4).

**Speculation from the previous layer** (``speculate="previous_layer"``, the paper's): layer i's scores
are estimated from the query layer i's weights make from layer i−1's attention input,
``RoPE(q_norm(q_proj_i(x_{i−1})))``, which is what lets InfiniGen prefetch layer i's rows while layer
i−1 runs. The runtime hands every attention module's input of the step in progress to the method
(``zoomkv.memory.speculation``). ``speculate="same_layer"`` estimates from layer i's own exact query
instead (no cross-layer drift, only the partial-channel error: an upper bound of InfiniGen's selections).
Nothing here overlaps the recall with the previous layer's compute: the selection is InfiniGen's, the
timing is not.

Deviations, on purpose:
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

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from zoomkv.errors import ConfigError
from zoomkv.memory.speculation import speculative_query
from zoomkv.memory.tiers import RowBuffer
from zoomkv.methods.infinigen_profile import load_layer, resolve_profile
from zoomkv.protocol.method import MethodConfig, PrefillContext, Selection, group_query
from zoomkv.protocol.recallable import (
    RecallableMethod,
    check_dense_layers,
    host_length,
    host_valid,
    padding_bias,
    recall_rows,
    reserve_recall_buffer,
)

if TYPE_CHECKING:
    from zoomkv.memory.layer import LayerMemory


@dataclass
class InfiniGenConfig(MethodConfig):
    alpha: float = field(
        default=5.0,
        metadata={"help": "recall rows whose estimated logit is within alpha of the head's best (Llama: 5)"},
    )
    profile: str | None = field(
        default=None,
        metadata={"help": "profile file, folder or calibrated model name (None: the running model's)"},
    )
    dense_layers: int = field(
        default=1,
        metadata={"help": "the first layer has no previous layer to speculate from: kept whole"},
    )
    speculate: str = field(
        default="previous_layer",
        metadata={"help": "the query estimated from layer i-1's input (\"same_layer\": layer i's own)"},
    )

    def __post_init__(self) -> None:
        if self.alpha <= 0:
            raise ConfigError(f"alpha must be > 0, got {self.alpha}")
        if self.speculate not in ("previous_layer", "same_layer"):
            raise ConfigError(f"speculate must be 'previous_layer' or 'same_layer', got {self.speculate!r}")
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


class InfiniGen(RecallableMethod):
    """Skewed partial keys on the device tier; recall the rows whose estimated score is near the best.

    Citation: Lee et al., "InfiniGen: Efficient Generative Inference of Large Language Models with Dynamic
    KV Cache Management", OSDI 2024.
    """

    name = "infinigen"
    config_class = InfiniGenConfig
    citation = ("Lee et al., InfiniGen: Efficient Generative Inference of Large Language Models with Dynamic KV "
                "Cache Management, OSDI 2024")
    summary = "SVD-skewed 20% partial keys on device; recall rows scoring within alpha of the best estimate"
    needs_profile = True

    config: InfiniGenConfig

    def min_budget(self) -> int:
        return 2  # the newest row and one recalled row

    # -- prefill (the index: skewed partial keys, counted in bytes, not rows) --------------------------------
    def build_index(self, memory: LayerMemory, ctx: PrefillContext) -> None:
        b, h, t, d = ctx.keys.shape
        path = resolve_profile(self.config.profile, ctx.model_name)
        skew, channels = load_layer(path, ctx.layer_idx, h, d)
        # Only the chosen columns of A are ever used: q·A[:, C] is the partial skewed query.
        partial = torch.gather(skew, 2, channels[:, None, :].expand(h, d, -1)).to(ctx.keys.device)
        memory.device_tier["skew"] = partial.contiguous()
        partial_keys = torch.matmul(ctx.keys.float(), partial[None]).to(ctx.keys.dtype)
        memory.device_tier["partial_keys"] = RowBuffer(partial_keys.contiguous())
        budget = self.layer_budget(ctx.layer_idx, ctx.num_layers, ctx.budget, ctx.zoom_layers)
        memory.meta.update(budget=budget, scaling=ctx.scaling, profile=str(path))
        reserve_recall_buffer(memory, min(budget, t))

    # -- decode -------------------------------------------------------------------------------------------
    def index_append(self, memory: LayerMemory, key: torch.Tensor, value: torch.Tensor, before: int) -> None:
        skew = memory.device_tier["skew"]
        memory.device_tier["partial_keys"].append(torch.matmul(key.float(), skew[None]).to(key.dtype))

    @property
    def needs_attention_inputs(self) -> bool:
        return self.config.speculate == "previous_layer"

    def speculated_query(self, memory: LayerMemory, query: torch.Tensor) -> torch.Tensor:
        """The query the estimate uses: layer i's projection of layer i-1's input at this step, or the
        layer's own query (``same_layer``, or a memory driven without a model, as in unit tests)."""
        inputs = getattr(memory.cache, "attention_inputs", {}) if self.needs_attention_inputs else {}
        own, previous = inputs.get(memory.layer_idx), inputs.get(memory.layer_idx - 1)
        if own is None or previous is None:
            return query
        memory.meta["speculated_steps"] = memory.meta.get("speculated_steps", 0) + 1
        with torch.no_grad():
            return speculative_query(own, previous.hidden).to(query.dtype)

    def select_rows(self, memory: LayerMemory, query: torch.Tensor) -> Selection:
        keys, values = memory.host_tier["keys"], memory.host_tier["values"]
        n, budget = host_length(memory), memory.meta["budget"]
        valid = host_valid(memory)
        idx = None
        if n > budget:
            scores = estimate_scores(self.speculated_query(memory, query), memory.device_tier["partial_keys"].view(),
                                     memory.device_tier["skew"], memory.meta["scaling"])
            if valid is not None:
                scores = scores.masked_fill(~valid.to(scores.device)[:, :, None, :], float("-inf"))
            count = min(max(fetch_count(scores, self.config.alpha), 1), budget - 1)
            rank = scores.amax(dim=2)  # [b, h, n]: a row one query head needs is eligible for the group
            rank[..., -1] = float("inf")  # the newest row is always attended
            idx = rank.topk(count + 1, dim=-1).indices.sort(dim=-1).values
        rk, rv, idx = recall_rows(memory, keys, values, idx)
        return Selection(rk, rv, padding_bias(valid, idx, rk.shape[1], query.dtype, query.device))
