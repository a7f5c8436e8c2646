"""Distilling sekv's adapter against the full-attention teacher: recipes, synthetic data, teacher signals
cached once, and one readable Accelerate loop (``python -m zoomkv.train --recipe ...``)."""
