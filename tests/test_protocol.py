"""The evaluation protocols: query-agnostic (the default: the context is compressed before the question
exists, then the question extends the compressed cache) and query-aware (the whole prompt compressed)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tests.helpers import load_tiny
from zoomkv.data.sample import PromptFormat
from zoomkv.errors import ZoomKVError
from zoomkv.eval.harness import EvalConfig, run_eval
from zoomkv.eval.tasks import GRID_TASK, SYNTHETIC_TASKS, TaskBuilder
from zoomkv.generation import generate_methods
from zoomkv.memory import CacheSpec


@pytest.mark.parametrize("task", [*SYNTHETIC_TASKS, GRID_TASK])
@pytest.mark.parametrize("chat", [False, True])
def test_every_task_says_where_its_question_starts(task, chat):
    _, tok = load_tiny("tiny-llama")
    fmt = PromptFormat(tok, chat)
    sample = TaskBuilder(fmt, seed=0, model_max=4096, essays=None, data=[]).build(task, 1500, 0, 0.5)
    assert sample.question_at is not None and 0 < sample.question_at < len(sample.prompt)
    text, context = fmt.sample_text(sample), fmt.context_text(sample)
    assert text.startswith(context) and len(context) < len(text)
    question = sample.prompt[sample.question_at:]
    assert question.strip() and question not in context  # the question comes after what is compressed
    assert sample.answer_prefix.strip() not in context


def test_query_agnostic_with_everything_kept_equals_the_whole_prompt():
    """With a budget over the prompt, asking the question over the compressed context gives the tokens of
    compressing the whole prompt (the byte tokenizer cuts the same tokens either way)."""
    model, tok = load_tiny("tiny-llama")
    texts = ["The grass is green. " * 20 + "Question: what is green? Answer:",
             "The sky is blue, the sun is bright. " * 9 + "Question: what is blue? Answer:"]
    contexts = [t[: t.index("Question:")] for t in texts]
    runs = [CacheSpec.build("full"), CacheSpec.build("oracle_topk", 4096), CacheSpec.build("snapkv", 4096),
            CacheSpec.build("sekv", 4096)]
    aware = generate_methods(model, tok, texts, runs, max_new_tokens=6, chat=False, stop_at_eos=False)
    agnostic = generate_methods(model, tok, texts, runs, max_new_tokens=6, chat=False, stop_at_eos=False,
                                contexts=contexts)
    for a, b in zip(agnostic, aware, strict=True):
        assert a.token_ids == b.token_ids and a.prompt_tokens == b.prompt_tokens
    chunked = generate_methods(model, tok, texts, [dataclasses.replace(r, prefill_chunk=64) for r in runs],
                               max_new_tokens=6, chat=False, stop_at_eos=False, contexts=contexts)
    assert [r.token_ids for r in chunked] == [r.token_ids for r in aware]


def test_a_context_must_start_its_prompt():
    model, tok = load_tiny("tiny-llama")
    with pytest.raises(ZoomKVError, match="start of its prompt"):
        generate_methods(model, tok, ["abc question"], [CacheSpec.build()], contexts=["xyz"], chat=False)


def test_rows_and_summary_record_the_protocol_and_resume_refuses_another(tmp_path):
    out = tmp_path / "run"
    common = dict(model="tiny-llama", out=out, methods=["full", "streamingllm"], budgets=["48"],
                  tasks=["niah_single_1"], lengths=[512], samples=2, batch_size=2, max_new_tokens=3, progress=False,
                  plots=False)
    rows = run_eval(EvalConfig(**common))
    assert rows and all(r["protocol"] == "query-agnostic" for r in rows)
    assert "- protocol: `query-agnostic`" in (out / "summary.md").read_text()
    assert json.loads((out / "run.json").read_text())["protocol"] == "query-agnostic"
    with pytest.raises(ZoomKVError, match="protocol"):
        run_eval(EvalConfig(**common, protocol="query-aware"))
    aware = run_eval(EvalConfig(**{**common, "out": tmp_path / "aware"}, protocol="query-aware"))
    assert all(r["protocol"] == "query-aware" for r in aware)
    with pytest.raises(ZoomKVError, match="--protocol"):
        run_eval(EvalConfig(**{**common, "out": tmp_path / "bad"}, protocol="sideways"))


def test_the_multi_turn_task_is_scored_per_turn_on_one_cache(tmp_path):
    out = tmp_path / "turns"
    rows = run_eval(EvalConfig(model="tiny-llama", out=out, methods=["full", "oracle_topk", "streamingllm"],
                               budgets=["64"], tasks=["niah_multiturn"], lengths=[1024], samples=2, max_new_tokens=3,
                               progress=False, plots=False))
    tasks = sorted({r["task"] for r in rows})
    assert tasks == ["niah_multiturn.1", "niah_multiturn.2", "niah_multiturn.3", "niah_multiturn.4"]
    assert len(rows) == 4 * 2 * 3  # turns × samples × configurations
    by_turn = {r["task"]: r for r in rows if r["method"] == "oracle_topk" and r["sample"] == 0}
    # every turn asks another key, and the cache grows by each question and answer
    assert len({tuple(r["answers"]) for r in by_turn.values()}) == 4
    prompts = [by_turn[f"niah_multiturn.{t}"]["prompt_tokens"] for t in (1, 2, 3, 4)]
    assert prompts == sorted(prompts) and len(set(prompts)) == 4
    assert all(r["device_bytes"] < r["full_kv_bytes"] for r in rows if r["method"] != "full")
    again = run_eval(EvalConfig(model="tiny-llama", out=out, methods=["full", "oracle_topk", "streamingllm"],
                                budgets=["64"], tasks=["niah_multiturn"], lengths=[1024], samples=2, max_new_tokens=3,
                                progress=False, plots=False))
    assert len(again) == len(rows)  # resumed: nothing was run twice
    assert "niah_multiturn.4" in (out / "summary.md").read_text()
