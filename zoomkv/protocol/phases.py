"""Where a decode step's time goes, for ``zoomkv bench --profile``.

The runtime marks the phases of a decode step on a compressed layer: ``append`` (the new row into the host
tier and the method's index), ``select`` (scoring, top-k and the recall), inside it ``recall`` (host rows
gathered, dequantized and copied into the device tier), and ``attend`` (attention over the selected rows).
Whatever else the step spends (the model's own layers, dense layers, sampling) is the rest. Marking costs
one attribute read while no clock runs; under a clock on CUDA each mark synchronises, so profile in a run of
its own, never inside a timed one.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager

_clock: PhaseClock | None = None


class PhaseClock:
    """Seconds per phase, summed over every layer and step while it runs (``measuring``)."""

    def __init__(self, sync: Callable[[], None] | None = None):
        self.totals: dict[str, float] = defaultdict(float)
        self.sync = sync


class phase:
    """``with phase("select"): ...`` adds the block's time to the running clock's ``select`` (no clock: nothing)."""

    __slots__ = ("name", "start")

    def __init__(self, name: str):
        self.name = name

    def __enter__(self) -> None:
        if _clock is not None:
            if _clock.sync is not None:
                _clock.sync()
            self.start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        if _clock is not None:
            if _clock.sync is not None:
                _clock.sync()
            _clock.totals[self.name] += time.perf_counter() - self.start


def clock_running() -> bool:
    """Whether a clock runs: a fused kernel then times its parts as separate calls."""
    return _clock is not None


@contextmanager
def measuring(clock: PhaseClock) -> Iterator[PhaseClock]:
    global _clock
    before, _clock = _clock, clock
    try:
        yield clock
    finally:
        _clock = before
