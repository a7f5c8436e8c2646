"""sekv's trainable modules: a few thousand parameters on top of a frozen model.

Per compressed (full-attention) layer ``l`` and KV head ``h``:

- ``code_gain[l, h, d]``: the semantic projector's per-coordinate log gain on the query side of the code
  score, ``score(q, k) = Σ_j exp(gain_j) (Rq)_j c_j(k)`` with ``c(k)`` the few-bit code of the rotated key;
  init 0 (every gain 1: the plain dot product with the decoded key). Training moves weight towards the
  coordinates whose codes rank rows as the full query would;
- ``span_tau[l]``: the entropy threshold in standard deviations: tokens whose surprisal exceeds
  ``mean + τ·std`` of their sequence are anchors, whose keys get a finer code; init 2.0;
- ``layer_logit[l]``: the layer's share of the rows, ``L·B·softmax(layer_logit)`` (the total stays
  ``L·B``, as PyramidKV's); init 0 (every layer B);
- ``summary_bias[l, h]``: added to the summary row's ``log(count)`` logit bias, so the one row standing for
  everything not recalled weighs what the teacher's rest weighs; init 0 (the plain softmax tail);
- ``rank_gate[l, 0 | 1, j]``: the rank budget of the host tier — whether the layer keeps its keys' (0) or
  values' (1) j-th principal direction (logit > 0; ``host.py``); init +3 (every direction: exact rows).

With ``hash_bits`` ``b`` > 0 the index is a trained hash instead of the rotated key's signs (the semantic
projector as learned hash codes, after HashAttention): per compressed layer and KV head

- ``hash_key[l, h, d, b]``: a centred key's code is the sign of its ``b`` projections (``b/8`` bytes and the
  projections' fp16 RMS a row, where the rotated key's signs take ``d/8`` and the RMS);
- ``hash_query[l, h, d, b]``: the query's weights on those bits, ``score(q, k) = (q·Q) · decode(sign(k·K))``;

both init to the layer's first ``b`` rotated coordinates (a random-hyperplane hash: at ``b = d``, exactly the
untrained codes). Anchors and the second stage keep the rotated key's finer codes and the gains.

With ``hash_width`` 2 or 4 the ``b`` bits a row are spread over fewer projections, the strongest at up to that many
bits each: per layer a ``hash_layout`` ``(n4, n2, n1)`` (``4·n4 + 2·n2 + n1 = b``; ``codes.encode_layout``), fitted
with the projections to the teacher cache (``hashing.py``) and recorded in the adapter. The projections are then
``[l, h, d, min(d, b)]``, a layer's columns past ``n4 + n2 + n1`` unused.

Layers are indexed by their position among the model's full-attention layers (``ModelShape.full_attention_layers``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from zoomkv.errors import ConfigError
from zoomkv.methods.sekv.codes import Layout, layout_bits, rotation
from zoomkv.protocol.shape import ModelShape

DEFAULT_MAX_FRACTION = 0.0005
INIT_TAU = 2.0
MAX_SEED = 2**31 - 1  # torch's generators take any 64-bit seed; a layer's seed is 7919·seed + layer
MAX_HASH_BITS = 512  # the compiled encoder's largest row
HASH_WIDTHS = (1, 2, 4)


def check_hash_bits(bits: int, dim: int) -> None:
    """``hash_bits`` is 0 (the rotated key's signs) or a whole number of bytes up to ``head_dim``."""
    if bits and (bits % 8 or not 8 <= bits <= min(dim, MAX_HASH_BITS)):
        raise ConfigError(f"sekv hyper-parameter 'hash_bits' must be 0 or a multiple of 8 in [8, head_dim={dim}], "
                          f"got {bits}")


def hash_columns(bits: int, width: int, dim: int) -> int:
    """Projections a layer holds: one a bit at width 1, else as many as the layout could use (all at one bit)."""
    return bits if width == 1 else min(dim, bits)


def check_hash_layout(layout: Any, bits: int, width: int, columns: int, layers: int) -> list[Layout]:
    """A recorded ``hash_layout`` → one ``(n4, n2, n1)`` a layer, or a ``ConfigError`` naming what is wrong: each
    a whole number of bytes a group, ``bits`` in all, no width above ``width``, within the layer's projections."""
    where = "sekv hyper-parameter 'hash_layout'"
    if not isinstance(layout, list | tuple) or len(layout) != layers:
        raise ConfigError(f"{where} must list one [n4, n2, n1] for each of the {layers} layers")
    out = []
    for entry in layout:
        if (not isinstance(entry, list | tuple) or len(entry) != 3
                or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in entry)):
            raise ConfigError(f"{where}: {entry!r} is not [n4, n2, n1] (counts of projections at 4, 2 and 1 bits)")
        n4, n2, n1 = entry
        if n4 % 2 or n2 % 4 or n1 % 8:
            raise ConfigError(f"{where}: {list(entry)} does not fill whole bytes (n4 even, n2 and n1 multiples of 4 "
                              "and 8)")
        if layout_bits((n4, n2, n1)) != bits or n4 + n2 + n1 > columns or (width < 4 and n4) or (width < 2 and n2):
            raise ConfigError(f"{where}: {list(entry)} is not {bits} bits over at most {columns} projections of at "
                              f"most {width} bits")
        out.append((n4, n2, n1))
    return out


