"""sekv's training: its recipe keys, and the objective of its modules against the full-KV teacher.

At a cached query position ``t`` of one layer the student is inference's router on the causal prefix
(``t + 1`` rows): the prefix's keys coded exactly as inference codes them (its mean, the layer's rotation,
``code_bits``, anchors at ``anchor_bits``), scored against the query through the trained gains. Three
losses, each for one module:

- **ranking** (the semantic projector's gains): per query head, the cross-entropy of the router's softmax
  over the rows it chooses among (not the sinks and recent rows, always attended) against the teacher's
  attention over the same rows, weighted by the teacher mass there. The selection recalls the rows with
  the most estimated mass, so a router whose softmax matches the teacher's recalls the teacher's rows;
- **anchors** (the entropy thresholds τ): which rows get the finer code is a hard choice at inference;
  here its forward pass is that choice and its backward pass the sigmoid ``σ(4(z - τ))`` of each row's
  surprisal z-score, so the ranking loss tells τ where finer codes pay, against ``w_anchor`` times the
  share of rows made anchors (what they cost in device bytes);
- **layer split** (``layer_logit``): each layer's budget ``B·share_l`` is continuous here; the teacher
  mass the layer's selection would capture at that many rows (the router's order, linearly interpolated)
  enters as ``-log(mass)``, so rows move to the layers that lose most without them (the total stays L·B);
- **output** (the summary row's bias, the rank gates): the selection inference makes (the router's best
  rows at the layer's budget), as the host tier gives them back under the rank gates (the rows in the kept
  principal directions; straight-through), attended beside the summary row, whose logit carries
  ``log(count) + bias``; the relative squared error of that output against the teacher's attention output;
- **rank budget**: ``w_host`` times how far the share of principal directions kept exceeds
  ``host_rank_target`` (1: no cut), so the gates choose which directions of which layer go.

With ``hash_bits`` the rows that are not anchors are scored from the trained hash instead (``hash_query``
against the signs of ``hash_key``'s projections); the ranking loss reaches both projections straight through the
signs (the forward pass keeps the codes inference keeps).
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from zoomkv.memory.quant import FORMATS_HELP, is_format
from zoomkv.methods.sekv.codes import BITS, decode, decode_layout, encode, encode_layout, rotation
from zoomkv.methods.sekv.hashing import fit_layout, moments
from zoomkv.methods.sekv.host import truncated
from zoomkv.methods.sekv.host_bits import fit_host_bits
from zoomkv.methods.sekv.method import HOST_KEY_BASES, RESCORE_SOURCES, SeKV, SeKVConfig
from zoomkv.methods.sekv.modules import MAX_SEED, SeKVAdapter, build_sekv_modules
from zoomkv.protocol import rotary
from zoomkv.protocol.method import check_hyperparameters
from zoomkv.protocol.shape import ModelShape
from zoomkv.protocol.training import MethodTraining, RecipeOptions, Sample, finite_at_least

ANCHOR_SHARPNESS = 4.0
HASH_INITS = ("fit", "rotation")
log = logging.getLogger(__name__)


@dataclass
class Student:
    """The router's view of one prefix at one layer: decoded row estimates and which rows are anchors."""

    coarse: torch.Tensor  # [h, n, d] decoded base codes (rotated, centred)
    fine: torch.Tensor  # [h, n, d] decoded anchor codes
    anchor: torch.Tensor  # [n] 0/1 in the forward pass, the sigmoid's gradient in the backward pass
    soft_anchor: torch.Tensor  # [n] the sigmoid itself
    rescored: torch.Tensor | None  # [h, n, d] decoded host-tier codes of the second stage (None: one stage)
    # [h, n, m] the trained hash's decoded codes (forward), the projections themselves (backward); None: no hash
    hashed: torch.Tensor | None = None


