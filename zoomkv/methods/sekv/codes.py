"""sekv's key codes: every row's key in a few bits, packed, scored against a query without unpacking.

A key is centred on its layer's mean key (a constant shift of every logit of one query, which the softmax
ignores), rotated by a fixed random orthogonal matrix (so every coordinate carries about the same share of
the key's energy, whatever the key's own structure), scaled to unit RMS, and each coordinate quantized to
``bits`` bits. Per row the device tier keeps the packed codes (``d·bits/8`` bytes) and the RMS (fp16): for
``head_dim`` 64 at one bit, 10 bytes per row where the row's key and value hold 256 (fp16) or 512 (fp32).

The levels are those that minimise the squared error of a standard normal coordinate: one bit, ``±E|z|``
(``±√(2/π)``); more bits, the best uniform step for a Gaussian (Max, 1960), levels at the step's centres.

Scoring never unpacks the codes: for a query ``q`` (rotated the same way) each byte of a code indexes a
table of 256 partial dot products of the query's coordinates under that byte, built once per query and
step (``score_codes``), so a row's score is ``rms · Σ_bytes table[byte]``: as many lookups as bytes.
"""

from __future__ import annotations

import functools
import math

import torch

from zoomkv.kernels import codes as kernel_codes
from zoomkv.kernels import encode as kernel_encode

BITS = (1, 2, 4, 8)
# The squared-error-optimal uniform step for a standard normal coordinate, by bits (Max 1960, Table II).
_GAUSS_STEP = {2: 0.9957, 4: 0.3352, 8: 0.0308}
_ONE_BIT = math.sqrt(2 / math.pi)


def check_bits(bits: int, dim: int) -> None:
    if bits not in BITS:
        raise ValueError(f"code bits must be one of {BITS}, got {bits}")
    if (dim * bits) % 8:
        raise ValueError(f"head_dim {dim} at {bits} bits is not a whole number of bytes")


@functools.lru_cache(maxsize=64)
def _rotation_cpu(dim: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(dim, dim, generator=g, dtype=torch.float64, device="cpu"))  # never meta
    # QR's signs are LAPACK's choice: fix them (diag(r) > 0) so the matrix is a function of the seed alone.
    return (q * torch.sign(torch.diagonal(r))[None, :]).float()


