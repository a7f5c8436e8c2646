"""Tokenizer settings every loaded model gets (shared by loading and the GGUF conversion)."""

from __future__ import annotations

from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["ensure_pad_token"]


def ensure_pad_token(tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel) -> None:
    """Batched generation needs a pad token; eos is the conventional stand-in when a model has none."""
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    gen = getattr(model, "generation_config", None)
    if gen is not None and gen.pad_token_id is None and tokenizer.pad_token_id is not None:
        gen.pad_token_id = tokenizer.pad_token_id
