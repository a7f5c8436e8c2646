"""A CUDA device stood in for on the CPU: ``tests/test_cuda.py`` runs on a machine without a GPU.

Tensors on ``cuda:0`` are CPU tensors wrapped in ``StandIn``: their numbers are real (computed by the CPU's
kernels), their device is CUDA's, and every op on them is held to CUDA's rules, so the GPU code paths
(``is_cuda`` branches, pinned host tiers, asynchronous copies, the Triton kernels) run here with the answers
they give on a GPU and fail where a GPU would fail them:

- **placement**: an op that mixes a CUDA tensor with a CPU one (not a 0-dim CPU scalar) raises as CUDA does;
  indices may be on the CPU or on the indexed tensor's device;
- **pinned memory**: ``pin_memory=True`` / ``.pin_memory()`` give host tensors ``is_pinned()`` says are pinned
  (their storage is remembered), and only those take asynchronous copies from the device;
- **synchronisations**: a scalar read of a CUDA tensor, an op whose shape depends on its values, a blocking
  copy between the devices, a device-to-host copy into pageable memory, a host-to-device copy from it (blocking
  or not: CUDA stages it and may wait for the stream), ``torch.cuda.synchronize()``: one event
  each, and under ``torch.cuda.set_sync_debug_mode("error")`` a ``RuntimeError`` as on CUDA;
- **asynchronous copies in flight**: pinned host memory written by a non-blocking copy from the device is not
  the host's to read or write until a synchronisation (a GPU would let the host see the bytes before they
  land); the host touching it first raises (``RaceError``). The device's own kernels read it in stream order;
- **Triton kernels** launch where they would on a GPU and run under Triton's interpreter on the CPU tensors
  inside;
- **device memory**: the bytes of every live storage on the device (rounded up to 512, as CUDA's caching allocator
  hands out blocks), so ``torch.cuda.memory_allocated`` / ``max_memory_allocated`` / ``reset_peak_memory_stats``
  answer as on a GPU, and ``peak_by_location()`` says which lines allocated what the peak held (``trace(True)``).
  What it cannot count: temporaries inside one op (torch's attention on the CPU computes its whole score
  matrix where FlashAttention does not), and the allocator's cached, fragmented memory (``memory_reserved``).

What it cannot show: time, and what only a GPU's runtime does (CUDA graphs are left off:
``ZOOMKV_CUDA_GRAPHS=0``; ``cudaHostRegister``; a real stream's overlap). A C++ device guard for CUDA (c10's
``FakeGuardImpl``) is registered once through ``torch.utils.cpp_extension``: torch's indexing opens a guard for the
tensor's device, which a CPU-only build does not have.
"""

from __future__ import annotations

import contextlib
import functools
import os
import traceback
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from zoomkv import kernels
from zoomkv.memory import sync_audit

CUDA = torch.device("cuda", 0)
_LAUNCH = kernels.launch  # (``active`` puts the stand-in's in its place)
CPU = torch.device("cpu")
_HERE = os.path.abspath(__file__)
_ROOT = os.path.dirname(os.path.dirname(_HERE)) + os.sep
BEFORE = "(before the last reset_peak_memory_stats)"
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep

_GUARD_SOURCE = r"""
#include <torch/extension.h>
#include <c10/core/impl/FakeGuardImpl.h>
C10_REGISTER_GUARD_IMPL(CUDA, c10::impl::FakeGuardImpl<c10::DeviceType::CUDA>);
bool registered() { return true; }
"""

# Ops that may take tensors of both devices: copies, and indexing (indices on the CPU are moved by torch).
_INDEXING = sync_audit.INDEXING | {"aten::_unsafe_index"}
_CROSSING = _INDEXING | {"aten::copy_", "aten::_to_copy", "aten::to", "aten::is_pinned", "aten::_pin_memory",
                         "aten::pin_memory", "aten::_has_compatible_shallow_copy_type"}
