"""zoomkv: keep the whole KV cache, hold little of it on the accelerator, recall what each step needs."""

__version__ = "0.1.0"

from zoomkv.budget import Budget  # noqa: E402
from zoomkv.errors import ZoomKVError  # noqa: E402
from zoomkv.memory import LayerMemory, MemoryReport, ZoomCache, attach  # noqa: E402
from zoomkv.methods import get_method, list_methods, register_method  # noqa: E402

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
