"""What a trainable method hands the adapter artefact and the training loop: ``MethodTraining``.

A method that trains registers one ``MethodTraining`` next to its config and class
(``register_method(name, config_cls, method_cls, training=...)``). The adapter layer rebuilds the modules
of a saved adapter through ``build_modules``; the training loop (``zoomkv.train``) knows no method by name
and asks this object for everything method-specific: the recipe keys the method adds, fresh modules,
their optimiser groups, the loss of one step against the teacher, the hyper-parameters an adapter
records, and the method object to evaluate with the fresh or the trained modules.

``recipe`` below is the resolved training recipe (``zoomkv.train.config.TrainConfig``): its generic keys
as attributes, and the method's own keys (an instance of ``recipe_class``) as ``recipe.options``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from zoomkv.errors import ConfigError
from zoomkv.protocol.method import KVMethod, MethodConfig
from zoomkv.protocol.shape import ModelShape

# The teacher-signal samples a step trains on: tensors by name (see zoomkv.train.teacher for the keys).
Sample = dict[str, torch.Tensor]


@dataclass
class RecipeOptions:
    """Base of a method's own recipe keys (a flat dataclass; ``choices`` lists the strings a key accepts).
    A subclass checks its keys' ranges in ``__post_init__`` with ``require``: the recipe is refused before
    any model loads."""

    choices: ClassVar[dict[str, tuple[Any, ...]]] = {}

    def require(self, key: str, ok: bool, what: str) -> None:
        """Refuse the recipe key ``key`` unless ``ok`` (``what``: its valid range, for the message)."""
        if not ok:
            raise ConfigError(f"recipe key {key!r} must be {what}, got {getattr(self, key)!r}")


def finite_at_least(value: Any, low: float) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value >= low


class MethodTraining:
    """What a trainable method adds to the registry (``register_method(..., training=...)``): its modules and
    objective, for the trainer, the adapter loader and ``--adapter`` alike.

    A subclass gives ``recipe_class`` (the method's recipe keys), ``build_modules`` (from an adapter config),
    ``init_modules``, ``param_groups``, ``step_loss``, ``hyper``, ``method_config`` and ``with_modules`` (the
    method running these modules); ``docs/ARCHITECTURE.md``, "Adding a method", has the whole recipe."""

    recipe_class: ClassVar[type[RecipeOptions]] = RecipeOptions
    report_name: ClassVar[str] = "report"  # the run folder's <report_name>.json holds ``report`` before and after
    size_hint: ClassVar[str] = "make the modules smaller"  # what to change when they are over the size limit
    # Hyper-parameters besides the method config's fields that an adapter config may carry (the modules'
    # sizes); a key in neither is refused at load, so a misspelt one cannot be silently ignored. None: not
    # checked (a training that does not declare them).
    module_keys: ClassVar[tuple[str, ...] | None] = None
    # The largest magnitude a loaded adapter's tensor may hold, by tensor name (the rest: 1e4,
    # zoomkv.adapters.weights.DEFAULT_WEIGHT_BOUND): a value past it is no trained value (a log gain of 1e30
    # would run as infinite gains) and the adapter is refused at load.
    weight_bounds: ClassVar[dict[str, float]] = {}

    # -- the modules --------------------------------------------------------------------------------------
    def build_modules(self, shape: ModelShape, hyper: dict[str, Any]) -> torch.nn.Module:
        """The modules an adapter config describes (``hyper``), sized from the base model's shape alone."""
        raise NotImplementedError

    def init_modules(self, recipe: Any, shape: ModelShape) -> torch.nn.Module:
        """Fresh modules for a training run."""
        raise NotImplementedError

    def prepare(self, modules: torch.nn.Module, recipe: Any, samples: Callable[[], Sequence[Sample]]) -> None:
        """Called once before training a fresh adapter, with the teacher cache (e.g. a PCA start)."""

    def hyper(self, modules: torch.nn.Module, recipe: Any) -> dict[str, Any]:
        """What rebuilds these modules (their exact sizes) and runs the method as trained."""
        raise NotImplementedError

    def fitted_hyper(self, modules: torch.nn.Module, recipe: Any, samples: Sequence[Sample]) -> dict[str, Any]:
        """Hyper-parameters fitted on the teacher cache once the steps are done (discrete choices no optimiser
        step makes), added to ``hyper`` at export."""
        return {}

    # -- the objective ------------------------------------------------------------------------------------
    def param_groups(self, modules: torch.nn.Module, recipe: Any) -> list[dict[str, Any]]:
        """The optimiser's parameter groups (default: every parameter at the recipe's ``lr``)."""
        return [{"params": list(modules.parameters()), "lr": recipe.lr}]

    def step_loss(self, modules: torch.nn.Module, sample: Sample, layers: list[int], recipe: Any, step: int,
                  rng: random.Random) -> tuple[torch.Tensor, dict[str, float]]:
        """The loss of one sample (its sampled ``layers``) at ``step``, and the numbers to log."""
        raise NotImplementedError

    def report(self, modules: torch.nn.Module, recipe: Any, samples: Sequence[Sample]) -> dict[str, Any] | None:
        """Optional numbers of the modules on held-out cached samples, written before and after training."""
        return None

    # -- inference ----------------------------------------------------------------------------------------
    def method_config(self, recipe: Any) -> MethodConfig:
        """The method's settings the modules are trained for."""
        raise NotImplementedError

    def with_modules(self, config: MethodConfig, modules: torch.nn.Module | None) -> KVMethod:
        """The method with settings ``config`` running ``modules`` (None: the method's untrained start). The one
        way a trainable method gets its modules: a loaded adapter (``ZoomAdapter.make_method``) and the
        trainer (``make_method``) both come here."""
        raise NotImplementedError

    def make_method(self, modules: torch.nn.Module | None, recipe: Any) -> KVMethod:
        """The method running ``modules`` (None: the method's untrained start), as the recipe sets it."""
        return self.with_modules(self.method_config(recipe), modules)
