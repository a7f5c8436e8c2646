"""The record formats of the long-context benchmarks, each read into ``Record``s of one ``LongBenchTask``:

- LongBench (``input, context, answers, all_classes, length, dataset``), scored with LongBench's metric
  for each dataset;
- LongBench-v2 (``_id, domain, question, choice_A..choice_D, answer, context``): multiple choice, the
  reply's stated letter scored (``choice``);
- InfiniteBench (``id, context, input, answer, options``): multiple choice when there are options
  (InfiniteBench's own rule, ``infbench_choice``), else the metric of the task named;
- RULER's exported ``input, outputs[, answer_prefix]``: the prompt as RULER wrote it, scored with
  ``string_match_all`` (``string_match_part`` for its QA tasks) as RULER does;
- the plain format for the user's own tasks.

The context is what the query-agnostic protocol compresses; the question or instruction after it is the
record's ``tail``. The instructions around each dataset's context are zoomkv's own wording of what each
task asks (LongBench-v2 keeps its answer-format sentence, which its metric reads); the metric, the
generation length, the first-line rule of the few-shot tasks and the choice to skip the chat template for
few-shot and code tasks follow LongBench. A context longer than the limit is cut in its middle, keeping
both ends, as LongBench does (LongBench cuts the whole prompt; cutting the context keeps the instruction
and question whole, which is the same whenever they are short).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zoomkv.data.jsonl import DataFileError, require, string_list
from zoomkv.data.sample import METRIC_NAMES, PromptFormat, Sample
from zoomkv.errors import ZoomKVError

_QA = ("Read the text below and answer the question after it as briefly as you can.\n\nText:\n",
       "\n\nQuestion: {input}\nGive only the answer, no other words.", "\nAnswer:")
_QA_MULTI = ("Answer the question after the passages below. Give only the answer, no other words.\n\n",
             "\n\nQuestion: {input}\nGive only the answer, no other words.", "\nAnswer:")
_QA_ZH = ("阅读下面的文字，然后简短地回答后面的问题，只给出答案。\n\n", "\n\n问题：{input}", "\n回答：")
_CODE = ("Complete the code below.\n", "{input}", "Next line of code:\n")

# template (head, tail, answer prefix) per kind; "{input}" is the record's input field
TEMPLATES: dict[str, tuple[str, str, str]] = {
    "qa": _QA,
    "qa_multi": _QA_MULTI,
    "qa_zh": _QA_ZH,
    "report": ("Below is a report.\n\n", "\n\nWrite a one-page summary of the report above.", "\nSummary:"),
    "news": ("Below are several news articles.\n\n", "\n\nWrite a one-page summary of all the news above.",
             "\nSummary:"),
    "meeting": ("Below is a meeting transcript.\n\n", "\n\nQuery: {input}\nAnswer the query in a few sentences.",
                "\nAnswer:"),
    "meeting_zh": ("下面是一段会议记录。\n\n", "\n\n请用一段话总结上面的会议。", "\n总结："),
    "trec": ("Decide the type of the last question; the examples below show the types.\n\n", "\n{input}", ""),
    "triviaqa": ("Answer the last question the way the examples below are answered.\n\n", "\n\n{input}", ""),
    "samsum": ("Summarise the last dialogue the way the examples below are summarised.\n\n", "\n\n{input}", ""),
    "lsht": ("判断最后一则新闻的类别，下面是一些例子。\n\n", "\n{input}", ""),
    "count": ("Below are paragraphs, some of them repeated. Count how many distinct paragraphs there are.\n\n",
              "\n\nHow many distinct paragraphs are there above? Reply with the number only.",
              "\nThe number of distinct paragraphs is:"),
    "retrieval": ("Below are paragraphs, then a summary of one of them.\n\n",
                  "\n\nSummary: {input}\n\nWhich paragraph is the summary taken from? Reply like \"Paragraph 1\".",
                  "\nThe answer is: "),
    "retrieval_zh": ("下面是一些段落，以及其中一段的摘要。\n\n", "\n\n摘要：{input}\n\n这段摘要出自哪一段？请按\"段落1\"的格式回答。",
                     "\n答案是："),
    "code": _CODE,
}


@dataclass(frozen=True)
class DatasetInfo:
    metric: str
    max_new_tokens: int
    template: str
    chat: bool = True  # LongBench prompts its few-shot and code tasks without the chat template
    first_line: bool = False  # and scores only the first line of a few-shot reply


DATASETS: dict[str, DatasetInfo] = {
    **{name: DatasetInfo("qa_f1", n, "qa") for name, n in
       (("narrativeqa", 128), ("qasper", 128), ("multifieldqa_en", 64))},
    **{name: DatasetInfo("qa_f1", 32, "qa_multi") for name in ("hotpotqa", "2wikimqa", "musique")},
    "multifieldqa_zh": DatasetInfo("qa_f1_zh", 64, "qa_zh"),
    "dureader": DatasetInfo("rouge_l_zh", 128, "qa_zh"),
    "gov_report": DatasetInfo("rouge_l", 512, "report"),
    "qmsum": DatasetInfo("rouge_l", 512, "meeting"),
    "multi_news": DatasetInfo("rouge_l", 512, "news"),
    "vcsum": DatasetInfo("rouge_l_zh", 512, "meeting_zh"),
    "trec": DatasetInfo("classification", 64, "trec", chat=False, first_line=True),
    "triviaqa": DatasetInfo("qa_f1", 32, "triviaqa", chat=False, first_line=True),
    "samsum": DatasetInfo("rouge_l", 128, "samsum", chat=False, first_line=True),
    "lsht": DatasetInfo("classification", 64, "lsht", chat=False, first_line=True),
    "passage_count": DatasetInfo("count", 32, "count"),
    "passage_retrieval_en": DatasetInfo("retrieval", 32, "retrieval"),
    "passage_retrieval_zh": DatasetInfo("retrieval_zh", 32, "retrieval_zh"),
    "lcc": DatasetInfo("code_sim", 64, "code", chat=False),
    "repobench-p": DatasetInfo("code_sim", 64, "code", chat=False),
}


@dataclass
class Record:
    head: str
    context: str  # the part cut in the middle when the prompt is too long
    tail: str
    answer_prefix: str
    answers: list[str]
    metric: str
    max_new_tokens: int
    all_classes: list[str] | None = None
    chat: bool | None = None
    first_line: bool = False
    line: int = 0


def cut_characters(text: str, most: int) -> str:
    """``text`` with its middle cut so at most ``most`` characters are left (its start and its end kept)."""
    if len(text) <= most:
        return text
    half = most // 2
    return text[:half] + text[len(text) - (most - half):]


def character_bound(fmt: PromptFormat, limit: int) -> int:
    """The most characters ``limit`` tokens can hold (a few tokens over, for the seam of a cut)."""
    return (limit + 16) * fmt.chars_per_token


def middle_truncate(fmt: PromptFormat, rec: Record, limit: int, what: str) -> tuple[str, bool]:
    """``rec.context`` cut in the middle so the whole rendered prompt fits in ``limit`` tokens. Cut by characters
    first, to what ``limit`` tokens can hold at most: the tokenizer never sees more than that (a 100 MB record
    made it allocate gigabytes and abort), and the halves it keeps are the ones the token cut keeps."""
    def size(context: str) -> int:
        return fmt.measure(rec.head + context + rec.tail, rec.answer_prefix, rec.chat)

    bound = character_bound(fmt, limit)
    framing = len(rec.head) + len(rec.tail) + len(rec.answer_prefix)
    if framing > bound:  # more characters than limit tokens can hold: over the limit, untokenized
        raise ZoomKVError(f"{what}: its instruction and question alone ({framing:,} characters) are over the "
                          f"limit of {limit} tokens")
    context = cut_characters(rec.context, bound)
    total = size(context)
    if total <= limit:
        return context, context != rec.context
    overhead = size("")
    if overhead >= limit:
        raise ZoomKVError(f"{what}: its instruction and question alone take {overhead} tokens, over the "
                          f"limit of {limit}")
    ids = fmt.tokenizer(context, add_special_tokens=False)["input_ids"]
    keep = max(0, len(ids) - (total - limit))
    for _ in range(8):  # re-tokenising at the cut can merge differently; shrink until it fits
        half = keep // 2
        context = fmt.tokenizer.decode(ids[:half]) + fmt.tokenizer.decode(ids[len(ids) - (keep - half):])
        over = size(context) - limit
        if over <= 0:
            return context, True
        keep = max(0, keep - over)
    return "", True


class LongBenchTask:
    """One dataset's records from a LongBench-format or plain JSONL file."""

    def __init__(self, name: str, source: str, records: list[Record]):
        self.name, self.source, self.records = name, source, records

    @property
    def size(self) -> int:
        return len(self.records)

    def records_cut(self, fmt: PromptFormat, length: int, count: int, *, model_max: int) -> int:
        """How many of the first ``count`` records ``build`` cuts at ``length`` (each measured once; a record
        longer than the tokens could hold is counted without being tokenized)."""
        cut = 0
        for rec in self.records[:count]:
            limit = min(length, model_max - rec.max_new_tokens)
            whole = rec.head + rec.context + rec.tail
            if len(whole) + len(rec.answer_prefix) > character_bound(fmt, limit) or \
                    fmt.measure(whole, rec.answer_prefix, rec.chat) > limit:
                cut += 1
        return cut

    def build(self, fmt: PromptFormat, length: int, index: int, *, model_max: int, seed: int = 0) -> Sample:
        rec = self.records[index]
        limit = min(length, model_max - rec.max_new_tokens)
        context, cut = middle_truncate(fmt, rec, limit, f"{self.source}:{rec.line}")
        return Sample(
            task=self.name, length=length, index=index, prompt=rec.head + context + rec.tail,
            answer_prefix=rec.answer_prefix, answers=rec.answers, metric=rec.metric,
            max_new_tokens=rec.max_new_tokens, all_classes=rec.all_classes, chat=rec.chat,
            first_line=rec.first_line, haystack="data", meta={"truncated": cut, "line": rec.line},
            question_at=len(rec.head + context),  # the tail holds the question or the instruction
        )


