"""Decode steps as CUDA graphs: captured once per layer, replayed while their shapes hold.

At batch 1 a GPU decode step waits on its launches, not on its bytes: a decoder layer is some forty small kernels
of the model's own (norms, projections, rotary, MLP) and, with sekv, some fifty more of the cache's (coding the new
row and writing it to both tiers, scoring, vote, top-k, rescoring, the recall's plan and reads, the summary row),
each a few microseconds of the host's time, where the bytes they read take less. Replayed as one CUDA graph, a
compressed layer's decode step is one launch (``layer``, the default; ``ZOOMKV_CUDA_GRAPHS=step`` captures the
cache's step alone, ``step``, inside the layer's attention).

A graph replays the kernels it captured with the arguments they had then, so what it captures must not change
from step to step in Python: no value read back to the host (the sync audit holds every method to that), fixed
shapes (a method scores its buffers' whole allocation and masks the rows past a count kept on the device,
``RowBuffer.length_tensor``, instead of slicing to the filled length), rows appended at a position read on the
device (``RowBuffer.write_at``), and the state a step hands the next kept in place (a recall buffer's slot map).
A method says when its step is of that kind with ``KVMethod.graph_key`` (a key of what its shapes depend on; None:
``append`` and ``select`` run as they are) and splits its append into the work on tensors
(``append_on_device``) and the Python side (``appended``: lengths), which runs at every step, replayed or not.
The runtime adds every tier tensor's address and shape to the key, runs the step as usual the first time it sees
a key, captures it the second time and replays it from the third. A new key (a buffer grew, a new prefill)
starts over; a capture that fails leaves the layer to run uncaptured.

Nothing is captured while a phase clock runs (``--profile`` synchronises inside the step) or under a dispatch
mode (the sync audit counts the ops of the step as it runs, and a captured one as one launch): the step of fixed
shapes then runs as it is, so it computes the same. ``ZOOMKV_CUDA_GRAPHS=0`` turns graphs and the fixed shapes off.

On the CPU, ``emulated()`` stands in for tests: the step is traced with torch.fx's ``make_fx``, which holds the
tier tensors by reference and bakes every Python value into the trace, as a CUDA graph holds addresses and
launch arguments; replaying the trace computes what the graph's replay would, so a count that should have been
read on the device but was baked in at capture shows up as a wrong selection in a later step.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from zoomkv.protocol.method import KVMethod, Memory, Selection
from zoomkv.protocol.phases import clock_running, phase

log = logging.getLogger(__name__)

GRAPH, SEEN, FAILED = "step_graph", "step_graph_seen", "step_graph_failed"  # memory.meta keys
LAYER_GRAPH, LAYER_SEEN = "layer_graph", "layer_graph_seen"

_EMULATE = False
_CAPTURE = True
_IN_LAYER = threading.local()  # a whole decoder layer is run or captured around this step: it runs as it is
_POOLS: dict[torch.device, Any] = {}
_COUNTS = {"captures": 0, "replays": 0, "failed": 0, "layer_captures": 0}


def counts() -> dict[str, int]:
    """Decode steps captured, replayed and failed to capture so far in this process (per layer; ``layer_captures``:
    of the captures, whole decoder layers)."""
    return dict(_COUNTS)


@contextlib.contextmanager
def emulated(on: bool = True, capture: bool = True) -> Iterator[None]:
    """Capture and replay decode steps on the CPU by tracing (``make_fx``) where a GPU would use CUDA graphs: the
    tests' stand-in for a graph's replay (``capture=False``: the steps in the GPU's fixed shapes, run as they are,
    e.g. with Triton's interpreter, which a trace cannot follow)."""
    global _EMULATE, _CAPTURE
    before, _EMULATE, _CAPTURE = (_EMULATE, _CAPTURE), on, capture
    try:
        yield
    finally:
        _EMULATE, _CAPTURE = before


def capturable(query: torch.Tensor) -> bool:
    """Whether steps on ``query``'s device are captured: on CUDA (or the CPU under ``emulated()``), graphs not
    turned off. A method runs its step of fixed shapes wherever this holds, captured or not, so a step computes the
    same whether it is replayed, captured or run as it is (under ``--profile`` or the sync audit)."""
    if _mode() == "0":
        return False
    return query.is_cuda or (_EMULATE and query.device.type == "cpu")


def _mode() -> str:
    """``ZOOMKV_CUDA_GRAPHS``: ``1`` (the default) whole decoder layers where they can be, else each layer's
    cache step; ``step``: the cache steps alone; ``0``: nothing captured, no fixed shapes."""
    return os.environ.get("ZOOMKV_CUDA_GRAPHS", "1")


def enabled(query: torch.Tensor) -> bool:
    """Whether this step is captured or replayed now: ``capturable``, and no phase clock and no
    dispatch mode running (each would see a replay as nothing)."""
    return capturable(query) and _CAPTURE and not clock_running() and _get_current_dispatch_mode() is None


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
    """One layer's captured decode step: ``replay(*inputs)`` runs it on this step's inputs (the cache step's key,
    value and query, its selection out; or the decoder layer's hidden states and rotary tables, its output)."""

    key: Hashable
    replay: Callable[..., Any]


def step(method: KVMethod, memory: Memory, key: torch.Tensor, value: torch.Tensor, query: torch.Tensor) -> Selection:
    """A decode step on a compressed layer: ``method.append`` the new rows, then ``method.select``; replayed from a
    captured graph where the method's step allows one (its ``graph_key``), the Python side of the append
    (``appended``) run every step."""
    rows = key.shape[2]
    key_of = None
    if capturable(query) and not memory.meta.get(FAILED):
        method.prepare_step(memory, rows)  # room for the rows first: a buffer that grows is a new layout
        key_of = method.graph_key(memory, query)
    if key_of is None:
        memory.meta.pop(GRAPH, None)
        with phase("append"):
            method.append(memory, key, value)
        with phase("select"):
            return method.select(memory, query)
    step_key = (key_of, tuple(key.shape), tuple(value.shape), tuple(query.shape), query.dtype, key.dtype,
                tier_layout(memory))
    graph = memory.meta.get(GRAPH)
    live = enabled(query) and not getattr(_IN_LAYER, "on", False)  # (a layer's capture holds this step)
    if live and graph is not None and graph.key == step_key:
        _COUNTS["replays"] += 1
        sel = graph.replay(key, value, query)
        method.appended(memory, rows)
        return sel
    memory.meta.pop(GRAPH, None)
    if live and memory.meta.get(SEEN) == step_key:
        # Second time at this key (kernels built, buffers settled): captured, and this step is the capture's run.
        graph, sel = _capture_selection(step_key, lambda k, v, q: _device_step(method, memory, k, v, q),
                                        (key, value, query), memory)
        if graph is not None:
            method.appended(memory, rows)
            if tier_layout(memory) == step_key[-1]:
                _COUNTS["captures"] += 1
                memory.meta[GRAPH] = graph
            return sel
    mode = None if getattr(_IN_LAYER, "on", False) else _get_current_dispatch_mode()  # the sync audit: the
    with mode.replayed() if hasattr(mode, "replayed") else contextlib.nullcontext():  # launches a replay makes
        with phase("append"):
            method.append_on_device(memory, key, value)
            method.appended(memory, rows)
        with phase("select"):
            sel = method.select(memory, query)
    # first time at this key: run as it is; a step that made or grew a buffer of its own is captured later
    memory.meta[SEEN] = step_key if tier_layout(memory) == step_key[-1] else None
    return sel


def _device_step(method: KVMethod, memory: Memory, key: torch.Tensor, value: torch.Tensor,
                 query: torch.Tensor) -> Selection:
    method.append_on_device(memory, key, value)
    return method.select(memory, query)


def layer(cache: Any, memory: Memory, forward: Callable[..., torch.Tensor], hidden: torch.Tensor, args: tuple,
          kwargs: dict[str, Any]) -> torch.Tensor:
    """A decoder layer's decode step (``forward(hidden, *args, **kwargs)``: its norms, projections, attention through
    the cache, and MLP) replayed from one CUDA graph where its cache step can be (the method's ``graph_key``): the
    model's own launches go too, which at batch 1 are most of a step. Its inputs are the hidden states and the
    rotary tables (``position_embeddings``); what else the model hands it each step (the attention mask, the
    positions) a compressed layer's attention does not read. The Python side of the step runs at every replay:
    the cache layer's count of tokens (transformers' ``update``) and the method's ``appended``."""
    method = cache.method
    pos = kwargs.get("position_embeddings")
    if _mode() != "1" or args or not capturable(hidden) or memory.meta.get(FAILED) or cache.probe is not None \
            or not (isinstance(pos, tuple) and all(isinstance(t, torch.Tensor) for t in pos)):
        return forward(hidden, *args, **kwargs)
    method.prepare_step(memory, 1)
    key_of = method.graph_key(memory, hidden.new_empty(hidden.shape[0], 1, hidden.shape[1], 1))  # (a query's shape)
    if key_of is None:
        return forward(hidden, *args, **kwargs)
    if not enabled(hidden):  # a phase clock or the sync audit: run as it is (the audit counts it one launch)
        mode = _get_current_dispatch_mode()
        with mode.replayed() if hasattr(mode, "replayed") else contextlib.nullcontext(), _inside_layer():
            return forward(hidden, *args, **kwargs)
    layer_key = (key_of, tuple(hidden.shape), hidden.dtype, *(tuple(t.shape) for t in pos), tier_layout(memory))
    graph = memory.meta.get(LAYER_GRAPH)
    if graph is not None and graph.key == layer_key:
        _COUNTS["replays"] += 1
        out = graph.replay(hidden, *pos)[0]
        memory.seen += hidden.shape[1]  # what the layer's cache update counts when it runs
        method.appended(memory, hidden.shape[1])
        return out
    memory.meta.pop(LAYER_GRAPH, None)

    def run(h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor]:
        return (forward(h, **{**kwargs, "position_embeddings": (cos, sin)}),)

    with _inside_layer():
        if memory.meta.get(LAYER_SEEN) == layer_key:  # second time at this key: captured; this step its run
            graph, out = capture(layer_key, run, (hidden, *pos), memory)
            if graph is not None:
                if tier_layout(memory) == layer_key[-1]:
                    _COUNTS["captures"] += 1
                    _COUNTS["layer_captures"] += 1
                    memory.meta[LAYER_GRAPH] = graph
                return out[0]
        out = run(hidden, *pos)[0]
    memory.meta[LAYER_SEEN] = layer_key if tier_layout(memory) == layer_key[-1] else None
    return out


@contextlib.contextmanager
def _inside_layer() -> Iterator[None]:
    """The cache step runs as it is inside a decoder layer run or captured whole (``layer``)."""
    before, _IN_LAYER.on = getattr(_IN_LAYER, "on", False), True
    try:
        yield
    finally:
        _IN_LAYER.on = before


def _flat(sel: Selection) -> tuple[torch.Tensor, ...]:
    return (sel.keys, sel.values) if sel.bias is None else (sel.keys, sel.values, sel.bias)


def _selection(out: tuple[torch.Tensor, ...], use_model_mask: bool) -> Selection:
    return Selection(out[0], out[1], out[2] if len(out) > 2 else None, use_model_mask)


def _capture_selection(key: Hashable, fn: Callable[..., Selection], inputs: tuple[torch.Tensor, ...],
                       memory: Memory) -> tuple[StepGraph | None, Selection | None]:
    """``capture`` of a step that returns a ``Selection``."""
    masks: list[bool] = []

    def flat(*args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        sel = fn(*args)
        masks.append(sel.use_model_mask)
        return _flat(sel)

    graph, out = capture(key, flat, inputs, memory)
    if graph is None:
        return None, None
    mask = masks[0]
    return StepGraph(key, lambda *args: _selection(graph.replay(*args), mask)), _selection(out, mask)


def capture(key: Hashable, fn: Callable[..., tuple[torch.Tensor, ...]], inputs: tuple[torch.Tensor, ...],
            memory: Memory) -> tuple[StepGraph | None, tuple[torch.Tensor, ...] | None]:
    """``fn(*inputs)`` (a tuple of tensors) captured on copies of ``inputs`` (a CUDA graph; a ``make_fx`` trace under
    ``emulated()``) and run once: the graph and this step's outputs. (None, None) where the capture failed: nothing
    of it ran, and the layer runs uncaptured from now on (said once in the log)."""
    static = tuple(t.clone() for t in inputs)
    if not inputs[0].is_cuda:  # emulated: a trace holds tensors by reference and bakes Python values in
        from torch.fx.experimental.proxy_tensor import make_fx

        results: list[tuple[torch.Tensor, ...]] = []

        def traced(*args: torch.Tensor) -> tuple[torch.Tensor, ...]:
            results.append(tuple(fn(*args)))  # tracing runs the step: this step's outputs
            return results[-1]

        module = make_fx(traced)(*static)
        return StepGraph(key, lambda *args: tuple(module(*args))), results[0]
    device = inputs[0].device
    if device not in _POOLS:
        # One memory pool for every graph: a layer's replay overwrites what another's left there, which is safe
        # because each graph's outputs are read before the next graph replays (nothing runs concurrently), and
        # the outputs themselves stay allocated while their graph lives. One side stream to capture on, as
        # torch.cuda.graph keeps one (cuBLAS sets up its workspace for a stream once).
        _POOLS[device] = (torch.cuda.graph_pool_handle(), torch.cuda.Stream(device=device))
    pool, stream = _POOLS[device]
    graph = torch.cuda.CUDAGraph()
    stream.wait_stream(torch.cuda.current_stream(device))
    try:
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=pool)
            try:
                out = tuple(fn(*static))
            finally:
                graph.capture_end()
    except Exception as err:  # noqa: BLE001 -- a step that cannot be captured still runs, uncaptured
        memory.meta[FAILED] = True
        if not _COUNTS["failed"]:  # once a process: every layer would say the same
            log.warning("a decode step cannot be captured in a CUDA graph (%s); such steps run uncaptured",
                        str(err).splitlines()[0] if str(err) else type(err).__name__)
        _COUNTS["failed"] += 1
        return None, None
    finally:
        torch.cuda.current_stream(device).wait_stream(stream)

    def replay(*args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        for held, now in zip(static, args, strict=True):
            held.copy_(now)
        graph.replay()
        return out

    return StepGraph(key, replay), replay(*inputs)
