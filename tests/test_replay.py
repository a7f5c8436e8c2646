"""Prefill once, compress many times: the tokens must be exactly those of running each method alone."""

from __future__ import annotations

import pytest

from zoomkv.generation import generate_methods, generate_text
from zoomkv.memory import CacheSpec
from zoomkv.methods import METHODS
from zoomkv.models import load_model

RUNS = [CacheSpec.build("full")] + [
    CacheSpec.build(name, max(40, cls().min_budget())) for name, cls in sorted(METHODS.items())
    if cls.uses_budget and not getattr(cls, "needs_profile", False)
]


@pytest.mark.parametrize("family", ["tiny-llama", pytest.param("tiny-gemma3", marks=pytest.mark.heavy)])
def test_replay_equals_running_each_method(family):
    model, tok = load_model(family)
    prompts = ["The quick brown fox jumps over the lazy dog. " * 3, "Pack my box with five dozen liquor jugs."]
    replayed = generate_methods(model, tok, prompts, RUNS, max_new_tokens=12, chat=False, stop_at_eos=False)
    for run, got in zip(RUNS, replayed, strict=True):
        alone = generate_text(model, tok, prompts, run, max_new_tokens=12, chat=False, stop_at_eos=False)
        assert got.token_ids == alone.token_ids, run.label
        assert got.memory.device_bytes == alone.memory.device_bytes, run.label
