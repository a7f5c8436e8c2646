"""Pieces shared by the recallable methods (``quest``, ``clusterkv``): the dense first layers both papers
keep, the host-tier copy of every row, and small budget helpers.

Everything here works on a ``LayerMemory`` and keeps its tensors in the layer's tiers, never on the method
object (one method object serves every layer).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from zoomkv.errors import ConfigError
from zoomkv.memory.tiers import RowBuffer
from zoomkv.methods.base import PrefillContext, Selection

if TYPE_CHECKING:
    from zoomkv.memory.layer import LayerMemory


def kv_rows(value: torch.Tensor | RowBuffer | None) -> int:
    """Rows per KV head a device-tier KV buffer occupies: its allocated capacity, since that is what is held."""
    if value is None:
        return 0
    if isinstance(value, RowBuffer):
        return value.capacity
    return value.shape[2]


# -- dense layers (kept whole, exactly like ``full``) -------------------------------------------------------
def keep_dense(memory: LayerMemory, ctx: PrefillContext) -> None:
    memory.meta["dense"] = True
    memory.device_tier["keys"] = ctx.keys
    memory.device_tier["values"] = ctx.values


def is_dense(memory: LayerMemory) -> bool:
    return bool(memory.meta.get("dense", False))


def dense_append(memory: LayerMemory, key: torch.Tensor, value: torch.Tensor) -> None:
    # The same concatenation ``full`` does, so a dense layer costs (and computes) what ``full`` does.
    memory.device_tier["keys"] = torch.cat([memory.device_tier["keys"], key], dim=2)
    memory.device_tier["values"] = torch.cat([memory.device_tier["values"], value], dim=2)


def dense_select(memory: LayerMemory) -> Selection:
    # All rows in sequence order: the model's own mask (left padding) applies unchanged.
    return Selection(memory.device_tier["keys"], memory.device_tier["values"], use_model_mask=True)


# -- the host tier: every row, so any of them can be recalled -------------------------------------------
def store_host_rows(memory: LayerMemory, ctx: PrefillContext) -> None:
    memory.host_tier["keys"] = memory.host_rows(ctx.keys)
    memory.host_tier["values"] = memory.host_rows(ctx.values)
    if ctx.valid is not None:
        # [b, 1, n, 1] so it grows along the row axis like the keys do.
        memory.host_tier["valid"] = memory.host_rows(ctx.valid[:, None, :, None])


def append_host_rows(memory: LayerMemory, key: torch.Tensor, value: torch.Tensor) -> None:
    memory.host_tier["keys"].append(key)
    memory.host_tier["values"].append(value)
    if "valid" in memory.host_tier:
        # Generated rows are always real tokens.
        ones = torch.ones(key.shape[0], 1, key.shape[2], 1, dtype=torch.bool, device=key.device)
        memory.host_tier["valid"].append(ones)


def host_valid(memory: LayerMemory) -> torch.Tensor | None:
    """``[b, 1, n]`` bool (False on left padding), or None when nothing is padded."""
    buf = memory.host_tier.get("valid")
    return None if buf is None else buf.view()[:, :, :, 0]


def host_length(memory: LayerMemory) -> int:
    return memory.host_tier["keys"].length


def check_dense_layers(dense_layers: int) -> None:
    if dense_layers < 0:
        raise ConfigError(f"dense_layers must be >= 0, got {dense_layers}")


def check_group_score(group_score: str) -> None:
    if group_score not in ("max", "sum"):
        raise ConfigError(f"group_score must be 'max' or 'sum', got {group_score!r}")
