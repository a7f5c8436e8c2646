"""``full``: every row stays on the device tier and every step attends to all of them (the reference)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zoomkv.memory.tiers import RowBuffer
from zoomkv.protocol.method import KVMethod, MethodConfig, PrefillContext, Selection


@dataclass
class FullConfig(MethodConfig):
    pass


class Full(KVMethod):
    name = "full"
    config_class = FullConfig
    summary = "keep every row on the device tier; attend to all (the uncompressed reference)"
    uses_budget = False

    quantizable_device = True

    def compress(self, memory, ctx: PrefillContext) -> None:
        if memory.quantize_device:  # int8/int4 codes on the device tier, dequantized each step
            memory.device_tier["keys"] = memory.device_rows_buffer(ctx.keys, role="keys")
            memory.device_tier["values"] = memory.device_rows_buffer(ctx.values, role="values")
            return
        memory.device_tier["keys"] = ctx.keys
        memory.device_tier["values"] = ctx.values

    def append(self, memory, key: torch.Tensor, value: torch.Tensor) -> None:
        tier = memory.device_tier
        if isinstance(tier["keys"], RowBuffer):
            tier["keys"].append(key)
            tier["values"].append(value)
            return
        # Plain concatenation, as transformers' DynamicLayer does, so `full` costs what plain generate costs.
        tier["keys"] = torch.cat([tier["keys"], key], dim=2)
        tier["values"] = torch.cat([tier["values"], value], dim=2)

    def extend(self, memory, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.append(memory, keys, values)  # every row is kept: one concatenation for the whole input

    def select(self, memory, query: torch.Tensor) -> Selection:
        keys, values = memory.device_tier["keys"], memory.device_tier["values"]
        if isinstance(keys, RowBuffer):
            keys, values = keys.view(), values.view()
        return Selection(keys, values, use_model_mask=True)
