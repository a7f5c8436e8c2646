"""``CacheSpec``: everything a ``ZoomCache`` runs with, checked once, before any model or prompt is touched.

    spec = CacheSpec.build("quest", "0.1", tail_summary=True, kv_quant="int8", page_size=8)
    cache = ZoomCache(model, spec)

A spec holds the method object itself (built once, with its hyper-parameters and, for a trained method,
its modules), the parsed ``Budget``, the softmax-tail switch, the KV quantization and the prefill chunk; for
a trained adapter also what the model must be (``TrainedModules``: checked, and the modules put on its
device, when the spec meets the model in ``check_model``).
A method object keeps no per-sequence state (that lives in each layer's ``LayerMemory``), so one spec
serves every cache of a run: every prompt of an evaluation, every repeat of a benchmark.

The command line reaches a spec through ``zoomkv.runspec`` (one grammar for every command);
``CacheSpec.build`` is the Python edge, where a budget may still be text.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from zoomkv import compat
from zoomkv.budget import Budget
from zoomkv.errors import BudgetError, ConfigError
from zoomkv.memory.quant import QuantSpec
from zoomkv.protocol.method import KVMethod
from zoomkv.protocol.registry import get_method
from zoomkv.protocol.shape import check_base_model

log = logging.getLogger(__name__)

TAIL_ROWS = 1  # the softmax tail's row per KV head (zoomkv.memory.tail): one of the budget's B rows


@dataclass(frozen=True)
class TrainedModules:
    """A trained adapter's share of a cache: the modules its method runs, and the base model they fit."""

    modules: torch.nn.Module
    base_model: dict[str, Any]  # the adapter's recorded fingerprint (zoomkv.protocol.shape.base_fingerprint)

    def fit(self, model_or_config: Any) -> None:
        """Refuse another base model (``BaseModelMismatchError`` naming both); put the modules on the model's
        device (in place: the method holds these very modules)."""
        check_base_model(self.base_model, model_or_config)
        if isinstance(model_or_config, torch.nn.Module):
            device = next((p.device for p in model_or_config.parameters()), None)
            if device is not None:
                self.modules.to(device)


