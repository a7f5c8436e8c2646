"""``compresskv`` and its calibration: head selection on a constructed case, error-aware layer budgets, the
missing-profile error, and the runtime invariants (it needs a profile, so test_method_invariants.py skips it:
here they run with profiles calibrated into a temporary cache for the tiny models)."""

from __future__ import annotations

import json
import types

import pytest
import torch

from tests.helpers import greedy as _generate
from tests.helpers import max_logit_diff
from tests.helpers import padded_batch as _batch
from zoomkv import ZoomCache
from zoomkv.calibrate import compresskv as calib
from zoomkv.cli import main
from zoomkv.compat import generate_cache_kwargs
from zoomkv.errors import ConfigError, ZoomKVError
from zoomkv.memory import LayerMemory
from zoomkv.methods import get_method
from zoomkv.methods.compresskv import error_budgets, load_profile
from zoomkv.models import load_model
from zoomkv.protocol.method import PrefillContext

FAMILIES = ["tiny-llama", "tiny-gemma3"]
TINY_MODELS = FAMILIES
TINY_MODELS_FAST = "all"  # cheap: every layout in the fast tier too


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory):
    """A zoomkv cache holding CompressKV profiles of the tiny models (random models answer no passkey:
    calibrated with --accept-all)."""
    root = tmp_path_factory.mktemp("zoomkv-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ZOOMKV_CACHE", str(root))
        for family in FAMILIES:
            code = main(["calibrate", "compresskv", "--model", family, "--samples", "2", "--length", "300",
                         "--error-budget", "32", "--accept-all"])
            assert code == 0
    return root


def profile_path(root, family: str):
    return root / "profiles" / family / "compresskv.json"


@pytest.fixture(scope="module")
def profiled(tiny, cache_root):
    """The `tiny` model (conftest.py, once per FAMILIES name), its tokenizer and its CompressKV profile."""
    model, tok = tiny
    return model, tok, str(profile_path(cache_root, model.zoomkv_name))


# -- calibration ------------------------------------------------------------------------------------------------
def test_calibration_writes_a_profile_of_heads_and_errors(cache_root):
    llama = load_profile(profile_path(cache_root, "tiny-llama"))
    assert llama["num_layers"] == 4 and llama["used"] == 2 and llama["accept_all"]
    assert all(sorted(h) == [0, 1, 2, 3] for h in llama["heads"])  # 4 query heads: top 4 = all, by score
    for heads, scores in zip(llama["heads"], llama["head_scores"], strict=True):
        assert [scores[h] for h in heads] == sorted(scores, reverse=True)
    assert all(e > 0 for e in llama["layer_error"])  # 300-token prompts, 32 rows kept: evicting hurts
    gemma = load_profile(profile_path(cache_root, "tiny-gemma3"))
    full = [i for i, t in enumerate(gemma["layer_types"]) if t == "full_attention"]
    assert [bool(h) for h in gemma["heads"]] == [i in full for i in range(4)]  # sliding layers: not profiled
    assert json.loads(profile_path(cache_root, "tiny-gemma3").read_text())["format"] == "zoomkv-compresskv-profile"


def test_calibration_refuses_when_no_sample_is_answered(tmp_path, capsys):
    code = main(["calibrate", "compresskv", "--model", "tiny-llama", "--samples", "1", "--length", "300",
                 "--out", str(tmp_path / "p.json")])
    assert code == 2 and "--accept-all" in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()


def _constructed(needle_heads: tuple[int, ...], q_heads: int = 8, kv_heads: int = 2, t: int = 40):
    """Keys with a needle (rows 10-14) along channel 0; query heads ``needle_heads`` look for it, the others
    look elsewhere (channel 1, which no key uses strongly)."""
    g = torch.Generator().manual_seed(0)
    d = 16
    keys = torch.randn(1, kv_heads, t + 1, d, generator=g) * 0.1
    keys[:, :, 10:15, 0] = 3.0
    values = torch.randn(1, kv_heads, t + 1, d, generator=g)
    query = torch.zeros(1, q_heads, 1, d)
    query[:, :, 0, 1] = 3.0
    for h in needle_heads:
        query[:, h, 0] = 0.0
        query[:, h, 0, 0] = 3.0
    needle = torch.zeros(t, dtype=torch.bool)
    needle[10:15] = True
    return keys, values, query, needle


