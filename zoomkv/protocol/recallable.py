"""The recallable family: methods that keep every row on the host tier and recall what a step needs.

``RecallableMethod`` writes the shared prologue once: the dense first layers the published methods keep
(Quest, ClusterKV, InfiniGen), the host-tier copy of every row, and the device-tier recall buffer. A
subclass builds its index at prefill (``build_index``), extends it per decode step (``index_append``) and
picks rows (``select_rows``). The functions below are the same pieces for methods with their own layout.

Recall copies chosen host-tier rows into the layer's device-tier recall buffer. On a CUDA machine the host
tier is pinned CPU memory, read from the GPU by one kernel at the indices the step chose there
(``RowBuffer.gather``, ``zoomkv.kernels.gather_rows``), and new rows go to it by asynchronous copies: a step never
waits for the host. The rows' padding mask (``valid``) is a device-tier index for the same reason. On a
CPU-only machine both tiers are RAM and the copy is a plain gather, but the buffer is still the device tier's
and still counted.

Everything here works on a ``Memory`` (the object the runtime hands a method; only its tiers,
``meta`` and buffer factories are used) and keeps its tensors in the layer's tiers, never on the method
object (one method object serves every layer).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from zoomkv import kernels
from zoomkv.errors import ConfigError
from zoomkv.kernels import plan as kernel_plan
from zoomkv.protocol.dense import ROOM, append_all, keep_all, select_all
from zoomkv.protocol.method import KVMethod, Memory, PrefillContext, RowBufferLike, Selection
from zoomkv.protocol.phases import phase


# -- dense layers (kept whole, exactly like ``full``: zoomkv.protocol.dense) ------------------------------
def keep_dense(memory: Memory, ctx: PrefillContext) -> None:
    memory.meta["dense"] = True
    keep_all(memory, ctx)


def is_dense(memory: Memory) -> bool:
    return bool(memory.meta.get("dense", False))


def dense_append(memory: Memory, key: torch.Tensor, value: torch.Tensor) -> None:
    append_all(memory, key, value)  # what ``full`` does, so a dense layer costs (and computes) what it does


def dense_select(memory: Memory) -> Selection:
    return select_all(memory)


# -- the host tier: every row, so any of them can be recalled -------------------------------------------
def store_host_rows(memory: Memory, ctx: PrefillContext) -> None:
    memory.host_tier["keys"] = memory.host_rows(ctx.keys, role="keys")
    memory.host_tier["values"] = memory.host_rows(ctx.values, role="values")
    store_valid(memory, ctx.valid)


def append_host_rows(memory: Memory, key: torch.Tensor, value: torch.Tensor) -> None:
    memory.host_tier["keys"].append(key)
    memory.host_tier["values"].append(value)
    append_valid(memory, key)


def store_valid(memory: Memory, valid: torch.Tensor | None) -> None:
    """Which host rows are real tokens, ``[b, n]`` (None: all of them), kept on the device tier: the selection
    masks padding there at every step, and a mask on the host would make a GPU step wait (one byte a row and
    sequence, counted in the device bytes; only a padded batch has one)."""
    if valid is not None:  # [b, 1, n, 1] so it grows along the row axis like the keys do
        memory.device_tier["valid"] = memory.device_rows_buffer(valid[:, None, :, None], room=ROOM)


def append_valid(memory: Memory, key: torch.Tensor) -> None:
    """A step's rows ``key`` ``[b, h, t, d]`` are real tokens."""
    if "valid" in memory.device_tier:
        memory.device_tier["valid"].append(torch.ones(key.shape[0], 1, key.shape[2], 1, dtype=torch.bool,
                                                      device=key.device))


def host_valid(memory: Memory) -> torch.Tensor | None:
    """``[b, 1, n]`` bool: which host rows are real tokens (False on left padding), on the device tier; None when
    nothing is padded."""
    buf = memory.device_tier.get("valid")
    return None if buf is None else buf.view()[:, :, :, 0]


def host_length(memory: Memory) -> int:
    return memory.host_tier["keys"].length


def check_dense_layers(dense_layers: int) -> None:
    if dense_layers < 0:
        raise ConfigError(f"dense_layers must be >= 0, got {dense_layers}")


def check_group_score(group_score: str) -> None:
    if group_score not in ("max", "sum"):
        raise ConfigError(f"group_score must be 'max' or 'sum', got {group_score!r}")


# -- recall: host-tier rows into the device tier's recall buffer -----------------------------------------
def reserve_recall_buffer(memory, rows: int, prefix: str = "recall") -> None:
    """Make sure the device tier has ``rows`` recall rows per KV head (reallocated only when growing)."""
    buf = memory.device_tier.get(f"{prefix}_keys")
    if buf is None or buf.shape[2] < rows:
        memory.device_tier[f"{prefix}_keys"] = memory.device_buffer(rows, memory.key_dim)
        memory.device_tier[f"{prefix}_values"] = memory.device_buffer(rows, memory.value_dim)


