"""``zoomkv export``: a training checkpoint (or an adapter folder) → an adapter folder, read back once written."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from zoomkv.adapters.errors import AdapterError, AdapterNotFoundError
from zoomkv.adapters.model import ZoomAdapter
from zoomkv.locks import lock_beside
from zoomkv.models.registry import same_base_name


def check_scores_base(scores: dict[str, Any], base_name: str | None) -> None:
    """Refuse scores whose rows name another base model than the adapter's (a registered name and its Hub id
    are one model): a card would show another model's numbers as this adapter's."""
    others = [m for m in scores.get("models") or [] if not same_base_name(m, base_name)]
    if others:
        raise AdapterError(f"--scores were measured on {', '.join(repr(m) for m in others)}, not on the adapter's "
                           f"base model {base_name!r}; evaluate the adapter on its own base model "
                           f"(zoomkv eval --model {base_name} --adapter ...)")


def export_checkpoint(checkpoint: str | Path, out: str | Path, *, scores: dict[str, Any] | None = None,
                      budget: str | int | float | None = None, overwrite: bool = False,
                      license: str | None = None, stamp_identity: bool = False) -> Path:
    """Checkpoint → adapter folder (``adapter_config.json``, ``adapter_model.safetensors``, ``README.md``).
    Scores measured on another base model than the adapter's are refused. ``stamp_identity``: weights that
    record no identity are taken as their config describes them and written with it."""
    if not Path(checkpoint).is_dir():
        raise AdapterNotFoundError(f"checkpoint folder not found: {checkpoint}")
    adapter = ZoomAdapter.from_pretrained(checkpoint, local_files_only=True, unrecorded_identity_ok=stamp_identity)
    if scores:
        check_scores_base(scores, adapter.config.base_model.get("name"))
    if budget is not None:
        adapter.config = dataclasses.replace(adapter.config, budget=budget)
    # One writer per target: a second export of it meanwhile would find the first one's staging as "an
    # interrupted export" and replace it. Beside the target: the folder itself is swapped by a rename.
    with lock_beside(out, "export", "--out"):
        out = adapter.save_pretrained(out, scores=scores, overwrite=overwrite, license=license)
        ZoomAdapter.from_pretrained(out)  # read back what was written: an export that cannot load is a bug
    return out
