"""zoomkv: keep the whole KV cache, hold little of it on the accelerator, recall what each step needs.

The package face: importing ``zoomkv`` (or any part of it) registers every shipped method, so
``get_method`` and the adapter loader know them all. The layers are in docs/ARCHITECTURE.md.
"""

from zoomkv.budget import Budget
from zoomkv.errors import ZoomKVError
from zoomkv.memory import LayerMemory, MemoryReport, ZoomCache, attach
from zoomkv.methods import get_method, list_methods, register_method
from zoomkv.version import __version__

__all__ = [
    "__version__",
    "Budget",
    "ZoomKVError",
    "ZoomCache",
    "LayerMemory",
    "MemoryReport",
    "attach",
    "get_method",
    "list_methods",
    "register_method",
]
