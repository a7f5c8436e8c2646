"""``zoomkv bench``: prefill and per-token decode time of methods vs ``full``, measured in one process.

Runs are interleaved (hf, full, m1, m2, hf, full, m1, m2, ...) and repeated, so machine noise hits every method
alike; the table reports medians and ratios to ``full`` and to ``hf`` (the same model and prompts through plain
transformers: its own ``DynamicCache`` and sdpa, no zoomkv; ``--no-hf`` leaves it out) from the same run, plus
device/host bytes.
``--batch-size N`` decodes N prompts together (tokens per second counts all of them); ``--sync-audit`` also
runs a few decode steps of each configuration under ``zoomkv.memory.sync_audit`` and reports the ops that
would make the host wait for the device, and the ops a step computes (on a GPU about one kernel launch each).
A configuration the device cannot hold is a row saying so. What to time comes parsed (``zoomkv.runspec``:
methods, adapters, variants, budgets), ``full`` first.
Every speed claim in BENCHMARKS.md is this command's output.
"""

from __future__ import annotations

import gc
import json
import logging
import platform
import statistics
import time
from collections.abc import Collection
from typing import Any

import torch

from zoomkv.data.passkey import passkey_prompt
from zoomkv.errors import ZoomKVError
from zoomkv.generation import GenerationResult, generate_plain, generate_text
from zoomkv.memory.pinned import HostMemoryError
from zoomkv.native import cpu_info
from zoomkv.runspec import REFERENCE, RunSpec, with_prefill_chunk

log = logging.getLogger(__name__)

HF = "hf"  # the plain-transformers row: no zoomkv cache, no zoomkv attention


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def _cell(value: Any, spec: str = "") -> str:
    """A table cell: ``-`` where nothing was measured (a run out of memory, a reference that did not run)."""
    return "-" if value is None else format(value, spec)


def _progress(t0: float, message: str) -> None:
    """One log line per stage (stdout stays the table or the JSON), so a slow stage shows itself."""
    log.info("[bench %7.1fs] %s", time.perf_counter() - t0, message)


