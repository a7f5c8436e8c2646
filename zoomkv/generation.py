"""``generate_text``: the one call the CLI, the demo and the benchmarks use to run a method on prompts.

It validates the prompt, applies the chat template when asked, runs ``model.generate`` with a
``ZoomCache`` built from a parsed ``CacheSpec`` (method, budget, variants, prefill chunk), and times prefill
and decoding separately (a logits processor timestamps every step). ``generate_methods`` runs several specs
from one shared prefill.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from zoomkv import compat
from zoomkv.errors import PromptError
from zoomkv.memory import CacheSpec, MemoryReport, ZoomCache
from zoomkv.memory.cache import LayerReport
from zoomkv.memory.replay import cache_from_record, prefill_positions, record_prefill
from zoomkv.models import context_limit


@dataclass
class GenerationResult:
    """What ``generate_text`` returns: the texts, token counts, prefill and decode timings, the memory report."""

    texts: list[str]
    prompt_tokens: int
    new_tokens: int
    prefill_s: float
    decode_ms_per_token: float
    memory: MemoryReport
    token_ids: list[list[int]] = field(default_factory=list)
    cache: ZoomCache | None = None  # kept when asked (generate_methods(keep_caches=True)): more turns can follow
    sequence: torch.Tensor | None = None  # the input ids and every generated token, as the cache saw them
    diagnostics: list[dict[str, Any] | None] | None = None  # per sequence, when asked (zoomkv.memory.diagnostics)

    @property
    def text(self) -> str:
        """The first sequence's text."""
        return self.texts[0]


class _StepClock(LogitsProcessor):
    """Records when each forward pass (the prefill, then one per decode step) hands its logits over.

    A logits processor rather than a streamer, because streamers only accept batch size 1.
    """

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if scores.is_cuda:  # kernels run ahead of Python: stamp when the step's logits really exist
            torch.cuda.synchronize(scores.device)
        self.times.append(time.perf_counter())
        return scores


def format_prompt(tokenizer: Any, prompt: str, chat: bool | None = None) -> str:
    """Wrap ``prompt`` in the model's chat template when it has one (``chat=None`` → when available)."""
    use_chat = chat if chat is not None else bool(getattr(tokenizer, "chat_template", None))
    if use_chat and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
    return prompt


def encode_prompts(tokenizer: Any, prompts: list[str], *, max_length: int, max_new_tokens: int, device: Any):
    if not prompts:
        raise PromptError("no prompt given")
    for p in prompts:
        if not p or not p.strip():
            raise PromptError("the prompt is empty")
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    length = enc["input_ids"].shape[1]
    if length + max_new_tokens > max_length:
        raise PromptError(
            f"the prompt has {length} tokens; with {max_new_tokens} new tokens that is over the model's "
            f"maximum context of {max_length} tokens"
        )
    return {k: v.to(device) for k, v in enc.items()}


@torch.inference_mode()
def generate_text(
    model: Any,
    tokenizer: Any,
    prompts: str | list[str],
    spec: CacheSpec,
    *,
    max_new_tokens: int = 64,
    chat: bool | None = None,
    stop_at_eos: bool = True,
) -> GenerationResult:
    """Generate from ``prompts`` with the cache ``spec`` describes (``CacheSpec.build("quest", 256)``; its
    ``prefill_chunk``: the prompt goes through in pieces of that many tokens, compressed as they go)."""
    if isinstance(prompts, str):
        prompts = [prompts]
    if max_new_tokens < 1:
        raise PromptError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    max_len = context_limit(model)
    spec.check_model(model)
    texts = [format_prompt(tokenizer, p, chat) for p in prompts]
    inputs = encode_prompts(
        tokenizer, texts, max_length=max_len, max_new_tokens=max_new_tokens, device=model.device
    )
    cache = ZoomCache(model, spec, tokenizer=tokenizer)
    new, prefill_s, decode_ms = _timed_generate(model, tokenizer, inputs, cache, max_new_tokens, stop_at_eos)
    decoded = tokenizer.batch_decode(new, skip_special_tokens=True)
    memory = cache.memory_report()
    cache.release()  # freed now, not at some later cyclic GC (see ZoomCache.release): callers loop over prompts
    return GenerationResult(
        texts=decoded,
        prompt_tokens=inputs["input_ids"].shape[1],
        new_tokens=new.shape[1],
        prefill_s=prefill_s,
        decode_ms_per_token=decode_ms,
        memory=memory,
        token_ids=new.tolist(),
    )


