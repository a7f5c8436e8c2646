"""The zoomkv adapter as a PEFT method: ``get_peft_model``, ``PeftModel.from_pretrained``,
``save_pretrained`` and ``push_to_hub`` work on it.

    import zoomkv                                         # registers the PEFT method once peft is imported
    peft_model = PeftModel.from_pretrained(model, "out")  # a folder written by `zoomkv export` (or PEFT's save)
    peft_model.generate(**inputs, max_new_tokens=32)      # compresses: a ZoomCache at the adapter's budget

    from zoomkv.adapters.peft_integration import ZoomKVPeftConfig, cache_from_peft
    peft_model = get_peft_model(model, ZoomKVPeftConfig.for_model(model, "sekv", hyper, budget=256))
    peft_model.save_pretrained("out")                     # adapter_config.json + adapter_model.safetensors
    peft_model.generate(**inputs, **generate_cache_kwargs(cache_from_peft(peft_model, budget=64)))  # another B
    peft_model.get_base_model().generate(**inputs)       # plain attention, the base model alone

``generate()`` on a PEFT model whose active adapter is a zoomkv adapter builds a fresh ``ZoomCache`` running
it at the budget its config records (``budget``), one per call; a cache passed to ``generate`` is used as
given; an adapter config without a budget makes ``generate`` say how to pass one. ``forward`` (no cache) is
the base model's.

What PEFT 0.21 really offers and where it does not fit (see ``register`` and ``ZoomKVTuner``):

* ``peft.utils.register_peft_method(name=, config_cls=, model_cls=, prefix=)`` only accepts names that are
  already members of the closed ``PeftType`` enum; third-party methods cannot register without a new
  member. ``register`` adds ``PeftType.ZOOMKV`` to the enum (its three lookup tables), then calls
  ``register_peft_method`` as documented. This is the one piece that relies on enum internals.
* PEFT tuners inject by replacing target ``nn.Linear``/``Embedding`` layers and change the forward pass.
  A zoomkv adapter changes neither: its modules are read by a KV method inside the cache's attention
  function. So the tuner targets nothing; it holds the modules in a model-level ``ModuleDict``
  (``zoomkv_modules``, keyed by adapter name, as VeRA keeps ``vera_A``) that PEFT's structural state-dict
  code saves and loads, and the PeftModel's forward is the base model's. Generation goes through a
  ``ZoomCache`` built by ``cache_from_peft``: PEFT enters the tuner's ``_enable_peft_forward_hooks`` around
  ``PeftModel.generate`` (what LoRA uses for ``adapter_names``), and there the base model's ``generate`` is
  wrapped, for that call only, to add the cache when none is given.
* PEFT loads with ``load_state_dict(strict=False)``: a missing tensor would leave random weights in
  place silently. ``ZoomKVTuner._remap_adapter_state_dict_for_load`` checks keys and shapes first and
  raises the same errors as ``ZoomAdapter.from_pretrained``. PEFT falls back to ``torch.load`` for an
  ``adapter_model.bin``; ``ZoomKVPeftConfig.from_pretrained`` refuses folders without the safetensors file,
  so nothing is unpickled.
* The checksum: ``ZoomKVPeftConfig.save_pretrained`` records ``weights_sha256`` (PEFT writes the weights
  first); ``ZoomKVPeftConfig.from_pretrained``, which every PEFT load path calls, reads the weights and
  verifies them (a missing checksum is refused), and the tuner accepts only exactly those tensors.

* The card: PEFT's ``save_pretrained`` makes a generic card from a template, and transformers'
  ``push_to_hub`` writes another over it between saving and uploading. ``ZoomKVPeftConfig.save_pretrained``
  replaces PEFT's template card with zoomkv's (a user's own card is left alone), and ``register`` wraps
  ``PeftModel.push_to_hub`` so that a model whose active adapter is a zoomkv adapter uploads what
  ``save_pretrained`` wrote, as ``zoomkv push`` does; any other PEFT model pushes through PEFT unchanged.

One folder format serves both: ``zoomkv export`` writes ``peft_type: ZOOMKV`` into
``adapter_config.json`` (PEFT reads it), and ``ZoomAdapter`` accepts PEFT's extra config keys and its
``base_model.zoomkv_modules.`` weight-key prefix.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from peft import PeftConfig, PeftModel
from peft.tuners.tuners_utils import BaseTuner, BaseTunerLayer
from peft.utils import PeftType

from zoomkv.adapters.card import CARD_HEADING, render_card
from zoomkv.adapters.config import (
    CARD_NAME,
    CONFIG_NAME,
    FORMAT_VERSION,
    LIBRARY_NAME,
    PEFT_TASK_TYPE,
    PEFT_TYPE,
    PEFT_WEIGHTS_PREFIX,
    WEIGHTS_NAME,
    ZoomAdapterConfig,
    read_json_file,
)
from zoomkv.adapters.errors import (
    AdapterError,
    AdapterKeysError,
    AdapterNotFoundError,
    AdapterShapeError,
    AdapterWeightsError,
    BaseModelMismatchError,
)
from zoomkv.adapters.model import ZoomAdapter, build_adapter_modules, cache_from_adapter, fingerprint_diff
from zoomkv.adapters.weights import read_weights, sha256, stamp_identity
from zoomkv.atomic import write_file_atomically
from zoomkv.compat import cache_kwarg, generate_cache_kwargs
from zoomkv.models.registry import hub_name
from zoomkv.protocol.shape import ModelShape, base_fingerprint

PEFT_NAME = "zoomkv"
PEFT_TYPE_VALUE = PEFT_TYPE
PREFIX = "zoomkv_"
CONTAINER = "zoomkv_modules"
CHECKPOINT_PREFIX = PEFT_WEIGHTS_PREFIX
# The heading of the card PEFT makes from huggingface_hub's empty template when a folder has none.
_PEFT_TEMPLATE_HEADING = "# Model Card for Model ID"
assert CHECKPOINT_PREFIX == f"base_model.{CONTAINER}."


def _extend_peft_type() -> PeftType:
    """Add ``ZOOMKV`` to PEFT's closed ``PeftType`` enum (str-valued), the way Enum creates members."""
    if PEFT_TYPE_VALUE in PeftType.__members__:
        return PeftType[PEFT_TYPE_VALUE]
    member = str.__new__(PeftType, PEFT_TYPE_VALUE)
    member._name_ = PEFT_TYPE_VALUE
    member._value_ = PEFT_TYPE_VALUE
    member.__objclass__ = PeftType
    PeftType._member_map_[PEFT_TYPE_VALUE] = member
    PeftType._value2member_map_[PEFT_TYPE_VALUE] = member
    PeftType._member_names_.append(PEFT_TYPE_VALUE)
    type.__setattr__(PeftType, PEFT_TYPE_VALUE, member)  # EnumType.__setattr__ refuses new members
    assert PeftType(PEFT_TYPE_VALUE) is member and isinstance(member, enum.Enum)
    return member


