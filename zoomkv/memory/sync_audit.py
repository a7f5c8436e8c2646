"""A sync audit: which ops of a decode step would stop a GPU to read a tensor back to the host.

A decode step that reads a tensor's value in Python (``.item()``, ``int(t)``, ``bool(t)``, ``.tolist()``), has
an output whose shape depends on values (``nonzero``, boolean-mask indexing, ``unique``, ``masked_select``,
``repeat_interleave`` by a tensor) or copies a device tensor to the host makes the host wait for the GPU: one
synchronisation each, and the step cannot be captured in a CUDA graph. ``SyncAudit`` is a
``TorchDispatchMode`` that sees every op while it is active, so it finds those ops on any machine, the CPU
included (where nothing actually waits):

    with SyncAudit() as audit:
        model(input_ids=next_token, past_key_values=cache, ...)
    print(audit.format())          # one line per op, with the zoomkv line that called it

``SyncAudit(raise_on_sync=True)`` raises ``SyncError`` at the first one instead; ``audit_decode`` audits
the decode steps after a prefill (``zoomkv bench --sync-audit`` reports it per method). ``audit.ops`` counts
the kernel launches a step makes on a GPU: the torch ops that compute (views, allocations and reshapes left out) and
zoomkv's Triton kernels (``zoomkv.kernels.launch``), one each; each launch is a few microseconds of the host's
time, which is what a small decode step waits on.

What a CPU run cannot show: on a CPU-only machine both tiers are RAM, so a copy between them is no copy at
all (recalling host-tier rows by indices computed on the device moves those indices to the host: a
synchronisation on CUDA, nothing here). Copies between devices are named when the tensors do sit on two
devices. On CUDA, ``torch.cuda.set_sync_debug_mode("error")`` is the full check (tests/test_cuda.py).
"""

from __future__ import annotations

import contextlib
import os
import traceback
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from zoomkv import kernels
from zoomkv.compat import generate_cache_kwargs
from zoomkv.errors import ZoomKVError

# Ops whose result is a Python value read from a tensor.
SCALAR_READS = frozenset({"aten::_local_scalar_dense", "aten::equal", "aten::is_nonzero", "aten::allclose"})
# Ops whose output shape depends on tensor values (the host must learn the size before allocating).
DATA_DEPENDENT = frozenset({
    "aten::nonzero", "aten::nonzero_numpy", "aten::argwhere", "aten::masked_select", "aten::unique",
    "aten::_unique", "aten::_unique2", "aten::unique_dim", "aten::unique_consecutive",
    "aten::unique_dim_consecutive", "aten::bincount", "aten::histc",
})
# Ops that take index tensors: data-dependent when an index is a boolean mask.
INDEXING = frozenset({"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"})
COPIES = frozenset({"aten::_to_copy", "aten::copy_", "aten::to"})
# what ``classify`` says of a copy between the devices that waits
COPY_KINDS = frozenset({"device-to-host copy", "blocking host-to-device copy", "host-to-device copy from pageable memory"})
# Ops that run no kernel: allocations, and a reshape of a fresh result that only relabels its shape.
NO_KERNEL = frozenset({"aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty",
                       "aten::_unsafe_view"})

_HERE = os.path.abspath(__file__)
_PACKAGE = os.path.dirname(os.path.dirname(_HERE)) + os.sep
_LIBRARIES = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch,) if getattr(m, "__file__", None))


class SyncError(ZoomKVError):
    """A decode step read a tensor value back to the host (raised by ``SyncAudit(raise_on_sync=True)``)."""


@dataclass(frozen=True)
class SyncEvent:
    op: str  # "aten::nonzero", "Tensor.tolist", ...
    kind: str  # "scalar read", "data-dependent shape", "device-to-host copy", "blocking host-to-device copy",
    # "host read"
    where: str  # "zoomkv/methods/quest.py:171 select_rows" (innermost zoomkv frame), or the innermost caller

    def __str__(self) -> str:
        return f"{self.kind}: {self.op} at {self.where}"


def _location() -> str:
    """The innermost zoomkv frame that led here (outside this module), else the innermost non-torch one."""
    frames = traceback.extract_stack()[:-1]
    fallback = None
    for frame in reversed(frames):
        path = os.path.abspath(frame.filename)
        if path == _HERE or path.startswith(_LIBRARIES):
            continue
        if path.startswith(_PACKAGE):
            rel = os.path.relpath(path, os.path.dirname(_PACKAGE.rstrip(os.sep)))
            return f"{rel}:{frame.lineno} {frame.name}"
        if fallback is None:
            fallback = f"{os.path.basename(path)}:{frame.lineno} {frame.name}"
    return fallback or "?"


def _device_of(x: Any) -> torch.device | None:
    device = getattr(x, "device", None)
    return device if isinstance(device, torch.device) else None


