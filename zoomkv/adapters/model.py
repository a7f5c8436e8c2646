"""``ZoomAdapter``: a trained method's modules plus the config that says what they are and what they fit.

    adapter = ZoomAdapter.from_pretrained("checkpoints/sekv-smollm2")   # or "user/name" on the Hub
    cache = cache_from_adapter(model, adapter, budget=256)              # checks the base model, attaches
    out = model.generate(**inputs, cache=cache)

The modules are rebuilt from ``adapter_config.json`` through the method's registered builder
(``build_adapter_modules``, through the method registry), then filled from ``adapter_model.safetensors``. Nothing is unpickled and no
code from the folder runs.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from zoomkv.adapters.card import render_card
from zoomkv.adapters.checkpoint import META_NAME, STATE_NAME, is_checkpoint, read_checkpoint
from zoomkv.adapters.config import (
    CARD_NAME,
    CONFIG_NAME,
    PEFT_WEIGHTS_PREFIX,
    WEIGHTS_NAME,
    ZoomAdapterConfig,
)
from zoomkv.adapters.errors import AdapterConfigError
from zoomkv.adapters.files import write_folder_atomically
from zoomkv.adapters.hub import push_folder, resolve_adapter
from zoomkv.adapters.weights import (
    check_identity,
    check_tensors,
    check_values,
    load_into,
    module_tensors,
    read_identity,
    read_weights,
    sha256,
    tensors_to_bytes,
    weights_identity,
)
from zoomkv.errors import ConfigError, ZoomKVError
from zoomkv.memory.cache import ZoomCache, attach
from zoomkv.protocol.registry import METHODS, get_training
from zoomkv.protocol.shape import (
    ModelShape,
    base_fingerprint,
    check_base_model,
    fingerprint_diff,  # noqa: F401  (where the trainer and PEFT import it from)
)


def build_adapter_modules(method: str, shape: ModelShape, hyper: dict[str, Any],
                          tensors: dict[str, torch.Tensor] | None = None, *,
                          source: str = "adapter weights") -> torch.nn.Module:
    """The trainable modules an adapter config describes, built by the method's registered training.

    Sizes come from a config that may have been downloaded, so they are checked before anything is allocated:
    the modules are first built on the meta device (no memory), their parameter count held against the base
    model's (``ModelShape.parameter_bound``) and, with ``tensors`` (the weights file's), every key and shape
    against the file's. Only then are they built for real: loading never allocates more than the weights it
    names. (A builder that cannot run on the meta device, reading tensor data, skips the first step.)"""
    training = get_training(method)
    _check_hyper_keys(training, method, hyper)
    planned = _build(training, method, shape, hyper, meta=True)
    if planned is not None:
        expected = planned.state_dict()
        size = sum(t.numel() for t in expected.values())
        if size > shape.parameter_bound():
            raise AdapterConfigError(
                f"{method} adapter: its hyper-parameters ({_sizes(hyper)}) make {size} parameters, more than the "
                f"base model's {shape.parameter_bound()}; refused before allocating them"
            )
        if tensors is not None:
            check_tensors(expected, tensors, source)
            check_values(tensors, source, expected=expected, bounds=training.weight_bounds)
    modules = _build(training, method, shape, hyper, meta=False)
    assert modules is not None
    if tensors is not None and planned is None:
        check_values(tensors, source, expected=modules.state_dict(), bounds=training.weight_bounds)
    return modules


def _check_hyper_keys(training: Any, method: str, hyper: dict[str, Any]) -> None:
    """Refuse hyper-parameters neither the method's config nor its modules know: a misspelt key (``r_mx``)
    would otherwise load an adapter that silently runs with the default."""
    if training.module_keys is None or method not in METHODS:
        return
    known = {f.name for f in dataclasses.fields(METHODS[method].config_class)} | set(training.module_keys)
    unknown = sorted(k for k in hyper if k not in known)
    if unknown:
        raise AdapterConfigError(f"{method} adapter: unknown hyper-parameter(s) {unknown} (known: "
                                 f"{', '.join(sorted(known))})")


def _sizes(hyper: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in hyper.items() if isinstance(v, int | float) and not isinstance(v, bool))


def _build(training: Any, method: str, shape: ModelShape, hyper: dict[str, Any], *, meta: bool) -> Any:
    try:
        if not meta:
            return training.build_modules(shape, hyper)
        with torch.device("meta"):
            return training.build_modules(shape, hyper)
    except ZoomKVError:
        raise
    except (NotImplementedError, RuntimeError) as err:
        if meta and (isinstance(err, NotImplementedError) or "meta" in str(err)):
            return None  # the builder reads tensor data: it cannot be planned without memory
        raise AdapterConfigError(f"{method} adapter: hyper-parameters that build no modules ({_first_line(err)}; "
                                 f"{_sizes(hyper)})") from err
    except (TypeError, ValueError, OverflowError) as err:
        raise AdapterConfigError(f"{method} adapter: invalid hyper-parameters ({_first_line(err)}; "
                                 f"{_sizes(hyper)})") from err


def _first_line(err: BaseException) -> str:
    """torch's errors carry a C++ stack after their first line: the message is that line."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


