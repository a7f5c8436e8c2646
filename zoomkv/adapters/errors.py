"""Errors of the adapter artefact. All are ``ZoomKVError``s, so the CLI prints one line and exits 2."""

from __future__ import annotations

# AdapterError and BaseModelMismatchError live in zoomkv.errors: a cache refuses the wrong base model too
from zoomkv.errors import AdapterError, BaseModelMismatchError, ConfigError

__all__ = ["AdapterError", "BaseModelMismatchError", "AdapterNotFoundError", "AdapterOfflineError",
           "AdapterConfigError", "AdapterVersionError", "AdapterWeightsError", "AdapterKeysError",
           "AdapterShapeError", "AdapterExistsError"]


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
