"""``sekv``: surprisal-guided spans with a trained, query-aware zoom.

Prefill (only when the context is over budget; below it every row stays exact, so B ≥ context is exactly
full attention). Per layer and batch row: the first ``sinks`` tokens and the last ``recent`` tokens stay
exact; in between, tokens whose surprisal (the frozen model's own ``-log p``) exceeds the adapter's
per-layer threshold are anchors, kept exact; the runs between anchors are spans (runs shorter than
``min_span`` stay exact). Per span and KV head the device tier keeps one summary row, the
surprisal-weighted mean of its keys and values; the host tier keeps an SVD of its keys and of its values
truncated by the adapter's rank gates — or, when a layer's gates keep every component (full rank), the
span's rows themselves, which are smaller than their full-rank factors.

Decode: the router estimates each span's share of the attention mass from the query and the summary key
(through the adapter's semantic projector, plus ``log |span|``), and spans whose estimate clears the
adapter's per-layer/head threshold are reconstructed (with the adapter's rank gates) into a device-tier
buffer and attended exactly, greedily in score order while the zoom rows allow. The remaining spans are
attended through their summary row with a ``log |span|`` logit bias: one softmax over everything.
Generated rows join the recent tail; every ``chunk`` steps its oldest ``chunk`` rows become a new span
so nothing generated is dropped.

Budget B per KV head = the rows attended exactly: sinks, anchors, loose rows, the recent tail (with room
for one more ``chunk``) and the zoom buffer. ``anchor_fraction`` of B is for anchors and loose rows (the
least surprising anchors are dropped when they do not fit), the rest after sinks and tail is the zoom buffer.
The summary rows are the span index — one key and one value row per span of at most ``max_span`` tokens
(at the default 8: an eighth of the KV bytes, twice Quest's two bounds per 16-token page) — and like
Quest's bounds or ClusterKV's centroids they are counted in the device tier's bytes, not in B.

The adapter: ``get_method("sekv", adapter=<SeKVAdapter>)``; a saved one (a folder, a Hub id or a training
checkpoint) through the artefact layer: ``ZoomAdapter.from_pretrained(path).make_method()``, which also
brings the settings it was trained with. Without one, a fresh adapter is built deterministically from the
layer shapes: it routes by ``q·summary-key``, zooms into anything over ~0.1% estimated mass and
reconstructs at full rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from zoomkv.errors import ConfigError
from zoomkv.methods.sekv.layout import build_spans, reconstruct, segment_row
from zoomkv.methods.sekv.modules import DEFAULT_R_MAX, SeKVAdapter
from zoomkv.protocol.method import KVMethod, MethodConfig, PrefillContext, Selection, group_query
from zoomkv.protocol.recallable import reserve_recall_buffer


@dataclass
class SeKVConfig(MethodConfig):
    sinks: int = field(default=4, metadata={"help": "first tokens always exact (attention sinks)"})
    recent: int = field(default=8, metadata={"help": "last tokens always exact"})
    chunk: int = field(
        default=8,
        metadata={"help": "generated rows are summarised into a span every `chunk` steps"},
    )
    min_span: int = field(default=4, metadata={"help": "shorter runs between anchors stay exact"})
    max_span: int = field(
        default=8,
        metadata={"help": "longest span: the zoom granularity (its SVD at rank max_span is exact)"},
    )
    anchor_fraction: float = field(
        default=0.1,
        metadata={"help": "share of B for anchors + loose rows; after sinks and tail the rest is zoom"},
    )

    def __post_init__(self) -> None:
        for name in ("sinks", "recent", "chunk"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.min_span < 2 or self.max_span < self.min_span:
            raise ConfigError(f"need 2 <= min_span <= max_span, got {self.min_span}, {self.max_span}")
        if not 1 <= self.chunk <= self.max_span:
            raise ConfigError(f"need 1 <= chunk <= max_span (a chunk becomes one span), got {self.chunk}")
        if not 0 <= self.anchor_fraction < 1:
            raise ConfigError(f"anchor_fraction must be in [0, 1), got {self.anchor_fraction}")


def plan_budget(budget: int, cfg: SeKVConfig) -> tuple[int, int]:
    """``(zoom_rows, room)``: rows of the zoom buffer, and the rows for anchors + loose rows; the rest of B
    holds the sinks, the tail and one chunk of growth."""
    room = int(budget * cfg.anchor_fraction)
    return budget - (cfg.sinks + cfg.recent + cfg.chunk + room), room


def stored_rank(adapter: SeKVAdapter, cfg: SeKVConfig) -> int:
    """Rank of the SVD factors of a span: a span has at most ``max_span`` rows, so more is padding."""
    return min(adapter.r_max, cfg.max_span)


class SeKV(KVMethod):
    name = "sekv"
    config_class = SeKVConfig
    citation = "surprisal-guided spans + anchors with a trained router, rank gates and summary rows (zoomkv)"
    summary = "surprisal anchors + span summaries on device, spans (or their SVD) on host; a trained router zooms in"
    recallable = True
    needs_surprisal = True

    config: SeKVConfig

    def __init__(self, config: SeKVConfig | None = None, *, adapter: SeKVAdapter | None = None,
                 **overrides: Any):
        super().__init__(config, **overrides)
        if adapter is not None and not isinstance(adapter, SeKVAdapter):
            raise ConfigError(f"sekv takes a SeKVAdapter, not {type(adapter).__name__} (load a saved adapter with "
                              "ZoomAdapter.from_pretrained(path).make_method())")
        self.adapter: SeKVAdapter | None = adapter
        self._fresh: dict[tuple[int, int, int], SeKVAdapter] = {}  # default adapters by (layers, heads, dim)

    def min_budget(self) -> int:
        c = self.config
        # Sinks + tail + one chunk of growth exact, and a zoom buffer that holds one whole span.
        return math.ceil((c.sinks + c.recent + c.chunk + c.max_span) / (1 - c.anchor_fraction)) + 1

    def device_rows(self, memory) -> int:
        # Exact rows + the zoom buffer. Summary rows are the span index: counted in bytes, not rows.
        rows = 0
        for name in ("keys", "recall_keys"):
            t = memory.device_tier.get(name)
            rows += 0 if t is None else t.shape[2]
        return rows

    # -- adapter ----------------------------------------------------------------------------------------
    def _adapter_for(self, ctx: PrefillContext) -> SeKVAdapter:
        layers = len(ctx.zoom_layers) if ctx.zoom_layers is not None else ctx.num_layers
        heads, dim = ctx.keys.shape[1], ctx.keys.shape[3]
        adapter = self.adapter
        if adapter is None:
            key = (layers, heads, dim)
            if key not in self._fresh:
                self._fresh[key] = SeKVAdapter(layers, heads, dim, proj_dim=min(8, dim), share_projector=True,
                                               r_max=DEFAULT_R_MAX)
            adapter = self._fresh[key]
        elif (adapter.num_layers, adapter.kv_heads, adapter.head_dim) != (layers, heads, dim):
            raise ConfigError(
                f"this sekv adapter was built for {adapter.num_layers} layers x {adapter.kv_heads} KV heads x "
                f"head_dim {adapter.head_dim}, but the model has {layers} x {heads} x {dim}"
            )
        return adapter.to(ctx.keys.device)

    @staticmethod
    def _layer_pos(ctx: PrefillContext) -> int:
        return ctx.zoom_layers.index(ctx.layer_idx) if ctx.zoom_layers is not None else ctx.layer_idx

    # -- prefill ----------------------------------------------------------------------------------------
    @torch.no_grad()
    def compress(self, memory, ctx: PrefillContext) -> None:
        adapter = self._adapter_for(ctx)
        budget = self.layer_budget(ctx.layer_idx, ctx.num_layers, ctx.budget)
        b, _, t, _ = ctx.keys.shape
        memory.meta.update(budget=budget, scaling=ctx.scaling, layer=self._layer_pos(ctx), adapter=adapter)
        surprisal = ctx.surprisal if ctx.surprisal is not None else torch.zeros(b, t, device=ctx.keys.device)
        valid = ctx.valid if ctx.valid is not None else torch.ones(b, t, dtype=torch.bool, device=ctx.keys.device)
        if t <= budget:
            # Everything fits: keep every row exact (this is full attention) until the budget is reached.
            memory.meta["mode"] = "exact"
            memory.device_tier["keys"], memory.device_tier["values"] = ctx.keys, ctx.values
            memory.device_tier["bias"] = _bias(valid)
            memory.host_tier["surprisal"] = memory.to_host(surprisal.float().clone())
            return
        self._build_zoom(memory, ctx.keys, ctx.values, valid, surprisal)

    def _build_zoom(self, memory, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor,
                    surprisal: torch.Tensor) -> None:
        c = self.config
        adapter: SeKVAdapter = memory.meta["adapter"]
        layer = memory.meta["layer"]
        b, h, t, _ = keys.shape
        zoom_rows, room = plan_budget(memory.meta["budget"], c)
        tail_start = t - c.recent
        tau = float(adapter.span_tau[layer])
        firsts = [int(valid[i].float().argmax()) for i in range(b)]
        layouts = [segment_row(surprisal[i], firsts[i], tail_start, tau, sinks=c.sinks, min_span=c.min_span,
                               max_span=c.max_span, room=room) for i in range(b)]
        n_exact = max(len(lay.exact) for lay in layouts)
        exact_idx = torch.zeros(b, n_exact + c.recent, dtype=torch.long)
        exact_ok = torch.zeros(b, n_exact + c.recent, dtype=torch.bool)
        for i, lay in enumerate(layouts):
            exact_idx[i, : len(lay.exact)] = torch.tensor(lay.exact, dtype=torch.long)
            exact_ok[i, : len(lay.exact)] = True
        exact_idx[:, n_exact:] = torch.arange(tail_start, t)
        exact_idx, exact_ok = exact_idx.to(keys.device), exact_ok.to(keys.device)
        exact_ok[:, n_exact:] = valid[:, tail_start:]
        gidx = exact_idx[:, None, :, None]
        memory.device_tier["keys"] = torch.gather(keys, 2, gidx.expand(-1, h, -1, keys.shape[-1]))
        memory.device_tier["values"] = torch.gather(values, 2, gidx.expand(-1, h, -1, values.shape[-1]))
        memory.device_tier["bias"] = _bias(exact_ok)
        # At full rank (every rank gate of the layer on) a span's rows are smaller than their SVD factors:
        # the host tier then holds the rows themselves; the factors only when the gates drop components.
        rank = stored_rank(adapter, c)
        memory.meta["span_rows"] = bool(adapter.hard_gates(layer)[..., :rank].all())
        spans = build_spans(keys, values, surprisal, [lay.spans for lay in layouts], rank,
                            factor=not memory.meta["span_rows"])
        self._store_spans(memory, spans.sum_keys, spans.sum_values, spans.count, _host_parts(spans, memory))
        memory.host_tier.pop("surprisal", None)
        memory.meta.update(
            mode="zoom", tail=c.recent, zoom_rows=zoom_rows,
            # the fewest rows a span holds (how many spans the zoom rows can take) and how many rows at the
            # front of the tail may be padding (a row shorter than the tail): Python values, so decode steps
            # read nothing back to learn them
            shortest=min((e - s for lay in layouts for s, e in lay.spans), default=c.max_span),
            tail_pad=int((~exact_ok[:, n_exact:]).sum(1).max()),
        )
        for name in ("recall_keys", "recall_values"):
            memory.device_tier.pop(name, None)
        reserve_recall_buffer(memory, zoom_rows)
        # Unfilled slots are hidden by a -inf bias, but 0·NaN is NaN: never leave torch.empty garbage there.
        memory.device_tier["recall_keys"].zero_()
        memory.device_tier["recall_values"].zero_()

    @staticmethod
    def _store_spans(memory, sum_k, sum_v, count, host_parts: dict[str, torch.Tensor]) -> None:
        memory.device_tier["sum_keys"], memory.device_tier["sum_values"] = sum_k, sum_v
        memory.device_tier["sum_count"] = count[:, None, :]  # [b, 1, S]
        # The span rows (or their SVD factors) are the host tier: off the accelerator, pinned so a zoom-in
        # copies back async.
        for name in ("rows_k", "rows_v", "coef_k", "basis_k", "coef_v", "basis_v"):
            memory.host_tier.pop(name, None)
        memory.host_tier.update({name: memory.to_host(t) for name, t in host_parts.items()})

    # -- decode -----------------------------------------------------------------------------------------
    @torch.no_grad()
    def append(self, memory, key: torch.Tensor, value: torch.Tensor) -> None:
        dev = memory.device_tier
        dev["keys"] = torch.cat([dev["keys"], key], dim=2)
        dev["values"] = torch.cat([dev["values"], value], dim=2)
        dev["bias"] = torch.cat([dev["bias"], dev["bias"].new_zeros(key.shape[0], 1, key.shape[2])], dim=2)
        if memory.meta["mode"] == "exact":
            s = memory.host_tier["surprisal"]
            # A generated token's surprisal is unknown here: the row mean makes it neither anchor nor noise.
            s = torch.cat([s, s.mean(-1, keepdim=True).expand(-1, key.shape[2])], 1)
            memory.host_tier["surprisal"] = memory.to_host(s)
            if dev["keys"].shape[2] > memory.meta["budget"]:  # the context outgrew the budget: compress now
                valid = dev["bias"][:, 0] == 0
                self._build_zoom(memory, dev["keys"], dev["values"], valid, s.to(key.device))
            return
        memory.meta["tail"] += key.shape[2]
        if memory.meta["tail"] >= self.config.recent + self.config.chunk:
            self._summarise_chunk(memory)

    def _summarise_chunk(self, memory) -> None:
        """The oldest ``chunk`` rows of the recent tail become a span (or join the last one when full)."""
        c, dev = self.config, memory.device_tier
        adapter: SeKVAdapter = memory.meta["adapter"]
        e = dev["keys"].shape[2]
        lo = e - memory.meta["tail"]
        hi = lo + c.chunk
        keys, values = dev["keys"][:, :, lo:hi], dev["values"][:, :, lo:hi]
        ok = dev["bias"][:, 0, lo:hi] == 0  # [b, chunk]; tail rows of short rows may be padding
        b, h, _, d = keys.shape
        # Pack each row's real chunk rows first (padding, if any, is at the start of the tail).
        order = (~ok).float().argsort(dim=1, stable=True)
        keys = torch.gather(keys, 2, order[:, None, :, None].expand(-1, h, -1, d))
        values = torch.gather(values, 2, order[:, None, :, None].expand(-1, h, -1, values.shape[-1]))
        if memory.meta["tail_pad"] > 0:
            # Prompt rows at the front of the tail may be padding (a row shorter than the tail): count them.
            spans = [[(0, int(n))] if int(n) > 0 else [] for n in ok.sum(1)]
            memory.meta["shortest"] = min([memory.meta["shortest"]] + [e for row in spans for _, e in row])
        else:  # every row of the chunk is a real token: nothing to count (and nothing read back)
            spans = [[(0, c.chunk)]] * b
            memory.meta["shortest"] = min(memory.meta["shortest"], c.chunk)
        memory.meta["tail_pad"] = max(0, memory.meta["tail_pad"] - c.chunk)
        # Generated rows carry no surprisal: uniform weights.
        new = build_spans(keys, values, torch.ones(b, c.chunk, device=keys.device), spans, stored_rank(adapter, c),
                          factor=not memory.meta["span_rows"])
        self._append_span(memory, new)
        device = dev["keys"].device
        keep = torch.cat([torch.arange(0, lo, device=device), torch.arange(hi, e, device=device)])
        for name in ("keys", "values", "bias"):
            dev[name] = dev[name].index_select(2, keep)
        memory.meta["tail"] -= c.chunk

    def _append_span(self, memory, new) -> None:
        dev, host = memory.device_tier, memory.host_tier
        if new.sum_keys.shape[2] == 0:  # every row's chunk was padding: an empty slot keeps shapes aligned
            return
        parts = {}
        for name, t in _host_parts(new, memory).items():
            old = host[name]
            if name.startswith(("rows_", "coef_")):  # [b, h, S, P, *]: pad the row axis to the longer span
                size = max(old.shape[3], t.shape[3])
                old, t = _pad_rows(old, size), _pad_rows(t, size)
            parts[name] = torch.cat([old, t.cpu()], 2)
        self._store_spans(memory, torch.cat([dev["sum_keys"], new.sum_keys], 2),
                          torch.cat([dev["sum_values"], new.sum_values], 2),
                          torch.cat([dev["sum_count"][:, 0], new.count], 1), parts)

    @torch.no_grad()
    def select(self, memory, query: torch.Tensor) -> Selection:
        dev, host = memory.device_tier, memory.host_tier
        keys, values = dev["keys"], dev["values"]
        b, h = keys.shape[:2]
        exact_bias = dev["bias"].expand(-1, h, -1)
        if memory.meta["mode"] == "exact" or dev["sum_keys"].shape[2] == 0:
            return Selection(keys, values, exact_bias.to(query.dtype))
        adapter: SeKVAdapter = memory.meta["adapter"]
        layer, scaling, zoom_rows = memory.meta["layer"], memory.meta["scaling"], memory.meta["zoom_rows"]
        q = group_query(query, h)  # [b, h, g, d]
        sum_k, sum_v = dev["sum_keys"], dev["sum_values"]
        count = dev["sum_count"].expand(-1, h, -1)  # [b, h, S]
        log_n = torch.where(count > 0, count.clamp_min(1).log(), torch.full_like(count, float("-inf")))
        # The router: estimated log share of the attention mass of each span, per query head; a span is
        # worth zooming into when some head of the group gives it more than the threshold.
        exact_logits = torch.matmul(q, keys.transpose(-1, -2)) * scaling + exact_bias[:, :, None]
        sum_logits = torch.matmul(q, sum_k.transpose(-1, -2)) * scaling + log_n[:, :, None]
        lse = torch.logsumexp(torch.cat([exact_logits, sum_logits], -1), -1, keepdim=True)
        routed = adapter.router_scores(layer, q, sum_k) * scaling + log_n[:, :, None]
        route = (routed - lse).amax(2) - adapter.route_tau[layer].to(q.dtype)[None, :, None]  # [b, h, S]
        take = greedy_zoom(route, count, zoom_rows)
        recall_k, recall_v = dev["recall_keys"], dev["recall_values"]
        # Fixed shapes, nothing read back to the host: each of the zoom_rows slots learns which zoomed span and
        # which of its rows it holds (the zoomed spans packed in span order), and every slot is written; slots
        # past the zoomed rows get a -inf bias, so their content (finite rows) weighs exactly nothing.
        n_rows = count.long() * take  # [b, h, S]
        ends = n_rows.cumsum(-1)
        slot = torch.arange(zoom_rows, device=ends.device).expand(b, h, zoom_rows).contiguous()
        filled = slot < ends[..., -1:]
        span = torch.searchsorted(ends, slot, right=True).clamp_(max=ends.shape[-1] - 1)  # [b, h, zoom_rows]
        row = (slot - (ends - n_rows).gather(-1, span)).masked_fill_(~filled, 0)  # the slot's row in its span
        dev_of = keys.device
        if memory.meta["span_rows"]:
            # Fetch the zoomed rows from the host tier (index there, copy only the zoom buffer's rows).
            rk = _span_rows(host["rows_k"], span, row).to(dev_of, non_blocking=True)
            rv = _span_rows(host["rows_v"], span, row).to(dev_of, non_blocking=True)
        else:
            # Reconstruct the zoomed spans from their factors: at most `most` of them fit the zoom rows.
            most = max(1, min(ends.shape[-1], zoom_rows // max(1, memory.meta["shortest"])))
            zoomed = (~take).to(torch.int8).argsort(dim=-1, stable=True)[..., :most]  # [b, h, most], in span order
            gates = adapter.hard_gates(layer).to(keys.dtype)[..., : host["coef_k"].shape[-1]]  # [h, 2, r]
            rk = reconstruct(_spans(host["coef_k"], zoomed).to(dev_of, non_blocking=True),
                             _spans(host["basis_k"], zoomed).to(dev_of, non_blocking=True), gates[None, :, None, 0])
            rv = reconstruct(_spans(host["coef_v"], zoomed).to(dev_of, non_blocking=True),
                             _spans(host["basis_v"], zoomed).to(dev_of, non_blocking=True), gates[None, :, None, 1])
            nth = (take.long().cumsum(-1) - 1).gather(-1, span).clamp_(0, most - 1)  # the slot's span among zoomed
            rk, rv = _span_rows(rk, nth, row), _span_rows(rv, nth, row)
        recall_k.copy_(rk)
        recall_v.copy_(rv)
        recall_bias = torch.zeros((b, h, zoom_rows), dtype=query.dtype, device=query.device)
        recall_bias.masked_fill_(~filled.to(query.device), float("-inf"))
        # Zoomed spans are attended through their rows, the others through their summary (log-size bias).
        sum_bias = log_n.masked_fill(take, float("-inf")).to(query.dtype)
        return Selection(
            torch.cat([keys, sum_k, recall_k], 2),
            torch.cat([values, sum_v, recall_v], 2),
            torch.cat([exact_bias.to(query.dtype), sum_bias, recall_bias], 2),
            index_rows=sum_k.shape[2],
        )


def _spans(parts: torch.Tensor, which: torch.Tensor) -> torch.Tensor:
    """Spans ``which`` (``[b, h, k]``) of per-span tensors ``[b, h, S, ...]`` → ``[b, h, k, ...]``."""
    which = which.to(parts.device)
    shape = which.shape + (1,) * (parts.dim() - 3)
    return parts.gather(2, which.reshape(shape).expand(*which.shape, *parts.shape[3:]))


def _span_rows(rows: torch.Tensor, span: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    """Row ``row`` of span ``span`` (both ``[b, h, k]``) of span rows ``[b, h, S, P, d]`` → ``[b, h, k, d]``."""
    b, h, spans, size, d = rows.shape
    flat = (span * size + row).to(rows.device)
    return rows.reshape(b, h, spans * size, d).gather(2, flat[..., None].expand(-1, -1, -1, d))


def _host_parts(spans, memory) -> dict[str, torch.Tensor]:
    """What the host tier keeps of spans: their rows at full rank, else their SVD factors."""
    if memory.meta["span_rows"]:
        return {"rows_k": spans.rows_k, "rows_v": spans.rows_v}
    return {"coef_k": spans.coef_k, "basis_k": spans.basis_k, "coef_v": spans.coef_v, "basis_v": spans.basis_v}


def greedy_zoom(route: torch.Tensor, count: torch.Tensor, zoom_rows: int) -> torch.Tensor:
    """``[b, h, S]`` bool: spans with ``route > 0``, best first, as long as their rows fit ``zoom_rows``
    (the first span that does not fit ends the walk, which keeps it vectorised)."""
    order = route.argsort(dim=-1, descending=True)
    eligible = torch.gather(route, -1, order) > 0
    sizes = torch.gather(count, -1, order) * eligible
    fits = eligible & (sizes.cumsum(-1) <= zoom_rows)
    return torch.zeros_like(fits).scatter(-1, order, fits)


def _bias(valid: torch.Tensor) -> torch.Tensor:
    """``[b, n]`` bool → ``[b, 1, n]`` float logit bias (``-inf`` on padding)."""
    return torch.zeros(valid.shape, dtype=torch.float32, device=valid.device).masked_fill(~valid, float("-inf"))[
        :, None
    ]


def _pad_rows(t: torch.Tensor, size: int) -> torch.Tensor:
    """Zero-pad the span-row axis of host-tier span tensors (``[b, h, S, P, r or d]``) up to ``size``."""
    short = size - t.shape[3]
    return t if short <= 0 else F.pad(t, [0, 0, 0, short])
