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
    """``auto`` (or nothing) → ``cuda`` when available, else ``cpu``; any other name is used as given, once
    torch knows it and this machine has it (``cuda:7`` on a machine with two GPUs is one ``ZoomKVError``)."""
    if not name or name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError, TypeError):
        raise ZoomKVError(f"unknown device {name!r}; valid: auto, cpu, cuda, cuda:N, mps, xpu") from None
    if device.type == "cpu":
        return name
    backend = getattr(torch, device.type, None)
    available = getattr(backend, "is_available", None)
    if available is None or not available():
        raise ZoomKVError(f"device {name!r}: no {device.type} device on this machine (try --device cpu)")
    count = getattr(backend, "device_count", lambda: 1)()
    if device.index is not None and device.index >= count:
        raise ZoomKVError(f"device {name!r}: this machine has {count} {device.type} device(s), "
                          f"{device.type}:0 to {device.type}:{count - 1}")
    return name
