"""Training recipes: flat YAML (first comment line = the command that runs it) + ``key=value`` overrides.

Everything is checked before any model is loaded: an unknown key, a value of the wrong type or a file that
does not exist raises ``ConfigError`` naming the key and what would be valid.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from zoomkv.errors import ConfigError


@dataclass
class TrainConfig:
    # what to train
    model: str = "smollm2-135m"  # a zoomkv model name, a local folder, or a name in KNOWN_CONFIGS (dry-run only)
    method: str = "sekv"
    run_name: str = "sekv"
    output_dir: str = "checkpoints"
    seed: int = 0
    max_trainable_fraction: float = 0.0005
    proj_dim: int | str = "auto"  # semantic projector width; "auto" sizes it under max_trainable_fraction
    share_projector: bool | str = "auto"
    r_max: int = 32
    init_adapter: str = ""  # start from this adapter folder instead of a fresh one
    # sekv's inference hyper-parameters, used to cut spans exactly as inference does
    budget: int = 128  # rows per KV head the student is trained for
    sinks: int = 4
    recent: int = 8
    chunk: int = 8
    min_span: int = 4
    max_span: int = 8
    anchor_fraction: float = 0.1
    # semantic_id's projector (method: semantic_id): its size, and the ID it is trained to hash into
    sem_dim: int = 16
    sem_hidden: int = 32
    id_bits: int = 6
    pair_rows: int = 192  # rows sampled per layer and step; every pair among them is a training pair
    # data (synthetic, generated offline with the model's tokenizer)
    tasks: str = "passkey,kv,vartrack"
    num_samples: int = 16
    min_length: int = 256  # length curriculum: sample lengths go from min_length to max_length
    max_length: int = 1024
    queries_per_sample: int = 8
    teacher_cache: str = ""  # "" = <output_dir>/<run_name>/teacher
    # optimisation
    steps: int = 100
    layers_per_step: int = 8  # layers sampled per step (all when 0)
    samples_per_step: int = 1  # samples per process and step (gradient accumulation); global batch x processes
    lr: float = 0.01  # thresholds and rank gates
    proj_lr: float = 0.001  # the semantic projector: it rescales logits, so it moves much more gently
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    rho: float = 0.9  # zoom supervision: the smallest span set covering rho of the teacher's span mass
    w_kl: float = 1.0
    w_out: float = 1.0
    w_zoom: float = 0.5
    w_route: float = 0.5  # listwise: the router's ranking of spans vs the teacher's span mass
    w_anchor: float = 0.1
    w_rank: float = 0.01
    w_budget: float = 0.1
    budget_ramp_steps: int = 50
    # bookkeeping
    log_every: int = 10
    save_every: int = 50
    resume: str = ""  # "" (fresh), "latest", or a checkpoint folder
    tensorboard: bool = True
    threads: int = 0  # torch intra-op threads (0: torch's default); 1 is fastest for these small ops on a busy CPU
    eval_samples: int = 4  # held-out samples scored (next-token KL vs full) with the fresh and trained adapter
    eval_baselines: str = ""  # training-free methods scored alongside at the same budget, e.g. "quest,clusterkv"
    kill_at_step: int = 0  # testing only: SIGKILL this process right after that step (resume tests)

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.run_name

    @property
    def cache_dir(self) -> Path:
        return Path(self.teacher_cache) if self.teacher_cache else self.run_dir / "teacher"

    @property
    def task_list(self) -> list[str]:
        return [t.strip() for t in self.tasks.split(",") if t.strip()]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def adapter_hyper(self) -> dict[str, Any]:
        return {"proj_dim": self.proj_dim, "share_projector": self.share_projector, "r_max": self.r_max,
                "max_trainable_fraction": self.max_trainable_fraction}

    def method_kwargs(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("sinks", "recent", "chunk", "min_span", "max_span", "anchor_fraction")}


TASKS = ("passkey", "kv", "vartrack")
CHOICES: dict[str, tuple[Any, ...]] = {"method": ("sekv", "semantic_id"), "proj_dim": ("auto",), "share_projector": ("auto",)}
FILE_KEYS = ("init_adapter",)


def _check_type(key: str, value: Any, hint: Any) -> Any:
    allowed = typing.get_args(hint) or (hint,)
    for t in allowed:
        if t is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if t is int and isinstance(value, bool):
            continue
        if isinstance(value, t):
            if isinstance(value, str) and key in CHOICES and value not in CHOICES[key]:
                others = [a.__name__ for a in allowed if a is not str]
                raise ConfigError(f"recipe key {key!r}: {value!r} is not valid; expected "
                                  f"{' or '.join([*others, f'one of {list(CHOICES[key])}'])}")
            return value
    names = " or ".join(a.__name__ for a in allowed)
    raise ConfigError(f"recipe key {key!r}: expected {names}, got {type(value).__name__} {value!r}")


def parse_overrides(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"overrides are key=value, got {item!r}")
        key, value = item.split("=", 1)
        out[key.strip()] = yaml.safe_load(value) if value.strip() else ""
    return out


def load_recipe(path: str | Path | None, overrides: list[str] | dict[str, Any] | None = None) -> TrainConfig:
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"recipe file not found: {path}")
        loaded = yaml.safe_load(path.read_text()) or {}
        if not isinstance(loaded, dict) or any(isinstance(v, dict | list) for v in loaded.values()):
            raise ConfigError(f"{path}: a recipe is a flat YAML mapping of key: scalar")
        raw.update(loaded)
    raw.update(parse_overrides(overrides) if isinstance(overrides, list) else (overrides or {}))
    hints = typing.get_type_hints(TrainConfig)
    valid = [f.name for f in fields(TrainConfig)]
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in hints:
            raise ConfigError(f"unknown recipe key {key!r}; valid keys: {', '.join(valid)}")
        values[key] = _check_type(key, value, hints[key])
    cfg = TrainConfig(**values)
    for key in FILE_KEYS:
        value = getattr(cfg, key)
        if value and not Path(value).exists():
            raise ConfigError(f"recipe key {key!r}: file or folder not found: {value}")
    unknown = sorted(set(t.strip() for t in cfg.tasks.split(",")) - set(TASKS))
    if unknown:
        raise ConfigError(f"recipe key 'tasks': unknown task(s) {unknown}; valid: {list(TASKS)}")
    if cfg.min_length > cfg.max_length or cfg.min_length < 16:
        raise ConfigError(f"recipe keys 'min_length'/'max_length': need 16 <= min_length <= max_length, got "
                          f"{cfg.min_length}, {cfg.max_length}")
    for key in ("steps", "num_samples", "queries_per_sample", "save_every", "log_every", "samples_per_step"):
        if getattr(cfg, key) < 1:
            raise ConfigError(f"recipe key {key!r} must be >= 1, got {getattr(cfg, key)}")
    return cfg


def save_resolved(cfg: TrainConfig, folder: Path) -> None:
    (folder / "train_config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=True))