class SeKVAdapter(nn.Module):
    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, *, rotation_seed: int = 0, hash_bits: int = 0,
                 hash_width: int = 1, hash_layout: Sequence[Sequence[int]] | None = None):
        super().__init__()
        check_hash_bits(hash_bits, head_dim)
        if hash_width not in HASH_WIDTHS:
            raise ConfigError(f"sekv hyper-parameter 'hash_width' must be one of {HASH_WIDTHS}, got {hash_width!r}")
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.rotation_seed, self.hash_bits, self.hash_width = rotation_seed, hash_bits, hash_width
        columns = hash_columns(hash_bits, hash_width, head_dim)
        # every projection at one bit until a fit allocates the widths (equal directions: one bit each is best)
        self.hash_layout: list[Layout] = (check_hash_layout(hash_layout, hash_bits, hash_width, columns, num_layers)
                                          if hash_layout is not None else [(0, 0, hash_bits)] * num_layers)
        self.code_gain = nn.Parameter(torch.zeros(num_layers, kv_heads, head_dim))
        self.span_tau = nn.Parameter(torch.full((num_layers,), INIT_TAU))
        self.layer_logit = nn.Parameter(torch.zeros(num_layers))
        self.summary_bias = nn.Parameter(torch.zeros(num_layers, kv_heads))
        self.rank_gate = nn.Parameter(torch.full((num_layers, 2, head_dim), 3.0))
        if hash_bits:
            init = torch.empty(num_layers, kv_heads, head_dim, columns)
            if init.device.type != "meta":  # (sizing builds the modules on the meta device: no values there)
                with torch.no_grad():
                    for layer in range(num_layers):
                        init[layer] = rotation(head_dim, self.rotation_seed_of(layer))[:, :columns]
            self.hash_key = nn.Parameter(init)
            self.hash_query = nn.Parameter(init.clone())

    def hyper(self) -> dict[str, Any]:
        out = {"num_layers": self.num_layers, "kv_heads": self.kv_heads, "head_dim": self.head_dim,
               "rotation_seed": self.rotation_seed}
        if self.hash_bits:  # none: adapters saved before it; the width and layout only where they are not signs
            out["hash_bits"] = self.hash_bits
            if self.hash_width > 1:
                out |= {"hash_width": self.hash_width, "hash_layout": [list(v) for v in self.hash_layout]}
        return out

    def hash_projections(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The trained hash's key and query projections of ``layer`` ``[kv_heads, d, m]``: the ``m`` its layout uses
        (a mixed layout leaves the rest unused)."""
        used = sum(self.hash_layout[layer])
        return self.hash_key[layer, ..., :used], self.hash_query[layer, ..., :used]

    def rotation_seed_of(self, layer: int) -> int:
        """The seed of layer ``layer``'s fixed rotation (one per layer, shared by its KV heads)."""
        return 7919 * self.rotation_seed + layer

    def gains(self, layer: int) -> torch.Tensor:
        """``[kv_heads, head_dim]``: the query-side weight of each rotated coordinate."""
        return self.code_gain[layer].exp()

    def layer_shares(self) -> torch.Tensor:
        """``[num_layers]``, summing to ``num_layers``: each layer's budget relative to B."""
        return torch.softmax(self.layer_logit, 0) * self.num_layers


def param_count(n_layers: int, kv_heads: int, head_dim: int, hash_bits: int = 0, hash_width: int = 1) -> int:
    return (n_layers * kv_heads * (head_dim + 1) + 2 * n_layers + 2 * n_layers * head_dim
            + 2 * n_layers * kv_heads * head_dim * hash_columns(hash_bits, hash_width, head_dim))


def hyper_int(hyper: dict[str, Any], key: str, default: Any, low: int, high: int) -> Any:
    """``hyper[key]`` as an int in ``[low, high]`` (an integral float, as JSON may write it, is accepted),
    else a ``ConfigError`` naming the key."""
    value = hyper.get(key, default)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ConfigError(f"sekv hyper-parameter {key!r} must be an integer in [{low}, {high}], got {value!r}")
    return value


def build_sekv_modules(shape: ModelShape, hyper: dict[str, Any]) -> SeKVAdapter:
    limit = hyper.get("max_trainable_fraction", DEFAULT_MAX_FRACTION)
    if not isinstance(limit, int | float) or isinstance(limit, bool) or not 0 < limit <= 1:
        raise ConfigError(f"sekv hyper-parameter 'max_trainable_fraction' must lie in (0, 1], got {limit!r}")
    sizes = {"num_layers": len(shape.full_attention_layers), "kv_heads": shape.num_kv_heads,
             "head_dim": shape.head_dim}
    for key, size in sizes.items():  # recorded by hyper(): they must be the base model's, not merely known keys
        if key in hyper and hyper[key] != size:
            raise ConfigError(f"sekv hyper-parameter {key!r} is {hyper[key]!r}, but the base model's shape makes "
                              f"it {size} (the modules are sized by the model)")
    hash_bits = hyper_int(hyper, "hash_bits", 0, 0, MAX_HASH_BITS)
    check_hash_bits(hash_bits, sizes["head_dim"])
    hash_width = hyper_int(hyper, "hash_width", 1, 1, 4)
    if "hash_layout" in hyper and not (hash_bits and hash_width > 1):
        raise ConfigError("sekv hyper-parameter 'hash_layout' is recorded only with hash_bits and a hash_width of 2 "
                          "or 4")
    return SeKVAdapter(sizes["num_layers"], sizes["kv_heads"], sizes["head_dim"],
                       rotation_seed=hyper_int(hyper, "rotation_seed", 0, 0, MAX_SEED), hash_bits=hash_bits,
                       hash_width=hash_width, hash_layout=hyper.get("hash_layout"))
