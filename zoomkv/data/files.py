"""``--data [NAME=]SOURCE``: the user's tasks, read through Hugging Face ``datasets``
(``zoomkv.data.sources.load_source``): a ``.jsonl`` / ``.json`` / ``.parquet`` / ``.csv`` file, a folder
saved with ``Dataset.save_to_disk``, or a Hub dataset id (its ``train`` split).

The records are LongBench, LongBench-v2, InfiniteBench, RULER-export, plain or GSM8K records, told apart
by the first record's fields unless ``--data-format`` says. A JSONL file ``datasets`` cannot load (bad
JSON, a line that is not an object, types arrow cannot put in one column) is read line by line instead,
so a broken line is named by its number. In a CSV file a list field (``answers``, ``options``, ...) is written
as a JSON list (``["a", "b"]``); a single answer can be plain text."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from zoomkv.data.jsonl import DataFileError, read_jsonl
from zoomkv.data.longbench import (
    LongBenchTask,
    Record,
    infinitebench_record,
    longbench_record,
    longbench_v2_record,
    plain_record,
    ruler_record,
)
from zoomkv.data.manyshot import ManyShotTask, parse_problem
from zoomkv.data.sample import PromptFormat, Sample
from zoomkv.data.sources import BUILDERS, load_source
from zoomkv.errors import ZoomKVError

FORMATS = ("auto", "longbench", "longbench_v2", "infinitebench", "ruler", "plain", "gsm8k")
RECORD_PARSERS = {"longbench": longbench_record, "longbench_v2": longbench_v2_record,
                  "infinitebench": infinitebench_record, "ruler": ruler_record, "plain": plain_record}
# fields that hold a list, which a CSV cell can only give as JSON text
_LIST_FIELDS = ("answers", "all_classes", "outputs", "options", "answer")
# file names that say nothing of the task (RULER writes TASK/validation.jsonl): the folder names it
_GENERIC_STEMS = ("validation", "test", "train", "data", "dev")


class DataTask(Protocol):
    name: str
    source: str

    @property
    def size(self) -> int: ...

    def build(self, fmt: PromptFormat, length: int, index: int, *, model_max: int, seed: int = 0) -> Sample: ...

    def records_cut(self, fmt: PromptFormat, length: int, count: int, *, model_max: int) -> int: ...


def detect_format(path: Path | str, line: int, obj: dict[str, Any]) -> str:
    if "prompt" in obj:
        return "plain"
    if "choice_A" in obj:
        return "longbench_v2"
    if "outputs" in obj and "input" in obj:
        return "ruler"
    if "context" in obj and "input" in obj:
        return "infinitebench" if "answer" in obj and "answers" not in obj else "longbench"
    if "question" in obj and "answer" in obj:
        return "gsm8k"
    raise DataFileError(path, line, f"cannot tell the format from the fields {sorted(obj)}: LongBench needs "
                        "input/context/answers, LongBench-v2 question/choice_A..choice_D/answer/context, "
                        "InfiniteBench context/input/answer[/options], RULER input/outputs, plain "
                        "prompt/answers, GSM8K question/answer")


def _jsonl_lines(path: Path) -> list[int]:
    """The numbers of the non-blank lines of a JSONL file: record i's line is entry i."""
    with path.open(encoding="utf-8", errors="replace") as f:
        return [n for n, text in enumerate(f, 1) if text.strip()]


def _from_csv(obj: dict[str, Any]) -> dict[str, Any]:
    """A CSV record's list fields, written as JSON lists (``["a", "b"]``), read back as lists. (Not
    ``Dataset.to_csv``'s ``['a' 'b']``, which cannot be told from one string.)"""
    for name in _LIST_FIELDS:
        value = obj.get(name)
        if isinstance(value, str) and value.lstrip().startswith("["):
            try:
                parsed = json.loads(value)
            except json.JSONDecodeError:
                continue
            if isinstance(parsed, list):
                obj[name] = parsed
    return obj


def _arrow_safe(path: Path) -> bool:
    """Whether a JSON / JSONL file is records Python's json reads (objects, or one array of them; not nested
    past its recursion limit): only those go to pyarrow, which segfaults on a lone ``null`` or on JSON
    nested some ten thousand deep instead of raising."""
    try:
        text = path.read_text(encoding="utf-8")
        if path.suffix.lower() == ".json" and text.lstrip("\ufeff \t\r\n").startswith("["):
            return all(isinstance(r, dict) for r in json.loads(text))
        return all(isinstance(json.loads(line), dict) for line in text.splitlines() if line.strip())
    except (UnicodeDecodeError, ValueError, RecursionError):
        return False