def prefix_student(adapter: SeKVAdapter, layer: int, keys: torch.Tensor, surprisal: torch.Tensor, n: int,
                   cfg: SeKVConfig) -> Student:
    h, _, d = keys.shape
    k = keys[:, :n].float()
    rot = rotation(d, adapter.rotation_seed_of(layer), k.device)
    centred = k - k.mean(1, keepdim=True)
    x = torch.matmul(centred, rot)
    with torch.no_grad():
        coarse = decode(*encode(x, cfg.code_bits), cfg.code_bits)
        fine = decode(*encode(x, cfg.anchor_bits), cfg.anchor_bits)
        rescored = None
        # rescore_from="host" rescores with the keys themselves at inference; training keeps the finer codes'
        # estimate of that stage (they pick nearly the same rows), so the setting changes no trained weight
        if cfg.rescore_bits:
            rescored = fine if cfg.rescore_bits == cfg.anchor_bits else decode(*encode(x, cfg.rescore_bits),
                                                                               cfg.rescore_bits)
    s = surprisal[:n].float()
    z = (s - s.mean()) / s.std(unbiased=False).clamp_min(1e-6)
    tau = adapter.span_tau[layer]
    soft = torch.sigmoid(ANCHOR_SHARPNESS * (z - tau))
    region = torch.zeros(n, dtype=torch.bool, device=k.device)
    region[cfg.sinks: max(cfg.sinks, n - cfg.recent)] = True
    with torch.no_grad():  # inference's choice: above the threshold, in the region, the most surprising first
        above = region & (z > tau.detach())
        most = int(cfg.anchor_fraction * n)
        hard = torch.zeros(n, device=k.device)
        if most > 0:  # the `most` highest, of which those below the threshold (-inf here) are not anchors
            top = z.masked_fill(~above, float("-inf")).topk(most)
            hard.scatter_(0, top.indices, top.values.isfinite().float())
    anchor = hard + (soft - soft.detach()) * region
    hashed = None
    if adapter.hash_bits:
        layout = adapter.hash_layout[layer]
        z = torch.matmul(centred, adapter.hash_projections(layer)[0])  # [h, n, m]: the layer's projections
        with torch.no_grad():
            coded = decode_layout(*encode_layout(z, layout), layout)
        hashed = coded + (z - z.detach())  # straight-through: the quantizer's gradient taken as the identity's
    return Student(coarse, fine, anchor, soft * region, rescored, hashed)


def router_logits(adapter: SeKVAdapter, layer: int, student: Student, query: torch.Tensor,
                  scaling: float, stage: int = 1) -> torch.Tensor:
    """``query`` ``[hq, d]`` → ``[h, g, n]`` estimated logits of every prefix row: from the device codes
    (``stage`` 1) or from the host tier's finer codes (``stage`` 2, the rescoring)."""
    h, n, d = student.coarse.shape
    rot = rotation(d, adapter.rotation_seed_of(layer), query.device)
    q = torch.matmul(query.float().view(h, -1, d), rot) * adapter.gains(layer)[:, None, :]
    if stage == 2:
        rows = student.rescored
    elif student.hashed is not None:  # anchors from their finer codes, every other row from the trained hash
        a = student.anchor[None, None, :]
        hashed_q = torch.matmul(query.float().view(h, -1, d), adapter.hash_projections(layer)[1])  # [h, g, m]
        base = torch.matmul(hashed_q, student.hashed.transpose(-1, -2))
        return (a * torch.matmul(q, student.fine.transpose(-1, -2)) + (1 - a) * base) * scaling
    else:
        a = student.anchor[None, :, None]
        rows = a * student.fine + (1 - a) * student.coarse  # [h, n, d]
    return torch.matmul(q, rows.transpose(-1, -2)) * scaling


def prefix_region(n: int, cfg: SeKVConfig, device: torch.device) -> tuple[torch.Tensor, int]:
    """The rows of an ``n``-row prefix the router chooses among (after the sinks, before the recent rows): a mask
    ``[n]`` on ``device`` and its row count, known here without reading the mask back from a GPU."""
    region = torch.zeros(n, dtype=torch.bool, device=device)
    region[cfg.sinks: n - cfg.recent] = True
    return region, len(range(n)[cfg.sinks: n - cfg.recent])


def _count(region: torch.Tensor, inside: int | None) -> int:
    return int(region.sum()) if inside is None else inside


def selection_order(adapter: SeKVAdapter, layer: int, student: Student, query: torch.Tensor, scaling: float,
                    logits: torch.Tensor, region: torch.Tensor, rows: int, cfg: SeKVConfig,
                    inside: int | None = None) -> torch.Tensor:
    """``[h, n]``: an order of the region's rows that puts first what inference recalls for ``rows`` rows:
    the first stage's vote, and with a second stage its candidates first, in the rescored vote's order.
    ``inside``: the region's row count when the caller knows it (read from the device, a GPU would wait)."""
    vote = torch.softmax(logits.detach(), -1).sum(1)
    if student.rescored is None:
        return vote
    always = cfg.sinks + cfg.recent  # inference's candidates include the rows it always attends
    m = min(_count(region, inside), math.ceil(cfg.candidates * (rows + always)) - always)
    if m <= 0:
        return vote
    cand = vote.masked_fill(~region, float("-inf")).topk(m, -1).indices
    fine = torch.softmax(router_logits(adapter, layer, student, query, scaling, stage=2).detach()
                         .masked_fill(~region, float("-inf")), -1).sum(1)
    return vote.scatter(-1, cand, 10.0 + fine.gather(-1, cand))


