"""sekv's prefill layout, shared by the method (inference) and the trainer (so both cut spans alike).

For one batch row: surprisal anchors, the spans between them, and the loose rows (runs shorter than
``min_span``) kept exact. Then, for all rows at once, per span and KV head a summary row
(surprisal-weighted mean) and a truncated SVD of the span's keys and values.

Everything here is plain tensors in, plain tensors out: no LayerMemory, no adapter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class RowLayout:
    """The layout of one batch row's region ``[start, stop)`` (sinks before it, the recent tail after it)."""

    exact: list[int]  # positions kept exact: sinks, anchors and loose rows, ascending
    spans: list[tuple[int, int]]  # [start, end) of each span, ascending
    anchors: list[int]


def _runs(start: int, stop: int, anchors: list[int]) -> list[tuple[int, int]]:
    """The maximal runs of ``[start, stop)`` that hold no anchor."""
    runs, cur = [], start
    for a in anchors:
        if a > cur:
            runs.append((cur, a))
        cur = a + 1
    if stop > cur:
        runs.append((cur, stop))
    return runs


def _pieces(n: int, piece: int) -> int:
    return math.ceil(n / piece)


def segment_row(
    surprisal: torch.Tensor,
    first: int,
    stop: int,
    tau: float,
    *,
    sinks: int,
    min_span: int,
    max_span: int,
    room: int,
) -> RowLayout:
    """Cut positions ``[first, stop)`` of one row (``first``: its first real token; ``stop``: where the
    recent tail starts) into sinks, anchors, loose rows and spans, with at most ``room`` exact rows besides
    the sinks (anchors + loose rows).

    Anchors are tokens whose surprisal exceeds ``mean + tau·std`` of the row, the most surprising first;
    when anchors and the loose rows they leave (runs shorter than ``min_span``) do not fit ``room`` they are
    halved until they do. Every other run is a span, split evenly into pieces of at most ``max_span`` rows:
    summary rows are the span index (like Quest's page bounds), so their number is not limited by the room.
    """
    sink_stop = min(first + sinks, stop)
    exact_sinks = list(range(first, sink_stop))
    start = sink_stop
    if stop <= start:
        return RowLayout(exact_sinks, [], [])
    real = surprisal[first:].float()
    thr = float(real.mean() + tau * real.std(unbiased=False)) if real.numel() > 1 else math.inf
    region = surprisal[start:stop].float()
    above = (region > thr).nonzero().flatten()
    order = region[above].argsort(descending=True, stable=True)
    candidates = (above[order] + start).tolist()
    k = min(len(candidates), max(room, 0))
    while True:
        anchors = sorted(candidates[:k])
        runs = _runs(start, stop, anchors)
        loose = [r for r in runs if r[1] - r[0] < min_span]
        long = [r for r in runs if r[1] - r[0] >= min_span]
        if k == 0 or k + sum(e - s for s, e in loose) <= room:
            break
        k //= 2
    if k == 0:  # no anchor: one run; a region shorter than min_span is still a span (the room may be 0)
        loose, long = [], runs
    spans: list[tuple[int, int]] = []
    for s, e in long:
        m = _pieces(e - s, max_span)
        cuts = [s + round(i * (e - s) / m) for i in range(m + 1)]
        spans.extend((cuts[i], cuts[i + 1]) for i in range(m))
    exact = sorted(exact_sinks + anchors + [p for s, e in loose for p in range(s, e)])
    return RowLayout(exact, spans, anchors)


@dataclass
class SpanTensors:
    """Per span and KV head: the summary rows, the sizes, the rows, and (``factor=True``) the rank-``r_max``
    SVD factors."""

    sum_keys: torch.Tensor  # [b, h, S, d]
    sum_values: torch.Tensor  # [b, h, S, dv]
    count: torch.Tensor  # [b, S] float, 0 for padding slots
    coef_k: torch.Tensor | None  # [b, h, S, P, r]: U·Σ
    basis_k: torch.Tensor | None  # [b, h, S, r, d]: Vᵀ
    coef_v: torch.Tensor | None
    basis_v: torch.Tensor | None
    start: torch.Tensor  # [b, S] long: first position of each span (teacher mass per span in training)
    rows_k: torch.Tensor  # [b, h, S, P, d]: the span's rows, zero-padded
    rows_v: torch.Tensor


