"""Time prefill and decode of methods against full, interleaved, in one process.

    zoomkv bench --model smollm2-135m --length 4096 --methods full,oracle_topk --budgets 256
"""

from __future__ import annotations

import argparse

from zoomkv.cli_args import int_option


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--methods", default="full,oracle_topk", help="comma-separated; full is always included")
    parser.add_argument("--budgets", default="256", help="comma-separated budgets (rows or fractions)")
    parser.add_argument("--length", type=int, default=4096, help="prompt length in tokens")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int_option(1, 10_000), default=3)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--random-weights", action="store_true",
                        help="build --model (a local folder with config.json + tokenizer) with random weights: timing only")
    parser.add_argument("--prefill-chunk", default="", metavar="N[,N...]",
                        help="also run every configuration with chunked prefill (pieces of N tokens) and report its "
                             "peak device memory and prefill time beside the one-shot prefill")
    parser.add_argument("--no-warmup", action="store_true",
                        help="skip the short warm-up run per configuration (long prompts: it costs a whole prefill)")
    parser.add_argument("--batch-size", type=int, default=1,
                        help="decode this many prompts together (each with its own pass key); tokens/s counts them all")
    parser.add_argument("--sync-audit", action="store_true",
                        help="also audit a few decode steps per configuration for ops that make the host wait for the "
                             "device (.item(), nonzero, device-to-host copies; see zoomkv.memory.sync_audit)")
    parser.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    from zoomkv.bench import run_bench

    run_bench(args)
    return 0
