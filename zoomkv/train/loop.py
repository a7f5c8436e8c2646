"""The training loop: one readable Accelerate loop, nanoGPT style.

    python -m zoomkv.train --recipe recipes/smollm2-135m/quickstart.yaml [key=value ...]
    accelerate launch --config_file recipes/accelerate/multi_cpu.yaml -m zoomkv.train --recipe ...

1. resolve the recipe (errors before any model loads), size the adapter, refuse it over the limit;
2. cut the samples from the corpus (synthetic tasks inserted), extract the teacher signals once (cached
   safetensors);
3. train the adapter from the cache: each step one sample (length curriculum) and a few layers;
4. checkpoint adapter-only state (weights, optimizer moments, step) every ``save_every`` steps and write
   the adapter folder (``ZoomAdapter`` format, loadable by ``--adapter``) at the end, recipe next to it.

Checkpoints are safetensors + JSON only (no pickle, unlike ``accelerator.save_state``), each written to a
temporary folder and renamed. Resuming (``resume=latest``) restores the exact state: the data position and
every random draw are pure functions of (seed, step), so a run killed with SIGKILL and resumed gives
bitwise the adapter of an uninterrupted run (CPU, same seed). A step checkpoint is also a valid
``zoomkv export`` input.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from zoomkv.adapters.checkpoint import META_NAME, STATE_NAME, checkpoint_files
from zoomkv.adapters.files import write_folder_atomically
from zoomkv.adapters.model import ZoomAdapter, fingerprint_diff
from zoomkv.adapters.weights import load_into, read_weights, sha256, tensors_to_bytes
from zoomkv.data.haystack import Haystack, text_haystack
from zoomkv.data.training import curriculum_index, make_samples
from zoomkv.errors import ConfigError, ZoomKVError
from zoomkv.protocol.registry import get_method
from zoomkv.protocol.shape import ModelShape, base_fingerprint
from zoomkv.train import deepspeed_engine
from zoomkv.train.config import TrainConfig, save_resolved
from zoomkv.train.deepspeed_engine import deepspeed_requested
from zoomkv.train.teacher import CachedSamples, build_cache, load_sample

# Shapes of models too big to load for a dry run: the trainable fraction needs only their config.
KNOWN_CONFIGS: dict[str, dict[str, Any]] = {
    "meta-llama/Meta-Llama-3-8B": dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
        tie_word_embeddings=False,
    ),
}


def shape_without_weights(name: str) -> ModelShape:
    """A ModelShape (with the parameter count) from a config alone: the model is built on the meta device."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**KNOWN_CONFIGS[name])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return ModelShape.from_config(config, sum(p.numel() for p in model.parameters()))


def build_adapter(cfg: TrainConfig, shape: ModelShape) -> torch.nn.Module:
    """The modules to train: the recipe's ``init_adapter``, or the method's fresh ones."""
    if cfg.init_adapter:
        loaded = ZoomAdapter.from_pretrained(cfg.init_adapter, local_files_only=True)
        if loaded.config.method != cfg.method:
            raise ConfigError(f"recipe key 'init_adapter': {cfg.init_adapter} holds a {loaded.config.method!r} "
                              f"adapter, not {cfg.method!r}")
        return loaded.modules
    plan_adapter(cfg, shape)
    return cfg.training.init_modules(cfg, shape)


def plan_adapter(cfg: TrainConfig, shape: ModelShape) -> None:
    """The recipe's modules built on the meta device first (no memory): sizes that overflow or make more than
    ``max_trainable_fraction`` of the base model are refused before anything is allocated. (An init that
    reads tensor data cannot run there; ``check_fraction`` then checks the real modules.)"""
    sizes = ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(cfg.options).items()
                      if isinstance(v, int) and not isinstance(v, bool)) if cfg.options is not None else ""
    try:
        with torch.device("meta"):
            planned = cfg.training.init_modules(cfg, shape)
    except ZoomKVError:
        raise
    except (TypeError, ValueError, OverflowError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"recipe keys of {cfg.method!r} ({sizes}) build no modules: {first}") from None
    except (NotImplementedError, RuntimeError):
        return
    check_fraction(planned, shape, cfg, log=lambda *args: None)


