"""Adapter weights as safetensors: tensors and a JSON header, nothing that executes on load.

Reading is strict: a truncated or corrupt file, a checksum that is missing or does not match, tensors the
method's modules lack or need, and shapes other than the modules' are each a distinct error.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from zoomkv.adapters.errors import (
    AdapterKeysError,
    AdapterNotFoundError,
    AdapterShapeError,
    AdapterWeightsError,
)


def module_tensors(modules: torch.nn.Module) -> dict[str, torch.Tensor]:
    # Cloned and contiguous on the CPU: safetensors refuses tensors that share storage (tied weights)
    # and views, and the file must not depend on the device the adapter was trained on.
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in modules.state_dict().items()}


def tensors_to_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    # Only the one conventional metadata key: safetensors writes metadata in hash-map order, so two keys
    # would make two exports of the same adapter differ byte-wise (and in their checksum).
    return st_save(tensors, metadata={"format": "pt"})


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_weights(path: str | Path, expected_sha256: str | None, *, recorded_in: str = "its config") -> dict[str, torch.Tensor]:
    """The tensors of ``path``, after checking its bytes against ``expected_sha256``. The checksum is never
    optional: a file whose checksum was not recorded (``None``) is refused, not loaded unverified."""
    path = Path(path)
    if not path.is_file():
        raise AdapterNotFoundError(f"no adapter weights at {path}")
    if not isinstance(expected_sha256, str):
        raise AdapterWeightsError(
            f"{path}: no checksum recorded in {recorded_in} (weights_sha256), so the weights cannot be verified and "
            "are not loaded; export the adapter again with zoomkv (zoomkv export FOLDER --out NEW)"
        )
    data = path.read_bytes()
    if sha256(data) != expected_sha256.lower():
        raise AdapterWeightsError(
            f"{path}: checksum mismatch (the file is corrupt or truncated, or not the one its config describes)"
        )
    try:
        # From bytes, not load_file: the checksum above and the parse read the very same bytes.
        return st_load(data)
    except (SafetensorError, ValueError, RuntimeError) as err:
        raise AdapterWeightsError(f"{path}: not a readable safetensors file (corrupt or truncated: {err})") from err


def load_into(modules: torch.nn.Module, tensors: dict[str, torch.Tensor], source: str = "adapter weights") -> None:
    """Copy ``tensors`` into ``modules`` after checking the key set and every shape (strictly)."""
    check_tensors(modules.state_dict(), tensors, source)
    modules.load_state_dict(tensors, strict=True)


def check_tensors(expected: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor],
                  source: str = "adapter weights") -> None:
    """``tensors`` have exactly the keys and shapes of ``expected`` (a state dict, possibly of modules built on
    the meta device: then nothing has been allocated yet)."""
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {missing}")
        if unexpected:
            parts.append(f"unexpected {unexpected}")
        raise AdapterKeysError(f"{source}: tensors do not match the method's modules: {'; '.join(parts)}")
    wrong = [
        f"{k}: file {tuple(tensors[k].shape)} vs modules {tuple(v.shape)}"
        for k, v in expected.items()
        if tuple(tensors[k].shape) != tuple(v.shape)
    ]
    if wrong:
        raise AdapterShapeError(f"{source}: wrong shape(s): {'; '.join(wrong)}")


def check_values(tensors: dict[str, torch.Tensor], source: str = "adapter weights") -> None:
    """Every floating-point tensor holds finite numbers only: NaN or infinity in a trained module is refused at
    load, not met as a crash (or a silent NaN) at the first prompt."""
    bad = [k for k, t in sorted(tensors.items()) if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:
        raise AdapterWeightsError(f"{source}: non-finite values (NaN or infinity) in {bad}")