@dataclass(frozen=True)
class CacheSpec:
    """Everything a ``ZoomCache`` runs with, checked once: the built method, the budget, the softmax tail,
    the KV quantization and its tiers, the prefill chunk, and a trained adapter's modules.

        spec = CacheSpec.build("quest", 256, tail_summary=True, kv_quant="int8")
        cache = ZoomCache(model, spec)                  # or generate_text(model, tokenizer, prompts, spec)

    An impossible combination (a budget the method cannot meet, a tail on an eviction method, a quantization
    that would quantize nothing) raises here, before a model runs; one spec serves every prompt of a run."""

    method: KVMethod
    budget: Budget | None = None  # device rows per layer per KV head; None: the method needs none (full)
    tail_summary: bool = False  # one mean row for everything a step did not select (zoomkv.memory.tail)
    kv_quant: QuantSpec | None = None  # int8/int4 rows in the host tier (every tier with tiers="all")
    prefill_chunk: int | None = None  # longer inputs go through in pieces of this many tokens
    trained: TrainedModules | None = field(default=None, compare=False)  # a loaded adapter's modules and base
    _warned: bool = field(default=False, init=False, repr=False, compare=False)  # said once per spec, not per cache

    def __post_init__(self) -> None:
        method = self.method
        if not isinstance(method, KVMethod):
            raise ConfigError(f"a CacheSpec takes a built method (get_method(name)), not {method!r}")
        if method.uses_budget and self.budget is None:
            raise BudgetError(f"method {method.name!r} needs a budget (e.g. --budget 256 or --budget 0.1)")
        if self.tail_summary and not method.recallable:
            raise ConfigError(f"the softmax tail (tail_summary: +tail, --tail-summary) needs a recallable method (its "
                              f"row is the mean of the sequence's own rows); {method.name!r} is not one")
        if self.budget is not None and self.budget.rows is not None:
            method.check_budget(self.method_budget(self.budget.rows))  # an impossible budget fails now
        quant = self.kv_quant
        if quant is not None and quant.tiers == "all" and not method.quantizable_device:
            raise ConfigError(
                f"method {method.name!r} keeps its device tier in full precision: --kv-quant-tiers all "
                "(kv_quant_tiers='all') is for a method that can quantize it (full); its +int8 / +int4 quantize "
                "the host tier")
        if quant is not None and quant.tiers == "host" and not method.uses_budget:
            raise ConfigError(f"method {method.name!r} holds every row on the device tier: quantizing only the host "
                              "tier would quantize nothing (by default +int8/+int4 quantize its device tier)")
        chunk = self.prefill_chunk
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
            raise ConfigError(f"prefill_chunk must be a positive number of tokens, got {chunk!r}")

    @classmethod
    def build(cls, method: str | KVMethod = "full", budget: str | int | float | Budget | None = None, *,
              tail_summary: bool = False, kv_quant: str | QuantSpec | None = None,
              kv_quant_tiers: str | None = None, kv_quant_group: int = 32, prefill_chunk: int | None = None,
              **method_kwargs: Any) -> CacheSpec:
        """A spec from Python values: a method name (with ``method_kwargs``, its hyper-parameters) or a built
        method, a budget as rows, a fraction or text, ``kv_quant`` as ``"int8"``/``"int4"``.
        ``kv_quant_tiers`` None: what a ``+int8`` variant means, the host tier, or the device tier of a
        method that keeps none (``full``)."""
        if isinstance(method, KVMethod) and method_kwargs:
            raise ConfigError(f"hyper-parameters {sorted(method_kwargs)} for an already built {method.name!r}: "
                              "give them to get_method (or ZoomAdapter.make_method)")
        built = get_method(method, **method_kwargs)
        quant = quant_spec(built, kv_quant, kv_quant_tiers, kv_quant_group)
        return cls(built, Budget.parse(budget), bool(tail_summary), quant, prefill_chunk)

    def method_budget(self, rows: int | None) -> int | None:
        """The rows the method itself may hold of ``rows``: all of them, less the tail's row when there is one."""
        if rows is None:
            return None
        return rows - self.tail_rows

    @property
    def tail_rows(self) -> int:
        """Device rows per KV head the runtime adds to the method's own: the tail's, when switched on."""
        return TAIL_ROWS if self.tail_summary else 0

    def check_model(self, model_or_config: Any) -> None:
        """What only the model can tell: another base model than a trained adapter's, a row budget over its
        longest context, a quantization group that does not divide its head size."""
        if self.trained is not None:
            self.trained.fit(model_or_config)
        config = getattr(model_or_config, "config", model_or_config)
        max_len = getattr(compat.text_config(config), "max_position_embeddings", None)
        if self.budget is not None:
            self.budget.check_fits(max_len)
        if self.method.uses_budget and self.budget is not None and not self._warned \
                and not self.compressed_layers(config):
            object.__setattr__(self, "_warned", True)
            log.warning("%s compresses none of this model's %d layers (its settings keep every one whole%s): "
                        "the budget %s holds no layer and the cache is as large as full KV", self.method.name,
                        len(compat.layer_types(config)), _dense_hint(self.method), self.budget)
        head_dim = compat.head_dim(config)
        quant = self.kv_quant
        if quant is not None and head_dim % min(quant.group_size, head_dim):
            raise ConfigError(f"quantization group size {quant.group_size} does not divide head_dim {head_dim}")
        if quant is not None and quant.outliers >= head_dim:
            raise ConfigError(f"{quant.name} keeps {quant.outliers} exact key channels of a {head_dim}-channel head: "
                              "fewer than head_dim")
        layers = len(compat.layer_types(config))
        if quant is not None and len(quant.layers) > layers:
            raise ConfigError(f"the host format {quant.name} gives bits for {len(quant.layers)} layers; the model has "
                              f"{layers} (an adapter fitted to another model)")

    def compressed_layers(self, model_or_config: Any) -> list[int]:
        """The model's layers this spec's method holds to the budget: full-attention layers it does not keep
        whole (``KVMethod.dense_layer``); sliding layers pass through."""
        config = getattr(model_or_config, "config", model_or_config)
        types = compat.layer_types(config)
        return [i for i, kind in enumerate(types)
                if kind == "full_attention" and not self.method.dense_layer(i, len(types))]

    @property
    def label(self) -> str:
        """The method and its variants as the command line writes them: ``quest+tail+int8``."""
        quant = f"+{self.kv_quant.name}" if self.kv_quant is not None else ""
        return self.method.name + ("+tail" if self.tail_summary else "") + quant


def _dense_hint(method: KVMethod) -> str:
    dense = getattr(method.config, "dense_layers", None)
    return f", dense_layers={dense}" if isinstance(dense, int) and dense else ""


def quant_spec(method: KVMethod, kv_quant: str | QuantSpec | None, tiers: str | None = None,
               group_size: int = 32) -> QuantSpec | None:
    """``"int8"`` / ``"kivi2"`` / ... for ``method``; None: the method's own format (``KVMethod.host_format``, a
    trained adapter's), usually none. ``tiers`` None: where ``+int8`` / ``+int4`` quantize, the
    host tier, which holds what a method keeps off the device; a method without a budget (``full``) holds every
    row on the device, so there its device tier (``"all"``)."""
    if isinstance(kv_quant, QuantSpec):
        return kv_quant
    tiers = tiers or ("host" if method.uses_budget else "all")
    if kv_quant is None:  # the method's own (a trained adapter's fitted host format), or none
        name, layers, fitted = method.host_format()
        spec = QuantSpec.parse(name, tiers, group_size)
        if spec is not None and layers:
            spec = replace(spec, layers=tuple((int(k), int(v)) for k, v in layers), fitted=fitted)
        return spec
    return QuantSpec.parse(kv_quant, tiers, group_size)
