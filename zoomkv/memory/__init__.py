from zoomkv.memory.cache import LayerReport, MemoryReport, ZoomCache, attach
from zoomkv.memory.layer import LayerMemory

__all__ = ["ZoomCache", "LayerMemory", "MemoryReport", "LayerReport", "attach"]