# Ops that read no element (shape, views, fresh memory): the host may do them to memory a copy is still writing.
_NO_READ = frozenset({"aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty",
                      "aten::new_empty_strided", "aten::is_pinned", "aten::detach", "aten::alias", "aten::lift_fresh",
                      "aten::_has_compatible_shallow_copy_type"})


class RaceError(RuntimeError):
    """The host read or wrote pinned memory an asynchronous copy from the device was still writing."""


@functools.cache
def available() -> bool:
    """Whether the stand-in can run here: a CPU-only torch (a real GPU is tested as itself) and a C++ compiler for
    the device guard. It registers the guard in this process for good: ask only in a process that runs the stand-in."""
    if torch.cuda.is_available():
        return False
    try:
        from torch.utils import cpp_extension

        cpp_extension.load_inline("zoomkv_cuda_standin_guard", cpp_sources=_GUARD_SOURCE, functions=["registered"])
    except Exception:  # no compiler or headers: the tests that need the stand-in skip
        return False
    return True


class _State:
    strict = False  # torch.cuda.set_sync_debug_mode("error")
    syncs: list[str] = []  # every synchronisation, in order (op and where)
    # storages of pinned host memory (weakly: a storage freed and its address reused is not pinned)
    pinned: weakref.WeakSet = weakref.WeakSet()
    # of those, the bytes a non-blocking copy from the device writes, not yet waited for: storage -> bool per byte
    in_flight: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
    # storages on the device (weakly: each one's bytes are given back when its last tensor goes)
    on_device: weakref.WeakSet = weakref.WeakSet()
    allocated = 0  # bytes of the live ones
    peak = 0  # the most since the last reset_peak_memory_stats
    tracing = False  # whether each allocation notes the line that made it (slow: a stack walk each)
    where: dict[int, tuple[int, str]] = {}  # id of a live storage -> (bytes, line), while tracing
    at_peak: dict[str, int] = {}  # line -> bytes live at the last peak noted, while tracing
    noted = 0  # the peak at_peak was taken at


def syncs() -> list[str]:
    """The synchronisations seen so far (``reset()`` clears them)."""
    return list(_State.syncs)


def reset() -> None:
    _State.syncs.clear()


def memory_allocated(device: Any = None) -> int:
    return _State.allocated


def max_memory_allocated(device: Any = None) -> int:
    return _State.peak


def reset_peak_memory_stats(device: Any = None) -> None:
    _State.peak = _State.noted = _State.allocated
    for key, (size, _line) in _State.where.items():  # (what lives on is the new peak's base)
        _State.where[key] = (size, BEFORE)
    _State.at_peak = _by_location()


def trace(on: bool) -> None:
    """Note the line that allocates each device storage from now on (``peak_by_location`` reads them)."""
    _State.tracing = on


def peak_by_location() -> dict[str, int]:
    """The device bytes live at the peak, by the line that allocated them (storages allocated while tracing and
    after the last ``reset_peak_memory_stats``; those from before it under ``BEFORE``, the rest under ``"?"``),
    largest first."""
    return dict(sorted(_State.at_peak.items(), key=lambda kv: -kv[1]))


def _by_location() -> dict[str, int]:
    lines: dict[str, int] = {}
    for size, line in _State.where.values():
        lines[line] = lines.get(line, 0) + size
    untraced = _State.allocated - sum(lines.values())
    if untraced:
        lines["?"] = untraced
    return lines


def _freed(key: int, size: int) -> None:
    _State.allocated -= size
    _State.where.pop(key, None)


