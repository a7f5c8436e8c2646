"""``semantic_id``: merge near-duplicate tokens into one representative row, recall their originals on demand.

Per KV head, each token's K‖V goes through a small projector (``zoomkv.methods.semantic_id.projector``) to
a semantic vector, hashed into a semantic ID (SimHash: the signs of ``id_bits`` fixed random projections).
Tokens whose IDs match and whose keys and values are similar (cosine ≥ 0.85 for K, the stricter 0.95 for
V) merge into one representative row: the mean key and mean value of the members, whose logit gets
``+log n`` so that n identical keys attend exactly like the n originals. Every original row stays on the
host tier, and an index (``group_of`` → ``perm``/``starts``) maps each group to its originals. At each
decode step, a group whose members disagree under this query (its *match* below ``recall_threshold``, see
below) has its originals recalled, in one batched copy, into a recall buffer on the device tier; its
representative is hidden for that step, and the group is merged again (its representative attended
again) as soon as it is no longer recalled.

Per-group state ``device_tier["state"]``: RAW (0, an unmerged row), COMPRESSED (1, a merged row attended
with ``log n``), RECALLED (2, its originals are in the recall buffer this step), EMPTY (3, an unused slot).

**Match.** For group g with members k_i (mean k̄) and query q (logits s_i = scaling·q·k_i), the
representative carries ``n·exp(s̄)`` where the members carry ``Σ exp(s_i)``. The device tier keeps each
group's per-channel key variance Var_c, so ``σ² = scaling² Σ_c q_c² Var_c`` is the variance of the
members' logits under q (cross-channel covariance ignored), and match = ``1/cosh(σ)``: the share of the
members' mass the representative carries when their logits sit at ``s̄ ± σ`` (exact for two members).
Identical keys → 1; the default threshold 0.8 is σ = ln 2 (members' weights differing four-fold). With
GQA the worst query head of the group decides. Among groups under the threshold, those with the most
at-risk mass (representative's attention probability × (1 - match)) are recalled first, whole groups
only, while they fit the recall buffer (a group larger than the buffer is never recalled).

**Protection.** The first ``num_sinks`` real tokens, the newest ``recent`` rows and *rare* rows are never
merged. Rare from the rows alone: a row whose centred K‖V (both halves unit-normalised) has cosine below
``rare_threshold`` with every other row of its sequence — a token like no other, as names, numbers and
identifiers that occur once tend to be. From token ids (``ctx.input_ids``, classified with
``ctx.tokenizer`` when given): numbers and code identifiers always, names occurring once (without a
tokenizer: any id occurring once) — these rank first. Rare rows take at most half of the slots left after
sinks and recent rows, rarest first. Rows generated while decoding are protected only while recent.

**Budget.** B = representatives + unmerged/protected rows + recall buffer, per KV head, at every step.
Merging is the price of the budget, so nothing merges while everything fits: B ≥ context is exactly full
attention (rows in sequence order, padding masked). Once a layer would exceed B it compresses: the recall
buffer takes ``recall_fraction`` of B, and every pair passing the paper's test (same ID, both cosine
thresholds) merges. If the groups still do not fit B - recall (minus ``chunk`` free slots for the rows
decoding will append), merging goes on by lowering the similarity greedily: both thresholds are lowered
together and the ID test is dropped, in rounds of greedy pairwise matching by similarity (each group joins
at most one other per round, so groups grow evenly instead of one hub swallowing its neighbours; pairs that
would outgrow the recall buffer go last), and after 8 rounds single-link merging (each group joins the
earlier group it is most similar to) finishes exactly at the target. So a budget ≥ ``min_budget()`` is always met; no
BudgetError. Why not refuse instead: the design's measured fact is that summary rows are what make small
budgets work, and a method that raised whenever a context holds fewer than ~B near-duplicates could not be
evaluated at the budgets every other method meets; groups merged below the thresholds are exactly the ones
the match test then sends to recall. While decoding, new rows stay unmerged until the layer is full again;
then one more merge frees ``chunk`` (≈ 1/8 of the unprotected) slots.

**Projector.** Without trained weights (``projector``, a safetensors file of ``SemanticProjector``) the
projector is its similarity-preserving initialisation, computed per sequence and KV head from the rows
being merged at the layer's first compression: the top ``sem_dim`` principal directions of the normalised
K‖V rows. That initialisation computes exactly ``U(x - μ)``, so that is what is evaluated; its basis
(``proj_mean``, ``proj_basis``) stays on the device tier so later merges hash into the same space. A
trained ``InputCorrection`` (adapter design ``pca_correction``) keeps that per-sequence PCA and reshapes
only its input; a trained ``SemanticProjector`` (design ``projector``) replaces it with one learned map.

Memory: per group slot the device tier also holds the key variance (head_dim float32), the count, the
state, the newest member and a protected flag — metadata counted in bytes (not in rows, as Quest's page
bounds and ClusterKV's centroids are not).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from zoomkv.errors import BudgetError, ConfigError
from zoomkv.methods.semantic_id.merging import (
    COMPRESSED,
    EMPTY,
    RAW,
    RECALLED,
    Merged,
    best_partners,
    forest_roots,
    greedy_matching,
    group_members,
    index_groups,
    match_score,
    max_neighbour_similarity,
    merge_by_root,
    simhash_ids,
    token_hints,
)
from zoomkv.methods.semantic_id.projector import InputCorrection, SemanticProjector, pca_basis, semantic_input
from zoomkv.protocol.method import KVMethod, MethodConfig, PrefillContext, Selection, group_query, kv_rows
from zoomkv.protocol.recallable import append_host_rows, host_length, store_host_rows

if TYPE_CHECKING:
    from zoomkv.memory.layer import LayerMemory

# Matching rounds before single-link merging finishes a merge (a round can halve the groups; the fallback
# guarantees the target whatever the data).
_MATCH_ROUNDS = 8


@dataclass
class SemanticIDConfig(MethodConfig):
    sem_dim: int = field(default=16, metadata={"help": "semantic vector size (the projector's output)"})
    hidden: int = field(
        default=32,
        metadata={"help": "projector hidden width (≥ 2 * sem_dim, see SemanticProjector)"},
    )
    id_bits: int = field(default=6, metadata={"help": "SimHash bits of the semantic ID (64 buckets)"})
    key_threshold: float = field(default=0.85, metadata={"help": "cosine of keys for a merge"})
    value_threshold: float = field(
        default=0.95,
        metadata={"help": "cosine of values (stricter: values are what the output is made of)"},
    )
    recall_threshold: float = field(
        default=0.8,
        metadata={"help": "recall a group when its match under the query falls below this"},
    )
    recall_fraction: float = field(
        default=0.25,
        metadata={"help": "share of the budget reserved for the recall buffer once merging starts"},
    )
    num_sinks: int = field(default=4, metadata={"help": "first real tokens never merged"})
    recent: int = field(default=8, metadata={"help": "newest rows never merged"})
    rare_threshold: float = field(
        default=0.5,
        metadata={"help": "a row less similar than this to every other row is rare (protected)"},
    )
    projector: str | None = field(
        default=None,
        metadata={"help": "Trained projector: a SemanticProjector safetensors file (adapters: ZoomAdapter.make_method); None: PCA init.",
                  "path": True},  # a file: never taken from an adapter config (ZoomAdapter.make_method)
    )
    seed: int = field(default=0, metadata={"help": "seed of the SimHash hyperplanes"})

    def __post_init__(self) -> None:
        if self.sem_dim < 1 or self.hidden < 2 * self.sem_dim:
            raise ConfigError(f"need sem_dim >= 1 and hidden >= 2 * sem_dim, got {self.sem_dim}, {self.hidden}")
        if not 0 <= self.id_bits <= 30:
            raise ConfigError(f"id_bits must lie in [0, 30], got {self.id_bits}")
        for name in ("key_threshold", "value_threshold", "rare_threshold"):
            value = getattr(self, name)
            if not -1.0 <= value <= 1.0:
                raise ConfigError(f"{name} is a cosine similarity in [-1, 1], got {value}")
        if not 0.0 < self.recall_threshold <= 1.0:
            raise ConfigError(f"recall_threshold must lie in (0, 1], got {self.recall_threshold}")
        if not 0.0 <= self.recall_fraction < 1.0:
            raise ConfigError(f"recall_fraction must lie in [0, 1), got {self.recall_fraction}")
        if self.num_sinks < 0 or self.recent < 0:
            raise ConfigError(f"num_sinks and recent must be >= 0, got {self.num_sinks}, {self.recent}")


@dataclass(frozen=True)
class Layout:
    """How a layer's budget splits once it compresses."""

    recall: int  # recall buffer rows
    slots: int  # group slots (representatives and unmerged rows): budget - recall
    chunk: int  # slots a merge leaves free for the rows decoding appends
    rare_cap: int  # most rare rows protected
    feasible: bool

    @property
    def target(self) -> int:
        return self.slots - self.chunk