def dataset_info(path: Path, line: int, name: str) -> DatasetInfo:
    info = DATASETS.get(name) or DATASETS.get(name.removesuffix("_e"))  # LongBench-E names end in _e
    if info is None:
        raise DataFileError(path, line, f"unknown LongBench dataset {name!r}; known: {', '.join(DATASETS)} "
                            "(give a 'metric' field, or use the plain format, for other tasks)")
    return info


def _count_field(path: Path, line: int, obj: dict[str, Any], name: str, default: int) -> int:
    value = obj.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise DataFileError(path, line, f"field {name!r} should be a positive whole number, got {value!r}")
    return value


def longbench_record(path: Path, line: int, obj: dict[str, Any], default_name: str) -> tuple[str, Record]:
    require(path, line, obj, {"input": (str,), "context": (str,), "answers": (list, str)}, "LongBench")
    name = str(obj.get("dataset") or default_name)
    answers = string_list(path, line, obj["answers"], "answers")
    classes = _classes(path, line, obj)
    if "metric" in obj:
        info = DatasetInfo(str(obj["metric"]), _count_field(path, line, obj, "max_new_tokens", 64), "qa")
    else:
        info = dataset_info(path, line, name)
    if info.metric not in METRIC_NAMES:
        raise DataFileError(path, line, f"unknown metric {info.metric!r}; valid: {', '.join(METRIC_NAMES)}")
    if info.metric == "classification" and not classes:
        raise DataFileError(path, line, "missing field 'all_classes' (the classification metric needs it)")
    head, tail, prefix = TEMPLATES[info.template]
    return name, Record(head, obj["context"], tail.replace("{input}", obj["input"]), prefix, answers,
                        info.metric, info.max_new_tokens, classes, None if info.chat else False,
                        info.first_line, line)