def run_bench(args: Any, runs: list[RunSpec]) -> list[dict[str, Any]]:
    """Time every run of ``runs`` (``full`` first: the reference the ratios are to), interleaved, and print the
    table (or the JSON); returns its rows."""
    from zoomkv.models import context_limit, load_model, parse_dtype, resolve_device

    chunks = _check_settings(args)
    batch = getattr(args, "batch_size", 1)
    t0 = time.perf_counter()
    random_weights = bool(getattr(args, "random_weights", False))
    _progress(t0, f"loading {args.model}" + (" (random weights)" if random_weights else ""))
    model, tokenizer = load_model(args.model, dtype=parse_dtype(args.dtype), device=resolve_device(args.device),
                                  random_weights=random_weights)
    if args.length + args.new_tokens > context_limit(model):
        raise ZoomKVError(f"--length {args.length} plus --new-tokens {args.new_tokens} is over {args.model}'s maximum "
                          f"context of {context_limit(model)} tokens")
    for run in runs:
        run.cache.check_model(model)  # another base model than an adapter's, a budget over the model's context
    _check_batch_fits(model, batch, args.length + args.new_tokens)
    _progress(t0, f"model on {model.device}; building a {args.length}-token prompt")
    # One prompt per sequence of the batch: the same length, each with its own pass key.
    prompts = [passkey_prompt(tokenizer, args.length, depth=0.5, seed=i).text for i in range(batch)]

    configs: list[RunSpec | None] = [with_prefill_chunk(run, chunk) for chunk in [None, *chunks] for run in runs]
    reference = next((i for i, c in enumerate(configs) if c.label == REFERENCE), None)
    if reference != 0:
        raise ZoomKVError("bench times every run against full: full must come first")
    with_hf = not getattr(args, "no_hf", False)
    if with_hf:
        configs.insert(0, None)  # None: the hf row
        reference = 1

    def timed(run: RunSpec | None, new: int, texts: list[str] = prompts) -> tuple[GenerationResult, int | None]:
        cuda = model.device.type == "cuda"
        if cuda:
            import torch

            torch.cuda.synchronize(model.device)
            base = torch.cuda.memory_allocated(model.device)
            torch.cuda.reset_peak_memory_stats(model.device)
        if run is None:
            r = generate_plain(model, tokenizer, texts, max_new_tokens=new, chat=False, stop_at_eos=False)
        else:
            r = generate_text(model, tokenizer, texts, run.cache, max_new_tokens=new, chat=False, stop_at_eos=False)
        return r, (torch.cuda.max_memory_allocated(model.device) - base) if cuda else None

    # warm-up: one short run per configuration so lazy initialisation (and kernel compilation) is not timed
    warm_length = getattr(args, "warmup_length", 0) or args.length
    warm_prompts = prompts if warm_length >= args.length else \
        [passkey_prompt(tokenizer, max(64, warm_length), depth=0.5, seed=i).text for i in range(batch)]
    # configurations the device (or the host, for a host tier) could not hold, and which: their rows say so, the
    # rest go on
    out_of_memory: dict[int, str] = {}

    def attempt(i: int, new: int, texts: list[str]) -> tuple[GenerationResult, int | None] | None:
        if i in out_of_memory:
            return None
        try:
            return timed(configs[i], new, texts)
        except torch.OutOfMemoryError:
            out_of_memory[i] = "device"
        except HostMemoryError:
            out_of_memory[i] = "host"
        # out of the handler: its traceback no longer holds the failed run's tensors, so their memory goes back
        _progress(t0, f"{_name(configs[i])}: out of {out_of_memory[i]} memory")
        if model.device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()
        return None

    for i, run in enumerate([] if getattr(args, "no_warmup", False) else configs):
        _progress(t0, f"warm-up {_name(run)}")
        attempt(i, 4, warm_prompts)

    samples: list[list[tuple[GenerationResult, int | None]]] = [[] for _ in configs]
    for rep in range(args.repeats):
        _progress(t0, f"repeat {rep + 1}/{args.repeats}")
        for i in range(len(configs)):
            result = attempt(i, args.new_tokens, prompts)
            if result is not None:
                samples[i].append(result)
    if len(out_of_memory) == len(configs):
        raise ZoomKVError(f"every configuration ran out of {model.device}'s memory; use a smaller --batch-size or "
                          "--length")

    # neither audited nor profiled: the configurations that ran out of memory
    syncs = _sync_audit(model, tokenizer, prompts, configs, t0, skip=out_of_memory) \
        if getattr(args, "sync_audit", False) else {}
    profiles = _profile(model, tokenizer, prompts, configs, args.new_tokens, t0, skip=out_of_memory) \
        if getattr(args, "profile", False) else {}

    def median(i: int | None, field: str) -> float | None:
        return statistics.median(getattr(r, field) for r, _ in samples[i]) if i is not None and samples[i] else None

    rows = []
    full_prefill, full_decode = median(reference, "prefill_s"), median(reference, "decode_ms_per_token")
    hf_prefill = median(0, "prefill_s") if with_hf else None
    hf_decode = median(0, "decode_ms_per_token") if with_hf else None
    for i, (run, results) in enumerate(zip(configs, samples, strict=True)):
        if not results:
            rows.append(None)  # filled below, with the measured rows' keys
            continue
        prefill = statistics.median(r.prefill_s for r, _ in results)
        decode = statistics.median(r.decode_ms_per_token for r, _ in results)
        last, cuda_peak = results[-1]
        mem = last.memory
        rows.append({
            "method": _name(run, budget=False),
            "budget": mem.budget,
            "prefill_chunk": None if run is None else run.cache.prefill_chunk,
            "batch_size": batch,
            "prompt_tokens": last.prompt_tokens,
            "out_of_memory": False, "out_of": None,
            "prefill_s": round(prefill, 4),
            "prefill_ratio": _ratio(prefill, full_prefill),
            "decode_ms_per_token": round(decode, 3),
            "decode_ratio": _ratio(decode, full_decode),
            "prefill_hf_ratio": _ratio(prefill, hf_prefill),
            "decode_hf_ratio": _ratio(decode, hf_decode),
            "decode_tokens_per_s": round(batch * 1000 / decode, 1) if decode > 0 else None,  # every sequence's
            "syncs_per_step": syncs[i][0] if i in syncs else None,  # with --sync-audit: host waits per decode step
            "ops_per_step": syncs[i][1] if i in syncs else None,  # and ops that compute (views left out)
            # and launches with each step a GPU captures in a CUDA graph counted as its replay (zoomkv.memory.graphs)
            "launches_per_step_captured": syncs[i][2] if i in syncs else None,
            "device_bytes": mem.device_bytes,
            "host_bytes": mem.host_bytes,
            "full_kv_bytes": mem.full_kv_bytes,
            "peak_device_bytes": mem.peak_device_bytes,
            "peak_device_rows": mem.peak_device_rows,
            "cuda_peak_bytes": cuda_peak,  # torch.cuda.max_memory_allocated over the run, above what was allocated before
            "profile_ms": profiles.get(i),  # with --profile: ms per decode step in each phase (a run of its own)
        })
    measured = next(r for r in rows if r is not None)  # there is one: a run with none measured raised above
    rows = [r if r is not None else _out_of_memory_row(configs[i], batch, measured, out_of_memory[i])
            for i, r in enumerate(rows)]
    if getattr(args, "json", False):
        print(json.dumps({"model": args.model, "random_weights": random_weights, "device": str(model.device),
                          "processor": processor_name(model.device), "threads": torch.get_num_threads(),
                          "dtype": str(model.dtype).removeprefix("torch."), "length": args.length, "new_tokens": args.new_tokens,
                          "repeats": args.repeats, "batch_size": batch, "rows": rows}))
    else:
        weights = " (random weights: timing only)" if random_weights else ""
        tokens = next(r["prompt_tokens"] for r in rows if not r["out_of_memory"])
        print(f"model {args.model}{weights} on {model.device} ({_machine(model.device)}) in "
              f"{str(model.dtype).removeprefix('torch.')}, "
              f"prompt {tokens} tokens" + (f" x {batch} sequences" if batch > 1 else "")
              + f", {args.new_tokens} new tokens, median of {args.repeats} interleaved runs")
        print()
        cuda = any(r["cuda_peak_bytes"] is not None for r in rows)
        audit = bool(syncs)
        hf = " × hf |" if with_hf else ""
        print("| method | budget | prefill chunk | prefill s | × full |" + hf + " decode ms/token | × full |" + hf
              + " decode tok/s | device MiB | peak device MiB | peak rows | host MiB | full KV MiB |"
              + (" CUDA peak MiB |" if cuda else "") + (" syncs/step | ops/step | captured |" if audit else ""))
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if with_hf else "")
              + ("---|" if cuda else "") + ("---|---|---|" if audit else ""))
        for r in rows:
            cells = [r["method"], _cell(r["budget"]), r["prefill_chunk"] or "one-shot"]
            if r["out_of_memory"]:  # nothing measured: one cell says why
                width = 10 + 2 * with_hf + cuda + 3 * audit
                print("| " + " | ".join(map(str, cells + [f"out of {r['out_of']} memory"] + ["-"] * (width - 1)))
                      + " |")
                continue
            cells += [_cell(r["prefill_s"], ".3f"), _cell(r["prefill_ratio"], ".2f")]
            cells += [_cell(r["prefill_hf_ratio"], ".2f")] if with_hf else []
            cells += [_cell(r["decode_ms_per_token"], ".2f"), _cell(r["decode_ratio"], ".2f")]
            cells += [_cell(r["decode_hf_ratio"], ".2f")] if with_hf else []
            cells += [_cell(r["decode_tokens_per_s"]), _mib(r["device_bytes"]), _mib(r["peak_device_bytes"]),
                      r["peak_device_rows"], _mib(r["host_bytes"]), _mib(r["full_kv_bytes"])]
            cells += [_mib(r["cuda_peak_bytes"])] if cuda else []
            cells += [_cell(r["syncs_per_step"], "g"), _cell(r["ops_per_step"]),
                      _cell(r["launches_per_step_captured"])] if audit else []
            print("| " + " | ".join(map(str, cells)) + " |")
        if profiles:
            _print_profile(rows)
    return rows


