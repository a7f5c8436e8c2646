"""``compresskv``: SnapKV-style eviction voted by *semantic retrieval heads*, with error-aware layer budgets.

Lin et al., "CompressKV: Semantic Retrieval Heads Know What Tokens are Not Important Before Generation",
2025 (arXiv:2508.02401). Two observations drive it. (1) In a GQA model not every query head knows which
tokens matter: some heads retrieve the important mid-context tokens and their surroundings, others only
attend to the first and last tokens. Voting with all heads (SnapKV) lets the latter evict what the former
need. (2) Layers differ in how much evicting hurts them.

Offline (``zoomkv calibrate compresskv --model M``, see ``zoomkv.calibrate.compresskv``): passkey
retrieval decoded with full attention; on the samples the model answers correctly, each query head's
attention mass on the needle tokens while the answer is generated gives its score, the top 4 per layer
are the layer's semantic retrieval heads; each layer's eviction error is the relative error of its
attention output when only a SnapKV top-k of its rows is kept. Saved as a small JSON profile.

Online, at prefill: each prompt row's score is the attention the last ``window`` (8) prompt queries of
the layer's semantic retrieval heads give it (each head over its own KV head's keys, softmax over the
whole causal row), average-pooled along the sequence (kernel 5), averaged over those heads. The top rows
plus the window are kept, the same rows for every KV head (as the authors' code: one index set chosen by
the retrieval heads). Layer budgets follow the error profile: each compressed layer gets
``min(32, B)`` rows plus a share of the rest proportional to its eviction error, capped at 3B, summing to
exactly L·B over the compressed layers.

Deviations, and why:
- Decoding uses this runtime's fixed budget like ``snapkv``: once a layer is full, each new row evicts the
  kept prompt row with the lowest prefill score (window and generated rows protected).
- The floor is ``min(32, B)``, not 32: with B < 32 the paper's [32, 3B] range cannot sum to L·B.
- Rounding: ideal shares are water-filled into [floor, 3B] and rounded by largest remainder, so the sum
  is exact (the authors' integer fix-up loop reaches the same sum, with ties broken differently).
- As for ``pyramidkv``, a layer whose error share is tiny gets fewer rows than B, so B ≥ context is exactly
  full attention only where every layer's allocation covers the context.

The profile is found from, in order: the ``profile`` hyper-parameter (a path), the ``model``
hyper-parameter (``profile_dir(model) / compresskv.json``), and the model name the runtime passes in
``ctx.model_name`` (``ZoomCache`` takes it from ``model.zoomkv_name``, i.e. what ``load_model`` was given).
From the CLI: ``zoomkv generate --model M --method compresskv --budget 256`` finds ``M``'s profile
automatically; ``--method-arg profile=PATH`` uses another file. Without one it raises a ZoomKVError naming
the exact calibration command.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from zoomkv.errors import ConfigError, ZoomKVError
from zoomkv.models.registry import same_base_name
from zoomkv.protocol.eviction import (
    NEG_INF,
    EvictionMethod,
    check_pooling,
    key_valid,
    pool_scores,
    store_rows,
    top_rows_and_window,
    window_scores,
)
from zoomkv.protocol.method import MethodConfig, PrefillContext
from zoomkv.protocol.profiles import profile_dir

if TYPE_CHECKING:
    from zoomkv.memory.layer import LayerMemory

PROFILE_FILE = "compresskv.json"
PROFILE_FORMAT = "zoomkv-compresskv-profile"
PROFILE_VERSION = 1


def calibrate_command(model: str | None) -> str:
    return f"zoomkv calibrate compresskv --model {model or '<MODEL>'}"


def default_profile_path(model: str) -> Path:
    return profile_dir(model) / PROFILE_FILE


@lru_cache(maxsize=16)
def _read_profile(path: str, mtime_ns: int) -> dict[str, Any]:
    """Parse and check a profile file (cached per path and modification time: one read per run)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise ZoomKVError(f"{path} is not a CompressKV profile (not UTF-8 text at byte {err.start}; the profile "
                          "is the JSON file `zoomkv calibrate compresskv` writes)") from None
    except (OSError, ValueError) as err:  # ValueError: bad JSON, an integer of 4300+ digits
        raise ZoomKVError(f"cannot read the CompressKV profile {path}: {err}") from None
    except RecursionError:
        raise ZoomKVError(f"cannot read the CompressKV profile {path}: nested too deeply") from None
    if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT:
        raise ZoomKVError(f"{path} is not a CompressKV profile (no format {PROFILE_FORMAT!r})")
    if data.get("version") != PROFILE_VERSION:
        raise ZoomKVError(f"{path} has profile version {data.get('version')}, this zoomkv reads {PROFILE_VERSION}")
    layers = data.get("num_layers")
    heads, errors = data.get("heads"), data.get("layer_error")
    if not isinstance(layers, int) or not isinstance(heads, list) or not isinstance(errors, list) \
            or len(heads) != layers or len(errors) != layers:
        raise ZoomKVError(f"{path}: 'heads' and 'layer_error' must list all {layers} layers")
    for i, err in enumerate(errors):
        if not isinstance(err, (int, float)) or not math.isfinite(err) or err < 0:
            raise ZoomKVError(f"{path}: layer {i} has an invalid eviction error {err!r}")
    return data


