"""The trained hash's start, fitted to the teacher cache before the steps (recipe ``hash_init: fit``).

The index estimates a logit ``q·k`` of a centred key from ``b`` signs. Write the query and the key in their
whitened coordinates, ``q = A u`` and ``k = B w`` (``A = Σ_q^½``, ``B = Σ_k^½``: the second moments of the layer's
queries and of its keys centred on their sequence's mean, per KV head, over the cache): then ``q·k = uᵀ (A B) w``,
and the rank-``b`` form closest to it over whitened data is the top ``b`` singular triplets of ``M = A B``
(Eckart–Young). So the key projection ``B⁻¹ V_b`` gives ``b`` uncorrelated unit-variance coordinates, the ones a
sign loses least of alike, and the query projection ``A⁻¹ U_b S_b`` carries the weights: the product estimates
``q·k`` up to the signs' loss. The loss then trains both from there. (The untrained alternatives it is measured
against: ``scripts/code_ablation.py``.)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from zoomkv.data.training import Sample

RIDGE = 1e-4  # of the mean eigenvalue: a direction no sample varies along must not blow up the inverse


def _sqrt_and_inverse(moment: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., d, d]`` symmetric PSD → its square root and the inverse of that (ridged)."""
    values, vectors = torch.linalg.eigh(moment)
    values = values.clamp_min(0) + RIDGE * values.mean(-1, keepdim=True).clamp_min(1e-12)
    root = (vectors * values.sqrt()[..., None, :]) @ vectors.transpose(-1, -2)
    inverse = (vectors * values.rsqrt()[..., None, :]) @ vectors.transpose(-1, -2)
    return root, inverse


def moments(samples: Sequence[Sample], layers: list[int], heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[L, h, d, d]`` second moments of the queries (a KV head's group) and of the keys (centred per sample)."""
    q_sum = k_sum = None
    q_count = k_count = 0
    for sample in samples:
        qs, ks = [], []
        for layer in layers:
            k = sample[f"k.{layer}"].double()  # [h, T, d]
            x = k - k.mean(1, keepdim=True)
            ks.append(x.transpose(-1, -2) @ x)
            q = sample[f"q.{layer}"].double()  # [hq, P, d]
            q = q.reshape(heads, -1, q.shape[-1])  # a KV head's group: its query heads' rows
            qs.append(q.transpose(-1, -2) @ q)
        q_sum = torch.stack(qs) if q_sum is None else q_sum + torch.stack(qs)
        k_sum = torch.stack(ks) if k_sum is None else k_sum + torch.stack(ks)
        q_count += q.shape[1]
        k_count += x.shape[1]
    if q_sum is None or k_sum is None:
        raise ValueError("no cached samples to fit the hash to")
    return q_sum / q_count, k_sum / k_count


def fit_projections(query_moment: torch.Tensor, key_moment: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., d, d]`` moments → ``(key projection, query projection)`` ``[..., d, bits]`` float32."""
    a, a_inv = _sqrt_and_inverse(query_moment)
    b, b_inv = _sqrt_and_inverse(key_moment)
    u, s, vh = torch.linalg.svd(a @ b)
    key = b_inv @ vh[..., :bits, :].transpose(-1, -2)
    query = a_inv @ (u[..., :, :bits] * s[..., None, :bits])
    return key.float(), query.float()