def captured_mass(teacher: torch.Tensor, order_scores: torch.Tensor, rows: torch.Tensor,
                  region: torch.Tensor, inside: int | None = None) -> torch.Tensor:
    """Teacher mass (``[h, g, n]``, mean over a group's heads) on the always-attended rows plus the best
    ``rows`` (a differentiable scalar) of ``region`` by the vote ``order_scores`` ``[h, n]``."""
    a = teacher.mean(1)  # [h, n]
    fixed = (a * ~region).sum(-1)  # sinks and recent rows
    ranked = order_scores.masked_fill(~region, float("-inf")).argsort(-1, descending=True)
    cum = torch.cat([a.new_zeros(a.shape[0], 1), torch.gather(a, -1, ranked).cumsum(-1)], -1)  # [h, n + 1]
    most = _count(region, inside)
    r = rows.clamp(0, most)
    lo = r.detach().floor().long().clamp(max=most)
    hi = (lo + 1).clamp(max=most)
    frac = r - lo
    got = cum.gather(-1, lo.expand(a.shape[0], 1))[:, 0] * (1 - frac) + cum.gather(-1, hi.expand(a.shape[0], 1))[:, 0] * frac
    return (fixed + got).mean()


def summary_output(adapter: SeKVAdapter, layer: int, keys: torch.Tensor, values: torch.Tensor, query: torch.Tensor,
                   chosen: torch.Tensor, scaling: float, stored: tuple[torch.Tensor, torch.Tensor] | None = None,
                   summary: bool = True) -> torch.Tensor:
    """``[h, g, dv]``: attention over the ``chosen`` rows (``[h, n]`` bool) — as the host tier gives them
    back (``stored``: the rows under the rank budget; None: exact) — and, with ``summary``, one row for the
    rest: the exact totals less the chosen rows, their mean at ``log(count) + summary_bias``, as inference
    computes it."""
    h, n, d = keys.shape
    rk, rv = stored if stored is not None else (keys, values)
    q = query.float().view(h, -1, d)
    logits = torch.matmul(q, rk.transpose(-1, -2)) * scaling  # [h, g, n]
    logits = logits.masked_fill(~chosen[:, None], float("-inf"))
    if not summary:
        return torch.matmul(torch.softmax(logits, -1), rv)
    sel = chosen.float()[..., None]
    count = (~chosen).float().sum(-1)  # [h]
    mean_k = (keys.sum(1) - (sel * rk).sum(1)) / count.clamp_min(1)[:, None]
    mean_v = (values.sum(1) - (sel * rv).sum(1)) / count.clamp_min(1)[:, None]
    tail = torch.matmul(q, mean_k[..., None])[..., 0] * scaling + count.clamp_min(1).log()[:, None]
    tail = tail + adapter.summary_bias[layer][:, None]
    tail = torch.where(count[:, None] > 0, tail, torch.full_like(tail, float("-inf")))
    w = torch.softmax(torch.cat([logits, tail[..., None]], -1), -1)
    return torch.matmul(w[..., :n], rv) + w[..., n:] * mean_v[:, None]


def straight_through(logits: torch.Tensor) -> torch.Tensor:
    """Gates 1/0 forward (a direction kept when its logit > 0, as the host tier keeps it), sigmoid backward."""
    soft = torch.sigmoid(logits)
    return (logits > 0).float() + soft - soft.detach()


def rank_gates(adapter: SeKVAdapter, layer: int) -> torch.Tensor:
    """``[2, d]``: the layer's rank gates (``straight_through``)."""
    return straight_through(adapter.rank_gate[layer])


def kept_share(logits: torch.Tensor) -> torch.Tensor:
    """The share of directions gates ``logits`` keep, hard forward, the sigmoid's gradient backward: the hinge
    sees what the host tier will hold. (Over the soft share it kept pushing while logits sat just below 0, a
    sigmoid of ≈ 0.5 above a 0.4 target with nothing kept. The gates still overshoot their target early in a
    run, as before: Adam's momentum carries them on for steps after the hinge lets go; BENCHMARKS.md.)"""
    return straight_through(logits).mean()


@dataclass
class Losses:
    rank: torch.Tensor
    anchor: torch.Tensor
    split: torch.Tensor
    out: torch.Tensor
    kept: torch.Tensor  # (logged) teacher mass the selection captures at the layer's budget
    recall: torch.Tensor | None = None  # the teacher's top rows the first stage leaves out of the candidates


