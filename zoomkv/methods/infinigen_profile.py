"""InfiniGen's offline profile: per layer and KV head, an orthogonal "skew" of the query/key space and the
channels that carry most of ``q·k`` once skewed. Written by ``zoomkv calibrate infinigen``, read by the
``infinigen`` method at prefill.

The skew is the right singular basis ``V`` of the layer's post-RoPE queries (``Q = U Σ Vᵀ``): rotating
queries and keys by the same orthogonal ``V`` leaves every ``q·k`` unchanged, but packs the queries' energy
into the first few channels, so a small set of channels approximates the attention scores well. Working
after RoPE (where the runtime stores keys) keeps the rotation exact whatever the position.

File: one safetensors file, ``layers.{i}.skew`` (``[kv_heads, d, d]`` float32, columns = skewed channels)
and ``layers.{i}.channels`` (``[kv_heads, k]`` int64) per full-attention layer, plus string metadata
(format, version, model shape, ratio) checked at load.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from zoomkv.atomic import write_file_atomically
from zoomkv.errors import ConfigError, ZoomKVError
from zoomkv.protocol.profiles import profile_dir

PROFILE_FILE = "infinigen.safetensors"
FORMAT = "zoomkv-infinigen"
VERSION = "1"


def partial_channels(head_dim: int, ratio: float) -> int:
    """Channels kept per head: ``ceil(ratio · d)``, at least one (20% of 64 → 13)."""
    return max(1, min(head_dim, math.ceil(ratio * head_dim - 1e-9)))


def skew_and_channels(queries: torch.Tensor, keys: torch.Tensor, ratio: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's skew and top channels from calibration samples.

    ``queries`` ``[q_heads, T, d]`` and ``keys`` ``[kv_heads, T, d]``, post-RoPE, one sequence. A KV head's
    skew is computed from the stacked queries of its whole GQA group (its keys serve all of them, so one
    rotation must fit the group). Channels are ranked by ``mean|q̃_c| · mean|k̃_c|``, the typical size of
    channel c's share of ``q·k``. Returns ``skew [kv_heads, d, d]`` (orthogonal) and ``channels
    [kv_heads, k]`` (ascending)."""
    kv_heads, _, d = keys.shape
    groups = queries.shape[0] // kv_heads
    k = partial_channels(d, ratio)
    skews, chosen = [], []
    for h in range(kv_heads):
        q = queries[h * groups : (h + 1) * groups].reshape(-1, d).double()
        # Right singular vectors, largest singular value first: the directions queries use most.
        _, _, vh = torch.linalg.svd(q, full_matrices=False)
        skew = vh.T  # [d, d]
        q_skew, k_skew = q @ skew, keys[h].double() @ skew
        weight = q_skew.abs().mean(0) * k_skew.abs().mean(0)
        skews.append(skew.float())
        chosen.append(weight.topk(k).indices.sort().values)
    return torch.stack(skews), torch.stack(chosen)


def save_profile(path: Path, layers: dict[int, tuple[torch.Tensor, torch.Tensor]], meta: dict[str, str]) -> Path:
    tensors = {}
    for i, (skew, channels) in layers.items():
        tensors[f"layers.{i}.skew"] = skew.contiguous()
        tensors[f"layers.{i}.channels"] = channels.to(torch.int64).contiguous()
    # atomic: a half-written profile is never read, and the temporary file's name is never a user's
    return write_file_atomically(path, lambda tmp: save_file(tensors, str(tmp),
                                                             metadata={"format": FORMAT, "version": VERSION, **meta}))


def is_profile(path: Path) -> bool:
    """An InfiniGen profile zoomkv wrote (its metadata's format), read without loading a tensor."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return (f.metadata() or {}).get("format") == FORMAT
    except Exception:  # safetensors raises its own errors on anything that is not a safetensors file
        return False


def resolve_profile(profile: str | None, model_name: str | None) -> Path:
    """The profile file: ``profile`` as a file, a folder holding one, or a model name; else the profile of
    the model being run. Raises a ZoomKVError naming the calibration command when there is none."""
    name = model_name or "MODEL"
    command = f"zoomkv calibrate infinigen --model {name}"
    if profile is not None:
        candidate = Path(profile).expanduser()
        if candidate.is_file():
            return candidate
        if candidate.is_dir() and (candidate / PROFILE_FILE).is_file():
            return candidate / PROFILE_FILE
        by_name = profile_dir(profile) / PROFILE_FILE
        if by_name.is_file():
            return by_name
        if "/" in profile or profile.endswith(".safetensors"):
            raise ZoomKVError(f"infinigen profile not found: {profile} (build one with `{command}`)")
        raise ZoomKVError(f"no infinigen profile for {profile!r}: run `zoomkv calibrate infinigen --model {profile}`")
    if model_name is not None:
        path = profile_dir(model_name) / PROFILE_FILE
        if path.is_file():
            return path
    raise ZoomKVError(
        f"method 'infinigen' needs a calibration profile of {name}: run `{command}` first "
        "(or pass profile=PATH)"
    )


def load_layer(path: Path, layer_idx: int, kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(skew [kv_heads, d, d], channels [kv_heads, k])`` of one layer, checked against the model."""
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT or meta.get("version") != VERSION:
                raise ConfigError(f"{path} is not a zoomkv infinigen profile (format {meta.get('format')!r})")
            name = f"layers.{layer_idx}.skew"
            if name not in f.keys():
                raise ConfigError(f"{path} has no layer {layer_idx}: it was built for another model "
                                  f"({meta.get('model', '?')})")
            skew = f.get_tensor(name)
            channels = f.get_tensor(f"layers.{layer_idx}.channels")
    except (SafetensorError, OSError) as err:  # a JSON, binary or truncated file: not safetensors
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"{path} is not a zoomkv infinigen profile (not a readable safetensors file: {first}; "
                          "`zoomkv calibrate infinigen` writes one)") from None
    if skew.shape[0] != kv_heads or skew.shape[-1] != head_dim:
        raise ConfigError(
            f"{path} was built for {skew.shape[0]} KV heads of dim {skew.shape[-1]} ({meta.get('model', '?')}), "
            f"but layer {layer_idx} has {kv_heads} of dim {head_dim}"
        )
    return skew, channels
