"""The trained hash's start, fitted to the teacher cache before the steps (recipe ``hash_init: fit``).

The index estimates a logit ``q·k`` of a centred key from ``b`` signs. Write the query and the key in their
whitened coordinates, ``q = A u`` and ``k = B w`` (``A = Σ_q^½``, ``B = Σ_k^½``: the second moments of the layer's
queries and of its keys centred on their sequence's mean, per KV head, over the cache): then ``q·k = uᵀ (A B) w``,
and the rank-``b`` form closest to it over whitened data is the top ``b`` singular triplets of ``M = A B``
(Eckart–Young). So the key projection ``B⁻¹ V_b`` gives ``b`` uncorrelated unit-variance coordinates, the ones a
sign loses least of alike, and the query projection ``A⁻¹ U_b S_b`` carries the weights: the product estimates
``q·k`` up to the signs' loss. The loss then trains both from there. (The untrained alternatives it is measured
against: ``scripts/code_ablation.py``.)

With ``hash_width`` above one, a coordinate may take 2 or 4 bits: the singular values say how much each direction
weighs in the logit, and a coordinate quantized at ``w`` bits keeps all but ``D(w)`` of its variance (Max's
Gaussian quantizers: 0.363, 0.119, 0.0115 at 1, 2 and 4 bits; 1 unkept). ``allocate`` picks the layout
``(n4, n2, n1)`` of ``b`` bits that loses the least weighted variance, ``Σ s_j² D(w_j)``, the strongest directions at
the most bits: reverse water-filling, in whole bytes a width.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from zoomkv.data.training import Sample
from zoomkv.methods.sekv.codes import Layout

# the squared error left of a unit-variance Gaussian coordinate quantized at 0, 1, 2 and 4 bits (Max 1960)
_DISTORTION = {0: 1.0, 1: 0.3634, 2: 0.1188, 4: 0.01154}

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


def allocate(weights: list[float], bits: int, width: int) -> Layout:
    """A layer's directions' weights (strongest first) → the ``(n4, n2, n1)`` of ``bits`` bits (at most ``width`` a
    coordinate, whole bytes a width) that leaves the least weighted error."""
    best: tuple[float, Layout] | None = None
    for n4 in range(0, (bits // 4 if width >= 4 else 0) + 1, 2):
        for n2 in range(0, ((bits - 4 * n4) // 2 if width >= 2 else 0) + 1, 4):
            n1 = bits - 4 * n4 - 2 * n2
            if n1 % 8 or n4 + n2 + n1 > len(weights):
                continue
            widths = [4] * n4 + [2] * n2 + [1] * n1 + [0] * (len(weights) - n4 - n2 - n1)
            cost = sum(w * _DISTORTION[b] for w, b in zip(weights, widths, strict=True))
            if best is None or cost < best[0] - 1e-12:
                best = (cost, (n4, n2, n1))
    if best is None:
        raise ValueError(f"no layout of {bits} bits over {len(weights)} directions")
    return best[1]


def _weights(query_moment: torch.Tensor, key_moment: torch.Tensor, columns: int) -> torch.Tensor:
    """``[..., columns]``: each direction's share of the query-key product's squared singular values."""
    a, _ = _sqrt_and_inverse(query_moment)
    b, _ = _sqrt_and_inverse(key_moment)
    s = torch.linalg.svdvals(a @ b)[..., :columns].double() ** 2
    return s / s.sum(-1, keepdim=True).clamp_min(1e-30)


def fit_layout(query_moment: torch.Tensor, key_moment: torch.Tensor, bits: int, width: int,
               columns: int) -> tuple[torch.Tensor, torch.Tensor, list[Layout]]:
    """``[L, h, d, d]`` moments → the first ``columns`` projections (strongest first) and each layer's layout, its
    directions weighted by the squared singular values, each head's normalised to sum 1, averaged over heads."""
    key, query = fit_projections(query_moment, key_moment, columns)
    weights = _weights(query_moment, key_moment, columns).mean(1)  # [L, columns]
    return key, query, [allocate(w.tolist(), bits, width) for w in weights]


CHUNK = 4096  # positions a moment reads at once: float32 copies of a chunk, not of a 32K prefill's rows


def _moment(rows: torch.Tensor, valid: torch.Tensor | None, heads: int) -> torch.Tensor:
    """``[b, r, T, d]`` (``r`` a multiple of ``heads``: a KV head's rows one group after another) → ``[b, heads,
    d, d]`` float64: the second moment of each head's rows over the valid positions, a chunk at a time in float32."""
    b, r, t, d = rows.shape
    total = torch.zeros(b, heads, d, d, dtype=torch.float64, device=rows.device)
    for start in range(0, t, CHUNK):
        x = rows[:, :, start: start + CHUNK].float()
        if valid is not None:
            x = x * valid[:, None, start: start + CHUNK, None]
        x = x.reshape(b, heads, -1, d)
        total += (x.transpose(-1, -2) @ x).double()
    count = (valid.sum(-1) if valid is not None else torch.full((b,), t, device=rows.device)) * (r // heads)
    return total / count.clamp_min(1).double()[:, None, None, None]


def query_moment(queries: torch.Tensor, valid: torch.Tensor | None, heads: int) -> torch.Tensor:
    """A prefill's queries ``[b, hq, T, d]`` → ``[b, heads, d, d]``: the second moment of each KV head's group of
    query heads over the valid positions (float64)."""
    return _moment(queries, valid, heads)


def fit_context(query_moment: torch.Tensor, centred: torch.Tensor, valid: torch.Tensor | None, bits: int,
                width: int = 4) -> tuple[torch.Tensor, torch.Tensor, Layout]:
    """sekv's ``fit_bits`` index, fitted to one prefill: its query moment ``[b, h, d, d]`` and its keys centred
    ``[b, h, T, d]`` → key and query projections ``[b, h, d, m]`` (float32, the ``m`` coordinates the layout uses)
    and one layout for the batch (the directions' weights averaged over sequences and heads)."""
    h, d = centred.shape[1], centred.shape[3]
    key_moment = _moment(centred, valid, h)
    columns = min(d, bits)
    key, query = fit_projections(query_moment, key_moment, columns)
    layout = allocate(_weights(query_moment, key_moment, columns).mean((0, 1)).tolist(), bits, width)
    used = sum(layout)
    return key[..., :used].contiguous(), query[..., :used].contiguous(), layout
