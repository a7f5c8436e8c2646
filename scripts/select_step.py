"""sekv's decode-step selection alone, per host format: CPU time of one layer's ``select`` on a synthetic layer.

The compiled CPU step (``zoomkv/methods/sekv/native/select.cpp``) scores every row's code, rescores the
candidates from the host tier's keys (``rescore_from=host``, decoded as read) and recalls the top rows. How fast it
decodes a host format shows here without a model around it: random keys and values of SmolLM2-135M's attention
shape (3 KV heads of 64 channels, 3 queries a head), compressed once, then ``select`` timed over fresh queries in
process CPU time on one thread (so other jobs on the machine move it less than wall time). BENCHMARKS.md, "4K,
batch 4, and the prefill with a quantized host tier":

    python scripts/select_step.py --batch-size 4 --rows 4074 --formats none,k8v4,kivi4g64
"""

from __future__ import annotations

import argparse
import time

import torch

from zoomkv import ZoomCache
from zoomkv.errors import ZoomKVError
from zoomkv.memory.quant import QuantSpec
from zoomkv.methods.sekv.method import SeKV
from zoomkv.models import load_model
from zoomkv.protocol.method import PrefillContext


def layer(config, kv_quant: str | None, batch: int, rows: int, budget: int, seed: int):
    """One compressed sekv layer over random rows (keys with channels of unequal scale, as real keys have)."""
    heads, dim, group = config.num_key_value_heads, config.head_dim, config.num_attention_heads // config.num_key_value_heads
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, heads, rows, dim, generator=g) * (1 + torch.rand(batch, heads, 1, dim, generator=g) * 3)
    values = torch.randn(batch, heads, rows, dim, generator=g)
    method = SeKV(rescore_from="host")
    cache = ZoomCache(config, method, budget, kv_quant=kv_quant)
    memory = cache.layers[0]
    memory.lazy_initialization(keys, values)
    memory.seen = rows
    ctx = PrefillContext(layer_idx=0, num_layers=len(cache.layers), keys=keys, values=values,
                         queries=torch.zeros(batch, heads * group, rows, dim), valid=None, budget=budget,
                         scaling=dim**-0.5, num_kv_groups=group, zoom_layers=cache.zoom_layer_indices,
                         surprisal=torch.rand(batch, rows, generator=g) ** 4 * 10)
    method.compress(memory, ctx)
    return method, memory, g


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", default="none,k8v4,kivi4g64", help="host formats, comma-separated (none: fp32)")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--rows", type=int, default=4074, help="context rows per KV head")
    parser.add_argument("--budget", type=int, default=128)
    parser.add_argument("--steps", type=int, default=50, help="selects per timed round")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds; the fastest is reported")
    args = parser.parse_args()
    formats = {name: None if name == "none" else name for name in args.formats.split(",")}
    for kv_quant in filter(None, formats.values()):  # a misspelt format is refused before any work
        try:
            QuantSpec.parse(kv_quant)
        except ZoomKVError as e:
            parser.error(str(e))
    torch.set_num_threads(1)
    config = load_model("tiny-llama")[0].config  # a one-layer stand-in given SmolLM2-135M's attention shape
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 9, 3, 64
    config.hidden_size = 9 * 64
    print(f"sekv select, one layer: batch {args.batch_size}, {args.rows} rows, B={args.budget}, "
          "rescore_from=host, one thread, ms of process CPU time per select")
    print("| host format | fastest round | every round |")
    print("|---|---|---|")
    for name, kv_quant in formats.items():
        method, memory, g = layer(config, kv_quant, args.batch_size, args.rows, args.budget, seed=0)
        queries = [torch.randn(args.batch_size, config.num_attention_heads, 1, config.head_dim, generator=g)
                   for _ in range(args.steps)]
        for q in queries[:5]:  # the layer's compiled step laid out, caches warm
            method.select(memory, q)
        rounds = []
        for _ in range(args.rounds):
            start = time.process_time()
            for q in queries:
                method.select(memory, q)
            rounds.append((time.process_time() - start) / len(queries) * 1000)
        print(f"| {name} | {min(rounds):.3f} | {' / '.join(f'{r:.3f}' for r in rounds)} |")


if __name__ == "__main__":
    main()
