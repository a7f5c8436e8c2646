"""The differentiable student: sekv's decode step at one query position, relaxed so every trainable part
gets a gradient, and the losses against the teacher.

The span layout is cut by the very functions inference uses (``segment_row``, ``build_spans``) on the
causal prefix only, so the student at position t never sees a span built from tokens after t. The forward
pass is inference's decode step (greedy zoom within the zoom rows, hard rank gates); the backward pass
goes through straight-through sigmoid relaxations: a span's summary is weighted by ``1 - z`` and its
reconstructed rows by ``z`` in one softmax, rank components by their gate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from zoomkv.adapters.sekv import SeKVAdapter
from zoomkv.methods._sekv_layout import build_spans, reconstruct, segment_row
from zoomkv.methods.sekv import SeKVConfig, greedy_zoom, plan_budget, stored_rank


@dataclass
class Losses:
    kl: torch.Tensor
    out: torch.Tensor
    zoom: torch.Tensor
    route: torch.Tensor
    anchor: torch.Tensor
    budget: torch.Tensor

    def as_dict(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.__dict__.items()}


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

