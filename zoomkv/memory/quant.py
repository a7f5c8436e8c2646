"""KV quantization: rows held as 8-, 4- or 2-bit codes with fp16 scales and minimums, decoded only when read.

Two layouts, as the published training-free schemes hold them:

- **per token** (``int8`` / ``int4`` / ``int2``): asymmetric, per group of ``group_size`` channels of each row,
  so rows can be appended one at a time while decoding. ``k4v2`` gives keys and values their own width;
  ``o4`` (``int2o4``) keeps the 4 key channels of largest magnitude of each KV head exact (fp16, chosen at
  prefill), the outliers that otherwise stretch every group they fall in;
- **per channel for keys** (``kivi4`` / ``kivi2``, KIVI's layout, Liu et al. 2024): each key channel
  quantized over blocks of ``group_size`` tokens, because key outliers sit in fixed channels; values per
  token. The newest rows that do not fill a block yet stay exact until they do (KIVI keeps 128; here < 32).

A fitted pattern (``QuantSpec.layers``: one ``(key bits, value bits)`` per model layer, what a trained
adapter's host budget chose) sets the width layer by layer. Codes are packed 8 / bits to a byte, so the bytes
the memory report counts are the bytes really held: codes, scales, minimums, exact channels and rows.

Why not transformers' ``QuantizedLayer`` (quanto/HQQ backends): it quantizes a whole layer's cache and
dequantizes all of it at every step and knows nothing of tiers. Here a recallable method's host tier stays
quantized and only the rows a step needs are decoded.
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from zoomkv.errors import ConfigError
from zoomkv.kernels import dequant as kernel_dequant
from zoomkv.kernels import quantize as kernel_quantize
from zoomkv.kernels.gather import gather_to_slots_reference
from zoomkv.memory.tiers import RowBuffer
from zoomkv.native import Kernel

_I64, _P = ctypes.c_int64, ctypes.c_void_p
# CPU float32 rows coded as quantize() (per token) and quantize_channels() (KIVI's key blocks) code them (the same
# codes, scales and minimums; quant.cpp's header has the one freedom): a buffer's prefill rows and its appends
ROW_QUANTIZER = Kernel(Path(__file__).with_name("quant.cpp"), "the compiled row quantizer", {
    "zk_quant_rows": ([_I64, _I64, _I64, _I64, ctypes.c_int, _P, _P, _I64, _P, _I64, _P, _I64, _I64], ctypes.c_int),
    "zk_quant_channels": ([_I64, _I64, _I64, _I64, ctypes.c_int, _P, _P, _I64, _I64, _P, _I64, _P, _I64, _I64],
                          ctypes.c_int),
}, fast_math=False)

BITS = (8, 4, 2)
LAYOUTS = ("token", "channel")
ROLES = ("keys", "values", "rows")  # "rows": other floating rows of the host tier (coordinates, exact copies)
_NAME = re.compile(r"(?:int(?P<both>[248])|k(?P<k>[248])v(?P<v>[248])|kivi(?P<kivi>[248])(?:v(?P<kv>[248]))?)"
                   r"(?:o(?P<o>[0-9]{1,3}))?(?:g(?P<g>[0-9]{1,4}))?")
FORMATS_HELP = ("int8, int4, int2, kKvV (k4v2: keys 4 bits, values 2), kivi4, kivi2, kivi4v2 (KIVI's keys at 4 bits, "
                "values 2); oN: N exact key channels (int2o4); gN: a scale per N channels of a row, or per N rows "
                "of a channel for KIVI's keys (32 unless named: kivi4g64)")


def is_format(text: str) -> bool:
    """Whether ``text`` names a quantization format (the ``+int8`` ... suffixes of the run grammar)."""
    return _NAME.fullmatch(str(text)) is not None


@dataclass(frozen=True)
class RowQuant:
    """How one row buffer is coded: the bits, the layout, the group (channels a scale covers per token, or
    tokens a channel's scale covers), exact key channels."""

    bits: int
    group_size: int = 32
    layout: str = "token"
    outliers: int = 0

    def bits_per_value(self, width: int) -> float:
        """Bits held per channel of a ``width``-wide row: the code, its share of the fp16 scale and minimum, and
        of the exact channels (per token; KIVI's open block of exact rows not counted)."""
        exact = 16 * self.outliers / width if self.layout == "token" else 0
        return self.bits + 32 / self.group_size + exact


@dataclass(frozen=True)
class QuantSpec:
    bits: int = 8  # the values' bits, and the keys' unless key_bits says otherwise
    group_size: int = 32  # channels per scale (per token), or tokens per scale (per channel)
    tiers: str = "host"  # "host": quantize the host tier; "all": the device tier's stored rows too
    key_bits: int | None = None
    key_layout: str = "token"  # "channel": KIVI's per-channel keys
    outliers: int = 0  # key channels per KV head kept exact
    layers: tuple[tuple[int, int], ...] = ()  # a fitted pattern: (key bits, value bits) per model layer
    fitted: str = ""  # what tables call a fitted pattern ("fit25")

    def __post_init__(self) -> None:
        for b in (self.bits, self.key_bits if self.key_bits is not None else self.bits, *sum(self.layers, ())):
            if b not in BITS:
                raise ConfigError(f"KV quantization supports {', '.join(map(str, BITS))} bits, got {b}")
        if self.group_size < 2 or self.group_size % 2:
            raise ConfigError(f"quantization group size must be an even number >= 2, got {self.group_size}")
        if self.tiers not in ("host", "all"):
            raise ConfigError(f"quantized tiers must be 'host' or 'all', got {self.tiers!r}")
        if self.key_layout not in LAYOUTS:
            raise ConfigError(f"key layout must be one of {LAYOUTS}, got {self.key_layout!r}")
        if not 0 <= self.outliers <= 256:
            raise ConfigError(f"exact key channels must be between 0 and 256, got {self.outliers}")

    @classmethod
    def parse(cls, text: str | None, tiers: str = "host", group_size: int = 32) -> QuantSpec | None:
        """``"int8"`` / ``"k4v2"`` / ``"kivi2"`` / ``"int2o4"`` / ``None`` (see ``FORMATS_HELP``)."""
        if text is None or text in ("", "none", "fp", "off"):
            return None
        text = {"8": "int8", "4": "int4"}.get(str(text), str(text))
        m = _NAME.fullmatch(text)
        if m is None:
            raise ConfigError(f"unknown KV quantization {text!r}; valid: {FORMATS_HELP}, none")
        bits = int(m["both"] or m["v"] or m["kv"] or m["kivi"])
        key_bits = int(m["k"] or m["kivi"]) if (m["k"] or m["kv"]) else None
        if m["kivi"] and m["o"]:
            raise ConfigError(f"{text!r}: KIVI's per-channel keys already give each channel its own scale; exact "
                              "channels (oN) go with the per-token formats (int2o4)")
        group_size = int(m["g"]) if m["g"] else group_size
        return cls(bits=bits, group_size=group_size, tiers=tiers, key_bits=key_bits,
                   key_layout="channel" if m["kivi"] else "token", outliers=int(m["o"] or 0))

    @property
    def name(self) -> str:
        """The format as the run grammar writes it (``int8``, ``k4v2``, ``kivi2``, ``int2o4``, ``kivi4g64``; a
        pattern's ``fitted`` name)."""
        if self.layers:
            return self.fitted or "fitted"
        kb = self.bits if self.key_bits is None else self.key_bits
        if self.key_layout == "channel":
            base = f"kivi{self.bits}" if kb == self.bits else f"kivi{kb}v{self.bits}"
        else:
            base = f"int{self.bits}" if kb == self.bits else f"k{kb}v{self.bits}"
        return (base + (f"o{self.outliers}" if self.outliers else "")
                + (f"g{self.group_size}" if self.group_size != 32 else ""))

    def for_rows(self, role: str = "rows", layer: int | None = None) -> RowQuant:
        """The coding of one buffer: ``role`` keys, values or other rows, of model layer ``layer``."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        kb = self.bits if self.key_bits is None else self.key_bits
        vb = self.bits
        if self.layers and layer is not None and layer < len(self.layers):
            kb, vb = self.layers[layer]
        if role == "keys":
            return RowQuant(kb, self.group_size, self.key_layout, self.outliers)
        return RowQuant(vb, self.group_size)



def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes ``[..., d]`` (each < 2**bits) → ``[..., d·bits/8]``: code ``i`` of a byte in bits ``i·bits``
    upward (int4: the even channel in the low nibble)."""
    per = 8 // bits
    if per == 1:
        return codes
    out = codes[..., 0::per].clone()
    for j in range(1, per):
        out |= codes[..., j::per] << (bits * j)
    return out


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    per = 8 // bits
    if per == 1:
        return packed
    out = torch.empty(*packed.shape[:-1], packed.shape[-1] * per, dtype=torch.uint8, device=packed.device)
    mask = (1 << bits) - 1
    for j in range(per):
        out[..., j::per] = (packed >> (bits * j)) & mask
    return out


def _codes(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes of ``x`` between fp16-rounded ``lo`` and ``hi`` (broadcast), and the fp16 scale."""
    levels = (1 << bits) - 1
    # Scale and minimum are stored in fp16: quantize against the rounded values so the bound holds.
    scale = ((hi - lo.float()) / levels).clamp_min(1e-8).half()
    codes = ((x - lo.float()) / scale.float()).round_().clamp_(0, levels).to(torch.uint8)
    return codes, scale


def quantize(x: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` ``[..., d]`` → (codes uint8 ``[..., d·bits/8]``, scale fp16 ``[..., d/g]``, minimum fp16 ``[..., d/g]``),
    per token, ``group_size`` channels a scale."""
    d = x.shape[-1]
    group_size = min(group_size, d)  # small heads: one group per row
    if d % group_size or d % (8 // bits):
        raise ConfigError(f"quantization group size {group_size} (or {bits}-bit packing) does not divide {d}")
    if kernel_quantize.quantize_rows_usable(x, bits, group_size):  # on a GPU: one kernel, not ~16 ops
        return kernel_quantize.quantize_rows(x, bits, group_size)
    groups = x.float().reshape(*x.shape[:-1], d // group_size, group_size)
    lo = groups.amin(dim=-1, keepdim=True).half()
    codes, scale = _codes(groups, lo, groups.amax(dim=-1, keepdim=True), bits)
    return pack(codes.reshape(*x.shape[:-1], d), bits), scale.squeeze(-1), lo.squeeze(-1)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor, bits: int, dtype: torch.dtype) -> torch.Tensor:
    codes = unpack(codes, bits)
    n_groups = scale.shape[-1]
    groups = codes.reshape(*codes.shape[:-1], n_groups, codes.shape[-1] // n_groups).float()  # 0 rows too
    out = groups * scale.float()[..., None] + lo.float()[..., None]
    return out.reshape(*codes.shape).to(dtype)


def quantize_channels(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A block of rows ``x`` ``[b, h, G, d]`` → (codes ``[b, h, G, d·bits/8]``, scale and minimum fp16
    ``[b, h, 1, d]``): each channel over the block's ``G`` tokens (KIVI's key layout)."""
    xf = x.float()
    lo = xf.amin(dim=2, keepdim=True).half()
    codes, scale = _codes(xf, lo, xf.amax(dim=2, keepdim=True), bits)
    return pack(codes, bits), scale, lo


def _code_native(rows: torch.Tensor, codes: RowBuffer, scale: RowBuffer, lo: RowBuffer, scale_rows: int,
                 call: Callable[[ctypes.CDLL, torch.Tensor, int], int]) -> bool:
    """CPU float32 ``rows`` coded by the compiled quantizer straight into the buffers, after their rows:
    ``call(library, rows, heads)`` runs the kernel, which writes the rows' codes and ``scale_rows`` rows of scales
    and minimums. False, nothing counted, where it does not apply or the kernel declines; torch then codes them."""
    if rows.dtype != torch.float32 or not ROW_QUANTIZER.usable(rows, codes.data):
        return False
    n = rows.shape[2]
    codes.reserve(n)
    scale.reserve(scale_rows)
    lo.reserve(scale_rows)
    if not (codes.data.is_contiguous() and scale.data.is_contiguous() and lo.data.is_contiguous()):
        return False  # the kernel writes [b·h, capacity, ·] storage
    x = rows.contiguous()  # held in a name for the call
    if call(ROW_QUANTIZER.library(), x, x.shape[0] * x.shape[1]):
        return False
    codes.advance(n)
    scale.advance(scale_rows)
    lo.advance(scale_rows)
    return True


def row_buffer(data: torch.Tensor, spec: QuantSpec | RowQuant, *, pinned: bool = False,
               open_device: torch.device | None = None, room: int = 0) -> RowBuffer:
    """A quantized buffer for rows ``data`` ``[b, h, n, d]``: per channel (``ChannelQuantizedRowBuffer``, its
    open block on ``open_device``) or per token (``QuantizedRowBuffer``; ``room``: rows allocated past them), as
    ``spec`` says."""
    q = spec.for_rows() if isinstance(spec, QuantSpec) else spec
    if q.layout == "channel":
        return ChannelQuantizedRowBuffer(data, q, pinned=pinned, open_device=open_device)
    return QuantizedRowBuffer(data, q, pinned=pinned, room=room)


class QuantizedRowBuffer(RowBuffer):
    """A ``RowBuffer`` whose rows are held as codes per token; ``view()`` returns dequantized rows.

    Rows of any width: KV rows (``head_dim``) are grouped ``group_size`` channels at a time; a width the
    group does not divide (a rank-gated host tier's coordinates, say 19 of 64 directions) is one group a row,
    and a width the packing does not divide is padded (the pad repeats the row's last value), cut off again by
    ``view()``. With ``outliers``, that many channels of each KV head (the largest in magnitude of the first
    rows) are held exact in fp16 beside the codes. ``room``: rows allocated past ``data``'s in every part."""

    def __init__(self, data: torch.Tensor, spec: QuantSpec | RowQuant, *, pinned: bool = False, room: int = 0):
        self.spec = spec.for_rows() if isinstance(spec, QuantSpec) else spec
        self.bits = self.spec.bits
        self.dtype = data.dtype
        self.width = data.shape[-1]
        self.pad = -self.width % (8 // self.bits)
        width = self.width + self.pad
        self.group = self.spec.group_size if width % min(self.spec.group_size, width) == 0 else width
        self.outlier_idx: torch.Tensor | None = None
        self.exact: RowBuffer | None = None
        if self.spec.outliers and data.shape[2]:
            o = min(self.spec.outliers, self.width)
            self.outlier_idx = data.abs().amax(2, keepdim=True).topk(o, -1).indices.sort(-1).values  # [b, h, 1, o]
            self.exact = RowBuffer(self._outlier_values(data), pinned=pinned)
        if self.exact is not None or self.pad or not self._init_native(data, pinned):
            codes, scale, lo = quantize(self._prepared(data), self.bits, self.group)
            # coded where the rows are (a GPU's prefill: there, in parallel), held where the buffer lives: a
            # pinned buffer's codes go to the host by asynchronous copies (the prefill goes on; a host read waits)
            self.codes, self.scale, self.lo = (RowBuffer.with_room(part, room, pinned=pinned)
                                               for part in (codes, scale, lo))
        self.pinned = self.codes.pinned
        self.length = data.shape[2]

    def _init_native(self, data: torch.Tensor, pinned: bool) -> bool:
        """The prefill's rows coded by the compiled quantizer into buffers of exactly their size (what the torch
        path would hold): one vectorised pass where torch makes a dozen, each a full-size temporary."""
        b, h, n, d = data.shape
        if data.dtype != torch.float32 or not ROW_QUANTIZER.usable(data):
            return False
        made = {"device": data.device, "pinned": pinned}
        self.codes = RowBuffer.empty_like(b, h, n, d * self.bits // 8, dtype=torch.uint8, **made)
        self.scale, self.lo = (RowBuffer.empty_like(b, h, n, d // min(self.group, d), dtype=torch.float16, **made)
                               for _ in range(2))
        return self._append_native(data)

    def _outlier_values(self, rows: torch.Tensor) -> torch.Tensor:
        at = self.outlier_idx.expand(-1, -1, rows.shape[2], -1)
        return rows.gather(-1, at).half()

    def _prepared(self, rows: torch.Tensor) -> torch.Tensor:
        """What is coded: the exact channels replaced by their group's least other value (so they no longer
        stretch its range), and the pad columns."""
        if self.outlier_idx is not None:
            mask = torch.zeros(*rows.shape[:2], 1, self.width, dtype=torch.bool, device=rows.device)
            mask.scatter_(-1, self.outlier_idx, True)
            group = self.group if self.width % self.group == 0 else self.width
            shape = (*rows.shape[:-1], self.width // group, group)
            others = rows.float().reshape(shape).masked_fill(mask.reshape(*mask.shape[:-1], -1, group), float("inf"))
            fill = others.amin(-1, keepdim=True)
            fill = torch.where(fill.isinf(), torch.zeros_like(fill), fill).expand(shape).reshape(rows.shape)
            rows = torch.where(mask, fill.to(rows.dtype), rows)
        if self.pad:
            rows = torch.cat([rows, rows[..., -1:].expand(*rows.shape[:-1], self.pad)], -1)
        return rows

    @property
    def data(self) -> torch.Tensor:  # the codes: what a RowBuffer's "data" means for shape/capacity
        return self.codes.data

    @property
    def capacity(self) -> int:
        return self.codes.capacity

    @property
    def nbytes(self) -> int:
        extra = 0 if self.exact is None else self.exact.nbytes + self.outlier_idx.nbytes
        return self.codes.nbytes + self.scale.nbytes + self.lo.nbytes + extra

    def tensors(self) -> list[torch.Tensor]:
        extra = [] if self.exact is None else [self.exact.data, self.outlier_idx]
        return [self.codes.data, self.scale.data, self.lo.data, *extra]

    def reserve(self, n: int) -> None:
        """Room for ``n`` more rows in every part (codes, scales, minimums, exact channels)."""
        for part in (self.codes, self.scale, self.lo, self.exact):
            if part is not None:
                part.reserve(n)

    def append(self, rows: torch.Tensor) -> None:
        if self.exact is None and not self.pad and self._append_native(rows):
            self.length += rows.shape[2]
            return
        if self.exact is not None:
            self.exact.append(self._outlier_values(rows).to(self.exact.data.device))
        codes, scale, lo = quantize(self._prepared(rows), self.bits, self.group)
        self.codes.append(codes)  # coded where the rows are; into pinned host memory without waiting on a GPU
        self.scale.append(scale)
        self.lo.append(lo)
        self.length += rows.shape[2]

    @property
    def writes_at(self) -> bool:
        return self.exact is None and not self.pad

    def write_at(self, rows: torch.Tensor, at: torch.Tensor) -> None:
        """``RowBuffer.write_at`` for coded rows: coded where they are (one kernel on a GPU), each part written at
        ``at`` (per token: codes, scales and minimums have a row each)."""
        codes, scale, lo = quantize(self._prepared(rows), self.bits, self.group)
        for part, coded in ((self.codes, codes), (self.scale, scale), (self.lo, lo)):
            part.write_at(coded, at)

    def note_written(self, n: int, *, from_gpu: bool) -> None:
        for part in (self.codes, self.scale, self.lo):
            part.note_written(n, from_gpu=from_gpu)
        self.length += n

    def _append_native(self, rows: torch.Tensor) -> bool:
        """``quantize``'s codes of CPU float32 rows in one compiled pass, written straight into the buffers (a
        decode step appends one row a layer, where the torch path's dozen ops cost more than the coding).
        False, nothing appended, where it does not apply; the torch path then codes the rows."""
        codes, scale, lo, d = self.codes, self.scale, self.lo, rows.shape[3]
        return _code_native(rows, codes, scale, lo, rows.shape[2], lambda lib, x, heads: lib.zk_quant_rows(
            heads, x.shape[2], d, min(self.group, d), self.bits, x.data_ptr(), codes.data.data_ptr(), codes.capacity,
            scale.data.data_ptr(), scale.capacity, lo.data.data_ptr(), lo.capacity, codes.length))

    def view(self) -> torch.Tensor:
        return self._decoded(self.codes.view(), self.scale.view(), self.lo.view(),
                             None if self.exact is None else self.exact.view())

    def rows_on(self, device: torch.device) -> torch.Tensor:
        """Every row decoded on ``device`` (the codes travel, not the rows)."""
        return self._decoded(self.codes.rows_on(device), self.scale.rows_on(device), self.lo.rows_on(device),
                             None if self.exact is None else self.exact.rows_on(device))

    def gather_to_slots(self, idx: torch.Tensor, dest: torch.Tensor, fetch: torch.Tensor, out: torch.Tensor) -> None:
        """Rows ``idx`` decoded into slots ``dest`` of ``out`` where ``fetch``: on a GPU one kernel reads only the
        fetched rows' codes from pinned memory and decodes them into their slots."""
        if not self._decode_in_kernel(idx, out, dest, fetch):
            gather_to_slots_reference(self._gather(idx, fetch), out, dest, fetch)

    def gather(self, idx: torch.Tensor | None, out: torch.Tensor | None = None) -> torch.Tensor:
        if idx is None and out is not None and out.is_cuda:
            # every row (a context within the budget): the codes travel and are decoded on the GPU, where view()
            # would wait for the copies in flight and decode them all on the host
            return out.copy_(self.rows_on(out.device))
        if idx is not None and out is not None and self._decode_in_kernel(idx, out):
            return out
        found = self._gather(idx)
        return found if out is None else out.copy_(found, non_blocking=True)

    def _decode_in_kernel(self, idx: torch.Tensor, out: torch.Tensor, dest: torch.Tensor | None = None,
                          fetch: torch.Tensor | None = None) -> bool:
        """Rows ``idx`` read and decoded by one kernel (``zoomkv.kernels.dequant``) where one runs (codes in pinned
        memory or on the GPU, indices on the GPU) and the rows are the codes alone (no exact channels, no pad);
        False, nothing written, elsewhere."""
        codes, scale, lo = (part.data[:, :, : self.length] for part in (self.codes, self.scale, self.lo))
        if self.exact is not None or self.pad or scale.stride() != lo.stride() or out.dtype != self.dtype \
                or out.stride(-1) != 1 or not kernel_dequant.gather_dequantized_usable(codes, idx, out):
            return False
        # (pinned rows still in flight from the GPU are ordered before the kernel by the stream: nothing to wait for)
        kernel_dequant.gather_dequantized(codes, scale, lo, idx, self.bits, out, dest=dest, fetch=fetch)
        return True

    def _gather(self, idx: torch.Tensor | None, fetch: torch.Tensor | None = None) -> torch.Tensor:
        """Only the rows asked for are dequantized: a step's recall costs O(k), not O(rows held); ``fetch``: only
        those rows are read (the others' entries are undefined)."""
        if idx is None:
            return self.view()
        return self._decoded(self.codes.gather(idx, fetch=fetch), self.scale.gather(idx, fetch=fetch),
                             self.lo.gather(idx, fetch=fetch),
                             None if self.exact is None else self.exact.gather(idx, fetch=fetch))

    def _decoded(self, codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor,
                 exact: torch.Tensor | None) -> torch.Tensor:
        rows = dequantize(codes, scale, lo, self.bits, self.dtype)
        rows = rows[..., : self.width] if self.pad else rows
        if exact is not None:
            at = self.outlier_idx.to(rows.device).expand(-1, -1, rows.shape[2], -1)
            rows = rows.scatter(-1, at, exact.to(rows.dtype))
        return rows


class ChannelQuantizedRowBuffer(RowBuffer):
    """Rows quantized per channel over blocks of ``group_size`` tokens (KIVI's key layout): codes per row,
    one fp16 scale and minimum per block and channel. The newest rows that do not fill a block are held exact
    (``residual``) until they do; then the block is coded and they go. Only the rows gathered are decoded.

    ``open_device``: where the open block lives (default: with the codes). A host tier on a GPU machine keeps it
    on the GPU, as KIVI keeps its residual there: a step appends its row on the GPU, a filled block is coded there
    and its codes go to pinned host memory by an asynchronous copy, and a recall reads codes, scales and minimums
    by the pinned-memory kernel, so no step waits on the host. Its bytes (under one block) count with the codes."""

    def __init__(self, data: torch.Tensor, spec: RowQuant, *, pinned: bool = False,
                 open_device: torch.device | None = None):
        self.spec = spec
        self.bits = spec.bits
        self.block = spec.group_size
        self.dtype = data.dtype
        self.width = data.shape[-1]
        if self.width % (8 // self.bits):
            raise ConfigError(f"{self.bits}-bit packing does not divide rows {self.width} wide")
        b, h, n, d = data.shape
        full = n - n % self.block
        # buffers of exactly the prefill's blocks (what it holds), filled as the decode's blocks are appended
        made = {"device": data.device, "pinned": pinned}
        self.codes = RowBuffer.empty_like(b, h, full, d * self.bits // 8, dtype=torch.uint8, **made)
        self.scale, self.lo = (RowBuffer.empty_like(b, h, full // self.block, d, dtype=torch.float16, **made)
                               for _ in range(2))  # [b, h, blocks, d]
        self.scale.GROW_ROWS = self.lo.GROW_ROWS = max(1, RowBuffer.GROW_ROWS // self.block)  # blocks, not rows
        self.pinned = self.codes.pinned
        self._append_blocks(data[:, :, :full])
        # < block rows: a plain tensor, no room to grow into
        self.residual = data[:, :, full:].to(open_device or data.device).contiguous()

    @property
    def writes_at(self) -> bool:  # a row may close a block and code it: not a write at one position
        return False

    def _append_blocks(self, rows: torch.Tensor) -> None:
        """Whole blocks of rows coded after the buffers' rows: by the compiled quantizer on CPU float32 rows,
        else by torch."""
        if not rows.shape[2] or self._append_blocks_native(rows):
            return
        codes, scale, lo = self._blocks(rows)
        self.codes.append(codes)
        self.scale.append(scale)
        self.lo.append(lo)

    def _append_blocks_native(self, rows: torch.Tensor) -> bool:
        codes, scale, lo, blocks = self.codes, self.scale, self.lo, rows.shape[2] // self.block
        return _code_native(rows, codes, scale, lo, blocks, lambda lib, x, heads: lib.zk_quant_channels(
            heads, blocks, self.block, self.width, self.bits, x.data_ptr(), codes.data.data_ptr(), codes.capacity,
            codes.length, scale.data.data_ptr(), scale.capacity, lo.data.data_ptr(), lo.capacity, scale.length))

    def _blocks(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, h, n, d = rows.shape
        blocks = n // self.block
        codes, scale, lo = quantize_channels(rows.reshape(b, h * blocks, self.block, d), self.bits)
        return (codes.reshape(b, h, n, -1), scale.reshape(b, h, blocks, d), lo.reshape(b, h, blocks, d))

    @property
    def length(self) -> int:  # type: ignore[override]
        return self.codes.length + self.residual.shape[2]

    @length.setter
    def length(self, value: int) -> None:  # RowBuffer's constructor sets it; the parts count it here
        pass

    @property
    def data(self) -> torch.Tensor:
        return self.codes.data

    @property
    def capacity(self) -> int:
        return self.codes.capacity + self.residual.shape[2]

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scale.nbytes + self.lo.nbytes + self.residual.nbytes

    def tensors(self) -> list[torch.Tensor]:
        return [self.codes.data, self.scale.data, self.lo.data, self.residual]

    def reserve(self, n: int) -> None:
        """Room for ``n`` more rows (and their blocks) in the coded parts."""
        self.codes.reserve(n)
        for part in (self.scale, self.lo):
            part.reserve(-(-n // self.block))

    def append(self, rows: torch.Tensor) -> None:
        # on the open block's device (the GPU's own rows there): a filled block is coded on it and leaves for the
        # codes' buffers, asynchronously where they are pinned
        pending = torch.cat([self.residual, rows.to(self.residual.device, self.residual.dtype)], 2)
        full = pending.shape[2] - pending.shape[2] % self.block
        self._append_blocks(pending[:, :, :full])
        self.residual = pending[:, :, full:].contiguous()

    def rows_on(self, device: torch.device) -> torch.Tensor:
        """Every row decoded on ``device``: pinned codes travel to the GPU without a host wait (the scales read
        there by the pinned-memory kernel), the open block's exact rows with them."""
        if not (self.codes.pinned and torch.device(device).type == "cuda"):
            return self.view().to(device)
        n = self.codes.length
        return torch.cat([self._decoded(self.codes.rows_on(device), torch.arange(n, device=device)),
                          self.residual.to(device, self.dtype)], 2)

    def view(self) -> torch.Tensor:
        n = self.codes.length
        return torch.cat([self._decoded(self.codes.view(), torch.arange(n, device=self.codes.data.device)),
                          self.residual.to(self.codes.data.device, self.dtype)], 2)

    def _decoded(self, codes: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Codes ``[b, h, k, ·]`` of rows ``rows`` (``[k]`` or ``[b, h, k]``) decoded with their blocks' scales."""
        block = (rows // self.block).expand(*codes.shape[:3]) if rows.dim() == 1 else rows // self.block
        # RowBuffer.gather: by the pinned-memory kernel where the blocks are pinned and the rows on a GPU
        scale, lo = self.scale.gather(block).float(), self.lo.gather(block).float()
        return (unpack(codes, self.bits).float() * scale + lo).to(self.dtype)

    def gather_to_slots(self, idx: torch.Tensor, dest: torch.Tensor, fetch: torch.Tensor, out: torch.Tensor) -> None:
        """Rows ``idx`` decoded into slots ``dest`` of ``out``, every one of them: a row held exact in the open
        block changes when the block is coded, so a slot holding it from an earlier step is written again."""
        gather_to_slots_reference(self._gather(idx), out, dest, None)

    def gather(self, idx: torch.Tensor | None, out: torch.Tensor | None = None) -> torch.Tensor:
        if idx is None and out is not None and out.is_cuda:  # every row (a context within the budget): no host wait
            return out.copy_(self.rows_on(out.device))
        found = self._gather(idx)
        return found if out is None else out.copy_(found, non_blocking=True)

    def _gather(self, idx: torch.Tensor | None) -> torch.Tensor:
        if idx is None:
            return self.view()
        # where the indices are: on a GPU the coded rows come from pinned memory by the kernel (RowBuffer.gather)
        idx = idx.expand(self.codes.data.shape[0], self.codes.data.shape[1], -1)
        n, r = self.codes.length, self.residual.shape[2]
        parts = []
        if n:
            coded = idx.clamp(max=n - 1)
            parts.append(self._decoded(self.codes.gather(coded), coded).to(idx.device))
        if r:
            at = (idx.to(self.residual.device) - n).clamp(0, r - 1)[..., None].expand(-1, -1, -1, self.width)
            parts.append(self.residual.gather(2, at).to(self.dtype).to(idx.device))
        if len(parts) == 1:
            return parts[0]
        return torch.where((idx < n)[..., None], parts[0], parts[1])
