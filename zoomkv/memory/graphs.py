"""A decode step's selection as a CUDA graph: captured once per layer, replayed while its shapes hold.

At batch 1 a GPU decode step waits on its launches, not on its bytes: sekv's selection is some fifty small
kernels a layer (scoring, vote, top-k, rescoring, the recall's plan and reads, the summary row), each a few
microseconds of the host's time, where the rows it reads take less. Replayed as one CUDA graph, the selection
is one launch a layer.

A graph replays the kernels it captured with the arguments they had then, so what it captures must not change
from step to step in Python: no value read back to the host (the sync audit holds every method to that), fixed
shapes (a method scores its buffers' whole allocation and masks the rows past a count kept on the device,
``RowBuffer.length_tensor``, instead of slicing to the filled length), and the state a step hands the next kept
in place (a recall buffer's slot map). A method says when its step is of that kind with ``KVMethod.graph_key``
(a key of what its shapes depend on; None: run it as it is); the runtime adds every tier tensor's address and
shape to the key, runs the step as usual the first time it sees a key, captures it the second time and replays
it from the third. A new key (a buffer grew, a new prefill) starts over; a capture that fails leaves the layer
to run as usual.

Nothing is captured while a phase clock runs (``--profile`` synchronises inside the step) or under a dispatch
mode (the sync audit counts the ops of the step as it runs); ``ZOOMKV_CUDA_GRAPHS=0`` turns graphs off.

On the CPU, ``emulated()`` stands in for tests: the step is traced with torch.fx's ``make_fx``, which holds the
tier tensors by reference and bakes every Python value into the trace, as a CUDA graph holds addresses and
launch arguments; replaying the trace computes what the graph's replay would, so a count that should have been
read on the device but was baked in at capture shows up as a wrong selection in a later step.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from zoomkv.protocol.method import KVMethod, Memory, Selection
from zoomkv.protocol.phases import clock_running

log = logging.getLogger(__name__)

GRAPH, SEEN, FAILED = "step_graph", "step_graph_seen", "step_graph_failed"  # memory.meta keys

_EMULATE = False
_POOLS: dict[torch.device, Any] = {}
_COUNTS = {"captures": 0, "replays": 0}


def counts() -> dict[str, int]:
    """Selections captured and replayed so far in this process."""
    return dict(_COUNTS)


@contextlib.contextmanager
def emulated(on: bool = True) -> Iterator[None]:
    """Capture and replay selections on the CPU by tracing (``make_fx``) where a GPU would use CUDA graphs: the
    tests' stand-in for a graph's replay."""
    global _EMULATE
    before, _EMULATE = _EMULATE, on
    try:
        yield
    finally:
        _EMULATE = before


def capturable(query: torch.Tensor) -> bool:
    """Whether steps on ``query``'s device are captured: on CUDA (or the CPU under ``emulated()``), graphs not
    turned off. A method runs its step of fixed shapes wherever this holds, captured or not, so a step computes the
    same whether it is replayed, captured or run as it is (under ``--profile`` or the sync audit)."""
    if os.environ.get("ZOOMKV_CUDA_GRAPHS", "1") == "0":
        return False
    return query.is_cuda or (_EMULATE and query.device.type == "cpu")


def enabled(query: torch.Tensor) -> bool:
    """Whether this step's selection is captured or replayed now: ``capturable``, and no phase clock and no
    dispatch mode running (each would see a replay as nothing)."""
    return capturable(query) and not clock_running() and _get_current_dispatch_mode() is None


def tier_layout(memory: Memory) -> tuple:
    """Every tier tensor's name, address and shape: what a captured step reads and writes in place. A buffer that
    grew or was replaced changes it; a row appended in place does not."""
    layout = []
    for tier in (memory.device_tier, memory.host_tier):
        for name, value in tier.items():
            tensors = value.tensors() if hasattr(value, "tensors") else \
                [value.data] if hasattr(value, "data") and not isinstance(value, torch.Tensor) else [value]
            layout.append((tier.name, name, *((t.data_ptr(), tuple(t.shape)) for t in tensors if t is not None)))
    return tuple(layout)


@dataclass
class StepGraph:
    """One layer's captured selection: ``replay(query)`` runs it on this step's query."""

    key: Hashable
    replay: Callable[[torch.Tensor], Selection]


def select(method: KVMethod, memory: Memory, query: torch.Tensor) -> Selection:
    """``method.select(memory, query)``, replayed from a captured graph where the method's step allows one."""
    key = method.graph_key(memory, query) if enabled(query) and not memory.meta.get(FAILED) else None
    if key is None:
        memory.meta.pop(GRAPH, None)
        return method.select(memory, query)
    key = (key, tuple(query.shape), query.dtype, tier_layout(memory))
    graph = memory.meta.get(GRAPH)
    if graph is not None and graph.key == key:
        _COUNTS["replays"] += 1
        return graph.replay(query)
    memory.meta.pop(GRAPH, None)
    sel = method.select(memory, query)
    if tier_layout(memory) != key[3]:  # the step itself made or grew a buffer: capture a later one
        memory.meta[SEEN] = None
    elif memory.meta.get(SEEN) != key:
        memory.meta[SEEN] = key  # first time at this key: run as usual (kernels built, buffers settled)
    else:
        # Second time: capture. Running the step again is harmless: a selection of the same query over the same
        # rows picks the same rows, and the recall buffer already holds them in their slots.
        graph = capture(key, lambda q: method.select(memory, q), query, memory)
        if graph is not None and tier_layout(memory) == key[3]:
            _COUNTS["captures"] += 1
            memory.meta[GRAPH] = graph
    return sel


