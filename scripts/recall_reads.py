"""How many of the rows a step recalls must be read from the host tier when a row the recall buffer already holds
keeps its slot (a GPU machine's recall: ``zoomkv.protocol.recallable.plan_swaps``; each row read there crosses PCIe).

For held-out prompts (RULER needles over a haystack no training saw, built as ``zoomkv eval`` builds them), each
method prefills the whole prompt and decodes ``--new-tokens`` greedy tokens through the torch path a GPU runs, with
that recall on. The table gives the share of the rows asked for that were read, after each layer's first decode
step (which reads them all), with a 95% interval over the prompts.

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


def read_share(model, make_cache, ids: torch.Tensor, new_tokens: int) -> float:
    """The share of rows asked for that were read, over the decode steps after each layer's first."""
    from zoomkv import native
    from zoomkv.protocol import recallable

    counts: list[tuple[int, int, bool]] = []
    plan = recallable.plan_swaps

    def counted(held: torch.Tensor, idx: torch.Tensor):
        dest, fetch, rows = plan(held, idx)
        counts.append((int(fetch.sum()), fetch.numel(), bool((held < 0).all())))
        return dest, fetch, rows

    recallable.plan_swaps = counted
    try:
        with torch.no_grad(), native.torch_path(), recallable.recall_misses_only(True):
            cache = make_cache()
            out = model(ids, past_key_values=cache, use_cache=True)
            for _ in range(new_tokens):
                out = model(out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
    finally:
        recallable.plan_swaps = plan
    later = [(read, asked) for read, asked, first in counts if not first]
    return sum(r for r, _ in later) / max(1, sum(a for _, a in later))


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
    print("\n| method | B | rows read / rows recalled, 95% interval |\n|---|---|---|")
    for budget in (int(b) for b in args.budgets.split(",")):
        for name, make in rows:
            shares = [read_share(model, lambda make=make, budget=budget: make(budget), ids, args.new_tokens) for ids in found]
            mean = sum(shares) / len(shares)
            sd = math.sqrt(sum((s - mean) ** 2 for s in shares) / max(1, len(shares) - 1))
            half = 1.96 * sd / math.sqrt(len(shares))
            print(f"| {name} | {budget} | {mean:.2f} [{mean - half:.2f}–{mean + half:.2f}] |", flush=True)


if __name__ == "__main__":
    main()
