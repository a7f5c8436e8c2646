"""Batched spherical k-means (cosine similarity) over the keys of every (batch, KV head) at once.

ClusterKV groups keys by direction: after RoPE, keys that point the same way get similar logits from the
same query, so a cluster is a set of rows that tend to be needed together. All (batch, head) pairs run the
same number of Lloyd iterations on one ``[b, h, n, C]`` similarity matrix; centroid sums use one flat
``index_add_`` so no Python loop runs over heads or clusters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class Clusters:
    labels: torch.Tensor  # [b, h, n] long; rows outside ``members`` get the sentinel label C
    sizes: torch.Tensor  # [b, h, C] long: members per cluster (0 for a cluster that ended up empty)
    centroids: torch.Tensor  # [b, h, C, d]: mean of the members' raw keys (what q·μ ranks)


def num_clusters(rows: int, rows_per_cluster: int) -> int:
    return math.ceil(rows / rows_per_cluster) if rows > 0 else 0


def cosine_kmeans(keys: torch.Tensor, members: torch.Tensor | None, clusters: int, iters: int,
                  early_stop: bool = True) -> Clusters:
    """Cluster ``keys`` ``[b, h, n, d]`` into ``clusters`` groups per (b, h) by cosine similarity.

    ``members`` (``[b, n]`` or ``[b, h, n]`` bool, None = all rows) says which rows take part: the others
    (left padding, sinks) get the sentinel label ``clusters`` and contribute to no centroid.
    Deterministic: seeds are members spaced evenly along the sequence (nearby rows are often similar, so
    an even spread covers the sequence's topics better than the first C rows would), no randomness.
    ``early_stop`` ends the iterations once the labels stop changing (which reads them back to the host);
    without it every iteration runs, to the same clusters, and nothing is read back.
    """
    b, h, n, d = keys.shape
    device = keys.device
    if members is None:
        members = torch.ones(b, h, n, dtype=torch.bool, device=device)
    elif members.dim() == 2:
        members = members[:, None, :].expand(b, h, n)
    sentinel = clusters
    if clusters == 0:
        return Clusters(
            torch.full((b, h, n), sentinel, dtype=torch.long, device=device),
            torch.zeros(b, h, 0, dtype=torch.long, device=device),
            keys.new_zeros(b, h, 0, d),
        )
    x = F.normalize(keys.float(), dim=-1)

    # Seeds: the members' positions in sequence order are the first `count` entries of a stable sort
    # that puts members first; pick C of them evenly spaced.
    count = members.sum(-1)  # [b, h]
    member_pos = (~members).to(torch.int8).argsort(dim=-1, stable=True)  # [b, h, n]
    frac = (torch.arange(clusters, device=device, dtype=torch.float64) + 0.5) / clusters
    pick = (frac * count[..., None].double()).long()
    pick = torch.minimum(pick, (count[..., None] - 1).clamp(min=0))
    seed_rows = member_pos.gather(-1, pick)  # [b, h, C]
    centroids = x.gather(2, seed_rows[..., None].expand(-1, -1, -1, d))

    # Sums per cluster go through one flat index_add_ over all (batch, head) pairs: slot
    # (pair * (C + 1) + label), with one extra slot per pair collecting the non-members so they drop out
    # without masking every row. (index_add_ on a flat 2-D view is several times faster than scatter_add_
    # along dim 2 on CPU.)
    slots = clusters + 1
    offset = (torch.arange(b * h, device=device) * slots).view(b, h, 1)
    flat_x = x.reshape(b * h * n, d)
    labels = torch.full((b, h, n), sentinel, dtype=torch.long, device=device)
    for it in range(iters):
        sim = torch.matmul(x, centroids.transpose(-1, -2))  # [b, h, n, C]
        new_labels = sim.argmax(dim=-1).masked_fill_(~members, sentinel)
        if early_stop and it > 0 and torch.equal(new_labels, labels):
            break  # converged: the centroids already match these labels
        labels = new_labels
        flat = (labels + offset).view(-1)
        sums = x.new_zeros(b * h * slots, d).index_add_(0, flat, flat_x).view(b, h, slots, d)[:, :, :clusters]
        counts = _count(flat, b * h * slots).view(b, h, slots)[:, :, :clusters]
        # An emptied cluster keeps its old centroid rather than becoming NaN; it simply recalls nothing.
        centroids = torch.where(counts[..., None] > 0, F.normalize(sums, dim=-1), centroids)

    # The representative used to rank clusters is the mean of the members' raw keys, not the unit
    # direction: q·mean(k) is exactly the members' mean logit, so key norms (which the cosine clustering
    # ignored) still count when ranking.
    flat = (labels + offset).view(-1)
    raw = keys.float().reshape(b * h * n, d)
    raw = raw.new_zeros(b * h * slots, d).index_add_(0, flat, raw).view(b, h, slots, d)[:, :, :clusters]
    sizes = _count(flat, b * h * slots).view(b, h, slots)[:, :, :clusters]
    means = raw / sizes.clamp(min=1)[..., None].to(raw.dtype)
    return Clusters(labels, sizes, means.to(keys.dtype))


def _count(flat: torch.Tensor, size: int) -> torch.Tensor:
    """How often each of ``size`` slots occurs in ``flat``: ``bincount(flat, minlength=size)`` with its size
    fixed in advance (bincount's size is the largest value, which the host must read first)."""
    return torch.zeros(size, dtype=torch.long, device=flat.device).index_add_(0, flat, torch.ones_like(flat))
