"""``clusterkv``: recall at the granularity of semantic clusters (Liu et al., DAC 2025).

Prefill: the first 16 real tokens of each sequence are attention sinks and stay resident on the device
tier. The other prompt keys of each KV head are grouped by k-means with cosine similarity (about 80
tokens per cluster, 20 iterations, evenly spaced seeds); the device tier keeps one centroid, one size and the
start of its members' run per cluster, and the members' row ids grouped by cluster (the index a step ranks,
cuts and addresses on the device: on a GPU no step waits for the host); the host tier keeps every row.

Decode: the clusters are ranked by ``q·μ`` and recalled whole, in that order, until the budget is
reached; the cluster that straddles the budget is cut by its own members' scores ``q·k``, so exactly the
rows that fit are recalled. Generated rows stay resident (and attended exactly) until
``recluster_interval`` (320) of them have accumulated; then they are clustered into new clusters appended
to the index, and their device rows are freed for recall.

One device buffer of at most B rows per KV head (``device_tier["keys"/"values"]``) holds, in sequence
order, ``[sinks | recalled rows | pending generated rows]``: the pending block moves left by one row
when the recall region shrinks, so the budget is used exactly and no step concatenates a second copy.

Deviations, on purpose:
- Pending generated rows may use at most ``recent_fraction`` (half) of the non-sink budget. With the
  paper's budgets (1-2K rows) that is the paper's 320-row interval; with a small budget the pending rows
  are clustered earlier, so sinks + pending + recall never exceed B and recall always has room.
- GQA: a KV head's clusters are ranked by the sum over its query group of ``q·μ`` (the group's total
  logit, a proxy for its total attention), and the boundary cluster by the same sum of ``q·k``.
- ``μ`` is the mean of the members' raw keys (post-RoPE), not their unit direction: ``q·μ`` is then
  exactly the members' mean logit, so key norms still count when ranking (clustering itself is cosine).
- Sinks are the first 16 *real* tokens of each sequence (left padding is skipped), and padding rows
  never join a cluster.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from zoomkv.errors import ConfigError
from zoomkv.memory.tiers import RowBuffer
from zoomkv.methods._kmeans import cosine_kmeans, num_clusters
from zoomkv.protocol.method import MethodConfig, PrefillContext, Selection, group_query
from zoomkv.protocol.recallable import (
    RecallableMethod,
    check_dense_layers,
    host_length,
)


@dataclass
class ClusterKVConfig(MethodConfig):
    num_sinks: int = field(default=16, metadata={"help": "first real tokens kept resident"})
    cluster_size: int = field(
        default=80,
        metadata={"help": "average rows per cluster: C = ceil(rows / cluster_size)"},
    )
    kmeans_iters: int = field(default=20, metadata={"help": "cosine k-means iterations at prefill"})
    recluster_interval: int = field(
        default=320,
        metadata={"help": "generated rows are clustered once this many have accumulated..."},
    )
    recent_fraction: float = field(
        default=0.5,
        metadata={"help": "...or earlier, once they fill this fraction of the non-sink budget"},
    )
    dense_layers: int = field(
        default=2,
        metadata={"help": "the first layers are kept whole, as in the paper; 0 for a strict budget"},
    )

    def __post_init__(self) -> None:
        if self.num_sinks < 0:
            raise ConfigError(f"num_sinks must be >= 0, got {self.num_sinks}")
        if self.cluster_size < 1 or self.kmeans_iters < 1 or self.recluster_interval < 1:
            raise ConfigError("cluster_size, kmeans_iters and recluster_interval must be >= 1")
        if not 0.0 < self.recent_fraction < 1.0:
            raise ConfigError(f"recent_fraction must lie in (0, 1), got {self.recent_fraction}")
        check_dense_layers(self.dense_layers)


class ClusterKV(RecallableMethod):
    name = "clusterkv"
    config_class = ClusterKVConfig
    citation = (
        "Liu et al., ClusterKV: Manipulating LLM KV Cache in Semantic Space for Recallable Compression, DAC 2025"
    )
    summary = "16 sinks + cosine k-means clusters of keys; recall whole clusters ranked by q·centroid"

    config: ClusterKVConfig

    def min_budget(self) -> int:
        return self.config.num_sinks + 2  # sinks, one pending (the newest) row, one recalled row

    # Device rows: one KV buffer (sinks + recall region + pending rows) at its allocated capacity, held as
    # "keys" (KVMethod.device_rows); centroids and sizes are metadata: counted in bytes, not rows.

    # -- prefill ----------------------------------------------------------------------------------------
    def build_index(self, memory, ctx: PrefillContext) -> None:
        cfg = self.config
        b, h, t, _ = ctx.keys.shape
        budget = self.layer_budget(ctx.layer_idx, ctx.num_layers, ctx.budget)
        sinks = min(cfg.num_sinks, t)
        valid = ctx.valid
        if valid is None:
            sink_rows = torch.arange(sinks, device=ctx.keys.device).expand(b, sinks)
            sink_ok = None
            members = torch.ones(b, t, dtype=torch.bool, device=ctx.keys.device)
            members[:, :sinks] = False
        else:
            # A stable sort putting real rows first lists them in sequence order: the first `sinks` of
            # them are this sequence's sinks, whatever its padding.
            sink_rows = (~valid).to(torch.int8).argsort(dim=-1, stable=True)[:, :sinks]
            sink_ok = valid.gather(-1, sink_rows)  # False only for a sequence shorter than `sinks`
            members = valid & (valid.long().cumsum(dim=-1) > sinks)

        found = cosine_kmeans(ctx.keys, members, num_clusters(int(members.sum(-1).max()), cfg.cluster_size),
                              cfg.kmeans_iters)
        # Members grouped by cluster id (stable: sequence order inside a cluster), non-members last.
        perm = found.labels.argsort(dim=-1, stable=True)
        memory.device_tier["centroids"] = found.centroids
        memory.device_tier["cluster_sizes"] = found.sizes
        memory.device_tier["perm"] = perm
        memory.device_tier["cluster_starts"] = found.sizes.cumsum(-1) - found.sizes

        clustered = int(found.sizes.sum(-1).max()) if found.sizes.numel() else 0
        largest = int(found.sizes.max()) if found.sizes.numel() else 0
        recall = min(budget - sinks, clustered)
        work_k = memory.device_buffer(sinks + recall, memory.key_dim)
        work_v = memory.device_buffer(sinks + recall, memory.value_dim)
        gather = sink_rows[:, None, :, None]
        work_k[:, :, :sinks] = ctx.keys.gather(2, gather.expand(b, h, sinks, ctx.keys.shape[-1]))
        work_v[:, :, :sinks] = ctx.values.gather(2, gather.expand(b, h, sinks, ctx.values.shape[-1]))
        memory.device_tier["keys"] = work_k
        memory.device_tier["values"] = work_v
        if sink_ok is not None and not bool(sink_ok.all()):
            memory.device_tier["sink_valid"] = sink_ok[:, None, :]
        pending_cap = max(1, min(cfg.recluster_interval, int((budget - sinks) * cfg.recent_fraction)))
        memory.meta.update(
            budget=budget,
            sinks=sinks,
            clustered=clustered,  # most clustered rows any (batch, head) has
            pending=0,  # generated rows not yet clustered, resident after the recall region
            pending_start=sinks + recall,
            pending_cap=pending_cap,
            reclusters=0,
            largest=largest,  # an upper bound of any cluster's size: the width a cut cluster is ranked over
        )

    # -- decode -----------------------------------------------------------------------------------------
    def index_append(self, memory, key: torch.Tensor, value: torch.Tensor, before: int) -> None:
        meta = memory.meta
        if meta["pending"] >= meta["pending_cap"]:
            self._cluster_pending(memory)
        sinks, pending = meta["sinks"], meta["pending"]
        # Recall gets whatever the sinks and the pending rows (this one included) leave of the budget.
        start = sinks + min(meta["budget"] - sinks - pending - 1, meta["clustered"])
        self._ensure_capacity(memory, start + pending + 1)
        work_k, work_v = memory.device_tier["keys"], memory.device_tier["values"]
        old = meta["pending_start"]
        if pending and start != old:
            # clone: the source and destination blocks overlap when they move by fewer than `pending` rows
            work_k[:, :, start : start + pending] = work_k[:, :, old : old + pending].clone()
            work_v[:, :, start : start + pending] = work_v[:, :, old : old + pending].clone()
        work_k[:, :, start + pending : start + pending + 1] = key
        work_v[:, :, start + pending : start + pending + 1] = value
        meta["pending_start"] = start
        meta["pending"] = pending + 1

    def select_rows(self, memory, query: torch.Tensor) -> Selection:
        meta = memory.meta
        sinks, start, pending = meta["sinks"], meta["pending_start"], meta["pending"]
        recall = start - sinks
        total = start + pending
        work_k, work_v = memory.device_tier["keys"], memory.device_tier["values"]
        slot_ok = None
        if recall > 0:
            rows, slot_ok = self._recall_index(memory, query, recall)
            # into the buffer's recall region; pinned rows read by a GPU kernel (RowBuffer.gather)
            memory.host_tier["keys"].gather(rows, out=work_k[:, :, sinks:start])
            memory.host_tier["values"].gather(rows, out=work_v[:, :, sinks:start])
        # Empty recall slots are hidden by the bias, which is built whether or not any slot is empty (asking
        # would read a value back to the host); a zero bias leaves the softmax exactly as it is without one.
        sink_ok = memory.device_tier.get("sink_valid")
        bias = None
        if slot_ok is not None or sink_ok is not None:
            b, h = work_k.shape[:2]
            bias = torch.zeros(b, h, total, dtype=query.dtype, device=query.device)
            if sink_ok is not None:
                bias[:, :, :sinks].masked_fill_(~sink_ok, float("-inf"))
            if slot_ok is not None:
                bias[:, :, sinks:start].masked_fill_(~slot_ok, float("-inf"))
        return Selection(work_k[:, :, :total], work_v[:, :, :total], bias)

    # -- internals --------------------------------------------------------------------------------------
    def _recall_index(self, memory, query: torch.Tensor, recall: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Host row ids ``[b, h, recall]`` in sequence order, and which slots hold a row (a (batch, head)
        with fewer clustered rows than ``recall`` leaves its last slots empty)."""
        centroids = memory.device_tier["centroids"]
        kv_heads, clusters = centroids.shape[1], centroids.shape[2]
        q = group_query(query, kv_heads).float()  # [b, h, g, d]
        # Index arithmetic on the device, where the scores are: nothing is read back to the host.
        score = torch.matmul(q, centroids.float().transpose(-1, -2)).sum(dim=2)  # [b, h, C]
        sizes = memory.device_tier["cluster_sizes"]
        starts = memory.device_tier["cluster_starts"]
        perm = memory.device_tier["perm"]
        dev = score.device
        n, m = host_length(memory), perm.shape[-1]

        order = score.argsort(dim=-1, descending=True, stable=True)
        size_sorted = sizes.gather(-1, order)
        cum = size_sorted.cumsum(-1)
        before = cum - size_sorted
        b, h = score.shape[:2]
        slot = torch.arange(recall, device=dev).expand(b, h, recall).contiguous()
        ok = slot < cum[..., -1:]
        rank = torch.searchsorted(cum, slot, right=True).clamp_(max=clusters - 1)  # sorted cluster per slot
        within = slot - before.gather(-1, rank)
        pos = starts.gather(-1, order.gather(-1, rank)) + within

        # The cluster holding the last slot is cut when it does not fit whole: take its best members by q·k.
        # Ranked over a fixed width (the largest cluster there is) whether or not anything is cut, so no value
        # is read back to decide; where nothing is cut, `in_cut` is all False and the ranking goes unused.
        last = rank[..., -1:]  # [b, h, 1]
        cut = ok[..., -1:] & (cum.gather(-1, last) > recall)
        cluster = order.gather(-1, last)
        count = sizes.gather(-1, cluster) * cut  # members of the cut cluster, 0 where nothing is cut
        width = max(1, memory.meta["largest"])
        member = torch.arange(width, device=dev)
        member_pos = (starts.gather(-1, cluster) + member).clamp_(max=m - 1)  # [b, h, width]
        member_rows = perm.gather(-1, member_pos)
        member_k = memory.host_tier["keys"].gather(member_rows)
        member_score = torch.matmul(q, member_k.float().transpose(-1, -2)).sum(dim=2)
        member_score = member_score.masked_fill(member >= count, float("-inf"))
        ranked = member_pos.gather(-1, member_score.argsort(dim=-1, descending=True, stable=True))
        in_cut = cut & (rank == last)
        pos = torch.where(in_cut, ranked.gather(-1, within.clamp(0, width - 1)), pos)

        rows = perm.gather(-1, pos.clamp_(0, m - 1)).masked_fill_(~ok, n)
        # Sequence order (empty slots, marked n, sort last): at a budget covering everything, the
        # selection is [sinks | every clustered row in order | pending], i.e. exactly the sequence.
        rows = rows.sort(dim=-1).values
        ok = rows < n
        return rows.masked_fill_(~ok, 0), ok

    def _cluster_pending(self, memory) -> None:
        """Cluster the pending generated rows into new clusters appended to the index; frees their rows."""
        cfg, meta = self.config, memory.meta
        pending, start = meta["pending"], meta["pending_start"]
        first = host_length(memory) - 1 - pending  # host row id of the oldest pending row (the newest is not pending yet)
        keys = memory.device_tier["keys"][:, :, start : start + pending]
        # Every iteration runs (no convergence test, which would read the labels back to the host): once the
        # labels are stable each further iteration recomputes the same centroids, so the result is the same.
        found = cosine_kmeans(keys, None, num_clusters(pending, cfg.cluster_size), cfg.kmeans_iters, early_stop=False)
        dev = memory.device_tier
        perm = dev["perm"]
        new_perm = found.labels.argsort(dim=-1, stable=True) + first
        new_starts = found.sizes.cumsum(-1) - found.sizes + perm.shape[-1]
        dev["perm"] = torch.cat([perm, new_perm], dim=-1)
        dev["cluster_starts"] = torch.cat([dev["cluster_starts"], new_starts], dim=-1)
        memory.device_tier["centroids"] = torch.cat([memory.device_tier["centroids"], found.centroids], dim=2)
        memory.device_tier["cluster_sizes"] = torch.cat([memory.device_tier["cluster_sizes"], found.sizes], dim=-1)
        meta["clustered"] += pending  # every (batch, head) gains all of them: generated rows are never padding
        meta["largest"] = max(meta["largest"], pending)  # no new cluster holds more than the rows clustered
        meta["pending"] = 0
        meta["reclusters"] += 1

    def _ensure_capacity(self, memory, rows: int) -> None:
        """Grow the device KV buffer to hold ``rows`` (in chunks, never past the budget), keeping the sinks
        and the pending block where they are."""
        work_k = memory.device_tier["keys"]
        capacity = work_k.shape[2]
        if rows <= capacity:
            return
        meta = memory.meta
        new_cap = min(meta["budget"], max(rows, capacity + max(RowBuffer.GROW_ROWS, capacity // 8)))
        keep = [(0, meta["sinks"])]
        if meta["pending"]:
            keep.append((meta["pending_start"], meta["pending_start"] + meta["pending"]))
        for name, dim in (("keys", memory.key_dim), ("values", memory.value_dim)):
            old = memory.device_tier[name]
            new = memory.device_buffer(new_cap, dim)
            for lo, hi in keep:
                new[:, :, lo:hi] = old[:, :, lo:hi]
            memory.device_tier[name] = new
