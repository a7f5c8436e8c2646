"""Selection diagnostics: what share of full attention each decode step's selection keeps.

A ``SelectionProbe`` on a ``ZoomCache`` (``ZoomCache(..., diagnose=True)``) keeps an exact copy of every
compressed layer's keys (the prefill's, then each extension's and each step's) and, at every decode step,
scores the step's query against all of them — the attention full KV would give. Per sequence, layer and
KV head it then records:

- ``mass``: the share of that full attention mass that falls on the rows the method selected (averaged
  over the KV head's query heads). A row counts when the selection holds it exactly (recognised by its
  bytes); summary rows (sekv's spans, the softmax tail) stand for rows without being them and count for
  nothing, and neither do quantized rows — this is the mass of the exact rows attended;
- ``overlap``: the share of the exact top-B rows (B = the budget, by the same averaged attention) that the
  selection holds — 1 for ``oracle_topk`` without recent-window rows;
- with ``focus`` rows (the needle's tokens, say), ``needle``: the share of full attention's mass on those
  rows that the selection kept, and ``needle_attention``: that mass itself (how much a head looks there).
  Sums over steps are mass-weighted: Σ kept / Σ full.

It costs one extra score over all keys per layer and step and a second copy of the keys: a diagnostic,
not a serving mode.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from zoomkv.protocol.method import Selection

_INT_OF = {4: torch.int32, 2: torch.int16, 1: torch.int8, 8: torch.int64}


def _weights(d: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(d)
    return (torch.randint(1, 2**62, (d,), generator=gen, dtype=torch.int64) | 1).to(device)


def row_fingerprints(rows: torch.Tensor) -> torch.Tensor:
    """One int64 per row of ``rows`` ``[..., d]``, a function of its exact bytes (equal rows, equal prints;
    different rows collide with chance ~2^-64)."""
    ints = rows.contiguous().view(_INT_OF[rows.element_size()]).to(torch.int64)
    return (ints * _weights(rows.shape[-1], rows.device)).sum(-1)


class SelectionProbe:
    def __init__(self, budget: Callable[[], int | None]):
        self.budget = budget  # the cache's budget in rows, known once the prefill has resolved it
        self.keys: dict[int, torch.Tensor] = {}  # layer → [b, kv, T, d], every row seen, exact
        self.valid: dict[int, torch.Tensor | None] = {}  # layer → [b, T] bool (left padding is False)
        self.mass: dict[int, torch.Tensor] = {}  # layer → [b, kv] sum over steps
        self.overlap: dict[int, torch.Tensor] = {}
        self.steps: dict[int, int] = {}
        self.by_step: dict[int, list[torch.Tensor]] = {}  # layer → per step [b] mass (mean over heads)
        # focus rows per sequence (positions in the padded input), e.g. the needle's tokens; None: not measured
        self.focus: list[torch.Tensor] | None = None
        self.focus_full: dict[int, torch.Tensor] = {}  # layer → [b, kv] Σ over steps of full mass on the focus
        self.focus_kept: dict[int, torch.Tensor] = {}
        self.focus_by_step: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # layer → per step ([b], [b])

    def prefill(self, layer: int, keys: torch.Tensor, valid: torch.Tensor | None) -> None:
        self.keys[layer] = keys.detach().clone()
        self.valid[layer] = None if valid is None else valid.detach().clone()

    def extend(self, layer: int, keys: torch.Tensor) -> None:
        if layer not in self.keys:
            return
        self.keys[layer] = torch.cat([self.keys[layer], keys.detach().to(self.keys[layer].dtype)], dim=2)
        valid = self.valid[layer]
        if valid is not None:
            more = torch.ones(valid.shape[0], keys.shape[2], dtype=torch.bool, device=valid.device)
            self.valid[layer] = torch.cat([valid, more], dim=1)

    @torch.no_grad()
    def step(self, layer: int, query: torch.Tensor, new_keys: torch.Tensor, sel: Selection, scaling: float) -> None:
        """A forward's new queries ``[b, hq, n, d]`` and keys on ``layer``, and the stored rows selected for
        them. One token (a decode step) or several (a question extending the cache: its last position is
        measured, the one that gives the first answer token; it attends the selection and all the new rows)."""
        if layer not in self.keys:
            return
        self.extend(layer, new_keys)
        if query.shape[2] > 1:
            query, also = query[:, :, -1:], new_keys
        else:
            also = None
        keys = self.keys[layer]
        b, kv, t, d = keys.shape
        groups = query.shape[1] // kv
        q = query.reshape(b, kv, groups, d).float()
        logits = torch.matmul(q, keys.float().transpose(-1, -2)) * scaling  # [b, kv, g, T]
        valid = self.valid[layer]
        if valid is not None:
            logits = logits.masked_fill(~valid[:, None, None, :], float("-inf"))
        probs = torch.softmax(logits, dim=-1).mean(dim=2)  # [b, kv, T]: the KV head's query heads averaged
        held = self._held(keys, sel, also)  # [b, kv, T] bool
        mass = (probs * held).sum(-1)
        k = min(self.budget() or t, t)
        top = probs.topk(k, dim=-1).indices
        overlap = held.gather(-1, top).float().mean(-1)
        self.mass[layer] = self.mass.get(layer, 0) + mass
        self.overlap[layer] = self.overlap.get(layer, 0) + overlap
        self.steps[layer] = self.steps.get(layer, 0) + 1
        self.by_step.setdefault(layer, []).append(mass.mean(-1))
        if self.focus is not None:
            on = torch.zeros(b, t, dtype=torch.bool, device=probs.device)
            for i, positions in enumerate(self.focus):
                on[i, positions[positions < t].to(probs.device)] = True
            full = (probs * on[:, None, :]).sum(-1)  # [b, kv]
            kept = (probs * (held & on[:, None, :])).sum(-1)
            self.focus_full[layer] = self.focus_full.get(layer, 0) + full
            self.focus_kept[layer] = self.focus_kept.get(layer, 0) + kept
            self.focus_by_step.setdefault(layer, []).append((kept.sum(-1), full.sum(-1)))

    @staticmethod
    def _held(keys: torch.Tensor, sel: Selection, also: torch.Tensor | None = None) -> torch.Tensor:
        """Which of ``keys`` ``[b, kv, T, d]`` the selection (and ``also``, rows attended beside it) holds
        exactly; rows hidden by ``-inf`` bias are not held."""
        chosen = sel.keys.to(keys.dtype)
        stored = row_fingerprints(keys)  # [b, kv, T]
        picked = row_fingerprints(chosen)  # [b, kv, k]
        if sel.bias is not None:  # a row hidden by -inf is not attended: give it a print no stored row has
            picked = picked.masked_fill(~torch.isfinite(sel.bias), int(stored.min()) - 1)
        if also is not None:
            picked = torch.cat([picked, row_fingerprints(also.to(keys.dtype))], dim=-1)
        held = torch.zeros_like(stored, dtype=torch.bool)
        for i in range(stored.shape[0]):
            for h in range(stored.shape[1]):
                held[i, h] = torch.isin(stored[i, h], picked[i, h])
        return held

    def summary(self, row: int) -> dict[str, Any] | None:
        """Sequence ``row``'s diagnostics: per layer the mean over steps of each KV head's mass and overlap,
        and the mean mass over layers at each step. None when no decode step was probed."""
        layers = sorted(layer for layer in self.steps if self.steps[layer])
        if not layers:
            return None
        n_steps = min(len(self.by_step[layer]) for layer in layers)
        by_step = [float(sum(self.by_step[layer][s][row] for layer in layers) / len(layers)) for s in range(n_steps)]
        out = {
            "layers": layers,
            "mass": [[round(float(v), 4) for v in self.mass[layer][row] / self.steps[layer]] for layer in layers],
            "overlap": [[round(float(v), 4) for v in self.overlap[layer][row] / self.steps[layer]] for layer in layers],
            "mass_by_step": [round(v, 4) for v in by_step],
        }
        if self.focus is not None and len(self.focus[row]):
            out["needle"] = [[round(float(k / f), 4) if f > 0 else None
                              for k, f in zip(self.focus_kept[layer][row], self.focus_full[layer][row], strict=True)]
                             for layer in layers]
            out["needle_attention"] = [[round(float(f / self.steps[layer]), 4) for f in self.focus_full[layer][row]]
                                       for layer in layers]
            # per step: the needle mass kept over all layers and heads / the needle mass full attention gives
            kept = [sum(float(self.focus_by_step[layer][s][0][row]) for layer in layers) for s in range(n_steps)]
            full = [sum(float(self.focus_by_step[layer][s][1][row]) for layer in layers) for s in range(n_steps)]
            out["needle_by_step"] = [round(k / f, 4) if f > 0 else None for k, f in zip(kept, full, strict=True)]
            out["needle_full"] = round(sum(full), 4)  # Σ over steps and layers: the weight of this row's needle
            out["needle_kept"] = round(sum(kept), 4)
        return out