PHASES = ("selection", "recall", "append", "attention", "rest")


def _profile(model: Any, tokenizer: Any, prompts: list[str], configs: list[RunSpec | None], new_tokens: int,
             t0: float, skip: Collection[int] = frozenset()) -> dict[int, dict[str, float]]:
    """Per configuration (by index in ``configs``): ms per decode step in each phase of the compressed layers
    (zoomkv.protocol.phases), from one more run of ``new_tokens`` under the phase clock; ``rest`` is the step's
    time outside them (the model's own layers, dense layers, sampling)."""
    import torch

    from zoomkv.protocol.phases import PhaseClock, measuring

    cuda = model.device.type == "cuda"
    found = {}
    for i, run in enumerate(configs):
        if run is None or i in skip:  # hf: no zoomkv phases to split
            continue
        clock = PhaseClock(sync=(lambda: torch.cuda.synchronize(model.device)) if cuda else None)
        with measuring(clock):
            result = generate_text(model, tokenizer, prompts, run.cache, max_new_tokens=new_tokens, chat=False,
                                   stop_at_eos=False)
        steps = max(result.new_tokens - 1, 1)  # the decode steps after the prefill's first token
        t = {name: 1000 * sec / steps for name, sec in clock.totals.items()}
        select, recall = t.get("select", 0.0), t.get("recall", 0.0)
        parts = {"selection": select - recall, "recall": recall, "append": t.get("append", 0.0),
                 "attention": t.get("attend", 0.0)}
        parts["rest"] = result.decode_ms_per_token - sum(parts.values())
        found[i] = {name: round(v, 2) for name, v in parts.items()} | {"step": round(result.decode_ms_per_token, 2)}
        _progress(t0, f"profiled {_name(run)}")
    return found