class ZoomAdapter:
    """A trained method's modules and the config that rebuilds and checks them: the artefact a user loads.

        adapter = ZoomAdapter.from_pretrained("checkpoints/NAME")    # a folder, a training checkpoint or a Hub id
        cache = cache_from_adapter(model, adapter)                   # a ZoomCache running it at its budget

    ``from_pretrained`` verifies the weights' checksum, their shapes and identity before anything runs;
    ``attach(model)`` refuses another base model, naming both; ``make_method()`` is the KV method holding the
    modules; ``save_pretrained`` / ``push_to_hub`` write the PEFT-style folder (config, safetensors, model card).
    ``config`` is the ``ZoomAdapterConfig``, ``modules`` the ``nn.Module``."""

    def __init__(self, config: ZoomAdapterConfig, modules: torch.nn.Module):
        self.config = config
        self.modules = modules

    def __repr__(self) -> str:
        n = sum(p.numel() for p in self.modules.parameters())
        return f"ZoomAdapter(method={self.config.method!r}, base={self.config.base_model.get('name')!r}, params={n})"

    # -- making one -------------------------------------------------------------------------------------
    @classmethod
    def initialise(cls, model: torch.nn.Module, method: str, hyper: dict[str, Any] | None = None, *,
                   budget: str | int | float | None = None, name: str | None = None,
                   revision: str | None = None) -> ZoomAdapter:
        """A fresh adapter for ``model`` (the training loop's starting point)."""
        hyper = dict(hyper or {})
        shape = ModelShape.from_model(model)
        modules = build_adapter_modules(method, shape, hyper)
        return cls.from_modules(modules, method, hyper, shape=shape,
                                fingerprint=base_fingerprint(model, name=name, revision=revision), budget=budget)

    @classmethod
    def from_modules(cls, modules: torch.nn.Module, method: str, hyper: dict[str, Any], *, shape: ModelShape,
                     fingerprint: dict[str, Any], budget: str | int | float | None = None) -> ZoomAdapter:
        """An adapter of these modules (the trainer's result): its config records the method, hyper-parameters, shape and base model."""
        trainable = sum(p.numel() for p in modules.parameters() if p.requires_grad)
        fraction = trainable / shape.num_parameters if shape.num_parameters else None
        config = ZoomAdapterConfig(method=method, hyper=dict(hyper), base_model=dict(fingerprint),
                                   shape=shape.to_dict(), budget=budget, trainable_fraction=fraction)
        try:  # through JSON now, so a hyper-parameter JSON cannot hold fails here and not at export
            data = json.loads(config.to_json())
        except (TypeError, ValueError) as err:
            raise AdapterConfigError(f"{method} adapter: hyper-parameters must be JSON values ({err})") from err
        return cls(ZoomAdapterConfig.from_dict(data, source=f"{method} adapter"), modules)

    @classmethod
    def from_config_and_tensors(cls, config: ZoomAdapterConfig, tensors: dict[str, torch.Tensor],
                                source: str = "adapter") -> ZoomAdapter:
        """Rebuild the modules ``config`` describes and load ``tensors`` into them (names and shapes checked)."""
        if tensors and all(k.startswith(PEFT_WEIGHTS_PREFIX) for k in tensors):  # saved by PeftModel
            tensors = {k.removeprefix(PEFT_WEIGHTS_PREFIX): v for k, v in tensors.items()}
        modules = build_adapter_modules(config.method, config.model_shape(), dict(config.hyper), tensors,
                                        source=source)
        load_into(modules, tensors, source=source)
        modules.eval()
        return cls(config, modules)

    # -- loading and saving -----------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, name_or_path: str | Path, *, revision: str | None = None,
                        token: str | bool | None = None, local_files_only: bool | None = None,
                        model: torch.nn.Module | None = None, unrecorded_identity_ok: bool = False) -> ZoomAdapter:
        """Load from an adapter folder, a training checkpoint folder (``checkpoints/step_N``) or a Hub id
        (through the local Hub cache; offline: only the cache). With ``model``, also check the adapter fits it.
        The one loader: ``--adapter``, ``zoomkv export``, ``init_adapter`` and PEFT all come through here.
        ``unrecorded_identity_ok``: weights that record no identity load on the config's word (``zoomkv export
        --stamp-identity``, which writes them again with one); otherwise they are refused."""
        local = Path(name_or_path).expanduser() if isinstance(name_or_path, str | Path) else None
        if local is not None and local.is_dir() and is_checkpoint(local):
            meta, shape, tensors = read_checkpoint(local)
            modules = build_adapter_modules(meta["method"], shape, dict(meta["hyper"]), tensors,
                                            source=str(local / STATE_NAME))
            load_into(modules, tensors, source=str(local / STATE_NAME))
            check_identity(read_identity(local / STATE_NAME), weights_identity(meta["method"], meta["hyper"],
                                                                                meta["base_model"]),
                           str(local / STATE_NAME), str(local / META_NAME), unrecorded_ok=unrecorded_identity_ok)
            adapter = cls.from_modules(modules, meta["method"], meta["hyper"], shape=shape,
                                       fingerprint=meta["base_model"], budget=meta.get("budget"))
        else:
            folder = resolve_adapter(name_or_path, revision=revision, token=token, local_files_only=local_files_only)
            config = ZoomAdapterConfig.from_json_file(folder / CONFIG_NAME)
            tensors = read_weights(folder / WEIGHTS_NAME, config.weights_sha256, recorded_in=str(folder / CONFIG_NAME))
            adapter = cls.from_config_and_tensors(config, tensors, source=str(folder / WEIGHTS_NAME))
            # after the config's own checks (sizes, names): then whether the weights are this config's at all
            check_identity(read_identity(folder / WEIGHTS_NAME), config.weights_identity(), str(folder / WEIGHTS_NAME),
                           str(folder / CONFIG_NAME), unrecorded_ok=unrecorded_identity_ok)
        if model is not None:
            adapter.check_base(model)
        return adapter

    def serialise(self, scores: dict[str, Any] | None = None, *, license: str | None = None) -> dict[str, bytes]:
        """The folder's files, in write order (the config records the weights' checksum)."""
        weights = tensors_to_bytes(module_tensors(self.modules), self.config.weights_identity())
        self.config = dataclasses.replace(self.config, weights_sha256=sha256(weights))
        return {
            WEIGHTS_NAME: weights,
            CARD_NAME: render_card(self.config, scores, license=license).encode("utf-8"),
            CONFIG_NAME: self.config.to_json().encode("utf-8"),
        }

    def save_pretrained(self, out: str | Path, *, scores: dict[str, Any] | None = None,
                        overwrite: bool = False, license: str | None = None) -> Path:
        """Write the adapter folder; ``scores`` (``load_scores``) and ``license`` (a Hub licence id) go on its card."""
        return write_folder_atomically(out, self.serialise(scores, license=license), overwrite=overwrite)

    def push_to_hub(self, repo_id: str, *, scores: dict[str, Any] | None = None, private: bool | None = None,
                    token: str | None = None, revision: str | None = None, commit_message: str | None = None,
                    endpoint: str | None = None) -> str:
        """Upload the adapter folder (config, weights, card with ``scores``) to the Hub repository ``repo_id``; its URL."""
        with tempfile.TemporaryDirectory(prefix="zoomkv-push-") as tmp:
            folder = self.save_pretrained(Path(tmp) / "adapter", scores=scores)
            return push_folder(folder, repo_id, private=private, token=token, revision=revision,
                               commit_message=commit_message, endpoint=endpoint)

    # -- using it ---------------------------------------------------------------------------------------
    def check_base(self, model: Any, *, strict_name: bool = False) -> None:
        """Raise ``BaseModelMismatchError`` unless ``model`` is the base model this adapter was trained on."""
        check_base_model(self.config.base_model, model, strict_name=strict_name)

    def attach(self, model: torch.nn.Module) -> torch.nn.Module:
        """Check the base model, put the modules on its device and route its attention through zoomkv."""
        self.check_base(model)
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self.modules.to(device)  # the method holds these very modules (make_method): they move with it
        return attach(model)

    def make_method(self, **overrides: Any) -> Any:
        """The KV method object with this adapter's hyper-parameters (``overrides`` on top) and its modules.

        Hyper-parameters that are fields of the method's config go to the method; the rest only size the
        modules. The method's registered training puts the modules into it (``MethodTraining.with_modules``),
        as it does for the trainer.
        """
        name = self.config.method
        if name not in METHODS:
            raise ConfigError(f"adapter method {name!r} is not a registered KV method")
        cls = METHODS[name]
        fields = dataclasses.fields(cls.config_class)
        paths = sorted(f.name for f in fields if f.metadata.get("path") and self.config.hyper.get(f.name) is not None)
        if paths:  # an adapter's weights are its own folder's: a config value is never followed as a path
            raise AdapterConfigError(f"{name} adapter: hyper-parameter(s) {paths} name a file; an adapter "
                                     "config may not point outside its folder")
        kwargs = {k: v for k, v in self.config.hyper.items() if k in {f.name for f in fields}}
        return get_training(name).with_modules(cls.make_config(**{**kwargs, **overrides}), self.modules)


def cache_from_adapter(model: torch.nn.Module, adapter: ZoomAdapter | str | Path,
                       budget: str | int | float | None = None, *, tokenizer: Any = None,
                       **method_overrides: Any) -> Any:
    """A ``ZoomCache`` running the adapter's method with its modules (budget: the adapter's own when None)."""
    if not isinstance(adapter, ZoomAdapter):
        adapter = ZoomAdapter.from_pretrained(adapter)
    adapter.attach(model)
    if budget is None:
        budget = adapter.config.budget
    return ZoomCache(model, adapter.make_method(**method_overrides), budget, tokenizer=tokenizer)
