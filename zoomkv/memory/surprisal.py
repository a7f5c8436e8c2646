"""Token surprisal from the frozen model's own logits: ``-log p(x_t | x_<t)``.

``generate()`` only computes logits for the last prompt position, so methods that need surprisal
(``needs_surprisal = True``, e.g. sekv's anchors) get it from the final hidden states, projected through
the LM head a chunk of positions at a time (a 4K prompt × 49K vocabulary never materialises at once).

That projection is most of what surprisal costs a prefill (a 4K prompt: 4K × 49K logits, ~15–20% of the
prompt's pass on the CPU). At inference (``fast=True``) a float32 model on a CPU with native bf16 matmuls
(AVX-512 BF16 / AMX) projects in bf16: the matmul in about half the time (measured on one thread; with two,
surprisal as a whole went from ~2.6 to ~2.3 s at 4K), surprisal within ~0.02 nats (the anchors are the tokens
several nats above the mean). Training's teacher records keep the float32 projection.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


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
    for start in range(0, t - 1, chunk):
        stop = min(start + chunk, t - 1)
        logits = project(hidden[:, start:stop]).float()
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        logp = torch.log_softmax(logits, dim=-1)
        target = input_ids[:, start + 1 : stop + 1].to(logp.device)
        out[:, start + 1 : stop + 1] = -logp.gather(-1, target[..., None]).squeeze(-1)
    if valid is not None:
        out = out.masked_fill(~valid.to(out.device), 0.0)
        first = valid.float().argmax(dim=-1)  # the first real token of each row
        counts = (valid.sum(-1) - 1).clamp_min(1)
        mean = out.sum(-1) / counts
        out[torch.arange(b), first] = mean
    elif t > 1:
        out[:, 0] = out[:, 1:].mean(-1)
    return out


@functools.cache
def _cpu_bf16_matmul() -> bool:
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _bf16_fits(lm_head: torch.nn.Module, hidden: torch.Tensor) -> bool:
    return (isinstance(lm_head, torch.nn.Linear) and hidden.device.type == "cpu" and hidden.dtype == torch.float32
            and lm_head.weight.dtype == torch.float32 and _cpu_bf16_matmul())


def _bf16_head(lm_head: torch.nn.Linear):
    weight = lm_head.weight.to(torch.bfloat16)
    bias = None if lm_head.bias is None else lm_head.bias.to(torch.bfloat16)
    return lambda x: F.linear(x.to(torch.bfloat16), weight, bias)
