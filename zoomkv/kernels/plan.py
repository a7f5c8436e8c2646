"""``plan_swaps``: where a step's rows go in a recall buffer that keeps the rows it already holds, in one kernel.

The torch plan (``zoomkv.protocol.recallable.plan_swaps``, the reference) is some twenty-six small ops a buffer:
on a GPU at batch 1, where a step is bound by kernel launches, more than the rows it saves from crossing PCIe
cost. Here one program per (sequence, KV head) holds the step's rows and the buffer's in registers, matches them
a tile at a time, ranks the missing rows and the free slots by prefix sums and pairs them: the same plan.
"""

from __future__ import annotations

import functools

import torch

from zoomkv.kernels import launch

MOST_ROWS = 8192  # one program holds a (sequence, head)'s rows; more than this take the torch plan


@functools.cache
def _kernel(interpret: bool):
    # keyed by the interpreter switch: triton.jit reads it when a kernel is defined
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["k"])
    def plan_swaps_kernel(held, idx, dest, fetch, rows, free_at, k, BLOCK: tl.constexpr, TILE: tl.constexpr):
        base = tl.program_id(0).to(tl.int64) * k
        offs = tl.arange(0, BLOCK)
        in_k = offs < k
        # row ids compared as int32 (a buffer's rows number far below 2^31): half the registers of int64
        want = tl.load(idx + base + offs, mask=in_k, other=-2).to(tl.int32)  # padding never matches: rows >= 0,
        have = tl.load(held + base + offs, mask=in_k, other=-3).to(tl.int32)  # empty slots -1
        slot = tl.full([BLOCK], -1, tl.int32)  # the slot holding each wanted row (-1: none)
        kept = tl.zeros([BLOCK], dtype=tl.int32)  # whether each slot's row is wanted
        for t in range(0, k, TILE):
            tiles = t + tl.arange(0, TILE)
            in_t = tiles < k
            have_t = tl.load(held + base + tiles, mask=in_t, other=-3).to(tl.int32)
            want_t = tl.load(idx + base + tiles, mask=in_t, other=-2).to(tl.int32)
            found = tl.where(want[:, None] == have_t[None, :], tiles[None, :], -1)
            slot = tl.maximum(slot, tl.max(found, axis=1))
            kept = tl.maximum(kept, tl.max((have[:, None] == want_t[None, :]).to(tl.int32), axis=1))
        miss = in_k & (slot < 0)
        free = in_k & (kept == 0)
        miss_rank = tl.cumsum(miss.to(tl.int32), axis=0) - 1
        free_rank = tl.cumsum(free.to(tl.int32), axis=0) - 1
        tl.store(free_at + base + free_rank, offs, mask=free)  # the r-th free slot
        tl.debug_barrier()
        to = tl.where(miss, tl.load(free_at + base + miss_rank, mask=miss, other=0), slot)
        tl.store(dest + base + offs, to.to(tl.int64), mask=in_k)
        tl.store(fetch + base + offs, miss.to(tl.uint8), mask=in_k)
        tl.store(rows + base + to, tl.load(idx + base + offs, mask=in_k), mask=in_k)

    return plan_swaps_kernel


def plan_swaps_fits(idx: torch.Tensor) -> bool:
    """Whether one program a (sequence, head) holds these rows."""
    return 0 < idx.shape[-1] <= MOST_ROWS


def plan_swaps(held: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``zoomkv.protocol.recallable.plan_swaps`` in one kernel: ``held`` and ``idx`` ``[b, h, k]`` int64 (``idx``
    distinct in each (b, h), ``held`` distinct but for -1) → ``dest``, ``fetch``, the slots' rows after."""
    b, h, k = idx.shape
    idx, held = idx.contiguous(), held.contiguous()
    dest = torch.empty_like(idx)
    rows = torch.empty_like(idx)
    fetch = torch.empty(b, h, k, dtype=torch.uint8, device=idx.device)
    free_at = torch.empty(b, h, k, dtype=torch.int32, device=idx.device)
    block = max(16, 1 << (k - 1).bit_length())
    tile = max(2, min(16, 16384 // block))  # a [block, tile] comparison at a time: ~64 registers a thread
    launch(_kernel, (b * h,), held, idx, dest, fetch, rows, free_at, k, BLOCK=block, TILE=tile,
                                      num_warps=8 if block >= 2048 else 4)
    return dest, fetch.view(torch.bool), rows
