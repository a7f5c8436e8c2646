"""Time prefill and decode of methods against full, interleaved, in one process.

    zoomkv bench --model smollm2-135m --length 4096 --methods full,oracle_topk --budgets 256
    zoomkv bench --model smollm2-135m --length 4096 --methods quest --adapter runs/sekv/adapter,runs/sekv/adapter+int8 --budgets 128

Methods and adapters take the grammar every command takes (``zoomkv.runspec``): ``+tail``, ``+int8``, ``+int4``,
``--tail-summary``, ``--kv-quant``, ``--method-arg``; without ``--budgets`` an adapter runs at its own budget
and the methods at 256.
"""

from __future__ import annotations

import argparse

from zoomkv.cli_args import add_run_arguments, int_option, runs_from_args

DEFAULT_BUDGETS = ("256",)  # the methods' budget when --budgets is not given (an adapter's own is its)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m")
    add_run_arguments(parser, several=True, methods="full,oracle_topk", prefill_chunk=False)
    parser.add_argument("--length", type=int, default=4096, help="prompt length in tokens")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int_option(1, 10_000), default=3)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--random-weights", action="store_true",
                        help="build --model (a local folder with config.json + tokenizer) with random weights: timing only")
    parser.add_argument("--prefill-chunk", default="", metavar="N[,N...]",
                        help="also run every configuration with chunked prefill (pieces of N tokens) and report its "
                             "peak device memory and prefill time beside the one-shot prefill (the comparison is "
                             "bench's point: here N adds runs, elsewhere it sets the one run)")
    parser.add_argument("--no-warmup", action="store_true",
                        help="skip the short warm-up run per configuration (long prompts: it costs a whole prefill)")
    parser.add_argument("--warmup-length", type=int, default=0, metavar="TOKENS",
                        help="warm up on prompts of this many tokens instead of --length (lazy initialisation and "
                             "kernel compilation do not need the whole prompt; 0: --length)")
    parser.add_argument("--no-hf", action="store_true",
                        help="leave out the hf row (the same model and prompts through plain transformers: its own "
                             "DynamicCache and sdpa attention, no zoomkv) that every ratio can also be read against")
    parser.add_argument("--batch-size", type=int, default=1,
                        help="decode this many prompts together (each with its own pass key); tokens/s counts them all")
    parser.add_argument("--profile", action="store_true",
                        help="also run each configuration once under a phase clock and print where a decode step's "
                             "time goes: selection (scoring, top-k), recall (host rows into the device tier), append "
                             "(the new row into the tiers and index), attention over the selected rows, and the rest")
    parser.add_argument("--sync-audit", action="store_true",
                        help="also audit a few decode steps per configuration for ops that make the host wait for the "
                             "device (.item(), nonzero, device-to-host copies; see zoomkv.memory.sync_audit), "
                             "and count the kernels a step launches on a GPU (ops/step: torch ops that compute and "
                             "zoomkv's Triton kernels, one each)")
    parser.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    from zoomkv.bench import run_bench

    run_bench(args, runs_from_args(args, default_budgets=DEFAULT_BUDGETS))
    return 0
