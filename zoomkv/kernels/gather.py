"""``gather_rows``: rows picked by device indices, read from wherever they live, written into a device buffer.

The recall of a two-tier cache: every row of a layer sits in pinned host memory, the indices of the rows a step
needs are on the GPU, and the rows must end up on the GPU. Moving the indices to the host to gather there
stops the GPU once per layer and step; this kernel reads the pinned rows from the GPU instead (host memory
mapped into the device's address space, as ShadowKV and RetroInfer read theirs), in stream order, so a row
written to the host tier by an earlier asynchronous copy is read after it lands.
"""

from __future__ import annotations

import functools

import torch

from zoomkv.kernels import launch, usable


def gather_rows_reference(src: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """What the kernel computes: ``src`` ``[b, h, n, d]``, ``idx`` ``[b, h, k]`` → ``[b, h, k, d]``."""
    at = idx.to(src.device)[..., None].expand(-1, -1, -1, src.shape[-1])
    return src.gather(2, at)


def gather_to_slots_reference(rows: torch.Tensor, out: torch.Tensor, dest: torch.Tensor,
                              fetch: torch.Tensor | None) -> torch.Tensor:
    """What the kernel computes with slots, given the rows ``idx`` names (``rows`` ``[b, h, k, d]``): slot
    ``dest[j]`` of ``out`` takes row ``j`` where ``fetch[j]`` (None: everywhere), and keeps what it holds
    elsewhere. ``dest`` is a permutation of ``out``'s first ``k`` slots (each written once)."""
    at = dest.to(out.device)[..., None].expand(-1, -1, -1, out.shape[-1])
    rows = rows.to(out.device, out.dtype)
    if fetch is not None:
        rows = torch.where(fetch.to(out.device)[..., None], rows, out.gather(2, at))
    return out.scatter_(2, at, rows)


def slot_arguments(idx: torch.Tensor, dest: torch.Tensor | None,
                   fetch: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``idx``, ``dest`` and ``fetch`` as the kernels that write rows into slots read them: contiguous (dest and fetch are read with idx's
    offsets), fetch as bytes, ``idx`` standing in for the ones not given (the kernel's DEST / FETCH say so)."""
    idx = idx.contiguous()
    dest = idx if dest is None else dest.contiguous()
    fetch = idx if fetch is None else fetch.contiguous().view(torch.uint8)
    return idx, dest, fetch


@functools.cache
def _kernel(interpret: bool):
    # keyed by the interpreter switch: triton.jit reads it when a kernel is defined
    import triton
    import triton.language as tl

    # lengths and strides change as buffers fill and grow: not specialised, or every new value would compile anew
    @triton.jit(do_not_specialize=["k", "s_b", "s_h", "i_b", "i_h", "o_b", "o_h", "o_k"])
    def gather_rows_kernel(src, idx, out, dest, fetch, heads, k, dim, s_b, s_h, s_n, i_b, i_h, o_b, o_h, o_k,
                           BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, DEST: tl.constexpr, FETCH: tl.constexpr):
        # (zoomkv.kernels.dequant starts the same way: Triton's interpreter runs a kernel with its module's globals
        # only, so a shared jit helper made per interpreter switch cannot be reached from both)
        bh = tl.program_id(0)
        b = (bh // heads).to(tl.int64)
        h = (bh % heads).to(tl.int64)
        ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        in_k = ks < k
        at = b * i_b + h * i_h + ks
        rows = tl.load(idx + at, mask=in_k, other=0).to(tl.int64)
        if DEST:  # row j to slot dest[j]
            slots = tl.load(dest + at, mask=in_k, other=0).to(tl.int64)
        else:
            slots = ks.to(tl.int64)
        if FETCH:  # only the rows fetch marks: the others are never read
            go = in_k & (tl.load(fetch + at, mask=in_k, other=0) != 0)
        else:
            go = in_k
        for d0 in range(0, dim, BLOCK_D):
            ds = d0 + tl.arange(0, BLOCK_D)
            m = go[:, None] & (ds[None, :] < dim)
            v = tl.load(src + b * s_b + h * s_h + rows[:, None] * s_n + ds[None, :], mask=m)
            tl.store(out + b * o_b + h * o_h + slots[:, None] * o_k + ds[None, :], v, mask=m)

    return gather_rows_kernel


def gather_rows(src: torch.Tensor, idx: torch.Tensor, out: torch.Tensor | None = None, *,
                dest: torch.Tensor | None = None, fetch: torch.Tensor | None = None) -> torch.Tensor:
    """Rows ``idx`` (``[b, h, k]``, int) of ``src`` (``[b, h, n, d]``: a CUDA tensor or pinned host memory,
    rows contiguous) into ``out`` (``[b, h, k, d]`` on ``idx``'s device; allocated when None). Indices must be
    in ``[0, n)``. One kernel, no host synchronisation; the torch reference where no kernel runs (on the CPU
    without the interpreter, the rows are gathered on the host and copied over).

    ``dest`` and ``fetch`` (``[b, h, k]``: a permutation of ``out``'s slots, and bool): row ``j`` goes to slot
    ``dest[j]`` (None: slot ``j``), and only where ``fetch[j]``; the other slots keep what they hold and their rows
    are not read (a recall that reads only the rows its buffer misses: ``zoomkv.protocol.recallable.plan_swaps``).
    Where no kernel runs, every row is read."""
    b, h, k = idx.shape
    d = src.shape[-1]
    if out is None:
        if dest is not None:
            raise ValueError("gather_rows: slots need the buffer they index (out)")
        out = torch.empty(b, h, k, d, dtype=src.dtype, device=idx.device)
    if not usable(src, idx, out) or src.stride(-1) != 1 or out.stride(-1) != 1 or src.dtype != out.dtype:
        if dest is not None:
            return gather_to_slots_reference(gather_rows_reference(src, idx), out, dest, fetch)
        out.copy_(gather_rows_reference(src, idx), non_blocking=True)
        return out
    if k == 0 or d == 0:
        return out
    block_d = min(128, 1 << (d - 1).bit_length())
    block_k = 32
    grid = (b * h, -(-k // block_k))
    idx, dest_at, fetch_at = slot_arguments(idx, dest, fetch)
    launch(_kernel, grid, src, idx, out, dest_at, fetch_at, h, k,
                    d, src.stride(0), src.stride(1), src.stride(2), idx.stride(0), idx.stride(1), out.stride(0),
                    out.stride(1), out.stride(2), BLOCK_K=block_k, BLOCK_D=block_d, DEST=dest is not None,
                    FETCH=fetch is not None)
    return out