def load_profile(path: str | Path, model: str | None = None) -> dict[str, Any]:
    """The profile at ``path``; a ZoomKVError naming the calibration command when it does not exist."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ZoomKVError(
            f"compresskv needs an offline profile (semantic retrieval heads and layer errors) and none was "
            f"found at {path}. Build it with:\n    {calibrate_command(model)}"
        )
    return _read_profile(str(path.resolve()), path.stat().st_mtime_ns)


@lru_cache(maxsize=256)
def error_budgets(errors: tuple[float, ...], budget: int, floor: int = 32, cap_factor: int = 3) -> tuple[int, ...]:
    """Per-layer row budgets from eviction errors: each layer gets ``lo = min(floor, budget)`` rows plus a
    share of the remaining ``L·budget - L·lo`` proportional to its error, capped at ``cap_factor·budget``
    (water-filling: what capped layers cannot take goes to the others in proportion), rounded by largest
    remainder. Sum exactly ``L·budget``; each in ``[lo, cap_factor·budget]``. All-zero errors: uniform."""
    n = len(errors)
    if n == 0:
        return ()
    lo, hi = min(floor, budget), cap_factor * budget
    total = n * budget
    # Exact rationals: the same allocation on every platform.
    weight = [Fraction(e) for e in errors]
    if sum(weight) <= 0:
        weight = [Fraction(1)] * n
    capped: set[int] = set()
    while True:
        free = [i for i in range(n) if i not in capped]
        rest = total - n * lo - len(capped) * (hi - lo)
        mass = sum(weight[i] for i in free)
        ideal = {i: Fraction(hi) for i in capped}
        for i in free:
            share = rest * weight[i] / mass if mass > 0 else Fraction(rest, len(free))
            ideal[i] = lo + share
        over = {i for i in free if ideal[i] > hi}
        if not over:
            break
        capped |= over
    shares = [int(ideal[i]) for i in range(n)]  # floor: ideal ≥ lo > 0
    left = total - sum(shares)
    # Largest remainder (ties to the larger error, then the lower layer); never above the cap.
    order = sorted(range(n), key=lambda i: (-(ideal[i] - shares[i]), -weight[i], i))
    for i in order:
        if left == 0:
            break
        if shares[i] < hi:
            shares[i] += 1
            left -= 1
    return tuple(shares)


@dataclass
class CompressKVConfig(MethodConfig):
    window: int = field(default=8, metadata={"help": "observation window of prompt queries (paper: 8)"})
    kernel_size: int = field(default=5, metadata={"help": "pooling kernel (paper: 5)"})
    pooling: str = field(default="avg", metadata={"help": "pooling of the window votes (the authors' default: average)"})
    top_heads: int = field(default=4, metadata={"help": "semantic retrieval heads per layer (paper: 4)"})
    min_layer_budget: int = field(default=32, metadata={"help": "floor of a layer's rows (paper: 32)"})
    max_layer_factor: int = field(
        default=3,
        metadata={"help": "cap of a layer's rows, in units of B (paper: 3B)"},
    )
    profile: str | None = field(
        default=None,
        metadata={"help": "path of the calibration profile (default: found from the model name)"},
    )
    model: str | None = field(
        default=None,
        metadata={"help": "model name whose profile_dir holds the profile"},
    )

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ConfigError(f"window must be at least 1, got {self.window}")
        check_pooling(self.kernel_size, self.pooling)
        if self.top_heads < 1:
            raise ConfigError(f"top_heads must be at least 1, got {self.top_heads}")
        if self.min_layer_budget < 1 or self.max_layer_factor < 1:
            raise ConfigError("min_layer_budget and max_layer_factor must be at least 1")


class CompressKV(EvictionMethod):
    """SnapKV votes from the semantic retrieval heads only, under error-proportional layer budgets.

    Citation: Lin et al., "CompressKV: Semantic Retrieval Heads Know What Tokens are Not Important Before
    Generation", arXiv:2508.02401, 2025.
    """

    name = "compresskv"
    config_class = CompressKVConfig
    summary = "SnapKV votes from calibrated semantic retrieval heads (window 8, kernel 5); layer budgets from eviction error"
    citation = ("Lin et al., CompressKV: Semantic Retrieval Heads Know What Tokens are Not Important Before "
                "Generation, arXiv 2025")
    needs_profile = True
    config: CompressKVConfig

    def __init__(self, config: MethodConfig | None = None, **overrides: Any):
        super().__init__(config, **overrides)
        # The profile read for the model this method runs on (a constant of that model, like a
        # hyper-parameter; shared by every layer). Explicit settings are checked now, before any model runs.
        self._profile: dict[str, Any] | None = None
        if self.config.profile or self.config.model:
            self._profile = self._find_profile(None)

    def _find_profile(self, model_name: str | None) -> dict[str, Any]:
        cfg = self.config
        if cfg.profile:
            return load_profile(cfg.profile, cfg.model or model_name)
        name = cfg.model or model_name
        if not name:
            raise ZoomKVError(
                "compresskv needs its calibration profile but does not know the model: pass "
                "profile=PATH or model=NAME (CLI: --method-arg model=NAME), after running\n    "
                f"{calibrate_command(None)}"
            )
        return load_profile(default_profile_path(name), name)

    def profile(self, model_name: str | None = None) -> dict[str, Any]:
        if self._profile is None:
            self._profile = self._find_profile(model_name)
        return self._profile

    # -- budget ---------------------------------------------------------------------------------------
    def min_budget(self) -> int:
        return self.config.window + 1

    def layer_budget(
        self, layer_idx: int, num_layers: int, budget: int, zoom_layers: Sequence[int] | None = None
    ) -> int:
        profile = self.profile()
        if profile["num_layers"] != num_layers:
            raise ZoomKVError(
                f"the CompressKV profile was made for a {profile['num_layers']}-layer model ({profile.get('model')}), "
                f"this one has {num_layers}; recalibrate with {calibrate_command(profile.get('model'))}"
            )
        zoom = sorted(zoom_layers) if zoom_layers is not None else list(range(num_layers))
        errors = tuple(float(profile["layer_error"][i]) for i in zoom)
        cfg = self.config
        budgets = error_budgets(errors, budget, cfg.min_layer_budget, cfg.max_layer_factor)
        return budgets[zoom.index(layer_idx)]

    # -- prefill --------------------------------------------------------------------------------------
    def check_profile_model(self, profile: dict[str, Any], model_name: str | None) -> None:
        """A profile calibrated on another model is refused, naming both (its heads and layer errors are that
        model's), unless ``model=`` names the profile's model: the explicit choice to use it here."""
        recorded = profile.get("model")
        if not isinstance(recorded, str) or not model_name or same_base_name(recorded, model_name):
            return
        if self.config.model is not None and same_base_name(self.config.model, recorded):
            return
        where = self.config.profile or default_profile_path(self.config.model or model_name)
        raise ZoomKVError(
            f"the CompressKV profile {where} was calibrated on {recorded!r}, not on {model_name!r}: its retrieval heads "
            f"and layer errors are that model's; run `{calibrate_command(model_name)}` (or pass model={recorded} to "
            "use it anyway)")

    def compress(self, memory: LayerMemory, ctx: PrefillContext) -> None:
        profile = self.profile(getattr(ctx, "model_name", None))
        self.check_profile_model(profile, getattr(ctx, "model_name", None))
        heads = self._heads(profile, ctx)
        capacity = self.capacity(ctx)
        store_rows(memory, ctx, *self.selection(ctx, heads, capacity), capacity)

    def _heads(self, profile: dict[str, Any], ctx: PrefillContext) -> list[int]:
        q_heads = ctx.queries.shape[1]
        if profile.get("num_attention_heads", q_heads) != q_heads:
            raise ZoomKVError(
                f"the CompressKV profile has {profile['num_attention_heads']} query heads per layer, this model "
                f"{q_heads}: it belongs to another model; recalibrate with {calibrate_command(profile.get('model'))}"
            )
        heads = [int(h) for h in profile["heads"][ctx.layer_idx]][: self.config.top_heads]
        if not heads or not all(0 <= h < q_heads for h in heads):
            raise ZoomKVError(f"the CompressKV profile lists no valid heads for layer {ctx.layer_idx}")
        return heads

    def selection(self, ctx: PrefillContext, heads: list[int], capacity: int) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Rows to keep (``[b, h, capacity]`` in sequence order, None when the prompt fits) and each prompt
        row's score (``[b, h, T]``: the heads' pooled votes, +inf on the window, -inf on padding)."""
        b, kv_heads, length, _ = ctx.keys.shape
        window = min(self.config.window, length)
        prefix = length - window
        votes = head_votes(ctx, heads, window)[..., :prefix]  # [b, k, prefix]
        votes = pool_scores(votes, self.config.kernel_size, self.config.pooling).mean(dim=1)  # [b, prefix]
        scores = window_scores(votes[:, None, :].expand(b, kv_heads, prefix), ctx, window)
        if length <= capacity:
            return None, scores
        return top_rows_and_window(scores, window, capacity), scores


def head_votes(ctx: PrefillContext, heads: list[int], window: int) -> torch.Tensor:
    """The attention the last ``window`` prompt queries of query heads ``heads`` give every prompt row
    (each head over its own KV head's keys, softmax over its whole causal row, padding masked), summed over
    the window: float32 ``[batch, len(heads), T]``."""
    b, _, length, _ = ctx.keys.shape
    idx = torch.tensor(heads, device=ctx.keys.device)
    q = ctx.queries[:, idx, length - window :].float()  # [b, k, w, d]
    k = ctx.keys[:, idx // ctx.num_kv_groups].float()  # query head h reads KV head h // groups
    logits = torch.matmul(q, k.transpose(-1, -2)) * ctx.scaling  # [b, k, w, T]
    q_pos = torch.arange(length - window, length, device=q.device)
    allowed = (torch.arange(length, device=q.device)[None, :] <= q_pos[:, None])[None, None]
    valid = key_valid(ctx)
    if valid is not None:
        allowed = allowed & valid[:, :, None, :]
    probs = torch.softmax(logits.masked_fill(~allowed, NEG_INF), dim=-1).nan_to_num_(0.0)
    return probs.sum(dim=2)
