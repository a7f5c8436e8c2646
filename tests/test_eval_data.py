"""User data files: LongBench, plain and GSM8K JSONL formats, their errors, middle truncation, many-shot."""

from __future__ import annotations

import json

import pytest

from zoomkv.data.files import load_data
from zoomkv.data.longbench import Record, middle_truncate
from zoomkv.data.sample import PromptFormat
from zoomkv.errors import ZoomKVError
from zoomkv.models import build_tiny_tokenizer


@pytest.fixture(scope="module")
def fmt():
    return PromptFormat(build_tiny_tokenizer(), chat=False)


def _write(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records), encoding="utf-8")
    return path


def _lb(dataset, **kw):
    return {"input": "Who wrote it?", "context": "Passage 1: Ann wrote it.", "answers": ["Ann"],
            "all_classes": None, "length": 5, "dataset": dataset, "_id": "x", **kw}


def test_longbench_file_groups_datasets_with_their_metrics(tmp_path, fmt):
    path = _write(tmp_path / "mixed.jsonl", [
        _lb("hotpotqa"), _lb("hotpotqa"),
        _lb("trec", input="What city is it?", answers=["LOC"], all_classes=["LOC", "NUM", "HUM"]),
        _lb("passage_retrieval_en_e", answers=["Paragraph 3"]),  # a LongBench-E name
    ])
    tasks = {t.name: t for t in load_data(str(path))}
    assert set(tasks) == {"hotpotqa", "trec", "passage_retrieval_en_e"} and tasks["hotpotqa"].size == 2
    qa = tasks["hotpotqa"].build(fmt, 1000, 0, model_max=4096)
    assert qa.metric == "qa_f1" and qa.max_new_tokens == 32 and qa.chat is None and not qa.first_line
    assert "Ann wrote it." in qa.prompt and "Who wrote it?" in qa.prompt
    trec = tasks["trec"].build(fmt, 1000, 0, model_max=4096)
    assert trec.metric == "classification" and trec.all_classes == ["LOC", "NUM", "HUM"]
    assert trec.chat is False and trec.first_line  # LongBench: no chat template, first line scored
    assert tasks["passage_retrieval_en_e"].build(fmt, 1000, 0, model_max=4096).metric == "retrieval"


def test_plain_format_and_task_naming(tmp_path, fmt):
    path = _write(tmp_path / "mine.jsonl", [
        {"prompt": "What colour is the sky?", "answers": "blue", "metric": "string_match_part"},
        {"prompt": "Name the key.", "context": "The key is 42.", "answers": ["42"], "answer_prefix": " The key is"},
    ])
    [task] = load_data(str(path))
    assert task.name == "mine" and task.size == 2
    first, second = (task.build(fmt, 500, i, model_max=4096) for i in range(2))
    assert first.metric == "string_match_part" and first.answers == ["blue"]
    assert second.prompt == "The key is 42.\n\nName the key." and second.answer_prefix == " The key is"
    [named] = load_data(f"sky={path}")
    assert named.name == "sky"


@pytest.mark.parametrize("lines,line_no,message", [
    ([_lb("hotpotqa"), "{not json", _lb("hotpotqa")], 2, "bad JSON"),
    ([_lb("hotpotqa"), _lb("hotpotqa"), {"input": "q", "context": "c", "dataset": "hotpotqa"}], 3,
     "missing field 'answers'"),
    ([_lb("hotpotqa"), "[1, 2]"], 2, "expected a JSON object"),
    ([_lb("no_such_set")], 1, "unknown LongBench dataset 'no_such_set'; known: narrativeqa"),
    ([_lb("trec", all_classes=None)], 1, "all_classes"),
    ([{"prompt": "p", "answers": []}], 1, "non-empty list"),
    ([{"question": "q", "answer": "no final number"}], 1, "#### <number>"),
    ([{"something": 1}], 1, "cannot tell the format"),
])
def test_bad_files_name_file_and_line(tmp_path, lines, line_no, message):
    path = _write(tmp_path / "bad.jsonl", lines)
    with pytest.raises(ZoomKVError) as err:
        load_data(str(path))
    assert f"{path}:{line_no}:" in str(err.value) and message in str(err.value)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(ZoomKVError, match="file not found"):
        load_data(str(tmp_path / "nope.jsonl"))
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(ZoomKVError, match="empty"):
        load_data(str(tmp_path / "empty.jsonl"))