def test_head_selection_picks_the_heads_that_attend_to_the_needle():
    keys, values, query, needle = _constructed(needle_heads=(2, 5))
    t = needle.shape[0]
    recorder = calib.Recorder(frozenset({0}), needle, window=8, kernel_size=5, error_budget=16)
    module = types.SimpleNamespace(layer_idx=0, num_key_value_groups=4, is_causal=True)
    calib._state.recorder = recorder
    try:
        # through the registered capture function, exactly as the model calls it: prefill, then one step
        prompt_q = torch.randn(1, 8, t, 16)
        calib._capture_attention(module, prompt_q, keys[:, :, :t], values[:, :, :t], None, scaling=0.25)
        out, _ = calib._capture_attention(module, query, keys, values, None, scaling=0.25)
    finally:
        calib._state.recorder = None
    assert out.shape == (1, 1, 8, 16)  # the model's own output is untouched sdpa
    scores = (recorder.mass[0] / recorder.steps[0]).tolist()
    heads = calib.top_heads_per_layer([scores], 2, frozenset({0}))
    assert heads == [[2, 5]]  # query head 5 reads KV head 1 (GQA groups of 4): mapped correctly
    assert recorder.error[0] > 0  # 16 of 40 rows kept: the layer's output moved
    # keeping every row costs nothing
    exact = calib.Recorder(frozenset({0}), needle, window=8, kernel_size=5, error_budget=64)
    exact.prefill(0, prompt_q, keys[:, :, :t], values[:, :, :t], 0.25)
    exact.decode(0, query, keys, values, None, 0.25)
    assert exact.error[0] == 0.0


def test_needle_span_covers_the_needle_sentence():
    text = "Filler. Filler. The pass key is 12345. Remember it. 12345 is the pass key. More filler."
    start, end = calib.needle_span(text, "12345")
    assert text[start:end] == "The pass key is 12345. Remember it. 12345 is the pass key."


# -- layer budgets -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("budget", [9, 20, 32, 64, 100, 512])
@pytest.mark.parametrize("errors", [(0.5, 0.4, 0.3, 0.2), (1.0, 0.0, 0.0, 0.0), (0.0,) * 4, (0.2, 5.0, 0.1, 0.3, 0.3),
                                    (1e-9, 1.0)])
def test_layer_budgets_lie_in_range_and_sum_to_l_times_b(errors, budget):
    out = error_budgets(errors, budget)
    assert sum(out) == len(errors) * budget
    assert all(min(32, budget) <= x <= 3 * budget for x in out)
    # more error, at least as many rows
    for i in range(len(errors)):
        for j in range(len(errors)):
            if errors[i] > errors[j]:
                assert out[i] >= out[j]


def test_layer_budget_uses_the_profile_of_the_compressed_layers(tmp_path):
    path = tmp_path / "p.json"
    calib.save_profile({"format": "zoomkv-compresskv-profile", "version": 1, "model": "x", "num_layers": 4,
                        "num_attention_heads": 4, "heads": [[0], [1], [2], [3]],
                        "layer_error": [0.1, 0.9, 0.0, 0.5]}, path)
    method = get_method("compresskv", profile=str(path))
    budgets = [method.layer_budget(i, 4, 100) for i in range(4)]
    assert sum(budgets) == 400 and budgets[1] == max(budgets) and budgets[2] == 32
    zoom = (1, 3)  # a hybrid model compressing two layers: their budgets sum to 2·B
    assert method.layer_budget(1, 4, 100, zoom) + method.layer_budget(3, 4, 100, zoom) == 200
    with pytest.raises(ZoomKVError, match="4-layer"):
        method.layer_budget(0, 30, 100)


# -- the method ------------------------------------------------------------------------------------------------
def test_votes_come_from_the_semantic_retrieval_heads_only(tmp_path):
    """Head 1 attends to row 20, head 0 to row 30: a profile naming head 1 keeps row 20 and drops row 30;
    SnapKV (every head voting) cannot tell them apart."""
    t, d, budget = 60, 8, 12
    g = torch.Generator().manual_seed(1)
    keys = torch.randn(1, 2, t, d, generator=g) * 0.05
    keys[0, :, 20, 0] = 4.0
    keys[0, :, 30, 1] = 4.0
    queries = torch.zeros(1, 4, t, d)
    queries[0, 1, :, 0] = 3.0
    queries[0, 0, :, 1] = 3.0
    path = tmp_path / "p.json"
    calib.save_profile({"format": "zoomkv-compresskv-profile", "version": 1, "model": "x", "num_layers": 4,
                        "num_attention_heads": 4, "heads": [[1]] * 4, "layer_error": [1.0] * 4}, path)
    method = get_method("compresskv", profile=str(path), kernel_size=1)
    ctx = PrefillContext(2, 4, keys, torch.randn(1, 2, t, d), queries, None, budget, d**-0.5, 2)
    idx, _ = method.selection(ctx, method._heads(method.profile(), ctx), budget)
    for head in range(2):  # the same rows for every KV head
        kept = set(idx[0, head].tolist())
        assert 20 in kept and 30 not in kept and set(range(t - 8, t)) <= kept


