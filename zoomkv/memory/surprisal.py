"""Token surprisal from the frozen model's own logits: ``-log p(x_t | x_<t)``.

``generate()`` only computes logits for the last prompt position, so methods that need surprisal
(``needs_surprisal = True``, e.g. sekv's anchors) get it from the final hidden states, projected through
the LM head a chunk of positions at a time (a 4K prompt × 49K vocabulary never materialises at once).

That projection is most of what surprisal costs a prefill (a 4K prompt: 4K × 49K logits). At inference
(``fast=True``) a float32 model on a CPU with native bf16 matmuls (AVX-512 BF16 / AMX) projects in bf16,
surprisal within ~0.02 nats of float32 (the anchors are the tokens several nats above the mean). Measured at
4K on two cores with SmolLM2's 49K × 576 head, surprisal as a whole went from ~2.0 to ~0.75 s with three
choices:

- the bf16 weight is transposed once a call to ``[hidden, vocab]`` and the positions flattened to 2-D: a
  plain ``mm`` (0.64 s for the projection; ``F.linear`` on the ``[vocab, hidden]`` bf16 weight 1.7 s, a 3-D
  ``matmul`` takes the batched path, ~10% slower);
- the log-softmax and the target's logit come from one compiled pass over the bf16 logits
  (``surprisal.cpp``: 0.03 s, against ~0.3 s for torch's float copy, log-softmax and gather);
- 256 rows of logits a chunk (positions × sequences; 25 MB in bf16).

Without the compiled kernel (no compiler, ``ZOOMKV_NATIVE=0``) torch computes the same numbers. Training's
teacher records keep the float32 projection.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from zoomkv.native import Kernel

_I64, _P = ctypes.c_int64, ctypes.c_void_p
# one pass a row over the bf16 logits: the log-sum-exp and the target's logit (surprisal.cpp)
SURPRISAL = Kernel(Path(__file__).with_name("surprisal.cpp"), "the compiled surprisal", {
    "zk_surprisal_bf16": ([_I64, _I64, _P, _P, _P], ctypes.c_int),
})


@torch.no_grad()
def token_surprisal(
    hidden: torch.Tensor,
    input_ids: torch.Tensor,
    lm_head: torch.nn.Module,
    *,
    valid: torch.Tensor | None = None,
    softcap: float | None = None,
    chunk: int = 256,
    fast: bool = False,
) -> torch.Tensor:
    """``hidden`` ``[b, T, H]`` (after the final norm), ``input_ids`` ``[b, T]`` → ``[b, T]`` float32 nats.

    Position 0 has no context: it gets the mean surprisal of its row (so it neither looks surprising nor
    trivially predictable); padded positions get 0.
    """
    b, t, _ = hidden.shape
    out = torch.zeros(b, t, dtype=torch.float32, device=hidden.device)
    project = _bf16_head(lm_head) if fast and _bf16_fits(lm_head, hidden) else lm_head
    step = max(1, chunk // b)  # `chunk` rows of logits at a time, whatever the batch
    for start in range(0, t - 1, step):
        stop = min(start + step, t - 1)
        logits = project(hidden[:, start:stop])
        target = input_ids[:, start + 1 : stop + 1].to(logits.device)
        out[:, start + 1 : stop + 1] = _nll(logits, target, softcap)
    if valid is not None:
        out = out.masked_fill(~valid.to(out.device), 0.0)
        first = valid.float().argmax(dim=-1)  # the first real token of each row
        counts = (valid.sum(-1) - 1).clamp_min(1)
        mean = out.sum(-1) / counts
        out[torch.arange(b), first] = mean
    elif t > 1:
        out[:, 0] = out[:, 1:].mean(-1)
    return out


def _nll(logits: torch.Tensor, target: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """``-log softmax(logits)[target]`` in float32: ``logits`` ``[b, c, V]``, ``target`` ``[b, c]``."""
    if softcap is None and logits.dtype == torch.bfloat16 and SURPRISAL.usable(logits, target):
        logits, target = logits.contiguous(), target.to(torch.int64).contiguous()  # held in names for the call
        nll = torch.empty(target.shape, dtype=torch.float32)
        if not SURPRISAL.library().zk_surprisal_bf16(target.numel(), logits.shape[-1], logits.data_ptr(),
                                                     target.data_ptr(), nll.data_ptr()):
            return nll
    logits = logits.float()
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return -torch.log_softmax(logits, dim=-1).gather(-1, target[..., None]).squeeze(-1)


@functools.cache
def _cpu_bf16_matmul() -> bool:
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _bf16_fits(lm_head: torch.nn.Module, hidden: torch.Tensor) -> bool:
    return (isinstance(lm_head, torch.nn.Linear) and hidden.device.type == "cpu" and hidden.dtype == torch.float32
            and lm_head.weight.dtype == torch.float32 and _cpu_bf16_matmul())


def _bf16_head(lm_head: torch.nn.Linear):
    # [hidden, vocab], converted once a call (~0.1 s for 49K × 576): see the module's header for the layout
    weight_t = lm_head.weight.detach().t().to(torch.bfloat16, memory_format=torch.contiguous_format)
    bias = None if lm_head.bias is None else lm_head.bias.detach().to(torch.bfloat16)

    def project(x: torch.Tensor) -> torch.Tensor:
        # [b·c, hidden] @ [hidden, vocab]: a 3-D input would take torch's batched path, ~10% slower here
        logits = torch.matmul(x.reshape(-1, x.shape[-1]).to(torch.bfloat16), weight_t)
        logits = logits if bias is None else logits + bias
        return logits.reshape(*x.shape[:-1], -1)

    return project