def _classes(path: Path, line: int, obj: dict[str, Any]) -> list[str] | None:
    """``all_classes``: absent, or the class names as a list of strings."""
    classes = obj.get("all_classes")
    if classes is None:
        return None
    if not isinstance(classes, list):
        raise DataFileError(path, line, "field 'all_classes' should be a list of strings")
    return string_list(path, line, classes, "all_classes")


def plain_record(path: Path, line: int, obj: dict[str, Any], default_name: str) -> tuple[str, Record]:
    """``{"prompt", "answers", [context, answer_prefix, metric, task, max_new_tokens, all_classes, chat]}``:
    the context (cut in its middle when too long) comes first, then the prompt."""
    require(path, line, obj, {"prompt": (str,), "answers": (list, str)}, "plain")
    metric = str(obj.get("metric", "qa_f1"))
    if metric not in METRIC_NAMES:
        raise DataFileError(path, line, f"unknown metric {metric!r}; valid: {', '.join(METRIC_NAMES)}")
    context = obj.get("context", "")
    if not isinstance(context, str):
        raise DataFileError(path, line, "field 'context' should be a string")
    chat = obj.get("chat")
    prefix = obj.get("answer_prefix", "")
    if not isinstance(prefix, str):
        raise DataFileError(path, line, "field 'answer_prefix' should be a string")
    record = Record(
        "", context, ("\n\n" if context else "") + obj["prompt"], prefix,
        string_list(path, line, obj["answers"], "answers"), metric, _count_field(path, line, obj, "max_new_tokens", 64),
        _classes(path, line, obj), chat if isinstance(chat, bool) else None, bool(obj.get("first_line", False)), line,
    )
    if metric == "classification" and not record.all_classes:
        raise DataFileError(path, line, "missing field 'all_classes' (the classification metric needs it)")
    return str(obj.get("task") or default_name), record


