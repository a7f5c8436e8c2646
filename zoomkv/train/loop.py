"""The training loop: one readable Accelerate loop, nanoGPT style.

    python -m zoomkv.train --recipe recipes/smollm2-135m/quickstart.yaml [key=value ...]
    accelerate launch --config_file recipes/accelerate/multi_cpu.yaml -m zoomkv.train --recipe ...

1. resolve the recipe (errors before any model loads), size the adapter, refuse it over the limit
   (``sizing``);
2. cut the samples from the corpus (synthetic tasks inserted), extract the teacher signals once (cached
   safetensors, ``teacher``);
3. train the adapter from the cache: each step one sample per micro-batch (length curriculum) and a few
   layers, the method's objective, one optimiser step (``train_step``; plain AdamW or DeepSpeed's);
4. checkpoint adapter-only state every ``save_every`` steps (``checkpoints``: bitwise resume) and write
   the adapter folder (``ZoomAdapter`` format, loadable by ``--adapter``) at the end, recipe next to it,
   then score it on held-out samples (``heldout``).

Everything method-specific comes from the recipe's ``MethodTraining`` (``cfg.training``); what keeps a run
honest (non-finite steps, gradients averaged over processes) is in ``guards``.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zoomkv.adapters.model import ZoomAdapter
from zoomkv.data.haystack import Haystack
from zoomkv.data.training import curriculum_index, make_samples
from zoomkv.errors import ConfigError
from zoomkv.launch import end_process_group
from zoomkv.locks import acquire_on_main, lock_inside
from zoomkv.logs import LOGGER_NAME, progress_shown
from zoomkv.protocol.shape import ModelShape, base_fingerprint
from zoomkv.train import deepspeed_engine
from zoomkv.train.checkpoints import (
    check_checkpoint_space,
    check_resume,
    check_run_folder,
    check_run_path,
    claim_run_folder,
    load_checkpoint_state,
    resume_folder,
    resume_step,
    save_checkpoint,
    start_over,
)
from zoomkv.train.config import TrainConfig, load_corpus, save_resolved
from zoomkv.train.guards import (
    average_gradients,
    check_processes_agree,
    gradient_norm,
    launch_mismatch,
    stop_unless_finite,
)
from zoomkv.train.heldout import evaluate, write_eval
from zoomkv.train.sizing import KNOWN_CONFIGS, build_adapter, check_fraction, freeze_parameters
from zoomkv.train.teacher import CachedSamples, SampleReader, build_cache, load_sample, sample_layers

log = logging.getLogger(__name__)


def train(cfg: TrainConfig) -> Path:
    """Run a recipe to its last step (or from the checkpoint ``resume`` names); returns the adapter folder."""
    if cfg.model in KNOWN_CONFIGS:
        raise ConfigError(f"{cfg.model!r} is only known by its config here (use --dry-run), not loadable")
    check_run_path(cfg)
    accelerator, tracking = start_accelerator(cfg)
    # One writer per run folder: a second run of this run_name started meanwhile would train into the same
    # checkpoints and adapter, and both would report success. Held by the main process until the run ends.
    lock = lock_inside(cfg.run_dir, "train", "run folder")
    acquire_on_main(lock, accelerator.is_main_process)
    try:
        return _train(cfg, accelerator, tracking)
    finally:
        lock.release()


def _train(cfg: TrainConfig, accelerator: Any, tracking: bool) -> Path:
    """``train`` once the run folder is this run's alone."""
    from tqdm.auto import tqdm

    from zoomkv.models import load_model, parse_dtype

    corpus = load_corpus(cfg)  # a bad source fails here, before the model loads
    earlier = check_run_folder(cfg)  # a new or empty folder, or a run of ours resumed or started over
    resume = resume_folder(cfg)  # checked against the recipe's method and model before the model loads
    # on the accelerator's device (a GPU when there is one), in the recipe's dtype
    model, tokenizer = load_model(cfg.model, dtype=parse_dtype(cfg.dtype), device=accelerator.device,
                                  random_weights=cfg.random_weights)
    model.requires_grad_(False)  # frozen: never trained, never saved
    shape = ModelShape.from_model(model)
    base = base_fingerprint(model, name=cfg.model)
    if resume is not None:
        check_resume(resume, cfg, base)
    adapter = build_adapter(cfg, shape)
    frozen = freeze_parameters(adapter, cfg.freeze)  # an unknown name fails here, before the teacher signals
    check_fraction(adapter, shape, cfg, log=log.info)
    check_checkpoint_space(cfg, adapter, resume_step(resume))  # what the run will write, before it starts
    if frozen:
        log.info("held at their start: %s", ", ".join(frozen))
    log.info("%d process(es), %s, %s", accelerator.num_processes, engine_name(accelerator), accelerator.device)
    training = cfg.training  # everything method-specific: modules, objective, optimiser groups

    if accelerator.is_main_process and earlier:  # overwrite=true: the earlier run's checkpoints and adapter go
        start_over(cfg, earlier)
    elif accelerator.is_main_process:
        claim_run_folder(cfg.run_dir)

    # -- teacher signals, once (main process), then everyone reads the cache
    paths = teacher_signals(accelerator, model, tokenizer, cfg, corpus)
    cached = CachedSamples(paths)
    if not cfg.init_adapter:  # every process computes the same start from the same cache
        training.prepare(adapter, cfg, cached)
    report_before = training.report(adapter, cfg, cached[-2:])

    # -- the optimiser, and where a resumed run starts
    engine = prepare_engine(accelerator, adapter, cfg)
    cached = CachedSamples(paths, accelerator.device)  # where the prepared adapter now is
    start_step = 0
    if resume is not None:
        start_step = load_checkpoint_state(resume, engine.adapter, engine.moments)
        log.info("resumed from %s at step %d", resume, start_step)
    if accelerator.is_main_process:
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        save_resolved(cfg, cfg.run_dir)
    if tracking:
        accelerator.init_trackers("tb", config={k: v for k, v in cfg.to_dict().items()
                                                if isinstance(v, int | float | str | bool)})

    # -- the loop
    bar = tqdm(total=cfg.steps, initial=start_step, desc="train",
               disable=not (accelerator.is_local_main_process and progress_shown()))
    t0 = time.time()
    # on a GPU each sample is read while the one before trains (on the CPU the read would take from its compute)
    with SampleReader(accelerator.device, ahead=accelerator.device.type == "cuda") as reader:
        for step in range(start_step + 1, cfg.steps + 1):
            losses, length = train_step(engine, cfg, step, paths, reader)
            bar.update(1)
            if losses and (step % cfg.log_every == 0 or step == 1):
                bar.set_postfix(loss=f"{losses['loss']:.4f}")
                log.info("step %d: %s len=%d (%.0fs)", step, " ".join(f"{k}={v:.4f}" for k, v in losses.items()),
                         length, time.time() - t0)
                if tracking:
                    accelerator.log({f"train/{k}": v for k, v in losses.items()}, step=step)
            if step % cfg.save_every == 0 or step == cfg.steps:
                save_step(engine, cfg, step, shape, base)
            if cfg.kill_at_step and step == cfg.kill_at_step:
                os.kill(os.getpid(), signal.SIGKILL)  # tests: a hard kill, no cleanup, no final save
    bar.close()
    check_processes_agree(accelerator, engine.adapter)

    # -- the adapter folder, the method's report and the held-out scores (main process)
    out = cfg.run_dir / "adapter"
    if accelerator.is_main_process:
        hyper = {**training.hyper(engine.adapter, cfg), **training.fitted_hyper(engine.adapter, cfg, cached)}
        exported = ZoomAdapter.from_modules(engine.adapter, cfg.method, hyper,
                                            shape=shape, fingerprint=base, budget=cfg.budget)
        exported.save_pretrained(out, overwrite=True)
        save_resolved(cfg, out)
        log.info("adapter saved to %s", out)
        if report_before is not None:  # the method's own numbers on the last cached samples, before and after
            report = {"fresh": report_before, "trained": training.report(engine.adapter, cfg, cached[-2:])}
            (cfg.run_dir / f"{training.report_name}.json").write_text(json.dumps(report, indent=2))
            log.info("%s %s", training.report_name, json.dumps(report))
        if cfg.eval_samples:
            write_eval(cfg, evaluate(model, tokenizer, cfg, engine.adapter))
    accelerator.wait_for_everyone()  # the others wait while the main process writes and evaluates
    accelerator.end_training()
    end_process_group()
    return out


