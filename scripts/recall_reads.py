"""How many of the rows a step recalls must be read from the host tier when a row the recall buffer already holds
keeps its slot (a GPU machine's recall: ``zoomkv.protocol.recallable.plan_swaps``; each row read there crosses PCIe).

For held-out prompts (RULER needles over a haystack no training saw, built as ``zoomkv eval`` builds them), each
method prefills the whole prompt and decodes ``--new-tokens`` greedy tokens through the torch path a GPU runs, with
that recall on. The table gives the share of the rows asked for that were read, after each layer's first decode
step (which reads them all), with a 95% interval over the prompts: the rows attended, and sekv's candidates' finer
codes (its second stage with ``rescore_from="codes"``, a fresh sekv's). A KIVI host tier reads every row anyway.

    python scripts/recall_reads.py --length 4096 --samples 5 --budgets 128,1024 --methods quest,oracle_topk \\
        --adapter checkpoints/sekv-smollm2-quickstart/adapter
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def prompts(args, tokenizer) -> list[torch.Tensor]:
    from zoomkv.data.haystack import text_haystack
    from zoomkv.data.sample import PromptFormat
    from zoomkv.eval.tasks import TaskBuilder

    fmt = PromptFormat(tokenizer)
    builder = TaskBuilder(fmt, seed=args.seed, model_max=1 << 20, essays=text_haystack(args.haystack), data=[])
    found = []
    for task in args.tasks.split(","):
        for i in range(args.samples):
            text = fmt.sample_text(builder.build(task, args.length, i))
            found.append(tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"])
    return found


def read_shares(model, make_cache, ids: torch.Tensor, new_tokens: int) -> dict[str, float]:
    """Per buffer (``recall``: the rows attended; ``cand``: sekv's candidates' finer codes), the share of rows asked
    for that were read, over the decode steps after each layer's first."""
    from zoomkv import native
    from zoomkv.compat import generate_cache_kwargs
    from zoomkv.methods.sekv import method as sekv
    from zoomkv.protocol import recallable

    counts: dict[str, list[int]] = {}
    plan = recallable.swaps

    def counted(memory, prefix: str, idx: torch.Tensor, fresh: bool = False):
        first = fresh or f"{prefix}_held" not in memory.device_tier
        dest, fetch, rows = plan(memory, prefix, idx, fresh)
        if not first:
            tally = counts.setdefault(prefix, [0, 0])
            tally[0] += int(fetch.sum())
            tally[1] += fetch.numel()
        return dest, fetch, rows

    recallable.swaps = sekv.swaps = counted
    try:
        with torch.no_grad(), native.torch_path(), recallable.recall_misses_only(True):
            cache = make_cache()
            out = model(ids, **generate_cache_kwargs(cache), use_cache=True)
            for _ in range(new_tokens):
                out = model(out.logits[:, -1:].argmax(-1), **generate_cache_kwargs(cache), use_cache=True)
    finally:
        recallable.swaps = sekv.swaps = plan
    return {prefix: read / max(1, asked) for prefix, (read, asked) in counts.items()}


def interval(shares: list[float]) -> str:
    mean = sum(shares) / len(shares)
    sd = math.sqrt(sum((s - mean) ** 2 for s in shares) / max(1, len(shares) - 1))
    half = 1.96 * sd / math.sqrt(len(shares))
    return f"{mean:.2f} [{mean - half:.2f}–{mean + half:.2f}]"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--tasks", default="niah_single_2,niah_multikey_1")
    p.add_argument("--haystack", default="kjv")
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--samples", type=int, default=5, help="prompts per task")
    p.add_argument("--budgets", default="128,1024")
    p.add_argument("--methods", default="quest,oracle_topk", help="training-free methods, by name")
    p.add_argument("--adapter", action="append", default=[], help="a trained adapter's folder (its method)")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    from zoomkv import ZoomCache
    from zoomkv.adapters import cache_from_adapter
    from zoomkv.models import load_model

    model, tokenizer = load_model(args.model)
    found = prompts(args, tokenizer)
    rows = [(name, lambda b, name=name: ZoomCache(model, name, b)) for name in args.methods.split(",") if name]
    rows += [(Path(a).parent.name, lambda b, a=a: cache_from_adapter(model, a, budget=b)) for a in args.adapter]
    print(f"{len(found)} prompts of {args.length} tokens ({args.tasks} over {args.haystack}), {args.new_tokens} steps")
    print("\n| method | B | rows read / rows recalled | candidates' codes read / asked (sekv) |\n|---|---|---|---|")
    for budget in (int(b) for b in args.budgets.split(",")):
        for name, make in rows:
            runs = [read_shares(model, lambda make=make, budget=budget: make(budget), ids, args.new_tokens)
                    for ids in found]
            cells = [interval([r[prefix] for r in runs]) if all(prefix in r for r in runs) else "–"
                     for prefix in ("recall", "cand")]
            print(f"| {name} | {budget} | {cells[0]} | {cells[1]} |", flush=True)

if __name__ == "__main__":
    main()