# ------------------------------------------------------------------------------------------ LongBench-v2

CHOICE_LETTERS = "ABCD"
V2_MAX_NEW_TOKENS = 128  # LongBench-v2's generation length without chain of thought
_V2_HEAD = "Please read the following text and answer the question below.\n\n<text>\n"
_V2_TAIL = ("\n</text>\n\nWhat is the correct answer to this question: {question}\nChoices:\n{choices}\n\n"
            'Format your response as follows: "The correct answer is (insert answer here)".')


def longbench_v2_record(path: Path, line: int, obj: dict[str, Any], default_name: str) -> tuple[str, Record]:
    """A LongBench-v2 question: the document, then the question and its four choices; the answer is a letter."""
    fields = {"question": (str,), "context": (str,), "answer": (str,),
              **{f"choice_{c}": (str,) for c in CHOICE_LETTERS}}
    require(path, line, obj, fields, "LongBench-v2")
    answer = obj["answer"].strip()
    if len(answer) != 1 or answer not in CHOICE_LETTERS:
        raise DataFileError(path, line, f"field 'answer' should be one of A, B, C, D, got {obj['answer']!r}")
    choices = "\n".join(f"({c}) {obj[f'choice_{c}'].strip()}" for c in CHOICE_LETTERS)
    tail = _V2_TAIL.replace("{question}", obj["question"].strip()).replace("{choices}", choices)
    return default_name, Record(_V2_HEAD, obj["context"].strip(), tail, "", [answer], "choice",
                                _count_field(path, line, obj, "max_new_tokens", V2_MAX_NEW_TOKENS), line=line)


# ----------------------------------------------------------------------------------------- InfiniteBench

# InfiniteBench's tasks: (metric, generation length as InfiniteBench sets it). Its multiple-choice tasks are
# scored with its own rule; its QA tasks with the token F1 it shares with LongBench (longbook_qa_chn with
# LongBench's jieba words, where InfiniteBench splits characters); the retrieval-style tasks, whose
# InfiniteBench rules read the first number or a whole word, with the looser string_match_part.
INFINITEBENCH: dict[str, tuple[str, int]] = {
    "passkey": ("string_match_part", 6), "number_string": ("string_match_part", 12),
    "kv_retrieval": ("string_match_part", 50), "longbook_sum_eng": ("rouge_l", 1200),
    "longbook_choice_eng": ("infbench_choice", 40), "longbook_qa_eng": ("qa_f1", 40),
    "longbook_qa_chn": ("qa_f1_zh", 40), "longdialogue_qa_eng": ("string_match_part", 40),
    "math_find": ("string_match_part", 3), "code_run": ("string_match_part", 5),
    "code_debug": ("infbench_choice", 5),
}
_IB_CHOICE = ("Read the text below and answer the question after it.\n\n",
              "\n\nQuestion: {input}\n\nOnly one of the following options is correct. Answer with its letter "
              "alone (A, B, C or D).\n{options}", "\nAnswer:")
_IB_ASK = ("Below is a long text, then a question about it. Answer as briefly as you can.\n\n", "\n\n{input}",
           "\nAnswer:")
_IB_SUM = ("Below is a book.\n\n", "\n\nSummarise the book above.", "\nSummary:")


def _choice_label(path: Path, line: int, answers: list[str], options: list[str]) -> list[str]:
    """InfiniteBench's label of a multiple-choice record: the right option's text and its letter."""
    first = answers[0].strip()
    if first in options:
        return [first, CHOICE_LETTERS[options.index(first)]]
    if len(first) == 1 and first in CHOICE_LETTERS[: len(options)]:
        return [options[CHOICE_LETTERS.index(first)], first]
    raise DataFileError(path, line, f"field 'answer' ({first[:40]!r}) is none of the 'options' nor their letter")


