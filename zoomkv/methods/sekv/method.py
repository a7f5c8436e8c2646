"""``sekv``: surprisal-guided key codes, a trained zoom-in router, and one summary row for the rest.

Every row stays on the host tier. The device tier holds, per compressed layer and KV head, an index of
every row: its key in a few bits (``codes.py``: centred, rotated by a fixed random orthogonal matrix,
unit-RMS, one bit per coordinate by default, plus the RMS), and for *anchors* a finer code. Anchors are
the tokens the frozen model found surprising (surprisal above ``mean + τ·std`` of the sequence, τ the
adapter's per-layer entropy threshold, at most ``anchor_fraction`` of the context, the most surprising
first): names, numbers and other one-off facts, whose keys a one-bit code blurs most.

Decode step: the router scores every row from its code against the query (rotated the same way, each
coordinate weighted by the adapter's trained gains: the semantic projector), each query head's scores go
through a softmax at the model's temperature, and a GQA group's query heads vote with their summed mass.
The first ``sinks`` rows and the newest ``recent`` always count; the best-voted rows fill the rest of the
budget and are recalled from the host tier (zoomed into) and attended exactly. Everything not recalled is
attended through one summary row: the mean key and value of the rows left out, with a ``log(count)``
logit bias (the softmax tail, ``zoomkv.memory.tail``), so the mass the selection misses is not simply
dropped. One softmax over all of it.

Budget: B per KV head = the recalled rows (sinks and recent rows among them) + the summary row. The
adapter may move rows between layers (``layer_logit``: the layer budgets sum to ``L·B``). The codes are
the index: counted in the device tier's bytes (10 bytes per row at head_dim 64 and one bit: 2% of fp32 KV,
4% of fp16 KV), not in B. While the context fits the budget every row is attended: exactly full attention.

With an adapter trained with ``hash_bits`` (``modules.py``), the index is the signs of the key's trained
projections instead (``hash_bits / 8`` bytes and the RMS a row: 6 at 32 bits), scored against the query's trained
projection; anchors and the second stage keep the rotated key's finer codes. With ``fit_bits`` the index is fitted to
each context at the prefill instead (``hashing.fit_context``): the directions of its query-key product under its
own query and key moments, the strongest at 4 or 2 bits, each sequence's projections kept (fp16) beside its codes.

Rows that join after compression (generated tokens, a follow-up question, later chunks of a chunked
prefill) get the base code: their surprisal is not known when they arrive.

The adapter: ``get_method("sekv", adapter=<SeKVAdapter>)``; a saved one (a folder, a Hub id or a training
checkpoint) through the artefact layer: ``ZoomAdapter.from_pretrained(path).make_method()``. Without one, a
fresh adapter routes by the plain code dot product, τ = 2 and one budget per layer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from zoomkv.errors import ConfigError
from zoomkv.memory import graphs
from zoomkv.memory.quant import BITS as QUANT_BITS
from zoomkv.memory.quant import FORMATS_HELP, QuantSpec, is_format, row_buffer
from zoomkv.memory.tail import append_tail, init_tail, with_tail
from zoomkv.memory.tiers import RowBuffer
from zoomkv.methods.sekv import native
from zoomkv.methods.sekv.codes import BITS, encode, encode_layout, rotation, score_codes, score_layout
from zoomkv.methods.sekv.hashing import fit_context, query_moment
from zoomkv.methods.sekv.host import masked_mean, principal_directions, project, reconstruct
from zoomkv.methods.sekv.modules import INIT_TAU, SeKVAdapter
from zoomkv.protocol import rotary
from zoomkv.protocol.method import MethodConfig, PrefillContext, Selection, group_query, summed_over_queries
from zoomkv.protocol.phases import phase
from zoomkv.protocol.recallable import (
    RecallableMethod,
    append_host_rows,
    append_valid,
    host_length,
    host_valid,
    misses_only,
    padding_bias,
    recall_rows,
    reserve_recall_buffer,
    store_host_rows,
    store_valid,
    swaps,
)

TAIL = "sekv_tail"  # the summary row's running sums, apart from the runtime's own ``--tail-summary`` row
NATIVE = "native_layer"  # memory.meta: the layer's compiled step, laid out after the prefill
QUERY_MOMENT = "sekv_query_moment"  # ctx.derived: the prefill's query moment per KV head (fit_bits)
HOST_KEY_BASES = ("pre_rope", "post_rope")
RESCORE_SOURCES = ("codes", "host")


@dataclass
class SeKVConfig(MethodConfig):
    sinks: int = field(default=4, metadata={"help": "first tokens always attended exactly (attention sinks)"})
    recent: int = field(default=16, metadata={"help": "newest tokens always attended exactly"})
    code_bits: int = field(default=1, metadata={"help": "bits per key coordinate in the index (1, 2, 4 or 8); an "
                                                         "adapter's trained hash (hash_bits) has its own widths"})
    anchor_bits: int = field(
        default=4, metadata={"help": "bits per key coordinate for anchors, the surprising tokens (1, 2, 4 or 8)"}
    )
    anchor_fraction: float = field(
        default=0.05, metadata={"help": "at most this share of the context are anchors (finer codes)"}
    )
    summary_row: bool = field(
        default=True, metadata={"help": "one row (the mean of what is not recalled) stands for the rest"}
    )
    rescore_bits: int = field(
        default=4, metadata={"help": "bits of the host tier's finer codes the router rescores its candidates with "
                                     "(1, 2, 4 or 8; 0: one stage)"}
    )
    candidates: float = field(
        default=4.0, metadata={"help": "candidates per recalled row the first stage passes to the rescoring"}
    )
    fit_bits: int = field(
        default=0, metadata={"help": "the index as codes fitted to the context at the prefill, this many bits a row "
                                     "(a multiple of 8 up to head_dim): the directions of its query-key product "
                                     "under its own query and key statistics, the strongest at 4 or 2 bits; 0: the "
                                     "rotated key's signs (or an adapter's trained hash)"}
    )
    rescore_from: str = field(
        default="codes", metadata={"help": "what the second stage scores the candidates with: 'codes', finer codes "
                                          "of every key at rescore_bits kept on the host tier beside the rows; "
                                          "'host', the host tier's keys themselves (as stored: exact or quantized), "
                                          "with no second copy of the keys"}
    )
    # The next four only matter under rank gates that drop directions. Their defaults are what adapters saved
    # before they existed were trained for (a recipe sets them: recipes/smollm2-135m/rank-budget.yaml).
    host_key_basis: str = field(
        default="post_rope", metadata={"help": "where the rank-gated host tier takes the keys' principal directions: "
                                              "'pre_rope' (rotated back by position, where keys are low-rank; "
                                              "'post_rope' when the model's RoPE cannot be rebuilt) or 'post_rope'"}
    )
    host_exact_sinks: bool = field(
        default=False, metadata={"help": "keep the sink rows exact on the device tier under rank gates (they sit "
                                         "far from the other rows' directions and take most of the attention)"}
    )
    host_exact_late: bool = field(
        default=False, metadata={"help": "under rank gates, rows that arrive after compression (a question, the "
                                         "answer so far, the next turn) stay exact on the host tier: the newest "
                                         "rows are attended every step"}
    )
    host_exact_anchors: bool = field(
        default=False, metadata={"help": "keep the anchors (the surprising tokens: names, numbers) exact on the host "
                                         "tier under rank gates; the rest of the rows go low-rank"}
    )
    host_anchor_bits: int = field(
        default=0, metadata={"help": "a second copy of the anchors' rows (the surprising tokens) beside a quantized "
                                     "host tier, recalled instead of their coarser codes: 8 (int8 per token) or 16 "
                                     "(fp16); 0: none. Counted in the host bytes; unused when the host rows are "
                                     "exact"}
    )
    host_format: str = field(
        default="none", metadata={"help": "the host tier's KV format when the command names none (int8, int4, "
                                         "kivi4, kivi2, ...; none: full precision); a trained adapter records "
                                         "the one its recipe chose"}
    )
    host_bits: list = field(
        default_factory=list, metadata={"help": "per model layer [key bits, value bits] of the host tier, fitted "
                                                "by training to the recipe's host_budget ([]: host_format's own "
                                                "bits in every layer; unused under host_format=none)"}
    )
    host_budget: float = field(
        default=0.0, metadata={"help": "the host-tier share of fp32 full KV that host_bits were fitted to "
                                       "(0: none; tables name the pattern after it)"}
    )

    def __post_init__(self) -> None:
        for name in ("sinks", "recent"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("code_bits", "anchor_bits"):
            if getattr(self, name) not in BITS:
                raise ConfigError(f"{name} must be one of {BITS}, got {getattr(self, name)}")
        if not 0 <= self.anchor_fraction <= 1:
            raise ConfigError(f"anchor_fraction must be in [0, 1], got {self.anchor_fraction}")
        if self.rescore_bits not in (0, *BITS):
            raise ConfigError(f"rescore_bits must be 0 or one of {BITS}, got {self.rescore_bits}")
        if self.fit_bits and (self.fit_bits % 8 or not 8 <= self.fit_bits <= 512):
            raise ConfigError(f"fit_bits must be 0 or a multiple of 8 in [8, head_dim], got {self.fit_bits}")
        if not 1 <= self.candidates <= 64:
            raise ConfigError(f"candidates must be in [1, 64], got {self.candidates}")
        if self.host_key_basis not in HOST_KEY_BASES:
            raise ConfigError(f"host_key_basis must be one of {HOST_KEY_BASES}, got {self.host_key_basis!r}")
        if self.rescore_from not in RESCORE_SOURCES:
            raise ConfigError(f"rescore_from must be one of {RESCORE_SOURCES}, got {self.rescore_from!r}")
        if self.host_anchor_bits not in (0, 8, 16):
            raise ConfigError(f"host_anchor_bits must be 0, 8 or 16, got {self.host_anchor_bits}")
        if self.host_format not in ("none", "") and not is_format(self.host_format):
            raise ConfigError(f"host_format must be none or one of {FORMATS_HELP}, got {self.host_format!r}")
        bits = self.host_bits
        if not isinstance(bits, list | tuple) or any(
                not isinstance(p, list | tuple) or len(p) != 2 or any(b not in QUANT_BITS for b in p) for p in bits):
            raise ConfigError(f"host_bits must be a list of [key bits, value bits] per layer, each one of {QUANT_BITS}")
        if not 0 <= self.host_budget <= 1:
            raise ConfigError(f"host_budget must be in [0, 1], got {self.host_budget}")


def split_budget(total: int, shares: Sequence[float], low: int) -> list[int]:
    """Integer budgets, each >= ``low``, summing to ``total``, as near ``shares`` (relative sizes) as
    integers allow (largest remainder). Needs ``total >= len(shares) * low``."""
    n = len(shares)
    spare = total - n * low
    if spare < 0:
        raise ConfigError(f"a total of {total} rows cannot give {n} layers {low} each")
    weight = [max(float(s), 0.0) for s in shares]
    norm = sum(weight) or 1.0
    exact = [spare * w / norm for w in weight]
    out = [low + math.floor(e) for e in exact]
    order = sorted(range(n), key=lambda i: (math.floor(exact[i]) - exact[i], i))
    for i in order[: total - sum(out)]:
        out[i] += 1
    return out


def rows_at(rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``rows`` ``[b, h, t, d]`` at ``positions`` ``[b, A]`` (the same for every head) → ``[b, h, A, d]``."""
    at = positions[:, None, :, None].expand(-1, rows.shape[1], -1, rows.shape[-1])
    return rows.gather(2, at)