def _print_profile(rows: list[dict[str, Any]]) -> None:
    print()
    print("Where a decode step goes (ms per step, one run under the phase clock: `--profile`): selection = "
          "scoring and top-k, recall = host rows into the device tier (and the summary row), append = the new "
          "row into the tiers and the index, attention = over the selected rows, rest = the model outside them.")
    print()
    print("| method | budget | step ms | " + " | ".join(PHASES) + " |")
    print("|---|---|---|" + "---|" * len(PHASES))
    for r in rows:
        p = r["profile_ms"]
        if p is None:
            continue
        print(f"| {r['method']} | {r['budget'] if r['budget'] is not None else '-'} | {p['step']:.1f} | "
              + " | ".join(f"{p[name]:.1f}" for name in PHASES) + " |")


SYNC_AUDIT_STEPS = 4


def _sync_audit(model: Any, tokenizer: Any, prompts: list[str], configs: list[RunSpec | None],
                t0: float, skip: Collection[int] = frozenset()) -> dict[int, tuple[float, int, int]]:
    """Per configuration (one-shot prefill only, by index in ``configs``): the ops per decode step that would
    make the host wait for the device, the ops that compute (a GPU's kernel launches, about), and those launches
    with each step a GPU captures in a CUDA graph counted as its one replay, over ``SYNC_AUDIT_STEPS`` steps after
    a fresh prefill (zoomkv.memory.sync_audit)."""
    from transformers import DynamicCache

    from zoomkv.generation import encode_prompts
    from zoomkv.memory import ZoomCache
    from zoomkv.memory.sync_audit import audit_decode, summarize
    from zoomkv.models import context_limit

    inputs = encode_prompts(tokenizer, prompts, max_length=context_limit(model), max_new_tokens=SYNC_AUDIT_STEPS,
                            device=model.device)
    found = {}
    for i, run in enumerate(configs):
        if i in skip or (run is not None and run.cache.prefill_chunk is not None):
            continue
        cache = DynamicCache() if run is None else ZoomCache(model, run.cache, tokenizer=tokenizer)
        audits = audit_decode(model, cache, inputs["input_ids"], inputs["attention_mask"], SYNC_AUDIT_STEPS)
        found[i] = (round(sum(len(a.events) for a in audits) / len(audits), 2),
                    round(sum(a.ops for a in audits) / len(audits)),
                    round(sum(a.launches_captured for a in audits) / len(audits)))
        _progress(t0, f"sync audit {_name(run)}: " + summarize(audits).replace("\n", "\n    "))
    return found


