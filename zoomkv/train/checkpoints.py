"""Training checkpoints: save one step's state, find and check the one to resume, restore it.

A checkpoint is one folder, ``<run>/checkpoints/step_NNNNNN``, of safetensors + JSON only (no pickle, unlike
``accelerator.save_state``), written whole to a temporary folder and renamed: the adapter checkpoint
(``zoomkv export`` reads it), AdamW's moments in ``torch.optim``'s ``state_dict`` terms, the step, the
recipe, and ``DONE`` last. Resuming it restores the exact state: the data position and every random draw
of the loop are pure functions of (seed, step), so a resumed run trains bitwise the adapter of an
uninterrupted one (CPU, same seed).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import torch
import yaml

from zoomkv.adapters.checkpoint import META_NAME, STATE_NAME, checkpoint_files
from zoomkv.adapters.config import CARD_NAME, CONFIG_NAME, WEIGHTS_NAME
from zoomkv.adapters.files import INCOMPLETE_MARKER, is_adapter_folder, is_incomplete, write_folder_atomically
from zoomkv.adapters.model import fingerprint_diff
from zoomkv.adapters.weights import load_into, read_weights, sha256, tensors_to_bytes
from zoomkv.atomic import free_space
from zoomkv.errors import ConfigError
from zoomkv.locks import LOCK_NAME
from zoomkv.logs import human_bytes
from zoomkv.protocol.shape import ModelShape
from zoomkv.train.config import TrainConfig
from zoomkv.train.teacher import check_cache_folder, is_cache_folder

OPTIMIZER_NAME = "optimizer.safetensors"
TRAINER_NAME = "trainer_state.json"


RUN_MARK = ".zoomkv-run"  # written first into a run folder the trainer makes (or finds empty)


def step_folders(run_dir: Path) -> list[Path]:
    """The run's step checkpoints zoomkv wrote (``checkpoints/step_N`` holding a checkpoint's files), by step."""
    folder = run_dir / "checkpoints"
    if not folder.is_dir() or folder.is_symlink():
        return []
    steps = [p for p in folder.iterdir() if p.name.startswith("step_") and p.name[5:].isdigit()
             and p.is_dir() and not p.is_symlink() and is_adapter_folder(p)]
    return sorted(steps, key=lambda p: int(p.name[5:]))


def is_run_folder(run_dir: Path) -> bool:
    """A run folder the trainer wrote: its mark or, for runs from before the mark, a checkpoint, an adapter, a
    teacher cache or a recipe (``train_config.yaml`` naming a method) of ours."""
    if (run_dir / RUN_MARK).is_file() or step_folders(run_dir) or is_cache_folder(run_dir / "teacher"):
        return True
    if (run_dir / "adapter").is_dir() and is_adapter_folder(run_dir / "adapter"):
        return True
    try:
        recipe = yaml.safe_load((run_dir / "train_config.yaml").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return False
    return isinstance(recipe, dict) and isinstance(recipe.get("method"), str) and "run_name" in recipe


def check_run_folder(cfg: TrainConfig) -> list[Path]:
    """Before the model loads: the run folder (``output_dir/run_name``) is new, empty or a run of ours; one that
    already holds checkpoints or an adapter is continued (``resume``) or started over (``overwrite``), never
    trained into afresh (that would overwrite some steps and leave others for a later ``resume=latest``).
    Returns what ``overwrite`` removes (``start_over``): the earlier run's step folders and adapter."""
    run = cfg.run_dir
    check_run_path(cfg)
    check_cache_folder(cfg.cache_dir)
    if not run.is_dir() or not any(p.name != LOCK_NAME for p in run.iterdir()):  # this run's lock alone: empty
        return []
    if not is_run_folder(run):
        raise ConfigError(f"run folder {run} (output_dir/run_name) holds files and no zoomkv run; choose another "
                          "run_name or output_dir (a run writes only into a new or empty folder, or its own)")
    ours = step_folders(run)
    adapter = run / "adapter"
    if adapter.is_dir() and not adapter.is_symlink() and is_adapter_folder(adapter):
        ours.append(adapter)
    steps = [p.name[5:].lstrip("0") or "0" for p in ours if p.name.startswith("step_") and (p / "DONE").is_file()]
    finished = adapter in ours and not is_incomplete(adapter)
    if (steps or finished) and not cfg.resume and not cfg.overwrite:
        what = (f"checkpoints up to step {steps[-1]}" if steps else "no checkpoint") + \
            (" and an adapter" if finished else "")
        raise ConfigError(f"run folder {run} already holds a run ({what}); continue it with resume=latest, train "
                          "another run_name, or start it over with overwrite=true (removes its checkpoints and "
                          "adapter)")
    return ours if cfg.overwrite else []


