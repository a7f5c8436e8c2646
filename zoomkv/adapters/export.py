"""``zoomkv export``: a training checkpoint (or an adapter folder) → an adapter folder, read back once written."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from zoomkv.adapters.errors import AdapterNotFoundError
from zoomkv.adapters.model import ZoomAdapter


def export_checkpoint(checkpoint: str | Path, out: str | Path, *, scores: dict[str, Any] | None = None,
                      budget: str | int | float | None = None, overwrite: bool = False) -> Path:
    """Checkpoint → adapter folder (``adapter_config.json``, ``adapter_model.safetensors``, ``README.md``)."""
    if not Path(checkpoint).is_dir():
        raise AdapterNotFoundError(f"checkpoint folder not found: {checkpoint}")
    adapter = ZoomAdapter.from_pretrained(checkpoint, local_files_only=True)
    if budget is not None:
        adapter.config = dataclasses.replace(adapter.config, budget=budget)
    out = adapter.save_pretrained(out, scores=scores, overwrite=overwrite)
    ZoomAdapter.from_pretrained(out)  # read back what was written: an export that cannot load is a bug
    return out