def start_accelerator(cfg: TrainConfig) -> tuple[Any, bool]:
    """The run's ``Accelerator`` (plain, multi-process or DeepSpeed, as the launcher set it up), seeded and
    deterministic; and whether it logs to tensorboard."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    tracking = False
    if cfg.tensorboard:
        try:
            import tensorboard  # noqa: F401

            tracking = True
        except ImportError:
            log.warning("tensorboard is not installed: logging to the console only "
                        "(pip install 'zoomkv[train]', or set tensorboard: false in the recipe)")
    # cpu=True without CUDA: processes started by torchrun (accelerate's multi-process launcher) then join
    # over gloo as MULTI_CPU instead of each training alone. Not under DeepSpeed: cpu=True would drop it
    # (its CPU accelerator, DS_ACCELERATOR=cpu, runs without CUDA).
    ds = deepspeed_engine.deepspeed_requested()
    accelerator = Accelerator(log_with="tensorboard" if tracking else None, project_dir=str(cfg.run_dir),
                              cpu=not torch.cuda.is_available() and not ds,
                              **(deepspeed_engine.accelerator_kwargs() if ds else {}))
    if not accelerator.is_local_main_process:  # its INFO lines would repeat the main process's
        quiet = logging.getLogger(LOGGER_NAME)
        quiet.setLevel(max(quiet.getEffectiveLevel(), logging.WARNING))
    if ds:
        deepspeed_engine.check_stage(accelerator)  # before the model loads: ZeRO-3 would partition it
    mismatch = launch_mismatch(accelerator.num_processes, os.environ)
    if mismatch:
        log.warning(mismatch)
    set_seed(cfg.seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    return accelerator, tracking


def engine_name(accelerator: Any) -> str:
    """How the processes train together: ``no`` (one), ``multi_cpu``, ``multi_gpu``, ``deepspeed ZeRO-2``..."""
    from accelerate.utils import DistributedType

    name = accelerator.distributed_type.value.lower()
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        name += f" ZeRO-{deepspeed_engine.zero_stage(accelerator)}"
    return name


def teacher_signals(accelerator: Any, model: Any, tokenizer: Any, cfg: TrainConfig,
                    corpus: Haystack | None) -> list[Path]:
    """The cached teacher samples' files: extracted by the main process (or found in the cache when the
    recipe's samples match it), read by every process."""
    tasks = cfg.task_mix
    samples = make_samples(tokenizer, tasks, cfg.num_samples, cfg.min_length, cfg.max_length, cfg.seed, corpus)
    fingerprint = {"model": cfg.model, "tasks": tasks, "num_samples": cfg.num_samples, "seed": cfg.seed,
                   "data": [cfg.data, cfg.data_split, cfg.data_field] if cfg.data else None,
                   "min_length": cfg.min_length, "max_length": cfg.max_length, "queries": cfg.queries_per_sample,
                   "budget": cfg.budget, "recent": cfg.recent}
    if accelerator.is_main_process:
        build_cache(model, tokenizer, samples, cfg.cache_dir, n_queries=cfg.queries_per_sample, min_pos=cfg.budget,
                    recent=cfg.recent, fingerprint=fingerprint, show_progress=progress_shown())
        log.debug("teacher signals in %s", cfg.cache_dir)
    accelerator.wait_for_everyone()
    return sorted(cfg.cache_dir.glob("sample_*.safetensors"))[: cfg.num_samples]


