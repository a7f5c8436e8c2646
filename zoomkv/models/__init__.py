"""Models: the name registry, tiny test models, GGUF packages and their cache, and ``load_model``.

    registry.py   ModelSpec, the registered names, DEFAULT_MODEL
    tiny.py       the tiny random test models and their byte tokenizer
    gguf.py       GGUF packages: locating, converting once, the cache folders
    tokenizer.py  the pad token every loaded tokenizer gets
    loading.py    load_model, model_max_length / context_limit
    device.py     parse_dtype / resolve_device (the --dtype and --device settings)

Names resolve in the order ``loading.load_model`` documents: a registered name, a local folder or
``.gguf`` file, then a Hugging Face hub id.
"""

from zoomkv.models.device import parse_dtype, resolve_device
from zoomkv.models.gguf import CACHE_FORMAT, cache_dir, ensure_converted, find_package_dir, model_cache_path
from zoomkv.models.loading import NO_CONTEXT_LIMIT, context_limit, load_model, model_max_length
from zoomkv.models.registry import DEFAULT_MODEL, ModelSpec, get_model_spec, list_models
from zoomkv.models.tiny import build_tiny_model, build_tiny_tokenizer

__all__ = [
    "CACHE_FORMAT",
    "DEFAULT_MODEL",
    "NO_CONTEXT_LIMIT",
    "ModelSpec",
    "build_tiny_model",
    "build_tiny_tokenizer",
    "cache_dir",
    "context_limit",
    "ensure_converted",
    "find_package_dir",
    "get_model_spec",
    "list_models",
    "load_model",
    "model_cache_path",
    "model_max_length",
    "parse_dtype",
    "resolve_device",
]