@contextlib.contextmanager
def _datasets_quiet() -> Iterator[None]:
    logger = logging.getLogger("datasets.packaged_modules")  # the json/csv/... builders ("datasets" is reset)
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def read_records(source: str) -> list[tuple[int, dict[str, Any]]]:
    """``(where, record)`` for every record of ``source``: ``where`` is the line number in a JSONL file,
    else the record's number counted from 1. Null fields are left out (a table gives every record every
    column)."""
    path = Path(source).expanduser()
    local = path.exists()
    if not local and (path.suffix.lower() in BUILDERS or source.startswith((".", "/", "~"))):
        raise DataFileError(path, None, "file not found")
    by_line = local and path.is_file() and path.suffix.lower() in (".jsonl", ".json")
    if by_line and not _arrow_safe(path):
        # named by line here: pyarrow (26) crashes the whole process on some bad files (`null`, deep nesting)
        return [(line, {k: v for k, v in obj.items() if v is not None}) for line, obj in read_jsonl(path)]
    try:
        with _datasets_quiet():  # its parse errors are logged before they are raised; the one line is ours
            ds = load_source(source)
    except ZoomKVError:
        if by_line:  # names the broken line, or reads the records arrow could not put in one table
            return [(line, {k: v for k, v in obj.items() if v is not None}) for line, obj in read_jsonl(path)]
        raise
    rows = [{k: v for k, v in row.items() if v is not None} for row in ds]
    where = str(path) if local else source
    if not rows or not any(rows):
        raise DataFileError(where, None, "no records (the file is empty)")
    if local and path.is_file() and path.suffix.lower() in (".csv", ".tsv"):
        rows = [_from_csv(row) for row in rows]
    numbers = _jsonl_lines(path) if by_line else []
    if len(numbers) != len(rows):  # a JSON array file, or no lines to count: the record's number
        numbers = list(range(1, len(rows) + 1))
    return list(zip(numbers, rows, strict=True))


def _default_name(source: str) -> str:
    path = Path(source.rstrip("/")).expanduser()
    if path.suffix.lower() in BUILDERS and path.stem.lower() in _GENERIC_STEMS and path.parent.name:
        return path.parent.name
    return path.stem if path.suffix.lower() in BUILDERS else path.name


def load_data(spec: str, fmt: str = "auto") -> list[DataTask]:
    """The tasks in one ``[NAME=]SOURCE``: a LongBench file may hold several datasets (one task each)."""
    if fmt not in FORMATS:
        raise ZoomKVError(f"unknown data format {fmt!r}; valid: {', '.join(FORMATS)}")
    name, sep, source = spec.partition("=")
    if not sep or Path(spec).expanduser().exists():  # a path that itself contains '=' stays a path
        name, source = "", spec
    records = read_records(source)
    where = str(Path(source).expanduser()) if Path(source).expanduser().exists() else source
    kind = fmt if fmt != "auto" else detect_format(where, *records[0])
    default = name or _default_name(source)
    if kind == "ruler" and not name:  # RULER's own task names are zoomkv's built-in synthetic tasks
        default = f"ruler_{default}"
    if kind == "gsm8k":
        problems = [parse_problem(Path(where), line, obj) for line, obj in records]
        return [ManyShotTask(name or f"manyshot_{default}", where, problems)]
    parse = RECORD_PARSERS[kind]
    groups: dict[str, list[Record]] = {}
    for line, obj in records:
        task, record = parse(Path(where), line, obj, default)
        groups.setdefault(name or task, []).append(record)
    return [LongBenchTask(task, where, recs) for task, recs in groups.items()]


def read_text_file(path_text: str | Path, what: str) -> str:
    """A UTF-8 text file the user named (a prompt, a document, calibration text), or one ZoomKVError
    saying what is wrong: ``{what} not found: PATH`` or ``PATH is not UTF-8 text``."""
    path = Path(path_text)
    if not path.is_file():
        raise ZoomKVError(f"{what} not found: {path}")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ZoomKVError(f"{path} is not UTF-8 text") from None