def _timed_generate(model: Any, tokenizer: Any, inputs: dict[str, torch.Tensor], cache: Any, max_new_tokens: int,
                    stop_at_eos: bool) -> tuple[torch.Tensor, float, float]:
    """Greedy ``model.generate`` with ``cache``; returns the new tokens, the prefill's seconds and the decode's
    milliseconds per step (a logits processor stamps every step)."""
    clock = _StepClock()
    start = time.perf_counter()
    gen_kwargs: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "do_sample": False,
        "pad_token_id": tokenizer.pad_token_id,
        "logits_processor": LogitsProcessorList([clock]),
    }
    if not stop_at_eos:
        gen_kwargs["eos_token_id"] = None
        gen_kwargs["min_new_tokens"] = max_new_tokens
    out = model.generate(**inputs, **gen_kwargs, **compat.generate_cache_kwargs(cache))
    end = time.perf_counter()
    new = out[:, inputs["input_ids"].shape[1]:]
    stamps = clock.times  # after the prefill, then after each decode step
    if stamps:
        prefill_s = stamps[0] - start
        steps = len(stamps) - 1
        decode_ms = (stamps[-1] - stamps[0]) / steps * 1000 if steps else 0.0
    else:
        prefill_s, decode_ms = end - start, 0.0
    return new, prefill_s, decode_ms


PLAIN_ATTENTION = "sdpa"  # what transformers runs when nobody asks for zoomkv


@torch.inference_mode()
def generate_plain(model: Any, tokenizer: Any, prompts: list[str], *, max_new_tokens: int = 64,
                   chat: bool | None = None, stop_at_eos: bool = True) -> GenerationResult:
    """The same prompts through plain transformers: its own ``DynamicCache`` and sdpa attention, no zoomkv on
    the path (the ``hf`` reference row of ``zoomkv bench``). Its memory report is one dense layer per KV
    layer with what that cache held at the end: every row, on the device."""
    from transformers import DynamicCache

    if isinstance(prompts, str):
        prompts = [prompts]
    texts = [format_prompt(tokenizer, p, chat) for p in prompts]
    inputs = encode_prompts(tokenizer, texts, max_length=context_limit(model), max_new_tokens=max_new_tokens,
                            device=model.device)
    previous = getattr(model.config, "_attn_implementation", None) or PLAIN_ATTENTION
    compat.set_attention(model, PLAIN_ATTENTION)
    cache = DynamicCache(config=model.config)
    try:
        new, prefill_s, decode_ms = _timed_generate(model, tokenizer, inputs, cache, max_new_tokens, stop_at_eos)
    finally:
        compat.set_attention(model, previous)
    reports = []
    for i, layer in enumerate(getattr(cache, "layers", [])):
        held = sum(t.nbytes for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
                   if isinstance(t, torch.Tensor))
        rows = layer.keys.shape[2] if isinstance(getattr(layer, "keys", None), torch.Tensor) else 0
        reports.append(LayerReport(i, "dense", held, 0, held, rows, held, rows))
    memory = MemoryReport(method="hf", budget=None, tokens=inputs["input_ids"].shape[1] + new.shape[1], layers=reports)
    del cache
    return GenerationResult(
        texts=tokenizer.batch_decode(new, skip_special_tokens=True),
        prompt_tokens=inputs["input_ids"].shape[1],
        new_tokens=new.shape[1],
        prefill_s=prefill_s,
        decode_ms_per_token=decode_ms,
        memory=memory,
        token_ids=new.tolist(),
    )