@dataclass
class Engine:
    """What trains: the adapter's modules (what the objective, checkpoints and export see), what
    ``accelerator.prepare`` made of them (DDP's wrapper or DeepSpeed's engine), the optimiser, and its state
    as checkpoints read and write it (``torch.optim``'s ``state_dict`` format, ZeRO's partitions gathered)."""

    accelerator: Any
    adapter: torch.nn.Module
    prepared: Any
    optimizer: Any
    moments: Any
    deepspeed: bool


def prepare_engine(accelerator: Any, adapter: torch.nn.Module, cfg: TrainConfig) -> Engine:
    """AdamW over the method's parameter groups, handed to Accelerate (and DeepSpeed under it)."""
    from accelerate.utils import DistributedType

    ds = accelerator.distributed_type == DistributedType.DEEPSPEED
    # frozen tensors (the recipe's freeze=) stay out of the optimiser: no moments, nothing for DeepSpeed to shard
    groups = [dict(g, params=[p for p in g["params"] if p.requires_grad])
              for g in cfg.training.param_groups(adapter, cfg)]
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]], weight_decay=cfg.weight_decay)
    param_lists = [list(group["params"]) for group in optimizer.param_groups]
    if ds:  # the engine's batch, accumulation and clipping come from the recipe
        deepspeed_engine.configure(accelerator, cfg.samples_per_step, cfg.grad_clip,
                                   sum(p.numel() for group in param_lists for p in group))
    prepared, optimizer = accelerator.prepare(adapter, optimizer)
    raw = accelerator.unwrap_model(prepared)
    moments = deepspeed_engine.ZeroOptimizerState(prepared, param_lists) if ds else optimizer
    return Engine(accelerator, raw, prepared, optimizer, moments, ds)


def micro_plan(cfg: TrainConfig, step: int, micro: int, total: int, paths: list[Path]
               ) -> tuple[Path, list[int], random.Random]:
    """Micro-batch ``micro`` of ``step`` (``total`` per step over all processes): its sample's file (the length
    curriculum), its layers and its random draws, all functions of (seed, step, micro) so a resumed run needs
    only the step. The global batch is numbered alike however it is split over processes (2 processes x 1
    sample = 1 process x 2 samples)."""
    rng = random.Random(cfg.seed * 7919 + step * 31 + micro)
    path = paths[curriculum_index(step * total + micro, cfg.steps * total, len(paths), cfg.seed)]
    every = sample_layers(path)
    layers = sorted(rng.sample(every, min(cfg.layers_per_step or len(every), len(every))))
    return path, layers, rng


