"""Tiny random test models built in-process (no download): a byte-level tokenizer and four families."""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

__all__ = ["TINY_MAX_POSITIONS", "build_tiny_model", "build_tiny_tokenizer"]

_TINY_SPECIALS = ("<pad>", "<bos>", "<eos>")  # ids 0, 1, 2; byte b is id 3 + b
_TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)
TINY_MAX_POSITIONS = 4096


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character table, the alphabet the ByteLevel pre-tokenizer emits.

    Recomputed here (not ``ByteLevel.alphabet()``, an unordered list) so that token id 3 + b is byte b,
    deterministically.
    """
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer built in-process (no download): <pad>=0, <bos>=1, <eos>=2, byte b = 3 + b.

    No merges, so every UTF-8 byte is one token and decoding round-trips any text exactly. It prepends
    <bos> like Llama/Gemma tokenizers do, and pads on the left for batched generation.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {tok: i for i, tok in enumerate(_TINY_SPECIALS)}
    vocab.update({ch: len(_TINY_SPECIALS) + b for b, ch in _bytes_to_unicode().items()})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # use_regex=False: no word splitting at all; with no merges it would only cost time.
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    backend.add_special_tokens(list(_TINY_SPECIALS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        padding_side="left",
        model_max_length=TINY_MAX_POSITIONS,
    )
    tokenizer.chat_template = _TINY_CHAT_TEMPLATE
    return tokenizer


def _tiny_config(family: str, vocab_size: int) -> Any:
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen2Config, Qwen3Config

    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA: two query heads share each KV head, as in the real models
        max_position_embeddings=TINY_MAX_POSITIONS,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    if family == "llama":
        return LlamaConfig(head_dim=16, **common)
    if family == "qwen2":
        return Qwen2Config(**common)  # head_dim is hidden_size // heads = 16 in Qwen2
    if family == "qwen3":
        return Qwen3Config(head_dim=16, **common)
    if family == "gemma3":
        return Gemma3TextConfig(
            head_dim=16,
            query_pre_attn_scalar=16,
            # A window much shorter than test prompts, so sliding layers really drop old positions.
            sliding_window=16,
            layer_types=["sliding_attention"] * 3 + ["full_attention"],
            **common,
        )
    raise ValueError(f"unknown tiny family {family!r}")


def build_tiny_model(
    family: str, *, dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa"
) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """A small randomly initialised model of ``family`` ("llama", "qwen2", "qwen3", "gemma3").

    Weights come from seed 0 inside a forked RNG, so every call builds the same model and the caller's
    random state is untouched. They are initialised in float32 and cast afterwards, so the bf16/fp16
    models are the roundings of the fp32 one rather than different random draws.
    """
    tokenizer = build_tiny_tokenizer()
    config = _tiny_config(family, vocab_size=len(tokenizer))  # exactly the tokenizer: every id decodes
    with torch.random.fork_rng(devices=[]):  # devices=[]: built on CPU, leave CUDA generators alone
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.float32, attn_implementation=attn_implementation
        )
    model = model.to(dtype)
    return model, tokenizer
