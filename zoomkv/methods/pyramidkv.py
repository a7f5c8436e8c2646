"""``pyramidkv``: SnapKV's selection under per-layer budgets that shrink linearly with depth.

Cai et al., "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling", 2024
(arXiv:2406.02069). Lower layers spread attention widely, upper layers focus on few rows
("pyramidal information funneling"), so lower layers get more of the budget. With ``L`` layers, budget
``B`` and the observation window ``W`` kept in every layer, the non-window rows ``P = B - W`` per layer
(``L * P`` in all) are spread as in the authors' code: the top layer gets ``P / beta``, the bottom layer
``2 P - P / beta``, linearly in between, so the layers sum to exactly ``L * B``.

Deviations, and why:

- Rounding: the authors floor a per-layer step, so their layer budgets do not sum exactly to ``L * B``.
  Here the linear shares are rounded by largest remainder (sum exact, still non-increasing with depth),
  and each layer gets at least one non-window row (their ``P // beta`` can be 0, i.e. a layer of window
  only): the top layer's share is ``max(P / beta, 1)``.
- The authors' code also clamps the bottom layer at the prompt length and hands the surplus to upper
  layers. That needs the prompt length, which ``layer_budget(layer, num_layers, budget)`` (what the runtime
  checks against) does not receive, so the allocation depends on ``(L, B)`` only. Consequence: with a
  budget equal to the context, upper layers still compress; exactness needs ``B / beta >= context``.
- Hybrid models (Gemma 3): only full-attention layers are compressed; the runtime passes their indices
  (``zoom_layers``) and the pyramid is laid over those layers, so they hold exactly ``L_full * B``.
- Decoding: as for ``snapkv``, a full layer evicts its lowest-scored prompt row for each new row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from functools import lru_cache

from zoomkv.errors import ZoomKVError
from zoomkv.methods.snapkv import SnapKV, SnapKVConfig


@dataclass
class PyramidKVConfig(SnapKVConfig):
    beta: float = field(
        default=20.0,
        metadata={"help": "pyramid steepness: the top layer gets 1/beta of the average non-window budget"},
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.beta < 1:
            # beta < 1 would give the top layer more than the bottom: an inverted pyramid.
            raise ZoomKVError(f"beta must be at least 1, got {self.beta}")


@lru_cache(maxsize=1024)
def pyramid_budgets(num_layers: int, budget: int, window: int, beta: float) -> tuple[int, ...]:
    """Per-layer row budgets, bottom layer first: ``window`` + a linear share of ``num_layers * (budget -
    window)`` from ``2P - P/beta`` down to ``P/beta``; exact sum ``num_layers * budget``, each ``> window``."""
    extra = budget - window
    if num_layers <= 1 or extra < 1:
        # One layer has nothing to spread; a budget under min_budget is refused by check_budget anyway.
        return (budget,) * max(num_layers, 1)
    # Exact rationals, so the rounding below is the same on every platform.
    low = max(Fraction(extra) / Fraction(beta), Fraction(1))
    high = 2 * extra - low
    step = (high - low) / (num_layers - 1)
    ideal = [high - i * step for i in range(num_layers)]
    shares = [int(x) for x in ideal]  # floor: ideal shares are positive
    left = num_layers * extra - sum(shares)
    # Largest remainder; ties go to the lower layer, which keeps the shares non-increasing with depth.
    order = sorted(range(num_layers), key=lambda i: (-(ideal[i] - shares[i]), i))
    for i in order[:left]:
        shares[i] += 1
    return tuple(window + s for s in shares)


class PyramidKV(SnapKV):
    """SnapKV scoring and selection under pyramid-shaped layer budgets (more rows in lower layers).

    Citation: Cai et al., "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information
    Funneling", arXiv:2406.02069, 2024.
    """

    name = "pyramidkv"
    config_class = PyramidKVConfig
    summary = "SnapKV selection with layer budgets shrinking linearly with depth (beta=20), summing to L*B"
    citation = "Cai et al., PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling, arXiv 2024"
    config: PyramidKVConfig

    def layer_budget(
        self, layer_idx: int, num_layers: int, budget: int, zoom_layers: Sequence[int] | None = None
    ) -> int:
        """This layer's rows. ``zoom_layers`` (the indices of the layers actually compressed) lays the
        pyramid over those layers only (the runtime always passes it; without it the pyramid spans all
        ``num_layers``)."""
        if zoom_layers is not None:
            zoom = sorted(zoom_layers)
            budgets = pyramid_budgets(len(zoom), budget, self.config.window, float(self.config.beta))
            return budgets[zoom.index(layer_idx)]
        return pyramid_budgets(num_layers, budget, self.config.window, float(self.config.beta))[layer_idx]