def classify(name: str, args: tuple, kwargs: dict) -> str | None:
    """Why the op ``name`` (``"aten::..."``) called with ``args``/``kwargs`` synchronises, or None."""
    if name in SCALAR_READS:
        return "scalar read"
    if name in DATA_DEPENDENT:
        return "data-dependent shape"
    if name == "aten::repeat_interleave":
        # Repeats given as a tensor: the output size is their sum, unless output_size says it.
        if any(isinstance(a, torch.Tensor) for a in args[:2]) and kwargs.get("output_size") is None:
            return "data-dependent shape"
        return None
    if name in INDEXING:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ()):
            return "data-dependent shape"
        return None
    if name in COPIES:
        if name == "aten::copy_":
            dst, src = (tuple(args) + (None, None))[:2]
            to, frm = _device_of(dst), _device_of(src)
            blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
        else:
            src = args[0] if args else None
            frm = _device_of(src)
            to = kwargs.get("device")
            to = torch.device(to) if to is not None else None
            blocking = not kwargs.get("non_blocking", False)
        if to is None or frm is None or to == frm or "meta" in (to.type, frm.type):
            return None
        if to.type == "cpu" and frm.type != "cpu":
            # into pinned memory without blocking: queued on the stream, nothing waits (the host tier's appends)
            pinned = name == "aten::copy_" and isinstance(dst, torch.Tensor) and dst.is_pinned()
            return None if pinned and not blocking else "device-to-host copy"
        if frm.type == "cpu" and blocking:
            return "blocking host-to-device copy"
        if frm.type == "cpu" and not src.is_pinned():
            # CUDA stages pageable memory through a pinned buffer of its own and may wait for the stream first
            return "host-to-device copy from pageable memory"
    return None


class SyncAudit(TorchDispatchMode):
    """Record (or, with ``raise_on_sync``, refuse) every op that makes the host wait on the device."""

    def __init__(self, raise_on_sync: bool = False):
        super().__init__()
        self.raise_on_sync = raise_on_sync
        self.events: list[SyncEvent] = []
        self.ops = 0  # ops that launch a kernel on a GPU: ops that compute (not views, not allocations) and kernels
        self.in_graphs = 0  # of those, inside steps a GPU replays from a CUDA graph, less one launch each
        self._patched: dict[str, Any] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if kernels.launch_running():  # a Triton kernel under the interpreter: its ops are its own (one launch)
            return func(*args, **kwargs)
        self.ops += not func.is_view and func._schema.name not in NO_KERNEL
        kind = classify(func._schema.name, args, kwargs)
        if kind is not None:
            self._note(func._schema.name, kind)
        return func(*args, **kwargs)

    def _note(self, op: str, kind: str) -> None:
        event = SyncEvent(op, kind, _location())
        self.events.append(event)
        if self.raise_on_sync:
            raise SyncError(f"a decode step synchronises with the host: {event}")

    # ``Tensor.tolist`` and ``Tensor.numpy`` read a CPU tensor without dispatching an op: wrap them.
    def __enter__(self):
        audit = self
        for name in ("tolist", "numpy"):
            original = getattr(torch.Tensor, name)
            self._patched[name] = original

            def read(tensor, *args, _original=original, _name=name, **kwargs):
                if not kernels.launch_running():  # (the interpreter reads a kernel's tensors as numpy arrays)
                    audit._note(f"Tensor.{_name}", "host read")
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, name, read)
        self._launched = kernels.launches()
        try:
            return super().__enter__()
        except BaseException:
            self._restore()
            raise

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self.ops += kernels.launches() - self._launched  # zoomkv's Triton kernels: one launch each
            self._restore()

    def _restore(self) -> None:
        for name, original in self._patched.items():
            setattr(torch.Tensor, name, original)
        self._patched.clear()

    @property
    def launches_captured(self) -> int:
        """``ops`` with every step a GPU captures in a CUDA graph counted as its one replay."""
        return self.ops - self.in_graphs

    @contextlib.contextmanager
    def replayed(self) -> Iterator[None]:
        """Around a step a GPU would replay from a CUDA graph (``zoomkv.memory.graphs``; under the audit it runs
        uncaptured): its launches count as one in ``launches_captured``."""
        ops, launched = self.ops, kernels.launches()
        try:
            yield
        finally:
            self.in_graphs += self.ops - ops + kernels.launches() - launched - 1

    @property
    def clean(self) -> bool:
        return not self.events

    def counts(self) -> Counter:
        """How often each distinct (kind, op, place) occurred."""
        return Counter(self.events)

    def format(self) -> str:
        if not self.events:
            return "no host synchronisation"
        return "\n".join(f"{n:4d}× {event}" for event, n in self.counts().most_common())


@torch.no_grad()
def audit_decode(model: Any, cache: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 steps: int = 8) -> list[SyncAudit]:
    """Prefill ``input_ids`` through ``model`` into ``cache`` (a fresh ``ZoomCache``), then run ``steps`` greedy
    decode steps, each forward under its own ``SyncAudit``; returns the audits, one per step. Only the decode
    forwards are audited: the prefill, the argmax and the mask bookkeeping between steps are the caller's."""
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    passed = generate_cache_kwargs(cache)  # cache= or past_key_values=, as this transformers version names it
    out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=True, **passed)
    audits = []
    for _ in range(steps):
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        attention_mask = torch.cat([attention_mask, torch.ones_like(token)], dim=1)
        position = attention_mask.sum(-1, keepdim=True) - 1
        with SyncAudit() as audit:
            out = model(input_ids=token, attention_mask=attention_mask, position_ids=position, use_cache=True,
                        **passed)
        audits.append(audit)
    return audits


def summarize(audits: list[SyncAudit]) -> str:
    """Several steps' audits in one text: how many steps synchronised, then each distinct op with its count."""
    events = Counter(e for a in audits for e in a.events)
    if not events:
        return f"{len(audits)} decode steps, no host synchronisation"
    dirty = sum(1 for a in audits if not a.clean)
    lines = [f"{dirty} of {len(audits)} decode steps synchronise ({sum(events.values())} ops):"]
    lines += [f"  {n:4d}x {e}" for e, n in events.most_common()]
    return "\n".join(lines)