def check_run_path(cfg: TrainConfig) -> None:
    """The run folder's path is not a file's (before its lock is made in it)."""
    run = cfg.run_dir
    if (run.exists() or run.is_symlink()) and not run.is_dir():
        raise ConfigError(f"run folder {run} (output_dir/run_name) is a file; choose another run_name")


def start_over(cfg: TrainConfig, earlier: list[Path]) -> None:
    """Main process, ``overwrite=true``: remove the earlier run's step folders and adapter (folders zoomkv wrote,
    as ``check_run_folder`` found them: the files it writes there, then the folder if nothing else is left in
    it) and the scores that described them; anything else stays. Then mark the run folder as a run's."""
    ours = {STATE_NAME, META_NAME, OPTIMIZER_NAME, TRAINER_NAME, "train_config.yaml", "DONE", WEIGHTS_NAME,
            CONFIG_NAME, CARD_NAME, INCOMPLETE_MARKER}
    for folder in earlier:
        for name in ours:
            (folder / name).unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            folder.rmdir()  # only when empty: a file of the user's keeps its folder
        if folder.is_dir():  # marked as an unfinished write of ours: nothing loads it, the run writes over it
            (folder / INCOMPLETE_MARKER).write_bytes(b"started over\n")
    for name in ("eval.json", f"{cfg.training.report_name}.json"):
        (cfg.run_dir / name).unlink(missing_ok=True)
    claim_run_folder(cfg.run_dir)