@dataclass
class _Items:
    """Groups about to be merged (transient; never stored on the method)."""

    keys: torch.Tensor
    values: torch.Tensor
    count: torch.Tensor
    spread: torch.Tensor | None
    newest: torch.Tensor
    protected: torch.Tensor
    hint: torch.Tensor | None


class SemanticID(KVMethod):
    name = "semantic_id"
    config_class = SemanticIDConfig
    citation = "zoomkv seed system: semantic-ID merging with recallable originals (zoomkv)"
    summary = "merge near-duplicate K‖V (SimHash ID + cosine) into log-n rows; recall a group's originals when its members disagree"
    recallable = True

    config: SemanticIDConfig

    def __init__(self, config: MethodConfig | None = None, **overrides: Any):
        super().__init__(config, **overrides)
        self._projector: SemanticProjector | InputCorrection | None = None
        if self.config.projector:
            self.attach_adapter(_load_projector(self.config.projector))

    def attach_adapter(self, module: torch.nn.Module | None) -> None:
        """Use a trained projector (shared by every layer and KV head), a trained correction of the input
        the per-sequence PCA is fitted to (``InputCorrection``), or None for the PCA initialisation alone.
        ``ZoomAdapter.make_method`` hands a ``semantic_id`` adapter's modules over through this."""
        if module is not None and not isinstance(module, SemanticProjector | InputCorrection):
            raise ConfigError(f"semantic_id takes a SemanticProjector or an InputCorrection, not {type(module).__name__}")
        if isinstance(module, SemanticProjector) and module.sem_dim != self.config.sem_dim:
            raise ConfigError(f"the projector gives {module.sem_dim} semantic dims, the config asks {self.config.sem_dim}")
        self._projector = module

    # -- budget ---------------------------------------------------------------------------------------
    def layout(self, budget: int) -> Layout:
        cfg = self.config
        recall = int(cfg.recall_fraction * budget)
        if cfg.recall_fraction > 0:
            recall = max(1, recall)
        slots = budget - recall
        fixed = cfg.num_sinks + cfg.recent
        chunk = max(1, (slots - fixed) // 8)
        target = slots - chunk
        rare_cap = max(0, (target - fixed - 1) // 2)
        # At least one mergeable group besides every row that may not merge, so any merge can finish.
        return Layout(recall, slots, chunk, rare_cap, feasible=slots >= 1 and target >= fixed + 1)

    def min_budget(self) -> int:
        budget = 2
        while not self.layout(budget).feasible:
            budget += 1
        return budget

    def device_rows(self, memory: LayerMemory) -> int:
        # One buffer: [recall region | group slots], at its allocated capacity.
        return kv_rows(memory.device_tier.get("keys"))

    # -- prefill --------------------------------------------------------------------------------------
    def compress(self, memory: LayerMemory, ctx: PrefillContext) -> None:
        if ctx.budget is None:
            raise BudgetError(f"method {self.name!r} needs a budget")
        budget = self.layer_budget(ctx.layer_idx, ctx.num_layers, ctx.budget, ctx.zoom_layers)
        cfg = self.config
        b, h, t, _ = ctx.keys.shape
        device = ctx.keys.device
        store_host_rows(memory, ctx)
        real = (torch.ones(b, t, dtype=torch.bool, device=device) if ctx.valid is None
                else ctx.valid.to(device))
        rows = torch.arange(t, device=device)
        group_of = torch.where(real, rows, -1)[:, None, :].expand(b, h, t)
        memory.host_tier["group_of"] = memory.host_rows(group_of[..., None].contiguous())
        count = real[:, None, :].expand(b, h, t).long()
        newest = torch.where(count > 0, rows, -1)
        sinks = real & (real.long().cumsum(-1) <= cfg.num_sinks)
        protected = sinks[:, None, :].expand(b, h, t).clone()
        hint = self._token_hints(ctx, real)
        memory.meta.update(budget=budget, recall=0, groups=t, merged=False, padded=ctx.valid is not None,
                           scaling=float(ctx.scaling), merges=0, fresh=False)
        if t <= budget:
            # Everything fits: keep every row, unmerged and in order (exactly full attention).
            self._allocate(memory, min(budget, t + max(16, t // 8)), recall=0, with_spread=False)
            tier = memory.device_tier
            tier["keys"][:, :, :t] = ctx.keys
            tier["values"][:, :, :t] = ctx.values
            tier["count"][..., :t] = count
            tier["state"][..., :t] = torch.where(count > 0, RAW, EMPTY).to(torch.int8)
            tier["protected"][..., :t] = protected
            tier["newest"][..., :t] = newest
            tier["hint"][..., :t] = (False if hint is None else hint[:, None, :])
            return
        items = _Items(ctx.keys, ctx.values, count, None, newest, protected,
                       None if hint is None else hint[:, None, :].expand(b, h, t))
        self._merge(memory, items, n_now=t)

    def _token_hints(self, ctx: PrefillContext, real: torch.Tensor) -> torch.Tensor | None:
        ids = getattr(ctx, "input_ids", None)
        if not isinstance(ids, torch.Tensor) or ids.shape != real.shape:
            return None
        return token_hints(ids.to(real.device), real, getattr(ctx, "tokenizer", None))

    # -- decode ---------------------------------------------------------------------------------------
    def append(self, memory: LayerMemory, key: torch.Tensor, value: torch.Tensor) -> None:
        meta, tier = memory.meta, memory.device_tier
        n = host_length(memory)  # this row's index
        append_host_rows(memory, key, value)
        limit = self.layout(meta["budget"]).slots if meta["merged"] else meta["budget"]
        if meta["groups"] >= limit:
            self._merge(memory, self._items(memory), n_now=n + 1)
        slot = meta["groups"]
        self._ensure_slots(memory, slot + 1)
        at = meta["recall"] + slot
        tier["keys"][:, :, at : at + 1] = key
        tier["values"][:, :, at : at + 1] = value
        tier["count"][..., slot] = 1
        tier["state"][..., slot] = RAW
        tier["protected"][..., slot] = False
        tier["newest"][..., slot] = n
        if "spread" in tier:
            tier["spread"][..., slot, :] = 0.0
        if "hint" in tier:
            tier["hint"][..., slot] = False
        b, h = key.shape[:2]
        memory.host_tier["group_of"].append(torch.full((b, h, 1, 1), slot, dtype=torch.long))
        meta["groups"] = slot + 1

    def select(self, memory: LayerMemory, query: torch.Tensor) -> Selection:
        meta, tier = memory.meta, memory.device_tier
        recall, groups = meta["recall"], meta["groups"]
        keys = tier["keys"][:, :, : recall + groups]
        values = tier["values"][:, :, : recall + groups]
        count = tier["count"][..., :groups]
        if not meta["merged"]:
            bias = None
            if meta["padded"]:
                bias = torch.zeros(count.shape, dtype=query.dtype, device=query.device)
                bias = bias.masked_fill_(count.to(query.device) == 0, float("-inf"))
            return Selection(keys, values, bias)
        rep_bias = count.clamp_min(1).float().log().masked_fill(count == 0, float("-inf"))
        chosen = torch.zeros_like(count, dtype=torch.bool)
        if recall > 0 and bool((count > 1).any()):
            chosen = self._choose(memory, query, rep_bias)
        previous = tier["state"][..., :groups] == RECALLED
        tier["state"][..., :groups] = torch.where(
            count == 0, EMPTY, torch.where(count == 1, RAW, torch.where(chosen, RECALLED, COMPRESSED))
        ).to(torch.int8)
        if recall > 0 and not (meta["fresh"] and torch.equal(previous, chosen)):
            self._recall(memory, chosen)
        recall_bias = torch.zeros(tier["recall_ok"].shape, device=rep_bias.device).masked_fill_(
            ~tier["recall_ok"], float("-inf"))
        bias = torch.cat([recall_bias, rep_bias.masked_fill(chosen, float("-inf"))], dim=-1)
        return Selection(keys, values, bias.to(query.dtype))

    def _choose(self, memory: LayerMemory, query: torch.Tensor, rep_bias: torch.Tensor) -> torch.Tensor:
        """The groups to recall this step, ``[b, h, G]`` bool (see the module docstring)."""
        meta, tier = memory.meta, memory.device_tier
        recall, groups, scaling = meta["recall"], meta["groups"], meta["scaling"]
        count = tier["count"][..., :groups]
        reps = tier["keys"][:, :, recall : recall + groups].float()
        q = group_query(query, reps.shape[1]).float()  # [b, h, g, d]
        logits = torch.matmul(q, reps.transpose(-1, -2)) * scaling + rep_bias[:, :, None, :]
        prob = torch.softmax(logits, dim=-1)
        match = match_score(q, tier["spread"][..., :groups, :], scaling)  # [b, h, g, G]
        candidate = (count >= 2) & (count <= recall) & (match.amin(2) < self.config.recall_threshold)
        priority = (prob * (1.0 - match)).amax(2).masked_fill(~candidate, float("-inf"))
        order = priority.argsort(dim=-1, descending=True, stable=True)
        sizes = torch.where(candidate, count, 0).gather(-1, order)
        fits = (sizes.cumsum(-1) <= recall) & candidate.gather(-1, order)
        return torch.zeros_like(candidate).scatter_(-1, order, fits)

    def _recall(self, memory: LayerMemory, chosen: torch.Tensor) -> None:
        """Copy the originals of the ``chosen`` groups from the host tier into the recall buffer."""
        meta, tier, host = memory.meta, memory.device_tier, memory.host_tier
        recall = meta["recall"]
        starts, perm = host["starts"], host["perm"]
        count = tier["count"][..., : meta["groups"]]
        # Index arithmetic on the host, next to the rows it addresses; only the chosen mask moves.
        rows, ok = group_members(chosen.to(perm.device), count.to(perm.device), starts, perm, recall)
        if bool(ok.any()):
            sel_k, sel_v = host["keys"].gather(rows), host["values"].gather(rows)
            tier["keys"][:, :, :recall].copy_(sel_k, non_blocking=memory.pin_host)
            tier["values"][:, :, :recall].copy_(sel_v, non_blocking=memory.pin_host)
        tier["recall_ok"].copy_(ok)
        meta["fresh"] = True

    # -- merging --------------------------------------------------------------------------------------
    def _items(self, memory: LayerMemory) -> _Items:
        meta, tier = memory.meta, memory.device_tier
        recall, groups = meta["recall"], meta["groups"]
        spread = tier.get("spread")
        hint = tier.get("hint")
        return _Items(
            keys=tier["keys"][:, :, recall : recall + groups],
            values=tier["values"][:, :, recall : recall + groups],
            count=tier["count"][..., :groups],
            spread=None if spread is None else spread[..., :groups, :],
            newest=tier["newest"][..., :groups],
            protected=tier["protected"][..., :groups],
            hint=None if hint is None else hint[..., :groups],
        )

    def _merge(self, memory: LayerMemory, items: _Items, n_now: int) -> None:
        """Merge ``items`` (the layer's groups, or the prompt's rows) until they fit the layout's target,
        then rebuild the device buffer as ``[recall | groups]`` and re-point the host index."""
        cfg, meta = self.config, memory.meta
        lay = self.layout(meta["budget"])
        first = not meta["merged"]
        live = items.count > 0
        mergeable = live & ~items.protected & (items.newest < n_now - cfg.recent)
        sem = self._semantic(memory, items, live, first)
        protected = items.protected
        if first:
            # Rare rows are judged once, on the rows themselves (before anything is merged), on the whole
            # centred K‖V: a direction only one row takes is exactly what a few principal components drop.
            x = semantic_input(items.keys, items.values)
            w = live.float()[..., None]
            x = x - (x * w).sum(-2, keepdim=True) / w.sum(-2, keepdim=True).clamp_min(1.0)
            rarity = max_neighbour_similarity(x, live)
            hinted = torch.zeros_like(live) if items.hint is None else items.hint.to(live.device) & live
            candidate = mergeable & ((rarity < cfg.rare_threshold) | hinted)
            score = torch.where(hinted, rarity - 4.0, rarity).masked_fill(~candidate, float("inf"))
            order = score.argsort(dim=-1, stable=True)
            rank = torch.empty_like(order).scatter_(-1, order, torch.arange(order.shape[-1], device=order.device)
                                                    .expand_as(order).contiguous())
            rare = candidate & (rank < lay.rare_cap)
            protected = protected | rare
            mergeable = mergeable & ~rare
        merged, remap = self._reduce(items, live, mergeable, protected, sem, lay, n_now)
        groups = merged.count.shape[-1]
        if int((merged.count > 0).sum(-1).max()) > lay.target:  # pragma: no cover - a bug if reached
            raise BudgetError(f"semantic_id could not merge layer {memory.layer_idx} into {lay.target} groups")

        # The host index: every original row → its new group; then rows sorted by group.
        group_of = memory.host_tier["group_of"]
        old = group_of.view()[..., 0]
        remap = remap.to(old.device)
        new = torch.where(old >= 0, remap.gather(-1, old.clamp_min(0)), torch.full_like(old, -1))
        group_of.data[:, :, : old.shape[-1], 0] = new
        perm, starts = index_groups(new, groups)
        memory.host_tier["perm"] = memory.to_host(perm)
        memory.host_tier["starts"] = memory.to_host(starts)

        # The device buffer: [recall region | group slots], the whole budget, allocated once.
        dtype = memory.dtype
        self._allocate(memory, lay.slots, recall=lay.recall, with_spread=True)
        tier = memory.device_tier
        at = lay.recall
        tier["keys"][:, :, at : at + groups] = merged.keys.to(dtype)
        tier["values"][:, :, at : at + groups] = merged.values.to(dtype)
        tier["count"][..., :groups] = merged.count
        tier["spread"][..., :groups, :] = merged.spread
        tier["newest"][..., :groups] = merged.newest
        tier["protected"][..., :groups] = merged.protected
        tier["state"][..., :groups] = torch.where(
            merged.count == 0, EMPTY, torch.where(merged.count == 1, RAW, COMPRESSED)).to(torch.int8)
        tier.pop("hint", None)  # token hints only matter for the first (rare-row) decision
        meta.update(recall=lay.recall, groups=groups, merged=True, fresh=False, merges=meta["merges"] + 1)

    def _reduce(
        self, items: _Items, live: torch.Tensor, mergeable: torch.Tensor, protected: torch.Tensor,
        sem: torch.Tensor, lay: Layout, n_now: int,
    ) -> tuple[Merged, torch.Tensor]:
        """Merge the items: (1) every pair passing the paper's test (same semantic ID, cosine of keys ≥
        ``key_threshold`` and of values ≥ ``value_threshold``); (2) while a KV head has more than
        ``lay.target`` groups, rounds of greedy matching by affinity (thresholds lowered together, ID
        test dropped; pairs too big to recall last); (3) after ``_MATCH_ROUNDS`` rounds, single-link
        merging finishes exactly at the target. Returns the merged groups and old item → new slot."""
        cfg = self.config
        ids = simhash_ids(sem, cfg.id_bits, cfg.seed)
        best_j, best_w = best_partners(items.keys, items.values, ids, mergeable, cfg.key_threshold,
                                       cfg.value_threshold)
        root = forest_roots(best_j, best_w, live, None)
        merged = merge_by_root(root, live, items.keys, items.values, items.count, items.spread, items.newest,
                               protected)
        remap = merged.old_to_new
        for round_ in range(_MATCH_ROUNDS + 1):
            live = merged.count > 0
            need = (live.sum(-1) - lay.target).clamp_min(0)
            if not bool((need > 0).any()):
                break
            mergeable = live & ~merged.protected & (merged.newest < n_now - cfg.recent)
            if round_ < _MATCH_ROUNDS:
                root = greedy_matching(merged.keys, merged.values, mergeable, need, cfg.key_threshold,
                                       cfg.value_threshold, merged.count, max(lay.recall, 1))
            else:
                best_j, best_w = best_partners(merged.keys, merged.values, None, mergeable, cfg.key_threshold,
                                               cfg.value_threshold)
                root = forest_roots(best_j, best_w, live, lay.target)
            merged = merge_by_root(root, live, merged.keys, merged.values, merged.count, merged.spread,
                                   merged.newest, merged.protected)
            remap = torch.where(remap >= 0, merged.old_to_new.gather(-1, remap.clamp_min(0)), remap)
        return merged, remap

    def _semantic(self, memory: LayerMemory, items: _Items, live: torch.Tensor, first: bool) -> torch.Tensor:
        """Semantic vectors ``[b, h, G, s]`` of the items' K‖V."""
        x = semantic_input(items.keys, items.values)
        module = self._projector
        if module is not None:
            if module.in_dim != x.shape[-1]:
                raise ConfigError(
                    f"the semantic projector takes {module.in_dim} inputs, this model's K‖V has {x.shape[-1]}")
            with torch.no_grad():
                if isinstance(module, SemanticProjector):
                    return module.to(x.device).float()(x)
                x = module.to(x.device).float()(x)  # an InputCorrection: the PCA below is fitted to its output
        tier = memory.device_tier
        if first or "proj_basis" not in tier:
            mean, basis = pca_basis(x, live.float(), min(self.config.sem_dim, x.shape[-1]))
            tier["proj_mean"], tier["proj_basis"] = mean, basis
        # The projector's PCA initialisation computes exactly U(x - μ): evaluate that directly.
        return torch.matmul(x - tier["proj_mean"][:, :, None, :], tier["proj_basis"].transpose(-1, -2))

    # -- buffers --------------------------------------------------------------------------------------
    def _allocate(self, memory: LayerMemory, slots: int, recall: int, with_spread: bool) -> None:
        """(Re)allocate the device buffer ``[recall | slots]`` and the per-slot metadata, keeping the
        groups already held (the caller overwrites them after a merge)."""
        tier, meta = memory.device_tier, memory.meta
        b, h = memory.batch, memory.kv_heads
        device = memory.device
        old = {k: tier.get(k) for k in ("keys", "values", "count", "state", "protected", "newest", "hint")}
        keep = min(meta.get("groups", 0), slots) if old["keys"] is not None else 0
        old_recall = meta.get("recall", 0)
        # Zeros, not torch.empty: unused rows are masked with -inf, and garbage NaN·(-inf) would poison softmax.
        tier["keys"] = torch.zeros(b, h, recall + slots, memory.key_dim, dtype=memory.dtype, device=device)
        tier["values"] = torch.zeros(b, h, recall + slots, memory.value_dim, dtype=memory.dtype, device=device)
        tier["count"] = torch.zeros(b, h, slots, dtype=torch.long, device=device)
        tier["state"] = torch.full((b, h, slots), EMPTY, dtype=torch.int8, device=device)
        tier["protected"] = torch.zeros(b, h, slots, dtype=torch.bool, device=device)
        tier["newest"] = torch.full((b, h, slots), -1, dtype=torch.long, device=device)
        if with_spread:
            tier["spread"] = torch.zeros(b, h, slots, memory.key_dim, dtype=torch.float32, device=device)
            tier["recall_ok"] = torch.zeros(b, h, recall, dtype=torch.bool, device=device)
        elif old["hint"] is not None or old["keys"] is None:
            tier["hint"] = torch.zeros(b, h, slots, dtype=torch.bool, device=device)
        if keep and not with_spread:
            for name in ("keys", "values"):
                tier[name][:, :, recall : recall + keep] = old[name][:, :, old_recall : old_recall + keep]
            for name in ("count", "state", "protected", "newest", "hint"):
                if old[name] is not None and name in tier:
                    tier[name][..., :keep] = old[name][..., :keep]

    def _ensure_slots(self, memory: LayerMemory, needed: int) -> None:
        """Grow the unmerged layer's buffer in chunks (never past the budget) so appends stay cheap."""
        capacity = memory.device_tier["count"].shape[-1]
        if needed <= capacity:
            return
        budget = memory.meta["budget"]
        self._allocate(memory, min(budget, max(needed, capacity + max(16, capacity // 8))), recall=0,
                       with_spread=False)


def _load_projector(path: str) -> SemanticProjector:
    """A trained projector saved as a bare safetensors file (``SemanticProjector.save``). An adapter folder
    goes through the artefact layer: ``ZoomAdapter.from_pretrained(folder).make_method()``."""
    from pathlib import Path

    if Path(path).expanduser().is_dir():
        raise ConfigError(f"{path} is a folder: load a semantic_id adapter with "
                          "ZoomAdapter.from_pretrained(folder).make_method()")
    return SemanticProjector.load(path)
