"""Token surprisal from the frozen model's own logits: ``-log p(x_t | x_<t)``.

``generate()`` only computes logits for the last prompt position, so methods that need surprisal
(``needs_surprisal = True``, e.g. sekv's anchors) get it from the final hidden states, projected through
the LM head a chunk of positions at a time (a 4K prompt × 49K vocabulary never materialises at once).
"""

from __future__ import annotations

import torch


@torch.no_grad()
def token_surprisal(
    hidden: torch.Tensor,
    input_ids: torch.Tensor,
    lm_head: torch.nn.Module,
    *,
    valid: torch.Tensor | None = None,
    softcap: float | None = None,
    chunk: int = 256,
) -> torch.Tensor:
    """``hidden`` ``[b, T, H]`` (after the final norm), ``input_ids`` ``[b, T]`` → ``[b, T]`` float32 nats.

    Position 0 has no context: it gets the mean surprisal of its row (so it neither looks surprising nor
    trivially predictable); padded positions get 0.
    """
    b, t, _ = hidden.shape
    out = torch.zeros(b, t, dtype=torch.float32, device=hidden.device)
    for start in range(0, t - 1, chunk):
        stop = min(start + chunk, t - 1)
        logits = lm_head(hidden[:, start:stop]).float()
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
