"""Talk about a long document: it is compressed once into a persistent cache, then every question and
answer extends that cache. Device and host bytes are printed after each turn. Type /quit (or end the
input) to leave, /memory for the full memory report.

    zoomkv chat --model smollm2-135m --method oracle_topk --budget 256 --context-file report.txt
    zoomkv chat --model smollm2-135m --adapter checkpoints/sekv-smollm2+int8 --context-file report.txt
    printf 'What is the pass key?\\nAnd again?\\n' | zoomkv chat --method quest --budget 128 --context-file doc.txt
"""

from __future__ import annotations

import argparse
import sys

from zoomkv.cli_args import add_run_arguments, run_from_args
from zoomkv.data.files import read_text_file
from zoomkv.errors import ZoomKVError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="registered name, hub id or local folder")
    add_run_arguments(parser, several=False)
    parser.add_argument("--context-file", required=True, help="the document to talk about (UTF-8 text)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="the longest answer, in tokens")
    parser.add_argument("--chat", choices=["auto", "on", "off"], default="auto",
                        help="use the model's chat template (auto: when it has one); off: Question:/Answer: lines")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="auto")


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def memory_line(conversation) -> str:
    r = conversation.memory_report()
    full = max(r.full_kv_bytes, 1)
    return (f"[{conversation.tokens} tokens; device {_mib(r.device_bytes)} ({r.device_bytes / full:.1%} of full KV), "
            f"host {_mib(r.host_bytes)} ({r.host_bytes / full:.1%})]")


def _read_line() -> str:
    """One line of standard input, UTF-8 text only: the rule --context-file follows. A stream that reads with
    ``surrogateescape`` (Python's own stdin under a C or POSIX locale) hands undecodable bytes over as lone
    surrogates instead of failing: refused the same way, never answered with them replaced."""
    try:
        line = sys.stdin.readline()
    except UnicodeDecodeError as err:
        raise ZoomKVError(f"the input is not UTF-8 text ({err.reason} at byte {err.start} of a line)") from None
    bad = next((i for i, c in enumerate(line) if "\udc80" <= c <= "\udcff"), None)
    if bad is not None:
        raise ZoomKVError(f"the input is not UTF-8 text (byte 0x{ord(line[bad]) - 0xDC00:02x} at character {bad} "
                          "of a line)")
    return line


def run(args: argparse.Namespace) -> int:
    from zoomkv.conversation import Conversation
    from zoomkv.models import load_model, parse_dtype, resolve_device

    spec = run_from_args(args)  # every check that needs no model: method, budget, variants, adapter
    document = read_text_file(args.context_file, "context file")
    if sys.stdin is None or sys.stdin.closed:  # started with its standard input closed (`zoomkv chat ... <&-`)
        raise ZoomKVError("zoomkv chat reads the questions from standard input, which is closed; type them, or "
                          "pipe them in (printf 'question\\n' | zoomkv chat ...)")
    model, tokenizer = load_model(args.model, dtype=parse_dtype(args.dtype), device=resolve_device(args.device))
    conversation = Conversation(model, tokenizer, document, spec.cache,
                                chat=None if args.chat == "auto" else args.chat == "on",
                                max_new_tokens=args.max_new_tokens)
    interactive = sys.stdin.isatty()
    print(f"{spec.label}: document compressed. {memory_line(conversation)}", flush=True)
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = _read_line()
        if not line or line.strip() in ("/quit", "/exit"):
            break
        question = line.strip()
        if not question:
            continue
        if question == "/memory":
            print(conversation.memory_report().format(), flush=True)
            continue
        if not interactive:
            print(f"> {question}")
        print(conversation.ask(question))
        print(memory_line(conversation), flush=True)
    return 0
