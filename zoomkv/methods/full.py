"""``full``: every row stays on the device tier and every step attends to all of them (the reference)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zoomkv.methods.base import KVMethod, MethodConfig, PrefillContext, Selection
from zoomkv.methods.registry import register_method


@dataclass
class FullConfig(MethodConfig):
    pass


@register_method
class Full(KVMethod):
    name = "full"
    config_class = FullConfig
    summary = "keep every row on the device tier; attend to all (the uncompressed reference)"
    uses_budget = False

    def compress(self, memory, ctx: PrefillContext) -> None:
        memory.device_tier["keys"] = ctx.keys
        memory.device_tier["values"] = ctx.values

    def append(self, memory, key: torch.Tensor, value: torch.Tensor) -> None:
        # Plain concatenation, as transformers' DynamicLayer does, so `full` costs what plain generate costs.
        memory.device_tier["keys"] = torch.cat([memory.device_tier["keys"], key], dim=2)
        memory.device_tier["values"] = torch.cat([memory.device_tier["values"], value], dim=2)

    def select(self, memory, query: torch.Tensor) -> Selection:
        return Selection(memory.device_tier["keys"], memory.device_tier["values"], use_model_mask=True)
