"""sekv's decode-step router and row encoder as one compiled CPU call each (``select.cpp``).

The torch path (``SeKV._pick`` / ``codes.encode``) is the reference and runs everywhere; on CPU tensors this
kernel does the same work per layer in one call, without the ``[g, n·bytes]`` gather, the softmax tensors
and the sort of every row the torch path materialises (``BENCHMARKS.md``, "Decode and prefill speed on CPU").

It is built once per machine on first use and called through ``ctypes`` (``zoomkv.native``: plain C, nothing
executes from a file); its loops over (sequence, KV head) run on torch's own OpenMP threads. Without a
compiler, or with ``ZOOMKV_NATIVE=0``, sekv runs the torch path and says so once.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import torch

from zoomkv.memory.quant import ChannelQuantizedRowBuffer, QuantizedRowBuffer
from zoomkv.memory.tiers import RowBuffer
from zoomkv.methods.sekv.codes import layout_bits
from zoomkv.native import Kernel, enabled, torch_path
from zoomkv.protocol.phases import clock_running, phase
from zoomkv.protocol.recallable import reserve_recall_buffer

SOURCE = Path(__file__).with_name("select.cpp")

_I64, _F64, _P = ctypes.c_int64, ctypes.c_double, ctypes.c_void_p


class HostArgs(ctypes.Structure):
    """A host tier's rows as the kernel reads them (``HostRows`` in select.cpp): float32 rows (bits 0); codes per
    token with fp16 scale and minimum per ``group`` channels; or per channel (KIVI: ``channel`` 1) over blocks of
    ``group`` rows, ``coded`` rows of them, the newer ones exact in ``residual``."""

    _fields_ = [("data", _P), ("cap", _I64), ("bits", _I64), ("scale", _P), ("lo", _P), ("group", _I64),
                ("channel", _I64), ("scale_cap", _I64), ("coded", _I64), ("residual", _P), ("residual_cap", _I64)]


class LayerArgs(ctypes.Structure):
    """Every buffer of one layer a decode step reads and writes (``Layer`` in select.cpp, field for field)."""

    _fields_ = [("batch", _I64), ("heads", _I64), ("d", _I64), ("dv", _I64), ("n", _I64), ("query_rows", _I64),
                ("scaling", _F64), ("query", _P), ("idx", _P), ("bias", _P),
                ("rotation", _P), ("gains", _P), ("mean", _P),
                ("codes", _P), ("codes_cap", _I64), ("bits", _I64), ("rms", _P), ("rms_cap", _I64),
                ("anchors", _I64), ("anchor_pos", _P), ("anchor_codes", _P), ("anchor_rms", _P), ("anchor_bits", _I64),
                ("valid", _P), ("valid_cap", _I64),
                ("sinks", _I64), ("sink_pos", _P), ("recent", _I64), ("m", _I64), ("k", _I64),
                ("fine_codes", _P), ("fine_cap", _I64), ("fine_rms", _P), ("fine_rms_cap", _I64), ("fine_bits", _I64),
                ("rescore_host", _I64), ("keys", HostArgs), ("values", HostArgs),
                ("key_sum", _P), ("value_sum", _P), ("count", _P), ("offset", _P),
                ("out_keys", _P), ("out_values", _P), ("out_cap", _I64),
                ("append_keys", _I64), ("append_values", _I64),
                ("anchor_copies", _I64), ("anchor_keys", HostArgs), ("anchor_values", HostArgs),
                ("hash_bits", _I64), ("hash_key", _P), ("hash_query", _P), ("hash_layout", _I64 * 3),
                ("hash_per_sequence", _I64)]


_LAYER = ctypes.POINTER(LayerArgs)
KERNEL = Kernel(SOURCE, "sekv's compiled CPU router", {
    "zk_sekv_step": ([_LAYER], ctypes.c_int),
    "zk_sekv_recall_rows": ([_LAYER], ctypes.c_int),
    "zk_sekv_append": ([_LAYER, _P, _P, _I64], ctypes.c_int),
    "zk_sekv_codes": ([_I64, _I64, _I64, _I64, _P, _P, _P, ctypes.c_int, _P, _P, ctypes.c_int, _P, _P], ctypes.c_int),
})
library, usable = KERNEL.library, KERNEL.usable
__all__ = ["KERNEL", "HostArgs", "LayerArgs", "NativeLayer", "enabled", "encode", "host_rows", "library",
           "torch_path", "usable"]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def encode(keys: torch.Tensor, mean: torch.Tensor, rotation: torch.Tensor, bits: int,
           fine_bits: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """New rows ``keys`` ``[b, h, t, d]`` → their codes and fp16 RMS at ``bits`` (and at ``fine_bits`` when not
    0), as ``codes.encode(((keys - mean) @ rotation), bits)`` computes them."""
    lib = library()
    assert lib is not None
    b, h, t, d = keys.shape
    x = keys.float().contiguous()
    mu = mean.float().contiguous()
    rot = rotation.float().contiguous()
    codes = torch.empty(b, h, t, d * bits // 8, dtype=torch.uint8)
    rms = torch.empty(b, h, t, 1, dtype=torch.float16)
    fine = torch.empty(b, h, t, d * fine_bits // 8, dtype=torch.uint8) if fine_bits else None
    fine_rms = torch.empty(b, h, t, 1, dtype=torch.float16) if fine_bits else None
    if lib.zk_sekv_codes(b, h, t, d, _ptr(x), _ptr(mu), _ptr(rot), bits, _ptr(codes), _ptr(rms),
                         fine_bits, _ptr(fine), _ptr(fine_rms)):
        raise ValueError(f"sekv's native encoder takes heads of up to 512 channels, not {d}")
    return codes, rms, fine, fine_rms


def host_rows(buf: Any) -> list | None:
    """A host-tier row buffer as ``zk_sekv_recall`` reads it (float32 rows; 8-, 4- or 2-bit codes per token with
    their scales and minimums; KIVI's per-channel codes with their exact newest rows), or None when it cannot
    (another dtype, a padded width, exact outlier channels, a low-rank tier)."""
    if type(buf) is RowBuffer:
        data = buf.data
        ok = data.dtype == torch.float32 and data.is_contiguous() and data.device.type == "cpu"
        return [_ptr(data), data.shape[2], 0, None, None, 0, 0, 0, 0, None, 0] if ok else None
    if type(buf) is ChannelQuantizedRowBuffer and buf.dtype == torch.float32:
        parts = (buf.codes.data, buf.scale.data, buf.lo.data, buf.residual)
        if all(t.is_contiguous() and t.device.type == "cpu" for t in parts) and buf.residual.dtype == torch.float32:
            return [_ptr(parts[0]), parts[0].shape[2], buf.bits, _ptr(parts[1]), _ptr(parts[2]), buf.block,
                    1, parts[1].shape[2], buf.codes.length, _ptr(buf.residual), buf.residual.shape[2]]
        return None
    group = min(getattr(buf, "group", 1), getattr(buf, "width", 0))  # quantize() takes one group a row on small heads
    if (type(buf) is QuantizedRowBuffer and buf.dtype == torch.float32 and not buf.pad and buf.width % group == 0
            and buf.exact is None):
        parts = (buf.codes.data, buf.scale.data, buf.lo.data)
        if all(t.is_contiguous() and t.device.type == "cpu" for t in parts):
            return [_ptr(parts[0]), parts[0].shape[2], buf.bits, _ptr(parts[1]), _ptr(parts[2]), group,
                    0, 0, 0, None, 0]
    return None


def _width(buf: Any) -> int:
    return getattr(buf, "width", None) or buf.data.shape[-1]


def _held(buf: RowBuffer) -> torch.Tensor:
    """A row buffer's storage as the kernel reads and writes it: contiguous (a view a prefill stored is copied
    once; grown buffers already are)."""
    if not buf.data.is_contiguous():
        buf.data = buf.data.contiguous()
    return buf.data


class NativeLayer:
    """One layer's buffers laid out for the kernel once (``LayerArgs``), so that a decode step is one compiled
    call to append and one to select and recall, with a few fields set in between: on the CPU, each Python
    line of a step runs with caches the model's weights just flushed, so a step's Python costs more than its C.

    Built by ``SeKV`` after the prefill (``memory.meta["native_layer"]``), refreshed whenever a buffer may have moved:
    before it grows one, and when the rows held are not the rows it last saw (anything else appended). Its
    kernel call picks ``k`` rows per KV head and, with ``recall``, decodes them and the summary row into the
    recall buffers; without, it returns the picks (``split``: stage one's ``m`` candidates, rescored in torch)."""

    def __init__(self, memory, *, code_bits: int, anchor_bits: int, recent: int, k: int, m_max: int, fine_bits: int, rescore_host: bool, gains: torch.Tensor | None, offset: torch.Tensor | None,
                 summary_prefix: str | None):
        self.dev, self.host = memory.device_tier, memory.host_tier
        self.k, self.m_max = k, m_max  # m_max: the rows stage one keeps at most (k: one stage)
        self.args = a = LayerArgs()
        self.ref = ctypes.byref(a)
        dev = self.dev
        self.codes, self.rms = dev["codes"], dev["code_rms"]
        self.fine = (self.host["fine_codes"], self.host["fine_rms"]) if fine_bits else None
        b, h = self.codes.data.shape[:2]
        a.batch, a.heads, a.d, a.dv = b, h, memory.key_dim, memory.value_dim
        a.scaling = float(memory.meta["scaling"])
        a.bits, a.anchor_bits, a.fine_bits, a.recent, a.k = code_bits, anchor_bits, fine_bits, recent, k
        # held here: the kernel reads these through raw pointers for the cache's life
        self.held = [dev["code_rotation"].float().contiguous(), dev["code_mean"].float().contiguous(),
                     dev["sink_pos"].contiguous()]
        a.rotation, a.mean, a.sink_pos = (t.data_ptr() for t in self.held)
        a.sinks = self.held[2].shape[1]
        if gains is not None:
            self.held.append(gains.float().contiguous())
            a.gains = self.held[-1].data_ptr()
        if "hash_key" in dev:  # a hash index: [heads, d, m] projections of keys and queries ([batch, ...]: fitted)
            self.held += [dev["hash_key"].float().contiguous(), dev["hash_query"].float().contiguous()]
            layout = memory.meta["hash_layout"]
            a.hash_bits, a.hash_key, a.hash_query = layout_bits(layout), self.held[-2].data_ptr(), \
                self.held[-1].data_ptr()
            a.hash_layout[:] = layout
            a.hash_per_sequence = int(self.held[-1].dim() == 4)
        if "anchor_pos" in dev and dev["anchor_pos"].shape[1]:
            anchors = [dev["anchor_pos"].contiguous(), dev["anchor_codes"].contiguous(), dev["anchor_rms"].contiguous()]
            self.held += anchors
            a.anchors = anchors[0].shape[1]
            a.anchor_pos, a.anchor_codes, a.anchor_rms = (t.data_ptr() for t in anchors)
        # the append writes every buffer (False: another dtype's running sums, which the torch append keeps)
        self.appends, recall = True, True
        if summary_prefix is not None:
            sums = [dev[f"{summary_prefix}_{name}"] for name in ("key_sum", "value_sum", "count")]
            if all(t.dtype == torch.float32 and t.is_contiguous() for t in sums):
                a.key_sum, a.value_sum, a.count = (t.data_ptr() for t in sums)  # the tier's own, added to in place
            else:
                self.appends = recall = False
        if offset is not None:
            self.held.append(offset.float().contiguous())
            a.offset = self.held[-1].data_ptr()
        # rows the kernel decodes whole (not a rank-gated tier's coordinates)
        readable = tuple(host_rows(self.host[name]) is not None and _width(self.host[name]) == dim
                         for name, dim in (("keys", a.d), ("values", a.dv)))
        self.readable = readable
        self.relaid = [n for n, ok in zip(("keys", "values"), readable, strict=True)
                       if ok and type(self.host[n]) is ChannelQuantizedRowBuffer]
        # host_anchor_bits: the anchors' finer copies (fixed after the prefill), read in place of their rows
        copies = [self.host.get(f"exact_anchor_{name}") for name in ("keys", "values")]
        if copies[0] is not None and a.anchors:
            found = [host_rows(c) for c in copies]
            if all(f is not None for f in found):
                a.anchor_copies, a.anchor_keys, a.anchor_values = 1, HostArgs(*found[0]), HostArgs(*found[1])
            else:
                recall = False  # copies the kernel cannot read (fp16): the torch recall swaps them in
        self.split = rescore_host and not readable[0]  # a host tier the kernel cannot read: stage two in torch
        a.rescore_host = int(rescore_host and not self.split)
        # the recall with the summary row after the rows (summary_prefix), decoded from any host format it reads
        self.recall = recall and summary_prefix is not None and all(readable)
        if self.recall:
            reserve_recall_buffer(memory, k + 1)  # the summary row's slot is one of the budget's rows
            self.recall = all(dev[f"recall_{name}"].dtype == torch.float32 for name in ("keys", "values"))
        a.append_keys, a.append_values = (int(type(self.host[n]) is RowBuffer and self.host[n].data.dtype == torch.float32)
                                          for n in ("keys", "values"))
        # what a step's append touches, worked out once: the buffers the kernel writes (their lengths move
        # here), the quantized tiers that code their own rows, those whose layout moves every append
        self.written = [self.codes, self.rms, *(self.fine or ())]
        self.written += [self.host[n] for n, own in (("keys", a.append_keys), ("values", a.append_values)) if own]
        self.coded = [(self.host[n], n) for n, own in (("keys", a.append_keys), ("values", a.append_values)) if not own]
        self.valid = self.dev.get("valid")
        self.lib = library()
        self.refresh()

    def refresh(self) -> None:
        """Every pointer and capacity that moves: after a buffer grows, or rows came in another way."""
        a, host = self.args, self.host
        a.codes, a.codes_cap = _held(self.codes).data_ptr(), self.codes.capacity
        a.rms, a.rms_cap = _held(self.rms).data_ptr(), self.rms.capacity
        if self.fine is not None:
            a.fine_codes, a.fine_cap = _held(self.fine[0]).data_ptr(), self.fine[0].capacity
            a.fine_rms, a.fine_rms_cap = _held(self.fine[1]).data_ptr(), self.fine[1].capacity
        for name, ok in zip(("keys", "values"), self.readable, strict=True):
            if ok:
                setattr(a, name, HostArgs(*host_rows(host[name])))
        valid = self.dev.get("valid")
        if valid is not None:
            flat = _held(valid)[:, 0, :, 0]  # [b, capacity] bool, contiguous
            a.valid, a.valid_cap = flat.data_ptr(), flat.shape[-1]
        if self.recall:
            out = (self.dev["recall_keys"], self.dev["recall_values"])
            if any(t.dtype != torch.float32 or not t.is_contiguous() for t in out):
                raise ValueError("sekv's native recall writes contiguous float32 rows")
            a.out_keys, a.out_values, a.out_cap = out[0].data_ptr(), out[1].data_ptr(), out[0].shape[2]
            self.selected = (out[0][:, :, : self.k + 1], out[1][:, :, : self.k + 1])
        a.n = host["keys"].length
        self.room = min(buf.capacity - buf.length for buf in self._growing())

    def _growing(self) -> list:
        """The buffers a step appends to, as row buffers (a quantized tier's parts)."""
        found = [self.codes, self.rms, *(self.fine or ())]
        for buf in (self.host["keys"], self.host["values"], self.dev.get("valid")):
            if type(buf) is QuantizedRowBuffer:
                found += [buf.codes, buf.scale, buf.lo]
            elif type(buf) is RowBuffer:
                found.append(buf)
            # KIVI's tier re-lays its newest rows at every append: append() reads its layout again each time
        return found

    def append(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """A step's new rows ``[b, h, t, d]`` (float32) into every buffer of the layer."""
        a, host, t = self.args, self.host, key.shape[2]
        if host["keys"].length != a.n or t > self.room:
            for buf in self._growing():
                buf.reserve(t)
            self.refresh()
        key, value = key.contiguous(), value.contiguous()  # held in names for the call
        if key.shape[-1] != a.d or value.shape[-1] != a.dv:
            raise ValueError(f"sekv's native append holds rows of {a.d} / {a.dv} channels, not {key.shape[-1]} / "
                             f"{value.shape[-1]}")
        for buf, row in self.coded:  # a quantized tier codes its rows itself (memory/quant.cpp)
            buf.append(key if row == "keys" else value)
        for name in self.relaid:  # KIVI's newest rows move with every append
            setattr(a, name, HostArgs(*host_rows(host[name])))
        if self.lib.zk_sekv_append(self.ref, key.data_ptr(), value.data_ptr(), t):
            raise ValueError(f"sekv's native encoder takes heads of up to 512 channels, not {key.shape[-1]}")
        for buf in self.written:
            buf.advance(t)
        if self.valid is not None:  # generated rows are real tokens
            self.valid.append(torch.ones(key.shape[0], 1, t, 1, dtype=torch.bool))
        a.n += t
        self.room -= t

    def step(self, query: torch.Tensor) -> torch.Tensor:
        """The rows of this step for ``query`` ``[b, h·g, q, d]``: ``[b, h, k]`` long in sequence order (``split``:
        the ``m`` candidates); with ``recall`` also decoded into the recall buffers, and the summary row's bias
        in ``self.bias``."""
        a = self.args
        if self.host["keys"].length != a.n or (self.recall and self.dev["recall_keys"].data_ptr() != a.out_keys):
            self.refresh()
        b, h = a.batch, a.heads
        q = query.float().reshape(b, -1, a.d).contiguous()  # [b, h·g·q, d]: KV head i's group is rows i·g·q ...
        a.query, a.query_rows = q.data_ptr(), q.shape[1] // h
        a.m = min(a.n, self.m_max)
        a.k = a.m if self.split else self.k
        idx = torch.empty(b, h, a.k, dtype=torch.long)
        a.idx = idx.data_ptr()
        lib = self.lib
        if self.recall:
            self.bias = torch.empty(b, h, self.k + 1)
            a.bias = self.bias.data_ptr()
            if clock_running():  # bench --profile: the recall timed as its own call
                a.out_keys = None
                rc = lib.zk_sekv_step(self.ref)
                a.out_keys = self.dev["recall_keys"].data_ptr()
                with phase("recall"):
                    rc = rc or lib.zk_sekv_recall_rows(self.ref)
            else:  # one call: each (sequence, KV head) picks its rows and recalls them
                rc = lib.zk_sekv_step(self.ref)
        else:
            rc = lib.zk_sekv_step(self.ref)
        if rc:
            raise ValueError(f"sekv's native router refused k={a.k}, m={a.m}, n={a.n}")
        return idx