def test_middle_truncation_keeps_both_ends(fmt):
    context = "START " + "".join(f"{i:04d} " for i in range(600)) + "END"
    rec = Record("Read this:\n", context, "\nQuestion: what?", "\nAnswer:", ["x"], "qa_f1", 32)
    cut, truncated = middle_truncate(fmt, rec, 1000, "t")
    total = fmt.measure(rec.head + cut + rec.tail, rec.answer_prefix)
    assert truncated and 990 <= total <= 1000  # the byte tokenizer: one token per character
    assert cut.startswith("START 0000") and cut.endswith("0599 END") and "0300" not in cut
    same, untouched = middle_truncate(fmt, rec, 10_000, "t")
    assert same == context and not untouched
    with pytest.raises(ZoomKVError, match="instruction and question alone"):
        middle_truncate(fmt, rec, 10, "t")


def test_data_prompt_cut_to_length_and_model_limit(tmp_path, fmt):
    path = _write(tmp_path / "long.jsonl", [_lb("hotpotqa", context="word " * 2000)])
    [task] = load_data(str(path))
    assert fmt.count(fmt.sample_text(task.build(fmt, 1000, 0, model_max=4096))) <= 1000
    # the model's limit wins over a longer --length, leaving room for the answer
    assert fmt.count(fmt.sample_text(task.build(fmt, 9000, 0, model_max=600))) <= 600 - 32


def _gsm(i):
    return {"question": f"Tom has {i} apples and buys 2 more. How many now? (#{i})",
            "answer": f"He has {i} + 2 = <<{i}+2={i + 2}>>{i + 2} apples.\n#### {i + 2:,}"}


def test_many_shot_fills_length_without_the_test_question(tmp_path, fmt):
    path = _write(tmp_path / "gsm.jsonl", [_gsm(i) for i in range(1000, 1040)])
    [task] = load_data(str(path))
    assert task.name == "manyshot_gsm" and task.size == 40
    sample = task.build(fmt, 2000, 0, model_max=4096)
    question = sample.prompt.rsplit("Question: ", 1)[1]
    assert sample.prompt.count(question) == 1  # never among its own shots
    assert 1900 <= fmt.count(fmt.sample_text(sample)) <= 2000 and sample.meta["shots"] > 5
    assert "<<" not in sample.prompt and "The answer is" in sample.prompt
    gold = int(question.split("(#")[1].rstrip(")")) + 2
    assert sample.answers == [str(gold)] and sample.metric == "exact_number"
    # more shots than the file holds: every other problem, once
    small = task.build(fmt, 1_000_000, 1, model_max=2_000_000)
    assert small.meta["shots"] == 39


def test_unknown_format_flag():
    with pytest.raises(ZoomKVError, match="valid: auto"):
        load_data("x.jsonl", fmt="csv")


def test_a_hub_id_may_name_its_configuration(monkeypatch):
    """``owner/name:config`` reaches ``datasets.load_dataset`` as the dataset and its configuration (LongBench
    has one per task); nothing is downloaded here."""
    import datasets

    from zoomkv.data import sources

    seen = {}

    def fake_load(name, config=None, split=None, streaming=False):
        seen.update(name=name, config=config, split=split)
        return datasets.Dataset.from_dict({"input": ["q"], "context": ["c"], "answers": [["a"]]})

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    sources.load_source("THUDM/LongBench:narrativeqa", split="test")
    assert seen == {"name": "THUDM/LongBench", "config": "narrativeqa", "split": "test"}
    sources.load_source("owner/plain")
    assert seen["name"] == "owner/plain" and seen["config"] is None
    with pytest.raises(ZoomKVError, match="nothing after ':'"):
        sources.load_source("owner/name:")
