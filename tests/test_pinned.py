"""Pinned host memory at its exact size (zoomkv.memory.pinned): page-locked where it lies, for as long as any view
of it lives, unlocked before it is freed. CUDA's runtime is replaced by a fake that records what it is asked
(tests/test_cuda.py runs the real one)."""

from __future__ import annotations

import gc

import pytest
import torch

from zoomkv.memory import pinned
from zoomkv.memory.tiers import RowBuffer


class FakeLocker:
    def __init__(self, error: int = 0):
        self.error, self.locked, self.unlocked = error, [], []

    def lock(self, address: int, nbytes: int) -> int:
        if not self.error:
            self.locked.append((address, nbytes))
        return self.error

    def unlock(self, address: int) -> int:
        self.unlocked.append(address)
        return 0

    def describe(self, error: int) -> str:
        return "out of memory"


@pytest.fixture
def locker(monkeypatch):
    fake = FakeLocker()
    monkeypatch.setattr(pinned, "locker", fake)
    monkeypatch.setattr(pinned, "EXACT_BYTES", 1 << 16)  # small tensors stand in for the large ones
    return fake


def test_a_large_buffer_is_locked_at_its_exact_size_until_its_last_view_goes(locker):
    shape = (2, 3, 1000, 24)  # 288,000 bytes of bf16: torch's allocator would pin 512 KiB
    t = pinned.empty(shape, torch.bfloat16)
    assert t.shape == shape and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert locker.locked == [(t.data_ptr(), 288_000 + -288_000 % pinned.PAGE)]  # whole pages, from a page's start
    assert t.data_ptr() % pinned.PAGE == 0 and t.untyped_storage().data_ptr() == t.data_ptr()
    t.fill_(1.5)
    rows = t[:, :, 10:20]  # a view outlives the tensor it came from
    del t
    gc.collect()
    assert locker.unlocked == [] and float(rows.float().sum()) == 1.5 * rows.numel()
    address = locker.locked[0][0]
    del rows
    gc.collect()
    assert locker.unlocked == [address]


def test_small_buffers_stay_with_torchs_allocator(locker, monkeypatch):
    asked = []
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: asked.append(kw) or torch.zeros(*a, dtype=kw["dtype"]))
    t = pinned.empty((2, 2, 8, 4), torch.float32)
    assert asked == [{"dtype": torch.float32, "pin_memory": True}] and locker.locked == [] and t.shape == (2, 2, 8, 4)
    monkeypatch.setattr(pinned, "EXACT_BYTES", 0)  # every size locked where it lies, but nothing to lock in none
    pinned.empty((2, 0, 4), torch.float32)
    assert len(asked) == 2 and locker.locked == []


def test_a_host_that_cannot_lock_the_rows_says_so_in_one_line(monkeypatch):
    monkeypatch.setattr(pinned, "locker", FakeLocker(error=2))
    monkeypatch.setattr(pinned, "EXACT_BYTES", 1 << 16)
    with pytest.raises(pinned.HostMemoryError, match=r"could not page-lock 0\.00 GiB .*\(out of memory\); fewer "):
        pinned.empty((4, 4, 4096, 8), torch.float16)


def test_a_pinned_row_buffer_grows_into_locked_memory_and_lets_the_old_go(locker):
    """The host tier's buffer on a CUDA machine: its rows copied into locked memory, grown into more of it, the
    outgrown allocation unlocked; the rows the same throughout."""
    rows = torch.randn(2, 2, 4000, 8)
    buf = RowBuffer(rows, pinned=True)
    first = buf.data.data_ptr()
    assert locker.locked[0][0] == first and torch.equal(buf.view(), rows)
    more = torch.randn(2, 2, 300, 8)
    buf.append(more)
    assert len(locker.locked) == 2 and locker.unlocked == [first]
    assert torch.equal(buf.view(), torch.cat([rows, more], dim=2))


def test_without_cuda_nothing_is_locked(monkeypatch):
    monkeypatch.setattr(pinned, "locker", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pinned._locker() is None
