"""sekv's decode-step router and row encoder as one compiled CPU call each (``select.cpp``).

The torch path (``SeKV._pick`` / ``codes.encode``) is the reference and runs everywhere; on CPU tensors this
kernel does the same work per layer in one call, without the ``[g, n·bytes]`` gather, the softmax tensors
and the sort of every row the torch path materialises (``BENCHMARKS.md``, "Decode speed").

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
from zoomkv.native import Kernel, enabled, torch_path

SOURCE = Path(__file__).with_name("select.cpp")

_I64, _F32, _P = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
# rows, capacity, bits (0: float32), scale, minimum, group; per channel (KIVI): 1, the blocks' capacity, the rows
# coded, the exact newest rows and their number
_HOST = [_P, _I64, ctypes.c_int, _P, _P, _I64, ctypes.c_int, _I64, _I64, _P, _I64]
_NO_HOST = [None, 0, 0, None, None, 0, 0, 0, 0, None, 0]
_SELECT_ARGS = [_I64, _I64, _I64, _I64, _I64,  # batch, heads, group, d, n
                _P, _P, _P, _F32,  # query, rotation, gains, scaling
                _P, _I64, ctypes.c_int, _P, _I64,  # codes, codes_cap, bits, rms, rms_cap
                _I64, _P, _P, _P, ctypes.c_int,  # anchors, anchor_pos, anchor_codes, anchor_rms, anchor_bits
                _P, _I64,  # valid, valid_cap
                _I64, _P, _I64, _I64, _I64,  # sinks, sink_pos, recent, m, k
                _P, _I64, _P, _I64, ctypes.c_int,  # fine codes, fine_cap, fine_rms, fine_rms_cap, fine_bits
                *_HOST,  # the host keys, when they rescore (rescore_from="host")
                _P]  # out
_RECALL_ARGS = [_I64, _I64, _I64, _I64, _I64, _P, *_HOST, *_HOST, _P, _I64, _P, _P, _P, _P, _P, _P, _I64, _P]
_CODES_ARGS = [_I64, _I64, _I64, _I64, _P, _P, _P, ctypes.c_int, _P, _P, ctypes.c_int, _P, _P]
_APPEND_ARGS = [_I64, _I64, _I64, _I64, _P, _P, _P, _P,  # batch, heads, rows, d, keys, values, mean, rotation
                ctypes.c_int, _P, _I64, _P, _I64,  # bits, codes and rms with their capacities
                ctypes.c_int, _P, _I64, _P, _I64, _I64,  # the finer codes the same, the index's first new row
                _P, _I64, _P, _I64, _I64,  # float32 host keys and values (or null) and their first new row
                _P, _P, _P]  # the summary row's sums and count (or null)


KERNEL = Kernel(SOURCE, "sekv's compiled CPU router", {
    "zk_sekv_select": (_SELECT_ARGS, ctypes.c_int),
    "zk_sekv_codes": (_CODES_ARGS, ctypes.c_int),
    "zk_sekv_recall": (_RECALL_ARGS, ctypes.c_int),
    "zk_sekv_append": (_APPEND_ARGS, ctypes.c_int),
})
library, usable = KERNEL.library, KERNEL.usable
__all__ = ["KERNEL", "append", "enabled", "encode", "host_rows", "library", "recall", "select", "torch_path", "usable"]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _rows(buf: torch.Tensor, dim: int) -> torch.Tensor:
    """A ``[b, h, capacity, dim]`` buffer as the kernel reads it: contiguous (row buffers already are)."""
    if buf.shape[-1] != dim or not buf.is_contiguous():
        raise ValueError("sekv's native router reads contiguous row buffers")
    return buf


def _bytes(valid: torch.Tensor | None) -> torch.Tensor | None:
    if valid is None:
        return None
    return valid.view(torch.uint8) if valid.dtype == torch.bool and valid.is_contiguous() else valid.to(torch.uint8).contiguous()


def select(query: torch.Tensor, rotation: torch.Tensor, gains: torch.Tensor | None, scaling: float,
           codes: torch.Tensor, rms: torch.Tensor, bits: int, n: int, *,
           anchor_pos: torch.Tensor | None, anchor_codes: torch.Tensor | None, anchor_rms: torch.Tensor | None,
           anchor_bits: int, valid: torch.Tensor | None, sink_pos: torch.Tensor, recent: int, m: int, k: int,
           fine_codes: torch.Tensor | None, fine_rms: torch.Tensor | None, fine_bits: int,
           host_keys: list | None = None) -> torch.Tensor:
    """``[b, h, k]`` long: the rows ``SeKV._pick`` picks, in sequence order. ``query`` ``[b, h·g, d]``;
    ``codes``/``rms``/``fine_*`` the row buffers' whole storage (``[b, h, capacity, ·]``, ``n`` rows filled);
    ``valid`` ``[b, capacity]`` bool or None; ``host_keys`` (``host_rows`` of the host keys): the second stage
    scores the candidates with them (``rescore_from="host"``) instead of the finer codes."""
    lib = library()
    assert lib is not None
    b, hq, d = query.shape
    h = codes.shape[1]
    q = query.float().contiguous()
    rot = rotation.float().contiguous()
    g = gains.float().contiguous() if gains is not None else None
    anchors = 0 if anchor_pos is None else anchor_pos.shape[1]
    apos = anchor_pos.contiguous() if anchors else None
    acodes = anchor_codes.contiguous() if anchors else None
    arms = anchor_rms.contiguous() if anchors else None
    v = _bytes(valid)
    sinks = sink_pos.contiguous()
    out = torch.empty(b, h, k, dtype=torch.long)
    rc = lib.zk_sekv_select(
        b, h, hq // h, d, n, _ptr(q), _ptr(rot), _ptr(g), float(scaling),
        _ptr(_rows(codes, d * bits // 8)), codes.shape[2], bits, _ptr(rms), rms.shape[2],
        anchors, _ptr(apos), _ptr(acodes), _ptr(arms), anchor_bits if anchors else 0,
        _ptr(v), 0 if v is None else v.shape[-1],
        sinks.shape[1], _ptr(sinks), recent, m, k,
        _ptr(None if fine_codes is None else _rows(fine_codes, d * fine_bits // 8)),
        0 if fine_codes is None else fine_codes.shape[2], _ptr(fine_rms),
        0 if fine_rms is None else fine_rms.shape[2], fine_bits if m > k else 0,
        *(host_keys if host_keys is not None and m > k else _NO_HOST), _ptr(out))
    if rc:
        raise ValueError(f"sekv's native router refused k={k}, m={m}, n={n}")
    return out


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


def _room(buf: RowBuffer | None, n: int) -> tuple[int | None, int]:
    """A float32 / code buffer made ready for ``n`` rows in place: its storage pointer and capacity."""
    if buf is None:
        return None, 0
    buf.reserve(n)
    if not buf.data.is_contiguous():  # a view a prefill stored: copied once, then grown contiguous
        buf.data = buf.data.contiguous()
    return buf.data.data_ptr(), buf.capacity


def append(keys: torch.Tensor, values: torch.Tensor, mean: torch.Tensor, rotation: torch.Tensor, bits: int,
           codes: RowBuffer, rms: RowBuffer, fine_bits: int, fine: RowBuffer | None, fine_rms: RowBuffer | None,
           host_keys: RowBuffer | None, host_values: RowBuffer | None,
           sums: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None) -> None:
    """New rows ``keys``/``values`` ``[b, h, t, d]`` (contiguous float32) into sekv's buffers in one call: their
    codes into ``codes``/``rms`` (and ``fine``/``fine_rms`` at ``fine_bits``), the rows into float32 host
    buffers ``host_keys``/``host_values`` (None: the caller appends them), and the summary row's running
    ``sums`` (key sum, value sum, count: contiguous float32, added to in place). What ``SeKV.append`` does."""
    lib = library()
    assert lib is not None
    b, h, t, d = keys.shape
    mean, rotation = mean.float().contiguous(), rotation.float().contiguous()  # held in names for the call
    start, host_start = codes.length, (host_keys or host_values or codes).length
    rows = [_room(buf, t) for buf in (codes, rms, fine, fine_rms, host_keys, host_values)]
    rc = lib.zk_sekv_append(b, h, t, d, _ptr(keys), _ptr(values), _ptr(mean), _ptr(rotation),
                            bits, *rows[0], *rows[1], fine_bits, *rows[2], *rows[3], start,
                            *rows[4], *rows[5], host_start, *(_ptr(s) for s in (sums or (None, None, None))))
    if rc:
        raise ValueError(f"sekv's native encoder takes heads of up to 512 channels, not {d}")
    for buf in (codes, rms, fine, fine_rms, host_keys, host_values):
        if buf is not None:
            buf.length += t


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


def recall(idx: torch.Tensor, keys: list, values: list, dk: int, dv: int, valid: torch.Tensor | None,
           key_sum: torch.Tensor, value_sum: torch.Tensor, count: torch.Tensor, offset: torch.Tensor | None,
           out_keys: torch.Tensor, out_values: torch.Tensor) -> torch.Tensor:
    """Rows ``idx`` ``[b, h, k]`` of the host rows ``keys``/``values`` (``host_rows`` of their buffers) decoded
    into ``out_keys``/``out_values`` rows ``0..k-1`` and the summary row into row ``k`` (what ``with_tail`` adds:
    the rest's mean from the running sums); returns the ``[b, h, k + 1]`` logit bias."""
    lib = library()
    assert lib is not None
    b, h, k = idx.shape
    for t in (out_keys, out_values):
        if t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError("sekv's native recall writes contiguous float32 rows")
    bias = torch.empty(b, h, k + 1)
    v = _bytes(valid)
    sums = [t.float().contiguous() for t in (key_sum, value_sum, count)]
    off = offset.float().contiguous() if offset is not None else None
    idx = idx.contiguous()  # held in a name for the call
    rc = lib.zk_sekv_recall(b, h, k, dk, dv, _ptr(idx), *keys, *values, _ptr(v),
                            0 if v is None else v.shape[-1], *(_ptr(t) for t in sums), _ptr(off), _ptr(out_keys),
                            _ptr(out_values), out_keys.shape[2], _ptr(bias))
    if rc:
        raise ValueError(f"sekv's native recall needs {k + 1} rows in the recall buffer, it has {out_keys.shape[2]}")
    return bias