def pick_anchors(surprisal: torch.Tensor, valid: torch.Tensor, tau: float, most: int, skip: int,
                 stop: int) -> torch.Tensor:
    """``[b, A]`` long positions of each row's anchors in ``[first real + skip, stop)``: surprisal above
    ``mean + tau·std`` of the row's real tokens, at most ``most``, the most surprising first; rows with
    fewer repeat their first anchor (or hold -1 when they have none)."""
    b, t = surprisal.shape
    s = surprisal.float().masked_fill(~valid, float("nan"))
    mean = s.nanmean(1, keepdim=True)
    std = (s - mean).pow(2).nanmean(1, keepdim=True).sqrt()
    pos = torch.arange(t, device=s.device)[None, :]
    first = valid.float().argmax(1, keepdim=True)
    eligible = valid & (pos >= first + skip) & (pos < stop) & (s > mean + tau * std)
    if most <= 0:
        return torch.zeros(b, 0, dtype=torch.long, device=s.device)
    ranked = s.masked_fill(~eligible, float("-inf"))
    count = int(eligible.sum(1).max())  # at prefill: one read of how many anchors the layer keeps
    k = min(most, count)
    top = ranked.topk(k, dim=1)
    idx = top.indices.masked_fill(~torch.isfinite(top.values), -1)
    return idx.sort(1).values