@dataclass
class ZoomKVPeftConfig(PeftConfig):
    """PEFT's view of ``adapter_config.json``: the same fields as ``ZoomAdapterConfig`` plus PEFT's own."""

    method: str = ""
    hyper: dict[str, Any] = field(default_factory=dict)
    base_model: dict[str, Any] = field(default_factory=dict)
    shape: dict[str, Any] = field(default_factory=dict)
    budget: str | int | float | None = None
    trainable_fraction: float | None = None
    weights_sha256: str | None = None
    format_version: int = FORMAT_VERSION
    toolkit_version: str = ""
    library_name: str = LIBRARY_NAME

    def __post_init__(self) -> None:
        super().__post_init__()
        self.peft_type = PeftType[PEFT_TYPE_VALUE]
        # A zoomkv adapter is always a causal LM's: configs written before the task type was recorded load as
        # PeftModelForCausalLM too (AutoPeftModelForCausalLM, pipeline("text-generation")).
        self.task_type = self.task_type or PEFT_TASK_TYPE
        # An adapter written before the Hub id was the one name holds the registered name (smollm2-135m):
        # AutoPeftModelForCausalLM loads base_model_name_or_path, so it gets the Hub id the weights come from.
        self.base_model_name_or_path = hub_name(self.base_model_name_or_path)
        if isinstance(self.base_model.get("name"), str):
            self.base_model = {**self.base_model, "name": hub_name(self.base_model["name"])}

    @classmethod
    def for_model(cls, model: torch.nn.Module, method: str, hyper: dict[str, Any] | None = None, *,
                  budget: str | int | float | None = None, name: str | None = None) -> ZoomKVPeftConfig:
        """The config of a fresh adapter for ``model`` (what ``get_peft_model`` needs)."""
        shape = ModelShape.from_model(model)
        fingerprint = base_fingerprint(model, name=name)
        config = cls.from_zoom_config(ZoomAdapterConfig(method=method, hyper=dict(hyper or {}), base_model=fingerprint,
                                                        shape=shape.to_dict(), budget=budget))
        # get_peft_model sets its own (the model's name_or_path, a conversion folder for a GGUF model) and warns
        # when it replaces one; save_pretrained writes the base model's name in its place.
        config.base_model_name_or_path = None
        return config

    @classmethod
    def from_zoom_config(cls, config: ZoomAdapterConfig) -> ZoomKVPeftConfig:
        data = config.to_dict()
        return cls(base_model_name_or_path=config.base_model.get("name"), task_type=PEFT_TASK_TYPE, **data)

    def to_zoom_config(self) -> ZoomAdapterConfig:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(ZoomAdapterConfig)}
        data["weights_sha256"] = None  # PEFT writes the weights itself, after this config
        return ZoomAdapterConfig.from_dict(data, source="PEFT adapter config")

    def save_pretrained(self, save_directory: str, **kwargs: Any) -> None:
        """PEFT's ``save_pretrained`` writes the weights, then this config: record the weights' checksum in it,
        as ``zoomkv export`` does, so every loader can verify them."""
        weights = Path(save_directory) / WEIGHTS_NAME
        if weights.is_file():
            # PEFT's file records no identity: stamped with this config's, as zoomkv's own exports are, so every
            # loader can tell these weights are the ones this config describes
            stamp_identity(weights, self.to_zoom_config().weights_identity())
            self.weights_sha256 = sha256(weights.read_bytes())
        # The one name of the base model, as `zoomkv export` writes it (the Hub id of a registered model), not
        # the folder PEFT found in the model's name_or_path.
        self.base_model_name_or_path = hub_name(self.base_model.get("name")) or self.base_model_name_or_path
        super().save_pretrained(save_directory, **kwargs)
        self._write_card(Path(save_directory))

    def _write_card(self, folder: Path) -> None:
        """zoomkv's model card, as `zoomkv export` writes it, in place of the generic one PEFT's save_pretrained
        has just made from its empty template (``library_name: peft``, "Model Card for Model ID"), so
        ``PeftModel.push_to_hub`` and ``zoomkv push`` publish the same repository. A card of the user's (PEFT
        only adds its tags to one) is left as it is."""
        card = folder / CARD_NAME
        if card.is_file():
            text = card.read_text(encoding="utf-8", errors="replace")
            if _PEFT_TEMPLATE_HEADING not in text and CARD_HEADING not in text:
                return
        config = dataclasses.replace(self.to_zoom_config(), weights_sha256=self.weights_sha256)
        text = render_card(config)
        write_file_atomically(card, lambda tmp: tmp.write_text(text, encoding="utf-8"))  # never half a card

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str, subfolder: str | None = None,
                        **kwargs: Any) -> ZoomKVPeftConfig:
        """The config, and the weights next to it read and verified against its ``weights_sha256`` (refused
        when it is missing or differs; never an ``adapter_model.bin``). Every PEFT load path
        (``PeftModel.from_pretrained``, ``load_adapter``) reads the config here; the tuner then checks that
        the tensors PEFT loads are exactly these (``_remap_adapter_state_dict_for_load``)."""
        config = super().from_pretrained(pretrained_model_name_or_path, subfolder=subfolder, **kwargs)
        local = Path(pretrained_model_name_or_path) / (subfolder or "")
        if local.is_dir():
            weights = local / WEIGHTS_NAME
        else:
            from huggingface_hub import hf_hub_download

            try:
                weights = Path(hf_hub_download(pretrained_model_name_or_path, WEIGHTS_NAME, subfolder=subfolder,
                                               **cls._split_kwargs(kwargs)[0]))
            except Exception as err:  # the Hub's many errors: not found, offline, no access
                raise AdapterNotFoundError(f"PEFT adapter {pretrained_model_name_or_path!r}: no {WEIGHTS_NAME} "
                                           f"(pickled adapter_model.bin files are never loaded): {err}") from err
        if not weights.is_file():
            raise AdapterNotFoundError(f"{weights.parent}: no {WEIGHTS_NAME} (pickled adapter_model.bin files are "
                                       "never loaded)")
        if (weights.parent / CONFIG_NAME).is_file():  # PEFT's reader keeps the last of a key given twice
            read_json_file(weights.parent / CONFIG_NAME)
        tensors = read_weights(weights, config.weights_sha256, recorded_in=f"{weights.parent / CONFIG_NAME}",
                               identity=config.to_zoom_config().weights_identity())
        config._zoomkv_verified = _plain_keys(tensors)
        return config


