"""How many kernels a decode step launches on a GPU, counted on the CPU.

At batch 1 a GPU decode step is bound by its launches (docs/performance.md, "On a GPU"). This runs the step the
GPU runs (the torch path, the recall reading only the rows its buffer misses) with zoomkv's Triton kernels
under Triton's interpreter, and counts what ``zoomkv bench --sync-audit`` counts on a GPU (``SyncAudit.ops``):
the torch ops that compute (views, allocations and reshapes left out) and each kernel one launch. A step the GPU captures
in a CUDA graph (``zoomkv.memory.graphs``: its append and selection in fixed shapes) is counted twice: its launches
as it runs them, and as one launch, its graph's replay (the last column, ``SyncAudit.launches_captured``). ``--by-place`` lists the torch ops by
the zoomkv function that issued them.

    python scripts/gpu_launches.py --methods full,quest,oracle_topk,sekv,sekv:rescore_from=host:kv_quant=k8v4

A method is ``NAME`` or ``NAME:KEY=VALUE:...`` (``ZoomCache`` options and hyper-parameters); ``hf`` is plain
transformers (its own cache).
"""

from __future__ import annotations

import argparse
import collections
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: its reductions run interpreted too
os.environ.setdefault("ZOOMKV_TRITON", "1")

import torch  # noqa: E402

from zoomkv import ZoomCache, kernels, native  # noqa: E402
from zoomkv.compat import generate_cache_kwargs  # noqa: E402
from zoomkv.memory import graphs, sync_audit  # noqa: E402
from zoomkv.models import load_model  # noqa: E402
from zoomkv.protocol.recallable import recall_misses_only  # noqa: E402


class ByPlace(sync_audit.SyncAudit):
    """``SyncAudit`` that also says where each torch op that launches came from."""

    def __init__(self):
        super().__init__()
        self.places: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not kernels.launch_running() and not func.is_view and func._schema.name not in sync_audit.NO_KERNEL:
            where = sync_audit._location()
            ours = "zoomkv" in where and not where.endswith((" _decoder_layer", " layer"))  # (the layers' wrappers)
            self.places[where.split(":")[0] + " " + where.rsplit(" ", 1)[-1] if ours else "the model"] += 1
        return super().__torch_dispatch__(func, types, args, kwargs)


def parse(spec: str) -> tuple[str, dict[str, str]]:
    name, *options = spec.split(":")
    return name, dict(option.split("=", 1) for option in options)


@torch.no_grad()
def count(model, ids: torch.Tensor, spec: str, budget: int, steps: int) -> ByPlace:
    name, options = parse(spec)
    cache = None if name == "hf" else ZoomCache(model, name, budget, **options)
    out = model(input_ids=ids, **generate_cache_kwargs(cache), use_cache=True)
    cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    for _ in range(steps):  # the last step is counted: every layer past its first decode step
        with ByPlace() as audit:
            out = model(input_ids=token, **generate_cache_kwargs(cache), use_cache=True)
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
    print("| method | launches a step, as run | the model's | the cache's, a layer | launches a step, captured "
          "(ZOOMKV_CUDA_GRAPHS=1: decoder layers) | the same, cache steps alone (=step) |")
    print("|---|---|---|---|---|---|")
    for spec in args.methods.split(","):
        found = []
        for mode in ("1", "step"):
            os.environ["ZOOMKV_CUDA_GRAPHS"] = mode
            with native.torch_path(), recall_misses_only(True), graphs.emulated():  # the GPU's step, fixed shapes
                found.append(count(model, ids, spec, args.budget, args.steps))
        audit = found[1]
        model_ops = audit.places["the model"]
        print(f"| {spec} | {audit.ops} | {model_ops} | {(audit.ops - model_ops) / layers:.0f} | "
              f"{found[0].launches_captured} | {audit.launches_captured} |")
        if args.by_place:
            for place, n in [*audit.places.most_common(), ("zoomkv's Triton kernels", audit.ops - audit.places.total())]:
                print(f"|   {place} | {n} | | | | |")


if __name__ == "__main__":
    main()
