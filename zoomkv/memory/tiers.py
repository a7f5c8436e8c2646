"""The two memory tiers and a growable row buffer.

The *device tier* is the accelerator (or the CPU when there is none); the *host tier* is CPU memory,
pinned on a CUDA machine so copies back to the device can be non-blocking. Every tensor a layer's memory
holds lives in exactly one ``Tier`` dict, so ``memory_report()`` is just the sum of ``nbytes`` per tier.
"""

from __future__ import annotations

import torch

from zoomkv.kernels.gather import gather_rows, gather_to_slots_reference
from zoomkv.memory import pinned as pinned_memory


class RowBuffer:
    """A ``[batch, heads, capacity, dim]`` tensor filled along the row axis.

    Appending grows capacity in chunks instead of re-concatenating every step, which keeps decoding O(1)
    amortised per row. ``nbytes`` counts the capacity actually allocated, since that is what is held.
    """

    GROW_ROWS = 128

    def __init__(self, data: torch.Tensor, *, pinned: bool = False):
        self.pinned = pinned and data.device.type == "cpu"
        self.data = pinned_memory.copy_of(data) if self.pinned and not data.is_pinned() else data
        self.length = data.shape[2]
        self.in_flight = False  # pinned rows written by an asynchronous copy from the GPU not yet waited for
        self._length_tensor: torch.Tensor | None = None  # ``length`` on the device, once asked for

    @classmethod
    def with_room(cls, data: torch.Tensor, room: int, *, pinned: bool = False) -> RowBuffer:
        """A buffer holding ``data`` with ``room`` more rows allocated after it (none, where it is: ``data``
        itself); ``pinned``: in pinned host memory, a GPU's rows copied there without waiting."""
        if room <= 0 and not (pinned and data.is_cuda):
            return cls(data, pinned=pinned)
        b, h, n, d = data.shape
        device = torch.device("cpu") if pinned else data.device
        buf = cls.empty_like(b, h, n + room, d, dtype=data.dtype, device=device, pinned=pinned)
        buf.append(data)
        return buf

    @staticmethod
    def _allocate(shape, dtype: torch.dtype, device: torch.device, pinned: bool) -> torch.Tensor:
        """Room for rows: page-locked host memory at its size (``zoomkv.memory.pinned``) or plain on ``device``."""
        return pinned_memory.empty(shape, dtype) if pinned else torch.empty(shape, dtype=dtype, device=device)

    @classmethod
    def empty_like(cls, batch: int, heads: int, rows: int, dim: int, *, dtype: torch.dtype,
                   device: torch.device, pinned: bool = False) -> RowBuffer:
        data = cls._allocate((batch, heads, rows, dim), dtype, device, pinned and device.type == "cpu")
        buf = cls(data, pinned=pinned)
        buf.length = 0
        return buf

    @property
    def capacity(self) -> int:
        return self.data.shape[2]

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def length_tensor(self) -> torch.Tensor:
        """``length`` as a one-element int64 tensor where the buffer lives, advanced by every later append on the
        device (no host read): a step of fixed shapes reads its row count there, so a CUDA graph of it replays with
        the count of the step it runs, not of the one it was captured in (``zoomkv.memory.graphs``)."""
        if self._length_tensor is None:
            self._length_tensor = torch.full((1,), self.length, dtype=torch.long, device=self.data.device)
        return self._length_tensor

    def view(self) -> torch.Tensor:
        """Every row, where the buffer lives (after the copies in flight into it have landed: a host read)."""
        self.wait()
        return self.data[:, :, : self.length]

    def rows_on(self, device: torch.device) -> torch.Tensor:
        """Every row on ``device``: pinned rows go to the GPU by an asynchronous copy queued after the ones that
        wrote them (no host wait)."""
        if self.pinned and torch.device(device).type == "cuda":
            return self.data[:, :, : self.length].to(device, non_blocking=True)
        return self.view().to(device)

    def gather(self, idx: torch.Tensor | None, out: torch.Tensor | None = None,
               fetch: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``idx`` (``[b, h, k]`` row ids; None: every row) as a ``[b, h, k, dim]`` tensor: where the
        buffer lives, or, for pinned rows and indices on the GPU, on the GPU, read there by one kernel with no
        host synchronisation (``zoomkv.kernels.gather``); into ``out`` when given. ``fetch`` (``[b, h, k]``
        bool): the rows wanted; the kernel leaves the others unread (their entries are then undefined)."""
        if self.pinned and idx is not None and idx.is_cuda:  # in stream order: nothing to wait for
            return gather_rows(self.data[:, :, : self.length], idx, out, fetch=fetch)
        if self.pinned and idx is None and out is not None and out.is_cuda:
            return out.copy_(self.data[:, :, : self.length], non_blocking=True)
        if idx is None:
            rows = self.view()
            return rows if out is None else out.copy_(rows, non_blocking=True)
        # Every allocated row, not the first ``length``: the indices name filled rows only, and a captured step's
        # gather must not hold the length of the step it was captured in.
        self.wait()
        rows = self.data
        at = idx.to(rows.device)[..., None].expand(-1, -1, -1, rows.shape[-1])
        found = rows.gather(2, at)
        return found if out is None else out.copy_(found, non_blocking=True)

    def gather_to_slots(self, idx: torch.Tensor, dest: torch.Tensor, fetch: torch.Tensor, out: torch.Tensor) -> None:
        """Rows ``idx`` into slots ``dest`` of ``out`` where ``fetch`` (``[b, h, k]`` each; the other slots keep
        what they hold): pinned rows are read from the GPU by one kernel that skips the rows not fetched."""
        if self.pinned and idx.is_cuda:
            gather_rows(self.data[:, :, : self.length], idx, out, dest=dest, fetch=fetch)
        else:
            gather_to_slots_reference(self.gather(idx), out, dest, fetch)

    def append(self, rows: torch.Tensor) -> None:
        n = rows.shape[2]
        self.reserve(n)
        # Into pinned host memory from the GPU: asynchronous, in stream order. Every later read on the GPU
        # (gather_rows) comes after it on the same stream; a read on the host calls wait() first.
        to_host = self.pinned and rows.is_cuda
        async_ok = to_host or (self.data.device.type == "cuda" and rows.device.type == "cpu" and rows.is_pinned())
        self.data[:, :, self.length : self.length + n].copy_(rows, non_blocking=async_ok)
        self.in_flight |= to_host
        self.advance(n)

    def advance(self, n: int) -> None:
        """``n`` more rows are filled (a writer that filled them in place after ``reserve`` says so here)."""
        self.length += n
        if self._length_tensor is not None:
            self._length_tensor.add_(n)

    def write_at(self, rows: torch.Tensor, at: torch.Tensor) -> None:
        """``rows`` ``[b, h, t, d]`` into rows ``at``, ``at + 1``, ... (``at``: a one-element tensor on the rows'
        device, e.g. ``length_tensor()``), after ``reserve(t)``: an append whose position is read on the device, so
        a CUDA graph replays it at the step's position. Pinned rows are written from the GPU by the gather kernel
        (rows to slots); ``note_written(t)`` then does the append's Python side."""
        b, h, t, _ = rows.shape
        rows = rows.to(self.data.dtype)
        slots = at if t == 1 else at + torch.arange(t, device=at.device)
        if not (self.pinned and rows.is_cuda):  # rows and buffer on one device: one indexed copy
            self.data.index_copy_(2, slots.to(self.data.device), rows.to(self.data.device))
            return
        gather_rows(rows, torch.arange(t, device=rows.device).expand(b, h, t), self.data, dest=slots.expand(b, h, t))

    def note_written(self, n: int, *, from_gpu: bool) -> None:
        """``n`` rows were written past ``length`` by ``write_at`` (whose caller advances ``length_tensor`` on the
        device itself); ``from_gpu``: into pinned memory by a GPU kernel, so a host read waits for it."""
        self.length += n
        self.in_flight |= self.pinned and from_gpu

    @property
    def writes_at(self) -> bool:
        """Whether ``write_at`` holds for this buffer (rows stored as they are, or coded row by row)."""
        return True

    def wait(self) -> None:
        """Before the host reads rows: wait for the asynchronous copies that write them (rare: the GPU path
        reads them on the GPU)."""
        if getattr(self, "in_flight", False):  # (coded buffers keep theirs in their parts)
            torch.cuda.synchronize()
            self.in_flight = False

    def reserve(self, n: int) -> None:
        """Room for ``n`` more rows after ``length`` (a writer that fills them in place then calls ``advance``)."""
        if self.length + n > self.capacity:
            grow = max(self.GROW_ROWS, self.capacity // 32, n)  # ≤ ~3% over, O(1) amortised
            shape = list(self.data.shape)
            shape[2] = self.capacity + grow
            bigger = self._allocate(shape, self.data.dtype, self.data.device, self.pinned)
            self.wait()  # the host copies the old rows: once per ~3% growth, not per step
            bigger[:, :, : self.length].copy_(self.data[:, :, : self.length])
            self.data = bigger


class Tier(dict):
    """Named tensors (or ``RowBuffer``s) of one memory tier."""

    def __init__(self, name: str, device: torch.device):
        super().__init__()
        self.name = name
        self.device = device

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(v) for v in self.values())


def _nbytes(value: object) -> int:
    if isinstance(value, torch.Tensor):
        return value.nbytes
    if isinstance(value, RowBuffer):
        return value.nbytes
    if value is None:
        return 0
    raise TypeError(f"a memory tier holds tensors or RowBuffers, not {type(value).__name__}")
