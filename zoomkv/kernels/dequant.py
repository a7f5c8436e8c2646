"""``gather_dequantized``: rows of a per-token coded host tier read by device indices and decoded, in one kernel.

A host tier in ``int8``, ``int4`` or ``k8v4`` (``zoomkv.memory.quant.QuantizedRowBuffer``) holds each row as
packed codes with an fp16 scale and minimum per group of channels. Its recall used to gather the codes, the
scales and the minimums (three kernels), decode them in torch (unpack, widen, multiply, add, cast: about eight
ops) and scatter the rows into their slots (three more): some fourteen launches a buffer, two buffers a layer.
Here one program reads a tile of a step's rows straight from pinned host memory, unpacks and decodes them in
registers and writes each to its slot, skipping the rows the recall buffer already holds.
"""

from __future__ import annotations

import functools

import torch

from zoomkv.kernels import launch, usable
from zoomkv.kernels.gather import slot_arguments


@functools.cache
def _kernel(interpret: bool):
    # keyed by the interpreter switch: triton.jit reads it when a kernel is defined
    import triton
    import triton.language as tl

    # lengths and strides change as buffers fill and grow: not specialised, or every new value would compile anew
    @triton.jit(do_not_specialize=["k", "c_b", "c_h", "s_b", "s_h", "i_b", "i_h", "o_b", "o_h", "o_k"])
    def gather_dequantized_kernel(codes, scale, lo, idx, out, dest, fetch, heads, k, dim, group,
                                  c_b, c_h, c_n, s_b, s_h, s_n, i_b, i_h, o_b, o_h, o_k,
                                  BITS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
                                  DEST: tl.constexpr, FETCH: tl.constexpr):
        bh = tl.program_id(0)  # the program's rows and their slots, as zoomkv.kernels.gather reads them
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
        per_byte: tl.constexpr = 8 // BITS
        for d0 in range(0, dim, BLOCK_D):
            ds = d0 + tl.arange(0, BLOCK_D)
            m = go[:, None] & (ds[None, :] < dim)
            byte = tl.load(codes + b * c_b + h * c_h + rows[:, None] * c_n + (ds // per_byte)[None, :], mask=m,
                           other=0).to(tl.int32)
            code = (byte >> ((ds % per_byte) * BITS)[None, :]) & ((1 << BITS) - 1)  # low bits first, as pack()
            g = rows[:, None] * s_n + (ds // group)[None, :]
            step = tl.load(scale + b * s_b + h * s_h + g, mask=m, other=0.0).to(tl.float32)
            least = tl.load(lo + b * s_b + h * s_h + g, mask=m, other=0.0).to(tl.float32)
            value = code.to(tl.float32) * step + least
            tl.store(out + b * o_b + h * o_h + slots[:, None] * o_k + ds[None, :], value.to(out.dtype.element_ty),
                     mask=m)

    return gather_dequantized_kernel


def gather_dequantized_usable(codes: torch.Tensor, idx: torch.Tensor, out: torch.Tensor | None) -> bool:
    return usable(codes, idx) and (out is None or usable(out, idx))


def gather_dequantized(codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor, idx: torch.Tensor, bits: int,
                       out: torch.Tensor, *, dest: torch.Tensor | None = None,
                       fetch: torch.Tensor | None = None) -> torch.Tensor:
    """Rows ``idx`` (``[b, h, k]``) decoded from ``codes`` (``[b, h, n, d * bits / 8]`` uint8, packed low bits
    first), ``scale`` and ``lo`` (``[b, h, n, groups]`` fp16: ``value = code * scale + lo`` per group of
    ``d / groups`` channels) into ``out`` (``[b, h, >= k, d]``): row ``j`` to slot ``dest[j]`` (None: ``j``), only
    where ``fetch[j]`` (None: every row); the other slots keep what they hold. What
    ``zoomkv.memory.quant.dequantize`` of the gathered codes computes (its reference in the tests)."""
    b, h, k = idx.shape
    d = out.shape[-1]
    if k == 0 or d == 0:
        return out
    groups = scale.shape[-1]
    idx, dest_at, fetch_at = slot_arguments(idx, dest, fetch)
    launch(_kernel, (b * h, -(-k // 32)),
        codes, scale, lo, idx, out, dest_at, fetch_at, h, k, d,
        d // groups, codes.stride(0), codes.stride(1), codes.stride(2), scale.stride(0), scale.stride(1),
        scale.stride(2), idx.stride(0), idx.stride(1), out.stride(0), out.stride(1), out.stride(2),
        BITS=bits, BLOCK_K=32, BLOCK_D=min(128, max(16, 1 << (d - 1).bit_length())), DEST=dest is not None,
        FETCH=fetch is not None)
    return out
