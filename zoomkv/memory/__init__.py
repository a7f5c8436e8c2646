from zoomkv.memory.cache import LayerReport, MemoryReport, ZoomCache, attach
from zoomkv.memory.layer import LayerMemory
from zoomkv.memory.spec import CacheSpec

__all__ = ["ZoomCache", "CacheSpec", "LayerMemory", "MemoryReport", "LayerReport", "attach"]
