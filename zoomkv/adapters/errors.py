"""Errors of the adapter artefact. All are ``ZoomKVError``s, so the CLI prints one line and exits 2."""

from __future__ import annotations

from typing import Any

from zoomkv.errors import ConfigError, ZoomKVError


class AdapterError(ZoomKVError):
    """Base class of every error about an adapter folder, its files or where it is loaded."""


class AdapterNotFoundError(AdapterError):
    """No adapter at that path or Hub id (or a required file of it is missing)."""


class AdapterOfflineError(AdapterNotFoundError):
    """The Hub is offline (HF_HUB_OFFLINE) or unreachable and the adapter is not in the local cache."""


class AdapterConfigError(AdapterError, ConfigError):
    """``adapter_config.json`` is not valid JSON, lacks a field, or has a field of the wrong type."""


class AdapterVersionError(AdapterConfigError):
    """The adapter was written in a format version this zoomkv does not read."""


class AdapterWeightsError(AdapterError):
    """``adapter_model.safetensors`` is corrupt, truncated, or not what the config describes."""


class AdapterKeysError(AdapterWeightsError):
    """The weights lack tensors the method's modules need, or carry tensors they do not have."""


class AdapterShapeError(AdapterWeightsError):
    """A tensor's shape differs from the one the method's modules have for this base model."""


class AdapterExistsError(AdapterError):
    """The export target already exists (pass overwrite=True / --overwrite to replace it)."""


class BaseModelMismatchError(AdapterError):
    """The adapter was trained for another base model. The message names both and the differing fields."""

    def __init__(self, expected: dict[str, Any], actual: dict[str, Any], differing: list[str]):
        self.expected = expected
        self.actual = actual
        self.differing = differing
        fields = ", ".join(f"{k}: adapter {expected.get(k)!r} vs model {actual.get(k)!r}" for k in differing)
        super().__init__(
            f"adapter was trained for base model {expected.get('name')!r} but the model is "
            f"{actual.get('name')!r}; they differ in {fields}"
        )
