"""The evaluation loop: every method × budget × task × length × sample, one prefill per prompt batch.

For each batch of prompts the model prefills once (``generate_methods``) and every configuration still
missing a row decodes from that shared prefill; its rows (score, bytes per tier, timings) are appended
to ``rows.jsonl`` before the next batch starts. Everything is validated before the model loads, so a
typo costs a second, not a prefill; a resumed run with nothing left to do loads no model at all. Under a
multi-process launcher the batches are shared out (``zoomkv.eval.shards``).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from zoomkv.data.files import DataTask, load_data
from zoomkv.data.haystack import DEFAULT_PROSE, Haystack, text_haystack
from zoomkv.data.sample import PromptFormat, Sample
from zoomkv.errors import ZoomKVError
from zoomkv.eval.metrics import score
from zoomkv.eval.rows import PART_GLOB, RowStore, check_eval_folder, row_key
from zoomkv.eval.shards import Processes, batch_of, join_processes
from zoomkv.eval.tasks import GRID_TASK, SYNTHETIC_TASKS, TaskBuilder, check_task_names, row_task
from zoomkv.generation import GenerationResult, generate_methods, generate_turns
from zoomkv.locks import acquire_on_main, lock_inside
from zoomkv.runspec import RunSpec, parse_runs

log = logging.getLogger(__name__)


@dataclass
class EvalConfig:
    model: str
    out: str | Path
    methods: list[str] = field(default_factory=lambda: ["full"])
    budgets: list[str] = field(default_factory=list)
    tasks: list[str] = field(default_factory=list)
    lengths: list[int] = field(default_factory=lambda: [4096])
    lengths_defaulted: bool = False  # the command line gave no --length: records cut to the default are warned of
    samples: int = 4
    data: list[str] = field(default_factory=list)
    data_format: str = "auto"
    haystack: str = DEFAULT_PROSE  # the prose of the essay tasks: a data source, or "noise"
    diagnose: bool = False  # rows carry the share of full attention each method's selections kept
    grid_lengths: list[int] = field(default_factory=list)
    grid_depths: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    # {method: {key: value}}; zoomkv.runspec.ALL_METHODS ("*"): every method and adapter named
    method_args: dict[str, dict[str, Any]] = field(default_factory=dict)
    adapters: list[str] = field(default_factory=list)  # adapter folders or Hub ids, each evaluated as a method
    tail_summary: bool = False  # +tail on every method and adapter named
    kv_quant: str | None = None  # +int8 / +int4 on every method and adapter named
    kv_quant_tiers: str | None = None  # where they quantize (zoomkv.runspec)
    batch_size: int = 1
    seed: int = 0
    chat: bool | None = False
    max_new_tokens: int | None = None
    dtype: str = "float32"
    device: str = "auto"
    overwrite: bool = False
    report_only: bool = False  # run nothing: summary and plots of the rows already in ``out`` (e.g. several runs' rows.jsonl put together)
    plots: bool = True
    progress: bool = True
    threads: int | None = None
    command: str = ""
    # query-agnostic: the context is prefilled and compressed without the question, which then extends the
    # compressed cache; query-aware: the whole prompt, question included, is compressed (observation-window
    # methods see the question before they choose)
    protocol: str = "query-agnostic"
    prefill_chunk: int | None = None  # put the prompt (or context) through in pieces of this many tokens


PROTOCOLS = ("query-agnostic", "query-aware")


@dataclass
class Prepared:
    runs: list[RunSpec]
    data: list[DataTask]
    essays: Haystack | None
    groups: list[tuple[str, int, float | None, int]]  # task, length, grid depth, number of samples


def method_runs(cfg: EvalConfig) -> list[RunSpec]:
    """``full`` (the reference, always first), every method at every budget, then every adapter: the run
    grammar of every command (``zoomkv.runspec``), parsed once."""
    return parse_runs(cfg.methods, cfg.adapters, cfg.budgets, method_args=cfg.method_args,
                      tail_summary=cfg.tail_summary, kv_quant=cfg.kv_quant, kv_quant_tiers=cfg.kv_quant_tiers,
                      prefill_chunk=cfg.prefill_chunk, reference=True)


def prepare(cfg: EvalConfig) -> Prepared:
    """Check everything that does not need the model; load data files and essays."""
    if cfg.samples < 1:
        raise ZoomKVError(f"--samples must be at least 1, got {cfg.samples}")
    if cfg.batch_size < 1:
        raise ZoomKVError(f"--batch-size must be at least 1, got {cfg.batch_size}")
    if cfg.protocol not in PROTOCOLS:
        raise ZoomKVError(f"--protocol must be one of {', '.join(PROTOCOLS)}, got {cfg.protocol!r}")
    if cfg.prefill_chunk is not None and cfg.prefill_chunk < 1:
        raise ZoomKVError(f"--prefill-chunk must be a positive number of tokens, got {cfg.prefill_chunk}")
    if cfg.max_new_tokens is not None and cfg.max_new_tokens < 1:
        raise ZoomKVError(f"--max-new-tokens must be at least 1, got {cfg.max_new_tokens}")
    for n in [*cfg.lengths, *cfg.grid_lengths]:
        if n < 1:
            raise ZoomKVError(f"lengths must be positive token counts, got {n}")
    for d in cfg.grid_depths:
        if not 0.0 <= d <= 1.0:
            raise ZoomKVError(f"--grid-depths are fractions of the context in [0, 1], got {d}")
    check_task_names(cfg.tasks)
    runs = method_runs(cfg)
    data = [task for spec in cfg.data for task in load_data(spec, cfg.data_format)]
    clash = sorted({t.name for t in data} & (set(SYNTHETIC_TASKS) | {GRID_TASK}))
    if clash:
        raise ZoomKVError(f"data task name(s) {', '.join(clash)} clash with built-in tasks; name them NAME=FILE")
    if not cfg.tasks and not data and not cfg.grid_lengths:
        raise ZoomKVError("nothing to evaluate: give --tasks, --data or --grid-lengths")
    # the prose is loaded only when a task runs on it (a first load of the shipped corpus takes a second)
    wants_prose = bool(cfg.grid_lengths) or any(SYNTHETIC_TASKS[t].essay for t in cfg.tasks)
    essays = _haystack(cfg.haystack) if wants_prose else None
    if not wants_prose and cfg.haystack not in (DEFAULT_PROSE, "noise"):
        _haystack(cfg.haystack)  # a haystack that does not load is refused whether or not a task reads it
        log.warning("--haystack %s: no task of this run reads a haystack (only the essay tasks marked [uses "
                    "--haystack] in --list-tasks, and the --grid-lengths grid); it is not used", cfg.haystack)
    groups: list[tuple[str, int, float | None, int]] = []
    for length in cfg.lengths:
        groups += [(t, length, None, cfg.samples) for t in cfg.tasks]
        groups += [(t.name, length, None, min(cfg.samples, t.size)) for t in data]
    for length in cfg.grid_lengths:
        groups += [(GRID_TASK, length, round(d, 4), cfg.samples) for d in cfg.grid_depths]
    return Prepared(runs, data, essays, groups)


def _haystack(source: str) -> Haystack:
    try:
        return text_haystack(source)
    except ZoomKVError as err:
        raise ZoomKVError(f"--haystack {source}: {str(err).removeprefix(f'haystack {source}: ')}") from None


def check_lengths(cfg: EvalConfig, model_max: int, model_name: str) -> None:
    """Synthetic prompts are built to their length exactly, so length + new tokens must fit the model
    (data prompts are cut to fit instead)."""
    checks = [(t, n) for t in cfg.tasks for n in cfg.lengths] + [(GRID_TASK, n) for n in cfg.grid_lengths]
    for task, length in checks:
        spec = SYNTHETIC_TASKS.get(task, SYNTHETIC_TASKS["niah_single_1"])
        # a multi-turn task adds each follow-up (a question of ~40 tokens) and its answer
        new = (cfg.max_new_tokens or spec.max_new_tokens) * spec.turns + 40 * (spec.turns - 1)
        if new >= model_max:
            raise ZoomKVError(f"{task}: {new} new tokens alone are over the maximum context of {model_name} "
                              f"({model_max} tokens); lower --max-new-tokens")
        if length + new > model_max:
            raise ZoomKVError(
                f"length {length} for {task} plus its {new} new tokens is over the maximum context of "
                f"{model_name} ({model_max} tokens); use a length of at most {model_max - new}"
            )


def _row(sample: Sample, prompt_tokens: int, b: int, run: RunSpec, result: GenerationResult, batch: int,
         cfg: EvalConfig, fmt: PromptFormat) -> dict[str, Any]:
    """Row of sample ``b`` of a batch under one configuration."""
    prediction = result.texts[b]
    scored = prediction.lstrip("\n").split("\n")[0] if sample.first_line else prediction
    mem = result.memory
    return {
        "method": run.label, "method_args": run.args, "budget": run.budget, "budget_rows": mem.budget,
        "task": sample.task, "length": sample.length,
        "depth": None if sample.depth is None else round(sample.depth, 4), "sample": sample.index,
        "score": round(score(sample.metric, scored, sample.answers, sample.all_classes), 4), "metric": sample.metric,
        # bytes are the batch's totals split evenly: every sequence of a batch holds the same rows
        "device_bytes": mem.device_bytes // batch, "host_bytes": mem.host_bytes // batch,
        "full_kv_bytes": mem.full_kv_bytes // batch,
        "prefill_s": round(result.prefill_s, 4), "decode_ms_per_token": round(result.decode_ms_per_token, 3),
        "prompt_tokens": prompt_tokens, "new_tokens": len(result.token_ids[b]), "batch_size": batch,
        "haystack": sample.haystack, "chat": fmt.uses_chat(sample.chat), "protocol": cfg.protocol,
        "model": cfg.model, "prediction": prediction, "answers": sample.answers,
        **({"diagnostics": result.diagnostics[b]} if result.diagnostics and result.diagnostics[b] else {}),
    }


def _turn_rows(model: Any, tokenizer: Any, samples: list[Sample], texts: list[str], contexts: list[str] | None,
               runs: list[RunSpec], cfg: EvalConfig, fmt: PromptFormat) -> list[dict[str, Any]]:
    """A multi-turn task's rows: one per turn (labelled TASK.TURN), every turn on the same cache, one sample
    at a time."""
    rows = []
    for b, s in enumerate(samples):
        lengths = [cfg.max_new_tokens or s.max_new_tokens] + [cfg.max_new_tokens or t.max_new_tokens
                                                              for t in s.follow_ups]
        per_run = generate_turns(model, tokenizer, texts[b], [t.question + t.answer_prefix for t in s.follow_ups],
                                 [r.cache for r in runs], max_new_tokens=lengths,
                                 context=None if contexts is None else contexts[b])
        for run, results in zip(runs, per_run, strict=True):
            for turn, result in enumerate(results, start=1):
                asked = s if turn == 1 else dataclasses.replace(s, answers=s.follow_ups[turn - 2].answers)
                row = _row(asked, result.prompt_tokens, 0, run, result, 1, cfg, fmt)
                row["task"] = row_task(s.task, turn)
                rows.append(row)
            # generate_turns keeps each run's cache (its turns share it); release it now that its rows are read
            # (a ZoomCache sits in reference cycles only the cyclic GC would free: see ZoomCache.release)
            results[0].cache.release()
    return rows


def _probe_row(task: str, length: int, depth: float | None, index: int, run: RunSpec) -> dict[str, Any]:
    return {"task": row_task(task), "length": length, "depth": depth, "sample": index, "method": run.label,
            "method_args": run.args, "budget": run.budget}


def _checked(sample: Sample, cfg: EvalConfig, fmt: PromptFormat) -> Sample:
    """A built sample the protocol can run: query-agnostic compresses its context before the question, so a
    record without one (a plain record's ``context`` left out) is refused naming the task and sample."""
    if cfg.protocol == "query-agnostic" and not fmt.context_text(sample).strip():
        raise ZoomKVError(f"{sample.task} sample {sample.index}: no context to compress before the question (the "
                          "query-agnostic protocol compresses a record's 'context' first); give the record a "
                          "context, or use --protocol query-aware")
    return sample


def _warm_up(model: Any, tokenizer: Any, runs: list[RunSpec]) -> None:
    """One short run per configuration, so one-time initialisation is not timed as decoding."""
    prompt = "The grass is green. The sky is blue. " * 12
    with contextlib.suppress(Exception):  # only timing depends on it; real errors surface in the run
        generate_methods(model, tokenizer, [prompt], [r.cache for r in runs], max_new_tokens=2, chat=False)


def release_freed_memory() -> None:
    """Hand the heap pages freed by a prompt's caches back to the OS (glibc's ``malloc_trim``): a cache is
    hundreds of MB of tensors, and glibc otherwise keeps the freed pages of its many arenas, so a long run's
    resident memory grows prompt by prompt although nothing stays alive. A no-op elsewhere."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _identity(cfg: EvalConfig, prep: Prepared, chat: bool | None) -> dict[str, Any]:
    """What makes rows comparable (run.json). ``chat`` None: not known before the tokenizer (``--chat auto``).
    The haystack only when a task of this run reads it: a run of noise tasks does not claim the prose."""
    identity = {"model": cfg.model, "chat": chat, "seed": cfg.seed, "dtype": cfg.dtype,
                "max_new_tokens": cfg.max_new_tokens, "protocol": cfg.protocol, "prefill_chunk": cfg.prefill_chunk}
    if prep.essays is not None:
        identity["haystack"] = cfg.haystack
    if cfg.diagnose:  # rows with and without diagnostics do not mix (the key is absent otherwise: older runs resume)
        identity["diagnose"] = True
    return identity


Batch = tuple[str, int, float | None, list[int]]  # task, length, grid depth, sample indices


def plan_batches(cfg: EvalConfig, prep: Prepared) -> list[Batch]:
    """Every prompt batch of the run, in the order one process runs them."""
    return [(task, length, depth, list(range(start, min(start + cfg.batch_size, count))))
            for task, length, depth, count in prep.groups for start in range(0, count, cfg.batch_size)]


def _missing(store: RowStore, batch: Batch, runs: list[RunSpec]) -> list[RunSpec]:
    task, length, depth, indices = batch
    return [r for r in runs if any(not store.has(row_key(_probe_row(task, length, depth, i, r))) for i in indices)]


def run_eval(cfg: EvalConfig, model: Any = None, tokenizer: Any = None) -> list[dict[str, Any]]:
    """Run (or resume) the evaluation ``cfg`` describes; returns every row in ``cfg.out``. Launched as several
    processes (``zoomkv.eval.shards``), each runs its share of the prompt batches and the main process merges
    the rows and writes the outputs."""
    prep = prepare(cfg)
    if cfg.threads is not None:
        if cfg.threads < 1:
            raise ZoomKVError(f"--threads must be at least 1, got {cfg.threads}")
        torch.set_num_threads(cfg.threads)
    if cfg.report_only and cfg.overwrite:
        raise ZoomKVError("--report-only reports the rows in --out; --overwrite would discard them")
    out = Path(cfg.out).expanduser()
    if cfg.report_only and not ((out / "rows.jsonl").is_file() or any(out.glob(PART_GLOB))):
        raise ZoomKVError(f"--report-only: no rows in {cfg.out} to report")  # before RowStore makes the folder
    check_eval_folder(out, report_only=cfg.report_only)  # a folder of other files, or a file of theirs in the way
    procs = join_processes(cfg.device)
    # One writer per --out: two evaluations of one folder would each append every row to rows.jsonl
    lock = lock_inside(out, "eval", "--out")
    acquire_on_main(lock, procs.main)
    try:
        rows = _run_locked(cfg, prep, procs, model, tokenizer)
    finally:
        lock.release()
    procs.close()
    return rows


def _run_locked(cfg: EvalConfig, prep: Prepared, procs: Processes, model: Any, tokenizer: Any) -> list[dict[str, Any]]:
    """``run_eval`` once ``--out`` is this evaluation's alone."""
    store = RowStore(cfg.out, part=procs.rank if procs.world > 1 else None)
    if not cfg.overwrite:
        store.check_identity(_identity(cfg, prep, cfg.chat), resuming=not cfg.report_only)  # every process alike
    procs.wait()
    if cfg.overwrite and procs.main:
        store.clear()
    procs.wait()  # nobody reads the folder before the main process has cleared it
    store.load()
    batches = plan_batches(cfg, prep)
    pending = [] if cfg.report_only else [i for i, b in enumerate(batches) if _missing(store, b, prep.runs)]
    chat = cfg.chat
    if not pending:
        if not cfg.report_only:
            log.info("nothing left to do: the %d prompt batches of this command all have their rows in %s; "
                     "writing the summary and plots of the %d rows there", len(batches), cfg.out, len(store.rows))
        recorded = store.recorded_identity().get("chat")
        chat = recorded if chat is None and isinstance(recorded, bool) else chat
    else:
        model, tokenizer, chat = _run_batches(cfg, prep, procs, store, batches, pending, model, tokenizer)
    procs.wait()  # every process's rows are on disk
    if procs.main:
        order = {(t, n, d, i): b for b, (t, n, d, indices) in enumerate(batches) for i in indices}
        store.merge(lambda r: order.get(batch_of(r), len(batches)))
        _write_report(cfg, prep, store, chat, procs.world)
    procs.wait()
    return store.rows if procs.main else store.load()


def _run_batches(cfg: EvalConfig, prep: Prepared, procs: Processes, store: RowStore, batches: list[Batch],
                 pending: list[int], model: Any, tokenizer: Any) -> tuple[Any, Any, bool]:
    """Load the model (the main process first: a first load converts and caches it) and run this process's
    share of the pending batches; returns the model, tokenizer and whether prompts used a chat template."""
    from zoomkv.models import context_limit

    if model is None:
        from zoomkv.models import load_model, parse_dtype, resolve_device

        if not procs.main:
            procs.wait()
        model, tokenizer = load_model(cfg.model, dtype=parse_dtype(cfg.dtype),
                                      device=procs.device or resolve_device(cfg.device))
        if procs.main:
            procs.wait()
    model_max = context_limit(model)
    check_lengths(cfg, model_max, cfg.model)
    for run in prep.runs:  # now, not in the warm-up: another base model than an adapter's (naming both
        run.cache.check_model(model)  # fingerprints), a budget over the model's context
    fmt = PromptFormat(tokenizer, cfg.chat)
    torch.manual_seed(cfg.seed)
    identity = _identity(cfg, prep, fmt.chat)
    store.check_identity(identity)  # the chat setting, now that the tokenizer says what auto means
    builder = TaskBuilder(fmt, seed=cfg.seed, model_max=model_max, essays=prep.essays, data=prep.data)
    if procs.main:
        say_records_cut(cfg, prep, fmt, model_max)
    # Build each group's first sample before any decoding (every process, every group: a failure is everyone's
    # at once) and before anything is written: a length too short for a task's template, a record too long for
    # the model or without the context the protocol compresses fails now, not after an hour of other tasks, and
    # leaves no run.json (nor a new --out) behind.
    built = {(t, n, d, ix[0]): _checked(builder.build(t, n, ix[0], d), cfg, fmt)
             for t, n, d, ix in (batches[i] for i in pending) if ix[0] == 0}
    procs.wait()
    if procs.main:
        store.record_identity(identity)
    todo = [batches[i] for i in pending if procs.mine(i)]
    if procs.world > 1:
        log.info("%d of %d prompt batches left; %d processes take them in turn", len(pending), len(batches),
                 procs.world)
    if todo:
        _warm_up(model, tokenizer, prep.runs)
    from tqdm.auto import tqdm

    mine = sum(1 for i in range(len(batches)) if procs.mine(i))
    bar = tqdm(total=mine, initial=mine - len(todo), unit="batch", disable=not cfg.progress or not procs.main,
               desc="eval", dynamic_ncols=True)
    try:
        for batch in todo:
            task, length, depth, indices = batch
            bar.set_description(f"{task}@{length}" + (f" depth {depth:.2f}" if depth is not None else ""))
            missing = _missing(store, batch, prep.runs)
            samples = [built.pop((task, length, depth, i), None) or _checked(builder.build(task, length, i, depth), cfg,
                                                                             fmt) for i in indices]
            texts = [fmt.sample_text(s) for s in samples]
            new = cfg.max_new_tokens or max(s.max_new_tokens for s in samples)
            # query-agnostic: each prompt's context is compressed first; its question then extends the cache
            contexts = [fmt.context_text(s) for s in samples] if cfg.protocol == "query-agnostic" else None
            if any(s.follow_ups for s in samples):
                store.append(_turn_rows(model, tokenizer, samples, texts, contexts, missing, cfg, fmt))
                bar.update(1)
                continue
            results = generate_methods(model, tokenizer, texts, [r.cache for r in missing],
                                       max_new_tokens=new, chat=False, contexts=contexts, diagnose=cfg.diagnose,
                                       focus=[list(s.answers) for s in samples])
            counts = [fmt.count(t) for t in texts]
            rows = [_row(s, counts[b], b, run, res, len(samples), cfg, fmt)
                    for run, res in zip(missing, results, strict=True) for b, s in enumerate(samples)]
            store.append(rows)
            del results
            release_freed_memory()
            full = [r["score"] for r in rows if r["method"] == "full"]
            if full:
                bar.set_postfix(full=f"{sum(full) / len(full):.0f}")
            bar.update(1)
    finally:
        bar.close()
    return model, tokenizer, fmt.chat


def say_records_cut(cfg: EvalConfig, prep: Prepared, fmt: PromptFormat, model_max: int) -> None:
    """How many of each data task's records are cut in the middle to the length, and to what: a warning when
    the length is the default nobody chose (a file of 8K prompts scored at 4K would be read as a method's
    failure), a note when --length asked for it."""
    tasks = {t.name: t for t in prep.data}
    for name, length, _, count in prep.groups:
        task = tasks.get(name)
        cut = task.records_cut(fmt, length, count, model_max=model_max) if task is not None else 0
        if not cut:
            continue
        if cfg.lengths_defaulted and length < model_max:
            log.warning("--data %s: %d of %d records are longer than %d tokens (--length's default) and are cut in "
                        "the middle to fit; give --length up to %d (the model's limit) to keep more of them",
                        name, cut, count, length, model_max)
        elif cfg.lengths_defaulted:
            log.warning("--data %s: %d of %d records are longer than the model reads (%d tokens, less each record's "
                        "answer) and are cut in the middle to fit", name, cut, count, model_max)
        else:
            log.info("--data %s: %d of %d records are cut in the middle to fit --length %d", name, cut, count, length)


def _write_report(cfg: EvalConfig, prep: Prepared, store: RowStore, chat: bool | None, processes: int) -> None:
    from zoomkv.eval.report import write_outputs

    header = {"model": cfg.model, "command": cfg.command, "protocol": cfg.protocol,
              "prefill_chunk": cfg.prefill_chunk, "chat": chat, "seed": cfg.seed,
              "samples": cfg.samples, "lengths": ",".join(map(str, cfg.lengths)), "batch_size": cfg.batch_size,
              "processes": processes,
              "config": {k: v for k, v in dataclasses.asdict(cfg).items() if k != "out"}}
    if cfg.report_only:  # the rows' own sample counts and lengths, not this command's defaults
        per_cell = Counter((r["method"], r["budget"], r["task"], r["length"]) for r in store.rows)
        header["samples"] = ",".join(map(str, sorted(set(per_cell.values())))) or None
        header["lengths"] = ",".join(map(str, sorted({r["length"] for r in store.rows}))) or None
        header.pop("processes")  # this command ran nothing
    store.record_outputs([], writing=True)  # a report killed midway leaves the files it wrote claimed
    paths = write_outputs(store.rows, store.out, header, list(dict.fromkeys(r.label for r in prep.runs)),
                          plots=cfg.plots)
    store.record_outputs(paths)
