"""Training recipes: flat YAML (first comment line = the command that runs it) + ``key=value`` overrides.

Everything is checked before any model is loaded: an unknown key, a value of the wrong type or a file that
does not exist raises ``ConfigError`` naming the key and what would be valid.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from zoomkv.data.haystack import Haystack, text_haystack
from zoomkv.data.training import parse_task_mix
from zoomkv.errors import ConfigError, ZoomKVError
from zoomkv.models.device import DTYPES
from zoomkv.protocol.method import coerce_number, value_fits
from zoomkv.protocol.registry import TRAINING, get_training
from zoomkv.protocol.training import MethodTraining


@dataclass
class TrainConfig:
    # what to train: a trainable method (zoomkv methods); its own recipe keys are listed by its recipe class
    # (MethodTraining.recipe_class) and land in `options`
    model: str = "smollm2-135m"  # a zoomkv model name, a local folder, or a name in KNOWN_CONFIGS (dry-run only)
    dtype: str = "float32"  # the frozen model's dtype on the training device (bfloat16 on a GPU); the modules train in fp32
    random_weights: bool = False  # `model` a local folder (config.json + tokenizer) built with seeded random weights: timing only
    method: str = ""
    run_name: str = ""  # a plain folder name in output_dir (left out: the method's name)
    output_dir: str = "checkpoints"
    seed: int = 0
    max_trainable_fraction: float = 0.0005
    init_adapter: str = ""  # start from this adapter folder instead of a fresh one
    budget: int = 128  # rows per KV head the student is trained for
    recent: int = 8  # the newest rows, kept exact: teacher query positions lie before them
    # data: text from a corpus (any data source: a shipped corpus name, a folder of .txt/.md files, a JSONL /
    # Parquet / CSV file, a saved dataset or a Hub id; "" = generated filler sentences), cut to the lengths below,
    # with synthetic tasks inserted at the rates given by their weights (see zoomkv.data.training)
    data: str = "python-docs"
    data_split: str = "train"
    data_field: str = "text"  # the field of each record that holds its text
    tasks: str = "plain,passkey,kv,vartrack"  # task[:weight],...: plain, passkey, kv, vartrack, aggregate
    num_samples: int = 16
    min_length: int = 256  # length curriculum: sample lengths go from min_length to max_length
    max_length: int = 1024
    queries_per_sample: int = 8
    # "" = <output_dir>/<run_name>/teacher; a recipe file names a folder under the working folder, the command
    # line any folder; either way a new or empty folder, or a teacher cache zoomkv wrote
    teacher_cache: str = ""
    # optimisation
    steps: int = 100
    layers_per_step: int = 8  # layers sampled per step (all when 0)
    samples_per_step: int = 1  # samples per process and step (gradient accumulation); global batch x processes
    lr: float = 0.01
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    # comma-separated names of the method's trainable tensors held at their start (an ablation: what training
    # the others alone buys), e.g. "span_tau" for sekv; `zoomkv train --dry-run` lists the names
    freeze: str = ""
    # bookkeeping
    log_every: int = 10
    save_every: int = 50
    resume: str = ""  # "" (fresh), "latest", or a checkpoint folder
    # start the run over where it already has checkpoints or an adapter (they are removed first); without it
    # such a run folder is refused unless resumed
    overwrite: bool = False
    tensorboard: bool = True
    threads: int = 0  # torch intra-op threads (0: torch's default); 1 is fastest for these small ops on a busy CPU
    eval_samples: int = 4  # held-out samples scored (next-token KL vs full) with the fresh and trained adapter
    eval_baselines: str = ""  # training-free methods scored alongside at the same budget, e.g. "quest,clusterkv"
    kill_at_step: int = 0  # testing only: SIGKILL this process right after that step (resume tests)
    options: Any = None  # the method's own keys (its MethodTraining.recipe_class), set by load_recipe

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.run_name

    @property
    def cache_dir(self) -> Path:
        return Path(self.teacher_cache) if self.teacher_cache else self.run_dir / "teacher"

    @property
    def task_mix(self) -> dict[str, float]:
        """The recipe's tasks and their weights (``plain:2,passkey`` → {plain: 2, passkey: 1})."""
        return parse_task_mix(self.tasks)

    @property
    def training(self) -> MethodTraining:
        """The method's training (modules and objective), from the method registry."""
        return get_training(self.method)

    def to_dict(self) -> dict[str, Any]:
        """Flat, as a recipe is written: the generic keys, then the method's own."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "options"}
        if self.options is not None:
            out.update(dataclasses.asdict(self.options))
        return out


FILE_KEYS = ("init_adapter",)
MAX_STEPS = 10_000_000


def _check_type(key: str, value: Any, hint: Any, choices: dict[str, tuple[Any, ...]]) -> Any:
    allowed = typing.get_args(hint) or (hint,)
    value = coerce_number(hint, value, f"recipe key {key!r}")  # lr: 1e-3 arrives from YAML as the text '1e-3'
    if not value_fits(hint, value):
        names = " or ".join(a.__name__ for a in allowed)
        raise ConfigError(f"recipe key {key!r}: expected {names}, got {type(value).__name__} {value!r}")
    if isinstance(value, str) and key in choices and value not in choices[key]:
        others = [a.__name__ for a in allowed if a is not str]
        raise ConfigError(f"recipe key {key!r}: {value!r} is not valid; expected "
                          f"{' or '.join([*others, f'one of {list(choices[key])}'])}")
    if float in allowed and int not in allowed and isinstance(value, int):
        return float(value)  # an int where a float is expected
    return value


def parse_overrides(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"overrides are key=value, got {item!r}")
        key, value = item.split("=", 1)
        out[key.strip()] = _load_yaml(value, f"override {item!r}") if value.strip() else ""
    return out


class _UniqueKeys(yaml.SafeLoader):
    """``yaml.safe_load``'s loader, except that a key given twice in one mapping is an error: YAML's last value
    winning would silently drop the first (``lr: 0.01`` ... ``lr: 0.5`` trains at 0.5 without a word)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                first = seen.setdefault(key, key_node.start_mark)
            except TypeError:  # an unhashable key: the base loader says so
                continue
            if first is not key_node.start_mark:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first given on line {first.line + 1})", key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