@torch.inference_mode()
def generate_methods(
    model: Any,
    tokenizer: Any,
    prompts: str | list[str],
    specs: list[CacheSpec],
    *,
    max_new_tokens: int = 32,
    chat: bool | None = None,
    stop_at_eos: bool = True,
    contexts: list[str] | None = None,
    keep_caches: bool = False,
    diagnose: bool = False,
    focus: list[list[str]] | None = None,
) -> list[GenerationResult]:
    """Run several cache specs on the same prompts with a single prefill (see ``zoomkv.memory.replay``).

    ``contexts`` (the query-agnostic protocol): for each prompt, its leading part that is prefilled and
    compressed before the rest (the question and the answer prefix) arrives; the rest then extends each
    method's compressed cache. Without it the whole prompt is prefilled and compressed (query-aware), and
    tokens are exactly those ``generate_text`` gives for each method; ``prefill_s`` is the shared prefill.
    A spec with a ``prefill_chunk`` takes no part in the shared prefill: its cache takes the prompt (or
    context) in pieces by itself.
    ``keep_caches``: each result keeps its cache and token sequence, so more turns can follow.
    ``diagnose``: each result's ``diagnostics`` say, per sequence, layer and KV head, what share of full
    attention its selections kept (``zoomkv.memory.diagnostics``); with ``focus`` (per prompt, strings such
    as the needle's answer) and ``contexts``, also the share of the attention on those strings' tokens in the
    context that was kept (needs a tokenizer with offsets; ignored otherwise).
    """
    if isinstance(prompts, str):
        prompts = [prompts]
    if max_new_tokens < 1:
        raise PromptError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    max_len = context_limit(model)
    for spec in specs:
        spec.check_model(model)  # before the prefill
    texts = [format_prompt(tokenizer, p, chat) for p in prompts]
    if contexts is None:
        inputs = encode_prompts(tokenizer, texts, max_length=max_len, max_new_tokens=max_new_tokens,
                                device=model.device)
        results = _from_shared_prefill(model, tokenizer, inputs, specs, max_new_tokens, stop_at_eos, diagnose,
                                       keep_caches)
    else:
        results = _query_agnostic(model, tokenizer, texts, contexts, specs, max_new_tokens, stop_at_eos, max_len,
                                  diagnose, focus if diagnose else None, keep_caches)
    return results


def _release(result: GenerationResult, keep_caches: bool) -> GenerationResult:
    """Drop the result's cache as soon as its numbers are read, unless asked to keep it: otherwise every
    method's whole cache (the host tier holds all KV) stays alive until the last method of the prompt ran."""
    if not keep_caches:
        # release(), not only dropping the reference: a ZoomCache is in reference cycles (its layers point
        # back at it) that only the cyclic GC would free, long after the next prompts' caches were made.
        result.cache.release()
        result.cache = result.sequence = None
    return result


def _shared_record(model: Any, specs: list[CacheSpec], ids: torch.Tensor, mask: torch.Tensor) -> Any:
    """The one prefill every spec without a ``prefill_chunk`` starts from (None when every spec chunks)."""
    return record_prefill(model, ids, mask) if any(s.prefill_chunk is None for s in specs) else None


def _cache_for(model: Any, tokenizer: Any, spec: CacheSpec, record: Any, diagnose: bool = False) -> ZoomCache:
    if spec.prefill_chunk is None:
        return cache_from_record(model, record, spec, tokenizer=tokenizer, diagnose=diagnose)
    return ZoomCache(model, spec, tokenizer=tokenizer, diagnose=diagnose)


def _decode(model: Any, tokenizer: Any, cache: ZoomCache, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int,
            stop_at_eos: bool) -> tuple[torch.Tensor, list[float]]:
    """Greedy ``new_tokens`` from ``ids`` (whatever of them the cache does not hold goes through first)."""
    clock = _StepClock()
    gen_kwargs: dict[str, Any] = {"max_new_tokens": new_tokens, "do_sample": False,
                                  "pad_token_id": tokenizer.pad_token_id,
                                  "logits_processor": LogitsProcessorList([clock])}
    if not stop_at_eos:
        gen_kwargs["eos_token_id"] = None
        gen_kwargs["min_new_tokens"] = new_tokens
    out = model.generate(input_ids=ids, attention_mask=mask, **gen_kwargs, **compat.generate_cache_kwargs(cache))
    return out[:, ids.shape[1]:], clock.times


def _step_ms(stamps: list[float]) -> float:
    """Mean time per decode step after the first stamp (which ends the pass over the new input)."""
    steps = len(stamps) - 1
    return (stamps[-1] - stamps[0]) / steps * 1000 if steps > 0 else 0.0


