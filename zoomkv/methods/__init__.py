"""KV methods, one file each, registered by name."""

from zoomkv.methods.registry import METHODS, get_method, list_methods, register_method

# Importing a method's module registers it.
from zoomkv.methods import full, oracle_topk  # noqa: E402, F401, I001

__all__ = ["METHODS", "get_method", "list_methods", "register_method"]
