"""Every call that depends on the transformers version lives here (the whole test suite passes with
transformers 5.13, 5.17 and 5.25; 5.12 and older have another cache-layer interface, ``get_max_cache_shape``
and ``get_mask_sizes(cache_position)``, and are refused on import).

- 5.x renames the cache argument of forward/generate from ``past_key_values`` to ``cache`` (5.24 warns on
  the old name); ``cache_kwarg()`` says which one this version takes.
- Custom attention functions are registered with ``AttentionInterface``; a name the mask registry
  (``AttentionMaskInterface``) does not know gets *no* mask at all, so padded batches would silently
  attend to padding: we register transformers' own sdpa mask under our name too.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from functools import cache
from typing import Any

import torch
import transformers
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from zoomkv.errors import UnsupportedDependency

__all__ = ["sdpa_attention_forward", "cache_kwarg", "register_attention", "layer_types", "TRANSFORMERS_VERSION"]

TRANSFORMERS_VERSION = transformers.__version__
# The releases pyproject.toml admits: the cache-layer interface zoomkv.memory.layer implements is 5.13's.
SUPPORTED = ((5, 13), (6,))


def check_version(version: str = TRANSFORMERS_VERSION) -> None:
    """Refuse a transformers release outside ``SUPPORTED`` (one line, on import), not a failure deep in a cache."""
    found = tuple(int(part) for part in re.findall(r"\d+", version)[:2])
    if not SUPPORTED[0] <= found < SUPPORTED[1]:
        low, high = (".".join(map(str, v)) for v in SUPPORTED)
        raise UnsupportedDependency(f"zoomkv needs transformers >={low},<{high}, found {version}: "
                                    f"pip install 'transformers>={low},<{high}'")


check_version()


@cache
def cache_kwarg() -> str:
    """The keyword ``generate``/``forward`` take the cache under in this transformers version."""
    from transformers.generation import utils as gen_utils

    names = getattr(gen_utils, "ALL_CACHE_NAMES", None)
    if names and names[0] == "cache":
        return "cache"
    return "past_key_values"


def generate_cache_kwargs(cache_obj: Any) -> dict[str, Any]:
    """The ``generate()`` keyword that passes a cache on this transformers version: ``cache=`` or ``past_key_values=``."""
    return {cache_kwarg(): cache_obj}


def register_attention(name: str, fn: Callable) -> None:
    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, decode_mask)


def decode_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """transformers' sdpa mask, except that a one-token query with a 2D attention mask never asks whether the
    mask is all ones (``_ignore_causal_mask_sdpa`` reads that back to the host: one GPU synchronisation per
    decode step); the mask is built instead, as transformers does for its compileable caches. sdpa gives the
    same result with an all-True mask as with none."""
    if kwargs.get("q_length") == 1 and kwargs.get("attention_mask") is not None:
        kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


def set_attention(model: torch.nn.Module, name: str) -> None:
    """Switch a loaded model's attention implementation to ``name`` (already registered)."""
    if getattr(model.config, "_attn_implementation", None) == name:
        return
    setter = getattr(model, "set_attn_implementation", None)
    if setter is not None and "allow_all_kernels" in inspect.signature(setter).parameters:
        setter(name)
    elif setter is not None:
        setter(name)
    else:  # older 5.x: the config attribute is what the modules read
        model.config._attn_implementation = name


def text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if get is not None else config


def head_dim(config: Any) -> int:
    """Channels per attention head: the config's ``head_dim`` where it has one (Gemma 3, Qwen3 set it apart
    from the hidden size), else ``hidden_size / num_attention_heads``."""
    text = text_config(config)
    return int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)


def layer_types(config: Any) -> list[str]:
    """Per decoder layer: "full_attention", "sliding_attention", ... (what DynamicCache would build)."""
    config = text_config(config)
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs

        types, _ = get_layer_types_and_kwargs(config)
        return list(types)
    except ImportError:  # pragma: no cover - older 5.x
        types = getattr(config, "layer_types", None)
        return list(types) if types else ["full_attention"] * config.num_hidden_layers


def sliding_window(config: Any) -> int | None:
    return getattr(text_config(config), "sliding_window", None)


def final_norm(model: torch.nn.Module) -> torch.nn.Module | None:
    """The decoder's final norm (the last module before the LM head), or None."""
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if get_decoder is not None else None
    return getattr(decoder, "norm", None)


def rotary_frequencies(config: Any, layer_idx: int) -> tuple[torch.Tensor, float] | None:
    """Layer ``layer_idx``'s rotary position embedding as the model computes it: ``(inv_freq [head_dim / 2],
    attention_scaling)``, so ``cos = cos(pos · inv_freq) · scaling`` (rotate-half layout); None when the layer's
    RoPE is not a static table this can rebuild (no RoPE, a partial rotary dimension, a dynamic type).

    Read from the config with transformers' own initialisers (per layer type where the model has one
    table per type, as Gemma 3 has), so it needs no weights."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    text = text_config(config)
    params = getattr(text, "rope_parameters", None)
    if not isinstance(params, dict):
        return None
    types = layer_types(text)
    layer_type = types[layer_idx] if layer_idx < len(types) else None
    per_type = layer_type in params and isinstance(params[layer_type], dict)
    own = params[layer_type] if per_type else params
    if not isinstance(own, dict) or own.get("partial_rotary_factor", 1.0) != 1.0:
        return None
    kind = own.get("rope_type", "default")
    if kind == "default":
        dim = head_dim(text)
        theta = own.get("rope_theta")
        if not isinstance(theta, int | float) or theta <= 0:
            return None
        # float32 throughout, as the models' own default initialisers compute it: the same table to the bit
        return 1.0 / (float(theta) ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    if kind.startswith("dynamic") or kind not in ROPE_INIT_FUNCTIONS:  # recomputed per length at run time
        return None
    init = ROPE_INIT_FUNCTIONS[kind]
    try:
        inv_freq, scaling = init(text, None, layer_type=layer_type) if per_type else init(text, None)
    except (KeyError, TypeError, ValueError, AttributeError):  # a parameter this initialiser needs is missing
        return None
    return inv_freq.float(), float(scaling)
