"""What a trainable method's modules need to know of the base model: its shape, and the fingerprint an
adapter records to refuse the wrong base model."""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass
from typing import Any

import torch

from zoomkv import compat
from zoomkv.errors import BaseModelMismatchError, ConfigError
from zoomkv.models.registry import same_base_name


@dataclass(frozen=True)
class ModelShape:
    """The base model's sizes an adapter's modules are built from, recorded in the adapter so it loads without the model."""

    model_type: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    layer_types: tuple[str, ...]
    num_parameters: int | None = None  # of the base model, when known (for the trainable fraction)

    def __post_init__(self) -> None:
        # Read from adapter configs too (downloaded files): every size is checked before anything uses it.
        def count(name: str, value: Any, low: int) -> None:
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigError(f"model shape: {name} must be an integer >= {low}, got {value!r}")

        if not isinstance(self.model_type, str):
            raise ConfigError(f"model shape: model_type must be a string, got {self.model_type!r}")
        for name in ("num_layers", "num_attention_heads", "num_kv_heads", "head_dim", "hidden_size", "vocab_size"):
            count(name, getattr(self, name), 1)
        count("max_position_embeddings", self.max_position_embeddings, 0)
        if self.num_parameters is not None:
            count("num_parameters", self.num_parameters, 1)
        if not isinstance(self.layer_types, tuple) or not all(isinstance(t, str) for t in self.layer_types):
            raise ConfigError(f"model shape: layer_types must be a list of strings, got {self.layer_types!r}")

    def parameter_bound(self) -> int:
        """The most parameters an adapter for this model may have: the base model's own count (an adapter is
        a small fraction of it), or, when that is not known, a transformer's count estimated from the shape."""
        if self.num_parameters:
            return self.num_parameters
        return self.num_layers * 12 * self.hidden_size**2 + 2 * self.vocab_size * self.hidden_size

    @classmethod
    def from_dict(cls, data: Any) -> ModelShape:
        """A shape as ``to_dict`` wrote it (an adapter config's or checkpoint's ``shape``), checked."""
        if not isinstance(data, dict):
            raise ConfigError(f"model shape: expected a mapping, got {type(data).__name__}")
        data = dict(data)
        types = data.get("layer_types", ())
        if not isinstance(types, list | tuple):
            raise ConfigError(f"model shape: layer_types must be a list of strings, got {types!r}")
        data["layer_types"] = tuple(types)
        try:
            return cls(**data)
        except TypeError as err:  # unknown or missing fields
            raise ConfigError(f"model shape: {err}") from None

    @property
    def full_attention_layers(self) -> tuple[int, ...]:
        """Indices of the layers a ``ZoomCache`` compresses (sliding-window layers left out)."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    def to_dict(self) -> dict[str, Any]:
        """The fields as a dict (``adapter_config.json``'s ``shape``)."""
        return asdict(self)

    @classmethod
    def from_config(cls, config: Any, num_parameters: int | None = None) -> ModelShape:
        """The shape a transformers config describes."""
        text = compat.text_config(config)
        heads = text.num_attention_heads
        return cls(
            model_type=str(getattr(text, "model_type", "unknown")),
            num_layers=int(text.num_hidden_layers),
            num_attention_heads=int(heads),
            num_kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
            head_dim=compat.head_dim(text),
            hidden_size=int(text.hidden_size),
            vocab_size=int(text.vocab_size),
            max_position_embeddings=int(getattr(text, "max_position_embeddings", 0) or 0),
            layer_types=tuple(compat.layer_types(config)),
            num_parameters=num_parameters,
        )

    @classmethod
    def from_model(cls, model: torch.nn.Module) -> ModelShape:
        """The shape of a loaded model, its parameter count included."""
        return cls.from_config(model.config, sum(p.numel() for p in model.parameters()))


def base_fingerprint(model_or_config: Any, name: str | None = None, revision: str | None = None) -> dict[str, Any]:
    """What an adapter records about its base model: loading onto a model with another fingerprint fails."""
    config = getattr(model_or_config, "config", model_or_config)
    shape = ModelShape.from_config(config)
    return {
        "name": name or getattr(model_or_config, "zoomkv_name", None) or getattr(config, "_name_or_path", None),
        "revision": revision,
        "model_type": shape.model_type,
        "num_layers": shape.num_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_kv_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "hidden_size": shape.hidden_size,
        "vocab_size": shape.vocab_size,
    }


FINGERPRINT_KEYS = ("model_type", "num_layers", "num_attention_heads", "num_kv_heads", "head_dim", "hidden_size",
                    "vocab_size")


def fingerprint_diff(expected: dict[str, Any], actual: dict[str, Any]) -> list[str]:
    """Fields that make ``actual`` another base model than ``expected``: the structural keys, and the
    revision when both record one. The name alone does not: a local copy of a Hub model is the same model."""
    diff = [k for k in FINGERPRINT_KEYS if expected.get(k) != actual.get(k)]
    if expected.get("revision") and actual.get("revision") and expected["revision"] != actual["revision"]:
        diff.append("revision")
    return diff


def check_base_model(expected: dict[str, Any], model: Any, *, strict_name: bool = False) -> None:
    """Raise ``BaseModelMismatchError`` unless ``model`` (or its config) is the base model ``expected`` (an
    adapter's recorded fingerprint) describes; another name with the same architecture and sizes warns."""
    actual = base_fingerprint(model, revision=expected.get("revision") and _model_revision(model))
    diff = fingerprint_diff(expected, actual)
    same_name = same_base_name(expected.get("name"), actual.get("name"))  # smollm2-135m is its Hub id
    if strict_name and not same_name:
        diff.append("name")
    if diff:
        raise BaseModelMismatchError(expected, actual, diff)
    if expected.get("name") and actual.get("name") and not same_name:
        warnings.warn(f"adapter trained on {expected['name']!r}, loaded onto {actual['name']!r} "
                      "(same architecture and sizes)", stacklevel=3)


def _model_revision(model: Any) -> str | None:
    config = getattr(model, "config", model)
    return getattr(model, "zoomkv_revision", None) or getattr(config, "_commit_hash", None)


def trainable_fraction(modules: torch.nn.Module, shape: ModelShape) -> float:
    if not shape.num_parameters:
        raise ConfigError("the base model's parameter count is unknown")
    return sum(p.numel() for p in modules.parameters() if p.requires_grad) / shape.num_parameters