def _result(tokenizer: Any, cache: ZoomCache, ids: torch.Tensor, new: torch.Tensor, prefill_s: float,
            decode_ms: float, stop_at_eos: bool) -> GenerationResult:
    token_ids = new.tolist()
    eos = tokenizer.eos_token_id
    if stop_at_eos and eos is not None:  # a row whose first token was EOS is finished there
        token_ids = [row[: row.index(eos) + 1] if eos in row else row for row in token_ids]
    return GenerationResult(
        texts=tokenizer.batch_decode(token_ids, skip_special_tokens=True),
        prompt_tokens=ids.shape[1],
        new_tokens=new.shape[1],
        prefill_s=prefill_s,
        decode_ms_per_token=decode_ms,
        memory=cache.memory_report(),
        token_ids=token_ids,
        cache=cache,
        sequence=torch.cat([ids, new], dim=1),
        diagnostics=None if cache.probe is None else [cache.probe.summary(b) for b in range(ids.shape[0])],
    )


def _from_shared_prefill(model: Any, tokenizer: Any, inputs: dict[str, torch.Tensor], specs: list[CacheSpec],
                         max_new_tokens: int, stop_at_eos: bool, diagnose: bool = False,
                         keep_caches: bool = False) -> list[GenerationResult]:
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    eos = tokenizer.eos_token_id
    record = _shared_record(model, specs, ids, mask)
    results = []
    for spec in specs:
        cache = _cache_for(model, tokenizer, spec, record, diagnose)
        start = time.perf_counter()
        if spec.prefill_chunk is not None:  # chunked: the prefill is this method's own, timed to its first token
            new, stamps = _decode(model, tokenizer, cache, ids, mask, max_new_tokens, stop_at_eos)
            prefill_s = stamps[0] - start if stamps else time.perf_counter() - start
            decode_ms = _step_ms(stamps)
        else:
            first = record.last_logits.argmax(dim=-1, keepdim=True)  # greedy: the same for every method
            prefill_s = record.prefill_s
            if max_new_tokens > 1 and not (stop_at_eos and eos is not None and bool((first == eos).all())):
                more, stamps = _decode(model, tokenizer, cache, torch.cat([ids, first], dim=1),
                                       torch.cat([mask, torch.ones_like(first)], dim=1), max_new_tokens - 1,
                                       stop_at_eos)
                new = torch.cat([first, more], dim=1)
            else:
                new, stamps = first, []
            elapsed = time.perf_counter() - start
            decode_ms = elapsed / len(stamps) * 1000 if stamps else 0.0
        results.append(_release(_result(tokenizer, cache, ids, new, prefill_s, decode_ms, stop_at_eos), keep_caches))
        del cache
    return results


