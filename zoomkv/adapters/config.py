"""``adapter_config.json``: what an adapter is (method, hyper-parameters), what it was trained on (the base
model's fingerprint and shape) and which format it is written in.

The file is sorted JSON, so two exports of the same adapter are byte-identical and diff cleanly. The
format version is checked before anything else is read: a newer format fails with a clear error instead
of half-loading.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from zoomkv.adapters.errors import AdapterConfigError, AdapterNotFoundError, AdapterVersionError
from zoomkv.budget import Budget
from zoomkv.errors import ConfigError, ZoomKVError
from zoomkv.models.registry import hub_name
from zoomkv.protocol.shape import FINGERPRINT_KEYS, ModelShape

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
CARD_NAME = "README.md"
FORMAT_VERSION = 1
SUPPORTED_FORMAT_VERSIONS = (1,)
LIBRARY_NAME = "zoomkv"
PEFT_TYPE = "ZOOMKV"  # the PeftType member zoomkv.adapters.peft_integration registers
# A zoomkv adapter runs inside a causal LM's generate(): PEFT's AutoPeftModelForCausalLM and pipeline("text-
# generation") need this task type to pick PeftModelForCausalLM (without it: a plain PeftModel, or "Cannot infer
# the auto class").
PEFT_TASK_TYPE = "CAUSAL_LM"
PEFT_WEIGHTS_PREFIX = "base_model.zoomkv_modules."  # how PEFT's save_pretrained names the module tensors

# Keys PEFT writes into adapter_config.json (PeftConfig's own fields). A folder saved through PEFT's
# save_pretrained carries them next to ours; they say nothing the zoomkv loader needs, so they are
# accepted and dropped rather than rejected as unknown.
PEFT_CONFIG_KEYS = frozenset({
    "peft_type", "task_type", "base_model_name_or_path", "revision", "inference_mode", "auto_mapping",
    "peft_version", "adapter_name",
})


def _toolkit_version() -> str:
    from zoomkv.version import __version__

    return __version__


def _peft_version() -> str | None:
    """The installed PEFT's version, as PEFT records it in the configs it writes (None without PEFT)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("peft")
    except PackageNotFoundError:
        return None


