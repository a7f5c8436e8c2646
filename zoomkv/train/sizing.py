"""The adapter a recipe trains, sized before anything is allocated: built (fresh or from ``init_adapter``),
its ``freeze`` tensors held, its trainable fraction of the base model checked against the limit; and
``--dry-run``, which does only this (from the config alone for models too big to load)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch

from zoomkv.adapters.model import ZoomAdapter
from zoomkv.data.training import sample_lengths
from zoomkv.errors import BaseModelMismatchError, ConfigError, ZoomKVError
from zoomkv.logs import human_bytes
from zoomkv.models.registry import same_base_name
from zoomkv.protocol.shape import FINGERPRINT_KEYS, ModelShape, fingerprint_diff
from zoomkv.train.config import TrainConfig
from zoomkv.train.teacher import sample_bytes

logger = logging.getLogger(__name__)

# Shapes of models too big to load for a dry run: the trainable fraction needs only their config.
KNOWN_CONFIGS: dict[str, dict[str, Any]] = {
    "meta-llama/Meta-Llama-3-8B": dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
        tie_word_embeddings=False,
    ),
}


def shape_without_weights(name: str) -> ModelShape:
    """A ModelShape (with the parameter count) from a config alone: the model is built on the meta device."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**KNOWN_CONFIGS[name])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return ModelShape.from_config(config, sum(p.numel() for p in model.parameters()))


def build_adapter(cfg: TrainConfig, shape: ModelShape) -> torch.nn.Module:
    """The modules to train: the recipe's ``init_adapter``, or the method's fresh ones."""
    if cfg.init_adapter:
        loaded = ZoomAdapter.from_pretrained(cfg.init_adapter, local_files_only=True)
        if loaded.config.method != cfg.method:
            raise ConfigError(f"recipe key 'init_adapter': {cfg.init_adapter} holds a {loaded.config.method!r} "
                              f"adapter, not {cfg.method!r}")
        check_init_base(cfg, loaded.config.base_model, shape)
        return loaded.modules
    plan_adapter(cfg, shape)
    return cfg.training.init_modules(cfg, shape)


def check_init_base(cfg: TrainConfig, recorded: dict[str, Any], shape: ModelShape) -> None:
    """``init_adapter`` must have been trained on the recipe's base model (the fingerprint its config records
    against the model's shape): modules of another model would train on from values that mean nothing here."""
    actual = {"name": cfg.model, **{k: getattr(shape, k) for k in FINGERPRINT_KEYS}}
    differing = fingerprint_diff(recorded, actual)
    if differing:
        raise ConfigError(f"recipe key 'init_adapter': {BaseModelMismatchError(recorded, actual, differing)}")
    if recorded.get("name") and not same_base_name(recorded.get("name"), cfg.model):
        logger.warning("init_adapter %s was trained on %r, the recipe trains on %r (same architecture and sizes)",
                       cfg.init_adapter, recorded.get("name"), cfg.model)


def plan_adapter(cfg: TrainConfig, shape: ModelShape) -> None:
    """The recipe's modules built on the meta device first (no memory): sizes that overflow or make more than
    ``max_trainable_fraction`` of the base model are refused before anything is allocated. (An init that
    reads tensor data cannot run there; ``check_fraction`` then checks the real modules.)"""
    sizes = ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(cfg.options).items()
                      if isinstance(v, int) and not isinstance(v, bool)) if cfg.options is not None else ""
    try:
        with torch.device("meta"):
            planned = cfg.training.init_modules(cfg, shape)
    except ZoomKVError:
        raise
    except (TypeError, ValueError, OverflowError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"recipe keys of {cfg.method!r} ({sizes}) build no modules: {first}") from None
    except (NotImplementedError, RuntimeError):
        return
    check_fraction(planned, shape, cfg, log=lambda *args: None)


def freeze_parameters(adapter: torch.nn.Module, names: str) -> list[str]:
    """Hold the recipe's ``freeze`` tensors at their start (no gradient, so the optimiser never moves them);
    returns their names. An unknown name is refused, listing the adapter's."""
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    params = dict(adapter.named_parameters())
    unknown = [n for n in wanted if n not in params]
    if unknown:
        raise ConfigError(f"recipe key 'freeze': {', '.join(map(repr, unknown))} is not a trainable tensor of this "
                          f"adapter; expected some of {', '.join(params)}")
    for name in wanted:
        params[name].requires_grad_(False)
    return wanted


def check_fraction(adapter: torch.nn.Module, shape: ModelShape, cfg: TrainConfig,
                   log: Callable[[str], Any] = logger.info) -> float:
    """The trainable fraction of the base model, said with ``log`` and refused over the recipe's limit."""
    n = sum(p.numel() for p in adapter.parameters() if p.requires_grad)
    fraction = n / shape.num_parameters
    log(f"trainable parameters: {n} of {shape.num_parameters} ({fraction:.3e} of the base model; "
        f"limit {cfg.max_trainable_fraction:g})")
    if fraction > cfg.max_trainable_fraction:
        raise ConfigError(
            f"the adapter has {n} trainable parameters = {fraction:.3e} of the base model, over "
            f"max_trainable_fraction={cfg.max_trainable_fraction:g}; {cfg.training.size_hint}, or raise "
            "max_trainable_fraction"
        )
    return fraction


def dry_run(cfg: TrainConfig) -> float:
    """``zoomkv train --dry-run``: the adapter's sizes and trainable fraction, printed (the command's output,
    ``trainable_fraction=`` last), without training."""
    if cfg.model in KNOWN_CONFIGS:
        shape = shape_without_weights(cfg.model)
    else:
        from zoomkv.models import load_model

        model, _ = load_model(cfg.model, random_weights=cfg.random_weights)
        shape = ModelShape.from_model(model)
    adapter = build_adapter(cfg, shape)
    print(f"model {cfg.model}: {shape.num_layers} layers ({len(shape.full_attention_layers)} compressed), "
          f"{shape.num_kv_heads} KV heads x head_dim {shape.head_dim}; adapter {cfg.training.hyper(adapter, cfg)}")
    print("trainable tensors: " + ", ".join(f"{n} {list(p.shape)}" for n, p in adapter.named_parameters()))
    freeze_parameters(adapter, cfg.freeze)
    fraction = check_fraction(adapter, shape, cfg, log=print)
    cache = sum(sample_bytes(shape, t, cfg.queries_per_sample, cfg.budget)
                for t in sample_lengths(cfg.num_samples, cfg.min_length, cfg.max_length))
    print(f"teacher cache: about {human_bytes(cache)} on disk for {cfg.num_samples} samples of {cfg.min_length} to "
          f"{cfg.max_length} tokens (each compressed layer's keys and values in fp16; checked against the free "
          "space before the signals are extracted)")
    print(f"trainable_fraction={fraction:.6g}")
    return fraction
