"""``quantize_rows``: rows coded per token, per group of channels, in one kernel (``zoomkv.memory.quant.quantize``,
the reference).

A per-token coded host tier (``int8``, ``int4``, ``k8v4``) codes each new row as it arrives: the group's minimum
and maximum, the fp16 scale and minimum, the rounded codes, the packing. In torch that is some sixteen small ops
a buffer, two buffers a layer, for one row: at batch 1 on a GPU, where a decode step is bound by kernel launches,
more launches than the rest of the layer's append. Here one program codes a block of rows: each group's extremes
are kept as the channels are read (no reduction op), then every byte is made from its channels.
"""

from __future__ import annotations

import functools

import torch

from zoomkv.kernels import launch, usable

BLOCK_ROWS = 16


@functools.cache
def _kernel(interpret: bool):
    # keyed by the interpreter switch: triton.jit reads it when a kernel is defined
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["rows"])
    def quantize_rows_kernel(x, codes, scale, lo, rows, dim, groups, nbytes, levels,
                             BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr,
                             BLOCK_B: tl.constexpr):
        rs = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        in_r = rs < rows
        gs = tl.arange(0, BLOCK_G)
        m_g = in_r[:, None] & (gs < groups)[None, :]
        # each group's least and largest value, channel by channel (elementwise: no reduction op, which the
        # interpreter runs only when it was on before triton was imported)
        least = tl.full([BLOCK_R, BLOCK_G], float("inf"), tl.float32)
        most = tl.full([BLOCK_R, BLOCK_G], -float("inf"), tl.float32)
        for i in tl.static_range(GROUP):
            v = tl.load(x + rs[:, None] * dim + (gs * GROUP + i)[None, :], mask=m_g, other=0.0).to(tl.float32)
            least = tl.minimum(least, v)
            most = tl.maximum(most, v)
        # stored in fp16: the codes are made against the rounded values (so the bound holds), as torch makes them
        least = least.to(tl.float16)
        step = tl.maximum(tl.div_rn(most - least.to(tl.float32), levels), 1e-8).to(tl.float16)
        tl.store(lo + rs[:, None] * groups + gs[None, :], least, mask=m_g)
        tl.store(scale + rs[:, None] * groups + gs[None, :], step, mask=m_g)
        tl.debug_barrier()  # the scales and minimums just written are read back by every byte of their group
        bs = tl.arange(0, BLOCK_B)
        m_b = in_r[:, None] & (bs < nbytes)[None, :]
        per_byte: tl.constexpr = 8 // BITS
        packed = tl.full([BLOCK_R, BLOCK_B], 0, tl.int32)
        for i in tl.static_range(per_byte):  # channel i of every byte: its code into bits i * BITS upward
            c = bs * per_byte + i
            v = tl.load(x + rs[:, None] * dim + c[None, :], mask=m_b, other=0.0).to(tl.float32)
            at = rs[:, None] * groups + (c // GROUP)[None, :]
            s = tl.load(scale + at, mask=m_b, other=1.0).to(tl.float32)
            m = tl.load(lo + at, mask=m_b, other=0.0).to(tl.float32)
            y = tl.div_rn(v - m, s)
            r = tl.floor(y + 0.5)  # round half to even, as torch.round: a tie (r - y == 0.5) to an odd r goes down
            odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
            r = tl.where(((r - y) == 0.5) & odd, r - 1.0, r)
            code = tl.minimum(tl.maximum(r, 0.0), levels).to(tl.int32)
            packed = packed | (code << (i * BITS))
        tl.store(codes + rs[:, None] * nbytes + bs[None, :], packed.to(tl.uint8), mask=m_b)

    return quantize_rows_kernel


def quantize_rows_usable(x: torch.Tensor, bits: int, group: int) -> bool:
    """Whether the kernel codes these rows: where one runs, with groups of a power of two up to 128 channels
    that divide the rows' width."""
    d = x.shape[-1]
    return usable(x) and 0 < group <= 128 and group & (group - 1) == 0 and d % group == 0 and d % (8 // bits) == 0


def quantize_rows(x: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` ``[..., d]`` → (codes uint8 ``[..., d * bits / 8]``, scale fp16 ``[..., d / group]``, minimum fp16
    ``[..., d / group]``), as ``zoomkv.memory.quant.quantize`` codes them."""
    *lead, d = x.shape
    groups, nbytes = d // group, d * bits // 8
    flat = x.reshape(-1, d)
    if flat.stride(-1) != 1 or flat.stride(0) != d:
        flat = flat.contiguous()
    rows = flat.shape[0]
    codes = torch.empty(rows, nbytes, dtype=torch.uint8, device=x.device)
    scale = torch.empty(rows, groups, dtype=torch.float16, device=x.device)
    lo = torch.empty(rows, groups, dtype=torch.float16, device=x.device)
    if rows:
        launch(_kernel, (-(-rows // BLOCK_ROWS),),
            flat, codes, scale, lo, rows, d, groups, nbytes, float((1 << bits) - 1), BITS=bits, GROUP=group,
            BLOCK_R=BLOCK_ROWS, BLOCK_G=max(2, 1 << (groups - 1).bit_length()),
            BLOCK_B=max(2, 1 << (nbytes - 1).bit_length()))
    return codes.reshape(*lead, nbytes), scale.reshape(*lead, groups), lo.reshape(*lead, groups)