def candidate_miss(logits: torch.Tensor, teacher: torch.Tensor, region: torch.Tensor, rows: int,
                   candidates: float, inside: int | None = None) -> torch.Tensor:
    """Per query head, the teacher's ``rows`` heaviest rows of ``region``, each weighted by its mass: a softplus of
    how far its estimated logit (``logits`` ``[h, g, n]``) falls below the ``candidates × rows``-th best, the last
    row the exact second stage gets to see. Zero gradient for rows well inside the candidates."""
    inside = _count(region, inside)
    k, m = max(1, min(inside, rows)), max(1, min(inside, math.ceil(candidates * rows)))
    est = logits.masked_fill(~region, float("-inf"))
    threshold = est.topk(m, -1).values[..., -1:].detach()
    top = teacher.masked_fill(~region, -1.0).topk(k, -1)
    weight = top.values.clamp_min(0)
    miss = torch.nn.functional.softplus(threshold - est.gather(-1, top.indices))
    return (weight * miss).sum() / weight.sum().clamp_min(1e-9)


def recalled_rows(adapter: SeKVAdapter, budget: int, cfg: SeKVConfig) -> torch.Tensor:
    """Per adapter layer, the rows the router recalls at the layer's (continuous) budget: its trained share of
    ``budget`` less the summary row, the sinks and the recent rows."""
    return budget * adapter.layer_shares() - 1 - (cfg.sinks + cfg.recent)


def position_losses(adapter: SeKVAdapter, layer: int, keys: torch.Tensor, values: torch.Tensor, query: torch.Tensor,
                    teacher: torch.Tensor, surprisal: torch.Tensor, t: int, scaling: float, budget: int,
                    cfg: SeKVConfig, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                    gate_values: bool = True, with_recall: bool = False, whole: int | None = None) -> Losses | None:
    """Losses at query position ``t`` of adapter layer ``layer``: ``keys``/``values`` ``[h, T, d]``,
    ``query`` ``[hq, d]``, ``teacher`` ``[hq, T]`` attention probabilities, ``rope``: the rows' ``cos, sin``
    ``[T, d]`` (for a host tier that takes keys before RoPE), ``gate_values``: False keeps every value
    direction (the rank budget cuts only the keys), ``whole``: the layer's integer budget as inference recalls
    it, ``round(recalled_rows(...)[layer])`` (read once a step by the caller: a GPU waits for that read; None:
    read here). None when the prefix fits the budget (every row is attended: nothing to learn)."""
    n = t + 1
    always = cfg.sinks + cfg.recent
    if n <= budget - 1 or n <= always + 1:
        return None
    h = keys.shape[0]
    student = prefix_student(adapter, layer, keys, surprisal, n, cfg)
    logits = router_logits(adapter, layer, student, query, scaling)  # [h, g, n]
    g = logits.shape[1]
    a = teacher[:, :n].float().view(h, g, n)
    region, inside = prefix_region(n, cfg, a.device)
    mass = (a * region).sum(-1)  # [h, g]: the teacher's mass where the router chooses
    target = (a * region) / mass[..., None].clamp_min(1e-9)
    def ranking(est: torch.Tensor) -> torch.Tensor:
        logp = torch.log_softmax(est.masked_fill(~region, float("-inf")), -1).masked_fill(~region, 0.0)
        ce = -(target * logp).sum(-1)
        return (ce * mass).sum() / mass.sum().clamp_min(1e-9)

    rank = ranking(logits)
    if student.rescored is not None:  # the gains serve both stages
        rank = (rank + ranking(router_logits(adapter, layer, student, query, scaling, stage=2))) / 2
    anchor = student.soft_anchor.sum() / max(1, inside)
    rows = recalled_rows(adapter, budget, cfg)[layer]
    if whole is None:
        whole = round(float(rows.detach()))
    vote = selection_order(adapter, layer, student, query, scaling, logits, region, max(1, whole), cfg,
                           inside)  # [h, n]
    kept = captured_mass(a, vote, rows, region, inside)
    split = -torch.log(kept.clamp_min(1e-6))
    recall = candidate_miss(logits, a, region, max(1, whole), cfg.candidates, inside) if with_recall else None
    with torch.no_grad():  # inference's selection at the layer's (integer) budget
        k = max(0, min(inside, whole))
        chosen = ~region.expand(h, -1).clone()
        if k:
            top = vote.masked_fill(~region, float("-inf")).topk(k, -1).indices
            chosen.scatter_(-1, top, True)
    kx, v = keys[:, :n].float(), values[:, :n].float()
    gates = rank_gates(adapter, layer)
    exact = None  # the rows the host tier keeps exact: the sinks, the newest rows, the anchors
    if cfg.host_exact_sinks or cfg.host_exact_anchors or cfg.host_exact_late:
        exact = torch.zeros(n, dtype=torch.bool, device=kx.device)
        if cfg.host_exact_sinks:
            exact[:cfg.sinks] = True
        if cfg.host_exact_late:  # what inference holds exact after compression, here the newest rows
            exact[max(0, n - cfg.recent):] = True
        if cfg.host_exact_anchors:
            exact |= student.anchor.detach() > 0.5
    stored = (truncated(kx, gates[0], exact, rope if cfg.host_key_basis == "pre_rope" else None),
              truncated(v, gates[1], exact) if gate_values else v)
    student_out = summary_output(adapter, layer, kx, v, query, chosen, scaling, stored, summary=cfg.summary_row)
    teacher_out = torch.matmul(a, v)
    out = ((student_out - teacher_out).pow(2).sum(-1) / teacher_out.pow(2).sum(-1).clamp_min(1e-6)).mean()
    return Losses(rank, anchor, split, out, kept.detach(), recall)


