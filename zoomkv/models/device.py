"""The ``--dtype`` and ``--device`` settings every command that loads a model accepts."""

from __future__ import annotations

import torch

from zoomkv.errors import ZoomKVError

__all__ = ["DTYPES", "parse_dtype", "resolve_device"]

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


def parse_dtype(name: str) -> torch.dtype:
    """``float32``/``fp32``, ``float16``/``fp16``, ``bfloat16``/``bf16`` → the torch dtype (ZoomKVError otherwise)."""
    if name not in DTYPES:
        raise ZoomKVError(f"unknown dtype {name!r}; valid: {', '.join(DTYPES)}")
    return DTYPES[name]


def resolve_device(name: str | None) -> str:
    """``auto`` (or nothing) → ``cuda`` when available, else ``cpu``; any other name is used as given."""
    if name and name != "auto":
        return name
    return "cuda" if torch.cuda.is_available() else "cpu"
