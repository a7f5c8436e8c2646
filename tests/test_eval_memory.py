"""A long eval must not keep dead caches: each ZoomCache is freed as soon as its numbers are read.

A ZoomCache and its LayerMemorys point at each other, so refcounting alone never frees them; left to the
cyclic GC (whose full collections are rare in a process holding a model) a `zoomkv eval` over SmolLM2 at
4K tokens kept every prompt's caches and prefill records and grew to 24 GB. ``ZoomCache.release`` breaks
the cycles; these tests run with the cyclic GC off, so a cache that only it could free stays visible.
"""

from __future__ import annotations

import gc
import weakref

import pytest

from zoomkv.eval.harness import EvalConfig, run_eval
from zoomkv.generation import generate_methods, generate_text
from zoomkv.memory import CacheSpec
from zoomkv.memory.cache import ZoomCache

PROMPT = "The grass is green. The sky is blue. The sun is warm. " * 12
QUESTION = " What colour is the sky? Answer:"


@pytest.fixture
def made(monkeypatch):
    """Weak references to every ZoomCache (and its layers) built while the test runs, with the cyclic GC off."""
    refs: list[weakref.ref] = []
    real = ZoomCache.__init__

    def tracking_init(self, *args, **kwargs):
        real(self, *args, **kwargs)
        refs.append(weakref.ref(self))
        refs.extend(weakref.ref(layer) for layer in self.layers)

    monkeypatch.setattr(ZoomCache, "__init__", tracking_init)
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield refs
    finally:
        if was_enabled:
            gc.enable()


def _alive(refs: list[weakref.ref]) -> list[str]:
    return [type(obj).__name__ for r in refs if (obj := r()) is not None]


def _runs() -> list[CacheSpec]:
    return [CacheSpec.build("full"), CacheSpec.build("oracle_topk", 32),
            CacheSpec.build("oracle_topk", 32, tail_summary=True), CacheSpec.build("quest", 32),
            CacheSpec.build("snapkv", 48)]


@pytest.mark.parametrize("diagnose,agnostic", [  # two of the four in the fast tier, every one in make test
    pytest.param(False, True, id="plain-query-agnostic"),
    pytest.param(False, False, id="plain-query-aware", marks=pytest.mark.heavy),
    pytest.param(True, True, id="diagnose-query-agnostic", marks=pytest.mark.heavy),
    pytest.param(True, False, id="diagnose-query-aware"),
])
def test_generate_methods_frees_every_cache_without_the_cyclic_gc(tiny, made, agnostic, diagnose):
    model, tokenizer = tiny
    for i in range(3):
        prompt = PROMPT + f" Number {i}." + QUESTION
        results = generate_methods(model, tokenizer, [prompt], _runs(), max_new_tokens=3, chat=False,
                                   contexts=[PROMPT + f" Number {i}."] if agnostic else None, diagnose=diagnose,
                                   focus=[["blue"]])
        assert len(results) == len(_runs()) and all(r.cache is None for r in results)
        # every method's cache and the prefill record's recording cache: all gone by refcounting alone
        assert len(made) > 0 and _alive(made) == []
    assert gc.collect() == 0 or not any(isinstance(o, ZoomCache) for o in gc.garbage)


def test_kept_caches_live_until_released(tiny, made):
    model, tokenizer = tiny
    results = generate_methods(model, tokenizer, [PROMPT + QUESTION], _runs()[:2], max_new_tokens=2, chat=False,
                               keep_caches=True)
    assert all(r.cache is not None and r.cache.get_seq_length() > 0 for r in results)
    for r in results:
        r.cache.release()
    del r, results
    assert _alive(made) == []


def test_generate_text_frees_its_cache(tiny, made):
    model, tokenizer = tiny
    for method, budget in [("full", None), ("quest", 32)]:
        result = generate_text(model, tokenizer, PROMPT, CacheSpec.build(method, budget), max_new_tokens=2,
                               chat=False)
        assert result.memory.full_kv_bytes > 0
        assert _alive(made) == []


def test_eval_loop_frees_every_cache(tmp_path, tiny, made):
    """The harness, multi-turn task included (generate_turns keeps each run's cache over its turns)."""
    cfg = EvalConfig(model="tiny-llama", out=tmp_path / "ev", methods=["oracle_topk", "quest"], budgets=["64"],
                     tasks=["niah_single_1", "niah_multiturn"], lengths=[800], samples=2, max_new_tokens=2,
                     progress=False, plots=False)
    rows = run_eval(cfg, *tiny)
    assert rows and len(made) > 0
    assert _alive(made) == []