def _flat(sel: Selection) -> tuple[torch.Tensor, ...]:
    return (sel.keys, sel.values) if sel.bias is None else (sel.keys, sel.values, sel.bias)


def _selection(out: tuple[torch.Tensor, ...], use_model_mask: bool) -> Selection:
    return Selection(out[0], out[1], out[2] if len(out) > 2 else None, use_model_mask)


def capture(key: Hashable, step: Callable[[torch.Tensor], Selection], query: torch.Tensor,
            memory: Memory) -> StepGraph | None:
    """``step`` captured on a copy of ``query`` (a CUDA graph; a ``make_fx`` trace under ``emulated()``), or None
    where the capture failed (the layer then runs as usual from now on, said once in the log)."""
    static_query = query.clone()
    if not query.is_cuda:  # emulated: a trace that holds tensors by reference and bakes Python values
        from torch.fx.experimental.proxy_tensor import make_fx

        shape: list[bool] = []

        def traced(q: torch.Tensor) -> tuple[torch.Tensor, ...]:
            sel = step(q)
            shape.append(sel.use_model_mask)
            return _flat(sel)

        module = make_fx(traced)(static_query)
        return StepGraph(key, lambda q: _selection(tuple(module(q)), shape[0]))
    device = query.device
    if device not in _POOLS:
        # One memory pool for every layer's graph: a layer's replay overwrites what another's left there, which is
        # safe because each selection is attended to before the next layer's replays (nothing runs concurrently).
        _POOLS[device] = torch.cuda.graph_pool_handle()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream(device=device)
    stream.wait_stream(torch.cuda.current_stream(device))
    try:
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=_POOLS[device])
            try:
                sel = step(static_query)
            finally:
                graph.capture_end()
    except Exception as err:  # noqa: BLE001 -- a step that cannot be captured still runs, uncaptured
        memory.meta[FAILED] = True
        log.warning("layer %s: its decode step cannot be captured in a CUDA graph (%s); it runs uncaptured",
                    memory.meta.get("layer", "?"), str(err).splitlines()[0] if str(err) else type(err).__name__)
        return None
    finally:
        torch.cuda.current_stream(device).wait_stream(stream)
    out, use_model_mask = _flat(sel), sel.use_model_mask

    def replay(q: torch.Tensor) -> Selection:
        static_query.copy_(q)
        graph.replay()
        return _selection(out, use_model_mask)

    return StepGraph(key, replay)
