"""Where a prefill's time goes beyond the model's forward: sekv's surprisal and per-layer compression.

Times one-shot prefills of ``full`` and each adapter (interleaved, ``--repeats`` rounds) on the bench's pass-key
prompts and splits what sekv adds: the token surprisal (the LM head over every prompt position), the layers'
compression after it, and the host rows' storing within that (where a quantized host tier codes its rows).
BENCHMARKS.md, "4K, batch 4, and the prefill with a quantized host tier":

    python scripts/prefill_phases.py --batch-size 4 --length 4096 checkpoints/sekv-smollm2-fp32/adapter \\
        checkpoints/sekv-smollm2-quickstart/adapter checkpoints/sekv-smollm2-kivi4g64/adapter
"""

from __future__ import annotations

import argparse
import collections
import time
from collections.abc import Callable
from typing import Any

import torch

import zoomkv.memory.cache as cache_module
from zoomkv.data.passkey import passkey_prompt
from zoomkv.generation import generate_text
from zoomkv.methods.sekv.method import SeKV
from zoomkv.models import load_model
from zoomkv.runspec import parse_runs

spent: collections.Counter[str] = collections.Counter()


def clocked(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[name] += time.perf_counter() - t
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("adapters", nargs="+", help="adapter folders (with +FORMAT variants), as for zoomkv bench")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--budget", default="128")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    model, tokenizer = load_model(args.model, dtype=torch.float32, device=torch.device("cpu"))
    prompts = [passkey_prompt(tokenizer, args.length, depth=0.5, seed=i).text for i in range(args.batch_size)]
    runs = parse_runs(methods=["full"], adapters=args.adapters, budgets=[args.budget], reference=True)
    cache_module.token_surprisal = clocked(cache_module.token_surprisal, "surprisal")
    cache_module.finish_prefill = clocked(cache_module.finish_prefill, "compress")
    SeKV._store_host = clocked(SeKV._store_host, "host rows")
    print("| round | method | prefill s | surprisal s | compress s (all layers) | of it, host rows s |")
    print("|---|---|---|---|---|---|")
    for rep in range(args.repeats):
        for run in runs:
            spent.clear()
            result = generate_text(model, tokenizer, prompts, run.cache, max_new_tokens=1, chat=False,
                                   stop_at_eos=False)
            print(f"| {rep + 1} | {run.label} | {result.prefill_s:.2f} | {spent['surprisal']:.2f} | "
                  f"{spent['compress']:.2f} | {spent['host rows']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
