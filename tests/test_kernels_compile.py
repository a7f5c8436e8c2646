"""Every Triton kernel compiles for a GPU (an H100, sm_90) on this CPU machine: Triton's compiler runs without a
device, down to the cubin, so a kernel the interpreter runs (tests/test_kernels.py) but the compiler refuses (a
`tl.dot` of the wrong shape, a dtype it cannot cast, a name it cannot resolve) fails here, before a GPU is lent."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

from triton.backends import backends  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from zoomkv.kernels import codes, dequant, encode, gather, plan, quantize, tail  # noqa: E402

pytestmark = [pytest.mark.skipif("nvidia" not in backends, reason="Triton without its CUDA backend"),
              pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION:UserWarning")]

I64 = "i64"
# name, kernel factory, argument types (constexprs left out), the constexpr cases compiled
KERNELS = [
    ("gather_rows", gather._kernel,
     dict(src="*bf16", idx="*i64", out="*bf16", dest="*i64", fetch="*u8", heads="i32", k="i32", dim="i32", s_b=I64,
          s_h=I64, s_n=I64, i_b=I64, i_h=I64, o_b=I64, o_h=I64, o_k=I64),
     [dict(BLOCK_K=32, BLOCK_D=128, DEST=True, FETCH=True), dict(BLOCK_K=32, BLOCK_D=64, DEST=False, FETCH=False)]),
    ("gather_dequantized", dequant._kernel,
     dict(codes="*u8", scale="*fp16", lo="*fp16", idx="*i64", out="*bf16", dest="*i64", fetch="*u8", heads="i32",
          k="i32", dim="i32", group="i32", c_b=I64, c_h=I64, c_n=I64, s_b=I64, s_h=I64, s_n=I64, i_b=I64, i_h=I64,
          o_b=I64, o_h=I64, o_k=I64),
     [dict(BITS=8, BLOCK_K=32, BLOCK_D=128, DEST=True, FETCH=True),
      dict(BITS=4, BLOCK_K=32, BLOCK_D=128, DEST=False, FETCH=False)]),
    ("encode_codes", encode._kernel,
     dict(x="*fp32", codes="*u8", rms="*fp16", rows="i32", dim="i32", nbytes="i32", step="fp32", half="fp32"),
     [dict(BITS=1, BLOCK_R=16, BLOCK_D=128, BLOCK_B=16, LANES=16),
      dict(BITS=4, BLOCK_R=16, BLOCK_D=256, BLOCK_B=128, LANES=16)]),
    ("tail_row", tail._kernel,
     dict(keys="*bf16", values="*bf16", bias="*bf16", key_sum="*fp32", value_sum="*fp32", count="*fp32",
          offset="*fp32", out_k="*bf16", out_v="*bf16", out_bias="*bf16", heads="i32", k="i32", dk="i32", dv="i32",
          k_b=I64, k_h=I64, k_n=I64, v_b=I64, v_h=I64, v_n=I64, w_b=I64, w_h=I64),
     [dict(HAS_BIAS=True, HAS_OFFSET=True, BLOCK_K=128, BLOCK_V=128, TILE_N=32, LANES_N=16),
      dict(HAS_BIAS=False, HAS_OFFSET=False, BLOCK_K=256, BLOCK_V=256, TILE_N=32, LANES_N=16)]),
    ("quantize_rows", quantize._kernel,
     dict(x="*bf16", codes="*u8", scale="*fp16", lo="*fp16", rows="i32", dim="i32", groups="i32", nbytes="i32",
          levels="fp32"),
     [dict(BITS=8, GROUP=32, BLOCK_R=16, BLOCK_G=4, BLOCK_B=128), dict(BITS=4, GROUP=32, BLOCK_R=16, BLOCK_G=4, BLOCK_B=64)]),
    ("score_codes", codes._kernel,
     dict(q="*fp32", codes="*u8", rms="*fp16", out="*fp32", heads="i32", groups="i32", n="i32", dim="i32", step="fp32",
          half="fp32", q_b=I64, q_h=I64, q_g=I64, c_b=I64, c_h=I64, c_n=I64, r_b=I64, r_h=I64, r_n=I64, o_b=I64,
          o_h=I64, o_g=I64),
     [dict(BITS=1, BLOCK_N=64, BLOCK_D=128, BLOCK_G=16)]),
    ("plan_swaps: match", plan._match_kernel,
     dict(held="*i64", idx="*i64", slot="*i32", kept="*i8", k="i32"),
     [dict(CHUNK=256, TILE=32), dict(CHUNK=16, TILE=16)]),
    ("plan_swaps: pair", plan._pair_kernel,
     dict(idx="*i64", slot="*i32", kept="*i8", dest="*i64", fetch="*u8", rows="*i64", free_at="*i32", k="i32"),
     [dict(BLOCK=4096), dict(BLOCK=16)]),
]


@pytest.mark.parametrize("name,factory,types,cases", KERNELS, ids=[k[0] for k in KERNELS])
def test_the_kernel_compiles_for_an_h100(name, factory, types, cases):
    for constexprs in cases:
        signature = {**types, **dict.fromkeys(constexprs, "constexpr")}
        compiled = triton.compile(ASTSource(fn=factory(False), signature=signature, constexprs=constexprs),
                                  target=GPUTarget("cuda", 90, 32))
        assert compiled.asm["cubin"], (name, constexprs)
