"""Selection diagnostics (``ZoomCache(diagnose=True)``, ``zoomkv eval --diagnose``): the share of full
attention mass each step's selection keeps and its overlap with the exact top-B rows."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import load_tiny
from zoomkv import ZoomCache, compat
from zoomkv.eval.harness import EvalConfig, run_eval
from zoomkv.memory.diagnostics import SelectionProbe, row_fingerprints
from zoomkv.protocol.method import Selection


@pytest.fixture(scope="module")
def tiny_llama():
    return load_tiny("tiny-llama")


def _generate(model, method: str, budget: int | None, ids: torch.Tensor) -> ZoomCache:
    cache = ZoomCache(model, method, budget, diagnose=True)
    model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False,
                   **compat.generate_cache_kwargs(cache))
    return cache


def test_held_rows_are_recognised_by_their_bytes():
    keys = torch.randn(1, 2, 10, 8)
    sel = Selection(keys[:, :, [1, 4, 7]].clone(), keys[:, :, [1, 4, 7]].clone(),
                    bias=torch.tensor([[[0.0, float("-inf"), 0.0], [0.0, 0.0, 0.0]]]))
    held = SelectionProbe._held(keys, sel)
    assert held[0, 0].nonzero().flatten().tolist() == [1, 7]  # row 4 is hidden by -inf in head 0
    assert held[0, 1].nonzero().flatten().tolist() == [1, 4, 7]
    nudged = keys.clone()
    nudged[0, 0, 1, 3] = torch.nextafter(nudged[0, 0, 1, 3], torch.tensor(9.0))  # one ulp: another row
    assert row_fingerprints(nudged)[0, 0, 1] != row_fingerprints(keys)[0, 0, 1]
    also = torch.randn(1, 2, 2, 8)
    both = torch.cat([keys, also], dim=2)
    assert SelectionProbe._held(both, sel, also)[0, 1].nonzero().flatten().tolist() == [1, 4, 7, 10, 11]


def test_full_keeps_everything_and_the_oracle_holds_the_exact_top_b(tiny_llama):
    model, _ = tiny_llama
    ids = torch.randint(5, 200, (2, 200), generator=torch.Generator().manual_seed(0))
    full = _generate(model, "full", None, ids).probe
    for row in (0, 1):
        s = full.summary(row)
        assert all(v == pytest.approx(1.0) for layer in s["mass"] + s["overlap"] for v in layer)
        assert len(s["mass_by_step"]) == 4  # five tokens: the first comes from the prefill
    oracle = _generate(model, "oracle_topk", 32, ids).probe.summary(0)
    assert all(v == pytest.approx(1.0) for layer in oracle["overlap"] for v in layer)
    assert all(0.0 < v < 1.0 for layer in oracle["mass"] for v in layer)
    window = _generate(model, "streamingllm", 32, ids).probe.summary(0)
    # the oracle's B rows carry more mass than any other B rows, layer by layer and head by head
    for a, b in zip(oracle["mass"], window["mass"], strict=True):
        assert all(x >= y - 1e-6 for x, y in zip(a, b, strict=True))


def test_eval_diagnose_writes_the_table_and_plots(tiny_llama, tmp_path):
    model, tok = tiny_llama
    cfg = EvalConfig(model="tiny-llama", out=tmp_path, methods=["full", "oracle_topk", "snapkv"], budgets=["48"],
                     tasks=["niah_single_1"], lengths=[420], samples=2, diagnose=True, progress=False)
    rows = run_eval(cfg, model=model, tokenizer=tok)
    assert all("diagnostics" in r for r in rows)
    summary = (tmp_path / "summary.md").read_text()
    assert "## Selection diagnostics" in summary and "| oracle_topk | 48 | 2 |" in summary
    for name in ("diagnostics_layers.png", "diagnostics_steps.png", "diagnostics_heads.png"):
        assert (tmp_path / name).stat().st_size > 1000
    first = json.loads((tmp_path / "rows.jsonl").read_text().splitlines()[0])
    assert len(first["diagnostics"]["mass"]) == len(first["diagnostics"]["layers"])


def test_needle_tokens_are_found_and_measured(tiny_llama, tmp_path):
    from zoomkv.generation import focus_positions

    _, tok = tiny_llama
    context = "abc The number is 7281. def 7281"
    positions = focus_positions(tok, [context], [["7281"]], pads=[3])
    ids = tok(context, add_special_tokens=False)["input_ids"]
    chosen = [ids[p - 3] for p in positions[0].tolist()]
    assert tok.decode(chosen).replace(" ", "") == "72817281"  # both occurrences, shifted by the padding
    model, _ = tiny_llama
    cfg = EvalConfig(model="tiny-llama", out=tmp_path, methods=["full", "oracle_topk"], budgets=["48"],
                     tasks=["niah_single_1"], lengths=[420], samples=1, diagnose=True, progress=False)
    rows = run_eval(cfg, model=model, tokenizer=tok)
    full = next(r for r in rows if r["method"] == "full")["diagnostics"]
    assert full["needle_kept"] == pytest.approx(full["needle_full"]) and full["needle_full"] > 0
    assert all(v == pytest.approx(1.0) for v in full["needle_by_step"])
    assert "needle kept" in (tmp_path / "summary.md").read_text()
