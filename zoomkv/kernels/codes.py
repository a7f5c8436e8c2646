"""``score_codes``: a query's estimated logit against every row's packed key code, read where the codes sit.

sekv's index holds each row's key as ``d * bits / 8`` packed bytes and an fp16 RMS (``zoomkv.methods.sekv.codes``:
a code ``c`` stands for the level ``(c - 2**(bits-1) + 0.5) * step``). Its torch path scores them through a
table of 256 partial products per byte, which on a GPU materialises a ``[b, h, g, n * bytes]`` gather: more
bytes than attending to the rows themselves. This kernel reads each row's bytes once, unpacks them in
registers and multiplies them with every query head of the group in one ``tl.dot``: ``n * (bytes + 2)`` read,
``g * n`` scores written.
"""

from __future__ import annotations

import functools

import torch

from zoomkv.kernels import launch, usable


@functools.cache
def _kernel(interpret: bool):
    # keyed by the interpreter switch: triton.jit reads it when a kernel is defined
    import triton
    import triton.language as tl

    # the row count grows every step and strides with capacity: not specialised (one compilation a shape)
    @triton.jit(do_not_specialize=["n", "q_b", "q_h", "q_g", "c_b", "c_h", "c_n", "r_b", "r_h", "r_n", "o_b", "o_h",
                                   "o_g"])
    def score_codes_kernel(q, codes, rms, out, heads, groups, n, dim, step, half,
                           q_b, q_h, q_g, c_b, c_h, c_n, r_b, r_h, r_n, o_b, o_h, o_g,
                           BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                           BLOCK_G: tl.constexpr):
        bh = tl.program_id(0)
        b = (bh // heads).to(tl.int64)
        h = (bh % heads).to(tl.int64)
        ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        in_n = ns < n
        ds = tl.arange(0, BLOCK_D)
        in_d = ds < dim
        per_byte: tl.constexpr = 8 // BITS
        at = codes + b * c_b + h * c_h + ns[:, None].to(tl.int64) * c_n + (ds // per_byte)[None, :]
        byte = tl.load(at, mask=in_n[:, None] & in_d[None, :], other=0).to(tl.int32)
        code = (byte >> ((ds % per_byte) * BITS)[None, :]) & ((1 << BITS) - 1)
        level = (code.to(tl.float32) - half + 0.5) * step  # [BLOCK_N, BLOCK_D]
        scale = tl.load(rms + b * r_b + h * r_h + ns.to(tl.int64) * r_n, mask=in_n, other=0.0).to(tl.float32)
        gs = tl.program_id(2) * BLOCK_G + tl.arange(0, BLOCK_G)  # a block of the group's query rows
        in_g = gs < groups
        qt = tl.load(q + b * q_b + h * q_h + gs[None, :] * q_g + ds[:, None], mask=in_d[:, None] & in_g[None, :],
                     other=0.0).to(tl.float32)  # [BLOCK_D, BLOCK_G]: every query head of the group at once
        s = tl.dot(level, qt, input_precision="ieee") * scale[:, None]  # [BLOCK_N, BLOCK_G]
        tl.store(out + b * o_b + h * o_h + gs[None, :] * o_g + ns[:, None], s, mask=in_n[:, None] & in_g[None, :])

    return score_codes_kernel


def score_codes_usable(query: torch.Tensor, codes: torch.Tensor) -> bool:
    return usable(query, codes)


def score_codes(query: torch.Tensor, codes: torch.Tensor, rms: torch.Tensor, bits: int, step: float) -> torch.Tensor:
    """``query`` ``[b, h, g, d]`` × codes ``[b, h, n, d * bits / 8]`` (uint8) with ``rms`` ``[b, h, n, 1]`` →
    ``[b, h, g, n]`` float32: ``rms * (query · levels(codes))``, levels ``(c - 2**(bits-1) + 0.5) * step``."""
    b, h, g, d = query.shape
    n = codes.shape[2]
    out = torch.empty(b, h, g, n, dtype=torch.float32, device=query.device)
    if n == 0:
        return out
    query = query.float()
    if query.stride(-1) != 1:
        query = query.contiguous()
    if codes.stride(-1) != 1:
        codes = codes.contiguous()
    block_n = 64
    # query rows a program takes: a decode step's group (4 heads) pads to 16; a chunk of new tokens (g = heads x
    # tokens) is tiled in blocks of 64, the third grid axis
    block_g = min(64, max(16, 1 << (g - 1).bit_length()))
    grid = (b * h, -(-n // block_n), -(-g // block_g))
    launch(_kernel, grid, query, codes, rms, out, h, g, n, d, float(step), float(2 ** (bits - 1)),
                    query.stride(0), query.stride(1), query.stride(2), codes.stride(0), codes.stride(1),
                    codes.stride(2), rms.stride(0), rms.stride(1), rms.stride(2), out.stride(0), out.stride(1),
                    out.stride(2), BITS=bits, BLOCK_N=block_n, BLOCK_D=max(16, 1 << (d - 1).bit_length()),
                    BLOCK_G=block_g)
    return out
