"""Adapter weights as safetensors: tensors and a JSON header, nothing that executes on load.

Reading is strict: a truncated or corrupt file, a checksum that is missing or does not match, tensors the
method's modules lack or need, and shapes other than the modules' are each a distinct error.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import struct
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from zoomkv.adapters.errors import (
    AdapterKeysError,
    AdapterNotFoundError,
    AdapterShapeError,
    AdapterWeightsError,
)
from zoomkv.atomic import write_file_atomically
from zoomkv.models.registry import same_base_name
from zoomkv.protocol.shape import fingerprint_diff


def module_tensors(modules: torch.nn.Module) -> dict[str, torch.Tensor]:
    # Cloned and contiguous on the CPU: safetensors refuses tensors that share storage (tied weights)
    # and views, and the file must not depend on the device the adapter was trained on.
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in modules.state_dict().items()}


IDENTITY_KEY = "zoomkv"  # the header's metadata entry naming what the weights were saved for


def tensors_to_bytes(tensors: dict[str, torch.Tensor], identity: dict[str, Any] | None = None) -> bytes:
    """The safetensors bytes of ``tensors``. ``identity`` (``weights_identity``: the method, its hyper-parameters
    and the base model's fingerprint) goes into the header's metadata, so weights moved under another adapter's
    config are refused even when the checksum beside them was recomputed."""
    metadata = {"format": "pt"}
    if identity is not None:
        metadata[IDENTITY_KEY] = json.dumps(identity, sort_keys=True, separators=(",", ":"))
    return _sorted_metadata(st_save(tensors, metadata=metadata))


def _sorted_metadata(data: bytes) -> bytes:
    """safetensors writes the metadata in hash-map order (another order each process): sorted here, so two
    exports of the same adapter are byte-identical (and have one checksum). Same length: offsets are unchanged."""
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + size])
    if "__metadata__" not in header:
        return data
    header = {"__metadata__": dict(sorted(header["__metadata__"].items())),
              **{k: v for k, v in header.items() if k != "__metadata__"}}
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    if len(text) > size:  # safetensors' own JSON is never longer than this; keep its bytes if it ever is
        return data
    return data[:8] + text + b" " * (size - len(text)) + data[8 + size :]


def weights_identity(method: str, hyper: dict[str, Any], base_model: dict[str, Any]) -> dict[str, Any]:
    """What adapter weights record they were saved for (and are checked against at load)."""
    return {"method": method, "hyper": hyper, "base_model": base_model}


def recorded_identity(data: bytes) -> dict[str, Any] | None:
    """The identity a weights file records in its header (None: written before identities, or by another tool)."""
    try:
        (size,) = struct.unpack("<Q", data[:8])
        meta = json.loads(data[8 : 8 + size]).get("__metadata__") or {}
        identity = json.loads(meta[IDENTITY_KEY]) if IDENTITY_KEY in meta else None
    except (struct.error, ValueError, AttributeError, TypeError, RecursionError):
        return None  # an unreadable header fails in the parse itself
    return identity if isinstance(identity, dict) else None


def read_identity(path: str | Path) -> dict[str, Any] | None:
    """``recorded_identity`` of a weights file, from its header alone."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            (size,) = struct.unpack("<Q", head)
            if size > 100 * 2**20:  # safetensors' own limit on a header
                return None
            return recorded_identity(head + f.read(size))
    except (OSError, struct.error):
        return None


STAMP_FLAG = "--stamp-identity"  # zoomkv export's flag that re-exports weights recording no identity


def check_identity(recorded: dict[str, Any] | None, expected: dict[str, Any], source: str, described_by: str, *,
                   unrecorded_ok: bool = False) -> None:
    """Refuse weights that record another method, other hyper-parameters or another base model than the config
    (or checkpoint meta) beside them: another adapter's weights with the checksum recomputed. Weights that
    record none are older than any release (or were written by another tool): names and shapes alone would
    let an edited config (``recent`` 8 → 16, checksum recomputed) misdescribe them, so they are refused with
    the command that re-exports them, which alone passes ``unrecorded_ok`` (the user vouches for the config)."""
    if recorded is None:
        if unrecorded_ok:
            return
        folder = Path(source).parent
        again = f"zoomkv export {shlex.quote(str(folder))} --out {shlex.quote(str(folder) + '-stamped')} {STAMP_FLAG}"
        raise AdapterWeightsError(
            f"{source}: the weights record no identity (the method, hyper-parameters and base model they were "
            f"saved for), so nothing shows that {described_by} describes them; if it does, re-export them: {again}")
    differs = []
    if recorded.get("method") != expected["method"]:
        differs.append(f"method {recorded.get('method')!r} vs {expected['method']!r}")
    old, new = recorded.get("hyper"), expected["hyper"]
    if json.dumps(old, sort_keys=True) != json.dumps(new, sort_keys=True):
        keys = sorted(k for k in {*(old or {}), *new} if not isinstance(old, dict) or old.get(k) != new.get(k))
        differs.append(f"hyper-parameters {keys}")
    base, model = recorded.get("base_model"), expected["base_model"]
    fields = fingerprint_diff(model, base) if isinstance(base, dict) else ["base_model"]
    if isinstance(base, dict) and not same_base_name(base.get("name"), model.get("name")):
        fields.append("name")
    if fields:
        name = base.get("name") if isinstance(base, dict) else None
        differs.append(f"base model {name!r} vs {model.get('name')!r} ({', '.join(fields)})")
    if differs:
        raise AdapterWeightsError(
            f"{source}: these weights were saved for another adapter than {described_by} describes "
            f"({'; '.join(differs)}): one of the two was replaced or edited since zoomkv wrote them together")


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def stamp_identity(path: Path, identity: dict[str, Any]) -> None:
    """Rewrite a weights file another writer made (PEFT's ``save_pretrained``) with ``identity`` in its header,
    as zoomkv's own exports have it: the same tensors, all or nothing."""
    tensors = st_load(path.read_bytes())
    data = tensors_to_bytes(tensors, identity)
    write_file_atomically(path, lambda tmp: tmp.write_bytes(data))


def read_weights(path: str | Path, expected_sha256: str | None, *, recorded_in: str = "its config",
                 identity: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """The tensors of ``path``, after checking its bytes against ``expected_sha256``. The checksum is never
    optional: a file whose checksum was not recorded (``None``) is refused, not loaded unverified. With
    ``identity`` (``weights_identity`` of the config beside it), weights that record another are refused."""
    path = Path(path)
    if not path.is_file():
        raise AdapterNotFoundError(f"no adapter weights at {path}")
    if not isinstance(expected_sha256, str):
        raise AdapterWeightsError(
            f"{path}: no checksum recorded in {recorded_in} (weights_sha256), so the weights cannot be verified and "
            "are not loaded; export the adapter again with zoomkv (zoomkv export FOLDER --out NEW)"
        )
    data = path.read_bytes()
    if sha256(data) != expected_sha256.lower():
        raise AdapterWeightsError(
            f"{path}: checksum mismatch (the file is corrupt or truncated, or not the one its config describes)"
        )
    try:
        # From bytes, not load_file: the checksum above and the parse read the very same bytes.
        tensors = st_load(data)
    except (SafetensorError, ValueError, RuntimeError) as err:
        raise AdapterWeightsError(f"{path}: not a readable safetensors file (corrupt or truncated: {err})") from err
    if identity is not None:
        check_identity(recorded_identity(data), identity, str(path), recorded_in)
    return tensors


def load_into(modules: torch.nn.Module, tensors: dict[str, torch.Tensor], source: str = "adapter weights") -> None:
    """Copy ``tensors`` into ``modules`` after checking the key set and every shape (strictly)."""
    check_tensors(modules.state_dict(), tensors, source)
    modules.load_state_dict(tensors, strict=True)


def check_tensors(expected: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor],
                  source: str = "adapter weights") -> None:
    """``tensors`` have exactly the keys and shapes of ``expected`` (a state dict, possibly of modules built on
    the meta device: then nothing has been allocated yet)."""
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {missing}")
        if unexpected:
            parts.append(f"unexpected {unexpected}")
        raise AdapterKeysError(f"{source}: tensors do not match the method's modules: {'; '.join(parts)}")
    wrong = [
        f"{k}: file {tuple(tensors[k].shape)} vs modules {tuple(v.shape)}"
        for k, v in expected.items()
        if tuple(tensors[k].shape) != tuple(v.shape)
    ]
    if wrong:
        raise AdapterShapeError(f"{source}: wrong shape(s): {'; '.join(wrong)}")


DEFAULT_WEIGHT_BOUND = 1e4  # the largest magnitude a trained module's value may have (MethodTraining.weight_bounds)


def check_values(tensors: dict[str, torch.Tensor], source: str = "adapter weights", *,
                 expected: dict[str, torch.Tensor] | None = None, bounds: dict[str, float] | None = None) -> None:
    """Values a module can run with: the dtype kind of the modules' tensors (``expected``: integers are not cast
    into float parameters, nor floats into integer buffers), finite numbers only (NaN or infinity is refused at
    load, not met as a crash or a silent NaN at the first prompt), and magnitudes within ``bounds`` (per tensor
    name; ``DEFAULT_WEIGHT_BOUND`` for the rest): a gain of 1e30 is no trained value."""
    if expected is not None:
        wrong = [f"{k}: file {t.dtype} vs modules {expected[k].dtype}" for k, t in sorted(tensors.items())
                 if k in expected and t.dtype != expected[k].dtype
                 and not (t.is_floating_point() and expected[k].is_floating_point())]
        if wrong:
            raise AdapterWeightsError(f"{source}: wrong dtype(s): {'; '.join(wrong)}")
    bad = [k for k, t in sorted(tensors.items()) if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:
        raise AdapterWeightsError(f"{source}: non-finite values (NaN or infinity) in {bad}")
    over = []
    for k, t in sorted(tensors.items()):
        bound = (bounds or {}).get(k, DEFAULT_WEIGHT_BOUND)
        if t.is_floating_point() and t.numel() and float(t.abs().max()) > bound:
            over.append(f"{k} (|x| up to {float(t.abs().max()):.3g}, at most {bound:g})")
    if over:
        raise AdapterWeightsError(f"{source}: values out of any trained range in {'; '.join(over)}")
