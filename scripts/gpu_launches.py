"""How many kernels a decode step launches on a GPU, counted on the CPU.

At batch 1 a GPU decode step is bound by its launches (docs/performance.md, "On a GPU"): each torch op that
computes is about one launch, each Triton kernel one. This runs the step the GPU runs (the torch path, the
recall reading only the rows its buffer misses) with the Triton kernels under Triton's interpreter, and counts
the ops that compute (views and allocations left out) with every kernel call as one launch, its inside not
counted. ``--by-place`` lists them by the zoomkv function that issued them.

    python scripts/gpu_launches.py --methods full,quest,oracle_topk,sekv,sekv:rescore_from=host:kv_quant=k8v4

A method is ``NAME`` or ``NAME:KEY=VALUE:...`` (``ZoomCache`` options and hyper-parameters).
"""

from __future__ import annotations

import argparse
import collections
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: its reductions run interpreted too
os.environ.setdefault("ZOOMKV_TRITON", "1")

import torch  # noqa: E402
import triton.runtime.interpreter as interpreter  # noqa: E402

from zoomkv import ZoomCache, native  # noqa: E402
from zoomkv.compat import generate_cache_kwargs  # noqa: E402
from zoomkv.memory import sync_audit  # noqa: E402
from zoomkv.models import load_model  # noqa: E402
from zoomkv.protocol.recallable import recall_misses_only  # noqa: E402

ALLOCATIONS = frozenset({"aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty"})


class Launches(sync_audit.SyncAudit):
    """The ops of a step that would launch a kernel, and where they come from."""

    inside_kernel = 0  # > 0 while a Triton kernel runs under the interpreter (its own ops are not launches)

    def __init__(self):
        super().__init__()
        self.launches = 0
        self.places: collections.Counter = collections.Counter()

    def note(self, what: str) -> None:
        self.launches += 1
        where = sync_audit._location()
        self.places[where.split(":")[0] + " " + where.rsplit(" ", 1)[-1] if "zoomkv" in where else "the model"] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not Launches.inside_kernel and not func.is_view and func._schema.name not in ALLOCATIONS:
            self.note(func._schema.name)
        return super().__torch_dispatch__(func, types, args, kwargs)


ACTIVE: list[Launches] = []
_run = interpreter.GridExecutor.__call__


def _counted(self, *args, **kwargs):
    if ACTIVE and not Launches.inside_kernel:
        ACTIVE[-1].note("triton")
    Launches.inside_kernel += 1
    try:
        return _run(self, *args, **kwargs)
    finally:
        Launches.inside_kernel -= 1


interpreter.GridExecutor.__call__ = _counted


def parse(spec: str) -> tuple[str, dict[str, str]]:
    name, *options = spec.split(":")
    return name, dict(option.split("=", 1) for option in options)


@torch.no_grad()
def count(model, ids: torch.Tensor, spec: str, budget: int, steps: int) -> Launches:
    name, options = parse(spec)
    cache = None if name == "hf" else ZoomCache(model, name, budget, **options)
    out = model(input_ids=ids, **generate_cache_kwargs(cache), use_cache=True)
    cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    for _ in range(steps):  # the last step is counted: every layer past its first decode step
        audit = Launches()
        ACTIVE.append(audit)
        try:
            with audit:
                out = model(input_ids=token, **generate_cache_kwargs(cache), use_cache=True)
        finally:
            ACTIVE.pop()
        token = out.logits[:, -1:].argmax(-1)
    return audit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--length", type=int, default=300)
    parser.add_argument("--budget", type=int, default=64)
    parser.add_argument("--methods", default="hf,full,quest,oracle_topk,sekv,sekv:rescore_from=host:kv_quant=k8v4")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--by-place", action="store_true")
    args = parser.parse_args()
    model, _ = load_model(args.model)
    ids = torch.randint(0, model.config.vocab_size, (1, args.length), generator=torch.Generator().manual_seed(0))
    layers = model.config.num_hidden_layers
    print(f"{args.model} ({layers} layers), {args.length} tokens, B={args.budget}, batch 1: launches a decode step\n")
    print("| method | launches a step | the model's | the cache's, a layer |\n|---|---|---|---|")
    for spec in args.methods.split(","):
        with native.torch_path(), recall_misses_only(True):
            audit = count(model, ids, spec, args.budget, args.steps)
        model_ops = audit.places["the model"]
        print(f"| {spec} | {audit.launches} | {model_ops} | {(audit.launches - model_ops) / layers:.0f} |")
        if args.by_place:
            for place, n in audit.places.most_common():
                print(f"|   {place} | {n} | | |")


if __name__ == "__main__":
    main()
