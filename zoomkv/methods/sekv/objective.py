"""sekv's training: its recipe keys, its modules' start, and the objective against the teacher.

The differentiable student: sekv's decode step at one query position, relaxed so every trainable part
gets a gradient, and the losses against the teacher.

The span layout is cut by the very functions inference uses (``segment_row``, ``build_spans``) on the
causal prefix only, so the student at position t never sees a span built from tokens after t. The forward
pass is inference's decode step (greedy zoom within the zoom rows, hard rank gates); the backward pass
goes through straight-through sigmoid relaxations: a span's summary is weighted by ``1 - z`` and its
reconstructed rows by ``z`` in one softmax, rank components by their gate.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F

from zoomkv.methods.sekv.layout import build_spans, reconstruct, segment_row
from zoomkv.methods.sekv.method import SeKV, SeKVConfig, greedy_zoom, plan_budget, stored_rank
from zoomkv.methods.sekv.modules import SeKVAdapter, build_sekv_modules
from zoomkv.protocol.shape import ModelShape
from zoomkv.protocol.training import MethodTraining, RecipeOptions, Sample, finite_at_least


@dataclass
class Losses:
    kl: torch.Tensor
    out: torch.Tensor
    zoom: torch.Tensor
    route: torch.Tensor
    anchor: torch.Tensor
    budget: torch.Tensor


def position_losses(adapter: SeKVAdapter, layer: int, keys: torch.Tensor, values: torch.Tensor, query: torch.Tensor,
                    teacher: torch.Tensor, surprisal: torch.Tensor, t: int, scaling: float, budget: int,
                    cfg: SeKVConfig, rho: float) -> Losses | None:
    """Losses at query position ``t`` of one layer. ``keys``/``values`` ``[h, T, d]`` (float32), ``query``
    ``[hq, d]``, ``teacher`` ``[hq, T]`` attention probabilities; None when the prefix fits the budget
    (then sekv keeps everything exact and there is nothing to learn)."""
    n = t + 1
    if n <= budget:
        return None
    h, _, d = keys.shape
    g = query.shape[0] // h
    zoom_rows, room = plan_budget(budget, cfg)
    s = surprisal[:n]
    with torch.no_grad():  # the layout is discrete: cut it (with the current threshold) as inference would
        lay = segment_row(s, 0, n - cfg.recent, float(adapter.span_tau[layer]), sinks=cfg.sinks,
                          min_span=cfg.min_span, max_span=cfg.max_span, room=room)
        if not lay.spans:
            return None
        sp = build_spans(keys[None, :, :n], values[None, :, :n], s[None], [lay.spans], stored_rank(adapter, cfg))
    exact = torch.tensor(lay.exact + list(range(n - cfg.recent, n)), dtype=torch.long)
    count = sp.count[0]  # [S]
    log_n = count.log()
    q = query.view(h, g, d)
    ke, ve = keys[:, exact], values[:, exact]
    sum_k, sum_v = sp.sum_keys[0], sp.sum_values[0]
    exact_logits = torch.matmul(q, ke.transpose(-1, -2)) * scaling  # [h, g, E]
    sum_logits = torch.matmul(q, sum_k.transpose(-1, -2)) * scaling + log_n  # [h, g, S]
    lse = torch.logsumexp(torch.cat([exact_logits, sum_logits], -1), -1, keepdim=True).detach()
    routed = adapter.router_scores(layer, q, sum_k) * scaling + log_n
    route = (routed - lse).amax(1) - adapter.route_tau[layer][:, None]  # [h, S]
    # Straight-through: the forward pass takes inference's hard choices (greedy zoom within the zoom rows,
    # rank components with logit > 0), the backward pass their sigmoid relaxations.
    z_soft = torch.sigmoid(route)
    z = greedy_zoom(route.detach(), count.expand(h, -1), zoom_rows).float() + z_soft - z_soft.detach()
    gate_logits = adapter.rank_gate[layer][..., : sp.coef_k.shape[-1]]  # [h, 2, r]: ranks a span can have
    g_soft = torch.sigmoid(gate_logits)
    gates = (gate_logits > 0).float() + g_soft - g_soft.detach()
    rec_k = reconstruct(sp.coef_k[0], sp.basis_k[0], gates[:, None, 0])  # [h, S, P, d]
    rec_v = reconstruct(sp.coef_v[0], sp.basis_v[0], gates[:, None, 1])
    size = rec_k.shape[2]
    live = torch.arange(size)[None, :] < count[:, None]  # [S, P]
    rec_logits = torch.einsum("hgd,hspd->hgsp", q, rec_k) * scaling
    rec_logits = rec_logits.masked_fill(~live[None, None], float("-inf"))
    # One softmax, with a span's summary weighted by (1 - z) and its rows by z: in probability space (not as
    # log-biases) so that z = 0 or 1 still passes a gradient.
    top = torch.cat([exact_logits, sum_logits, rec_logits.flatten(-2)], -1).amax(-1, keepdim=True).detach()
    w_exact = torch.exp(exact_logits - top)
    w_sum = torch.exp(sum_logits - top) * (1 - z)[:, None]
    w_rec = torch.exp(rec_logits - top[..., None]) * z[:, None, :, None]
    total = w_exact.sum(-1, keepdim=True) + w_sum.sum(-1, keepdim=True) + w_rec.sum((-1, -2))[..., None]
    p_exact, p_sum, p_rec = w_exact / total, w_sum / total, w_rec / total[..., None]
    n_spans = sum_k.shape[1]
    out = (torch.matmul(p_exact, ve) + torch.matmul(p_sum, sum_v) + torch.einsum("hgsp,hspd->hgd", p_rec, rec_v))
    # Teacher, in the same units: each exact row, and each span's total mass.
    a = teacher[:, :n].view(h, g, n)
    span_id = torch.full((n,), -1, dtype=torch.long)
    for j, (lo, hi) in enumerate(lay.spans):
        span_id[lo:hi] = j
    in_span = span_id >= 0
    t_span = torch.zeros(h, g, n_spans).index_add_(2, span_id[in_span], a[..., in_span])
    t_units = torch.cat([a[..., exact], t_span], -1)
    s_units = torch.cat([p_exact, p_sum + p_rec.sum(-1)], -1)
    kl = (t_units * (t_units.clamp_min(1e-9).log() - s_units.clamp_min(1e-9).log())).sum(-1).mean()
    t_out = torch.matmul(a, values[:, :n])
    out_loss = ((out - t_out) ** 2).sum(-1).div(t_out.pow(2).sum(-1) + 1e-6).mean()
    # Zoom supervision: per KV head, the fewest spans covering rho of the teacher's span mass.
    mass = t_span.sum(1)  # [h, S]
    order = mass.argsort(-1, descending=True)
    sorted_mass = torch.gather(mass, -1, order)
    cum = sorted_mass.cumsum(-1) / sorted_mass.sum(-1, keepdim=True).clamp_min(1e-9)
    need = torch.cat([torch.ones(h, 1, dtype=torch.bool), cum[:, :-1] < rho], -1)
    target = torch.zeros_like(mass).scatter(-1, order, need.float())
    pos = target.sum().clamp_min(1)
    weight = torch.where(target > 0, (target.numel() - pos) / pos, torch.ones_like(target))
    zoom = F.binary_cross_entropy_with_logits(route, target, weight=weight)
    # The router's ranking (what the greedy zoom consumes within the buffer): per query head, the router's
    # softmax over spans against the teacher's distribution of span mass (listwise cross-entropy), weighted
    # by how much of that head's attention lies in spans at all.
    span_total = t_span.sum(-1, keepdim=True)  # [h, g, 1]
    t_dist = t_span / span_total.clamp_min(1e-9)
    ce = -(t_dist * torch.log_softmax(routed, -1)).sum(-1)  # [h, g]
    route_loss = (ce * span_total[..., 0]).sum() / span_total.sum().clamp_min(1e-9)
    # The anchor threshold (discrete above) learns from a surrogate: tokens receiving the teacher's top 2%
    # of attention inside the compressible region should sit above mean + tau * std.
    region = slice(cfg.sinks, n - cfg.recent)
    received = a.mean((0, 1))[region]
    zs = (s - s.mean()) / s.std(unbiased=False).clamp_min(1e-6)
    label = (received >= torch.quantile(received, 0.98)).float()
    anchor = F.binary_cross_entropy_with_logits((zs[region] - adapter.span_tau[layer]) * 2.0, label)
    expected_rows = (z_soft * count).sum(-1)
    budget_pen = F.relu(expected_rows - zoom_rows).div(max(zoom_rows, 1)).mean()
    return Losses(kl, out_loss, zoom, route_loss, anchor, budget_pen)


def rank_regulariser(adapter: SeKVAdapter) -> torch.Tensor:
    """Keep only the rank components the losses ask for: later components cost more."""
    r = adapter.r_max
    cost = torch.arange(1, r + 1, dtype=torch.float32) / r
    return (torch.sigmoid(adapter.rank_gate) * cost).mean()


def ramp(step: int, ramp_steps: int) -> float:
    return 1.0 if ramp_steps <= 0 else min(1.0, step / ramp_steps)



@dataclass
class SeKVRecipe(RecipeOptions):
    """sekv's own recipe keys (the generic ones, budget and recent among them, are the trainer's)."""

    proj_dim: int | str = "auto"  # semantic projector width; "auto" sizes it under max_trainable_fraction
    share_projector: bool | str = "auto"
    r_max: int = 32
    # sekv's inference hyper-parameters, used to cut spans exactly as inference does (recent: the trainer's)
    sinks: int = 4
    chunk: int = 8
    min_span: int = 4
    max_span: int = 8
    anchor_fraction: float = 0.1
    proj_lr: float = 0.001  # the semantic projector: it rescales logits, so it moves much more gently
    rho: float = 0.9  # zoom supervision: the smallest span set covering rho of the teacher's span mass
    w_kl: float = 1.0
    w_out: float = 1.0
    w_zoom: float = 0.5
    w_route: float = 0.5  # listwise: the router's ranking of spans vs the teacher's span mass
    w_anchor: float = 0.1
    w_rank: float = 0.01
    w_budget: float = 0.1
    budget_ramp_steps: int = 50

    choices = {"proj_dim": ("auto",), "share_projector": ("auto",)}

    def __post_init__(self) -> None:
        self.require("proj_dim", self.proj_dim == "auto" or self.proj_dim >= 1, '>= 1 or "auto"')
        for key, low in (("r_max", 1), ("sinks", 0), ("chunk", 1), ("min_span", 1), ("budget_ramp_steps", 0)):
            self.require(key, getattr(self, key) >= low, f">= {low}")
        self.require("max_span", self.max_span >= self.min_span, f">= min_span ({self.min_span})")
        self.require("anchor_fraction", 0 <= self.anchor_fraction <= 1, "in [0, 1]")
        self.require("rho", 0 < self.rho <= 1, "in (0, 1]")
        for key in ("proj_lr", "w_kl", "w_out", "w_zoom", "w_route", "w_anchor", "w_rank", "w_budget"):
            self.require(key, finite_at_least(getattr(self, key), 0), "a finite number >= 0")


_METHOD_KEYS = tuple(f.name for f in fields(SeKVConfig))


class SeKVTraining(MethodTraining):
    recipe_class = SeKVRecipe
    size_hint = "lower proj_dim/r_max, set share_projector=true"
    module_keys = ("num_layers", "kv_heads", "head_dim", "proj_dim", "share_projector", "r_max", "init_seed",
                   "max_trainable_fraction")

    def build_modules(self, shape: ModelShape, hyper: dict[str, Any]) -> SeKVAdapter:
        return build_sekv_modules(shape, hyper)

    def init_modules(self, recipe: Any, shape: ModelShape) -> SeKVAdapter:
        o = recipe.options
        return build_sekv_modules(shape, {"proj_dim": o.proj_dim, "share_projector": o.share_projector,
                                          "r_max": o.r_max, "max_trainable_fraction": recipe.max_trainable_fraction,
                                          "init_seed": recipe.seed})

    def method_config(self, recipe: Any) -> SeKVConfig:
        return SeKVConfig(**self._method_kwargs(recipe))

    def _method_kwargs(self, recipe: Any) -> dict[str, Any]:
        o = recipe.options
        return {k: recipe.recent if k == "recent" else getattr(o, k) for k in _METHOD_KEYS}

    def hyper(self, modules: SeKVAdapter, recipe: Any) -> dict[str, Any]:
        return {**self._method_kwargs(recipe), **modules.hyper(), "init_seed": recipe.seed}

    def param_groups(self, modules: SeKVAdapter, recipe: Any) -> list[dict[str, Any]]:
        projector = [p for n, p in modules.named_parameters() if n.startswith("proj_")]
        others = [p for n, p in modules.named_parameters() if not n.startswith("proj_")]
        return [{"params": others, "lr": recipe.lr}, {"params": projector, "lr": recipe.options.proj_lr}]

    def step_loss(self, modules: SeKVAdapter, sample: Sample, layers: list[int], recipe: Any, step: int,
                  rng: random.Random) -> tuple[torch.Tensor, dict[str, float]]:
        o, mcfg = recipe.options, self.method_config(recipe)
        all_layers = sample["layers"].tolist()
        scaling = float(sample["scaling"])
        parts: dict[str, list[torch.Tensor]] = {k: [] for k in ("kl", "out", "zoom", "route", "anchor", "budget")}
        for layer in layers:
            pos_in_adapter = all_layers.index(layer)
            keys, values = sample[f"k.{layer}"].float(), sample[f"v.{layer}"].float()
            for p, t in enumerate(sample["positions"].tolist()):
                losses = position_losses(modules, pos_in_adapter, keys, values, sample[f"q.{layer}"][:, p],
                                         sample[f"attn.{layer}"][:, p].float(), sample["surprisal"], t, scaling,
                                         recipe.budget, mcfg, o.rho)
                if losses is not None:
                    for k in parts:
                        parts[k].append(getattr(losses, k))
        if not parts["kl"]:
            zero = sum(p.sum() * 0 for p in modules.parameters())
            return zero, {}
        mean = {k: torch.stack(v).mean() for k, v in parts.items()}
        rank = rank_regulariser(modules)
        loss = (o.w_kl * mean["kl"] + o.w_out * mean["out"] + o.w_zoom * mean["zoom"] + o.w_route * mean["route"]
                + o.w_anchor * mean["anchor"] + o.w_rank * rank
                + o.w_budget * ramp(step, o.budget_ramp_steps) * mean["budget"])
        logs = {k: v.item() for k, v in mean.items()} | {"rank": rank.item(), "loss": loss.item()}
        return loss, logs

    def make_method(self, modules: SeKVAdapter | None, recipe: Any) -> SeKV:
        return SeKV(adapter=modules, **self._method_kwargs(recipe))
