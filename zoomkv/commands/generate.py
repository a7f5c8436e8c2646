"""Generate from a prompt with a KV method and print the memory report.

    zoomkv generate --model smollm2-135m --method oracle_topk --budget 0.1 --prompt "..." [--json]
    zoomkv generate --model smollm2-135m --adapter checkpoints/sekv-smollm2 --prompt-file prompt.txt
"""

from __future__ import annotations

import argparse
import json

from zoomkv.cli_args import parse_method_args
from zoomkv.data.files import read_text_file
from zoomkv.errors import ZoomKVError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="registered name, hub id or local folder")
    parser.add_argument("--method", default="full", help="a name from `zoomkv methods`")
    parser.add_argument("--adapter", default=None,
                        help="a trained adapter (folder from `zoomkv export` or Hub id); sets the method and budget")
    parser.add_argument("--budget", default=None, help="device-tier rows per layer per KV head: 512, or 0.1 of the prompt")
    parser.add_argument("--method-arg", "--method-args", dest="method_arg", action="append", metavar="KEY=VALUE[,K=V]",
                        help="override method hyper-parameters (repeatable, or comma-separated)")
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="the prompt text")
    src.add_argument("--prompt-file", help="read the prompt from this file")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--prefill-chunk", type=int, metavar="N",
                        help="put the prompt through in pieces of N tokens, compressed as they go (peak device KV "
                             "per layer: the budget plus N rows)")
    parser.add_argument("--chat", choices=["auto", "on", "off"], default="auto", help="wrap the prompt in the chat template")
    parser.add_argument("--kv-quant", choices=["none", "int8", "int4"], default="none",
                        help="store the host tier as int8/int4 codes with per-group fp16 scales")
    parser.add_argument("--kv-quant-tiers", choices=["host", "all"], default="host",
                        help="'all' quantizes the device tier's stored rows too (full)")
    parser.add_argument("--tail-summary", action="store_true",
                        help="recallable methods: add one mean row (log-count bias) for every row not selected")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--json", action="store_true", help="print one JSON object (text, memory, timings)")


def run(args: argparse.Namespace) -> int:
    from zoomkv.budget import Budget
    from zoomkv.generation import generate_text
    from zoomkv.methods import get_method
    from zoomkv.models import load_model, parse_dtype, resolve_device

    method_kwargs = parse_method_args(args.method_arg)
    adapter = None
    if args.adapter:
        from zoomkv.adapters.model import ZoomAdapter

        adapter = ZoomAdapter.from_pretrained(args.adapter)  # fail fast (corrupt, offline...), before the model
        method = adapter.make_method(**method_kwargs)  # the adapter's method, hyper-parameters and modules
        if args.budget is None:
            args.budget = adapter.config.budget
    else:
        method = get_method(args.method, **method_kwargs)  # fail fast, before loading a model
    Budget.parse(args.budget)
    if args.kv_quant_tiers == "all" and args.kv_quant != "none" and not method.quantizable_device:
        raise ZoomKVError(f"--kv-quant-tiers all is not supported by {method.name!r} (only by: full)")
    if args.prompt is None and args.prompt_file is None:
        raise ZoomKVError("give the prompt with --prompt TEXT or --prompt-file FILE")
    prompt = args.prompt if args.prompt_file is None else read_text_file(args.prompt_file, "prompt file")
    if not prompt.strip():
        raise ZoomKVError("the prompt is empty")
    model, tokenizer = load_model(args.model, dtype=parse_dtype(args.dtype), device=resolve_device(args.device))
    if adapter is not None:
        adapter.attach(model)  # wrong base model → BaseModelMismatchError naming both (exit 2)
    result = generate_text(
        model, tokenizer, prompt, method=method, budget=args.budget, max_new_tokens=args.max_new_tokens,
        chat=None if args.chat == "auto" else args.chat == "on",
        kv_quant=None if args.kv_quant == "none" else args.kv_quant, kv_quant_tiers=args.kv_quant_tiers,
        tail_summary=args.tail_summary, prefill_chunk=args.prefill_chunk,
    )
    report = result.memory
    if args.json:
        payload = {
            "model": args.model,
            "method": method.name,
            "budget": report.budget,
            "text": result.text,
            "prompt_tokens": result.prompt_tokens,
            "new_tokens": result.new_tokens,
            "prefill_s": round(result.prefill_s, 4),
            "decode_ms_per_token": round(result.decode_ms_per_token, 3),
            "memory": report.to_dict(),
        }
        print(json.dumps(payload))
    else:
        print(result.text)
        print()
        print(f"[{method.name}] {result.prompt_tokens} prompt tokens, {result.new_tokens} new; "
              f"prefill {result.prefill_s:.2f} s, decode {result.decode_ms_per_token:.1f} ms/token")
        print(report.format())
    return 0