def infinitebench_record(path: Path, line: int, obj: dict[str, Any], default_name: str) -> tuple[str, Record]:
    """An InfiniteBench record: its options listed after the question when it has some."""
    require(path, line, obj, {"context": (str,), "input": (str,), "answer": (list, str, int, float)},
            "InfiniteBench")
    answers = string_list(path, line, obj["answer"], "answer")
    options = obj.get("options") or []
    if not isinstance(options, list):
        raise DataFileError(path, line, "field 'options' should be a list of strings")
    options = string_list(path, line, options, "options") if options else []
    if options and not 2 <= len(options) <= len(CHOICE_LETTERS):
        raise DataFileError(path, line, f"field 'options' should hold 2 to 4 options, got {len(options)}")
    metric, max_new = INFINITEBENCH.get(default_name, ("infbench_choice" if options else "qa_f1", 64))
    if "metric" in obj:
        metric = str(obj["metric"])
    if metric not in METRIC_NAMES:
        raise DataFileError(path, line, f"unknown metric {metric!r}; valid: {', '.join(METRIC_NAMES)}")
    question = obj["input"].strip()
    if options:
        head, tail, prefix = _IB_CHOICE
        listed = "\n".join(f"{letter}. {option}" for letter, option in zip(CHOICE_LETTERS, options, strict=False))
        tail = tail.replace("{options}", listed).replace("{input}", question)
    elif metric.startswith("rouge") and not question:
        head, tail, prefix = _IB_SUM
    elif metric.endswith("_zh"):
        head, tail, prefix = _QA_ZH
    else:
        head, tail, prefix = _IB_ASK
    if options and metric == "infbench_choice":
        answers = _choice_label(path, line, answers, options)
    if "{input}" in tail:  # a record without a question: the context alone, then the answer prefix
        tail = tail.replace("{input}", question) if question else ""
    return default_name, Record(head, obj["context"], tail, prefix, answers, metric,
                                _count_field(path, line, obj, "max_new_tokens", max_new), line=line)


# ----------------------------------------------------------------------------------------------- RULER

# RULER's generation length per task family (its tokens_to_generate), by the start of the task's name
RULER_NEW_TOKENS = (("niah", 128), ("vt", 30), ("variable_tracking", 30), ("cwe", 120),
                    ("common_words", 120), ("fwe", 50), ("freq_words", 50), ("qa", 32))
# where RULER's templates ask their question, after the context
_RULER_QUESTIONS = ("Question:", "What are all the special magic", "What is the special magic")


def ruler_question_at(text: str) -> int:
    """Where the question of a RULER prompt starts: its last "Question:" or needle query, else its last
    line; the whole prompt is context when it has a single line and no marker."""
    at = max(text.rfind(marker) for marker in _RULER_QUESTIONS)
    if at > 0:
        return at
    body = text.rstrip()
    last = body.rfind("\n")
    return last + 1 if last > 0 else len(text)


def ruler_record(path: Path, line: int, obj: dict[str, Any], default_name: str) -> tuple[str, Record]:
    """A prompt RULER exported (``input``, ``outputs``, ``answer_prefix``), used as RULER wrote it: the
    context is what comes before the question (``ruler_question_at``), cut in its middle when too long."""
    require(path, line, obj, {"input": (str,), "outputs": (list, str, int)}, "RULER")
    answers = string_list(path, line, obj["outputs"], "outputs")
    family = default_name.removeprefix("ruler_")  # the task RULER named: niah_*, vt, cwe, fwe, qa_*
    metric = str(obj.get("metric") or ("string_match_part" if family.startswith("qa") else "string_match_all"))
    if metric not in METRIC_NAMES:
        raise DataFileError(path, line, f"unknown metric {metric!r}; valid: {', '.join(METRIC_NAMES)}")
    new = next((n for prefix, n in RULER_NEW_TOKENS if family.startswith(prefix)), 128)
    prefix = obj.get("answer_prefix", "")
    if not isinstance(prefix, str):
        raise DataFileError(path, line, "field 'answer_prefix' should be a string")
    text = obj["input"]
    at = ruler_question_at(text)
    return default_name, Record("", text[:at], text[at:], prefix, answers, metric,
                        _count_field(path, line, obj, "max_new_tokens", new), line=line)
