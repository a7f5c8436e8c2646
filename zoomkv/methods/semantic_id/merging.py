"""Pieces of ``semantic_id``: SimHash IDs, greedy merging of near-duplicate groups, the match statistic
and the group → originals index. Pure tensor functions, batched over ``[batch, kv_heads]``; the method
keeps every tensor they return in its layer's tiers.
"""

from __future__ import annotations

import math
import re
import weakref
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
import torch.nn.functional as F

NEG_INF = float("-inf")

# Largest pairwise block one merging step materialises (float32 elements): 2**22 = 16 MiB per matrix.
_PAIR_BLOCK = 2**22
# Largest pair-weight matrix a matching round keeps for its repeated passes: 2**25 elements = 128 MiB.
_MATRIX_LIMIT = 2**25
# Added to the affinity of a pair that passes the paper's test (same ID, both thresholds): every such pair
# ranks above every other (affinities lie in [-2, 2]).
TIER = 4.0

RAW, COMPRESSED, RECALLED, EMPTY = 0, 1, 2, 3  # per-group state (int8)


# -- semantic IDs -------------------------------------------------------------------------------------------
@lru_cache(maxsize=16)
def _planes_cpu(bits: int, dim: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(bits, dim, generator=g)


def simhash_ids(sem: torch.Tensor, bits: int, seed: int) -> torch.Tensor:
    """SimHash: bit k of the ID says on which side of random hyperplane k (fixed by ``seed``, so the IDs
    are deterministic) the semantic vector lies. Vectors at angle θ share a bit with probability
    ``1 - θ/π``. ``[..., s]`` → int64 ``[...]``."""
    if bits == 0:
        return torch.zeros(sem.shape[:-1], dtype=torch.long, device=sem.device)
    planes = _planes_cpu(bits, sem.shape[-1], seed).to(sem.device)
    side = (sem.float() @ planes.T) > 0
    weights = 2 ** torch.arange(bits, device=sem.device)
    return (side.long() * weights).sum(-1)


# -- merging ------------------------------------------------------------------------------------------------
def _row_chunk(b: int, h: int, g: int) -> int:
    return max(1, _PAIR_BLOCK // max(1, b * h * g))


def _pair_weights(
    kn: torch.Tensor, vn: torch.Tensor, ids: torch.Tensor | None, mergeable: torch.Tensor, tau_k: float,
    tau_v: float, start: int, end: int, earlier_only: bool, count: torch.Tensor | None, size_cap: int | None,
) -> torch.Tensor:
    """Merge weights of rows ``start:end`` against every group, ``[b, h, end - start, G]`` (see
    ``best_partners``); ``kn``/``vn`` are the unit-normalised keys and values."""
    g = kn.shape[2]
    # In place where possible: at prefill these blocks are the largest tensors the method touches.
    weight = torch.matmul(kn[:, :, start:end], kn.transpose(-1, -2)).sub_(tau_k)
    weight = torch.minimum(weight, torch.matmul(vn[:, :, start:end], vn.transpose(-1, -2)).sub_(tau_v), out=weight)
    if ids is not None:
        same = ids[:, :, start:end, None] == ids[:, :, None, :]
        weight.add_((same & (weight >= 0)).float().mul_(TIER))
    if count is not None and size_cap is not None:
        too_big = (count[:, :, start:end, None] + count[:, :, None, :]) > size_cap
        torch.sub(weight, too_big.to(weight.dtype), alpha=TIER, out=weight)
    # Blocked pairs as broadcast in-place fills, never a [c, G] mask per KV head: these blocks are the
    # method's largest tensors and every extra pass over them costs as much as the matmul.
    weight.masked_fill_(~mergeable[:, :, None, :], NEG_INF)
    weight.masked_fill_(~mergeable[:, :, start:end, None], NEG_INF)
    if earlier_only:
        cols = torch.arange(g, device=kn.device)
        here = torch.arange(start, end, device=kn.device)[:, None]
        return weight.masked_fill_(cols[None, :] >= here, NEG_INF)
    weight.diagonal(offset=start, dim1=-2, dim2=-1).fill_(NEG_INF)  # row i of the block is group start + i
    return weight


def best_partners(
    keys: torch.Tensor,
    values: torch.Tensor,
    ids: torch.Tensor | None,
    mergeable: torch.Tensor,
    tau_k: float,
    tau_v: float,
    *,
    earlier_only: bool = True,
    count: torch.Tensor | None = None,
    size_cap: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """For each group i, the mergeable group j it should join first, and that pair's weight.

    The affinity of a pair is ``min(cos_K - tau_k, cos_V - tau_v)`` (≥ 0 iff both cosine thresholds
    hold). With ``ids``, pairs that also share the semantic ID (the paper's merge test) get ``+TIER``, so
    they always come first. With ``count`` and ``size_cap``, pairs whose merged group would exceed the cap
    (too big for the recall buffer) get ``-TIER``: chosen only when nothing else is left.

    ``earlier_only`` restricts j < i: the edges then form a forest whose roots are the earliest member of
    each group. Otherwise every j ≠ i competes (for matching; the weights are symmetric).

    ``keys``/``values`` ``[b, h, G, d]`` (the groups' representatives), ``ids`` ``[b, h, G]``, ``mergeable``
    ``[b, h, G]`` bool. Returns ``best_j`` (long) and ``best_w`` (float32, ``-inf`` when i has no partner).
    """
    b, h, g, _ = keys.shape
    kn = F.normalize(keys.float(), dim=-1)
    vn = F.normalize(values.float(), dim=-1)
    best_j = torch.zeros(b, h, g, dtype=torch.long, device=keys.device)
    best_w = torch.full((b, h, g), NEG_INF, device=keys.device)
    step = _row_chunk(b, h, g)
    for start in range(0, g, step):
        end = min(g, start + step)
        weight = _pair_weights(kn, vn, ids, mergeable, tau_k, tau_v, start, end, earlier_only, count, size_cap)
        w, j = weight.max(dim=-1)
        best_w[:, :, start:end] = w
        best_j[:, :, start:end] = j
    return best_j, best_w


def greedy_matching(
    keys: torch.Tensor,
    values: torch.Tensor,
    mergeable: torch.Tensor,
    need: torch.Tensor,
    tau_k: float,
    tau_v: float,
    count: torch.Tensor,
    size_cap: int,
    passes: int = 6,
) -> torch.Tensor:
    """One merge round: a greedy weighted matching of the groups, at most ``need`` pairs per KV head.

    Repeated passes of ``mutual_pairs`` over the groups still unmatched (the pair weights computed once)
    approach the greedy maximal matching, so a round can halve the groups, not only merge the few pairs
    that happen to be mutual best. When the ``[G, G]`` weights would be too large to hold, one pass.
    Returns each group's root (the earlier group of its pair, or itself)."""
    b, h, g, _ = keys.shape
    if b * h * g * g > _MATRIX_LIMIT:
        best_j, best_w = best_partners(keys, values, None, mergeable, tau_k, tau_v, earlier_only=False,
                                       count=count, size_cap=size_cap)
        return mutual_pairs(best_j, best_w, need)
    kn = F.normalize(keys.float(), dim=-1)
    vn = F.normalize(values.float(), dim=-1)
    weight = _pair_weights(kn, vn, None, mergeable, tau_k, tau_v, 0, g, False, count, size_cap)
    ar = torch.arange(g, device=keys.device).expand(b, h, g)
    root = ar.clone()
    free = mergeable.clone()
    left = need.clone()
    for _ in range(passes):
        if not bool((left > 0).any()):
            break
        # Matched groups leave as columns in place (the matrix is not needed afterwards) and as rows after
        # the max: the same pairs as masking both in a copy, without a [G, G] mask or copy per pass.
        weight.masked_fill_(~free[..., None, :], NEG_INF)
        best_w, best_j = weight.max(dim=-1)
        best_w.masked_fill_(~free, NEG_INF)
        step = mutual_pairs(best_j, best_w, left)
        joined = step != ar  # the later group of each new pair
        if not bool(joined.any()):
            break
        partner = torch.zeros(b, h, g, dtype=torch.int8, device=keys.device).scatter_reduce_(
            -1, torch.where(joined, step, ar), joined.to(torch.int8), reduce="amax").bool()
        root = torch.minimum(root, step)  # a group joins at most one pair over all passes
        free &= ~(joined | partner)
        left = left - joined.sum(-1)
    return root


def mutual_pairs(best_j: torch.Tensor, best_w: torch.Tensor, need: torch.Tensor) -> torch.Tensor:
    """One round of matching: pairs of groups that are each other's best partner, the ``need`` (per KV
    head, ``[b, h]``) strongest of them, merge (the later into the earlier). Each group joins at most one
    other, so sizes at most double per round and no group becomes a hub that swallows its neighbours.
    Returns the root of each group ``[b, h, G]``. At least one pair exists wherever two groups are
    mergeable (the strongest pair is mutual)."""
    g = best_j.shape[-1]
    ar = torch.arange(g, device=best_j.device).expand_as(best_j)
    mutual = torch.isfinite(best_w) & (best_j.gather(-1, best_j) == ar) & (ar < best_j)
    key = best_w.masked_fill(~mutual, NEG_INF)
    order = key.argsort(dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(-1, order, ar.contiguous())
    take = mutual & (rank < need[..., None])
    # root[j] = i for each taken pair (i, j); "amin" keeps i over j's own index, deterministically.
    return ar.contiguous().scatter_reduce(-1, torch.where(take, best_j, ar), ar.contiguous(), reduce="amin")


def max_neighbour_similarity(sem: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """For each row of ``sem`` ``[b, h, G, s]``, the highest cosine similarity with any *other* live row
    (``-inf`` when it has none): a row unlike every other row of its sequence is "rare"."""
    b, h, g, _ = sem.shape
    sn = F.normalize(sem.float(), dim=-1)
    out = torch.full((b, h, g), NEG_INF, device=sem.device)
    cols = torch.arange(g, device=sem.device)
    step = _row_chunk(b, h, g)
    for start in range(0, g, step):
        end = min(g, start + step)
        sim = sn[:, :, start:end] @ sn.transpose(-1, -2)
        other = cols[None, :] != torch.arange(start, end, device=sem.device)[:, None]
        sim = sim.masked_fill(~(other & live[:, :, None, :]), NEG_INF)
        out[:, :, start:end] = sim.amax(-1)
    return out


def forest_roots(best_j: torch.Tensor, best_w: torch.Tensor, live: torch.Tensor, target: int | None) -> torch.Tensor:
    """Which group each group ends up in (its root, ``[b, h, G]`` long), from ``best_partners(...,
    earlier_only=True)`` edges.

    Every edge that passes the paper's test (weight ≥ TIER) is taken: near-duplicates with matching IDs
    always merge once a layer compresses. If a KV head still has more than ``target`` live groups (None:
    no target), its remaining edges are taken greedily by decreasing affinity — exactly as many as
    needed, since each edge of a forest joins two components; the forest spans every mergeable group, so
    any target above the unmergeable count is reached. Components are found by pointer jumping.
    """
    g = best_j.shape[-1]
    ar = torch.arange(g, device=best_j.device).expand_as(best_j)
    has = torch.isfinite(best_w)
    paper = has & (best_w >= TIER - 1.0)
    if target is None:
        need = torch.zeros(best_j.shape[:2], dtype=torch.long, device=best_j.device)
    else:
        need = (live.sum(-1) - paper.sum(-1) - target).clamp_min(0)  # [b, h]
    extra_key = best_w.masked_fill(~(has & ~paper), NEG_INF)
    order = extra_key.argsort(dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(-1, order, ar.contiguous())
    take = paper | (has & ~paper & (rank < need[..., None]))
    ptr = torch.where(take, best_j, ar)
    while True:  # each round halves every path: at most log2(G) + 1 rounds
        nxt = ptr.gather(-1, ptr)
        if torch.equal(nxt, ptr):
            return ptr
        ptr = nxt


@dataclass
class Merged:
    """Groups after a merge, compacted to the front (slot s < ``live`` per head; the rest empty)."""

    keys: torch.Tensor  # [b, h, G', dk] mean member key (float32)
    values: torch.Tensor  # [b, h, G', dv]
    count: torch.Tensor  # [b, h, G'] long, 0 on empty slots
    spread: torch.Tensor  # [b, h, G', dk] float32 per-channel variance of the member keys
    newest: torch.Tensor  # [b, h, G'] long: highest member row index (-1 on empty slots)
    protected: torch.Tensor  # [b, h, G'] bool
    old_to_new: torch.Tensor  # [b, h, G] long: the new slot of each old group (-1 for empty ones)


def merge_by_root(
    root: torch.Tensor,
    live: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    count: torch.Tensor,
    spread: torch.Tensor | None,
    newest: torch.Tensor,
    protected: torch.Tensor,
) -> Merged:
    """Merge every group into its root: size-weighted means (so a merged row is the mean of all its
    original rows), and the exact pooled per-channel key variance (two passes: means, then squared
    deviations, which stays accurate when the spread is small next to the keys)."""
    b, h, g, dk = keys.shape
    n = count.float() * live
    tot = torch.zeros(b, h, g, device=keys.device).scatter_add_(-1, root, n)
    denom = tot.clamp_min(1.0)[..., None]

    def pooled_mean(x: torch.Tensor) -> torch.Tensor:
        idx = root[..., None].expand(-1, -1, -1, x.shape[-1])
        return torch.zeros(b, h, g, x.shape[-1], device=x.device).scatter_add_(2, idx, x.float() * n[..., None]) / denom

    mean_k = pooled_mean(keys)
    mean_v = pooled_mean(values)
    idx_k = root[..., None].expand(-1, -1, -1, dk)
    dev = keys.float() - mean_k.gather(2, idx_k)
    within = dev * dev if spread is None else spread + dev * dev
    var = torch.zeros(b, h, g, dk, device=keys.device).scatter_add_(2, idx_k, within * n[..., None]) / denom
    top = torch.full((b, h, g), -1, dtype=torch.long, device=keys.device)
    top = top.scatter_reduce(-1, root, newest.masked_fill(~live, -1), reduce="amax")

    ar = torch.arange(g, device=keys.device)
    is_root = live & (root == ar)
    counts = is_root.sum(-1)  # [b, h]
    width = max(int(counts.max()), 1)
    order = (~is_root).to(torch.int8).argsort(dim=-1, stable=True)[..., :width]  # old slot of each new slot
    used = torch.arange(width, device=keys.device) < counts[..., None]
    new_slot = is_root.long().cumsum(-1) - 1
    old_to_new = torch.where(live, new_slot.gather(-1, root), torch.full_like(root, -1))

    def take(x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 4:
            return x.gather(2, order[..., None].expand(-1, -1, -1, x.shape[-1]))
        return x.gather(-1, order)

    zero = torch.zeros((), device=keys.device)
    return Merged(
        keys=torch.where(used[..., None], take(mean_k), zero),
        values=torch.where(used[..., None], take(mean_v), zero),
        count=torch.where(used, take(tot).round().long(), 0),
        spread=torch.where(used[..., None], take(var).clamp_min(0.0), zero),
        newest=torch.where(used, take(top), -1),
        protected=take(protected) & used,
        old_to_new=old_to_new,
    )


# -- decode: how well a representative stands for its members under a query ------------------------------
def match_score(query: torch.Tensor, spread: torch.Tensor, scaling: float) -> torch.Tensor:
    """``1 / cosh(σ)``, σ the spread of the members' logits under the query.

    ``σ² = scaling² · Σ_c q_c² Var_c`` is the variance of ``q·k_i`` over the members, counting each
    channel's variance and ignoring cross-channel covariance (only the per-channel variance is kept per
    group). ``1/cosh(σ)`` is the share of the members' true attention mass ``Σ_i exp(s_i)`` that the
    merged row (``n·exp(mean s)``) carries when the logits sit at ``mean ± σ`` — exact for two members
    and for any symmetric two-point spread. 1 when the members agree under this query, 0.8 at σ = ln 2
    (their weights differ four-fold), → 0 as they disagree.

    ``query`` ``[b, h, g, d]``, ``spread`` ``[b, h, G, d]`` → ``[b, h, g, G]``.
    """
    var = (query.float() ** 2) @ spread.float().transpose(-1, -2)
    sigma = var.clamp_min(0.0).sqrt() * scaling
    log_cosh = sigma + F.softplus(-2.0 * sigma) - math.log(2.0)  # stable for large σ
    return torch.exp(-log_cosh)


def group_members(
    chosen: torch.Tensor, count: torch.Tensor, starts: torch.Tensor, perm: torch.Tensor, slots: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Host row ids ``[b, h, slots]`` of the members of the ``chosen`` groups (``[b, h, G]`` bool, the
    groups of the last merge, whose members ``perm[starts[g] : starts[g] + count[g]]`` are), packed from
    slot 0 in group order, and which slots are filled. All on the host tier's device."""
    g = starts.shape[-1]
    sizes = torch.where(chosen[..., :g], count[..., :g], 0)
    cum = sizes.cumsum(-1)
    slot = torch.arange(slots, device=sizes.device).expand(*sizes.shape[:2], slots).contiguous()
    grp = torch.searchsorted(cum, slot, right=True).clamp_(max=g - 1)
    within = slot - (cum - sizes).gather(-1, grp)
    pos = (starts.gather(-1, grp) + within).clamp_(0, perm.shape[-1] - 1)
    ok = slot < cum[..., -1:]
    rows = perm.gather(-1, pos).masked_fill_(~ok, 0)
    return rows, ok


def index_groups(group_of: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``group_of`` ``[b, h, n]`` (-1 on padding) → ``perm`` (rows sorted by group, in sequence order
    inside a group; padding last) and ``starts`` ``[b, h, groups]`` (where each group's rows begin)."""
    key = torch.where(group_of >= 0, group_of, torch.full_like(group_of, groups))
    perm = key.argsort(dim=-1, stable=True)
    sizes = torch.zeros(*group_of.shape[:2], groups + 1, dtype=torch.long, device=group_of.device)
    sizes.scatter_add_(-1, key, torch.ones_like(key))
    starts = sizes[..., :groups].cumsum(-1) - sizes[..., :groups]
    return perm, starts


# -- protected token classes from token ids ---------------------------------------------------------------
_IDENTIFIER = re.compile(r"[A-Za-z0-9]_[A-Za-z0-9]|[a-z][A-Z]|::|->")
_NAME = re.compile(r"^[A-Z][a-z]{2,}$")
_TOKEN_CLASS_CACHE: weakref.WeakKeyDictionary[Any, dict[int, int]] = weakref.WeakKeyDictionary()
NUMBER, IDENTIFIER, NAME = 1, 2, 4


def token_classes(tokenizer: Any, ids: list[int]) -> dict[int, int]:
    """Bit flags per token id: NUMBER (its text has a digit), IDENTIFIER (``snake_case``, ``camelCase``,
    ``::``, ``->``), NAME (a capitalised word piece). Cached per tokenizer (a vocabulary does not change)."""
    try:
        cache = _TOKEN_CLASS_CACHE.setdefault(tokenizer, {})
    except TypeError:  # not weak-referenceable: classify without caching
        cache = {}
    missing = [i for i in ids if i not in cache]
    for i in missing:
        text = tokenizer.decode([i]).strip()
        flag = NUMBER if any(ch.isdigit() for ch in text) else 0
        flag |= IDENTIFIER if _IDENTIFIER.search(text) else 0
        flag |= NAME if _NAME.match(text) else 0
        cache[i] = flag
    return cache


def token_hints(ids: torch.Tensor, valid: torch.Tensor | None, tokenizer: Any) -> torch.Tensor:
    """Rows to protect by token class, ``[b, T]`` bool: numbers and code identifiers always, and names
    that occur once in the sequence. Without a tokenizer only in-context rarity is known: ids that occur
    exactly once among the sequence's real tokens."""
    b, t = ids.shape
    real = torch.ones(b, t, dtype=torch.bool, device=ids.device) if valid is None else valid.to(ids.device)
    # Whether each row's id occurs only once in its own sequence (padding not counted).
    once = torch.zeros(b, t, dtype=torch.bool, device=ids.device)
    for i in range(b):
        _, inverse, counts = torch.unique(ids[i][real[i]], return_inverse=True, return_counts=True)
        once[i, real[i]] = counts[inverse] == 1
    if tokenizer is None:
        return once & real
    uniq = [int(i) for i in torch.unique(ids[real]).tolist()]
    classes = token_classes(tokenizer, uniq)
    table = torch.zeros(max(uniq, default=0) + 1, dtype=torch.long)
    for i in uniq:
        table[i] = classes[i]
    flags = table.to(ids.device)[ids.clamp(0, table.shape[0] - 1)]
    hint = (flags & (NUMBER | IDENTIFIER)).bool() | ((flags & NAME).bool() & once)
    return hint & real