def focus_positions(tokenizer: Any, contexts: list[str], focus: list[list[str]],
                    pads: list[int]) -> list[torch.Tensor] | None:
    """Per context, the positions (after ``pads[i]`` tokens of left padding) of the tokens that overlap an
    occurrence of any of ``focus[i]``'s strings. None when the tokenizer cannot map tokens to characters."""
    out = []
    for context, strings, pad in zip(contexts, focus, pads, strict=True):
        try:
            offsets = tokenizer(context, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        except (NotImplementedError, KeyError, TypeError):
            return None
        spans = [(m, m + len(s)) for s in strings if s for m in _occurrences(context, s)]
        hit = [pad + i for i, (a, b) in enumerate(offsets) if any(a < e and b > s for s, e in spans)]
        out.append(torch.tensor(hit, dtype=torch.long))
    return out


def _occurrences(text: str, s: str) -> list[int]:
    found, at = [], text.find(s)
    while at >= 0:
        found.append(at)
        at = text.find(s, at + 1)
    return found


def _query_agnostic(model: Any, tokenizer: Any, texts: list[str], contexts: list[str], specs: list[CacheSpec],
                    max_new_tokens: int, stop_at_eos: bool, max_len: int, diagnose: bool = False,
                    focus: list[list[str]] | None = None, keep_caches: bool = False) -> list[GenerationResult]:
    if len(contexts) != len(texts):
        raise PromptError(f"{len(contexts)} contexts for {len(texts)} prompts")
    rests = []
    for text, context in zip(texts, contexts, strict=True):
        if not text.startswith(context):
            raise PromptError("a context must be the start of its prompt (the question comes after it)")
        rests.append(text[len(context):])
    for c in contexts:
        if not c.strip():
            raise PromptError("the context is empty")
    # Context and question are tokenized apart, so no token straddles the cut; each row is left padded.
    rows = [tokenizer(c, add_special_tokens=False)["input_ids"] for c in contexts]
    rest = [tokenizer(r, add_special_tokens=False)["input_ids"] for r in rests]
    total = max(len(c) + len(r) for c, r in zip(rows, rest, strict=True))
    if total + max_new_tokens > max_len:
        raise PromptError(f"the prompt has {total} tokens; with {max_new_tokens} new tokens that is over "
                          f"the model's maximum context of {max_len} tokens")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids = torch.tensor([[pad] * (total - len(c) - len(r)) + c + r for c, r in zip(rows, rest, strict=True)],
                       device=model.device)
    mask = torch.tensor([[0] * (total - len(c) - len(r)) + [1] * (len(c) + len(r))
                         for c, r in zip(rows, rest, strict=True)], device=model.device)
    # One cut for the batch, before the longest question: no question token is ever compressed (a row with a
    # shorter question has its last few context tokens asked with it instead).
    cut = total - max(len(r) for r in rest)
    ctx = {"input_ids": ids[:, :cut], "attention_mask": mask[:, :cut]}
    focus_rows = None
    if focus is not None:
        pads = [total - len(c) - len(r) for c, r in zip(rows, rest, strict=True)]
        focus_rows = focus_positions(tokenizer, contexts, focus, pads)
    record = _shared_record(model, specs, ctx["input_ids"], ctx["attention_mask"])
    results = []
    for spec in specs:
        cache = _cache_for(model, tokenizer, spec, record, diagnose)
        if cache.probe is not None:
            cache.probe.focus = focus_rows
        start = time.perf_counter()
        if spec.prefill_chunk is not None:  # this method's own (chunked) prefill of the context, without the question
            model(input_ids=ctx["input_ids"], attention_mask=ctx["attention_mask"], use_cache=True, logits_to_keep=1,
                  position_ids=prefill_positions(ctx["attention_mask"]),
                  **compat.generate_cache_kwargs(cache))
        prefill_s = record.prefill_s if spec.prefill_chunk is None else time.perf_counter() - start
        start = time.perf_counter()
        new, stamps = _decode(model, tokenizer, cache, ids, mask, max_new_tokens, stop_at_eos)
        decode_ms = _step_ms(stamps)  # the first stamp ends the question's pass through the compressed cache
        results.append(_release(_result(tokenizer, cache, ids, new, prefill_s, decode_ms, stop_at_eos), keep_caches))
        del cache
    return results


@torch.inference_mode()
def generate_turns(
    model: Any,
    tokenizer: Any,
    prompt: str,
    follow_ups: list[str],
    specs: list[CacheSpec],
    *,
    max_new_tokens: list[int],
    context: str | None = None,
    stop_at_eos: bool = True,
) -> list[list[GenerationResult]]:
    """Several turns on one cache per spec: ``prompt`` (whose ``context`` is compressed first when
    given, query-agnostic), then each follow-up text appended after the previous answer, which stays in
    the cache. ``max_new_tokens[i]`` per turn. Returns, per spec, one result per turn (memory after it)."""
    if len(max_new_tokens) != len(follow_ups) + 1:
        raise PromptError(f"{len(max_new_tokens)} generation lengths for {len(follow_ups) + 1} turns")
    first = generate_methods(model, tokenizer, [prompt], specs, max_new_tokens=max_new_tokens[0], chat=False,
                             stop_at_eos=stop_at_eos, contexts=None if context is None else [context],
                             keep_caches=True)
    out = []
    for result in first:
        cache, ids = result.cache, result.sequence
        turns = [result]
        for follow_up, new_tokens in zip(follow_ups, max_new_tokens[1:], strict=True):
            extra = tokenizer(follow_up, add_special_tokens=False, return_tensors="pt")["input_ids"].to(ids.device)
            ids = torch.cat([ids, extra], dim=1)
            start = time.perf_counter()
            new, stamps = _decode(model, tokenizer, cache, ids, torch.ones_like(ids), new_tokens, stop_at_eos)
            # the first stamp ends the follow-up's pass through the compressed cache
            turn = _result(tokenizer, cache, ids, new, (stamps[0] if stamps else time.perf_counter()) - start,
                           _step_ms(stamps), stop_at_eos)
            turns.append(turn)
            ids = turn.sequence
        out.append(turns)
    return out
