"""Every registered method with what it needs to run on a tiny model (kvpress's ``default_presses`` idea):
most need nothing; methods with an offline calibration profile get a small synthetic one written here, so
the shared invariant tests run every method. The profiles are valid but arbitrary (random tiny models have
no retrieval heads to find); the methods' own test files calibrate real ones."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from zoomkv import compat
from zoomkv.methods.infinigen_profile import partial_channels, save_profile


def _full_layers(model) -> list[int]:
    return [i for i, kind in enumerate(compat.layer_types(model.config)) if kind == "full_attention"]


def _compresskv_profile(model, folder: Path) -> Path:
    text = compat.text_config(model.config)
    full = set(_full_layers(model))
    n = text.num_hidden_layers
    # recorded for the model it is built for: a profile of another model is refused (issue 32)
    name = getattr(model, "zoomkv_name", None) or "matrix"
    profile = {"format": "zoomkv-compresskv-profile", "version": 1, "model": name, "num_layers": n,
               "num_attention_heads": text.num_attention_heads,
               "heads": [[0] if i in full else [] for i in range(n)],
               "layer_error": [float(i + 1) if i in full else 0.0 for i in range(n)]}
    path = folder / "compresskv.json"
    path.write_text(json.dumps(profile))
    return path


def _infinigen_profile(model, folder: Path) -> Path:
    text = compat.text_config(model.config)
    kv_heads = text.num_key_value_heads
    d = compat.head_dim(model.config)
    k = partial_channels(d, 0.2)
    layers = {i: (torch.eye(d).expand(kv_heads, d, d).clone(), torch.arange(k).expand(kv_heads, k).clone())
              for i in _full_layers(model)}
    return save_profile(folder / "infinigen.safetensors", layers, {"model": "matrix"})


PROFILE_BUILDERS = {"compresskv": _compresskv_profile, "infinigen": _infinigen_profile}


def method_kwargs(name: str, model: Any, folder: Path) -> dict[str, Any]:
    """The keyword arguments ``get_method(name, ...)`` needs on ``model`` (files go under ``folder``)."""
    if name in PROFILE_BUILDERS:
        sub = folder / f"{name}-{model.config.model_type}"
        sub.mkdir(parents=True, exist_ok=True)
        return {"profile": str(PROFILE_BUILDERS[name](model, sub))}
    return {}

