"""Errors zoomkv raises on bad input. The CLI prints their message, never a traceback."""

from __future__ import annotations

from typing import Any


class ZoomKVError(Exception):
    """Base class for every error caused by what the user asked for (not by a bug)."""


class ModelNotFoundError(ZoomKVError):
    """An unknown model name, a missing model package, or a hub id that cannot be fetched."""


class MethodNotFoundError(ZoomKVError):
    """An unknown method name."""


class BudgetError(ZoomKVError):
    """A budget that cannot be parsed or met."""


class PromptError(ZoomKVError):
    """An empty prompt, or one longer than the model accepts."""


class UnsupportedDependency(ImportError):
    """An installed package outside the versions zoomkv works with (raised on import; the command prints it as
    one line)."""


class BudgetExceededError(RuntimeError):
    """A method held more device-tier rows than its budget allows. Always a bug in that method."""


class ConfigError(ZoomKVError, ValueError):
    """An unknown or impossible hyper-parameter (a method's, a recipe's, an adapter's)."""


class AdapterError(ZoomKVError):
    """Base class of every error about an adapter folder, its files or where it is loaded (the rest are in
    ``zoomkv.adapters.errors``)."""


class BaseModelMismatchError(AdapterError):
    """The adapter was trained for another base model. The message names both and the differing fields.
    Here, below the adapter layer, because a cache running an adapter's modules refuses the wrong model too."""

    def __init__(self, expected: dict[str, Any], actual: dict[str, Any], differing: list[str]):
        self.expected = expected
        self.actual = actual
        self.differing = differing
        fields = ", ".join(f"{k}: adapter {expected.get(k)!r} vs model {actual.get(k)!r}" for k in differing)
        super().__init__(
            f"adapter was trained for base model {expected.get('name')!r} but the model is "
            f"{actual.get('name')!r}; they differ in {fields}"
        )