@dataclass
class ZoomAdapterConfig:
    """``adapter_config.json``: what rebuilds an adapter's modules and checks them before anything runs.

    The method and its hyper-parameters, the base model's fingerprint (another base model is refused) and shape
    (the modules are sized from it alone), the budget it was trained or evaluated at, the trainable fraction and
    the weights' SHA-256; versioned, with PEFT's keys so PEFT's loaders read it as it is."""

    method: str
    hyper: dict[str, Any]
    base_model: dict[str, Any]  # base_fingerprint(): name, revision and the FINGERPRINT_KEYS
    shape: dict[str, Any]  # ModelShape.to_dict(): enough to rebuild the modules without the base model
    budget: str | int | float | None = None  # the budget the adapter was trained / evaluated at
    trainable_fraction: float | None = None  # adapter parameters / base model parameters
    weights_sha256: str | None = None  # of adapter_model.safetensors, so silent bit rot is caught too
    format_version: int = FORMAT_VERSION
    toolkit_version: str = field(default_factory=_toolkit_version)
    library_name: str = LIBRARY_NAME

    def __post_init__(self) -> None:
        # One name for the base model, the Hub id its weights come from, in the config and the card alike;
        # adapters written before held the registered name (smollm2-135m) and load as the same model.
        name = self.base_model.get("name") if isinstance(self.base_model, dict) else None
        if isinstance(name, str) and hub_name(name) != name:
            self.base_model = {**self.base_model, "name": hub_name(name)}

    def weights_identity(self) -> dict[str, Any]:
        """What this adapter's weights record they were saved for (``zoomkv.adapters.weights``)."""
        return {"method": self.method, "hyper": self.hyper, "base_model": self.base_model}

    def model_shape(self) -> ModelShape:
        """The base model's shape the modules are sized from."""
        try:
            return ModelShape.from_dict(self.shape)
        except ConfigError as err:
            raise AdapterConfigError(f"adapter config: invalid 'shape' ({err})") from err

    def to_dict(self) -> dict[str, Any]:
        """The fields as a dict."""
        return asdict(self)

    def to_json(self) -> str:
        """The file's text: the fields plus PEFT's keys (``peft_type``, ``task_type``, ``base_model_name_or_path``)."""
        # PEFT's keys too, so `PeftModel.from_pretrained` and `AutoPeftModelForCausalLM.from_pretrained` read a
        # zoomkv export as it is (peft_integration); inference_mode as PEFT's save_pretrained writes it.
        peft: dict[str, Any] = {"peft_type": PEFT_TYPE, "task_type": PEFT_TASK_TYPE, "inference_mode": True,
                                "base_model_name_or_path": self.base_model.get("name")}
        if _peft_version() is not None:
            peft["peft_version"] = _peft_version()
        return json.dumps({**self.to_dict(), **peft}, sort_keys=True, indent=2) + "\n"

    @classmethod
    def from_dict(cls, data: Any, source: str = "adapter config") -> ZoomAdapterConfig:
        """A config from parsed JSON, every field checked (version, types, sizes); one ``AdapterConfigError`` naming ``source``."""
        if not isinstance(data, dict):
            raise AdapterConfigError(f"{source}: expected a JSON object, got {type(data).__name__}")
        # The version first: a future format may rename every other field.
        version = data.get("format_version")
        if version is None:
            raise AdapterConfigError(f"{source}: no 'format_version' (not a zoomkv adapter config?)")
        if version not in SUPPORTED_FORMAT_VERSIONS:
            raise AdapterVersionError(
                f"{source}: format_version {version!r} is not supported by zoomkv {_toolkit_version()} "
                f"(it reads {list(SUPPORTED_FORMAT_VERSIONS)}); upgrade zoomkv or re-export the adapter"
            )
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(data) - known - PEFT_CONFIG_KEYS)
        if unknown:
            raise AdapterConfigError(f"{source}: unknown field(s) {unknown}")
        missing = sorted(k for k in ("method", "hyper", "base_model", "shape") if k not in data)
        if missing:
            raise AdapterConfigError(f"{source}: missing field(s) {missing}")
        kinds: dict[str, tuple[type, ...]] = {
            "method": (str,), "hyper": (dict,), "base_model": (dict,), "shape": (dict,),
            "budget": (str, int, float, type(None)), "trainable_fraction": (int, float, type(None)),
            "weights_sha256": (str, type(None)), "toolkit_version": (str,), "library_name": (str,),
        }
        for key, types in kinds.items():
            if key in data and not isinstance(data[key], types):
                raise AdapterConfigError(f"{source}: field {key!r} has type {type(data[key]).__name__}")
        missing_fp = sorted(k for k in FINGERPRINT_KEYS if k not in data["base_model"])
        if missing_fp:
            raise AdapterConfigError(f"{source}: base_model fingerprint lacks {missing_fp}")
        for key in ("name", "revision"):
            if not isinstance(data["base_model"].get(key), str | None):
                raise AdapterConfigError(f"{source}: base_model {key!r} has type "
                                         f"{type(data['base_model'][key]).__name__}, not a string")
        try:  # the budget the adapter records is used as the default budget: checked like --budget
            Budget.parse(data.get("budget"))
        except ZoomKVError as err:
            raise AdapterConfigError(f"{source}: field 'budget': {err}") from None
        config = cls(**{k: v for k, v in data.items() if k in known})
        config.model_shape()  # validates the shape now, not at the first use
        return config

    @classmethod
    def from_json_file(cls, path: str | Path) -> ZoomAdapterConfig:
        """Read and check ``adapter_config.json`` at ``path``."""
        path = Path(path)
        if not path.is_file():
            raise AdapterNotFoundError(f"no {CONFIG_NAME} at {path}")
        return cls.from_dict(read_json_file(path), source=str(path))


class DuplicateKeyError(ValueError):
    """A key given twice in one JSON object."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``'s ``object_pairs_hook``: an object, unless a key comes twice. JSON itself keeps the last
    value, so an edited config (``"recent": 8`` ... ``"recent": 16``) would silently say one thing and run
    another; recipes refuse a YAML key given twice the same way."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKeyError(f"key {key!r} is given twice in one object (which one is meant?)")
        out[key] = value
    return out


def read_json_file(path: Path) -> Any:
    """A JSON file of an adapter or checkpoint (config, meta), every problem one ``AdapterConfigError`` naming it:
    not UTF-8, not JSON, nested too deeply, an integer of 4300+ digits, or a key given twice."""
    try:
        return json.loads(path.read_text(encoding="utf-8"), object_pairs_hook=_unique_keys)
    except DuplicateKeyError as err:
        raise AdapterConfigError(f"{path}: {err}") from None
    except (UnicodeDecodeError, ValueError) as err:  # ValueError: bad JSON, an integer of 4300+ digits
        raise AdapterConfigError(f"{path}: not valid JSON ({err})") from err
    except RecursionError:
        raise AdapterConfigError(f"{path}: not valid JSON (nested too deeply)") from None
