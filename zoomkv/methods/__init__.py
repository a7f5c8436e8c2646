"""KV methods, one file each, registered by name: importing this package imports every method module."""

import importlib
import pkgutil

from zoomkv.methods.registry import METHODS, get_method, list_methods, register_method

_NOT_METHODS = {"base", "registry"}
for _info in pkgutil.iter_modules(__path__):
    if not _info.name.startswith("_") and _info.name not in _NOT_METHODS:
        importlib.import_module(f"{__name__}.{_info.name}")

__all__ = ["METHODS", "get_method", "list_methods", "register_method"]
