"""Training ``semantic_id``'s projector from the same teacher cache as sekv.

The projector decides the semantic ID (SimHash of its output), and tokens may only merge when their IDs
match. So it is trained to make two rows collide exactly when merging them is *attention-equivalent* for
the teacher: under every cached teacher query of their KV head's group that sees both rows, their logits
differ by at most σ* (the logit spread at which ``semantic_id``'s match equals its recall threshold,
``1/cosh(σ*) = recall_threshold``: ln 2 for the default 0.8), and their values are at least
``value_threshold`` cosine-similar (what the merge test itself demands of V).

Per step and layer: a seeded sample of rows every query sees, all pairs among them, the teacher's label per
pair, and the student's collision probability ``(1 - θ/π)^id_bits`` (θ: the angle between the two
semantic vectors; SimHash with ``id_bits`` random hyperplanes collides with exactly that probability).
Loss (recipe key ``loss``): ``pairs``, class-balanced binary cross-entropy of each pair's collision
probability against its label; or ``neighbours``, listwise: each row's other rows ranked by semantic
similarity as the teacher's logit gap ranks them (equivalence is rare, ~0.03% of pairs on SmolLM2, so the
label-wise loss mostly pushes pairs apart; the ranking keeps the nearest rows the most equivalent ones).

What is trained (recipe key ``design``): ``projector``, one ``SemanticProjector`` shared by every sequence,
layer and head, started from the PCA of cached K‖V rows (similarity-preserving, deterministic); or
``pca_correction``, an ``InputCorrection`` of K‖V before the PCA the method fits to each sequence and head
(started as the identity, so exactly the untrained method). For the correction, each step fits that PCA
the way the method does (to every row the cached queries see, sinks left out), holds the basis fixed and
lets the gradient reach the correction through the corrected rows.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from zoomkv.errors import ConfigError
from zoomkv.memory.pinned import to_device
from zoomkv.methods.semantic_id.method import SemanticID, SemanticIDConfig
from zoomkv.methods.semantic_id.projector import InputCorrection, SemanticProjector, pca_basis, semantic_input
from zoomkv.protocol.method import check_hyperparameters
from zoomkv.protocol.shape import ModelShape
from zoomkv.protocol.training import MethodTraining, RecipeOptions, Sample

LOSSES = ("pairs", "neighbours")
DESIGNS = ("projector", "pca_correction")
METHOD_KEYS = ("sem_dim", "hidden", "id_bits", "key_threshold", "value_threshold", "recall_threshold")


@dataclass
class SemanticIDRecipe(RecipeOptions):
    """semantic_id's own recipe keys: the projector's size, the ID it is trained to hash into, the pairs."""

    sem_dim: int = 16
    sem_hidden: int = 32
    id_bits: int = 6
    pair_rows: int = 192  # rows sampled per layer and step; every pair among them is a training pair
    # pairs: class-balanced BCE of each pair's collision probability against the teacher's equivalence label;
    # neighbours: listwise, each row's neighbours ranked by semantic similarity as the teacher's logit gap
    # ranks them (a softmax over the other rows, KL to the teacher's), so the nearest rows are the most
    # equivalent ones even where no pair passes the strict test
    loss: str = "pairs"
    neighbour_temperature: float = 0.1  # the student's softmax over cosine similarities (neighbours loss)
    # projector: one trained map replaces the per-sequence PCA; pca_correction: the per-sequence PCA stays and
    # a trained correction of its input (x ⊙ (1 + gain) + x A B, rank correction_rank) reshapes what it sees
    design: str = "projector"
    correction_rank: int = 8

    def __post_init__(self) -> None:
        self.require("loss", self.loss in LOSSES, f"one of {LOSSES}")
        self.require("design", self.design in DESIGNS, f"one of {DESIGNS}")
        self.require("correction_rank", 0 <= self.correction_rank <= 256, "in [0, 256]")
        self.require("neighbour_temperature", 0 < self.neighbour_temperature <= 10, "in (0, 10]")
        self.require("sem_dim", self.sem_dim >= 1, ">= 1")
        self.require("sem_hidden", self.sem_hidden >= 2 * self.sem_dim, f">= 2 * sem_dim ({2 * self.sem_dim})")
        self.require("id_bits", 0 <= self.id_bits <= 30, "in [0, 30]")
        self.require("pair_rows", self.pair_rows >= 2, ">= 2")


def method_config(recipe: Any) -> SemanticIDConfig:
    """The method's settings the projector is trained for (recipe keys prefixed ``sem_`` where ambiguous)."""
    o = recipe.options
    return SemanticIDConfig(sem_dim=o.sem_dim, hidden=o.sem_hidden, id_bits=o.id_bits)


