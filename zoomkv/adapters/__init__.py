"""Trainable adapters of zoomkv methods and the adapter artefact (see base.py for the contract)."""

from typing import Any

_EXPORTS = {"ZoomAdapter": "zoomkv.adapters.model", "cache_from_adapter": "zoomkv.adapters.model",
            "ZoomAdapterConfig": "zoomkv.adapters.config", "export_checkpoint": "zoomkv.adapters.checkpoint",
            "write_checkpoint": "zoomkv.adapters.checkpoint"}


def __getattr__(name: str) -> Any:
    # Lazy: method modules import zoomkv.adapters.<method> while zoomkv.methods is being imported, and the
    # artefact layer imports zoomkv.methods; importing it eagerly here would make that a cycle.
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
