"""``zoomkv bench``: prefill and per-token decode time of methods vs ``full``, measured in one process.

Runs are interleaved (full, m1, m2, full, m1, m2, ...) and repeated, so machine noise hits every method
alike; the table reports medians and ratios to ``full`` from the same run, plus device/host bytes.
Every speed claim in BENCHMARKS.md is this command's output.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any

from zoomkv.data.passkey import passkey_prompt
from zoomkv.errors import ZoomKVError
from zoomkv.generation import generate_text


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def _progress(t0: float, message: str) -> None:
    """One line on stderr per stage (stdout stays the table or the JSON), so a slow stage shows itself."""
    print(f"[bench {time.perf_counter() - t0:7.1f}s] {message}", file=sys.stderr, flush=True)


def run_bench(args: Any) -> list[dict[str, Any]]:
    from zoomkv.budget import Budget
    from zoomkv.methods import get_method
    from zoomkv.models import load_model, parse_dtype, resolve_device

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    budgets = [b.strip() for b in str(args.budgets).split(",") if b.strip()]
    for m in methods:
        get_method(m)
    for b in budgets:
        Budget.parse(b)
    if args.repeats < 1 or args.new_tokens < 2:
        raise ZoomKVError("--repeats must be ≥ 1 and --new-tokens ≥ 2")
    t0 = time.perf_counter()
    random_weights = bool(getattr(args, "random_weights", False))
    _progress(t0, f"loading {args.model}" + (" (random weights)" if random_weights else ""))
    model, tokenizer = load_model(args.model, dtype=parse_dtype(args.dtype), device=resolve_device(args.device),
                                  random_weights=random_weights)
    _progress(t0, f"model on {model.device}; building a {args.length}-token prompt")
    prompt = passkey_prompt(tokenizer, args.length, depth=0.5, seed=0)

    configs: list[tuple[str, str | None]] = [("full", None)]
    for m in methods:
        if m == "full":
            continue
        configs += [(m, b) for b in budgets]

    # warm-up: one short run per configuration so lazy initialisation is not timed
    for m, b in configs:
        _progress(t0, f"warm-up {m}" + (f"@{b}" if b else ""))
        generate_text(model, tokenizer, prompt.text, method=m, budget=b, max_new_tokens=2, chat=False, stop_at_eos=False)

    samples: dict[tuple[str, str | None], list[Any]] = {c: [] for c in configs}
    for rep in range(args.repeats):
        _progress(t0, f"repeat {rep + 1}/{args.repeats}")
        for c in configs:
            r = generate_text(model, tokenizer, prompt.text, method=c[0], budget=c[1],
                              max_new_tokens=args.new_tokens, chat=False, stop_at_eos=False)
            samples[c].append(r)

    rows = []
    full_prefill = statistics.median(r.prefill_s for r in samples[("full", None)])
    full_decode = statistics.median(r.decode_ms_per_token for r in samples[("full", None)])
    for (m, _budget), results in samples.items():
        prefill = statistics.median(r.prefill_s for r in results)
        decode = statistics.median(r.decode_ms_per_token for r in results)
        mem = results[-1].memory
        rows.append({
            "method": m,
            "budget": mem.budget,
            "prompt_tokens": results[-1].prompt_tokens,
            "prefill_s": round(prefill, 4),
            "prefill_ratio": round(prefill / full_prefill, 3),
            "decode_ms_per_token": round(decode, 3),
            "decode_ratio": round(decode / full_decode, 3),
            "device_bytes": mem.device_bytes,
            "host_bytes": mem.host_bytes,
            "full_kv_bytes": mem.full_kv_bytes,
        })
    if getattr(args, "json", False):
        print(json.dumps({"model": args.model, "random_weights": random_weights, "device": str(model.device),
                          "dtype": str(model.dtype).removeprefix("torch."), "length": args.length, "new_tokens": args.new_tokens,
                          "repeats": args.repeats, "rows": rows}))
    else:
        weights = " (random weights: timing only)" if random_weights else ""
        print(f"model {args.model}{weights} on {model.device} in {str(model.dtype).removeprefix('torch.')}, "
              f"prompt {rows[0]['prompt_tokens']} tokens, {args.new_tokens} new tokens, "
              f"median of {args.repeats} interleaved runs")
        print()
        print("| method | budget | prefill s | × full | decode ms/token | × full | device MiB | host MiB | full KV MiB |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['method']} | {r['budget'] if r['budget'] is not None else '-'} | {r['prefill_s']:.3f} | "
                  f"{r['prefill_ratio']:.2f} | {r['decode_ms_per_token']:.2f} | {r['decode_ratio']:.2f} | "
                  f"{_mib(r['device_bytes'])} | {_mib(r['host_bytes'])} | {_mib(r['full_kv_bytes'])} |")
    return rows