def _allocated(inner: torch.Tensor) -> None:
    """A device tensor's storage, counted once while it lives."""
    storage = inner.untyped_storage()
    if storage in _State.on_device:
        return
    _State.on_device.add(storage)
    size = -(-storage.nbytes() // 512) * 512
    _State.allocated += size
    weakref.finalize(storage, _freed, id(storage), size)
    if _State.tracing:
        _State.where[id(storage)] = (size, _allocating_line())
    _State.peak = max(_State.peak, _State.allocated)
    # while tracing, the lines behind the peak noted again each time it has grown by 1/64 (a walk over the live
    # storages): within 2% of the peak itself
    if _State.tracing and _State.allocated > _State.noted + _State.noted // 64:
        _State.at_peak, _State.noted = _by_location(), _State.allocated


def _allocating_line() -> str:
    """The innermost frame outside torch and this file: the model's or zoomkv's line that asked for the memory."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = os.path.abspath(frame.filename)
        if path != _HERE and not path.startswith(_TORCH):
            # (a library's path from its site-packages, one inside the checkout from its root)
            where = path.rsplit("site-packages" + os.sep, 1)[-1] if "site-packages" in path else \
                os.path.relpath(path, _ROOT) if path.startswith(_ROOT) else path
            return f"{where}:{frame.lineno} {frame.name}"
    return "?"


def _storage(t: torch.Tensor) -> torch.UntypedStorage:
    return t.untyped_storage()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of its storage a tensor (a view) holds, as indices."""
    size = t.element_size()
    elements = torch.as_strided(torch.arange(t.untyped_storage().nbytes() // size), t.shape, t.stride(),
                                t.storage_offset())
    return (elements.reshape(-1, 1) * size + torch.arange(size)).reshape(-1)


def _note_in_flight(t: torch.Tensor) -> None:
    storage = _storage(t)
    if storage not in _State.in_flight:
        _State.in_flight[storage] = torch.zeros(storage.nbytes(), dtype=torch.bool)
    _State.in_flight[storage][_bytes(t)] = True


class StandIn(torch.Tensor):
    """A CPU tensor (``inner``) that says it lives on ``device``."""

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor, device: torch.device) -> StandIn:
        t = torch.Tensor._make_wrapper_subclass(cls, inner.shape, strides=inner.stride(),
                                                storage_offset=inner.storage_offset(), dtype=inner.dtype,
                                                device=device, requires_grad=inner.requires_grad)
        t.inner = inner
        if t.is_cuda:
            _allocated(inner)
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _dispatch(func, args, kwargs or {})

    def __repr__(self) -> str:  # (printing must not read a CUDA tensor back)
        return f"StandIn({self.device}, {tuple(self.shape)}, {self.dtype})"

    def tolist(self):
        if self.is_cuda:
            _sync("Tensor.tolist")
        else:
            _host_touch([self], "Tensor.tolist")
        return torch.Tensor.tolist(self.inner)

    def numpy(self, *args, **kwargs):
        if self.is_cuda:
            raise TypeError(f"can't convert {self.device} device type tensor to numpy. Use Tensor.cpu() to copy the "
                            "tensor to host memory first.")
        _host_touch([self], "Tensor.numpy")
        return torch.Tensor.numpy(self.inner, *args, **kwargs)

    def data_ptr(self) -> int:
        return self.inner.data_ptr()

    def untyped_storage(self):
        return self.inner.untyped_storage()


def _unwrap(x: Any) -> Any:
    return x.inner if isinstance(x, StandIn) else x


def _device(x: torch.Tensor) -> torch.device:
    return x.device if isinstance(x, StandIn) else CPU


def _sync(what: str) -> None:
    """The host waits for the stream: every copy queued before has landed (torch's blocking copies synchronise
    the stream too)."""
    where = sync_audit._location()
    _State.syncs.append(f"{what} at {where}")
    _State.in_flight.clear()
    if _State.strict:
        raise RuntimeError(f"called a synchronizing CUDA operation: {what} at {where}")


def _host_touch(tensors: list[torch.Tensor], op: str) -> None:
    """The host reads or writes these CPU tensors now: none may be pinned memory a copy is still writing."""
    for t in tensors:
        if not isinstance(t, StandIn) or t.is_cuda or _storage(t.inner) not in _State.in_flight:
            continue
        if _State.in_flight[_storage(t.inner)][_bytes(t.inner)].any():
            raise RaceError(f"{op} touches pinned host memory an asynchronous copy from the GPU is still writing, "
                            f"before any synchronisation, at {sync_audit._location()}")


def _is_pinned(t: torch.Tensor) -> bool:
    return isinstance(t, StandIn) and not t.is_cuda and _storage(t.inner) in _State.pinned


def _pinned(inner: torch.Tensor) -> StandIn:
    _State.pinned.add(_storage(inner))
    return StandIn(inner, CPU)


def _check_devices(name: str, tensors: list[torch.Tensor]) -> None:
    if name in _CROSSING:
        return
    devices = {_device(t) for t in tensors if t.dim() > 0 or _device(t).type != "cpu"}
    if len(devices) > 1:
        raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                           f"{' and '.join(sorted(str(d) for d in devices))}! ({name})")


