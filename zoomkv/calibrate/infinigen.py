"""``zoomkv calibrate infinigen --model M``: the skew matrices and partial channels InfiniGen needs.

Runs the model once over calibration text (2048 tokens, as the authors do with one PG-19 book), records
every full-attention layer's post-RoPE queries and keys, and writes per layer and KV head the orthogonal
skew and the top 20% skewed channels (``zoomkv.methods.infinigen_profile``) to
``profile_dir(M)/infinigen.safetensors`` — a few KB per layer.

The default text is Python's own help topics (``pydoc_data``, shipped with every CPython): plain English
prose that needs no download. ``--text-file`` takes any other text.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path
from typing import Any

import torch

from zoomkv.data.files import read_text_file
from zoomkv.errors import ZoomKVError
from zoomkv.methods.infinigen_profile import PROFILE_FILE, is_profile, save_profile, skew_and_channels

HELP = "InfiniGen: per-layer SVD skew of post-RoPE queries and the top fifth of the skewed channels"

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="registered name, hub id or local folder")
    parser.add_argument("--tokens", type=int, default=2048, help="calibration tokens (authors: 2048)")
    parser.add_argument("--text-file", default=None, help="calibration text (default: Python's help topics)")
    parser.add_argument("--partial-ratio", type=float, default=0.2, help="fraction of channels kept (paper: 0.2)")
    parser.add_argument("--output", default=None, help=f"file to write (default: the model's profile dir/{PROFILE_FILE})")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="auto")


def default_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


def calibration_ids(tokenizer: Any, text: str, tokens: int) -> torch.Tensor:
    """The first ``tokens`` tokens of ``text`` (``[1, n]``), tokenizing only as much text as needed."""
    chars = tokens * 8  # generous: few tokenizers average more than 8 characters a token
    while True:
        ids = tokenizer(text[:chars], return_tensors="pt")["input_ids"]
        if ids.shape[1] > tokens or chars >= len(text):
            return ids[:, :tokens]
        chars *= 2


def build_profile(model: Any, input_ids: torch.Tensor, model_name: str, partial_ratio: float = 0.2,
                  output: Path | None = None, progress: bool | None = None) -> Path:
    """Record one prefill of ``input_ids`` (``[1, T]``) and write the profile; returns its path.
    ``progress``: a bar (the prefill, then each layer) on stderr; None: when stderr is a terminal."""
    from tqdm.auto import tqdm

    from zoomkv.memory.replay import record_prefill
    from zoomkv.protocol.profiles import profile_dir

    if not 0.0 < partial_ratio <= 1.0:
        raise ZoomKVError(f"--partial-ratio must lie in (0, 1], got {partial_ratio}")
    bar = tqdm(total=1, desc="calibrate infinigen: prefill", disable=None if progress is None else not progress)
    try:
        record = record_prefill(model, input_ids)
        contexts = sorted(record.contexts.items())
        bar.total += len(contexts)
        bar.update(1)
        bar.set_description("calibrate infinigen: layers")
        layers = {}
        for i, ctx in contexts:
            layers[i] = skew_and_channels(ctx.queries[0].float().cpu(), ctx.keys[0].float().cpu(), partial_ratio)
            bar.update(1)
    finally:
        bar.close()
    if not layers:
        raise ZoomKVError(f"{model_name} has no full-attention layer to calibrate")
    text = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    meta = {
        "model": model_name,
        "model_type": str(getattr(text, "model_type", "")),
        "num_hidden_layers": str(getattr(text, "num_hidden_layers", "")),
        "partial_ratio": str(partial_ratio),
        "tokens": str(input_ids.shape[1]),
    }
    path = output if output is not None else profile_dir(model_name) / PROFILE_FILE
    return save_profile(path, layers, meta)


def run(args: argparse.Namespace) -> int:
    from zoomkv.models import context_limit, load_model, parse_dtype, resolve_device

    if args.tokens < 16:
        raise ZoomKVError(f"--tokens must be at least 16, got {args.tokens}")
    if args.output and Path(args.output).is_dir():
        raise ZoomKVError(f"--output {args.output} is a folder; give the profile file's path")
    if args.output and (Path(args.output).exists() or Path(args.output).is_symlink()) and \
            not is_profile(Path(args.output)):
        raise ZoomKVError(f"--output {args.output} exists and is not an InfiniGen profile (it is never replaced); "
                          "give a new file's path")
    text = default_text() if args.text_file is None else read_text_file(args.text_file, "calibration text")
    start = time.perf_counter()
    model, tokenizer = load_model(args.model, dtype=parse_dtype(args.dtype), device=resolve_device(args.device))
    if args.tokens > context_limit(model):
        raise ZoomKVError(f"--tokens {args.tokens} is over {args.model}'s maximum context of {context_limit(model)}")
    ids = calibration_ids(tokenizer, text, args.tokens).to(model.device)
    if ids.shape[1] < args.tokens:
        log.warning("the calibration text has only %d tokens (asked for %d)", ids.shape[1], args.tokens)
    with torch.inference_mode():
        out = build_profile(model, ids, args.model, args.partial_ratio,
                            Path(args.output) if args.output else None,
                            progress=False if getattr(args, "quiet", False) else None)
    log.info("wrote %s (%d tokens, %.1f s)", out, ids.shape[1], time.perf_counter() - start)
    return 0
