"""sekv's trainable modules: a few thousand parameters on top of a frozen model.

Per compressed (full-attention) layer ``l`` and KV head ``h``:

- ``span_tau[l]``: the anchor threshold in standard deviations (anchors: surprisal > mean + τ·std); init 1.0;
- ``proj_a``/``proj_b`` ``[L or 1, p, d]``: the semantic projector, a low-rank correction of the router's
  bilinear form, ``score(q, k̄) = q·k̄ + (A q)·(B k̄)``. ``B`` starts at zero, so a fresh adapter routes by
  plain ``q·k̄`` (the summary key's logit) and is deterministic; ``A`` starts from a seeded draw so B gets
  a gradient. With few parameters to spare (small models) the projector is shared by all layers;
- ``route_tau[l, h]``: the zoom threshold on the router's estimated log attention mass of a span; init -7
  (zoom into anything holding ~0.1% of the mass, while the budget allows);
- ``rank_gate[l, h, 2, r_max]``: logits of the rank gates for keys (0) and values (1); a rank component is
  used at inference when its logit is > 0; init +3 (every rank on: full-rank, exact reconstruction).

Layers are indexed by their position among the model's full-attention layers (``ModelShape.full_attention_layers``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zoomkv.errors import ConfigError
from zoomkv.protocol.shape import ModelShape

DEFAULT_R_MAX = 32
DEFAULT_MAX_FRACTION = 0.0005


class SeKVAdapter(nn.Module):
    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, *, proj_dim: int, share_projector: bool,
                 r_max: int = DEFAULT_R_MAX, seed: int = 0):
        super().__init__()
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.proj_dim, self.share_projector, self.r_max = proj_dim, share_projector, r_max
        n_proj = 1 if share_projector else num_layers
        g = torch.Generator().manual_seed(seed)  # deterministic whatever the global RNG state
        self.span_tau = nn.Parameter(torch.ones(num_layers))
        self.proj_a = nn.Parameter(torch.randn(n_proj, proj_dim, head_dim, generator=g) / head_dim**0.5)
        self.proj_b = nn.Parameter(torch.zeros(n_proj, proj_dim, head_dim))
        self.route_tau = nn.Parameter(torch.full((num_layers, kv_heads), -7.0))
        self.rank_gate = nn.Parameter(torch.full((num_layers, kv_heads, 2, r_max), 3.0))

    def hyper(self) -> dict[str, Any]:
        return {"num_layers": self.num_layers, "kv_heads": self.kv_heads, "head_dim": self.head_dim,
                "proj_dim": self.proj_dim, "share_projector": self.share_projector, "r_max": self.r_max}

    def projector(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = 0 if self.share_projector else layer
        return self.proj_a[i], self.proj_b[i]

    def router_scores(self, layer: int, query: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """``query [..., g, d]`` × ``keys [..., S, d]`` → ``[..., g, S]``: ``q·k + (A q)·(B k)``."""
        a, b = self.projector(layer)
        base = torch.matmul(query, keys.transpose(-1, -2))
        qa = torch.matmul(query, a.to(query.dtype).T)  # [..., g, p]
        kb = torch.matmul(keys, b.to(keys.dtype).T)  # [..., S, p]
        return base + torch.matmul(qa, kb.transpose(-1, -2))

    def hard_gates(self, layer: int) -> torch.Tensor:
        """``[kv_heads, 2, r_max]`` 0/1: the rank components used at inference."""
        return (self.rank_gate[layer] > 0).float()


def _param_count(n_layers: int, kv_heads: int, head_dim: int, proj_dim: int, shared: bool, r_max: int) -> int:
    n_proj = 1 if shared else n_layers
    return n_layers + 2 * n_proj * proj_dim * head_dim + n_layers * kv_heads + n_layers * kv_heads * 2 * r_max


def hyper_int(hyper: dict[str, Any], key: str, default: Any, low: int) -> Any:
    """``hyper[key]`` as an int >= ``low`` (an integral float, as JSON may write it, is accepted; "auto" is
    passed through where it is the default), else a ``ConfigError`` naming the key."""
    value = hyper.get(key, default)
    if value == "auto" and default == "auto":
        return value
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ConfigError(f"sekv hyper-parameter {key!r} must be an integer >= {low}, got {value!r}")
    return value


def choose_size(shape: ModelShape, hyper: dict[str, Any]) -> tuple[int, bool]:
    """``(proj_dim, share_projector)``: the hyper-parameters when given, else the largest projector (per layer
    before shared) that keeps the adapter under ``max_trainable_fraction`` of the base model."""
    n_layers = len(shape.full_attention_layers)
    r_max = hyper_int(hyper, "r_max", DEFAULT_R_MAX, 1)
    proj_dim = hyper_int(hyper, "proj_dim", "auto", 1)
    shared = hyper.get("share_projector", "auto")
    if shared != "auto" and not isinstance(shared, bool):
        raise ConfigError(f"sekv hyper-parameter 'share_projector' must be true, false or \"auto\", got {shared!r}")
    if proj_dim != "auto" and shared != "auto":
        return proj_dim, shared
    limit = hyper.get("max_trainable_fraction", DEFAULT_MAX_FRACTION)
    if not isinstance(limit, int | float) or isinstance(limit, bool) or not 0 < limit <= 1:
        raise ConfigError(f"sekv hyper-parameter 'max_trainable_fraction' must lie in (0, 1], got {limit!r}")
    dims = [int(proj_dim)] if proj_dim != "auto" else [64, 32, 16, 8, 4, 2, 1]
    modes = [bool(shared)] if shared != "auto" else [False, True]
    if not shape.num_parameters:
        return dims[min(3, len(dims) - 1)], modes[0]  # no size known (e.g. inference from ctx): a mid size
    for mode in modes:
        for p in dims:
            if p <= shape.head_dim and _param_count(n_layers, shape.num_kv_heads, shape.head_dim, p, mode,
                                                    r_max) <= limit * shape.num_parameters:
                return p, mode
    return dims[-1], modes[-1]  # nothing fits: the smallest; the trainer reports and refuses it


def build_sekv_modules(shape: ModelShape, hyper: dict[str, Any]) -> SeKVAdapter:
    proj_dim, shared = choose_size(shape, hyper)
    return SeKVAdapter(len(shape.full_attention_layers), shape.num_kv_heads, shape.head_dim, proj_dim=proj_dim,
                       share_projector=shared, r_max=hyper_int(hyper, "r_max", DEFAULT_R_MAX, 1),
                       seed=hyper_int(hyper, "init_seed", 0, 0))
