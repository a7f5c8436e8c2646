"""Pinned (page-locked) host memory for the host tier, at the size asked for.

torch's pinned allocator rounds every request up to the next power of two and keeps what is freed for its next
requests: one layer's host rows of 8 sequences x 32K tokens (541 MB of bf16 keys) take 1 GiB, and the prompt's
KV parked on the host while the surprisal is computed stays pinned after it leaves. At 32 x 32K tokens on a
128 GB machine that is the difference between a host tier that fits and one that does not. So an allocation of
``EXACT_BYTES`` or more is ordinary host memory page-locked where it lies (``cudaHostRegister``), unlocked when
its last view goes: the bytes asked for, no more. Smaller ones stay with torch's allocator (its reuse is cheap
and its rounding small). Recalls read both the same way: a GPU kernel takes either pointer, and copies from
either run asynchronously.
"""

from __future__ import annotations

import math
import mmap
import weakref
from typing import Protocol

import numpy
import torch

from zoomkv.errors import ZoomKVError

EXACT_BYTES = 16 << 20  # below this, torch's allocator: at most 16 MiB rounded away per buffer
PAGE = mmap.PAGESIZE


class HostMemoryError(ZoomKVError):
    """The host could not page-lock a host tier's rows (too little memory for them)."""


class PageLocker(Protocol):
    """What page-locks memory: CUDA's runtime (``cudaHostRegister`` / ``cudaHostUnregister``); a test's fake."""

    def lock(self, address: int, nbytes: int) -> int: ...  # 0, or the runtime's error code

    def unlock(self, address: int) -> int: ...

    def describe(self, error: int) -> str: ...


class CudaPageLocker:
    """CUDA's runtime, through torch's bindings. Flags 0: with unified addressing (every 64-bit CUDA platform)
    the memory is mapped for every device, so a kernel reads it by its host address."""

    def lock(self, address: int, nbytes: int) -> int:
        return int(torch.cuda.cudart().cudaHostRegister(address, nbytes, 0))

    def unlock(self, address: int) -> int:
        # torch's own pinned blocks wait on events for the copies still reading them; these wait for the device:
        # a recall's copy or kernel queued before the last view went finishes before the bytes are freed (rare:
        # a buffer outgrown, a prompt's parked KV, a cache at its end; never inside a captured step, which
        # allocates nothing).
        if not torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize()
        return int(torch.cuda.cudart().cudaHostUnregister(address))

    def describe(self, error: int) -> str:
        try:
            return str(torch.cuda.cudart().cudaGetErrorString(error))
        except Exception:  # an error code pybind's enum does not name: the number says enough
            return f"CUDA error {error}"


locker: PageLocker | None = None  # None: CUDA's, where CUDA is available (tests put a fake here)


def _locker() -> PageLocker | None:
    if locker is not None:
        return locker
    return CudaPageLocker() if torch.cuda.is_available() else None


def empty(shape: tuple[int, ...] | list[int] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised pinned host tensor of ``shape`` (contiguous)."""
    nbytes = math.prod(shape) * dtype.itemsize
    page_locker = _locker()
    if page_locker is None or nbytes < max(EXACT_BYTES, 1):  # (nothing to lock in an empty tensor)
        return torch.empty(tuple(shape), dtype=dtype, pin_memory=True)
    # Whole pages: two locked ranges never share one (the runtime refuses a range that overlaps a locked one), and
    # the tensor's storage starts where the lock does (``is_pinned`` asks about the storage's first byte).
    span = -(-nbytes // PAGE) * PAGE
    host = numpy.empty(span + PAGE, dtype=numpy.uint8)
    skip = -host.ctypes.data % PAGE
    address = host.ctypes.data + skip
    error = page_locker.lock(address, span)
    if error:
        raise HostMemoryError(f"could not page-lock {nbytes / 2**30:.2f} GiB of host memory for the host tier "
                              f"({page_locker.describe(error)}); fewer sequences at once, or a host format with "
                              "fewer bits (--kv-quant), needs less")
    # numpy owns the bytes and torch's storage holds them through a memoryview: when the last view of them goes,
    # the array's end calls its weak references before it frees the bytes, so they are unlocked while still there
    weakref.finalize(host, page_locker.unlock, address).atexit = False  # (at exit the process lets it all go)
    return torch.frombuffer(memoryview(host)[skip : skip + span], dtype=torch.uint8)[:nbytes].view(dtype).view(
        tuple(shape))


def copy_of(tensor: torch.Tensor) -> torch.Tensor:
    """A pinned host copy of ``tensor`` (waits for it: a device tensor is copied synchronously)."""
    out = empty(tensor.shape, tensor.dtype)
    out.copy_(tensor)
    return out


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Host ``tensor`` on ``device`` without the host waiting: to a GPU through torch's pinned memory, the copy
    queued behind the GPU's work (one from pageable memory waits for that work first; torch keeps a pinned block
    until its copy has landed)."""
    if torch.device(device).type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