def micro_batch(cfg: TrainConfig, step: int, micro: int, total: int, paths: list[Path],
                device: torch.device | str = "cpu", reader: SampleReader | None = None
                ) -> tuple[dict[str, torch.Tensor], list[int], random.Random]:
    """``micro_plan``'s micro-batch, its sample's tensors on ``device`` (the adapter's; through ``reader`` when it
    read them ahead), torch's random state seeded for it."""
    torch.manual_seed(cfg.seed * 1_000_003 + step * 101 + micro)
    path, layers, rng = micro_plan(cfg, step, micro, total, paths)
    # the other layers' tensors stay on disk
    sample = reader.load(path, layers) if reader is not None else load_sample(path, device, layers)
    return sample, layers, rng


def read_next(reader: SampleReader, cfg: TrainConfig, step: int, j: int, accelerator: Any, paths: list[Path]) -> None:
    """The sample of the micro-batch after this process's ``j``-th of ``step``, read while ``j`` trains."""
    per_proc = cfg.samples_per_step
    step, j = (step, j + 1) if j + 1 < per_proc else (step + 1, 0)
    if step <= cfg.steps:
        path, layers, _ = micro_plan(cfg, step, accelerator.process_index * per_proc + j,
                                     accelerator.num_processes * per_proc, paths)
        reader.read_ahead(path, layers)


def train_step(engine: Engine, cfg: TrainConfig, step: int, paths: list[Path], reader: SampleReader | None = None
               ) -> tuple[dict[str, float], int]:
    """One optimiser step: ``samples_per_step`` micro-batches on each process, their gradients averaged over
    micro-batches and processes, clipped, applied; stopped before anything is kept if the loss, gradient or
    update is not finite. Plain AdamW steps here; DeepSpeed's engine reduces, clips and steps inside the
    last micro-batch's backward. Returns the last micro-batch's losses and sample length."""
    accelerator, run_dir = engine.accelerator, cfg.run_dir
    per_proc = cfg.samples_per_step
    losses: dict[str, float] = {}
    total_loss = torch.zeros((), device=accelerator.device)  # read by the guard with the gradient's norm
    total = accelerator.num_processes * per_proc
    for j in range(per_proc):
        micro = accelerator.process_index * per_proc + j
        sample, layers, rng = micro_batch(cfg, step, micro, total, paths, accelerator.device, reader)
        if reader is not None and reader.reads_ahead:
            read_next(reader, cfg, step, j, accelerator, paths)
        loss, losses = cfg.training.step_loss(engine.adapter, sample, layers, cfg, step, rng)
        total_loss = total_loss + loss.detach().float()
        if engine.deepspeed:  # the engine divides by samples_per_step, reduces, clips and steps after the last one
            stop_unless_finite(accelerator, step, run_dir, loss=loss.detach().float())
            with accelerator.accumulate(engine.prepared):
                accelerator.backward(loss)
        else:
            accelerator.backward(loss / per_proc)
    if engine.deepspeed:
        stop_unless_finite(accelerator, step, run_dir, grad_norm=deepspeed_engine.global_grad_norm(engine.prepared),
                           adapter=engine.adapter)
    else:
        average_gradients(accelerator, engine.prepared, engine.adapter)
        stop_unless_finite(accelerator, step, run_dir, loss=total_loss, grad_norm=gradient_norm(engine.adapter))
        if cfg.grad_clip > 0:
            accelerator.clip_grad_norm_(engine.adapter.parameters(), cfg.grad_clip)
        engine.optimizer.step()
        engine.optimizer.zero_grad(set_to_none=True)
        stop_unless_finite(accelerator, step, run_dir, adapter=engine.adapter)  # an update can overflow too
    return losses, int(sample["ids"].shape[0])


def save_step(engine: Engine, cfg: TrainConfig, step: int, shape: ModelShape, base: dict[str, Any]) -> None:
    """The step's checkpoint, written by the main process once every process has finished the step."""
    accelerator = engine.accelerator
    accelerator.wait_for_everyone()
    state = engine.moments.state_dict()  # every process: DeepSpeed gathers its partitions
    if accelerator.is_main_process:
        save_checkpoint(cfg.run_dir, step, cfg, engine.adapter, state, shape, base)
        log.debug("checkpoint of step %d written", step)
    accelerator.wait_for_everyone()
