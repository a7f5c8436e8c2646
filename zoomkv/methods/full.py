"""``full``: every row stays on the device tier and every step attends to all of them (the reference).

Its rows sit in preallocated buffers a step writes into, attended per KV head without copying them per query
head (``zoomkv.protocol.dense``): on a GPU that costs less than transformers' own ``DynamicCache``, which
concatenates the whole KV anew at every step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zoomkv.protocol.dense import append_all, keep_all, select_all
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
        # int8/int4 codes on the device tier when the cache quantizes every tier, dequantized each step
        keep_all(memory, ctx)

    def append(self, memory, key: torch.Tensor, value: torch.Tensor) -> None:
        append_all(memory, key, value)

    def extend(self, memory, keys: torch.Tensor, values: torch.Tensor) -> None:
        append_all(memory, keys, values)  # every row is kept: the whole input at once

    def select(self, memory, query: torch.Tensor) -> Selection:
        return select_all(memory)
