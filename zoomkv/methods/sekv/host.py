"""sekv's host tier under rank budgets: the rows in a per-sequence principal basis, truncated by the
adapter's trained rank gates.

Per compressed layer and KV head the keys (and, apart, the values) of the compressed context are centred
and expressed in their own principal directions (largest variance first); the host tier keeps each row's
coordinates along the directions the layer's gates keep (``rank_gate[l, 0 | 1, j] > 0``: one gate per
direction, shared by the layer's heads), the device tier the kept directions and the mean. A recalled row is
``mean + coordinates · directions``: the best approximation of the row in that many directions, exact when
every gate is on. Rows that join later are projected onto the same directions. Keys may be taken before
RoPE (rotated back by their positions: ShadowKV's observation that they are low-rank there), and the sink
rows and the anchors kept exact, outside the fit (``SeKVConfig.host_key_basis``, ``host_exact_sinks``,
``host_exact_anchors``).

Nothing here knows the method: plain tensors in, plain tensors out.
"""

from __future__ import annotations

import torch

from zoomkv.protocol import rotary


def masked_mean(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``x`` ``[b, h, n, d]``, ``valid`` ``[b, n]`` → ``[b, h, 1, d]``: the mean of the real rows."""
    w = valid[:, None, :, None].to(x.dtype)
    return (x * w).sum(2, keepdim=True) / w.sum(2, keepdim=True).clamp_min(1)


def principal_directions(x: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """``[..., d, d]``: the principal directions (rows, largest variance first) of centred rows ``x``
    ``[..., n, d]`` (padding rows, where ``valid`` ``[b, n]`` is False, left out). float64 eigh of the
    ``d × d`` scatter matrix: exact to float32 whatever the conditioning."""
    xd = x.double()
    if valid is not None:
        xd = xd * valid[:, None, :, None].to(xd.dtype)
    _, vecs = torch.linalg.eigh(torch.matmul(xd.transpose(-1, -2), xd))  # ascending eigenvalues
    return vecs.flip(-1).transpose(-1, -2).to(x.dtype)


def project(x: torch.Tensor, mean: torch.Tensor, directions: torch.Tensor) -> torch.Tensor:
    """Rows ``x`` ``[b, h, n, d]`` → their coordinates ``[b, h, n, r]`` along ``directions`` ``[b, h, r, d]``."""
    return torch.matmul(x.to(directions.dtype) - mean, directions.transpose(-1, -2))


def reconstruct(coords: torch.Tensor, mean: torch.Tensor, directions: torch.Tensor) -> torch.Tensor:
    """Coordinates ``[b, h, k, r]`` → rows ``[b, h, k, d]``."""
    return torch.matmul(coords.to(directions.dtype), directions) + mean


def truncated(x: torch.Tensor, gates: torch.Tensor, exact: torch.Tensor | None = None,
              rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Training: rows ``x`` ``[h, n, d]`` kept in the principal directions ``gates`` ``[d]`` weigh (1/0 in
    the forward pass, a relaxation's gradient in the backward pass), as the host tier gives them back.
    ``exact`` ``[n]`` bool: rows (sinks, anchors) that stay exact and out of the fit; ``rope``: ``cos, sin``
    ``[n | more, d]`` of the rows' positions, the directions then fitted to the rows before RoPE."""
    if exact is None and rope is None:
        mean = x.mean(1, keepdim=True)
        directions = principal_directions((x - mean).detach())  # [h, d, d]
        coords = torch.matmul(x - mean, directions.transpose(-1, -2))
        return torch.matmul(coords * gates, directions) + mean
    n = x.shape[1]
    cos, sin = (None, None) if rope is None else (rope[0][:n], rope[1][:n])
    base = x if cos is None else rotary.undo(x, cos, sin)
    fit = base if exact is None else base[:, ~exact]
    mean = fit.mean(1, keepdim=True)
    directions = principal_directions((fit - mean).detach())
    coords = torch.matmul(base - mean, directions.transpose(-1, -2))
    back = torch.matmul(coords * gates, directions) + mean
    if cos is not None:
        back = rotary.apply(back, cos, sin)
    return back if exact is None else torch.where(exact[None, :, None], x, back)
