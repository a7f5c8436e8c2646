"""The method protocol: what the memory engine asks of a KV method (``method.py``), the family bases that
write the shared parts once (``eviction.py``, ``recallable.py``), what a trainable method adds
(``training.py``, ``shape.py``), and the one registry of methods (``registry.py``). Nothing here knows a
method by name or imports the engine; the engine and every method import this."""

from zoomkv.protocol.eviction import EvictionMethod
from zoomkv.protocol.method import KVMethod, Memory, MethodConfig, PrefillContext, RowBufferLike, Selection
from zoomkv.protocol.recallable import RecallableMethod
from zoomkv.protocol.registry import (
    get_method,
    get_training,
    list_methods,
    register_method,
    unregister_method,
)
from zoomkv.protocol.shape import ModelShape
from zoomkv.protocol.training import MethodTraining

__all__ = [
    "EvictionMethod",
    "KVMethod",
    "Memory",
    "MethodConfig",
    "MethodTraining",
    "ModelShape",
    "PrefillContext",
    "RecallableMethod",
    "RowBufferLike",
    "Selection",
    "get_method",
    "get_training",
    "list_methods",
    "register_method",
    "unregister_method",
]
