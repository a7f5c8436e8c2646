"""Generate from a prompt with a KV method and print the memory report.

    zoomkv generate --model smollm2-135m --method oracle_topk --budget 0.1 --prompt "..." [--json]
    zoomkv generate --model smollm2-135m --method quest+tail+int8 --budget 128 --prompt-file prompt.txt
    zoomkv generate --model smollm2-135m --adapter checkpoints/sekv-smollm2+int8 --prompt-file prompt.txt
"""

from __future__ import annotations

import argparse
import json

from zoomkv.cli_args import add_run_arguments, run_from_args
from zoomkv.data.files import read_text_file
from zoomkv.errors import ZoomKVError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="registered name, hub id or local folder")
    add_run_arguments(parser, several=False)
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="the prompt text")
    src.add_argument("--prompt-file", help="read the prompt from this file")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--chat", choices=["auto", "on", "off"], default="auto", help="wrap the prompt in the chat template")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--json", action="store_true", help="print one JSON object (text, memory, timings)")


def run(args: argparse.Namespace) -> int:
    from zoomkv.generation import generate_text
    from zoomkv.models import load_model, parse_dtype, resolve_device

    spec = run_from_args(args)  # every check that needs no model: method, budget, variants, adapter
    if args.prompt is None and args.prompt_file is None:
        raise ZoomKVError("give the prompt with --prompt TEXT or --prompt-file FILE")
    prompt = args.prompt if args.prompt_file is None else read_text_file(args.prompt_file, "prompt file")
    if not prompt.strip():
        raise ZoomKVError("the prompt is empty")
    model, tokenizer = load_model(args.model, dtype=parse_dtype(args.dtype), device=resolve_device(args.device))
    result = generate_text(model, tokenizer, prompt, spec.cache, max_new_tokens=args.max_new_tokens,
                           chat=None if args.chat == "auto" else args.chat == "on")
    report = result.memory
    name = spec.cache.method.name
    if args.json:
        payload = {
            "model": args.model,
            "method": name,
            "label": spec.label,
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
        print(f"[{spec.label}] {result.prompt_tokens} prompt tokens, {result.new_tokens} new; "
              f"prefill {result.prefill_s:.2f} s, decode {result.decode_ms_per_token:.1f} ms/token")
        print(report.format())
    return 0
