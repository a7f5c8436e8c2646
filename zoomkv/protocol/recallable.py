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

import torch

from zoomkv.errors import ConfigError
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather rows ``idx`` (``[b, h, k]``, or None for all rows) of the host-tier row buffers ``keys`` /
    ``values`` into the device recall buffer; returns views of the filled part. Quantized buffers decode
    only the rows gathered."""
    with phase("recall"):
        k = keys.length if idx is None else idx.shape[2]
        reserve_recall_buffer(memory, k, prefix)
        rk = memory.device_tier[f"{prefix}_keys"][:, :, :k]
        rv = memory.device_tier[f"{prefix}_values"][:, :, :k]
        gather_into(keys, idx, rk)
        gather_into(values, idx, rv)
        return rk, rv


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