def test_missing_profile_says_the_exact_command(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ZOOMKV_CACHE", str(tmp_path))
    with pytest.raises(ZoomKVError, match="zoomkv calibrate compresskv --model tiny-llama"):
        get_method("compresskv", model="tiny-llama")
    with pytest.raises(ZoomKVError, match="zoomkv calibrate compresskv --model"):
        get_method("compresskv", profile=str(tmp_path / "nope.json"))
    # the runtime passes the model's name: the error names it at prefill
    model, tok = load_model("tiny-llama")
    cache = ZoomCache(model, "compresskv", 64)
    ids = torch.randint(5, 200, (1, 30))
    with pytest.raises(ZoomKVError, match="zoomkv calibrate compresskv --model tiny-llama"):
        model.generate(input_ids=ids, max_new_tokens=2, do_sample=False, pad_token_id=0, **generate_cache_kwargs(cache))
    assert main(["generate", "--model", "tiny-llama", "--method", "compresskv", "--budget", "64", "--prompt", "hi"]) == 2
    assert "zoomkv calibrate compresskv --model tiny-llama" in capsys.readouterr().err
    with pytest.raises(ConfigError):
        get_method("compresskv", top_heads=0)


def test_profile_found_by_the_model_name(cache_root, monkeypatch):
    monkeypatch.setenv("ZOOMKV_CACHE", str(cache_root))
    model, _ = load_model("tiny-llama")
    cache = ZoomCache(model, "compresskv", 40)  # no profile argument: ZoomCache knows the model's name
    ids = torch.randint(5, 200, (1, 80), generator=torch.Generator().manual_seed(0))
    model.generate(input_ids=ids, max_new_tokens=4, do_sample=False, pad_token_id=0, **generate_cache_kwargs(cache))
    assert 0 < cache.max_device_rows <= max(cache.method.layer_budget(i, 4, 40) for i in range(4))


# -- the runtime invariants (as test_method_invariants.py, with a profile) ---------------------------------------
def test_large_budget_is_exactly_full(profiled):
    model, _, path = profiled
    ids, mask = _batch(model.config.vocab_size)
    ref = _generate(model, ids, mask, ZoomCache(model, "full"))
    out = _generate(model, ids, mask, ZoomCache(model, "compresskv", 4096, profile=path))
    assert torch.equal(out.sequences, ref.sequences)
    assert max_logit_diff(out.scores, ref.scores) < 1e-4


def test_small_budget_never_exceeded(profiled):
    model, _, path = profiled
    ids, mask = _batch(model.config.vocab_size, lengths=(90, 90))
    method = get_method("compresskv", profile=path)
    budget = max(method.min_budget(), 40)
    cache = ZoomCache(model, method, budget)
    inner = method.select
    checked = []

    def select(memory, query):
        sel = inner(memory, query)
        n = cache.num_layers_total
        cap = method.layer_budget(memory.layer_idx, n, budget, cache.zoom_layer_indices)
        assert method.device_rows(memory) <= cap and sel.keys.shape[2] <= cap
        checked.append(memory.layer_idx)
        return sel

    method.select = select
    _generate(model, ids, mask, cache, new=24)
    assert checked
    zoom = [layer for layer in cache.layers if isinstance(layer, LayerMemory)]
    caps = [method.layer_budget(layer.layer_idx, cache.num_layers_total, budget, cache.zoom_layer_indices)
            for layer in zoom]
    assert sum(caps) == budget * len(zoom) and all(32 <= c <= 3 * budget for c in caps)
    report = cache.memory_report()
    compressed = [r for r in report.layers if r.kind == "zoom"]
    assert compressed and sum(r.device_bytes for r in compressed) < sum(r.full_kv_bytes for r in compressed)
