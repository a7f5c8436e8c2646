"""``zoomkv calibrate compresskv --model M [--samples N --length L]``: CompressKV's offline profile.

For each of N passkey prompts (``zoomkv.data.passkey``, needle at evenly spread depths) the model decodes
the answer greedily with full attention, through a capturing attention function (registered with
transformers like zoomkv's own, so every layer's query, keys and values pass through it):

- **semantic retrieval heads**: at each answer step, each query head's softmax attention mass on the
  needle tokens (the whole needle sentence, the key and its context: CompressKV's heads retrieve the
  evidence *and* its surroundings, not only the copied token). Averaged over steps and over the samples
  the model answers correctly (``--accept-all``: every sample; the tiny random test models answer none),
  the top ``--top-heads`` (4) per layer are the layer's semantic retrieval heads;
- **eviction error**: at prefill each layer picks a SnapKV top-``--error-budget`` of its prompt rows
  (observation window 8, average pooling 5, all heads voting); at each answer step the layer's attention
  output over those rows (plus the generated ones) is compared with the exact one: relative Frobenius
  error over heads and channels, averaged like the head scores.

Only full-attention layers are profiled (sliding-window layers are never compressed): others get no heads
and error 0. The profile, a small JSON file, goes to ``profile_dir(M)/compresskv.json`` (or ``--out``),
where ``compresskv`` finds it by the model's name.
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from zoomkv import compat
from zoomkv.atomic import write_file_atomically
from zoomkv.errors import ZoomKVError

log = logging.getLogger(__name__)
HELP = "find CompressKV's semantic retrieval heads and per-layer eviction error (passkey decoding)"
ATTENTION_NAME = "zoomkv_calibrate"
_state = threading.local()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="registered name, hub id or local folder")
    parser.add_argument("--samples", type=int, default=8, help="passkey prompts to decode (default 8)")
    parser.add_argument("--length", type=int, default=2048, help="prompt length in tokens (default 2048)")
    parser.add_argument("--top-heads", type=int, default=4, help="semantic retrieval heads kept per layer")
    parser.add_argument("--error-budget", type=int, default=128,
                        help="rows a layer keeps when its eviction error is measured (default 128)")
    parser.add_argument("--window", type=int, default=8, help="SnapKV observation window for the error")
    parser.add_argument("--kernel-size", type=int, default=5, help="SnapKV pooling kernel for the error")
    parser.add_argument("--answer-tokens", type=int, default=0, help="tokens to decode (0: the key's length + 2)")
    parser.add_argument("--accept-all", action="store_true",
                        help="use every sample, answered correctly or not (for models that cannot answer)")
    parser.add_argument("--chat", action="store_true", help="wrap prompts in the model's chat template")
    parser.add_argument("--out", default=None, help="profile path (default: profile_dir(model)/compresskv.json)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="auto")


def run(args: argparse.Namespace) -> int:
    from zoomkv.methods.compresskv import default_profile_path
    from zoomkv.models import context_limit, load_model, parse_dtype, resolve_device

    if args.samples < 1 or args.length < 16 or args.top_heads < 1 or args.error_budget <= args.window:
        raise ZoomKVError("need --samples ≥ 1, --length ≥ 16, --top-heads ≥ 1 and --error-budget > --window")
    if args.window < 1 or args.kernel_size < 1 or args.answer_tokens < 0 or args.samples > 100_000:
        raise ZoomKVError("need --window ≥ 1, --kernel-size ≥ 1, --answer-tokens ≥ 0 and --samples ≤ 100000")
    if args.out:
        check_out(Path(args.out))
    from zoomkv.eval.shards import join_processes

    procs = join_processes(args.device)  # under accelerate launch / torchrun: the prompts are shared out
    if not procs.main:
        procs.wait()  # the main process loads first: a first load converts and caches the model
    model, tokenizer = load_model(args.model, dtype=parse_dtype(args.dtype),
                                  device=procs.device or resolve_device(args.device))
    if procs.main:
        procs.wait()
    if args.length + max(args.answer_tokens, 0) > context_limit(model):
        raise ZoomKVError(f"--length {args.length} is over {args.model}'s maximum context of {context_limit(model)}")
    profile = calibrate(
        model, tokenizer, model_name=args.model, samples=args.samples, length=args.length,
        top_heads=args.top_heads, error_budget=args.error_budget, window=args.window,
        kernel_size=args.kernel_size, answer_tokens=args.answer_tokens, accept_all=args.accept_all, chat=args.chat,
        progress=False if getattr(args, "quiet", False) or not procs.main else None, processes=procs,
    )
    if not procs.main:
        procs.close()  # after the main process has written the one profile
        return 0
    path = Path(args.out) if args.out else default_profile_path(args.model)
    save_profile(profile, path)
    procs.close()
    used, total = profile["used"], profile["samples"]
    # the profile itself is the command's output (stdout); where it went is a log line
    print(f"compresskv profile for {args.model} ({used}/{total} samples used):")
    for layer, (heads, err) in enumerate(zip(profile["heads"], profile["layer_error"], strict=True)):
        if heads:
            print(f"  layer {layer:3d}: heads {heads}  eviction error {err:.4f}")
    log.info("wrote %s", path)
    return 0


def check_out(path: Path, flag: str = "--out") -> None:
    """Before the model loads: the profile path is new, or a CompressKV profile (replaced), never another file."""
    from zoomkv.methods.compresskv import PROFILE_FORMAT

    if path.is_dir():
        raise ZoomKVError(f"{flag} {path} is a folder; give the profile file's path")
    if path.exists() or path.is_symlink():
        try:
            ours = path.is_file() and path.stat().st_size < 16 << 20 and \
                json.loads(path.read_text(encoding="utf-8")).get("format") == PROFILE_FORMAT
        except (OSError, ValueError, AttributeError):
            ours = False
        if not ours:
            raise ZoomKVError(f"{flag} {path} exists and is not a CompressKV profile (it is never replaced); "
                              "give a new file's path")


def save_profile(profile: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    # One key per line, each value on one line: small, diffable, still plain JSON.
    body = ",\n".join(f"  {json.dumps(k)}: {json.dumps(profile[k])}" for k in sorted(profile))
    # atomic: a half-written profile is never read, and the temporary file's name is never a user's
    return write_file_atomically(path, lambda tmp: tmp.write_text("{\n" + body + "\n}\n", encoding="utf-8"))


# -- the capturing attention function ----------------------------------------------------------------------
@dataclass
class Recorder:
    """What one sample's decoding accumulates, per profiled layer."""

    layers: frozenset[int]
    needle: torch.Tensor  # [T] bool: prompt positions of the needle
    window: int
    kernel_size: int
    error_budget: int
    keep: dict[int, torch.Tensor | None] = field(default_factory=dict)  # prefill: kept prompt rows [b, kvh, k]
    prompt_len: dict[int, int] = field(default_factory=dict)
    mass: dict[int, torch.Tensor] = field(default_factory=dict)  # [q_heads], summed over steps
    error: dict[int, float] = field(default_factory=dict)  # summed over steps
    steps: dict[int, int] = field(default_factory=dict)

    def prefill(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> None:
        from zoomkv.protocol.eviction import observation_scores, pool_scores
        from zoomkv.protocol.method import PrefillContext

        length = key.shape[2]
        self.prompt_len[layer] = length
        if length <= self.error_budget:
            self.keep[layer] = None
            return
        window = min(self.window, length)
        ctx = PrefillContext(layer, 0, key, value, query, None, self.error_budget, scale,
                             query.shape[1] // key.shape[1])
        votes = pool_scores(observation_scores(ctx, window)[..., : length - window], self.kernel_size, "avg")
        top = votes.topk(self.error_budget - window, dim=-1).indices
        self.keep[layer] = top

    def decode(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               mask: torch.Tensor | None, scale: float) -> None:
        b, hq, _, d = query.shape
        kvh, n = key.shape[1], key.shape[2]
        q = query[:, :, 0].float().reshape(b, kvh, hq // kvh, d)
        logits = torch.matmul(q, key.float().transpose(-1, -2)) * scale  # [b, kvh, g, n]
        if mask is not None:
            mask = mask[:, :, -1:, :n]  # [b, 1, 1, n]
            logits = logits.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else logits + mask
        probs = torch.softmax(logits, dim=-1)
        t = self.prompt_len[layer]
        needle = torch.zeros(n, dtype=torch.bool, device=probs.device)
        needle[: min(t, self.needle.shape[0])] = self.needle[:t].to(probs.device)
        mass = probs[..., needle].sum(-1).reshape(b, hq).sum(0)
        self.mass[layer] = self.mass.get(layer, torch.zeros_like(mass)) + mass

        out = torch.matmul(probs, value.float())
        keep = self.keep.get(layer)
        if keep is None:
            err = 0.0
        else:
            kept = torch.zeros(b, kvh, n, dtype=torch.bool, device=probs.device)
            kept.scatter_(-1, keep.to(probs.device), True)
            kept[..., t - min(self.window, t) :] = True  # the observation window and the generated rows
            approx = torch.matmul(torch.softmax(logits.masked_fill(~kept[:, :, None, :], float("-inf")), -1),
                                  value.float())
            err = float((approx - out).norm() / out.norm().clamp_min(1e-12))
        self.error[layer] = self.error.get(layer, 0.0) + err
        self.steps[layer] = self.steps.get(layer, 0) + 1


def _capture_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                       **kwargs: Any):
    """sdpa, unchanged, plus a look at each profiled layer's attention (float32, on the side)."""
    out = compat.sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                        scaling=scaling, **kwargs)
    recorder: Recorder | None = getattr(_state, "recorder", None)
    layer = getattr(module, "layer_idx", None)
    if recorder is not None and layer in recorder.layers:
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        with torch.no_grad():
            if query.shape[2] > 1:
                recorder.prefill(layer, query, key, value, scale)
            else:
                recorder.decode(layer, query, key, value, attention_mask, scale)
    return out


compat.register_attention(ATTENTION_NAME, _capture_attention)


# -- calibration ---------------------------------------------------------------------------------------------
def needle_span(text: str, answer: str) -> tuple[int, int]:
    """Character span of the needle: from the sentence holding the key's first occurrence to the end of
    the sentence holding its last (passkey needles state the key twice)."""
    first = text.find(answer)
    if first < 0:
        raise ZoomKVError("the answer does not occur in the prompt")
    last = text.rfind(answer)
    start = max(text.rfind(". ", 0, first) + 2, text.rfind("\n", 0, first) + 1, 0)
    end = text.find(".", last + len(answer))
    return start, (end + 1 if end >= 0 else last + len(answer))


def token_mask(tokenizer: Any, text: str, span: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids of ``text`` and a bool mask of the tokens overlapping ``span``."""
    try:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        offsets = enc["offset_mapping"]
        mask = [s < span[1] and e > span[0] for s, e in offsets]
    except (NotImplementedError, TypeError, ValueError, KeyError):
        # Slow tokenizers have no offsets: count the tokens before and up to the span instead.
        enc = tokenizer(text, add_special_tokens=False)
        lo = len(tokenizer(text[: span[0]], add_special_tokens=False)["input_ids"])
        hi = len(tokenizer(text[: span[1]], add_special_tokens=False)["input_ids"])
        mask = [lo <= i < hi for i in range(len(enc["input_ids"]))]
    return torch.tensor(enc["input_ids"]), torch.tensor(mask, dtype=torch.bool)


@torch.inference_mode()
def calibrate(
    model: Any,
    tokenizer: Any,
    *,
    model_name: str,
    samples: int = 8,
    length: int = 2048,
    top_heads: int = 4,
    error_budget: int = 128,
    window: int = 8,
    kernel_size: int = 5,
    answer_tokens: int = 0,
    accept_all: bool = False,
    chat: bool = False,
    progress: bool | None = None,
    processes: Any = None,
) -> dict[str, Any]:
    """The profile (a JSON-ready dict). ``progress``: a bar over the samples on stderr (None: when stderr
    is a terminal). ``processes`` (``zoomkv.eval.shards.Processes``): this process decodes samples i with
    i mod N = its rank; every sample's contribution is summed across processes, then over the samples in
    order, so the profile is the one a single process computes, bit for bit."""
    from tqdm.auto import tqdm

    from zoomkv.data.passkey import passkey_prompt
    from zoomkv.generation import format_prompt
    from zoomkv.methods.compresskv import PROFILE_FORMAT, PROFILE_VERSION

    config = compat.text_config(model.config)
    types = compat.layer_types(model.config)
    full_layers = frozenset(i for i, kind in enumerate(types) if kind == "full_attention")
    num_layers, q_heads = len(types), int(config.num_attention_heads)
    previous = getattr(model.config, "_attn_implementation", None) or "sdpa"
    compat.set_attention(model, ATTENTION_NAME)
    # one row per sample, filled by the process that decodes it (zeros elsewhere and for unused samples)
    head_rows = torch.zeros(samples, num_layers, q_heads, dtype=torch.float64)
    err_rows = torch.zeros(samples, num_layers, dtype=torch.float64)
    used_rows = torch.zeros(samples, dtype=torch.float64)
    mine = [i for i in range(samples) if processes is None or processes.mine(i)]
    bar = tqdm(mine, desc="calibrate compresskv", unit="sample", disable=None if progress is None else not progress)
    try:
        for i in bar:
            prompt = passkey_prompt(tokenizer, length, depth=(i + 0.5) / samples, seed=i)
            text = format_prompt(tokenizer, prompt.text, chat)
            ids, needle = token_mask(tokenizer, text, needle_span(text, prompt.answer))
            steps = answer_tokens or len(tokenizer(" " + prompt.answer, add_special_tokens=False)["input_ids"]) + 2
            recorder = Recorder(full_layers, needle, window, kernel_size, error_budget)
            _state.recorder = recorder
            try:
                input_ids = ids[None].to(model.device)
                out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                     max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                                     pad_token_id=tokenizer.pad_token_id, eos_token_id=None)
            finally:
                _state.recorder = None
            answer = tokenizer.decode(out[0, input_ids.shape[1] :], skip_special_tokens=True)
            if not accept_all and prompt.answer not in answer:
                continue
            used_rows[i] = 1
            bar.set_postfix(used=int(used_rows.sum()))
            for layer in full_layers:
                n = max(recorder.steps.get(layer, 0), 1)
                if layer in recorder.mass:
                    head_rows[i, layer] = recorder.mass[layer].double().cpu() / n
                err_rows[i, layer] = recorder.error.get(layer, 0.0) / n
    finally:
        bar.close()
        compat.set_attention(model, previous)
    if processes is not None:
        head_rows, err_rows, used_rows = (processes.sum(t) for t in (head_rows, err_rows, used_rows))
    head_sum = torch.zeros(num_layers, q_heads, dtype=torch.float64)
    err_sum = torch.zeros(num_layers, dtype=torch.float64)
    for i in range(samples):  # in sample order: the sums one process adds up as it goes
        if used_rows[i]:
            head_sum += head_rows[i]
            err_sum += err_rows[i]
    used = int(used_rows.sum())
    if used == 0:
        raise ZoomKVError(
            f"{model_name} answered none of the {samples} passkey samples, so no head can be scored; try more "
            "--samples or a shorter --length, or --accept-all to use every sample anyway"
        )
    scores = (head_sum / used).tolist()
    for layer in range(num_layers):
        if layer not in full_layers:
            scores[layer] = [0.0] * q_heads
    return {
        "format": PROFILE_FORMAT,
        "version": PROFILE_VERSION,
        "model": model_name,
        "num_layers": num_layers,
        "num_attention_heads": q_heads,
        "num_kv_heads": int(getattr(config, "num_key_value_heads", None) or q_heads),
        "layer_types": list(types),
        "heads": top_heads_per_layer(scores, top_heads, full_layers),
        "head_scores": scores,
        "layer_error": [float(e) for e in (err_sum / used).tolist()],
        "samples": samples,
        "used": used,
        "accept_all": accept_all,
        "length": length,
        "error_budget": error_budget,
        "window": window,
        "kernel_size": kernel_size,
        "command": f"zoomkv calibrate compresskv --model {model_name} --samples {samples} --length {length}"
                   + (" --accept-all" if accept_all else ""),
    }


def top_heads_per_layer(scores: list[list[float]], k: int, layers: frozenset[int]) -> list[list[int]]:
    """Per layer, the ``k`` highest-scoring query heads, best first (ties: the lower index); none for layers
    that are not profiled."""
    return [sorted(range(len(row)), key=lambda h: (-row[h], h))[:k] if layer in layers else []
            for layer, row in enumerate(scores)]