def sample_rope(sample: Sample, layer: int, length: int, cfg: SeKVConfig) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``cos, sin`` ``[length, d]`` of a cached sample's rows at ``layer`` (positions 0, 1, ...), when the
    host tier takes keys before RoPE; the teacher cache records each layer's rotary table."""
    if cfg.host_key_basis != "pre_rope" or f"rotary_inv_freq.{layer}" not in sample:
        return None
    inv_freq = sample[f"rotary_inv_freq.{layer}"].float()
    return rotary.angles(torch.arange(length, device=inv_freq.device), inv_freq,
                         float(sample[f"rotary_scaling.{layer}"]))


@dataclass
class SeKVRecipe(RecipeOptions):
    """sekv's own recipe keys (the generic ones, budget and recent among them, are the trainer's)."""

    sinks: int = 4
    code_bits: int = 1
    anchor_bits: int = 4
    anchor_fraction: float = 0.05
    summary_row: bool = True
    rescore_bits: int = 4
    candidates: float = 4.0
    rescore_from: str = "codes"  # "host": the second stage scores the host tier's own keys (no finer codes kept)
    host_key_basis: str = "post_rope"  # under a rank budget: "pre_rope" fits the keys' directions before RoPE
    host_exact_sinks: bool = False  # under a rank budget: the sink rows stay exact
    host_exact_anchors: bool = False  # under a rank budget: the anchors (surprising tokens) stay exact
    host_exact_late: bool = False  # under a rank budget: rows after compression stay exact
    rotation_seed: int = 0
    # the index as a trained hash of this many bits a row (0: the rotated key's signs, head_dim bits); its query and
    # key projections (2 x layers x KV heads x head_dim x bits parameters) train at hash_lr
    hash_bits: int = 0
    # the most bits one projection may take (1: every bit a projection's sign; 2 or 4: fewer projections, the
    # strongest at more bits, the layout fitted with them: needs hash_init fit)
    hash_width: int = 1
    hash_lr: float = 0.002
    # where the hash starts: "fit", the projections closest to the query-key product on the teacher cache
    # (hashing.py); "rotation", the layer's first hash_bits rotated coordinates (random hyperplanes)
    hash_init: str = "rotation"
    # the index fitted to each context at the prefill instead, this many bits a row (SeKVConfig.fit_bits; nothing
    # trains for it: the adapter records it, its steps train the rest as they would); 0: not recorded
    fit_bits: int = 0
    gain_lr: float = 0.02  # the projector's log gains scale logits: they move more gently than τ
    # the first stage's recall: the teacher's top rows it leaves out of the candidates the second stage rescores
    # (candidate_miss), for an index that must find the rows rather than rank them all (0: off)
    w_recall: float = 0.0
    w_rank: float = 1.0
    w_anchor: float = 0.05  # device bytes of the anchors' finer codes, per share of rows made anchors
    w_split: float = 0.1
    w_out: float = 1.0  # the summary row's bias and the rank gates: the output against the teacher's
    # the rank budget of the host tier: the share of principal directions the gates may keep (1: no cut)
    host_rank_target: float = 1.0
    # whether the rank budget cuts the values too; false: only the keys' directions are gated (and the target
    # is their share), the values stay full rank — for a host tier whose values are quantized instead
    host_rank_values: bool = True
    w_host: float = 1.0  # weight of the hinge above host_rank_target
    # the rank gates' learning rate: a step moves only its layers' gates (layers_per_step of them), and Adam
    # moves a gate about lr a step, so at the shared lr a gate started at +3 could not reach 0 in a short run
    gate_lr: float = 0.25
    # the host tier's KV format the adapter runs with (zoomkv.memory.quant: int8, int4, kivi4, kivi2, ...; none:
    # full precision), and the share of fp32 full KV its bits per layer are fitted to after the steps
    # (zoomkv.methods.sekv.host_bits; 0: host_format's bits in every layer)
    host_format: str = "none"
    host_budget: float = 0.0
    # the fit's cost adds the attention weights' KL divergence to the output error (false: the output error alone,
    # the first fit of BENCHMARKS.md's "Host formats on the held-out prompts")
    host_fit_kl: bool = True

    def __post_init__(self) -> None:
        self.require("sinks", self.sinks >= 0, ">= 0")
        self.require("rotation_seed", 0 <= self.rotation_seed <= MAX_SEED, f"in [0, {MAX_SEED}]")
        for key in ("code_bits", "anchor_bits"):
            self.require(key, getattr(self, key) in BITS, f"one of {BITS}")
        self.require("rescore_bits", self.rescore_bits in (0, *BITS), f"0 or one of {BITS}")
        self.require("candidates", 1 <= self.candidates <= 64, "in [1, 64]")
        self.require("rescore_from", self.rescore_from in RESCORE_SOURCES, f"one of {RESCORE_SOURCES}")
        self.require("anchor_fraction", 0 <= self.anchor_fraction <= 1, "in [0, 1]")
        self.require("host_rank_target", 0 < self.host_rank_target <= 1, "in (0, 1]")
        self.require("host_key_basis", self.host_key_basis in HOST_KEY_BASES, f"one of {HOST_KEY_BASES}")
        self.require("host_format", self.host_format == "none" or is_format(self.host_format),
                     f"none or one of {FORMATS_HELP}")
        self.require("host_budget", 0 <= self.host_budget < 1, "in [0, 1) (0: no fitted budget)")
        self.require("host_budget", not self.host_budget or self.host_format != "none",
                     "with a host_format (the layout its bits are fitted in), e.g. host_format: kivi4")
        self.require("hash_bits", self.hash_bits == 0 or (self.hash_bits % 8 == 0 and 8 <= self.hash_bits <= 512),
                     "0 or a multiple of 8 in [8, head_dim]")
        self.require("hash_init", self.hash_init in HASH_INITS, f"one of {HASH_INITS}")
        self.require("hash_width", self.hash_width in (1, 2, 4), "1, 2 or 4")
        self.require("fit_bits", self.fit_bits == 0 or (self.fit_bits % 8 == 0 and 8 <= self.fit_bits <= 512
                                                        and not self.hash_bits),
                     "0 or a multiple of 8 in [8, head_dim], without hash_bits (one index or the other)")
        self.require("hash_width", self.hash_width == 1 or (self.hash_bits and self.hash_init == "fit"),
                     "1 unless hash_bits is set and hash_init is fit (the fit allocates the widths)")
        for key in ("gain_lr", "hash_lr", "gate_lr", "w_recall", "w_rank", "w_anchor", "w_split", "w_out", "w_host"):
            self.require(key, finite_at_least(getattr(self, key), 0), "a finite number >= 0")