def _load_yaml(text: str, where: str) -> Any:
    """``yaml.safe_load`` (a key given twice refused), its errors one ``ConfigError`` line naming ``where``, the
    problem and its place."""
    try:
        return yaml.load(text, Loader=_UniqueKeys)  # noqa: S506 (a SafeLoader)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        raise ConfigError(f"{where}: not valid YAML: {err.problem or err.context}{at}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{where}: not valid YAML: {str(err).splitlines()[0] if str(err) else err!r}") from None
    except RecursionError:
        raise ConfigError(f"{where}: nested too deeply for a recipe (a recipe is a flat key: scalar mapping)") from None


def load_recipe(path: str | Path | None, overrides: list[str] | dict[str, Any] | None = None) -> TrainConfig:
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"recipe file not found: {path}")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise ConfigError(f"{path}: not UTF-8 text (byte {err.start}); a recipe is a YAML file") from None
        loaded = _load_yaml(text, str(path)) or {}
        if not isinstance(loaded, dict) or any(isinstance(v, dict | list) for v in loaded.values()):
            raise ConfigError(f"{path}: a recipe is a flat YAML mapping of key: scalar")
        raw.update(loaded)
    from_file = dict(raw)
    raw.update(parse_overrides(overrides) if isinstance(overrides, list) else (overrides or {}))
    method = raw.get("method", "")
    if not isinstance(method, str) or method not in TRAINING:
        raise ConfigError(f"recipe key 'method': {method!r} is not a trainable method; expected one of "
                          f"{sorted(TRAINING)}")
    option_class = TRAINING[method].recipe_class
    hints = {k: v for k, v in typing.get_type_hints(TrainConfig).items() if k != "options"}
    option_hints = typing.get_type_hints(option_class)
    option_hints = {f.name: option_hints[f.name] for f in fields(option_class)}
    valid = [*hints, *option_hints]
    values: dict[str, Any] = {}
    options: dict[str, Any] = {}
    for key, value in raw.items():
        if key in hints:
            values[key] = _check_type(key, value, hints[key], {})
        elif key in option_hints:
            options[key] = _check_type(key, value, option_hints[key], option_class.choices)
        else:
            raise ConfigError(f"unknown recipe key {key!r}; valid keys: {', '.join(valid)} (for method {method!r})")
    values["options"] = option_class(**options)
    values.setdefault("run_name", method)
    cfg = TrainConfig(**values)
    for key in FILE_KEYS:
        value = getattr(cfg, key)
        if value and not Path(value).exists():
            raise ConfigError(f"recipe key {key!r}: file or folder not found: {value}")
        if value and key == "init_adapter" and not Path(value).is_dir():
            raise ConfigError(f"recipe key {key!r}: {value} is a file, not an adapter folder")
    try:
        mix = cfg.task_mix
    except ZoomKVError as err:
        raise ConfigError(f"recipe key 'tasks': {err}") from None
    if "plain" in mix and not cfg.data:
        raise ConfigError("recipe key 'tasks': 'plain' needs a corpus in recipe key 'data'")
    if cfg.min_length > cfg.max_length or cfg.min_length < 16:
        raise ConfigError(f"recipe keys 'min_length'/'max_length': need 16 <= min_length <= max_length, got "
                          f"{cfg.min_length}, {cfg.max_length}")
    if cfg.steps == 0 and not cfg.init_adapter:
        raise ConfigError("recipe key 'steps' must be >= 1 (0 only with init_adapter: its modules as they are, "
                          "exported with what is fitted after the steps, such as sekv's host_bits)")
    for key in ("steps", "num_samples", "queries_per_sample", "save_every", "log_every", "samples_per_step"):
        if getattr(cfg, key) < (0 if key == "steps" else 1):
            raise ConfigError(f"recipe key {key!r} must be >= 1, got {getattr(cfg, key)}")
    if cfg.steps > MAX_STEPS:  # steps: 1e30 would train (and checkpoint) without end
        raise ConfigError(f"recipe key 'steps' must be at most {MAX_STEPS:,} (weeks of training at the fastest "
                          f"this trainer steps: a longer run is a number mistyped), got {cfg.steps:,}")
    if cfg.samples_per_step > cfg.num_samples:  # a step of 1e9 micro-batches would run for ever
        raise ConfigError(f"recipe key 'samples_per_step' must be at most num_samples ({cfg.num_samples}: a step "
                          f"draws its samples from those), got {cfg.samples_per_step}")
    check_baselines(cfg.eval_baselines)
    check_ranges(cfg)
    check_paths(cfg, from_file)
    return cfg