def freeze_parameters(adapter: torch.nn.Module, names: str) -> list[str]:
    """Hold the recipe's ``freeze`` tensors at their start (no gradient, so the optimiser never moves them);
    returns their names. An unknown name is refused, listing the adapter's."""
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    params = dict(adapter.named_parameters())
    unknown = [n for n in wanted if n not in params]
    if unknown:
        raise ConfigError(f"recipe key 'freeze': {', '.join(map(repr, unknown))} is not a trainable tensor of this "
                          f"adapter; expected some of {', '.join(params)}")
    for name in wanted:
        params[name].requires_grad_(False)
    return wanted


def check_fraction(adapter: torch.nn.Module, shape: ModelShape, cfg: TrainConfig, log=print) -> float:
    n = sum(p.numel() for p in adapter.parameters() if p.requires_grad)
    fraction = n / shape.num_parameters
    log(f"trainable parameters: {n} of {shape.num_parameters} ({fraction:.3e} of the base model; "
        f"limit {cfg.max_trainable_fraction:g})")
    if fraction > cfg.max_trainable_fraction:
        raise ConfigError(
            f"the adapter has {n} trainable parameters = {fraction:.3e} of the base model, over "
            f"max_trainable_fraction={cfg.max_trainable_fraction:g}; {cfg.training.size_hint}, or raise "
            "max_trainable_fraction"
        )
    return fraction


def dry_run(cfg: TrainConfig) -> float:
    if cfg.model in KNOWN_CONFIGS:
        shape = shape_without_weights(cfg.model)
    else:
        from zoomkv.models import load_model

        model, _ = load_model(cfg.model)
        shape = ModelShape.from_model(model)
    adapter = build_adapter(cfg, shape)
    print(f"model {cfg.model}: {shape.num_layers} layers ({len(shape.full_attention_layers)} compressed), "
          f"{shape.num_kv_heads} KV heads x head_dim {shape.head_dim}; adapter {adapter_hyper(adapter, cfg)}")
    print("trainable tensors: " + ", ".join(f"{n} {list(p.shape)}" for n, p in adapter.named_parameters()))
    freeze_parameters(adapter, cfg.freeze)
    fraction = check_fraction(adapter, shape, cfg)
    print(f"trainable_fraction={fraction:.6g}")
    return fraction


OPTIMIZER_NAME = "optimizer.safetensors"
TRAINER_NAME = "trainer_state.json"


def latest_checkpoint(run_dir: Path) -> Path | None:
    done = [p for p in (run_dir / "checkpoints").glob("step_*") if (p / "DONE").is_file()]
    return max(done, key=lambda p: int(p.name.split("_")[1]), default=None)


def adapter_hyper(adapter: torch.nn.Module, cfg: TrainConfig) -> dict[str, Any]:
    """What rebuilds these modules (their exact sizes) and runs the method (its settings)."""
    return cfg.training.hyper(adapter, cfg)


def save_checkpoint(run_dir: Path, step: int, cfg: TrainConfig, adapter: torch.nn.Module, optimizer: Any,
                    shape: ModelShape, fingerprint: dict[str, Any]) -> None:
    """One folder, written whole then renamed (a kill mid-save leaves the previous one as ``latest``):
    the adapter checkpoint (``zoomkv export`` reads it), the optimizer moments, the step, the recipe.
    ``optimizer``: the optimizer, or its ``state_dict()`` (DeepSpeed's is gathered by every process)."""
    files = checkpoint_files(adapter, method=cfg.method, hyper=adapter_hyper(adapter, cfg), base_model=fingerprint,
                             shape=shape, budget=cfg.budget, extra={"step": step})
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


class NonFiniteTrainingError(ZoomKVError):
    """A step's loss, gradient norm or updated weights are NaN or infinite (too high an lr, bad data): the
    run stops before saving anything from that step on."""


def gradient_norm(adapter: torch.nn.Module) -> torch.Tensor:
    grads = [p.grad.detach().float().norm() for p in adapter.parameters() if p.grad is not None]
    return torch.stack(grads).norm().cpu() if grads else torch.zeros(())


