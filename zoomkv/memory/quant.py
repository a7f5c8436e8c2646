"""KV quantization: rows stored as int8 or int4 codes with a per-group fp16 scale and minimum.

Asymmetric, per group of ``group_size`` channels of each row (KIVI-style per-token grouping, which is
what lets rows be appended one at a time while decoding). int4 codes are packed two to a byte, so the
bytes counted in the memory report are the bytes really held: codes + scales + minimums.

Why not transformers' ``QuantizedLayer`` (quanto/HQQ backends): it quantizes a whole layer's cache and
dequantizes all of it at every step, supports only 2/4 bits with quanto, and knows nothing of tiers.
Here a recallable method's host tier stays quantized and only the rows a step needs are dequantized.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zoomkv.errors import ConfigError
from zoomkv.memory.tiers import RowBuffer


@dataclass(frozen=True)
class QuantSpec:
    bits: int = 8  # 8 or 4
    group_size: int = 32  # channels per scale; must divide head_dim
    tiers: str = "host"  # "host": quantize the host tier; "all": the device tier's stored rows too

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ConfigError(f"KV quantization supports 8 or 4 bits, got {self.bits}")
        if self.group_size < 2 or self.group_size % 2:
            raise ConfigError(f"quantization group size must be an even number >= 2, got {self.group_size}")
        if self.tiers not in ("host", "all"):
            raise ConfigError(f"quantized tiers must be 'host' or 'all', got {self.tiers!r}")

    @classmethod
    def parse(cls, text: str | None, tiers: str = "host", group_size: int = 32) -> QuantSpec | None:
        """``"int8"`` / ``"int4"`` / ``None``."""
        if text is None or text in ("", "none", "fp", "off"):
            return None
        table = {"int8": 8, "8": 8, "int4": 4, "4": 4}
        if str(text) not in table:
            raise ConfigError(f"unknown KV quantization {text!r}; valid: int8, int4, none")
        return cls(bits=table[str(text)], group_size=group_size, tiers=tiers)


def quantize(x: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` ``[..., d]`` → (codes uint8 ``[..., d or d/2]``, scale fp16 ``[..., d/g]``, minimum fp16 ``[..., d/g]``)."""
    d = x.shape[-1]
    group_size = min(group_size, d)  # small heads: one group per row
    if d % group_size:
        raise ConfigError(f"quantization group size {group_size} does not divide head_dim {d}")
    groups = x.float().reshape(*x.shape[:-1], d // group_size, group_size)
    lo = groups.amin(dim=-1, keepdim=True).half()
    hi = groups.amax(dim=-1, keepdim=True)
    levels = (1 << bits) - 1
    # Scale and minimum are stored in fp16: quantize against the rounded values so the bound holds.
    scale = ((hi - lo.float()) / levels).clamp_min(1e-8).half()
    codes = ((groups - lo.float()) / scale.float()).round_().clamp_(0, levels).to(torch.uint8)
    codes = codes.reshape(*x.shape[:-1], d)
    if bits == 4:
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return codes, scale.squeeze(-1), lo.squeeze(-1)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor, bits: int, dtype: torch.dtype) -> torch.Tensor:
    if bits == 4:
        unpacked = torch.empty(*codes.shape[:-1], codes.shape[-1] * 2, dtype=torch.uint8, device=codes.device)
        unpacked[..., 0::2] = codes & 0x0F
        unpacked[..., 1::2] = codes >> 4
        codes = unpacked
    n_groups = scale.shape[-1]
    groups = codes.reshape(*codes.shape[:-1], n_groups, codes.shape[-1] // n_groups).float()  # 0 rows too
    out = groups * scale.float()[..., None] + lo.float()[..., None]
    return out.reshape(*codes.shape).to(dtype)


class QuantizedRowBuffer(RowBuffer):
    """A ``RowBuffer`` whose rows are held as int8/int4 codes; ``view()`` returns dequantized rows.

    Rows of any width: KV rows (``head_dim``) are grouped ``spec.group_size`` channels at a time; a width the
    group does not divide (a rank-gated host tier's coordinates, say 19 of 64 directions) is one group a row,
    and int4 pads an odd width with one more column (two codes share a byte), cut off again by ``view()``."""

    def __init__(self, data: torch.Tensor, spec: QuantSpec, *, pinned: bool = False):
        self.spec = spec
        self.dtype = data.dtype
        self.width = data.shape[-1]
        self.pad = spec.bits == 4 and self.width % 2 == 1
        width = self.width + self.pad
        self.group = spec.group_size if width % min(spec.group_size, width) == 0 else width
        codes, scale, lo = quantize(self._padded(data), spec.bits, self.group)
        self.codes = RowBuffer(codes, pinned=pinned)
        self.scale = RowBuffer(scale, pinned=pinned)
        self.lo = RowBuffer(lo, pinned=pinned)
        self.pinned = self.codes.pinned
        self.length = data.shape[2]

    def _padded(self, rows: torch.Tensor) -> torch.Tensor:
        # the pad column repeats the row's last value, so it never widens the group's range
        return torch.cat([rows, rows[..., -1:]], -1) if self.pad else rows

    @property
    def data(self) -> torch.Tensor:  # the codes: what a RowBuffer's "data" means for shape/capacity
        return self.codes.data

    @property
    def capacity(self) -> int:
        return self.codes.capacity

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scale.nbytes + self.lo.nbytes

    def tensors(self) -> list[torch.Tensor]:
        return [self.codes.data, self.scale.data, self.lo.data]

    def append(self, rows: torch.Tensor) -> None:
        codes, scale, lo = quantize(self._padded(rows), self.spec.bits, self.group)
        self.codes.append(codes.to(self.codes.data.device))
        self.scale.append(scale.to(self.scale.data.device))
        self.lo.append(lo.to(self.lo.data.device))
        self.length += rows.shape[2]

    def view(self) -> torch.Tensor:
        return self._decoded(self.codes.view(), self.scale.view(), self.lo.view())

    def gather(self, idx: torch.Tensor | None) -> torch.Tensor:
        """Only the rows asked for are dequantized: a step's recall costs O(k), not O(rows held)."""
        if idx is None:
            return self.view()
        return self._decoded(self.codes.gather(idx), self.scale.gather(idx), self.lo.gather(idx))

    def _decoded(self, codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
        rows = dequantize(codes, scale, lo, self.spec.bits, self.dtype)
        return rows[..., : self.width] if self.pad else rows
