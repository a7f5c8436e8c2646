"""Distilling a trainable method's modules against the full-attention teacher: recipes, teacher signals
cached once, and one readable, method-agnostic Accelerate loop (``python -m zoomkv.train --recipe ...``);
what is method-specific comes from the method's registered ``MethodTraining``."""
