"""``sekv``: the trained zoom-in method — the method (``method.py``), its key codes (``codes.py``), its
trainable modules (``modules.py``) and its training objective (``objective.py``)."""

from zoomkv.methods.sekv.method import SeKV, SeKVConfig
from zoomkv.methods.sekv.modules import SeKVAdapter
from zoomkv.methods.sekv.objective import SeKVTraining

__all__ = ["SeKV", "SeKVConfig", "SeKVAdapter", "SeKVTraining"]