def recall_rows(
    memory, keys: RowBufferLike, values: RowBufferLike, idx: torch.Tensor | None, prefix: str = "recall"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Gather rows ``idx`` (``[b, h, k]``, or None for all rows) of the host-tier row buffers ``keys`` /
    ``values`` into the device recall buffer; returns views of the filled part and the host row each of their
    slots holds (``idx`` itself, in another order where only the misses were read; None for all rows in order).
    Quantized buffers decode only the rows gathered.

    Where the host tier is across a bus (pinned memory on a GPU machine; ``recall_misses_only`` elsewhere), a
    row the buffer already holds from an earlier step stays in its slot and only the rows it misses are read:
    consecutive steps pick mostly the same rows (sekv, Quest and exact top-B read 20-26% of them a step at
    4K, B=128: ``scripts/recall_reads.py``), and each row read crosses PCIe. Attention does not care in which
    order its rows sit."""
    with phase("recall"):
        k = keys.length if idx is None else idx.shape[2]
        tier = memory.device_tier
        grown = f"{prefix}_keys" not in tier or tier[f"{prefix}_keys"].shape[2] < k
        reserve_recall_buffer(memory, k, prefix)
        rk = tier[f"{prefix}_keys"][:, :, :k]
        rv = tier[f"{prefix}_values"][:, :, :k]
        if idx is not None and idx.device != rk.device:  # an index the host made (SentenceKV's): the plan, the held
            idx = idx.to(rk.device, non_blocking=True)  # rows' map and the reads run where the buffer is
        if idx is None or not misses_only(memory):
            tier.pop(f"{prefix}_held", None)
            gather_into(keys, idx, rk)
            gather_into(values, idx, rv)
            return rk, rv, idx
        dest, fetch, rows = swaps(memory, prefix, idx, fresh=grown)
        keys.gather_to_slots(idx, dest, fetch, rk)
        values.gather_to_slots(idx, dest, fetch, rv)
        return rk, rv, rows


def swaps(memory, prefix: str, idx: torch.Tensor, fresh: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``plan_swaps`` for the device buffer ``prefix`` (its first ``k`` slots, ``k = idx.shape[2]``), against the
    rows it held after the last plan (``{prefix}_held`` on the device tier, updated here); ``fresh``: the buffer
    holds nothing yet (new, or reallocated)."""
    tier, k = memory.device_tier, idx.shape[2]
    held = tier.get(f"{prefix}_held")
    if fresh or held is None or held.shape[:2] != idx.shape[:2]:  # nothing held that these slots can keep
        start = torch.full_like(idx, -1)
    elif held.shape[2] != k:  # a step that asks for more or fewer rows (Quest's partial page): its k slots
        start = held[:, :, :k] if held.shape[2] > k else F.pad(held, (0, k - held.shape[2]), value=-1)
    else:
        start = held
    dest, fetch, rows = plan_swaps(start, idx)
    if start is held:  # in place: a step captured in a CUDA graph hands its slot map to the next one there
        held.copy_(rows)
    else:
        tier[f"{prefix}_held"] = rows
    return dest, fetch, rows


def plan_swaps(held: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where this step's rows ``idx`` (``[b, h, k]``, distinct in each (b, h)) go in a recall buffer whose slots
    hold the host rows ``held`` (``[b, h, k]``, -1: nothing): a row already held keeps its slot, a missing row
    takes a slot whose row is no longer wanted (the j-th missing row the j-th such slot). Returns ``dest``, the
    slot of each of ``idx`` (a permutation of the slots), ``fetch``, which of ``idx`` must be read, and the
    slots' rows after. Fixed shapes and no host read: on a GPU the plan stays there (one kernel:
    ``zoomkv.kernels.plan``; these torch ops are its reference)."""
    if kernels.usable(held, idx) and kernel_plan.plan_swaps_fits(idx):  # one launch on a GPU
        return kernel_plan.plan_swaps(held, idx)
    k = idx.shape[-1]
    idx, held = idx.contiguous(), held.contiguous()
    held_sorted, held_slot = held.sort(-1)
    at = torch.searchsorted(held_sorted, idx).clamp_max(k - 1)
    fetch = held_sorted.gather(-1, at) != idx  # not held
    idx_sorted = idx.sort(-1).values
    free = idx_sorted.gather(-1, torch.searchsorted(idx_sorted, held).clamp_max(k - 1)) != held  # not wanted
    slots = torch.arange(k, device=idx.device).expand_as(idx)
    free_slot = torch.full((*idx.shape[:-1], k + 1), k, dtype=idx.dtype, device=idx.device)
    free_slot.scatter_(-1, torch.where(free, free.cumsum(-1) - 1, k), slots)  # [.., r]: the r-th free slot
    miss_rank = torch.where(fetch, fetch.cumsum(-1) - 1, k)
    dest = torch.where(fetch, free_slot.gather(-1, miss_rank), held_slot.gather(-1, at))
    return dest, fetch, torch.empty_like(held).scatter_(-1, dest, idx)


_MISSES_ONLY: bool | None = None  # None: where the host tier is pinned (a GPU machine)


@contextlib.contextmanager
def recall_misses_only(on: bool = True) -> Iterator[None]:
    """Recall only the rows the buffer misses (``on``), or every row every step, whatever the machine: the GPU's
    way tested on the CPU, or compared with reading every row (``ZOOMKV_RECALL_MISSES=0`` turns it off too)."""
    global _MISSES_ONLY
    before, _MISSES_ONLY = _MISSES_ONLY, on
    try:
        yield
    finally:
        _MISSES_ONLY = before


def misses_only(memory) -> bool:
    """Whether this layer's recalls read only the rows their buffers miss (on where the host tier is pinned)."""
    if _MISSES_ONLY is not None:
        return _MISSES_ONLY
    return bool(getattr(memory, "pin_host", False)) and os.environ.get("ZOOMKV_RECALL_MISSES", "1") != "0"


def gather_into(rows: RowBufferLike, idx: torch.Tensor | None, out: torch.Tensor) -> None:
    """Rows ``idx`` of a host-tier buffer into the device tensor ``out``: a plain buffer of pinned rows is read
    by one GPU kernel (``RowBuffer.gather``: no host synchronisation), a per-token coded one gathers its codes
    that way and decodes them where ``idx`` is."""
    rows.gather(idx, out=out)


def padding_bias(valid: torch.Tensor | None, idx: torch.Tensor | None, heads: int, dtype, device) -> torch.Tensor | None:
    """``-inf`` logit bias for selected rows that are left padding. ``valid`` is ``[b, n]`` or ``[b, 1, n]``."""
    if valid is None:
        return None
    if valid.dim() == 2:
        valid = valid[:, None, :]
    rows = valid.expand(-1, heads, -1)
    if idx is not None:
        rows = torch.gather(rows, 2, idx.to(rows.device))
    bias = torch.zeros(rows.shape, dtype=dtype, device=device)
    return bias.masked_fill_(~rows.to(device), float("-inf"))


class RecallableMethod(KVMethod):
    """Base of the methods that keep every row on the host tier (Quest, ClusterKV, InfiniGen).

    Layers below ``config.dense_layers`` are kept whole, exactly as ``full`` keeps them. Every other layer
    stores all rows on the host tier; the subclass keeps its index on the device tier and picks the rows
    each step recalls into the recall buffer.
    """

    recallable = True
    # device_rows is KVMethod's: dense layers hold "keys", compressed layers only the recall buffer (an
    # index is metadata, counted in bytes but not in rows).

    def dense_layer(self, layer_idx: int, num_layers: int) -> bool:
        return layer_idx < self.config.dense_layers

    def compress(self, memory: Memory, ctx: PrefillContext) -> None:
        """Every row to the host tier, then the method's index (``build_index``); a dense layer keeps its rows whole."""
        if self.dense_layer(ctx.layer_idx, ctx.num_layers):
            keep_dense(memory, ctx)
            return
        store_host_rows(memory, ctx)
        self.build_index(memory, ctx)

    def append(self, memory: Memory, key: torch.Tensor, value: torch.Tensor) -> None:
        if is_dense(memory):
            dense_append(memory, key, value)
            return
        before = host_length(memory)
        append_host_rows(memory, key, value)
        self.index_append(memory, key, value, before)

    def extend(self, memory: Memory, keys: torch.Tensor, values: torch.Tensor) -> None:
        if is_dense(memory):  # a dense layer keeps every row: one concatenation for the whole input
            dense_append(memory, keys, values)
            return
        super().extend(memory, keys, values)

    def select(self, memory: Memory, query: torch.Tensor) -> Selection:
        if is_dense(memory):
            return dense_select(memory)
        return self.select_rows(memory, query)

    # -- what a subclass writes -----------------------------------------------------------------------------
    def build_index(self, memory: Memory, ctx: PrefillContext) -> None:
        """Build the device-tier index of a compressed layer once its rows are on the host tier."""
        raise NotImplementedError

    def index_append(self, memory: Memory, key: torch.Tensor, value: torch.Tensor, before: int) -> None:
        """Extend the index with a decode step's row (``before``: host rows before it)."""
        raise NotImplementedError

    def select_rows(self, memory: Memory, query: torch.Tensor) -> Selection:
        """Recall the rows this step attends to."""
        raise NotImplementedError
