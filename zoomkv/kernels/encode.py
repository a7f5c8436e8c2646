"""``encode_codes``: rotated keys to sekv's packed codes and RMS in one kernel.

sekv's index stores each new key as ``d * bits / 8`` packed bytes and an fp16 RMS
(``zoomkv.methods.sekv.codes.encode``, the reference). Its torch path is about a dozen small ops a call (the RMS,
the division, the levels, the clamp, the shifts, the sum, two casts): at batch 1 on a GPU, where a decode step is
bound by kernel launches, that is a dozen launches per layer and per code width for one row. Here one program
codes a block of rows: each row is read once, its RMS, levels and packed bytes made in registers, and the
bytes and the RMS written.
"""

from __future__ import annotations

import functools

import torch

from zoomkv.kernels import launch, usable

BLOCK_ROWS = 16  # rows a program codes (tl.dot's least size)


@functools.cache
def _kernel(interpret: bool):
    # keyed by the interpreter switch: triton.jit reads it when a kernel is defined
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["rows"])
    def encode_codes_kernel(x, codes, rms, rows, dim, nbytes, step, half,
                            BITS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_B: tl.constexpr,
                            LANES: tl.constexpr):
        rs = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        in_r = rs < rows
        ds = tl.arange(0, BLOCK_D)
        in_d = ds < dim
        v = tl.load(x + rs[:, None] * dim + ds[None, :], mask=in_r[:, None] & in_d[None, :], other=0.0)
        v = v.to(tl.float32)
        # The row's sum of squares without tl.sum (triton.language's reductions run under the interpreter only
        # when it was on before triton was imported, and the CPU tests switch it on later): a product with a
        # column of ones puts the sum in each of LANES columns, a product with a one-hot row spreads column 0
        # over the bytes' columns (exactly: one term). Small constant matrices, whatever the head size.
        ones = tl.full([BLOCK_D, LANES], 1.0, tl.float32)
        first = tl.where(tl.arange(0, LANES)[:, None] == 0, tl.full([LANES, BLOCK_B], 1.0, tl.float32), 0.0)
        square_sum = tl.dot(tl.dot(v * v, ones, input_precision="ieee"), first, input_precision="ieee")
        # IEEE division and square root, as torch computes them (Triton's defaults are approximate)
        norm = tl.sqrt_rn(tl.div_rn(square_sum, dim * 1.0))  # [BLOCK_R, BLOCK_B]: the row's RMS in every column
        bs = tl.arange(0, BLOCK_B)
        in_b = bs < nbytes
        per_byte: tl.constexpr = 8 // BITS
        packed = tl.full([BLOCK_R, BLOCK_B], 0, tl.int32)
        for i in tl.static_range(per_byte):  # coordinate i of every byte: its code into bits i * BITS upward
            vi = tl.load(x + rs[:, None] * dim + (bs * per_byte + i)[None, :], mask=in_r[:, None] & in_b[None, :],
                         other=0.0).to(tl.float32)
            z = tl.div_rn(vi, tl.maximum(norm, 1e-12))
            if BITS == 1:
                code = (z > 0).to(tl.int32)
            else:
                level = tl.floor(tl.div_rn(z, step))
                code = (tl.minimum(tl.maximum(level, -half), half - 1) + half).to(tl.int32)
            packed = packed | (code << (i * BITS))
        tl.store(codes + rs[:, None] * nbytes + bs[None, :], packed.to(tl.uint8), mask=in_r[:, None] & in_b[None, :])
        tl.store(rms + rs[:, None] + bs[None, :], norm.to(tl.float16), mask=in_r[:, None] & (bs == 0)[None, :])

    return encode_codes_kernel


def encode_codes_usable(x: torch.Tensor) -> bool:
    return usable(x)


def encode_codes(x: torch.Tensor, bits: int, step: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[..., d]`` → ``(codes uint8 [..., d * bits / 8], rms fp16 [..., 1])``: each row's RMS, and the
    levels of ``x / rms`` (``bits`` 1: the signs; else ``floor(z / step)`` within ``±2**(bits-1)``, offset by
    ``2**(bits-1)``) packed low bits first, as ``encode`` packs them."""
    *lead, d = x.shape
    nbytes = d * bits // 8
    flat = x.reshape(-1, d)
    if flat.dtype is not torch.float32 or flat.stride(-1) != 1 or flat.stride(0) != d:
        flat = flat.float().contiguous()
    rows = flat.shape[0]
    codes = torch.empty(rows, nbytes, dtype=torch.uint8, device=x.device)
    rms = torch.empty(rows, dtype=torch.float16, device=x.device)
    if rows:
        block_d = max(16, 1 << (d - 1).bit_length())
        launch(_kernel, (-(-rows // BLOCK_ROWS),),
            flat, codes, rms, rows, d, nbytes, float(step), float(2 ** (bits - 1)),
            BITS=bits, BLOCK_R=BLOCK_ROWS, BLOCK_D=block_d, BLOCK_B=max(16, 1 << (nbytes - 1).bit_length()), LANES=16)
    return codes.reshape(*lead, nbytes), rms.reshape(*lead, 1)