@torch.no_grad()
def init_from_cache(projector: SemanticProjector, samples: Sequence[Sample], *, rows_per_layer: int = 512,
                    seed: int = 0) -> SemanticProjector:
    """PCA of K‖V rows from the cached samples (every layer and KV head, a seeded subsample of each)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for sample in samples[:8]:
        for layer in sample["layers"].tolist():
            x = semantic_input(sample[f"k.{layer}"], sample[f"v.{layer}"]).reshape(-1, projector.in_dim)
            take = torch.randperm(x.shape[0], generator=g)[:rows_per_layer]
            rows.append(x[take])
    mean, basis = pca_basis(torch.cat(rows), None, projector.sem_dim)
    return projector.load_pca(mean, basis)


def pair_targets(keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor, scaling: float,
                 sigma: float, value_threshold: float) -> torch.Tensor:
    """``[S, S]`` bool: rows i and j are attention-equivalent for every query (``[Q, d]``) and their values
    at least ``value_threshold`` cosine-similar. ``keys``/``values``: ``[S, d]``."""
    v = F.normalize(values.float(), dim=-1)
    return (logit_gaps(keys, queries, scaling) <= sigma) & (v @ v.T >= value_threshold)


def collision_probability(sem: torch.Tensor, bits: int) -> torch.Tensor:
    """``[S, s]`` semantic vectors → ``[S, S]`` probability that SimHash with ``bits`` planes collides."""
    unit = F.normalize(sem, dim=-1)
    cos = (unit @ unit.T).clamp(-1 + 1e-6, 1 - 1e-6)
    return (1 - torch.arccos(cos) / math.pi) ** bits


def logit_gaps(keys: torch.Tensor, queries: torch.Tensor, scaling: float) -> torch.Tensor:
    """``[S, S]``: the largest logit difference of rows i and j under any of the queries (``[Q, d]``)."""
    logits = scaling * (queries.float() @ keys.float().T)  # [Q, S]
    return (logits[:, :, None] - logits[:, None, :]).abs().amax(0)


def neighbour_loss(sem: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor,
                   scaling: float, sigma: float, value_threshold: float, temperature: float) -> torch.Tensor:
    """Listwise: for each row, a softmax over the other rows by the teacher's closeness (``-gap / σ``, pairs
    whose values fail ``value_threshold`` pushed a further 10σ away) against the student's softmax over
    semantic cosine similarity at ``temperature``; KL(teacher || student), averaged over rows."""
    n = keys.shape[0]
    eye = torch.eye(n, dtype=torch.bool, device=keys.device)
    v = F.normalize(values.float(), dim=-1)
    far = (v @ v.T < value_threshold).float() * 10.0
    teacher = torch.softmax((-logit_gaps(keys, queries, scaling) / sigma - far).masked_fill(eye, float("-inf")), -1)
    unit = F.normalize(sem, dim=-1)
    student = torch.log_softmax(((unit @ unit.T) / temperature).masked_fill(eye, float("-inf")), -1)
    kl = teacher * (teacher.clamp_min(1e-12).log() - student.masked_fill(eye, 0.0))
    return kl.masked_fill(eye, 0.0).sum(-1).mean()


def student_semantic(modules: SemanticProjector | InputCorrection, keys: torch.Tensor, values: torch.Tensor,
                     idx: torch.Tensor, visible: slice, sem_dim: int) -> torch.Tensor:
    """The semantic vectors ``[S, s]`` the method would give rows ``idx`` of one KV head (``keys``/``values``
    ``[T, d]``). A projector maps them directly; under an input correction the method's per-sequence PCA is
    fitted to the corrected ``visible`` rows (no gradient through the basis) and the sampled rows, corrected
    with gradient, are projected on it."""
    x = semantic_input(keys[idx], values[idx])
    if isinstance(modules, SemanticProjector):
        return modules(x)
    with torch.no_grad():
        fitted = modules(semantic_input(keys[visible], values[visible]))
        mean, basis = pca_basis(fitted, None, min(sem_dim, fitted.shape[-1]))
    return (modules(x) - mean) @ basis.T


def step_loss(projector: SemanticProjector | InputCorrection, sample: dict[str, torch.Tensor], layers: list[int],
              mcfg: SemanticIDConfig, rows: int, seed: int, loss: str = "pairs",
              temperature: float = 0.1) -> tuple[torch.Tensor, dict[str, float]]:
    sigma = math.acosh(1.0 / mcfg.recall_threshold)
    scaling = float(sample["scaling"])
    first_query = int(sample["positions"].min())
    sinks = mcfg.num_sinks
    g = torch.Generator().manual_seed(seed)
    losses, rates = [], []
    for layer in layers:
        keys, values, queries = sample[f"k.{layer}"], sample[f"v.{layer}"], sample[f"q.{layer}"]
        kv_heads, q_heads = keys.shape[0], queries.shape[0]
        group = q_heads // kv_heads
        visible = first_query - sinks  # rows every cached query sees (sinks never merge)
        if visible < 4:
            continue
        # the host's seeded draw (the same rows on any device), copied once a layer, queued
        idx = to_device(sinks + torch.randperm(visible, generator=g)[:rows], keys.device)
        pairs = off_diagonal(len(idx), keys.device)
        for h in range(kv_heads):
            k, v = keys[h, idx], values[h, idx]
            q = queries[h * group : (h + 1) * group].reshape(-1, queries.shape[-1])
            target = pair_targets(k, v, q, scaling, sigma, mcfg.value_threshold).flatten()[pairs].float()
            sem = student_semantic(projector, keys[h], values[h], idx, slice(sinks, first_query), mcfg.sem_dim)
            prob = collision_probability(sem, mcfg.id_bits).flatten()[pairs]
            n_pos = target.sum()
            if loss == "neighbours":
                losses.append(neighbour_loss(sem, k, v, q, scaling, sigma, mcfg.value_threshold, temperature))
            else:
                # Class balance: equivalent pairs are rare, and each one missed is a merge lost.
                pos_weight = ((target.numel() - n_pos) / n_pos.clamp_min(1)).clamp(max=50.0)
                weight = torch.where(target > 0, pos_weight, torch.ones_like(target))
                losses.append(F.binary_cross_entropy(prob.clamp(1e-6, 1 - 1e-6), target, weight=weight))
            with torch.no_grad():  # the head's logged rates, kept where they are until the step's one read
                n_neg = target.numel() - n_pos
                rates.append(torch.stack([target.mean(), (n_pos > 0).float(),
                                          (prob * target).sum() / n_pos.clamp_min(1),
                                          (prob * (1 - target)).sum() / n_neg.clamp_min(1)]))
    if not losses:
        return sum(p.sum() * 0 for p in projector.parameters()), {}
    loss = torch.stack(losses).mean()
    first, *heads = torch.cat([loss.detach()[None], torch.cat(rates)]).tolist()  # one read, not five a head
    share, has_pos, pos_rate, neg_rate = (heads[i::4] for i in range(4))
    logs = {"loss": first, "equivalent": sum(share) / len(share),
            "collide_eq": sum(r for r, has in zip(pos_rate, has_pos, strict=True) if has) / max(1, sum(has_pos)),
            "collide_other": sum(neg_rate) / len(neg_rate)}
    return loss, logs


def off_diagonal(n: int, device: torch.device) -> torch.Tensor:
    """The flat indices of an ``[n, n]`` matrix's entries off its diagonal, row by row (what a boolean mask
    ``~eye`` picks, in fixed shape: no wait for its count on a GPU)."""
    row = torch.arange(n, device=device)[:, None]
    col = torch.arange(n - 1, device=device)[None, :]
    return (row * n + col + (col >= row)).flatten()


def hyper(modules: SemanticProjector | InputCorrection, cfg: Any) -> dict[str, Any]:
    """What rebuilds the module and runs the method as trained (ZoomAdapter's ``hyper``). A projector's
    hyper-parameters say no ``design`` (so adapters written before the correction existed load unchanged)."""
    mcfg = method_config(cfg)
    settings = {k: getattr(mcfg, k) for k in METHOD_KEYS}
    if isinstance(modules, InputCorrection):
        return settings | {"design": "pca_correction", "correction_rank": modules.rank}
    return settings | {"sem_dim": modules.sem_dim, "hidden": modules.hidden}


@torch.no_grad()
def pair_metrics(projector: SemanticProjector | InputCorrection, samples: Sequence[Sample], recipe: Any) -> dict[str, float]:
    """Expected collisions of equivalent vs other pairs on the cached samples (all layers, seed fixed)."""
    mcfg = method_config(recipe)
    logs = []
    for sample in samples:
        logs.append(step_loss(projector, sample, sample["layers"].tolist(), mcfg, recipe.options.pair_rows,
                              12345)[1])
    logs = [entry for entry in logs if entry]
    return {k: sum(entry[k] for entry in logs) / len(logs) for k in ("loss", "collide_eq", "collide_other")}


class SemanticIDTraining(MethodTraining):
    recipe_class = SemanticIDRecipe
    report_name = "pairs"  # collision rates of equivalent vs other pairs, before and after
    size_hint = "lower sem_dim/sem_hidden"
    module_keys = ("sem_dim", "hidden", "design", "correction_rank")

    def build_modules(self, shape: ModelShape, hyper: dict[str, Any]) -> SemanticProjector | InputCorrection:
        """One module shared by every layer and KV head: the projector, or (``design: pca_correction``) the
        correction of the per-sequence PCA's input. The adapter's weights are the module: a ``projector``
        file named in its hyper-parameters is refused, never read."""
        if hyper.get("projector") is not None:
            raise ConfigError("semantic_id adapter: hyper-parameter 'projector' names a file; an adapter's projector "
                              "is its own adapter_model.safetensors (an adapter config may not point elsewhere)")
        design = hyper.get("design", "projector")
        if design not in DESIGNS:
            raise ConfigError(f"semantic_id adapter: design must be one of {DESIGNS}, got {design!r}")
        sizes = {k: v for k, v in hyper.items() if k in ("sem_dim", "hidden")}
        check_hyperparameters(SemanticIDConfig, sizes, "semantic_id")
        cfg = SemanticIDConfig(**sizes)
        if design == "pca_correction":
            rank = hyper.get("correction_rank", 8)
            if not isinstance(rank, int) or isinstance(rank, bool):
                raise ConfigError(f"semantic_id adapter: correction_rank must be an integer, got {rank!r}")
            return InputCorrection(2 * shape.head_dim, rank)
        return SemanticProjector(shape.head_dim, cfg.sem_dim, cfg.hidden)

    def init_modules(self, recipe: Any, shape: ModelShape) -> SemanticProjector | InputCorrection:
        """The recipe's module: a projector (block-pooling init; the PCA start needs the teacher cache) or the
        identity correction."""
        o = recipe.options
        if o.design == "pca_correction":
            return InputCorrection(2 * shape.head_dim, o.correction_rank)
        return SemanticProjector(shape.head_dim, o.sem_dim, o.sem_hidden)

    def prepare(self, modules: SemanticProjector | InputCorrection, recipe: Any, samples: Sequence[Sample]) -> None:
        if isinstance(modules, SemanticProjector):  # a correction starts as the identity, data-free
            init_from_cache(modules, samples, seed=recipe.seed)

    def method_config(self, recipe: Any) -> SemanticIDConfig:
        return method_config(recipe)

    def hyper(self, modules: SemanticProjector | InputCorrection, recipe: Any) -> dict[str, Any]:
        return hyper(modules, recipe)

    def step_loss(self, modules: SemanticProjector | InputCorrection, sample: Sample, layers: list[int], recipe: Any, step: int,
                  rng: random.Random) -> tuple[torch.Tensor, dict[str, float]]:
        return step_loss(modules, sample, layers, method_config(recipe), recipe.options.pair_rows,
                         rng.randrange(2**31), recipe.options.loss, recipe.options.neighbour_temperature)

    def report(self, modules: SemanticProjector | InputCorrection, recipe: Any, samples: Sequence[Sample]) -> dict[str, Any]:
        return pair_metrics(modules, samples, recipe)

    def with_modules(self, config: SemanticIDConfig,
                     modules: SemanticProjector | InputCorrection | None) -> SemanticID:
        method = SemanticID(config)
        method.attach_adapter(modules)  # None: the per-sequence PCA start the method uses untrained
        return method
