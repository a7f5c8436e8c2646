"""``tail_row``: the softmax tail's row (``zoomkv.memory.tail.with_tail``, the reference) in one kernel.

The row standing for every row a step did not select is the running sums less the selected rows, over the count
left, with ``log(count left)`` as its logit bias. In torch that is some eighteen small ops a layer (weights from
the selection's bias, weighted sums, the differences, the divisions, the bias, the casts): at batch 1 on a GPU,
where a decode step is bound by kernel launches, eighteen launches for one row. Here one program a (sequence,
KV head) reads the selected rows once, a tile at a time, and writes the row's key, value and bias.
"""

from __future__ import annotations

import functools

import torch

from zoomkv.kernels import launch, usable

TILE = 32  # selected rows a program reads at once
LANES = 16  # tl.dot's least size: sums are made as products with constant matrices, every lane the same sum


@functools.cache
def _kernel(interpret: bool):
    # keyed by the interpreter switch: triton.jit reads it when a kernel is defined
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["k", "k_b", "k_h", "k_n", "v_b", "v_h", "v_n", "w_b", "w_h"])
    def tail_row_kernel(keys, values, bias, key_sum, value_sum, count, offset, out_k, out_v, out_bias,
                        heads, k, dk, dv, k_b, k_h, k_n, v_b, v_h, v_n, w_b, w_h,
                        HAS_BIAS: tl.constexpr, HAS_OFFSET: tl.constexpr, BLOCK_K: tl.constexpr,
                        BLOCK_V: tl.constexpr, TILE_N: tl.constexpr, LANES_N: tl.constexpr):
        bh = tl.program_id(0)
        b = (bh // heads).to(tl.int64)
        h = (bh % heads).to(tl.int64)
        lanes = tl.arange(0, LANES_N)
        dks = tl.arange(0, BLOCK_K)
        dvs = tl.arange(0, BLOCK_V)
        # Sums as products with constant matrices (tl.dot), not tl.sum: triton.language's reductions run under
        # the interpreter only when it was on before triton was imported, and the CPU tests switch it on later.
        sum_k = tl.full([LANES_N, BLOCK_K], 0.0, tl.float32)  # every lane holds the same sum
        sum_v = tl.full([LANES_N, BLOCK_V], 0.0, tl.float32)
        # how many originals the selection covers, in every element (no slicing in Triton: one per width)
        chosen_k = tl.full([LANES_N, BLOCK_K], 0.0, tl.float32)
        chosen_v = tl.full([LANES_N, BLOCK_V], 0.0, tl.float32)
        ones_k = tl.full([TILE_N, BLOCK_K], 1.0, tl.float32)
        ones_v = tl.full([TILE_N, BLOCK_V], 1.0, tl.float32)
        for t in range(0, k, TILE_N):
            ns = t + tl.arange(0, TILE_N)
            in_n = ns < k
            if HAS_BIAS:
                logit = tl.load(bias + b * w_b + h * w_h + ns, mask=in_n, other=-float("inf")).to(tl.float32)
                w = tl.where(logit > -float("inf"), tl.exp(logit), 0.0)  # a row of bias log c stands for c rows
            else:
                w = tl.where(in_n, 1.0, 0.0)
            weights = tl.full([LANES_N, TILE_N], 0.0, tl.float32) + w[None, :]
            rk = tl.load(keys + b * k_b + h * k_h + ns[:, None].to(tl.int64) * k_n + dks[None, :],
                         mask=in_n[:, None] & (dks < dk)[None, :], other=0.0).to(tl.float32)
            rv = tl.load(values + b * v_b + h * v_h + ns[:, None].to(tl.int64) * v_n + dvs[None, :],
                         mask=in_n[:, None] & (dvs < dv)[None, :], other=0.0).to(tl.float32)
            sum_k += tl.dot(weights, rk, input_precision="ieee")
            sum_v += tl.dot(weights, rv, input_precision="ieee")
            chosen_k += tl.dot(weights, ones_k, input_precision="ieee")
            chosen_v += tl.dot(weights, ones_v, input_precision="ieee")
        total = tl.load(count + bh + lanes * 0)[:, None]  # [LANES_N, 1], the same value in every lane
        rest = total - chosen_k
        denom = tl.maximum(rest, 1.0)
        mean_k = tl.div_rn(tl.load(key_sum + bh * dk + dks[None, :] + lanes[:, None] * 0, mask=(dks < dk)[None, :],
                                   other=0.0) - sum_k, denom)
        mean_v = tl.div_rn(tl.load(value_sum + bh * dv + dvs[None, :] + lanes[:, None] * 0, mask=(dvs < dv)[None, :],
                                   other=0.0) - sum_v, tl.maximum(total - chosen_v, 1.0))
        first = (lanes == 0)[:, None]
        tl.store(out_k + bh * dk + dks[None, :] + lanes[:, None] * 0, mean_k.to(out_k.dtype.element_ty),
                 mask=first & (dks < dk)[None, :])
        tl.store(out_v + bh * dv + dvs[None, :] + lanes[:, None] * 0, mean_v.to(out_v.dtype.element_ty),
                 mask=first & (dvs < dv)[None, :])
        log_rest = tl.log(denom)
        if HAS_OFFSET:
            log_rest += tl.load(offset + h + lanes * 0)[:, None].to(tl.float32)
        row_bias = tl.where(rest > 0.5, log_rest, -float("inf"))  # no row left out: the row weighs nothing
        tl.store(out_bias + bh + lanes[:, None] * 0 + dks[None, :] * 0, row_bias.to(out_bias.dtype.element_ty),
                 mask=first & (dks == 0)[None, :])

    return tail_row_kernel


def tail_row_usable(*tensors: torch.Tensor) -> bool:
    return usable(*tensors)


def tail_row(keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor | None, key_sum: torch.Tensor,
             value_sum: torch.Tensor, count: torch.Tensor, offset: torch.Tensor | None,
             bias_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tail row of a selection: ``keys`` ``[b, h, k, dk]``, ``values`` ``[b, h, k, dv]``, their logit ``bias``
    ``[b, h, k]`` (None: every row one original; ``log c``: a row standing for ``c``; ``-inf``: none), the running
    sums ``[b, h, 1, d]`` and ``count`` ``[b, h, 1]`` of every row, ``offset`` ``[h]`` added to the bias →
    the row's key ``[b, h, 1, dk]`` and value (in the rows' dtype) and its bias ``[b, h, 1]`` (``bias_dtype``)."""
    b, h, k, dk = keys.shape
    dv = values.shape[-1]
    out_k = torch.empty(b, h, 1, dk, dtype=keys.dtype, device=keys.device)
    out_v = torch.empty(b, h, 1, dv, dtype=values.dtype, device=keys.device)
    out_bias = torch.empty(b, h, 1, dtype=bias_dtype, device=keys.device)
    if keys.stride(-1) != 1:
        keys = keys.contiguous()
    if values.stride(-1) != 1:
        values = values.contiguous()
    weights = bias if bias is not None else count  # a placeholder pointer where there is no bias
    if bias is not None and bias.stride(-1) != 1:
        weights = bias = bias.contiguous()
    sums = [t.float().contiguous() for t in (key_sum, value_sum, count)]
    block = [max(16, 1 << (d - 1).bit_length()) for d in (dk, dv)]
    launch(_kernel, (b * h,),
        keys, values, weights, *sums, offset.to(keys.device, torch.float32).contiguous() if offset is not None else count,
        out_k, out_v, out_bias, h, k, dk, dv, keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2),
        weights.stride(0) if bias is not None else 0, weights.stride(1) if bias is not None else 0,
        HAS_BIAS=bias is not None, HAS_OFFSET=offset is not None, BLOCK_K=block[0], BLOCK_V=block[1],
        TILE_N=TILE, LANES_N=LANES)
    return out_k, out_v, out_bias