def rotation(dim: int, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """A fixed random orthogonal ``[dim, dim]`` matrix (float32), drawn on the CPU from ``seed``, copied to another
    device once (a training step asks for it at every prefix: a blocking copy each time on a GPU)."""
    device = torch.device(device)
    return _rotation_cpu(dim, seed) if device.type == "cpu" else _rotation_on(dim, seed, str(device))


@functools.lru_cache(maxsize=64)
def _rotation_on(dim: int, seed: int, device: str) -> torch.Tensor:
    return _rotation_cpu(dim, seed).to(device)


def levels(bits: int) -> torch.Tensor:
    """``[2**bits]`` float32: the value of each code."""
    if bits == 1:
        return torch.tensor([-_ONE_BIT, _ONE_BIT])
    half = 2 ** (bits - 1)
    return (torch.arange(2**bits, dtype=torch.float32) - half + 0.5) * _GAUSS_STEP[bits]


def quantize(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Unit-RMS coordinates ``z`` → code indices (long, in ``[0, 2**bits)``)."""
    if bits == 1:
        return (z > 0).long()
    half = 2 ** (bits - 1)
    return torch.floor(z.float() / _GAUSS_STEP[bits]).clamp_(-half, half - 1).long() + half


def pack(idx: torch.Tensor, bits: int) -> torch.Tensor:
    """Code indices ``[..., d]`` → ``[..., d·bits/8]`` uint8, coordinate ``i`` of a byte at bit ``i·bits``."""
    per_byte = 8 // bits
    idx = idx.reshape(*idx.shape[:-1], -1, per_byte)
    shifts = torch.arange(per_byte, device=idx.device) * bits
    return (idx << shifts).sum(-1).to(torch.uint8)


def encode(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Centred, rotated keys ``x`` ``[..., d]`` → ``(codes uint8 [..., d·bits/8], rms fp16 [..., 1])``; on a GPU
    one kernel (``zoomkv.kernels.encode``, held to this)."""
    check_bits(bits, x.shape[-1])
    if kernel_encode.encode_codes_usable(x):
        return kernel_encode.encode_codes(x, bits, _GAUSS_STEP.get(bits, 0.0))
    x = x.float()
    rms = x.pow(2).mean(-1, keepdim=True).sqrt()
    return pack(quantize(x / rms.clamp_min(1e-12), bits), bits), rms.to(torch.float16)


@functools.lru_cache(maxsize=16)
def _byte_levels_cpu(bits: int) -> torch.Tensor:
    per_byte = 8 // bits
    byte = torch.arange(256)[:, None]
    idx = (byte >> (torch.arange(per_byte) * bits)) & (2**bits - 1)  # [256, per_byte]
    return levels(bits)[idx]


@functools.lru_cache(maxsize=64)
def _byte_levels_on(bits: int, device: str) -> torch.Tensor:
    return _byte_levels_cpu(bits).to(device)


def byte_levels(bits: int, device: torch.device | str) -> torch.Tensor:
    """``[256, 8 / bits]``: the level of each coordinate a byte value packs (a constant table, copied to a
    device once per process: a copy per call would make every GPU step wait for the host)."""
    device = torch.device(device)
    return _byte_levels_cpu(bits) if device.type == "cpu" else _byte_levels_on(bits, str(device))


def level_step(bits: int) -> float:
    """The distance between neighbouring levels: level ``c`` is ``(c - 2**(bits-1) + 0.5) * level_step``."""
    return 2 * _ONE_BIT if bits == 1 else _GAUSS_STEP[bits]


def decode(codes: torch.Tensor, rms: torch.Tensor, bits: int) -> torch.Tensor:
    """The rotated, centred keys the codes stand for: ``[..., nbytes]``, ``[..., 1]`` → ``[..., d]`` float32."""
    lv = byte_levels(bits, codes.device)[codes.long()]  # [..., nbytes, per_byte]
    return lv.flatten(-2) * rms.float()


def score_codes(query: torch.Tensor, codes: torch.Tensor, rms: torch.Tensor, bits: int) -> torch.Tensor:
    """``query`` ``[b, h, g, d]`` (rotated) × codes ``[b, h, n, nbytes]`` with ``rms`` ``[b, h, n, 1]`` →
    ``[b, h, g, n]``: ``q · decode(codes)`` by table lookups (no code is unpacked); on a GPU one kernel that
    unpacks each row's bytes in registers (``zoomkv.kernels.codes``, held to this)."""
    if kernel_codes.score_codes_usable(query, codes):
        return kernel_codes.score_codes(query, codes, rms, bits, level_step(bits))
    b, h, g, d = query.shape
    n, nbytes = codes.shape[2], codes.shape[3]
    per_byte = 8 // bits
    table = torch.matmul(query.float().reshape(b, h, g, nbytes, per_byte),
                         byte_levels(bits, query.device).T)  # [b, h, g, nbytes, 256]
    flat = (codes.long() + 256 * torch.arange(nbytes, device=codes.device)).reshape(b, h, 1, n * nbytes)
    parts = table.reshape(b, h, g, nbytes * 256).gather(-1, flat.expand(-1, -1, g, -1))
    return parts.reshape(b, h, g, n, nbytes).sum(-1) * rms.float()[..., 0][:, :, None, :]


# -- mixed widths: a hash (trained: ``hash_width``; fitted to the context: ``fit_bits``) at 4, 2 or 1 bits a coordinate
# A layout ``(n4, n2, n1)``: the first ``n4`` coordinates at 4 bits, the next ``n2`` at 2, the next ``n1`` at 1 (the
# strongest directions first), each group packed whole bytes after the one before; one RMS over all of them.
Layout = tuple[int, int, int]
LAYOUT_WIDTHS = (4, 2, 1)


def layout_groups(layout: Layout) -> list[tuple[int, int, int, int, int]]:
    """``(first, end)`` coordinates, ``bits``, ``(first, end)`` bytes of each non-empty group, widest first."""
    out, col, byte = [], 0, 0
    for count, bits in zip(layout, LAYOUT_WIDTHS, strict=True):
        if count:
            size = count * bits // 8
            out.append((col, col + count, bits, byte, byte + size))
            col, byte = col + count, byte + size
    return out


def layout_bits(layout: Layout) -> int:
    """Bits a row (the RMS aside)."""
    return sum(count * bits for count, bits in zip(layout, LAYOUT_WIDTHS, strict=True))


def encode_layout(x: torch.Tensor, layout: Layout) -> tuple[torch.Tensor, torch.Tensor]:
    """Projected keys ``x`` ``[..., m]`` (``m`` ≥ the layout's coordinates) → ``(codes [..., bits/8], rms)``; every
    coordinate at one bit is ``encode(x, 1)`` exactly (its GPU kernel included)."""
    used = sum(layout)
    if layout[0] == layout[1] == 0:
        return encode(x[..., :used], 1)
    x = x[..., :used].float()
    rms = x.pow(2).mean(-1, keepdim=True).sqrt()
    z = x / rms.clamp_min(1e-12)
    parts = [pack(quantize(z[..., a:b], bits), bits) for a, b, bits, _, _ in layout_groups(layout)]
    return torch.cat(parts, -1), rms.to(torch.float16)


def decode_layout(codes: torch.Tensor, rms: torch.Tensor, layout: Layout) -> torch.Tensor:
    """The projected keys the codes stand for: ``[..., bits/8]``, ``[..., 1]`` → ``[..., n4 + n2 + n1]``."""
    return torch.cat([decode(codes[..., c:e], rms, bits) for _, _, bits, c, e in layout_groups(layout)], -1)


def score_layout(query: torch.Tensor, codes: torch.Tensor, rms: torch.Tensor, layout: Layout) -> torch.Tensor:
    """``score_codes`` for a mixed layout: the query's projections ``[b, h, g, m]`` against each group's bytes."""
    total = None
    for a, b, bits, c, e in layout_groups(layout):
        part = score_codes(query[..., a:b].contiguous(), codes[..., c:e], rms, bits)
        total = part if total is None else total + part
    return total


def code_bytes(dim: int, bits: int) -> int:
    """Device bytes per row: packed codes plus the fp16 RMS."""
    return dim * bits // 8 + 2