class SeKV(RecallableMethod):
    name = "sekv"
    config_class = SeKVConfig
    citation = "surprisal-guided key codes with a trained zoom-in router and a summary row (zoomkv)"
    summary = ("every key as a 1-bit code on device (4-bit for surprising tokens); a trained router recalls "
               "the best rows, one summary row stands for the rest")
    needs_surprisal = True
    reads_queries = False

    config: SeKVConfig

    def __init__(self, config: SeKVConfig | None = None, *, adapter: SeKVAdapter | None = None,
                 **overrides: Any):
        super().__init__(config, **overrides)
        if adapter is not None and not isinstance(adapter, SeKVAdapter):
            raise ConfigError(f"sekv takes a SeKVAdapter, not {type(adapter).__name__} (load a saved adapter with "
                              "ZoomAdapter.from_pretrained(path).make_method())")
        self.adapter: SeKVAdapter | None = adapter
        if adapter is not None and adapter.hash_bits and self.config.fit_bits:
            raise ConfigError(f"sekv: this adapter's index is a trained hash of {adapter.hash_bits} bits a row; "
                              "fit_bits (an index fitted to the context) replaces it: one or the other")
        if adapter is not None and adapter.hash_bits and self.config.code_bits != 1:
            raise ConfigError(f"sekv: this adapter's index is a trained hash of {adapter.hash_bits} bits a row (one a "
                              f"projection); code_bits={self.config.code_bits} does not apply to it")
        self._split: dict[tuple[int, int], list[int]] = {}

    def host_format(self) -> tuple[str, list[list[int]], str]:
        c = self.config
        if c.host_format in ("none", ""):
            return "none", [], ""
        return c.host_format, [list(p) for p in c.host_bits], f"fit{round(100 * c.host_budget)}" if c.host_bits else ""

    def dense_layer(self, layer_idx: int, num_layers: int) -> bool:
        return False

    def min_budget(self) -> int:
        return self.config.sinks + self.config.recent + 1 + self.config.summary_row  # + a recalled row

    # -- budget -----------------------------------------------------------------------------------------
    def layer_budget(self, layer_idx: int, num_layers: int, budget: int,
                     zoom_layers: Sequence[int] | None = None) -> int:
        if self.adapter is None:
            return budget
        zoom = sorted(zoom_layers) if zoom_layers is not None else list(range(num_layers))
        if len(zoom) != self.adapter.num_layers:
            return budget  # a shape mismatch is refused by compress, naming both shapes
        key = (budget, len(zoom))
        if key not in self._split:
            shares = self.adapter.layer_shares().detach().cpu().tolist()
            self._split[key] = split_budget(budget * len(zoom), shares, self.min_budget())
        return self._split[key][zoom.index(layer_idx)]

    def device_rows(self, memory) -> int:
        rows = super().device_rows(memory)  # the recall buffer (with a slot for the summary row, once it has one)
        summary = self.config.summary_row and f"{TAIL}_count" in memory.device_tier
        return rows + (1 if summary and not memory.meta.get("summary_slot") else 0)

    # -- the adapter ------------------------------------------------------------------------------------
    def _check_adapter(self, ctx: PrefillContext) -> None:
        a = self.adapter
        if a is None:
            return
        layers = len(ctx.zoom_layers) if ctx.zoom_layers is not None else ctx.num_layers
        heads, dim = ctx.keys.shape[1], ctx.keys.shape[3]
        if (a.num_layers, a.kv_heads, a.head_dim) != (layers, heads, dim):
            raise ConfigError(
                f"this sekv adapter was built for {a.num_layers} layers x {a.kv_heads} KV heads x "
                f"head_dim {a.head_dim}, but the model has {layers} x {heads} x {dim}"
            )

    @staticmethod
    def _layer_pos(ctx: PrefillContext) -> int:
        return ctx.zoom_layers.index(ctx.layer_idx) if ctx.zoom_layers is not None else ctx.layer_idx

    def _gains(self, layer: int, heads: int, dim: int, device) -> torch.Tensor:
        if self.adapter is None:
            return torch.ones(heads, dim, device=device)
        return self.adapter.gains(layer).detach().to(device)

    def _tau(self, layer: int) -> float:
        return INIT_TAU if self.adapter is None else float(self.adapter.span_tau[layer].detach())

    def _seed(self, layer: int) -> int:
        return self.adapter.rotation_seed_of(layer) if self.adapter is not None else layer

    # -- prefill ----------------------------------------------------------------------------------------
    def keep_query_statistics(self, ctx: PrefillContext) -> None:
        if self.config.fit_bits:  # the fitted index weighs the keys' directions by the context's queries
            ctx.derived[QUERY_MOMENT] = query_moment(ctx.queries, ctx.valid, ctx.keys.shape[1])

    def _index_projections(self, ctx: PrefillContext, centred: torch.Tensor, valid: torch.Tensor,
                           layer: int) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int, int]] | None:
        """The index's key and query projections and layout: fitted to this context (``fit_bits``), an adapter's
        trained hash, or None (the rotated key's signs)."""
        if self.config.fit_bits:
            if self.config.fit_bits > centred.shape[-1]:
                raise ConfigError(f"sekv: fit_bits={self.config.fit_bits} is more than head_dim "
                                  f"{centred.shape[-1]} bits a row")
            moment = ctx.derived.get(QUERY_MOMENT)
            if moment is None:  # the queries were held (a replay's record): their moment now
                if ctx.queries.shape[2] == 0:
                    raise ConfigError("sekv: fit_bits needs the prefill's queries, which this runtime did not keep")
                moment = ctx.derived[QUERY_MOMENT] = query_moment(ctx.queries, ctx.valid, centred.shape[1])
            key, query, layout = fit_context(moment, centred, valid, self.config.fit_bits)
            # fp16 on the device (a sequence's own: at 4K rows they would otherwise weigh half of what the fewer
            # bits a row save), widened where used
            return key.half().to(centred.device), query.half().to(centred.device), layout
        if self.adapter is None or not self.adapter.hash_bits:
            return None
        key, query = (p.detach().float().contiguous().to(centred.device)
                      for p in self.adapter.hash_projections(layer))
        return key, query, self.adapter.hash_layout[layer]

    @torch.no_grad()
    def compress(self, memory, ctx: PrefillContext) -> None:
        self._check_adapter(ctx)
        c = self.config
        layer = self._layer_pos(ctx)
        b, h, t, d = ctx.keys.shape
        budget = self.layer_budget(ctx.layer_idx, ctx.num_layers, ctx.budget, ctx.zoom_layers)
        valid = ctx.valid if ctx.valid is not None else torch.ones(b, t, dtype=torch.bool, device=ctx.keys.device)
        dev = memory.device_tier
        keys = ctx.keys.float()
        mean = masked_mean(keys, valid)
        surprisal = ctx.surprisal if ctx.surprisal is not None else torch.zeros(b, t, device=keys.device)
        anchors = pick_anchors(surprisal, valid, self._tau(layer), int(c.anchor_fraction * t), c.sinks,
                               t - c.recent)
        self._store_host(memory, ctx, layer, mean, valid, compressed=t > budget - c.summary_row, anchors=anchors)
        rot = rotation(d, self._seed(layer), keys.device)
        dev["code_rotation"], dev["code_mean"] = rot, mean
        if self.adapter is not None:  # on the device once, where a step reads them (the adapter may sit elsewhere)
            dev["code_gains"] = self._gains(layer, h, d, keys.device)
            if c.summary_row:
                dev["summary_bias"] = self.adapter.summary_bias[layer].detach().to(keys.device)
        rotated = torch.matmul(keys - mean, rot)
        projections = self._index_projections(ctx, keys - mean, valid, layer)
        if projections is not None:  # a trained hash or codes fitted to this context: the index is their codes
            dev["hash_key"], dev["hash_query"], layout = projections
            memory.meta["hash_layout"] = layout
            codes, rms = encode_layout(torch.matmul(keys - mean, dev["hash_key"].float()), layout)
        else:
            memory.meta.pop("hash_layout", None)
            codes, rms = encode(rotated, c.code_bits)
        dev["codes"], dev["code_rms"] = RowBuffer(codes), RowBuffer(rms)
        if anchors.shape[1]:
            safe = anchors.clamp_min(0)
            fine = torch.gather(rotated, 2, safe[:, None, :, None].expand(-1, h, -1, d))
            dev["anchor_pos"] = anchors
            dev["anchor_codes"], dev["anchor_rms"] = encode(fine, c.anchor_bits)
        first = valid.float().argmax(1, keepdim=True)
        dev["sink_pos"] = (first + torch.arange(c.sinks, device=keys.device)).clamp_max(t - 1)
        memory.meta.update(budget=budget, scaling=ctx.scaling, layer=layer)
        memory.meta.pop(NATIVE, None)  # a new prefill: the compiled step is laid out again
        if c.rescore_bits and c.rescore_from == "codes":
            # The finer codes live on the host tier beside the rows; a step copies only its candidates' codes
            # into a fixed device buffer (counted in the device tier's bytes).
            fine, fine_rms = encode(rotated, c.rescore_bits)
            # (codes and their RMS are no KV rows: never quantized again under --kv-quant)
            memory.host_tier["fine_codes"] = memory.host_rows(fine, quantize=False)
            memory.host_tier["fine_rms"] = memory.host_rows(fine_rms, quantize=False)
            m = self._candidates(budget)
            dev["cand_codes"] = torch.zeros(b, h, m, fine.shape[-1], dtype=torch.uint8, device=keys.device)
            dev["cand_rms"] = torch.zeros(b, h, m, 1, dtype=torch.float16, device=keys.device)
        if c.summary_row:
            init_tail(memory, ctx, prefix=TAIL)
        reserve_recall_buffer(memory, min(budget - c.summary_row, t))

    def _kept_directions(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The principal directions the adapter's rank gates keep for keys and values (None: every one)."""
        if self.adapter is None:
            return None, None
        keep = (self.adapter.rank_gate[layer] > 0).detach().cpu()
        return tuple(None if bool(k.all()) else k for k in keep)  # type: ignore[return-value]

    def _store_host(self, memory, ctx: PrefillContext, layer: int, key_mean: torch.Tensor, valid: torch.Tensor,
                    compressed: bool, anchors: torch.Tensor | None = None) -> None:
        """Every row on the host tier: as it is, or (rank gates that drop directions, on a context that is
        compressed) its coordinates along the directions kept, the directions on the device tier. Keys are
        taken before RoPE when ``host_key_basis='pre_rope'`` (and the model's RoPE is known), and with
        ``host_exact_sinks`` the sink rows stay exact on the device tier, with ``host_exact_anchors`` the
        anchors (``[b, A]`` positions, -1: none) exact on the host tier, both out of the directions' fit; with
        ``host_exact_late`` rows appended later keep an exact host copy beside their coordinates. Under
        ``kv_quant`` the coordinates (and the exact copies) are quantized in turn: the two cuts compose."""
        keep_k, keep_v = self._kept_directions(layer)
        memory.meta["low_rank"], memory.meta["exact_anchors"] = {}, False
        memory.meta.pop("late_from", None)
        if not compressed or (keep_k is None and keep_v is None):
            # while the context fits the budget every row stays exact (B >= context is full attention)
            store_host_rows(memory, ctx)
            if compressed:
                self._store_fine_anchors(memory, ctx, anchors)
            return
        c = self.config
        if keep_k is not None and c.rescore_from == "host":  # the rescoring would read coordinates as keys
            raise ConfigError("sekv: rescore_from=host scores the host tier's keys, and this adapter's rank gates "
                              "keep only some of their directions there: use rescore_from=codes with rank gates")
        host, dev = memory.host_tier, memory.device_tier
        b, _, t, _ = ctx.keys.shape
        fit = valid
        if c.host_exact_sinks and c.sinks:
            sinks = (valid.float().argmax(1, keepdim=True) + torch.arange(c.sinks, device=valid.device)).clamp_max(t - 1)
            dev["exact_sink_pos"] = sinks
            dev["exact_sink_keys"], dev["exact_sink_values"] = rows_at(ctx.keys, sinks), rows_at(ctx.values, sinks)
            fit = valid.clone()
            fit.scatter_(1, sinks, False)
        if c.host_exact_anchors and anchors is not None and anchors.shape[1]:
            safe = anchors.clamp_min(0)
            host["exact_anchor_keys"] = memory.host_rows(rows_at(ctx.keys, safe))
            host["exact_anchor_values"] = memory.host_rows(rows_at(ctx.values, safe))
            memory.meta["exact_anchors"] = True  # their positions: dev["anchor_pos"], which compress stores
            hit = torch.zeros(valid.shape, dtype=torch.uint8, device=valid.device)
            hit.scatter_reduce_(1, safe, (anchors >= 0).to(torch.uint8), reduce="amax")
            fit = fit & ~hit.bool()
        keys = ctx.keys
        if keep_k is not None and c.host_key_basis == "pre_rope" and ctx.rotary is not None:
            inv_freq, scale = ctx.rotary
            dev["rope_inv_freq"] = inv_freq.to(keys.device)
            dev["pad"] = (~valid).sum(1)  # left padding: row i sits at position i - pad
            memory.meta["rope_scaling"] = scale
            keys = rotary.undo(keys.float(), *self._angles(memory, torch.arange(t, device=keys.device)[None, None]))
            key_mean = None
        for name, rows, mean, keep in (("keys", keys, key_mean, keep_k), ("values", ctx.values, None, keep_v)):
            if keep is None:
                host[name] = memory.host_rows(getattr(ctx, name), role=name)
                continue
            mean = masked_mean(rows.float(), fit) if mean is None or fit is not valid else mean
            directions = principal_directions(rows.float() - mean, fit)[:, :, keep.to(rows.device)]
            dev[f"{name}_directions"], dev[f"{name}_mean"] = directions, mean
            host[name] = memory.host_rows(project(rows, mean, directions).to(ctx.keys.dtype))
            memory.meta["low_rank"][name] = True
        if ctx.valid is not None:
            store_valid(memory, ctx.valid)
        if c.host_exact_late:
            memory.meta["late_from"] = t  # host rows from here on also have an exact copy
            host["late_keys"] = memory.host_rows(ctx.keys[:, :, :0])
            host["late_values"] = memory.host_rows(ctx.values[:, :, :0])

    def _store_fine_anchors(self, memory, ctx: PrefillContext, anchors: torch.Tensor | None) -> None:
        """``host_anchor_bits``: the anchors' keys and values once more, at 8 or 16 bits, beside a quantized host
        tier; the recall takes them instead of the anchors' coarser codes (``_exact_listed``)."""
        bits, spec = self.config.host_anchor_bits, memory.cache.kv_quant
        if not bits or spec is None or anchors is None or not anchors.shape[1]:
            return
        safe = anchors.clamp_min(0)  # -1 (no anchor) copies row 0, which no recall matches
        for name in ("keys", "values"):
            picked = memory.to_host(rows_at(getattr(ctx, name), safe))
            memory.host_tier[f"exact_anchor_{name}"] = (
                RowBuffer(picked.half(), pinned=memory.pin_host) if bits == 16
                else row_buffer(picked, QuantSpec(bits=8, group_size=spec.group_size).for_rows(name),
                                pinned=memory.pin_host))
        memory.meta["exact_anchors"] = True  # their positions: dev["anchor_pos"], which compress stores

    @staticmethod
    def _angles(memory, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin`` ``[b, h | 1, k, d]`` of host rows ``rows`` (indices, ``[b | 1, h | 1, k]``) at their positions."""
        dev = memory.device_tier
        positions = (rows - dev["pad"][:, None, None]).clamp_min(0)
        return rotary.angles(positions, dev["rope_inv_freq"], memory.meta["rope_scaling"])

    def _host_rows(self, memory, name: str, rows: torch.Tensor, first: int) -> torch.Tensor:
        """What the host tier stores of new rows ``rows`` (host rows ``first``, ``first + 1``, ...): the rows,
        or their coordinates."""
        if not memory.meta["low_rank"].get(name):
            return rows
        dev = memory.device_tier
        x = rows
        if name == "keys" and "rope_inv_freq" in dev:
            at = torch.arange(first, first + rows.shape[2], device=rows.device)[None, None]
            x = rotary.undo(rows.float(), *self._angles(memory, at))
        return project(x, dev[f"{name}_mean"], dev[f"{name}_directions"]).to(rows.dtype)

    def _recall(self, memory, idx: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The recalled keys and values, and the host row each slot holds (``recall_rows``)."""
        keys, values = memory.host_tier["keys"], memory.host_tier["values"]
        if not memory.meta["low_rank"] and not memory.meta.get("exact_anchors"):
            return recall_rows(memory, keys, values, idx)
        with phase("recall"):
            return (*self._recall_rebuilt(memory, keys, values, idx), idx)

    def _recall_rebuilt(self, memory, keys, values, idx: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The recall where host rows are not the rows: coordinates rebuilt along their directions (rank gates),
        then the rows kept exact or finer elsewhere (sinks, anchors, late rows) swapped in."""
        dev = memory.device_tier
        k = keys.length if idx is None else idx.shape[2]
        reserve_recall_buffer(memory, k)
        at_rows = torch.arange(k, device=dev["recall_keys"].device)[None, None] if idx is None else \
            idx.to(dev["recall_keys"].device)
        out = []
        for name, held in (("keys", keys), ("values", values)):
            rows = held.gather(idx).to(dev["recall_keys"].device, non_blocking=True)
            if memory.meta["low_rank"].get(name):
                rows = reconstruct(rows, dev[f"{name}_mean"], dev[f"{name}_directions"])
                if name == "keys" and "rope_inv_freq" in dev:
                    rows = rotary.apply(rows, *self._angles(memory, at_rows))
            if "exact_sink_pos" in dev:
                rows = self._exact_listed(rows, at_rows, dev["exact_sink_pos"], dev[f"exact_sink_{name}"])
            if memory.meta.get("exact_anchors"):  # their positions: dev["anchor_pos"], which compress stores
                rows = self._exact_listed(rows, at_rows, dev["anchor_pos"],
                                          memory.host_tier[f"exact_anchor_{name}"].view())
            if "late_from" in memory.meta:
                rows = self._exact_late(memory, name, rows, at_rows)
            buf = dev[f"recall_{name}"][:, :, :k]
            buf.copy_(rows)
            out.append(buf)
        return out[0], out[1]

    @staticmethod
    def _exact_late(memory, name: str, rows: torch.Tensor, at_rows: torch.Tensor) -> torch.Tensor:
        """``rows`` (host rows ``at_rows``) with the rows that arrived after compression exact."""
        late = memory.host_tier[f"late_{name}"].view()
        if late.shape[2] == 0:
            return rows
        offset = (at_rows - memory.meta["late_from"]).expand(rows.shape[0], rows.shape[1], -1)
        at = offset.clamp(0, late.shape[2] - 1).to(late.device)[..., None].expand(-1, -1, -1, late.shape[-1])
        exact = late.gather(2, at).to(rows.device, non_blocking=True).to(rows.dtype)
        return torch.where((offset >= 0)[..., None], exact, rows)

    @staticmethod
    def _exact_listed(rows: torch.Tensor, at_rows: torch.Tensor, positions: torch.Tensor,
                      exact: torch.Tensor) -> torch.Tensor:
        """``rows`` (host rows ``at_rows``, ``[b | 1, h | 1, k]``) with those at ``positions`` ``[b, A]`` (-1: none)
        replaced by their exact copies ``exact`` ``[b, h, A, d]`` (the sinks on the device tier, the anchors on
        the host tier)."""
        match = at_rows[..., None] == positions[:, None, None, :]  # [b, h | 1, k, A]
        which = match.to(torch.uint8).argmax(-1).expand(rows.shape[0], rows.shape[1], -1)  # [b, h, k]
        at = which.to(exact.device)[..., None].expand(-1, -1, -1, exact.shape[-1])
        picked = exact.gather(2, at).to(rows.device, non_blocking=True).to(rows.dtype)
        return torch.where(match.any(-1, keepdim=True), picked, rows)

    # -- decode -----------------------------------------------------------------------------------------
    @torch.no_grad()
    def append(self, memory, key: torch.Tensor, value: torch.Tensor) -> None:
        if key.dtype is torch.float32 and value.dtype is torch.float32 and native.usable(key):
            plan = self._native_layer(memory)
            if plan.appends:
                plan.append(key, value)
                return
        if memory.meta["low_rank"]:
            host = memory.host_tier
            first = host_length(memory)
            host["keys"].append(self._host_rows(memory, "keys", key, first))
            host["values"].append(self._host_rows(memory, "values", value, first))
            if "late_from" in memory.meta:
                host["late_keys"].append(key)
                host["late_values"].append(value)
            append_valid(memory, key)
        else:
            append_host_rows(memory, key, value)
        dev, c = memory.device_tier, self.config
        fine_bits = c.rescore_bits if c.rescore_from == "codes" else 0
        if "hash_key" not in dev and native.usable(key):  # both code widths in one compiled pass
            codes, rms, fine, fine_rms = native.encode(key, dev["code_mean"], dev["code_rotation"], c.code_bits,
                                                       fine_bits)
        else:
            codes, rms, fine, fine_rms = self._coded_rows(memory, key, fine_bits)
        dev["codes"].append(codes)
        dev["code_rms"].append(rms)
        if fine_bits:
            memory.host_tier["fine_codes"].append(fine)
            memory.host_tier["fine_rms"].append(fine_rms)
        if self.config.summary_row:
            append_tail(memory, key, value, prefix=TAIL)

    def _coded_rows(self, memory, key: torch.Tensor, fine_bits: int) -> tuple:
        """New rows ``key`` coded by torch ops (by the encode kernel on a GPU): the index's codes and RMS, and
        with ``fine_bits`` the second stage's finer codes of the rotated key (else None, None)."""
        dev = memory.device_tier
        centred = key.float() - dev["code_mean"]
        if "hash_key" in dev:  # the trained hash's codes
            codes, rms = encode_layout(torch.matmul(centred, dev["hash_key"].float()), memory.meta["hash_layout"])
            rotated = torch.matmul(centred, dev["code_rotation"]) if fine_bits else None
        else:
            rotated = torch.matmul(centred, dev["code_rotation"])
            codes, rms = encode(rotated, self.config.code_bits)
        fine, fine_rms = encode(rotated, fine_bits) if fine_bits else (None, None)
        return codes, rms, fine, fine_rms

    def extend(self, memory, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.append(memory, keys, values)  # one code per row, all at once: the same as one by one

    def _candidates(self, budget: int) -> int:
        return math.ceil(self.config.candidates * (budget - self.config.summary_row))

    def rotated_query(self, memory, query: torch.Tensor) -> torch.Tensor:
        """``[b, h, g·q, d]``: the query in the codes' rotated coordinates, weighted by the trained gains."""
        dev = memory.device_tier
        h = dev["code_mean"].shape[1]
        q = group_query(query, h).float()
        rotated = torch.matmul(q, dev["code_rotation"])
        gains = dev.get("code_gains")  # the trained adapter's (none: every weight 1)
        return rotated if gains is None else rotated * gains[None, :, None]

    def router_scores(self, memory, query: torch.Tensor, width: int | None = None) -> torch.Tensor:
        """``[b, h, g·q, n]``: each query head's estimated logit of every row, from the device codes alone
        (``width``: of the codes buffers' first ``width`` allocated rows, filled or not: a step of fixed shapes)."""
        dev = memory.device_tier
        h = dev["code_mean"].shape[1]
        qr = self.rotated_query(memory, query)
        codes, rms = ((buf.view() if width is None else buf.data[:, :, :width]) for buf in (dev["codes"], dev["code_rms"]))
        if "hash_query" in dev:  # the trained hash: the query's weights on the key's codes
            hashed = torch.matmul(group_query(query, h).float(), dev["hash_query"].float())
            scores = score_layout(hashed, codes, rms, memory.meta["hash_layout"])
        else:
            scores = score_codes(qr, codes, rms, self.config.code_bits)
        if "anchor_pos" in dev:
            pos = dev["anchor_pos"]  # [b, A], -1 where a row has fewer anchors
            fine = score_codes(qr, dev["anchor_codes"], dev["anchor_rms"], self.config.anchor_bits)
            at = pos.clamp_min(0)[:, None, None, :].expand(-1, h, qr.shape[2], -1)
            fine = torch.where(pos[:, None, None, :] >= 0, fine, scores.gather(-1, at))
            scores = scores.scatter(-1, at, fine)
        return scores * memory.meta["scaling"]

    def _rescore(self, memory, query: torch.Tensor, cand: torch.Tensor, first: torch.Tensor, k: int) -> torch.Tensor:
        """Stage two: the candidates' finer codes, copied from the host tier, pick the ``k`` rows recalled
        (rows the first stage forced, sinks and recent ones, stay forced; padding stays out)."""
        dev, host = memory.device_tier, memory.host_tier
        m = cand.shape[-1]
        codes, rms = dev["cand_codes"][:, :, :m], dev["cand_rms"][:, :, :m]
        dest = None
        if misses_only(memory):  # the candidates' codes held from the last step stay: only the others are read
            dest, fetch, _ = swaps(memory, "cand", cand)
            host["fine_codes"].gather_to_slots(cand, dest, fetch, codes)
            host["fine_rms"].gather_to_slots(cand, dest, fetch, rms)
        else:
            dev.pop("cand_held", None)  # the slots are about to hold other rows
            host["fine_codes"].gather(cand, out=codes)  # on a GPU read from pinned memory by a kernel: no host wait
            host["fine_rms"].gather(cand, out=rms)
        scaling, bits = memory.meta["scaling"], self.config.rescore_bits
        vote = summed_over_queries(lambda q: torch.softmax(
            score_codes(self.rotated_query(memory, q), codes, rms, bits) * scaling, -1).sum(2), query, m)
        if dest is not None:  # slot order back to the candidates' order
            vote = vote.gather(-1, dest)
        vote = torch.where(torch.isinf(first), first, vote)
        return cand.gather(-1, vote.topk(k, dim=-1).indices)

    def _pick(self, memory, query: torch.Tensor, n: int, m: int, k: int, width: int | None = None) -> torch.Tensor:
        """``[b, h, k]``: the rows this step recalls, in sequence order. The group's summed softmax over the
        codes' logits ranks every row (sinks and recent rows forced in, padding out); the best ``m`` go to
        the rescoring when ``m > k``. ``width``: a step of fixed shapes (``_fixed_rows``) over that many allocated
        rows, those past the row count on the device masked out."""
        h = memory.device_tier["code_mean"].shape[1]
        valid = self._valid(memory, width)
        c = self.config
        if width is not None:
            count = memory.device_tier["codes"].length_tensor()
            pos = torch.arange(width, device=count.device)
            live = pos < count
            valid = live[None, None] if valid is None else valid & live

        def mass(q: torch.Tensor) -> torch.Tensor:  # [b, h, n]: the group's mass on each row
            logits = self.router_scores(memory, q, width)
            if valid is not None:
                logits = logits.masked_fill(~valid[:, :, None, :], float("-inf"))
            return torch.softmax(logits, -1).sum(2)

        vote = summed_over_queries(mass, query, n if width is None else width)
        if c.sinks:
            sinks = memory.device_tier["sink_pos"][:, None, :].expand(-1, h, -1)
            vote = vote.scatter(-1, sinks, float("inf"))
        if c.recent and width is None:
            vote[..., max(0, n - c.recent):] = float("inf")
        elif c.recent:
            vote = vote.masked_fill(live & (pos >= count - c.recent), float("inf"))
        if valid is not None:
            vote = vote.masked_fill(~valid, float("-inf"))
        if width is None:
            idx = vote.topk(m, dim=-1).indices
        else:  # padding ranks above the unfilled rows (a sequence with fewer real rows than m takes padding)
            idx = vote.clamp_min(torch.finfo(vote.dtype).min).masked_fill(~live, float("-inf")).topk(m, dim=-1).indices
        if m > k and c.rescore_from == "host":
            first = vote.gather(-1, idx)
            idx = self._rescore_host(memory, query, idx, torch.isinf(first) & (first > 0), k, width)
        elif m > k:
            idx = self._rescore(memory, query, idx, vote.gather(-1, idx), k)
        return idx.sort(dim=-1).values  # sequence order

    @staticmethod
    def _valid(memory, width: int | None) -> torch.Tensor | None:
        """``host_valid``, or of the first ``width`` allocated rows in a step of fixed shapes."""
        if width is None or "valid" not in memory.device_tier:
            return host_valid(memory)
        return memory.device_tier["valid"].data[:, :, :width, 0]

    def _rescore_host(self, memory, query: torch.Tensor, cand: torch.Tensor, forced: torch.Tensor,
                      k: int, width: int | None = None) -> torch.Tensor:
        """Stage two from the host tier's own keys (``rescore_from='host'``): the candidates decoded as stored
        and scored exactly against the group's queries (the teacher's own logits, as far as the host tier holds
        them); the ``k`` best by the group's summed softmax, forced rows (``forced``) kept, padding out."""
        dev = memory.device_tier
        h, m = dev["code_mean"].shape[1], cand.shape[-1]
        dest = None
        if misses_only(memory):
            # The candidates' keys stay on the device from step to step (m_max rows a KV head, counted there):
            # consecutive steps share most candidates, and each one read crosses PCIe (4x the recall's rows).
            fresh = "cand_keys" not in dev or dev["cand_keys"].shape[2] < m
            if fresh:
                dev["cand_keys"] = memory.device_buffer(max(m, self._stage_one(memory.meta["budget"])), memory.key_dim)
            keys = dev["cand_keys"][:, :, :m]
            dest, fetch, _ = swaps(memory, "cand", cand, fresh=fresh)
            memory.host_tier["keys"].gather_to_slots(cand, dest, fetch, keys)
        else:
            dev.pop("cand_held", None)
            keys = memory.host_tier["keys"].gather(cand).to(query.device)  # on a GPU: read there from pinned memory
        keys_t, scaling = keys.float().transpose(-1, -2), memory.meta["scaling"]
        vote = summed_over_queries(lambda q: torch.softmax(
            torch.matmul(group_query(q, h).float(), keys_t) * scaling, -1).sum(2), query, m)
        if dest is not None:  # slot order back to the candidates' order
            vote = vote.gather(-1, dest)
        valid = self._valid(memory, width)
        if valid is not None:
            vote = vote.masked_fill(~valid.expand(-1, h, -1).gather(-1, cand), float("-inf"))
        vote = vote.masked_fill(forced, float("inf"))
        return cand.gather(-1, vote.topk(k, dim=-1).indices)

    def _forced(self, memory, cand: torch.Tensor, n: int) -> torch.Tensor:
        """``[b, h, m]``: which candidates the first stage forced in (sinks and the newest rows)."""
        forced = cand >= n - self.config.recent if self.config.recent else torch.zeros_like(cand, dtype=torch.bool)
        if self.config.sinks:
            sinks = memory.device_tier["sink_pos"][:, None, None, :]
            forced = forced | (cand[..., None] == sinks).any(-1)
        return forced

    def _stage_one(self, budget: int) -> int:
        """The rows stage one keeps at most: the candidates a second stage rescores, or the budget's rows."""
        c = self.config
        two_stages = c.rescore_bits or c.rescore_from == "host"
        return self._candidates(budget) if two_stages else budget - c.summary_row

    def _native_layer(self, memory) -> native.NativeLayer:
        """This layer's compiled step (``native.NativeLayer``), laid out once after the prefill."""
        plan = memory.meta.get(NATIVE)
        if plan is None:
            dev, c = memory.device_tier, self.config
            budget = memory.meta["budget"]
            plan = memory.meta[NATIVE] = native.NativeLayer(
                memory, code_bits=c.code_bits, anchor_bits=c.anchor_bits, recent=c.recent, k=budget - c.summary_row,
                m_max=self._stage_one(budget), fine_bits=c.rescore_bits if c.rescore_from == "codes" else 0, rescore_host=c.rescore_from == "host",
                gains=dev.get("code_gains"), offset=dev.get("summary_bias"),
                summary_prefix=TAIL if c.summary_row else None)
            plan.appends &= not memory.meta["low_rank"]  # rank-gated host rows are projected in torch first
            if plan.recall:
                memory.meta["summary_slot"] = True
        return plan

    def _fixed_rows(self, memory, query: torch.Tensor, coming: int = 0) -> int | None:
        """The allocated rows a step of fixed shapes scores, where steps are captured in CUDA graphs on the query's
        device (``graphs.capturable``) and this layer's can be: the torch path, host rows stored as they are or
        coded row by row, more rows than stage one keeps (``coming``: rows this step appends still). None
        elsewhere: the step scores the filled rows."""
        dev, budget = memory.device_tier, memory.meta.get("budget")
        if budget is None or "codes" not in dev or not graphs.capturable(query) or native.usable(query) \
                or memory.meta["low_rank"] or memory.meta.get("exact_anchors") \
                or not all(buf.writes_at for buf in self._appended_buffers(memory)):
            return None
        n = host_length(memory) + coming
        if n <= budget - self.config.summary_row or n < self._stage_one(budget):
            return None
        return min(buf.capacity for name, buf in dev.items() if name in ("codes", "code_rms", "valid"))

    def graph_key(self, memory, query: torch.Tensor) -> tuple | None:
        width = self._fixed_rows(memory, query, coming=query.shape[2])
        return None if width is None else (width, memory.meta["budget"], misses_only(memory))

    @staticmethod
    def _appended_buffers(memory) -> list:
        """Every buffer a decode step appends a row to, the codes' first (their ``length_tensor`` is the count)."""
        dev, host = memory.device_tier, memory.host_tier
        names = [(dev, "codes"), (dev, "code_rms"), (dev, "valid"), (host, "keys"), (host, "values"),
                 (host, "fine_codes"), (host, "fine_rms")]
        return [tier[name] for tier, name in names if name in tier]

    def prepare_step(self, memory, rows: int) -> None:
        for buf in self._appended_buffers(memory):
            buf.reserve(rows)

    @torch.no_grad()
    def append_on_device(self, memory, key: torch.Tensor, value: torch.Tensor) -> None:
        """``append`` at the position the codes' ``length_tensor`` holds: the step's rows coded and written into
        every buffer there, the summary row's sums taken, the count advanced; all on the device."""
        dev, host, c = memory.device_tier, memory.host_tier, self.config
        at = dev["codes"].length_tensor()
        fine_bits = c.rescore_bits if c.rescore_from == "codes" else 0
        codes, rms, fine, fine_rms = self._coded_rows(memory, key, fine_bits)
        written = {"codes": codes, "code_rms": rms, "keys": key, "values": value}
        if fine_bits:
            written["fine_codes"], written["fine_rms"] = fine, fine_rms
        if "valid" in dev:
            written["valid"] = torch.ones(key.shape[0], 1, key.shape[2], 1, dtype=torch.bool, device=key.device)
        for tier in (dev, host):
            for name, rows in written.items():
                if name in tier:
                    tier[name].write_at(rows, at)
        if c.summary_row:
            append_tail(memory, key, value, prefix=TAIL)
        at.add_(key.shape[2])

    def appended(self, memory, rows: int) -> None:
        for buf in self._appended_buffers(memory):
            buf.note_written(rows, from_gpu=True)

    def select_rows(self, memory, query: torch.Tensor) -> Selection:
        n = host_length(memory)
        k = memory.meta["budget"] - self.config.summary_row  # the summary row is the budget's last row
        idx = None
        width = self._fixed_rows(memory, query)
        if n > k:
            # one compiled call on CPU tensors (native/select.cpp), the recall in it; the torch path elsewhere
            if native.usable(query):
                plan = self._native_layer(memory)
                idx = plan.step(query)
                if plan.recall:
                    return Selection(*plan.selected, plan.bias)
                if plan.split:  # stage two from a host tier the kernel cannot read
                    idx = self._rescore_host(memory, query, idx, self._forced(memory, idx, n), k).sort(dim=-1).values
            else:
                idx = self._pick(memory, query, n, min(n, self._stage_one(memory.meta["budget"])), k, width)
        valid = self._valid(memory, width)
        h = memory.device_tier["code_mean"].shape[1]
        rk, rv, idx = self._recall(memory, idx)
        sel = Selection(rk, rv, padding_bias(valid, idx, h, query.dtype, query.device))
        if not self.config.summary_row:
            return sel
        offset = memory.device_tier.get("summary_bias")
        with phase("recall"):  # the summary row joins the recalled rows (the compiled recall writes both at once)
            return with_tail(memory, sel, prefix=TAIL, offset=offset)