def claim_run_folder(run_dir: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    if not (run_dir / RUN_MARK).is_file():
        (run_dir / RUN_MARK).write_text("zoomkv training run\n", encoding="utf-8")


# A checkpoint's files beside its tensors (meta, trainer state, recipe, DONE), rounded up generously
CHECKPOINT_OVERHEAD = 64 * 1024


def saves_left(cfg: TrainConfig, start_step: int = 0) -> int:
    """How many checkpoints the run writes from ``start_step`` on: every ``save_every`` steps and the last."""
    every = cfg.save_every
    return cfg.steps // every - start_step // every + (1 if cfg.steps % every and cfg.steps > start_step else 0)


def checkpoint_bytes(adapter: torch.nn.Module) -> int:
    """What one checkpoint of ``adapter`` takes on disk: its tensors, AdamW's two moments per trainable value
    (float32), the small files."""
    state = sum(t.numel() * t.element_size() for t in adapter.state_dict().values())
    moments = sum(2 * p.numel() * 4 for p in adapter.parameters() if p.requires_grad)
    return state + moments + CHECKPOINT_OVERHEAD


def check_checkpoint_space(cfg: TrainConfig, adapter: torch.nn.Module, start_step: int = 0) -> None:
    """Before the first step: every checkpoint the run keeps (and its adapter) fits in the space left where the
    run folder is. A run that would fill the disk is refused now, not after hours and thousands of folders."""
    per = checkpoint_bytes(adapter)
    count = saves_left(cfg, start_step)
    need = count * per + per  # the adapter folder at the end is about one more
    where, free = free_space(cfg.run_dir)
    if need > free:
        raise ConfigError(f"recipe keys 'steps'/'save_every': {count:,} checkpoints of {human_bytes(per)} each "
                          f"({human_bytes(need)} with the adapter) would not fit in the {human_bytes(free)} free "
                          f"in {where}; raise save_every, lower steps, or free some space")


def resume_step(folder: Path | None) -> int:
    """The step a checkpoint to resume holds (0: none; a bad one is refused when it is read)."""
    if folder is None:
        return 0
    try:
        return int(json.loads((folder / TRAINER_NAME).read_text(encoding="utf-8"))["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def latest_checkpoint(run_dir: Path) -> Path | None:
    done = [p for p in (run_dir / "checkpoints").glob("step_*") if (p / "DONE").is_file()]
    return max(done, key=lambda p: int(p.name.split("_")[1]), default=None)


def save_checkpoint(run_dir: Path, step: int, cfg: TrainConfig, adapter: torch.nn.Module, optimizer: Any,
                    shape: ModelShape, fingerprint: dict[str, Any]) -> None:
    """One folder, written whole then renamed (a kill mid-save leaves the previous one as ``latest``):
    the adapter checkpoint (``zoomkv export`` reads it), the optimizer moments, the step, the recipe.
    ``optimizer``: the optimizer, or its ``state_dict()`` (DeepSpeed's is gathered by every process)."""
    files = checkpoint_files(adapter, method=cfg.method, hyper=cfg.training.hyper(adapter, cfg),
                             base_model=fingerprint, shape=shape, budget=cfg.budget, extra={"step": step})
    state = optimizer if isinstance(optimizer, dict) else optimizer.state_dict()
    tensors, scalars = {}, {}
    for index, entries in state["state"].items():
        for key, value in entries.items():
            if torch.is_tensor(value):
                tensors[f"{index}.{key}"] = value.detach().cpu().contiguous()
            else:
                scalars[f"{index}.{key}"] = value
    files[OPTIMIZER_NAME] = tensors_to_bytes(tensors)
    trainer = {"step": step, "param_groups": state["param_groups"], "optimizer_scalars": scalars,
               "optimizer_sha256": sha256(files[OPTIMIZER_NAME])}
    files[TRAINER_NAME] = (json.dumps(trainer, indent=2, sort_keys=True) + "\n").encode("utf-8")
    files["train_config.yaml"] = yaml.safe_dump(cfg.to_dict(), sort_keys=True).encode("utf-8")
    files["DONE"] = str(step).encode()
    write_folder_atomically(run_dir / "checkpoints" / f"step_{step:06d}", files, overwrite=True)


def resume_folder(cfg: TrainConfig) -> Path | None:
    """The checkpoint ``resume`` names (``latest``: the newest finished one of the run, None if none yet),
    checked to be of the recipe's method and base model name; ``check_resume`` adds the model's shape."""
    if not cfg.resume:
        return None
    folder = latest_checkpoint(cfg.run_dir) if cfg.resume == "latest" else Path(cfg.resume)
    if folder is None:
        return None
    if not folder.is_dir():
        raise ConfigError(f"recipe key 'resume': checkpoint folder not found: {cfg.resume}")
    check_resume(folder, cfg)
    return folder


def check_resume(folder: Path, cfg: TrainConfig, fingerprint: dict[str, Any] | None = None) -> None:
    """Refuse to resume a checkpoint of another method or base model (the name the recipe gave it, and,
    with ``fingerprint``, the loaded model's shape): it would continue, and be stamped as, the wrong one."""
    try:
        meta = json.loads((folder / META_NAME).read_text(encoding="utf-8"))
        recorded = meta["base_model"]
        method = meta["method"]
        if not isinstance(recorded, dict):
            raise TypeError("base_model is not a mapping")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"recipe key 'resume': {folder} is not a training checkpoint of this trainer ({err})") from err
    if method != cfg.method:
        raise ConfigError(f"recipe key 'resume': {folder} is a checkpoint of method {method!r}, not {cfg.method!r}")
    try:  # the optimiser's groups leave frozen tensors out: another freeze= cannot take these moments
        saved = yaml.safe_load((folder / "train_config.yaml").read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError):
        saved = {}
    frozen = str(saved.get("freeze") or "") if isinstance(saved, dict) else ""
    if frozen != cfg.freeze:
        raise ConfigError(f"recipe key 'resume': {folder} was trained with freeze={frozen!r}, the recipe says "
                          f"freeze={cfg.freeze!r}; resume with the same freeze")
    diff = [] if recorded.get("name") == cfg.model else ["name"]
    if fingerprint is not None:
        diff += fingerprint_diff(recorded, fingerprint)
    if diff:
        raise ConfigError(
            f"recipe key 'resume': {folder} is a checkpoint of base model {recorded.get('name')!r}, not the "
            f"recipe's model {cfg.model!r} (they differ in {', '.join(diff)}); resume with "
            f"model={recorded.get('name')}, or train the new model in another run_name/output_dir"
        )


def load_checkpoint_state(folder: Path, adapter: torch.nn.Module, optimizer: Any) -> int:
    """Restore the adapter weights and optimizer moments saved by ``save_checkpoint``; returns the step."""
    try:
        trainer = json.loads((folder / TRAINER_NAME).read_text(encoding="utf-8"))
        step = int(trainer["step"])
        meta = json.loads((folder / META_NAME).read_text(encoding="utf-8"))
        state_sha, optimizer_sha = meta["state_sha256"], trainer["optimizer_sha256"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"{folder} is not a training checkpoint of this trainer ({err})") from err
    # Both files verified against the checksums written with them, like every adapter file zoomkv reads.
    load_into(adapter, read_weights(folder / STATE_NAME, state_sha, recorded_in=str(folder / META_NAME)),
              source=str(folder / STATE_NAME))
    state: dict[int, dict[str, Any]] = {}
    for name, tensor in read_weights(folder / OPTIMIZER_NAME, optimizer_sha,
                                     recorded_in=str(folder / TRAINER_NAME)).items():
        index, key = name.split(".", 1)
        state.setdefault(int(index), {})[key] = tensor
    for name, value in trainer.get("optimizer_scalars", {}).items():
        index, key = name.split(".", 1)
        state.setdefault(int(index), {})[key] = value
    optimizer.load_state_dict({"state": state, "param_groups": trainer["param_groups"]})
    return step