def _factor(rows: torch.Tensor, r_max: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated SVD of ``rows`` ``[..., P, d]`` (zero rows for padding): ``(U·Σ [..., P, r_max], Vᵀ [..., r_max, d])``,
    zero-padded up to ``r_max`` so spans of any size share one tensor.

    Computed from the eigenvectors of the ``d × d`` Gram matrix (float64, so squaring the condition number
    costs nothing) rather than ``torch.linalg.svd``: several times faster on CPU for many small spans, and
    ``U·Σ = rows · V`` makes the full-rank reconstruction exact however the eigenvalues round.
    """
    gram = torch.matmul(rows.double().transpose(-1, -2), rows.double())
    _, vecs = torch.linalg.eigh(gram)  # ascending eigenvalues
    r = min(r_max, rows.shape[-1], rows.shape[-2])
    v = vecs[..., -r:].flip(-1)  # [..., d, r], largest first
    coef = torch.matmul(rows.double(), v).to(rows.dtype)
    basis = v.transpose(-1, -2).to(rows.dtype)
    if r < r_max:
        coef = torch.nn.functional.pad(coef, (0, r_max - r))
        basis = torch.nn.functional.pad(basis, (0, 0, 0, r_max - r))
    return coef, basis


def build_spans(
    keys: torch.Tensor,
    values: torch.Tensor,
    weights: torch.Tensor,
    spans: list[list[tuple[int, int]]],
    r_max: int,
    *,
    factor: bool = True,
) -> SpanTensors:
    """``keys``/``values`` ``[b, h, T, d]``, ``weights`` ``[b, T]`` (surprisal), ``spans`` per batch row →
    summaries and SVD factors, padded to the largest span count and span length of the batch."""
    b, h, _, d = keys.shape
    n_spans = max((len(s) for s in spans), default=0)
    size = max((e - s for row in spans for s, e in row), default=1)
    starts = torch.zeros(b, max(n_spans, 0), dtype=torch.long)
    counts = torch.zeros(b, n_spans, dtype=torch.long)
    for i, row in enumerate(spans):
        for j, (s, e) in enumerate(row):
            starts[i, j], counts[i, j] = s, e - s
    starts, counts = starts.to(keys.device), counts.to(keys.device)
    offs = torch.arange(size, device=keys.device)
    live = offs < counts[..., None]  # [b, S, P]
    idx = (starts[..., None] + offs).masked_fill(~live, 0)  # [b, S, P]
    flat = idx.reshape(b, 1, -1, 1)

    def gather(x: torch.Tensor) -> torch.Tensor:
        rows = torch.gather(x, 2, flat.expand(-1, h, -1, x.shape[-1])).view(b, h, n_spans, size, x.shape[-1])
        return rows * live[:, None, :, :, None].to(x.dtype)

    k_rows, v_rows = gather(keys), gather(values)
    # Surprisal weights: the summary leans towards the span's informative tokens. A small floor keeps
    # fully predictable tokens (surprisal ≈ 0) from vanishing and padding-free spans from dividing by 0.
    w = torch.gather(weights.float(), 1, idx.view(b, -1)).view(b, n_spans, size).clamp_min(0) + 1e-3
    w = w * live
    w = w / w.sum(-1, keepdim=True).clamp_min(1e-12)
    w = w[:, None, :, :, None].to(keys.dtype)
    coef_k, basis_k = _factor(k_rows, r_max) if factor else (None, None)
    coef_v, basis_v = _factor(v_rows, r_max) if factor else (None, None)
    return SpanTensors((w * k_rows).sum(3), (w * v_rows).sum(3), counts.to(keys.dtype), coef_k, basis_k,
                       coef_v, basis_v, starts, k_rows, v_rows)


def reconstruct(coef: torch.Tensor, basis: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Rows of spans from their factors with rank gates: ``coef [..., P, r]``, ``basis [..., r, d]``,
    ``gate [..., r]`` (1/0 at inference, soft in training) → ``[..., P, d]``."""
    return torch.matmul(coef * gate[..., None, :], basis)
