"""`zoomkv eval --data` through Hugging Face datasets (JSONL, Parquet, CSV, saved datasets; LongBench,
LongBench-v2, InfiniteBench and RULER records) and LongBench's published metrics (rouge-score, jieba).

Every dataset is built here in tmp_path: nothing is downloaded. Metric values are worked out by hand from
LongBench's definitions (THUDM/LongBench metrics.py and eval.py); the comments show how.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from zoomkv.data.files import load_data
from zoomkv.data.sample import PromptFormat
from zoomkv.errors import ZoomKVError
from zoomkv.eval import harness
from zoomkv.eval.metrics import (
    choice,
    classification,
    code_sim,
    count,
    extract_choice,
    infbench_choice,
    qa_f1,
    qa_f1_zh,
    retrieval,
    rouge_l,
    rouge_l_zh,
    score,
)
from zoomkv.generation import GenerationResult
from zoomkv.memory import CacheSpec
from zoomkv.models import build_tiny_tokenizer
from zoomkv.runspec import RunSpec


@pytest.fixture(scope="module")
def fmt():
    return PromptFormat(build_tiny_tokenizer(), chat=False)


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return str(path)


def _write(kind, folder, stem, records):
    """The same records as a JSONL file, a Parquet file, a CSV file or a saved-dataset folder."""
    import datasets

    if kind == "jsonl":
        return _jsonl(folder / f"{stem}.jsonl", records)
    ds = datasets.Dataset.from_list(records)
    if kind == "parquet":
        ds.to_parquet(str(folder / f"{stem}.parquet"))
        return str(folder / f"{stem}.parquet")
    if kind == "csv":  # list fields as JSON text (what a CSV cell can hold), nulls as empty cells
        path = folder / f"{stem}.csv"
        with path.open("w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=list(ds.column_names))
            writer.writeheader()
            writer.writerows({k: json.dumps(v) if isinstance(v, list) else v for k, v in r.items()} for r in records)
        return str(path)
    ds.save_to_disk(str(folder / stem))
    return str(folder / stem)


# ------------------------------------------------------------------------------------ LongBench metrics


def test_rouge_l_is_summary_level_over_sentences():
    # LongBench feeds its rouge package sentences split at "." and whitespace words, case kept.
    # prediction: [The report says costs rose] [Revenue fell sharply] [Staff were cut]   → 11 words
    # reference:  [Costs rose and revenue fell] [The company cut staff]                   →  9 words
    # union LCS per reference sentence: 1st → {rose} from the 1st, {fell} from the 2nd ("Revenue" ≠ "revenue",
    # "costs" ≠ "Costs") = 2; 2nd → {The} from the 1st, {cut} from the 3rd = 2. LCS_u = 4:
    # R = 4/9, P = 4/11, F = 2·(4/9)(4/11) / (4/9 + 4/11) = 32/80 = 0.4 (the rouge package LongBench calls gives 0.4)
    pred = "The report says costs rose. Revenue fell sharply. Staff were cut."
    assert rouge_l(pred, ["Costs rose and revenue fell. The company cut staff."]) == pytest.approx(40.0)
    # one sentence, no repeated word: LCS [Ann and Bob meet at noon] = 6, P = 6/6, R = 6/7, F = 12/13
    assert rouge_l("Ann and Bob meet at noon.", ["Ann and Bob will meet at noon."]) == pytest.approx(100 * 12 / 13)
    # the best of several references; an empty prediction scores 0 (LongBench catches the rouge error)
    assert rouge_l("a b", ["x y", "a b"]) == pytest.approx(100.0, abs=1e-5)  # the package's F has a 1e-8 term
    assert rouge_l("", ["a b"]) == 0.0 and rouge_l("...", ["a b"]) == 0.0


def test_rouge_l_zh_segments_with_jieba():
    # jieba: 我爱北京天安门。 → 我 / 爱 / 北京 / 天安门 / 。 (5 words); 我爱北京 → 我 / 爱 / 北京 (3)
    # LCS 3: P = 3/5, R = 3/3, F = 2·(3/5)·1 / (3/5 + 1) = 0.75
    assert rouge_l_zh("我爱北京天安门。", ["我爱北京"]) == pytest.approx(75.0)
    # 会议 / 讨论 / 了 / 明年 / 的 / 预算 / 和 / 人员 / 安排 / 。 (10) against 会议 / 讨论 / 了 / 预算 / 。 (5):
    # LCS 5, P = 1/2, R = 1, F = 2/3
    assert rouge_l_zh("会议讨论了明年的预算和人员安排。", ["会议讨论了预算。"]) == pytest.approx(100 * 2 / 3)
    # the words are jieba's: the whole of 北京 matches
    assert rouge_l_zh("北京", ["北京"]) == pytest.approx(100.0, abs=1e-5)


def test_qa_f1_and_qa_f1_zh():
    # SQuAD normalisation: [cat sat on mat] vs [cat on mat]: P = 3/4, R = 1, F1 = 6/7
    assert qa_f1("The cat sat on the mat!", ["a cat on a mat"]) == pytest.approx(100 * 6 / 7)
    # jieba words, each without punctuation, empty ones dropped: [我 爱 北京 天安门] vs [我 爱 北京]: F1 = 6/7
    assert qa_f1_zh("我爱北京天安门。", ["我爱北京"]) == pytest.approx(100 * 6 / 7)
    # whole words: 北京大学 is one word, so it shares nothing with 北京
    assert qa_f1_zh("北京大学", ["北京"]) == 0.0


def test_classification_keeps_longbench_walk():
    # LongBench removes a class that is part of the answer from the list it is iterating, which skips the
    # next one: classes found in "ABC" are [A, AB, ABC]; A is removed, AB is skipped (kept), ABC kept →
    # credit 1/2 (a clean filter would give 1)
    assert classification("ABC", ["ABC"], all_classes=["A", "AB", "ABC"]) == 50.0
    assert classification("Location", ["Location"], all_classes=["Location", "Number", "Human"]) == 100.0
    assert classification("Location or Number", ["Location"], all_classes=["Location", "Number"]) == 50.0
    assert classification("nothing", ["Location"], all_classes=["Location", "Number"]) == 0.0


def test_retrieval_count_and_code_sim():
    # the right number's share of all numbers in the reply
    assert retrieval("Paragraph 3, or maybe Paragraph 5", ["Paragraph 3"]) == 50.0
    assert count("I count 7 paragraphs", ["7"]) == 100.0
    # fuzz.ratio of the first code line: "x = y + 1" vs "x = y+1": 2·7/(9 + 7) = 87.5% → Python's round → 88
    assert code_sim("```\n# set x\nx = y + 1\n", ["x = y+1"]) == 88.0


def test_longbench_v2_choice():
    # LongBench-v2 reads "The correct answer is (X)", then "The correct answer is X", after dropping "*"
    assert extract_choice("Reasoning...\nThe correct answer is (B)") == "B"
    assert extract_choice("**The correct answer is C**") == "C"
    assert extract_choice("B") is None  # no stated answer: wrong, as in LongBench-v2
    assert choice("The correct answer is (B).", ["B"]) == 100.0
    assert choice("The correct answer is (A).", ["B"]) == 0.0
    assert choice("B", ["B"]) == 0.0


def test_infinitebench_choice():
    label = ["Paris", "B"]  # the right option's text and its letter, as InfiniteBench labels it
    assert infbench_choice(" B. Paris", label) == 100.0  # a reply that starts with a letter is that letter
    assert infbench_choice("C", label) == 0.0
    assert infbench_choice("I think the answer is: Paris, clearly", label) == 100.0
    assert infbench_choice("Hmm, the option is C", label) == 0.0
    assert infbench_choice("It must be B", label) == 100.0  # the first word that is a letter
    assert infbench_choice("", label) == 0.0


@pytest.mark.heavy
def test_jieba_prints_nothing():
    code = "from zoomkv.eval.metrics import rouge_l_zh; print(rouge_l_zh('我爱北京天安门', ['北京']))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr


# ---------------------------------------------------------------------- sources and formats of --data


def _lb(dataset, **kw):
    return {"input": "Who wrote it?", "context": "Passage 1: Ann wrote it.", "answers": ["Ann"],
            "all_classes": None, "length": 5, "dataset": dataset, "_id": "x", **kw}


LB_RECORDS = [
    _lb("hotpotqa"), _lb("hotpotqa", answers=["Ann", "Anne"]),
    _lb("trec", input="What city is it?", answers=["LOC"], all_classes=["LOC", "NUM", "HUM"]),
]


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "csv", "saved"])
def test_longbench_records_from_every_source(tmp_path, fmt, kind):
    source = _write(kind, tmp_path, "lb", LB_RECORDS)
    tasks = {t.name: t for t in load_data(source)}
    assert set(tasks) == {"hotpotqa", "trec"} and tasks["hotpotqa"].size == 2
    qa = tasks["hotpotqa"].build(fmt, 1000, 1, model_max=4096)
    assert qa.metric == "qa_f1" and qa.answers == ["Ann", "Anne"] and qa.max_new_tokens == 32
    trec = tasks["trec"].build(fmt, 1000, 0, model_max=4096)
    assert trec.metric == "classification" and trec.all_classes == ["LOC", "NUM", "HUM"] and trec.first_line
    # the context is compressed, the question comes after it
    assert fmt.context_text(qa).endswith("Passage 1: Ann wrote it.")
    assert "Who wrote it?" in qa.prompt[qa.question_at:] and "Who wrote it?" not in fmt.context_text(qa)
    [named] = load_data(f"mine={source}")[:1]
    assert named.name == "mine"


def test_plain_and_gsm8k_from_parquet(tmp_path, fmt):
    plain = _write("parquet", tmp_path, "mine", [
        {"prompt": "Name the key.", "context": "The key is 42.", "answers": ["42"], "metric": "string_match_part"},
        {"prompt": "Colour?", "context": None, "answers": ["blue"], "metric": None},  # nulls: fields left out
    ])
    [task] = load_data(plain)
    first, second = task.build(fmt, 500, 0, model_max=4096), task.build(fmt, 500, 1, model_max=4096)
    assert first.prompt == "The key is 42.\n\nName the key." and first.metric == "string_match_part"
    assert second.prompt == "Colour?" and second.metric == "qa_f1"
    gsm = _write("parquet", tmp_path, "gsm", [{"question": f"What is {i} + 2?", "answer": f"{i} + 2\n#### {i + 2}"}
                                              for i in range(6)])
    [many] = load_data(gsm)
    assert many.name == "manyshot_gsm" and many.build(fmt, 400, 0, model_max=4096).metric == "exact_number"


V2 = {"_id": "66f", "domain": "Single-Document QA", "sub_domain": "Legal", "difficulty": "easy", "length": "short",
      "question": "Who signed the lease?", "choice_A": "Ann", "choice_B": "Bob", "choice_C": "Cy", "choice_D": "Di",
      "answer": "B", "context": "  The lease was signed by Bob in May.  "}


def test_longbench_v2_records(tmp_path, fmt):
    source = _write("jsonl", tmp_path, "LongBench-v2", [V2, {**V2, "answer": "D"}])
    [task] = load_data(source)
    sample = task.build(fmt, 2000, 0, model_max=4096)
    assert task.name == "LongBench-v2" and sample.metric == "choice" and sample.answers == ["B"]
    assert sample.max_new_tokens == 128 and sample.answer_prefix == ""
    context, question = fmt.context_text(sample), sample.prompt[sample.question_at:]
    assert context.endswith("<text>\nThe lease was signed by Bob in May.")
    assert question.startswith("\n</text>") and "Who signed the lease?" in question
    assert "(B) Bob" in question and '"The correct answer is (insert answer here)"' in question
    assert score(sample.metric, "The correct answer is (B)", sample.answers) == 100.0
    for bad, message in [({"choice_C": None}, "missing field 'choice_C'"),
                         ({"answer": "E"}, "field 'answer' should be one of A, B, C, D")]:
        broken = _write("parquet", tmp_path, "v2bad", [V2, {**V2, **bad}])
        with pytest.raises(ZoomKVError) as err:
            load_data(broken, fmt="longbench_v2")
        assert f"{broken}: record 2: {message}" in str(err.value)


IB_CHOICE = {"id": 0, "context": "Chapter 1. Mary moved to Paris.", "input": "Where did Mary move?",
             "answer": ["Paris"], "options": ["Rome", "Paris", "Oslo", "Lima"]}
IB_QA = {"id": 1, "context": "Chapter 1. Mary moved to Paris.", "input": "Where did Mary move?",
         "answer": ["Paris"], "options": []}


def test_infinitebench_records(tmp_path, fmt):
    source = _write("saved", tmp_path, "longbook_choice_eng", [IB_CHOICE])
    [task] = load_data(source)
    sample = task.build(fmt, 2000, 0, model_max=4096)
    assert task.name == "longbook_choice_eng" and sample.metric == "infbench_choice"
    assert sample.answers == ["Paris", "B"] and sample.max_new_tokens == 40
    assert fmt.context_text(sample).endswith("Mary moved to Paris.")
    question = sample.prompt[sample.question_at:]
    assert "Where did Mary move?" in question and "B. Paris" in question and "D. Lima" in question
    assert score(sample.metric, " B", sample.answers) == 100.0
    [qa] = load_data(f"longbook_qa_eng={_write('jsonl', tmp_path, 'ib', [IB_QA])}")
    plain = qa.build(fmt, 2000, 0, model_max=4096)
    assert plain.metric == "qa_f1" and plain.answers == ["Paris"] and plain.max_new_tokens == 40
    assert "Where did Mary move?" in plain.prompt[plain.question_at:]
    wrong = _write("jsonl", tmp_path, "ibbad", [{**IB_CHOICE, "answer": ["Berlin"]}])
    with pytest.raises(ZoomKVError, match=r"ibbad.jsonl:1: field 'answer' \('Berlin'\) is none of the 'options'"):
        load_data(wrong)


def _ruler(query, context, template):
    return {"index": 0, "input": template.format(context=context, query=query), "outputs": ["1234567"],
            "length": 100, "length_w_model_temp": 110,
            "answer_prefix": f" The special magic number for {query} mentioned in the provided text is"}


NIAH = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. I will quiz "
        "you about the numbers afterwards.\n{context}\nWhat is the special magic number for {query} mentioned in "
        "the provided text?")
QA = ("Answer the question based on the given documents. Only give me the answer and do not output any other "
      "words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the given "
      "documents. Only give me the answer and do not output any other words.\n\nQuestion: {query}")


def test_ruler_exports(tmp_path, fmt):
    folder = tmp_path / "niah_single_1"
    folder.mkdir()
    context = "The grass is green. One of the special magic numbers for tall-door is: 1234567. The sky is blue."
    source = _write("jsonl", folder, "validation", [_ruler("tall-door", context, NIAH)])
    [task] = load_data(source)  # RULER writes TASK/validation.jsonl: the folder names the task
    sample = task.build(fmt, 4000, 0, model_max=8192)
    assert task.name == "ruler_niah_single_1" and sample.metric == "string_match_all" and sample.max_new_tokens == 128
    assert sample.prompt == _ruler("tall-door", context, NIAH)["input"]
    assert fmt.context_text(sample).endswith("The sky is blue.\n")
    assert sample.prompt[sample.question_at:].startswith("What is the special magic number for tall-door")
    assert sample.answer_prefix.startswith(" The special magic number")
    qa_folder = tmp_path / "qa_1"
    qa_folder.mkdir()
    qa_source = _write("csv", qa_folder, "validation", [_ruler("Who won?", "Document 1: Ann won.", QA)])
    qa = load_data(qa_source)[0].build(fmt, 4000, 0, model_max=8192)
    assert qa.metric == "string_match_part" and qa.max_new_tokens == 32 and qa.answers == ["1234567"]
    assert qa.prompt[qa.question_at:] == "Question: Who won?"


def test_unknown_format_and_missing_fields(tmp_path):
    source = _write("parquet", tmp_path, "odd", [{"text": "a", "label": 1}])
    with pytest.raises(ZoomKVError, match=r"odd.parquet: record 1: cannot tell the format from the fields"):
        load_data(source)
    missing = _write("parquet", tmp_path, "lb", [_lb("hotpotqa"), {**_lb("hotpotqa"), "answers": None}])
    with pytest.raises(ZoomKVError, match=r"lb.parquet: record 2: missing field 'answers'"):
        load_data(missing)
    with pytest.raises(ZoomKVError, match="file not found"):
        load_data(str(tmp_path / "nope.parquet"))
    with pytest.raises(ZoomKVError, match=r"valid: auto, longbench, longbench_v2, infinitebench, ruler"):
        load_data(source, fmt="csv")


# -------------------------------------------------------------- scored end to end through the eval path


# one record per LongBench dataset, with a fixed reply; the expected score of each is derived in the metric
# tests above (samsum's second line is dropped: LongBench scores the first line of its few-shot replies)
END_TO_END = [
    (_lb("samsum", context="Ann: noon? Bob: ok", input="Dialogue: Ann: noon? Bob: ok\nSummary:",
         answers=["Ann and Bob will meet at noon."]), "Ann and Bob meet at noon.\nDialogue: more", 100 * 12 / 13),
    (_lb("gov_report", answers=["Costs rose and revenue fell. The company cut staff."]),
     "The report says costs rose. Revenue fell sharply. Staff were cut.", 40.0),
    (_lb("multifieldqa_zh", answers=["我爱北京"]), "我爱北京天安门。", 100 * 6 / 7),
    (_lb("dureader", answers=["我爱北京"]), "我爱北京天安门。", 75.0),
    (_lb("trec", answers=["ABC"], all_classes=["A", "AB", "ABC"]), "ABC\nA", 50.0),
    (_lb("lcc", answers=["x = y+1"]), "# set x\nx = y + 1", 88.0),
    (_lb("hotpotqa", answers=["a cat on a mat"]), "The cat sat on the mat!", 100 * 6 / 7),
]


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_longbench_file_scored_through_the_harness(tmp_path, fmt, kind):
    source = _write(kind, tmp_path, "longbench", [record for record, _, _ in END_TO_END])
    tasks = {t.name: t for t in load_data(source)}
    cfg = harness.EvalConfig(model="tiny", out=tmp_path / "out")
    run = RunSpec("full", CacheSpec.build("full"))
    memory = SimpleNamespace(budget=None, device_bytes=1, host_bytes=0, full_kv_bytes=1)
    for record, reply, expected in END_TO_END:
        sample = tasks[record["dataset"]].build(fmt, 2000, 0, model_max=4096)
        result = GenerationResult(texts=[reply], prompt_tokens=10, new_tokens=2, prefill_s=0.0,
                                  decode_ms_per_token=1.0, memory=memory, token_ids=[[1, 2]])
        row = harness._row(sample, 10, 0, run, result, 1, cfg, fmt)  # the function that scores every eval row
        assert row["task"] == record["dataset"] and row["score"] == pytest.approx(expected, abs=1e-4)


def test_eval_command_runs_every_format(tmp_path, capsys):
    from zoomkv.cli import main

    lb = _write("parquet", tmp_path, "lb", [_lb("hotpotqa")])
    v2 = _write("jsonl", tmp_path, "v2", [V2])
    ib = _write("saved", tmp_path, "ib", [IB_CHOICE])
    (tmp_path / "vt").mkdir()
    ruler = _write("csv", tmp_path / "vt", "validation", [_ruler("q", "VAR X = 1.", QA)])
    out = tmp_path / "run"
    code = main(["eval", "--model", "tiny-llama", "--data", lb, "--data", v2, "--data", f"infbench={ib}",
                 "--data", ruler, "--length", "400", "--samples", "1", "--max-new-tokens", "3",
                 "--out", str(out), "--quiet", "--no-plots"])
    assert code == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    metrics = {r["task"]: r["metric"] for r in rows}
    assert metrics == {"hotpotqa": "qa_f1", "v2": "choice", "infbench": "infbench_choice",
                       "ruler_vt": "string_match_all"}
    for r in rows:  # every row's score is its metric of its reply
        assert r["score"] == pytest.approx(score(r["metric"], r["prediction"], r["answers"]), abs=1e-4)
