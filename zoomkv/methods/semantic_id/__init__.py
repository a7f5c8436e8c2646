"""``semantic_id``: semantic-ID merging with recallable originals — the method (``method.py``), its merging
kernels (``merging.py``), its trainable projector (``projector.py``) and the projector's training objective
(``objective.py``)."""

from zoomkv.methods.semantic_id.method import SemanticID, SemanticIDConfig
from zoomkv.methods.semantic_id.objective import SemanticIDTraining
from zoomkv.methods.semantic_id.projector import SemanticProjector

__all__ = ["SemanticID", "SemanticIDConfig", "SemanticIDTraining", "SemanticProjector"]
