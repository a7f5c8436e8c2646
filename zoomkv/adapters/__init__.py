"""The adapter artefact: a trained method's modules as a PEFT-style folder (``adapter_config.json``,
``adapter_model.safetensors``, model card), training checkpoints, export, the Hub and the PEFT method.
The modules themselves belong to their method (``zoomkv.methods.<name>``) and are found through the
method registry."""

from zoomkv.adapters.checkpoint import write_checkpoint
from zoomkv.adapters.config import ZoomAdapterConfig
from zoomkv.adapters.export import export_checkpoint
from zoomkv.adapters.model import ZoomAdapter, build_adapter_modules, cache_from_adapter

__all__ = ["ZoomAdapter", "ZoomAdapterConfig", "build_adapter_modules", "cache_from_adapter", "export_checkpoint",
           "write_checkpoint"]