def stop_unless_finite(accelerator: Any, step: int, run_dir: Path, *, loss: torch.Tensor | None = None,
                       grad_norm: torch.Tensor | None = None, adapter: torch.nn.Module | None = None) -> None:
    """Raise ``NonFiniteTrainingError`` (one line, exit 2) when the step's loss, gradient norm or the updated
    adapter is not finite, on every process at once (they decide together, so none waits for the others)."""
    problems = []
    if loss is not None and not torch.isfinite(loss).all():
        problems.append(f"the loss is {float(loss):g}")
    if grad_norm is not None and not torch.isfinite(grad_norm).all():
        problems.append(f"the gradient norm is {float(grad_norm):g}")
    if adapter is not None and not all(bool(torch.isfinite(p).all()) for p in adapter.parameters()):
        problems.append("the update made the adapter's weights non-finite")
    bad = torch.tensor([float(bool(problems))], device=accelerator.device)
    if accelerator.num_processes > 1:
        bad = accelerator.reduce(bad, reduction="sum")
    if not bad.item():
        return
    last = latest_checkpoint(run_dir)
    kept = f"the last checkpoint, {last}, is finite" if last else "no checkpoint was written"
    raise NonFiniteTrainingError(
        f"step {step}: {' and '.join(problems) or 'another process saw a non-finite loss'}; training stopped "
        f"and nothing of this step was saved ({kept}); lower lr (or grad_clip), or check the data"
    )


def average_gradients(accelerator: Any, prepared: Any, adapter: torch.nn.Module) -> None:
    """Mean of the gradients over processes. The loss calls the adapter's methods, not its forward, so
    DDP's hooks never fire: without this every process would train its own copy."""
    if accelerator.num_processes == 1 or not isinstance(prepared, torch.nn.parallel.DistributedDataParallel):
        return  # one process, or an engine (DeepSpeed) that reduces gradients itself
    for p in adapter.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)  # every process must join every all-reduce
        torch.distributed.all_reduce(p.grad, op=torch.distributed.ReduceOp.SUM)
        p.grad.div_(accelerator.num_processes)


def check_processes_agree(accelerator: Any, adapter: torch.nn.Module) -> None:
    """Every process must end with the same adapter (same init, same averaged steps); say so or fail."""
    if accelerator.num_processes == 1:
        return
    mine = torch.cat([p.detach().flatten() for p in adapter.parameters()])[None]
    every = accelerator.gather(mine)
    if not torch.equal(every.amin(0), every.amax(0)):
        raise RuntimeError("the training processes ended with different adapters (gradients not synchronised)")
    accelerator.print(f"all {accelerator.num_processes} processes hold the same adapter")


def load_corpus(cfg: TrainConfig) -> Haystack | None:
    """The recipe's ``data`` as one word stream (None: generated filler sentences)."""
    return text_haystack(cfg.data, field=cfg.data_field, split=cfg.data_split) if cfg.data else None