def _check_indices(name: str, args: tuple) -> None:
    if name not in _INDEXING:
        return
    self_device = _device(args[0])
    for index in args[1] if len(args) > 1 else ():
        if isinstance(index, torch.Tensor) and _device(index) not in (self_device, CPU):
            raise RuntimeError(f"indices should be either on cpu or on the same device as the indexed tensor "
                               f"({self_device})")
        if isinstance(index, torch.Tensor) and self_device.type == "cuda" and _device(index) == CPU:
            _sync(f"{name} with host indices (a blocking host-to-device copy)")


def _copy_syncs(src: torch.Tensor, to: torch.device, non_blocking: bool, dst_pinned: bool) -> bool:
    """Whether a copy from ``src`` to ``to`` waits (CUDA's rule); notes it. Returns whether it stays in flight."""
    frm = _device(src)
    if frm == to:
        return False
    if not non_blocking:
        _sync(f"a blocking copy {frm.type} -> {to.type}")
        return False
    if frm.type == "cpu" and not _is_pinned(src):
        # the driver stages pageable memory through its own pinned buffer, and may wait for the stream to do so
        _sync("a host-to-device copy from pageable memory")
        return False
    if to.type == "cpu":  # device to host, not blocking: asynchronous into pinned memory only
        if not dst_pinned:
            _sync("a device-to-host copy into pageable memory")
            return False
        return True
    return False


def _to(func, args: tuple, kwargs: dict) -> Any:
    """``aten::to`` (when a mode sees it whole): itself where nothing changes, else the copy ``_to_copy`` makes. (Run
    on the CPU tensor inside, it would return that tensor, wherever it was asked to go.)"""
    bound = {a.name: v for a, v in zip(func._schema.arguments, args, strict=False)} | kwargs
    src = bound["self"]
    device, dtype = bound.get("device"), bound.get("dtype")
    if "other" in bound:
        device, dtype = bound["other"].device, bound["other"].dtype
    device = torch.device(device) if device is not None else _device(src)
    dtype = dtype if dtype is not None else src.dtype
    if device.type == _device(src).type and dtype == src.dtype and not bound.get("copy"):
        return src
    return _dispatch(torch.ops.aten._to_copy.default, (src,), {"dtype": dtype, "device": device,
                                                              "non_blocking": bool(bound.get("non_blocking"))})


