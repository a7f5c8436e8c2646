"""``plan_swaps``: where a step's rows go in a recall buffer that keeps the rows it already holds, in two kernels.

The torch plan (``zoomkv.protocol.recallable.plan_swaps``, the reference) is some twenty-six small ops a buffer:
on a GPU at batch 1, where a step is bound by kernel launches, more than the rows it saves from crossing PCIe
cost. Here the first kernel matches the step's rows against the buffer's, a chunk of either side a program
against a tile of the other at a time, so a (sequence, KV head)'s k^2 comparisons spread over 2 k / CHUNK
programs (sekv rescores 4,092 candidates a layer at B=1024: one program a head comparing them all would take
most of a step); the second, one program a (sequence, KV head), ranks the missing rows and the free slots by
prefix sums and pairs them: the same plan.
"""

from __future__ import annotations

import functools

import torch

from zoomkv.kernels import launch

MOST_ROWS = 8192  # the pairing holds a (sequence, head)'s rows in one program; more than this take the torch plan
CHUNK = 256  # rows a matching program holds
TILE = 32  # rows of the other side it compares them with at a time


@functools.cache
def _match_kernel(interpret: bool):
    # keyed by the interpreter switch: triton.jit reads it when a kernel is defined
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["k"])
    def match_kernel(held, idx, slot, kept, k, CHUNK: tl.constexpr, TILE: tl.constexpr):
        # programs (sequence x head, 2 x chunks): the first half finds the slot holding each wanted row of its
        # chunk (-1: none), the second whether each slot of its chunk holds a wanted row
        base = tl.program_id(0).to(tl.int64) * k
        chunks = tl.cdiv(k, CHUNK)
        side = tl.program_id(1) // chunks  # 0: wanted rows against held ones; 1: held rows against wanted ones
        offs = (tl.program_id(1) % chunks) * CHUNK + tl.arange(0, CHUNK)
        in_k = offs < k
        # row ids compared as int32 (a buffer's rows number far below 2^31); padding never matches: rows >= 0,
        # empty slots -1
        if side == 0:
            mine = tl.load(idx + base + offs, mask=in_k, other=-2).to(tl.int32)
            other = held
        else:
            mine = tl.load(held + base + offs, mask=in_k, other=-3).to(tl.int32)
            other = idx
        found = tl.full([CHUNK], -1, tl.int32)
        for t in range(0, k, TILE):
            tiles = t + tl.arange(0, TILE)
            theirs = tl.load(other + base + tiles, mask=tiles < k, other=-4).to(tl.int32)  # matches none
            found = tl.maximum(found, tl.max(tl.where(mine[:, None] == theirs[None, :], tiles[None, :], -1), axis=1))
        if side == 0:
            tl.store(slot + base + offs, found, mask=in_k)
        else:
            tl.store(kept + base + offs, (found >= 0).to(tl.int8), mask=in_k)

    return match_kernel


@functools.cache
def _pair_kernel(interpret: bool):
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["k"])
    def pair_kernel(idx, slot, kept, dest, fetch, rows, free_at, k, BLOCK: tl.constexpr):
        base = tl.program_id(0).to(tl.int64) * k
        offs = tl.arange(0, BLOCK)
        in_k = offs < k
        at = tl.load(slot + base + offs, mask=in_k, other=-1)
        miss = in_k & (at < 0)
        free = in_k & (tl.load(kept + base + offs, mask=in_k, other=1) == 0)
        miss_rank = tl.cumsum(miss.to(tl.int32), axis=0) - 1
        free_rank = tl.cumsum(free.to(tl.int32), axis=0) - 1
        tl.store(free_at + base + free_rank, offs, mask=free)  # the r-th free slot
        tl.debug_barrier()
        to = tl.where(miss, tl.load(free_at + base + miss_rank, mask=miss, other=0), at)
        tl.store(dest + base + offs, to.to(tl.int64), mask=in_k)
        tl.store(fetch + base + offs, miss.to(tl.uint8), mask=in_k)
        tl.store(rows + base + to, tl.load(idx + base + offs, mask=in_k), mask=in_k)

    return pair_kernel


def plan_swaps_fits(idx: torch.Tensor) -> bool:
    """Whether one program a (sequence, head) pairs these rows."""
    return 0 < idx.shape[-1] <= MOST_ROWS


def plan_swaps(held: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``zoomkv.protocol.recallable.plan_swaps`` in two kernels: ``held`` and ``idx`` ``[b, h, k]`` int64 (``idx``
    distinct in each (b, h), ``held`` distinct but for -1) → ``dest``, ``fetch``, the slots' rows after."""
    b, h, k = idx.shape
    idx, held = idx.contiguous(), held.contiguous()
    dest = torch.empty_like(idx)
    rows = torch.empty_like(idx)
    fetch = torch.empty(b, h, k, dtype=torch.uint8, device=idx.device)
    slot = torch.empty(b, h, k, dtype=torch.int32, device=idx.device)
    kept = torch.empty(b, h, k, dtype=torch.int8, device=idx.device)
    free_at = torch.empty(b, h, k, dtype=torch.int32, device=idx.device)
    block = max(16, 1 << (k - 1).bit_length())
    chunk, tile = min(CHUNK, block), min(TILE, block)
    launch(_match_kernel, (b * h, 2 * -(-k // chunk)), held, idx, slot, kept, k, CHUNK=chunk, TILE=tile, num_warps=4)
    launch(_pair_kernel, (b * h,), idx, slot, kept, dest, fetch, rows, free_at, k, BLOCK=block,
           num_warps=8 if block >= 2048 else 4)
    return dest, fetch.view(torch.bool), rows