_METHOD_KEYS = tuple(f.name for f in fields(SeKVConfig))


class SeKVTraining(MethodTraining):
    recipe_class = SeKVRecipe
    size_hint = ("sekv's modules are sized by the model (layers x KV heads x head_dim); a trained hash adds "
                 "2 x layers x KV heads x head_dim x hash_bits: fewer hash_bits, or none")
    module_keys = ("num_layers", "kv_heads", "head_dim", "rotation_seed", "hash_bits", "hash_width", "hash_layout",
                   "max_trainable_fraction")
    # code_gain is a log gain (exp(30) ~ 1e13 already drowns every other coordinate); the logits' biases
    # saturate a softmax long before 50
    weight_bounds = {"code_gain": 30.0, "summary_bias": 50.0, "layer_logit": 50.0}

    def build_modules(self, shape: ModelShape, hyper: dict[str, Any]) -> SeKVAdapter:
        # The method settings an adapter records are checked here too, so a bad one is refused at load
        # (naming the key), not when the method first runs.
        settings = {k: hyper[k] for k in _METHOD_KEYS if k in hyper}
        check_hyperparameters(SeKVConfig, settings, "sekv")
        SeKVConfig(**settings)
        return build_sekv_modules(shape, hyper)

    def init_modules(self, recipe: Any, shape: ModelShape) -> SeKVAdapter:
        return build_sekv_modules(shape, {"rotation_seed": recipe.options.rotation_seed,
                                          "hash_bits": recipe.options.hash_bits,
                                          "hash_width": recipe.options.hash_width,
                                          "max_trainable_fraction": recipe.max_trainable_fraction})

    def prepare(self, modules: SeKVAdapter, recipe: Any, samples: Sequence[Sample]) -> None:
        """A trained hash starts from the projections fitted to the teacher cache (``hash_init: fit``)."""
        if not modules.hash_bits or recipe.options.hash_init != "fit":
            return
        layers = samples[0]["layers"].tolist()
        query_moment, key_moment = moments(samples, layers, modules.kv_heads)
        key, query, layout = fit_layout(query_moment, key_moment, modules.hash_bits, modules.hash_width,
                                        modules.hash_key.shape[-1])
        with torch.no_grad():
            modules.hash_key.copy_(key)
            modules.hash_query.copy_(query)
        modules.hash_layout = layout
        log.info("hash of %d bits fitted to the teacher cache (%d samples); layouts (n4, n2, n1): %s",
                 modules.hash_bits, len(samples), " ".join("/".join(map(str, v)) for v in layout))

    def method_config(self, recipe: Any) -> SeKVConfig:
        return SeKVConfig(**self._method_kwargs(recipe))

    def _method_kwargs(self, recipe: Any) -> dict[str, Any]:
        o = recipe.options
        return {k: recipe.recent if k == "recent" else getattr(o, k) for k in _METHOD_KEYS
                if k == "recent" or (hasattr(o, k) and (k != "fit_bits" or o.fit_bits))}
        # host_bits: fitted after the steps (fitted_hyper); fit_bits only when set (adapters saved before it)

    def hyper(self, modules: SeKVAdapter, recipe: Any) -> dict[str, Any]:
        return {**self._method_kwargs(recipe), **modules.hyper()}

    def fitted_hyper(self, modules: SeKVAdapter, recipe: Any, samples: Sequence[Sample]) -> dict[str, Any]:
        """The host tier's bits per layer, fitted to ``host_budget`` on the teacher cache (``host_bits``)."""
        o = recipe.options
        if not o.host_budget:
            return {}
        budgets = [round(recipe.budget * float(share)) for share in modules.layer_shares().detach()]  # sekv's split
        pattern, report = fit_host_bits(samples, o.host_format, o.host_budget, budgets, modules.head_dim,
                                        o.rescore_bits if o.rescore_from == "codes" else 0, kl=o.host_fit_kl)
        log.info("host bits fitted to %.3f of full KV (reached %.3f): %s", o.host_budget, report["host_share"],
                 " ".join(f"{k}/{v}" for k, v in pattern))
        return {"host_bits": pattern}

    def param_groups(self, modules: SeKVAdapter, recipe: Any) -> list[dict[str, Any]]:
        others = [modules.span_tau, modules.layer_logit, modules.summary_bias]
        groups = [{"params": [modules.code_gain], "lr": recipe.options.gain_lr}, {"params": others, "lr": recipe.lr}]
        if modules.hash_bits:  # no decay: the projections' scale is the logits' scale
            groups.append({"params": [modules.hash_key, modules.hash_query], "lr": recipe.options.hash_lr,
                           "weight_decay": 0.0})
        if recipe.options.host_rank_target < 1:
            group = {"params": [modules.rank_gate], "lr": recipe.options.gate_lr}
            if not recipe.options.host_rank_values:  # no decay either: the value gates must stay on
                group["weight_decay"] = 0.0
            groups.append(group)
        else:  # no rank budget: the gates stay on (the host rows exact) and collect no gradient
            modules.rank_gate.requires_grad_(False)
        return groups

    def step_loss(self, modules: SeKVAdapter, sample: Sample, layers: list[int], recipe: Any, step: int,
                  rng: random.Random) -> tuple[torch.Tensor, dict[str, float]]:
        o, mcfg = recipe.options, self.method_config(recipe)
        all_layers = sample["layers"].tolist()
        scaling = float(sample["scaling"])
        names = ("rank", "anchor", "split", "out", "kept") + (("recall",) if o.w_recall else ())
        parts: dict[str, list[torch.Tensor]] = {k: [] for k in names}
        wholes = [round(x) for x in recalled_rows(modules, recipe.budget, mcfg).detach().tolist()]  # one read
        for layer in layers:
            pos = all_layers.index(layer)
            keys, values = sample[f"k.{layer}"].float(), sample[f"v.{layer}"].float()
            rope = sample_rope(sample, layer, keys.shape[1], mcfg)
            for p, t in enumerate(sample["positions"].tolist()):
                losses = position_losses(modules, pos, keys, values, sample[f"q.{layer}"][:, p],
                                         sample[f"attn.{layer}"][:, p].float(), sample["surprisal"], t, scaling,
                                         recipe.budget, mcfg, rope, gate_values=o.host_rank_values,
                                         with_recall=bool(o.w_recall), whole=wholes[pos])
                if losses is not None:
                    for k in parts:
                        parts[k].append(getattr(losses, k))
        if not parts["rank"]:
            zero = sum(p.sum() * 0 for p in modules.parameters())
            return zero, {}
        mean = {k: torch.stack(v).mean() for k, v in parts.items()}
        # The share of principal directions the host keeps, over this step's layers only: Adam moves every
        # gate about as far each step whatever its gradient, so a hinge over all layers would pull down the
        # gates of layers whose output error this step does not see.
        pos = [all_layers.index(layer) for layer in layers]  # (each picked alone: a list would be copied to a GPU)
        gated = slice(None) if o.host_rank_values else slice(0, 1)  # the kinds under the budget: keys (0), values (1)
        host = kept_share(torch.stack([modules.rank_gate[p] for p in pos])[:, gated])
        loss = (o.w_rank * mean["rank"] + o.w_anchor * mean["anchor"] + o.w_split * mean["split"]
                + o.w_out * mean["out"] + o.w_host * torch.relu(host - o.host_rank_target))
        if o.w_recall:
            loss = loss + o.w_recall * mean["recall"]
        kept_dirs = (modules.rank_gate[:, gated] > 0).float().mean()
        numbers = torch.stack([*mean.values(), kept_dirs, loss.detach()]).tolist()  # one read, not one a number
        return loss, dict(zip([*mean, "host_rank", "loss"], numbers, strict=True))

    def report(self, modules: SeKVAdapter, recipe: Any, samples: list[Sample]) -> dict[str, Any] | None:
        """On held-out cached samples: per layer, the teacher mass the router's selection captures at the
        layer's budget, beside exact top-B's (the selection's upper bound), and the anchors' share."""
        mcfg = self.method_config(recipe)
        kept: dict[int, list[float]] = {}
        oracle: dict[int, list[float]] = {}
        anchors: list[float] = []
        with torch.no_grad():
            recalled = recalled_rows(modules, recipe.budget, mcfg)  # what training recalls at, per layer
            for sample in samples:
                scaling = float(sample["scaling"])
                for pos, layer in enumerate(sample["layers"].tolist()):
                    keys = sample[f"k.{layer}"].float()
                    for p, t in enumerate(sample["positions"].tolist()):
                        n = t + 1
                        if n <= recipe.budget - 1:
                            continue
                        a = sample[f"attn.{layer}"][:, p].float()
                        student = prefix_student(modules, pos, keys, sample["surprisal"], n, mcfg)
                        logits = router_logits(modules, pos, student, sample[f"q.{layer}"][:, p], scaling)
                        h, g = logits.shape[:2]
                        at = a[:, :n].view(h, g, n)
                        region, inside = prefix_region(n, mcfg, at.device)
                        rows = recalled[pos]
                        order = selection_order(modules, pos, student, sample[f"q.{layer}"][:, p], scaling, logits,
                                                region, max(1, round(float(rows))), mcfg, inside)
                        kept.setdefault(pos, []).append(float(captured_mass(at, order, rows, region, inside)))
                        oracle.setdefault(pos, []).append(float(captured_mass(at, at.sum(1), rows, region, inside)))
                        anchors.append(float(student.anchor.sum()) / max(1, inside))
        if not kept:
            return None
        per_layer = {str(p): {"kept": round(sum(v) / len(v), 4), "oracle": round(sum(oracle[p]) / len(oracle[p]), 4)}
                     for p, v in sorted(kept.items())}
        flat = [x for v in kept.values() for x in v]
        flat_o = [x for v in oracle.values() for x in v]
        return {"kept_mass": round(sum(flat) / len(flat), 4), "oracle_mass": round(sum(flat_o) / len(flat_o), 4),
                "anchor_share": round(sum(anchors) / len(anchors), 4), "layers": per_layer,
                "tau": [round(float(x), 3) for x in modules.span_tau.detach()],  # (read, not differentiated)
                "host_rank": [[int(n) for n in (modules.rank_gate[layer] > 0).sum(-1)]
                              for layer in range(modules.num_layers)],
                "layer_budgets": [round(recipe.budget * float(s), 1) for s in modules.layer_shares().detach()],
                "gain_spread": round(float(modules.code_gain.detach().std()), 4)}

    def with_modules(self, config: SeKVConfig, modules: SeKVAdapter | None) -> SeKV:
        return SeKV(config, adapter=modules)