def _out_of_memory_row(run: RunSpec | None, batch: int, measured: dict[str, Any], memory: str) -> dict[str, Any]:
    """The row of a configuration the device (``memory="device"``) or the host could not hold: a measured row's
    keys, only its name filled."""
    return {**dict.fromkeys(measured), "method": _name(run, budget=False),
            "budget": None if run is None else run.budget,
            "prefill_chunk": None if run is None else run.cache.prefill_chunk, "batch_size": batch,
            "out_of_memory": True, "out_of": memory}


def processor_name(device: torch.device) -> str:
    """What runs the model: the GPU's name, or the CPU's model name (Linux's /proc/cpuinfo; else the platform's).

    Printed above every bench table: the same code times differently on another processor (sekv's prefill
    surprisal at 4K x 4 took 1.4 s on one dev machine, 2.7 s on another), so a time is read with its machine.
    """
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_info("model name") or platform.processor() or platform.machine() or "unknown processor"


def _machine(device: torch.device) -> str:
    name = processor_name(device)
    return name if device.type == "cuda" else f"{name}, {torch.get_num_threads()} threads"


def _name(run: RunSpec | None, budget: bool = True) -> str:
    """A configuration in progress lines: ``quest+tail@128 chunk 512`` (``budget=False``: its row label)."""
    if run is None:
        return HF
    if not budget:
        return run.label
    chunk = run.cache.prefill_chunk
    return run.label + (f"@{run.budget}" if run.budget else "") + (f" chunk {chunk}" if chunk else "")


def _ratio(value: float, reference: float | None) -> float | None:
    return None if reference is None or reference <= 0 else round(value / reference, 3)


def _check_batch_fits(model: Any, batch: int, tokens: int) -> None:
    """``--batch-size``: full KV of the batch (the reference every run is timed against) must fit the device,
    checked before its prompts are built (``--batch-size 100000000`` would build prompts for ever). On a GPU a
    batch over it is timed all the same, up to four times the device's memory: ``hf`` and ``full`` run out of it
    (their rows say so) while a method holding B rows may decode; the CPU's memory is refused."""
    from zoomkv import compat
    from zoomkv.models.loading import device_memory_bytes

    config = compat.text_config(model.config)
    layers = len(compat.layer_types(model.config))
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    size = next(model.parameters()).element_size()
    need = batch * tokens * layers * kv_heads * compat.head_dim(model.config) * 2 * size
    have = device_memory_bytes(model.device)
    if have is not None and model.device.type == "cuda" and need <= 4 * have:
        if need > have:
            log.warning("full KV of %d prompts of %d tokens takes %.3g GiB, more than %s's %.3g GiB: hf and full "
                        "will run out of memory", batch, tokens, need / 2**30, model.device, have / 2**30)
        return
    if have is not None and need > have:
        raise ZoomKVError(f"--batch-size {batch}: full KV of {batch} prompts of {tokens} tokens takes "
                          f"{need / 2**30:.3g} GiB, more than {model.device}'s {have / 2**30:.3g} GiB; use a smaller "
                          "batch or --length")


def _check_settings(args: Any) -> list[int]:
    """The timing settings, checked before the model loads; returns the --prefill-chunk sizes to compare."""
    if args.repeats < 1 or args.new_tokens < 2:
        raise ZoomKVError("--repeats must be ≥ 1 and --new-tokens ≥ 2")
    batch = getattr(args, "batch_size", 1)
    if batch < 1:
        raise ZoomKVError(f"--batch-size must be at least 1, got {batch}")
    if args.length < 64:
        raise ZoomKVError(f"--length must be at least 64 tokens, got {args.length}")
    try:
        chunks = [int(c) for c in str(getattr(args, "prefill_chunk", "") or "").split(",") if c.strip()]
    except ValueError:
        raise ZoomKVError(f"--prefill-chunk expects whole numbers, got {args.prefill_chunk!r}") from None
    if any(c < 1 for c in chunks):
        raise ZoomKVError(f"--prefill-chunk must be positive, got {args.prefill_chunk!r}")
    return chunks