def _dispatch(func, args: tuple, kwargs: dict) -> Any:
    name = func._schema.name
    if name == "aten::to":
        return _to(func, args, kwargs)
    flat, _ = tree_flatten((args, kwargs))
    tensors = [x for x in flat if isinstance(x, torch.Tensor)]
    standins = [t for t in tensors if isinstance(t, StandIn)]
    # where the op puts its result when it says (``device=``, or positionally: ``aten::to.device``)
    device_kw = kwargs.get("device", next((a for a in args if isinstance(a, torch.device)), None))
    device_kw = torch.device(device_kw) if device_kw is not None else None
    if device_kw is not None and device_kw.type == "cuda" and device_kw.index is None:
        device_kw = CUDA  # ("cuda" is the current device, as torch resolves it)
    pin = bool(kwargs.get("pin_memory"))
    if name == "aten::is_pinned":  # (a plain CPU tensor too: torch would ask for an accelerator)
        return _is_pinned(args[0])
    if name == "aten::_pin_memory":
        _host_touch([args[0]], name)
        return _pinned(_unwrap(args[0]).clone())
    if kernels.launch_running() or not (standins or pin or (device_kw is not None and device_kw.type == "cuda")):
        return func(*args, **kwargs)  # plain CPU tensors (and a kernel's own ops under the interpreter)

    _check_devices(name, tensors)
    _check_indices(name, args)
    on_cuda = any(_device(t).type == "cuda" for t in tensors) or (device_kw is not None and device_kw.type == "cuda")
    in_flight_after = None
    if name == "aten::copy_":
        dst, src = args[0], args[1]
        non_blocking = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
        if _device(src).type == "cpu" and _device(dst).type == "cpu":  # (a copy the device makes is in stream order)
            _host_touch([src, dst], name)
        if _copy_syncs(src, _device(dst), non_blocking, _is_pinned(dst)):
            in_flight_after = dst.inner
    elif name == "aten::_to_copy":
        to = device_kw or _device(args[0])
        non_blocking = bool(kwargs.get("non_blocking", False))
        if _device(args[0]).type == "cpu" and to.type == "cpu":
            _host_touch([args[0]], name)
        # torch allocates pinned memory for a non-blocking copy to the host, which then runs asynchronously
        pin = pin or (non_blocking and to.type == "cpu" and _device(args[0]).type == "cuda")
        _copy_syncs(args[0], to, non_blocking, pin)
    elif on_cuda:
        kind = sync_audit.classify(name, args, kwargs)
        if kind is not None and kind not in sync_audit.COPY_KINDS:
            _sync(f"{kind}: {name}")
    elif not func.is_view and name not in _NO_READ:
        _host_touch(standins, name)

    unwrapped_kwargs = {k: _unwrap(v) for k, v in kwargs.items()}
    if "device" in kwargs:
        unwrapped_kwargs["device"] = CPU
    if "pin_memory" in unwrapped_kwargs:
        unwrapped_kwargs["pin_memory"] = False
    out = func(*tree_map(lambda a: CPU if isinstance(a, torch.device) else _unwrap(a), args), **unwrapped_kwargs)

    result_device = device_kw or (_device(tensors[0]) if tensors else CPU)
    if name == "aten::copy_":
        result_device = _device(args[0])
    by_inner = {id(t.inner): t for t in standins}

    def wrap(o: Any) -> Any:
        if not isinstance(o, torch.Tensor) or isinstance(o, StandIn):
            return o
        if id(o) in by_inner:  # an op in place returns its argument
            return by_inner[id(o)]
        if pin and result_device.type == "cpu":
            return _pinned(o)
        return StandIn(o, result_device)

    if func.is_view and torch.is_inference_mode_enabled() and not args[0].is_inference():
        # a view of a tensor made outside inference mode (a parameter) is not an inference tensor: autograd sets
        # its version counter from its base next, as it does for a CUDA tensor's view
        with torch.inference_mode(False):
            result = tree_map(wrap, out)
    else:
        result = tree_map(wrap, out)
    if in_flight_after is not None:
        _note_in_flight(in_flight_after)
    if pin and name == "aten::_to_copy" and result_device.type == "cpu" and isinstance(result, StandIn):
        _note_in_flight(result.inner)
    return result