def check_baselines(names: str) -> None:
    """``eval_baselines``: registered methods, checked at load (not after training, nor only when eval_samples
    makes them run)."""
    from zoomkv.protocol.registry import METHODS

    unknown = [n.strip() for n in names.split(",") if n.strip() and n.strip() not in METHODS]
    if unknown:
        raise ConfigError(f"recipe key 'eval_baselines': unknown method(s) {', '.join(map(repr, unknown))}; expected "
                          f"names from `zoomkv methods` ({', '.join(sorted(METHODS))})")


def check_paths(cfg: TrainConfig, from_file: dict[str, Any]) -> None:
    """Names from a recipe cannot point outside the run's folder: ``run_name`` is one plain folder name, and a
    recipe file's ``teacher_cache`` (a file written by someone else) a relative path that stays below the
    folder the command runs in; the command line (the user) may name any folder for it. What is in the folders
    is checked when the run starts (``checkpoints.check_run_folder``, ``teacher.check_cache_folder``)."""
    name = cfg.run_name
    if not name.strip() or name in (".", "..") or any(c in name for c in "/\\\0") or Path(name).is_absolute():
        raise ConfigError(f"recipe key 'run_name': {name!r} is not a folder name; name the run with letters, "
                          "digits, '-' or '_' (it is a folder in output_dir), or leave it out for the method's name")
    cache = from_file.get("teacher_cache")
    if isinstance(cache, str) and cache == cfg.teacher_cache and cache:
        parts = Path(cache).parts
        if Path(cache).is_absolute() or ".." in parts or cache.startswith("~"):
            raise ConfigError(f"recipe key 'teacher_cache': {cache!r} in a recipe file must be a folder below the "
                              "working folder (relative, no '..'); to use a cache elsewhere, give it on the "
                              "command line (teacher_cache=PATH)")
    if cfg.overwrite and cfg.resume:
        raise ConfigError(f"recipe keys 'overwrite' and 'resume': overwrite=true starts the run over, "
                          f"resume={cfg.resume} continues it; give one")


# The range of each numeric generic key (the method's own keys are checked by its recipe class). A value
# outside it (lr: .nan, a negative lr, budget: 0, threads: -2) is refused before any model loads.
RANGES: dict[str, tuple[str, Any]] = {
    # a step moves each weight by about lr: above 10 nothing trains, and lr: 1e3 is a slip for 1e-3
    "lr": ("a finite number > 0 and at most 10", lambda v: math.isfinite(v) and 0 < v <= 10),
    "weight_decay": ("a finite number >= 0", lambda v: math.isfinite(v) and v >= 0),
    "grad_clip": ("a finite number >= 0 (0: no clipping)", lambda v: math.isfinite(v) and v >= 0),
    "max_trainable_fraction": ("a number in (0, 1]", lambda v: 0 < v <= 1),
    "budget": (">= 1", lambda v: v >= 1),
    "recent": (">= 0", lambda v: v >= 0),
    "seed": ("0 to 2**32 - 1", lambda v: 0 <= v < 2**32),
    "layers_per_step": (">= 0 (0: all layers)", lambda v: v >= 0),
    "threads": ("0 to 4096 (0: torch's default)", lambda v: 0 <= v <= 4096),
    "eval_samples": (">= 0", lambda v: v >= 0),
    "kill_at_step": (">= 0", lambda v: v >= 0),
}


def check_ranges(cfg: TrainConfig) -> None:
    if cfg.dtype not in DTYPES:
        raise ConfigError(f"recipe key 'dtype' must be one of {', '.join(DTYPES)}, got {cfg.dtype!r}")
    for key, (what, ok) in RANGES.items():
        value = getattr(cfg, key)
        if not ok(value):
            raise ConfigError(f"recipe key {key!r} must be {what}, got {value!r}")
    try:  # the method's own settings as the trainer will build them (its config checks their ranges)
        cfg.training.method_config(cfg)
    except NotImplementedError:
        pass


def save_resolved(cfg: TrainConfig, folder: Path) -> None:
    (folder / "train_config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=True))


def load_corpus(cfg: TrainConfig) -> Haystack | None:
    """The recipe's ``data`` as one word stream (None: generated filler sentences)."""
    return text_haystack(cfg.data, field=cfg.data_field, split=cfg.data_split) if cfg.data else None
