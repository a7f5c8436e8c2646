"""The ``zoomkv`` command line (also ``python -m zoomkv``).

    zoomkv generate --model smollm2-135m --method oracle_topk --budget 0.1 --prompt "..." [--json]
    zoomkv bench --model smollm2-135m --length 4096 --methods full,oracle_topk --budgets 256
    zoomkv models | zoomkv methods

Errors caused by the input (unknown names, bad budgets, empty or over-long prompts) print one line and
exit with status 2; they never print a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path
from typing import Any

from zoomkv.errors import ZoomKVError

# Subcommands defined next to their subsystem (evaluation, calibration profiles, training, adapters).
PLUGIN_COMMANDS = ("zoomkv.eval.cli", "zoomkv.calibrate", "zoomkv.train.cli", "zoomkv.adapters.cli")


def _parse_method_args(items: list[str] | None) -> dict[str, Any]:
    """``--method-arg key=value[,key=value]`` (repeatable) → hyper-parameter overrides (YAML scalars)."""
    import yaml

    out: dict[str, Any] = {}
    for group in items or []:
        for item in group.split(","):
            if not item.strip():
                continue
            if "=" not in item:
                raise ZoomKVError(f"--method-arg expects key=value, got {item!r}")
            key, value = item.split("=", 1)
            out[key.strip()] = yaml.safe_load(value)
    return out


def cmd_generate(args: argparse.Namespace) -> int:
    from zoomkv.budget import Budget
    from zoomkv.generation import generate_text
    from zoomkv.methods import get_method
    from zoomkv.models import load_model, parse_dtype, resolve_device

    method_kwargs = _parse_method_args(args.method_arg)
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
    if args.prompt_file is not None:
        path = Path(args.prompt_file)
        if not path.is_file():
            raise ZoomKVError(f"prompt file not found: {path}")
        prompt = path.read_text(encoding="utf-8")
    else:
        prompt = args.prompt
    if not prompt.strip():
        raise ZoomKVError("the prompt is empty")
    model, tokenizer = load_model(args.model, dtype=parse_dtype(args.dtype), device=resolve_device(args.device))
    if adapter is not None:
        adapter.attach(model)  # wrong base model → BaseModelMismatchError naming both (exit 2)
    result = generate_text(
        model, tokenizer, prompt, method=method, budget=args.budget, max_new_tokens=args.max_new_tokens,
        chat=None if args.chat == "auto" else args.chat == "on",
        kv_quant=None if args.kv_quant == "none" else args.kv_quant, kv_quant_tiers=args.kv_quant_tiers,
        tail_summary=args.tail_summary,
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


def cmd_models(args: argparse.Namespace) -> int:
    from zoomkv.models import list_models

    for spec in list_models():
        extra = f"  (install: {spec.install})" if getattr(spec, "install", None) else ""
        print(f"{spec.name:16s} {spec.description}{extra}")
    print("Any Hugging Face model id or local folder (Llama, Qwen2/3, Mistral, Gemma 3) works too.")
    return 0


def cmd_methods(args: argparse.Namespace) -> int:
    import dataclasses

    from zoomkv.methods import list_methods

    for cls in list_methods():
        params = ", ".join(f"{f.name}={f.default!r}" for f in dataclasses.fields(cls.config_class))
        kind = "recallable" if cls.recallable else ("no budget" if not cls.uses_budget else "eviction")
        print(f"{cls.name:14s} [{kind}] {cls.summary}" + (f"\n{'':14s}   defaults: {params}" if params else ""))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from zoomkv.bench import run_bench

    run_bench(args)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from zoomkv import __version__

    parser = argparse.ArgumentParser(prog="zoomkv", description=__doc__.split("\n")[0])
    parser.add_argument("--version", action="version", version=f"zoomkv {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate from a prompt with a KV method and print the memory report")
    g.add_argument("--model", default="smollm2-135m", help="registered name, hub id or local folder")
    g.add_argument("--method", default="full", help="a name from `zoomkv methods`")
    g.add_argument("--adapter", default=None,
                   help="a trained adapter (folder from `zoomkv export` or Hub id); sets the method and budget")
    g.add_argument("--budget", default=None, help="device-tier rows per layer per KV head: 512, or 0.1 of the prompt")
    g.add_argument("--method-arg", "--method-args", dest="method_arg", action="append", metavar="KEY=VALUE[,K=V]",
                   help="override method hyper-parameters (repeatable, or comma-separated)")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="the prompt text")
    src.add_argument("--prompt-file", help="read the prompt from this file")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--chat", choices=["auto", "on", "off"], default="auto", help="wrap the prompt in the chat template")
    g.add_argument("--kv-quant", choices=["none", "int8", "int4"], default="none",
                   help="store the host tier as int8/int4 codes with per-group fp16 scales")
    g.add_argument("--kv-quant-tiers", choices=["host", "all"], default="host",
                   help="'all' quantizes the device tier's stored rows too (full)")
    g.add_argument("--tail-summary", action="store_true",
                   help="recallable methods: add one mean row (log-count bias) for every row not selected")
    g.add_argument("--dtype", default="float32")
    g.add_argument("--device", default="auto")
    g.add_argument("--json", action="store_true", help="print one JSON object (text, memory, timings)")
    g.set_defaults(func=cmd_generate)

    b = sub.add_parser("bench", help="time prefill and decode of methods against full, interleaved, in one process")
    b.add_argument("--model", default="smollm2-135m")
    b.add_argument("--methods", default="full,oracle_topk", help="comma-separated; full is always included")
    b.add_argument("--budgets", default="256", help="comma-separated budgets (rows or fractions)")
    b.add_argument("--length", type=int, default=4096, help="prompt length in tokens")
    b.add_argument("--new-tokens", type=int, default=32)
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--dtype", default="float32")
    b.add_argument("--device", default="auto")
    b.add_argument("--random-weights", action="store_true",
                   help="build --model (a local folder with config.json + tokenizer) with random weights: timing only")
    b.add_argument("--json", action="store_true")
    b.set_defaults(func=cmd_bench)

    # Commands that live with their subsystem: each module has `register(subparsers)`.
    for module_name in PLUGIN_COMMANDS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name is None or not module_name.startswith(err.name):
                raise  # a real import error inside the module, not "not written yet"
            continue
        module.register(sub)

    sub.add_parser("models", help="list the registered models").set_defaults(func=cmd_models)
    sub.add_parser("methods", help="list the KV methods and their defaults").set_defaults(func=cmd_methods)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ZoomKVError as err:
        print(f"zoomkv: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("zoomkv: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