class _Mode(TorchDispatchMode):
    """Factory functions asked for ``cuda`` (or pinned memory) while no stand-in tensor is an argument."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return _dispatch(func, args, kwargs or {})


def _synchronize(device: Any = None) -> None:
    _sync("torch.cuda.synchronize()")


def _set_sync_debug_mode(mode: int | str) -> None:
    _State.strict = mode in ("error", 2)


def _standin_usable(*tensors: torch.Tensor) -> bool:
    """``zoomkv.kernels.usable`` as on a GPU: every tensor on the device or pinned, one of them on the device."""
    if not kernels.enabled():
        return False
    return any(t.is_cuda for t in tensors) and all(t.is_cuda or t.is_pinned() for t in tensors)


def _standin_launch(make, grid, *args, **kwargs) -> None:
    """A kernel launched on the stand-in: ``zoomkv.kernels.launch`` (counted as one), run under Triton's interpreter
    on the CPU tensors inside."""
    _LAUNCH(lambda _interpreting: make(True), grid, *(_unwrap(a) for a in args),
            **{k: _unwrap(v) for k, v in kwargs.items()})


def _kernel_modules() -> list[Any]:
    import importlib
    import pkgutil

    found = []
    for info in pkgutil.iter_modules(kernels.__path__):
        found.append(importlib.import_module(f"zoomkv.kernels.{info.name}"))
    return found


@contextlib.contextmanager
def active(monkeypatch) -> Iterator[None]:
    """The stand-in on for a block: ``cuda`` tensors are stand-ins, ``torch.cuda``'s calls the tests make answer as
    on a GPU, the kernels run interpreted, CUDA graphs off."""
    if not available():
        raise RuntimeError("the CUDA stand-in needs a CPU-only torch and a C++ compiler")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("ZOOMKV_CUDA_GRAPHS", "0")
    # module.to("cuda") puts its parameters' new tensors in place (not ``param.data = ...``, which would keep the
    # Parameter's class and lose the stand-in's)
    monkeypatch.setattr(torch.__future__, "_overwrite_module_params_on_conversion", True)
    monkeypatch.setattr(torch.cuda, "_lazy_init", lambda: None)  # (torch's ``.to("cuda")`` calls it first)
    monkeypatch.setattr(torch.cuda, "synchronize", _synchronize)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", _set_sync_debug_mode)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device=None: torch.zeros(16, dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device=None: None)
    for counter in (memory_allocated, max_memory_allocated, reset_peak_memory_stats):
        monkeypatch.setattr(torch.cuda, counter.__name__, counter)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    for module in [kernels, *_kernel_modules()]:
        if hasattr(module, "usable"):
            monkeypatch.setattr(module, "usable", _standin_usable)
        if hasattr(module, "launch"):
            monkeypatch.setattr(module, "launch", _standin_launch)
    _State.strict = False
    # torch.tensor(data, device="cuda") makes its CPU tensor with the modes off, then moves it: with this, the move
    # is an op the stand-in sees (FakeTensorMode does the same)
    lift = torch._C._only_lift_cpu_tensors()
    torch._C._set_only_lift_cpu_tensors(True)
    try:
        with _Mode():
            yield
    finally:
        torch._C._set_only_lift_cpu_tensors(lift)
        _State.strict = _State.tracing = False
        _State.where.clear()
    _State.in_flight.clear()


@contextlib.contextmanager
def off() -> Iterator[None]:
    """Inside ``active``: a block of plain CPU work (``cuda`` tensors made in it are refused by torch as on a
    CPU-only machine; the stand-in's tensors made before it keep their rules)."""
    with torch.utils._python_dispatch._disable_current_modes():
        yield


def as_gpu(monkeypatch, total_memory: int = 80 << 30) -> None:
    """Inside ``active``: the runtime questions a command asks torch before it runs on a GPU answered as one GPU
    would answer them (available, one device, its name and size, the current accelerator), and the host tier's pinned memory torch's own (no
    ``cudaHostRegister`` here). ``torch.cuda.is_available()`` stays False otherwise: the tests of placement rely on
    it."""
    from types import SimpleNamespace

    from zoomkv.memory import pinned

    device = SimpleNamespace(total_memory=total_memory, name="CUDA stand-in")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "CUDA stand-in")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _=None: device)
    # accelerate's question (which accelerator, then that device made current)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda check_available=False: CUDA)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(pinned, "EXACT_BYTES", 1 << 62)


def on_standin(t: torch.Tensor) -> torch.Tensor:
    """``t`` (a CPU tensor) as a stand-in CUDA tensor."""
    return StandIn(t, CUDA)

