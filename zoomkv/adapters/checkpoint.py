"""The training checkpoint layout: what the trainer writes every ``save_every`` steps and ``zoomkv export``
(``ZoomAdapter.from_pretrained``) reads.

A training checkpoint folder holds (other files, e.g. optimizer state or the resolved recipe, are ignored):

    adapter_state.safetensors   the adapter modules' state_dict (module_tensors(modules))
    adapter_meta.json           {"method": str, "hyper": {...}, "base_model": base_fingerprint(model),
                                 "shape": ModelShape.from_model(model).to_dict(),
                                 "state_sha256": of adapter_state.safetensors (checked on every read),
                                 "budget": optional, "step": optional, ...}

``write_checkpoint`` writes exactly that, for the training loop to call. An exported adapter folder is a
valid CHECKPOINT too (re-export, e.g. to add scores).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from zoomkv.adapters.config import CONFIG_NAME, read_json_file
from zoomkv.adapters.errors import AdapterConfigError, AdapterNotFoundError
from zoomkv.adapters.files import INCOMPLETE_MARKER, is_incomplete, write_folder_atomically
from zoomkv.adapters.weights import module_tensors, read_weights, sha256, tensors_to_bytes, weights_identity
from zoomkv.errors import ConfigError
from zoomkv.protocol.shape import ModelShape

STATE_NAME = "adapter_state.safetensors"
META_NAME = "adapter_meta.json"
META_REQUIRED = ("method", "hyper", "base_model", "shape", "state_sha256")


def checkpoint_files(modules: torch.nn.Module, *, method: str, hyper: dict[str, Any], base_model: dict[str, Any],
                     shape: ModelShape, budget: str | int | float | None = None,
                     extra: dict[str, Any] | None = None) -> dict[str, bytes]:
    """The two files of a checkpoint (name → bytes), for callers that add files of their own (the trainer
    adds its optimizer state) before writing the folder atomically."""
    state = tensors_to_bytes(module_tensors(modules), weights_identity(method, hyper, base_model))
    meta = {"method": method, "hyper": hyper, "base_model": base_model, "shape": shape.to_dict(),
            "budget": budget, **(extra or {}), "state_sha256": sha256(state)}
    return {STATE_NAME: state, META_NAME: (json.dumps(meta, sort_keys=True, indent=2) + "\n").encode("utf-8")}


def write_checkpoint(folder: str | Path, modules: torch.nn.Module, *, method: str, hyper: dict[str, Any],
                     base_model: dict[str, Any], shape: ModelShape, budget: str | int | float | None = None,
                     extra: dict[str, Any] | None = None, overwrite: bool = True) -> Path:
    """Write a training checkpoint folder (weights and ``adapter_meta.json`` with their checksum), all or nothing."""
    files = checkpoint_files(modules, method=method, hyper=hyper, base_model=base_model, shape=shape,
                             budget=budget, extra=extra)
    return write_folder_atomically(folder, files, overwrite=overwrite)


def is_checkpoint(path: Path) -> bool:
    """A training checkpoint folder (not an exported adapter, which has its own config and weights)."""
    return (path / META_NAME).is_file() and (path / STATE_NAME).is_file() and not (path / CONFIG_NAME).is_file()


# The trainer's step folders carry its state and end with DONE (zoomkv.train.checkpoints): one with the state and
# without DONE was never finished.
TRAINER_STATE_NAME = "trainer_state.json"
DONE_NAME = "DONE"


def check_finished(path: Path) -> None:
    """Refuse a checkpoint folder that an interrupted or started-over write left: marked ``.zoomkv-incomplete``,
    or a trainer's step folder without its ``DONE``. Such a folder exports and loads nothing."""
    if is_incomplete(path):
        raise AdapterNotFoundError(f"{path} is marked unfinished ({INCOMPLETE_MARKER}: an interrupted write, or a run "
                                   "started over) and is not loaded; use a finished checkpoint")
    if (path / TRAINER_STATE_NAME).is_file() and not (path / DONE_NAME).is_file():
        raise AdapterNotFoundError(f"{path} is a training checkpoint without {DONE_NAME}: it was never finished and "
                                   "is not loaded; use a finished checkpoint")


def read_checkpoint(path: str | Path) -> tuple[dict[str, Any], ModelShape, dict[str, torch.Tensor]]:
    """``(meta, shape, tensors)`` of a training checkpoint folder; safetensors + JSON only. An unfinished one
    (``check_finished``) is refused."""
    path = Path(path)
    if not path.is_dir():
        raise AdapterNotFoundError(f"checkpoint folder not found: {path}")
    check_finished(path)
    if not (path / META_NAME).is_file() or not (path / STATE_NAME).is_file():
        raise AdapterNotFoundError(
            f"{path} is not a training checkpoint: it needs {STATE_NAME} and {META_NAME} (or an exported adapter)"
        )
    meta = read_json_file(path / META_NAME)
    if not isinstance(meta, dict):
        raise AdapterConfigError(f"{path / META_NAME}: expected a JSON object")
    missing = [k for k in META_REQUIRED if k not in meta]
    if missing:
        raise AdapterConfigError(f"{path / META_NAME}: missing field(s) {missing}")
    for key, kind in (("method", str), ("hyper", dict), ("base_model", dict), ("state_sha256", str)):
        if not isinstance(meta[key], kind):
            raise AdapterConfigError(f"{path / META_NAME}: field {key!r} has type {type(meta[key]).__name__}")
    try:
        shape = ModelShape.from_dict(meta["shape"])
    except ConfigError as err:
        raise AdapterConfigError(f"{path / META_NAME}: invalid 'shape' ({err})") from err
    return meta, shape, read_weights(path / STATE_NAME, meta["state_sha256"], recorded_in=str(path / META_NAME))