class ZoomKVLayer(BaseTunerLayer):
    """Never instantiated: the tuner wraps no layer. PEFT needs the class for its isinstance checks."""

    adapter_layer_names = (CONTAINER,)


class ZoomKVModules(torch.nn.ModuleDict, BaseTunerLayer):
    """The adapters' modules by name, the tuner's one container. It is a tuner layer only so that PEFT's
    layer walk (``get_model_status``, which ``PeftModel.disable_adapter()`` consults) finds the tuner and its
    on/off state; it wraps no layer and names no adapter tensors of its own."""

    adapter_layer_names = ()


class ZoomKVTuner(BaseTuner):
    prefix = PREFIX
    tuner_layer_cls = ZoomKVLayer

    def inject_adapter(self, model: torch.nn.Module, adapter_name: str, autocast_adapter_dtype: bool = True,
                       low_cpu_mem_usage: bool = False, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        config = self.peft_config[adapter_name]
        zoom = config.to_zoom_config()
        actual = base_fingerprint(model)
        diff = fingerprint_diff(zoom.base_model, actual)
        if diff:
            raise BaseModelMismatchError(zoom.base_model, actual, diff)
        # Against the verified weights (PeftModel.from_pretrained) before anything is allocated.
        verified = getattr(config, "_zoomkv_verified", None)
        modules = build_adapter_modules(zoom.method, zoom.model_shape(), dict(zoom.hyper), verified,
                                        source=f"PEFT adapter {adapter_name!r}")
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        for p in model.parameters():  # the base model is frozen: only the adapter trains
            p.requires_grad_(False)
        if CONTAINER not in self._modules:
            # Created here, not in __init__: BaseTuner.__init__ resets the module (nn.Module.__init__) and
            # then calls inject_adapter.
            self.zoomkv_modules = ZoomKVModules()
        self.zoomkv_modules[adapter_name] = modules.to(device)
        if config.trainable_fraction is None and zoom.model_shape().num_parameters:
            trainable = sum(p.numel() for p in modules.parameters() if p.requires_grad)
            config.trainable_fraction = trainable / zoom.model_shape().num_parameters

    def _create_and_replace(self, *args: Any, **kwargs: Any) -> None:
        raise AdapterError("zoomkv adapters replace no layer (they act inside the KV cache)")

    def _mark_only_adapters_as_trainable(self, model: torch.nn.Module) -> None:
        for p in model.parameters():
            p.requires_grad_(False)

    def _prepare_adapter_config(self, peft_config: PeftConfig, model_config: dict) -> PeftConfig:
        return peft_config

    def set_adapter(self, adapter_name: str | list[str], inference_mode: bool = False) -> None:
        self.active_adapter = adapter_name

    def disable_adapter_layers(self) -> None:
        self._zoomkv_disabled = True  # generate() then adds no cache: plain attention
        self.zoomkv_modules._disable_adapters = True  # what PEFT's status reads

    def enable_adapter_layers(self) -> None:
        self._zoomkv_disabled = False
        self.zoomkv_modules._disable_adapters = False

    @contextlib.contextmanager
    def _enable_peft_forward_hooks(self, *args: Any, **kwargs: Any) -> Iterator[None]:
        """Around ``PeftModel.generate`` (and ``forward``): the base model's ``generate`` adds a ``ZoomCache``
        running the active adapter at its config's budget when the call passes no cache."""
        model = self.model
        if getattr(self, "_zoomkv_disabled", False) or "generate" in vars(model):
            yield  # disabled, or already inside a wrapped call
            return
        original = model.generate

        def generate(*gen_args: Any, **gen_kwargs: Any) -> Any:
            names = {cache_kwarg(), "past_key_values", "cache"}
            if gen_kwargs.get("use_cache") is not False and all(gen_kwargs.get(n) is None for n in names):
                gen_kwargs.update(generate_cache_kwargs(self._default_cache()))
            return original(*gen_args, **gen_kwargs)

        model.generate = generate  # an instance attribute, for this call only
        try:
            yield
        finally:
            del model.generate

    def _default_cache(self) -> Any:
        name = self.active_adapter if isinstance(self.active_adapter, str) else self.active_adapter[0]
        config = self.peft_config[name]
        adapter = ZoomAdapter(config.to_zoom_config(), self.modules_for(name))
        if adapter.config.budget is None:
            raise AdapterError(
                f"zoomkv adapter {name!r} records no budget, so generate() cannot build its cache: pass one, "
                "peft_model.generate(**inputs, **generate_cache_kwargs(cache_from_peft(peft_model, budget=256))), "
                "or set ZoomKVPeftConfig(budget=...)"
            )
        return cache_from_adapter(self.model, adapter)

    def modules_for(self, adapter_name: str | None = None) -> torch.nn.Module:
        name = adapter_name or (self.active_adapter if isinstance(self.active_adapter, str) else self.active_adapter[0])
        return self.zoomkv_modules[name]

    @classmethod
    def _remove_adapter_name_from_key(cls, key: str, adapter_name: str) -> str:
        return key.replace(f"{CONTAINER}.{adapter_name}.", f"{CONTAINER}.", 1)

    @classmethod
    def _remap_adapter_state_dict_for_load(cls, model: torch.nn.Module, config: PeftConfig, adapter_name: str,
                                           state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Checkpoint keys → model keys, strictly. Accepts PEFT's keys (``base_model.zoomkv_modules.x``) and a
        zoomkv export's plain module keys (``x``)."""
        tuner = getattr(model, "base_model", model)
        own = tuner.zoomkv_modules[adapter_name].state_dict()
        plain = _plain_keys(state_dict)
        verified = getattr(config, "_zoomkv_verified", None)
        if verified is None:
            raise AdapterWeightsError(
                f"PEFT adapter {adapter_name!r}: its weights were not verified against the config's weights_sha256; "
                "load it with PeftModel.from_pretrained(model, folder) or load_adapter(folder, name) without config="
            )
        if plain.keys() != verified.keys() or any(not torch.equal(v.cpu(), verified[k]) for k, v in plain.items()):
            raise AdapterWeightsError(f"PEFT adapter {adapter_name!r}: the weights PEFT loaded are not the ones "
                                      "verified against the config's checksum (the file changed while loading?)")
        missing = sorted(set(own) - set(plain))
        unexpected = sorted(set(plain) - set(own))
        if missing or unexpected:
            raise AdapterKeysError(f"PEFT adapter {adapter_name!r}: missing {missing}, unexpected {unexpected}")
        wrong = [f"{k}: file {tuple(v.shape)} vs modules {tuple(own[k].shape)}" for k, v in plain.items()
                 if tuple(v.shape) != tuple(own[k].shape)]
        if wrong:
            raise AdapterShapeError(f"PEFT adapter {adapter_name!r}: wrong shape(s): {'; '.join(wrong)}")
        return {f"base_model.{CONTAINER}.{adapter_name}.{k}": v for k, v in plain.items()}


def _plain_keys(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Module keys as ``ZoomAdapter`` names them, from PEFT's (``base_model.zoomkv_modules.x``) or plain ones."""
    prefix = CHECKPOINT_PREFIX if any(k.startswith(CHECKPOINT_PREFIX) for k in state_dict) else ""
    return {k.removeprefix(prefix): v for k, v in state_dict.items() if not prefix or k.startswith(prefix)}


def register() -> None:
    """Make ``zoomkv`` a PEFT method (idempotent)."""
    from peft.mapping import PEFT_TYPE_TO_TUNER_MAPPING
    from peft.utils import register_peft_method

    peft_type = _extend_peft_type()
    if not getattr(PeftModel.push_to_hub, "_zoomkv", False):
        PeftModel.push_to_hub = _push_to_hub_wrapper(PeftModel.push_to_hub)
    if PEFT_TYPE_TO_TUNER_MAPPING.get(peft_type) is ZoomKVTuner:
        return
    register_peft_method(name=PEFT_NAME, config_cls=ZoomKVPeftConfig, model_cls=ZoomKVTuner, prefix=PREFIX)


def _push_to_hub_wrapper(original: Any) -> Any:
    """``PeftModel.push_to_hub`` (transformers' ``PushToHubMixin``) writes its own card over the one
    ``save_pretrained`` wrote (``library_name: transformers`` from a template) after saving and before uploading,
    with no hook in between. For a PEFT model whose active adapter is a zoomkv adapter, push what
    ``save_pretrained`` writes, zoomkv's card included, as ``zoomkv push`` does: the same repository either way.
    Every other PEFT model goes through PEFT's own ``push_to_hub`` unchanged."""

    @functools.wraps(original)
    def push_to_hub(self: PeftModel, repo_id: str, *args: Any, commit_message: str | None = None,
                    private: bool | None = None, token: bool | str | None = None, revision: str | None = None,
                    create_pr: bool = False, **kwargs: Any) -> Any:
        name = self.active_adapter if isinstance(self.active_adapter, str) else None
        if args or name is None or not isinstance(self.peft_config.get(name), ZoomKVPeftConfig):
            return original(self, repo_id, *args, commit_message=commit_message, private=private, token=token,
                            revision=revision, create_pr=create_pr, **kwargs)
        from zoomkv.adapters.hub import push_folder

        with tempfile.TemporaryDirectory(prefix="zoomkv-peft-push-") as tmp:
            self.save_pretrained(tmp, selected_adapters=[name])
            folder = Path(tmp) if name == "default" else Path(tmp) / name  # where PEFT saves that adapter
            return push_folder(folder, repo_id, private=private, token=token if isinstance(token, str) else None,
                               revision=revision, commit_message=commit_message, create_pr=create_pr)

    push_to_hub._zoomkv = True  # type: ignore[attr-defined]
    return push_to_hub


def adapter_from_peft(peft_model: PeftModel, adapter_name: str | None = None) -> ZoomAdapter:
    name = adapter_name or peft_model.active_adapter
    config = peft_model.peft_config[name]
    if not isinstance(config, ZoomKVPeftConfig):
        raise AdapterError(f"PEFT adapter {name!r} is a {type(config).__name__}, not a zoomkv adapter")
    return ZoomAdapter(config.to_zoom_config(), peft_model.base_model.modules_for(name))


def cache_from_peft(peft_model: PeftModel, budget: str | int | float | None = None, *,
                    adapter_name: str | None = None, tokenizer: Any = None, **method_overrides: Any) -> Any:
    """A ``ZoomCache`` for ``peft_model.generate`` running the active zoomkv adapter."""
    adapter = adapter_from_peft(peft_model, adapter_name)
    return cache_from_adapter(peft_model.get_base_model(), adapter, budget, tokenizer=tokenizer, **method_overrides)


def load_peft_adapter(model: torch.nn.Module, folder: str | Path, **kwargs: Any) -> PeftModel:
    """``PeftModel.from_pretrained`` for a local zoomkv adapter folder, refusing pickled weights."""
    folder = Path(folder)
    if folder.is_dir() and not (folder / WEIGHTS_NAME).is_file():
        raise AdapterError(f"{folder}: no {WEIGHTS_NAME} (pickled adapter_model.bin files are never loaded)")
    return PeftModel.from_pretrained(model, str(folder), **kwargs)


register()
