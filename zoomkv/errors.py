"""Errors zoomkv raises on bad input. The CLI prints their message, never a traceback."""


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


class BudgetExceededError(RuntimeError):
    """A method held more device-tier rows than its budget allows. Always a bug in that method."""


class ConfigError(ZoomKVError, ValueError):
    """An unknown or impossible hyper-parameter (a method's, a recipe's, an adapter's)."""