def train(cfg: TrainConfig) -> Path:
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, set_seed
    from tqdm.auto import tqdm

    from zoomkv.models import load_model

    if cfg.model in KNOWN_CONFIGS:
        raise ConfigError(f"{cfg.model!r} is only known by its config here (use --dry-run), not loadable")
    run_dir = cfg.run_dir
    log_with = None
    if cfg.tensorboard:
        try:
            import tensorboard  # noqa: F401

            log_with = "tensorboard"
        except ImportError:
            print("tensorboard is not installed: logging to the console only "
                  "(pip install 'zoomkv[train]', or set tensorboard: false in the recipe)")
    # cpu=True without CUDA: processes started by torchrun (accelerate's multi-process launcher) then join
    # over gloo as MULTI_CPU instead of each training alone. Not under DeepSpeed: cpu=True would drop it
    # (its CPU accelerator, DS_ACCELERATOR=cpu, runs without CUDA).
    ds = deepspeed_requested()
    accelerator = Accelerator(log_with=log_with, project_dir=str(run_dir),
                              cpu=not torch.cuda.is_available() and not ds,
                              **(deepspeed_engine.accelerator_kwargs() if ds else {}))
    ds = accelerator.distributed_type == DistributedType.DEEPSPEED
    say = accelerator.print
    set_seed(cfg.seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)

    corpus = load_corpus(cfg)  # a bad source fails here, before the model loads
    resume = resume_folder(cfg)  # checked against the recipe's method and model before the model loads
    model, tokenizer = load_model(cfg.model)
    model.requires_grad_(False)  # frozen: never trained, never saved
    shape = ModelShape.from_model(model)
    if resume is not None:
        check_resume(resume, cfg, base_fingerprint(model, name=cfg.model))
    adapter = build_adapter(cfg, shape)
    frozen = freeze_parameters(adapter, cfg.freeze)  # an unknown name fails here, before the teacher signals
    check_fraction(adapter, shape, cfg, log=say)
    if frozen:
        say(f"held at their start: {', '.join(frozen)}")
    say(f"{accelerator.num_processes} process(es), {accelerator.distributed_type.value.lower()}, {accelerator.device}")
    training = cfg.training  # everything method-specific: modules, objective, optimiser groups

    # -- teacher signals, once (main process), then everyone reads the cache
    tasks = cfg.task_mix
    samples = make_samples(tokenizer, tasks, cfg.num_samples, cfg.min_length, cfg.max_length, cfg.seed, corpus)
    fingerprint = {"model": cfg.model, "tasks": tasks, "num_samples": cfg.num_samples, "seed": cfg.seed,
                   "data": [cfg.data, cfg.data_split, cfg.data_field] if cfg.data else None,
                   "min_length": cfg.min_length, "max_length": cfg.max_length, "queries": cfg.queries_per_sample,
                   "budget": cfg.budget, "recent": cfg.recent}
    if accelerator.is_main_process:
        build_cache(model, tokenizer, samples, cfg.cache_dir, n_queries=cfg.queries_per_sample, min_pos=cfg.budget,
                    recent=cfg.recent, fingerprint=fingerprint)
    accelerator.wait_for_everyone()
    paths = sorted(cfg.cache_dir.glob("sample_*.safetensors"))[: cfg.num_samples]
    cached = CachedSamples(paths)

    if not cfg.init_adapter:  # every process computes the same start from the same cache
        training.prepare(adapter, cfg, cached)
    report_before = training.report(adapter, cfg, cached[-2:])
    # frozen tensors (the recipe's freeze=) stay out of the optimiser: no moments, nothing for DeepSpeed to shard
    groups = [dict(g, params=[p for p in g["params"] if p.requires_grad]) for g in training.param_groups(adapter, cfg)]
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]], weight_decay=cfg.weight_decay)
    param_lists = [list(group["params"]) for group in optimizer.param_groups]
    if ds:  # the engine's batch, accumulation and clipping come from the recipe
        deepspeed_engine.configure(accelerator, cfg.samples_per_step, cfg.grad_clip,
                                   sum(p.numel() for group in param_lists for p in group), say)
    adapter, optimizer = accelerator.prepare(adapter, optimizer)
    raw = accelerator.unwrap_model(adapter)
    # what checkpoints read and write: torch.optim's state_dict format, ZeRO's partitions gathered into it
    moments = deepspeed_engine.ZeroOptimizerState(adapter, param_lists) if ds else optimizer
    fingerprint = base_fingerprint(model, name=cfg.model)
    start_step = 0
    if resume is not None:
        start_step = load_checkpoint_state(resume, raw, moments)
        say(f"resumed from {resume} at step {start_step}")
    if accelerator.is_main_process:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_resolved(cfg, run_dir)
    if log_with:
        accelerator.init_trackers("tb", config={k: v for k, v in cfg.to_dict().items() if isinstance(v, int | float | str | bool)})

    bar = tqdm(total=cfg.steps, initial=start_step, desc="train", disable=not accelerator.is_local_main_process)
    t0 = time.time()
    for step in range(start_step + 1, cfg.steps + 1):
        # A step is `samples_per_step` micro-batches on each process; the global batch is their union over
        # processes, numbered alike however it is split (2 processes x 1 sample = 1 process x 2 samples).
        # Randomness is a function of (seed, step, micro-batch number): resume needs only the step.
        per_proc, n_proc = cfg.samples_per_step, accelerator.num_processes
        logs: dict[str, float] = {}
        total_loss = torch.zeros(())
        for j in range(per_proc):
            micro = accelerator.process_index * per_proc + j
            rng = random.Random(cfg.seed * 7919 + step * 31 + micro)
            torch.manual_seed(cfg.seed * 1_000_003 + step * 101 + micro)
            index = curriculum_index(step * n_proc * per_proc + micro, cfg.steps * n_proc * per_proc, len(paths),
                                     cfg.seed)
            sample = load_sample(paths[index])
            layers_all = sample["layers"].tolist()
            layers = sorted(rng.sample(layers_all, min(cfg.layers_per_step or len(layers_all), len(layers_all))))
            loss, logs = training.step_loss(raw, sample, layers, cfg, step, rng)
            total_loss = total_loss + loss.detach().float().cpu()
            if ds:  # the engine divides by samples_per_step, reduces, clips and steps after the last one
                stop_unless_finite(accelerator, step, run_dir, loss=loss.detach().float().cpu())
                with accelerator.accumulate(adapter):
                    accelerator.backward(loss)
            else:
                accelerator.backward(loss / per_proc)
        if ds:
            stop_unless_finite(accelerator, step, run_dir, grad_norm=deepspeed_engine.global_grad_norm(adapter),
                               adapter=raw)
        else:
            average_gradients(accelerator, adapter, raw)
            stop_unless_finite(accelerator, step, run_dir, loss=total_loss, grad_norm=gradient_norm(raw))
            if cfg.grad_clip > 0:
                accelerator.clip_grad_norm_(raw.parameters(), cfg.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            stop_unless_finite(accelerator, step, run_dir, adapter=raw)  # an update can overflow too
        bar.update(1)
        if logs and (step % cfg.log_every == 0 or step == 1):
            bar.set_postfix(loss=f"{logs['loss']:.4f}")
            say(f"step {step}: " + " ".join(f"{k}={v:.4f}" for k, v in logs.items())
                + f" len={sample['ids'].shape[0]} ({time.time() - t0:.0f}s)")
            if log_with:
                accelerator.log({f"train/{k}": v for k, v in logs.items()}, step=step)
        if step % cfg.save_every == 0 or step == cfg.steps:
            accelerator.wait_for_everyone()
            state = moments.state_dict()  # every process: DeepSpeed gathers its partitions
            if accelerator.is_main_process:
                save_checkpoint(run_dir, step, cfg, raw, state, shape, fingerprint)
            accelerator.wait_for_everyone()
        if cfg.kill_at_step and step == cfg.kill_at_step:
            os.kill(os.getpid(), signal.SIGKILL)  # tests: a hard kill, no cleanup, no final save
    bar.close()
    check_processes_agree(accelerator, raw)
    out = run_dir / "adapter"
    if accelerator.is_main_process:
        exported = ZoomAdapter.from_modules(raw, cfg.method, adapter_hyper(raw, cfg), shape=shape,
                                            fingerprint=fingerprint, budget=cfg.budget)
        exported.save_pretrained(out, overwrite=True)
        save_resolved(cfg, out)
        say(f"adapter saved to {out}")
        if report_before is not None:  # the method's own numbers on the last cached samples, before and after
            report = {"fresh": report_before, "trained": training.report(raw, cfg, cached[-2:])}
            (run_dir / f"{training.report_name}.json").write_text(json.dumps(report, indent=2))
            say(f"{training.report_name} " + json.dumps(report))
        if cfg.eval_samples:
            write_eval(cfg, evaluate(model, tokenizer, cfg, raw), say)
    accelerator.wait_for_everyone()  # the others wait while the main process writes and evaluates
    accelerator.end_training()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        # Shut the group down together: a process group freed after a peer has exited can block forever.
        torch.distributed.destroy_process_group()
    return out


@torch.inference_mode()
def answer_scores(model, tokenizer, texts: list[tuple[str, str]], methods: dict[str, Any],
                  budget: int) -> dict[str, dict[str, float]]:
    """Teacher-forced answer tokens after one prefill per text, for each method: mean next-token KL to full
    attention, and exact-answer accuracy (every answer token the greedy choice) of the compressed and of
    the full model."""
    from zoomkv import compat
    from zoomkv.memory.replay import cache_from_record, record_prefill

    kls: dict[str, list[float]] = {name: [] for name in methods}
    hits: dict[str, list[bool]] = {name: [] for name in methods}
    full_hits = []
    for prompt, answer in texts:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        ans = tokenizer(answer, add_special_tokens=False, return_tensors="pt")["input_ids"]
        full = model(input_ids=torch.cat([ids, ans], 1)).logits[0, ids.shape[1] - 1 : -1].float()
        full_hits.append(bool((full.argmax(-1) == ans[0]).all()))
        record = record_prefill(model, ids)
        for name, method in methods.items():
            cache = cache_from_record(model, record, method, budget)
            logits = [record.last_logits[0]]
            for i in range(ans.shape[1] - 1):
                pos = torch.tensor([[ids.shape[1] + i]])
                out = model(input_ids=ans[:, i : i + 1], position_ids=pos, use_cache=True,
                            **compat.generate_cache_kwargs(cache))
                logits.append(out.logits[0, -1].float())
            student = torch.stack(logits)
            kl = torch.nn.functional.kl_div(student.log_softmax(-1), full.log_softmax(-1), log_target=True,
                                            reduction="none")
            kls[name].append(float(kl.sum(-1).mean()))
            hits[name].append(bool((student.argmax(-1) == ans[0]).all()))
    n = len(texts)
    return {name: {"kl": sum(kls[name]) / n, "accuracy": sum(hits[name]) / n, "full_accuracy": sum(full_hits) / n}
            for name in methods}


def evaluate(model, tokenizer, cfg: TrainConfig, adapter: torch.nn.Module) -> dict[str, Any]:
    """Held-out samples (other seeds, the longest length): the fresh adapter vs the trained one, and the
    recipe's ``eval_baselines`` (training-free methods) at the same budget."""
    # scored on the answer of a task that has one (plain text has none): passkey when the recipe names none
    answered = {t: w for t, w in cfg.task_mix.items() if t != "plain"} or {"passkey": 1.0}
    held = make_samples(tokenizer, answered, cfg.eval_samples, cfg.max_length, cfg.max_length, cfg.seed + 9973,
                        load_corpus(cfg))
    texts = []
    for s in held:
        cut = s.text.rindex(s.answer)
        texts.append((s.text[:cut].rstrip(" "), " " + s.answer))
    methods: dict[str, Any] = {name: cfg.training.make_method(modules, cfg)
                               for name, modules in (("fresh", None), ("trained", adapter))}
    for name in (b.strip() for b in cfg.eval_baselines.split(",") if b.strip()):
        methods[name] = get_method(name)
    return {"budget": cfg.budget, "samples": len(texts), "length": cfg.max_length,
            **answer_scores(model, tokenizer, texts, methods, cfg.budget)}


def evaluate_run(cfg: TrainConfig) -> dict[str, Any]:
    """``--eval-only``: score the run's saved adapter (``<run>/adapter``) as the end of training does."""
    from zoomkv.models import load_model

    folder = cfg.run_dir / "adapter"
    if not folder.is_dir():
        raise ConfigError(f"no trained adapter at {folder}: train the recipe first")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    model, tokenizer = load_model(cfg.model)
    loaded = ZoomAdapter.from_pretrained(folder, local_files_only=True)
    loaded.check_base(model)
    scores = evaluate(model, tokenizer, cfg, loaded.modules)
    write_eval(cfg, scores, print)
    return scores


def write_eval(cfg: TrainConfig, scores: dict[str, Any], say: Any) -> None:
    (cfg.run_dir / "eval.json").write_text(json.dumps(scores, indent=2))
    say("eval " + json.dumps(scores))
