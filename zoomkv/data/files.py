"""``--data [NAME=]FILE.jsonl``: the user's tasks, in LongBench, plain or GSM8K format (told apart by
the first record's fields unless ``--data-format`` says)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from zoomkv.data.jsonl import DataFileError, read_jsonl
from zoomkv.data.longbench import LongBenchTask, Record, longbench_record, plain_record
from zoomkv.data.manyshot import ManyShotTask, parse_problem
from zoomkv.data.sample import PromptFormat, Sample
from zoomkv.errors import ZoomKVError

FORMATS = ("auto", "longbench", "plain", "gsm8k")


class DataTask(Protocol):
    name: str
    source: str

    @property
    def size(self) -> int: ...

    def build(self, fmt: PromptFormat, length: int, index: int, *, model_max: int, seed: int = 0) -> Sample: ...


def detect_format(path: Path, line: int, obj: dict[str, Any]) -> str:
    if "prompt" in obj:
        return "plain"
    if "context" in obj and "input" in obj:
        return "longbench"
    if "question" in obj and "answer" in obj:
        return "gsm8k"
    raise DataFileError(path, line, f"cannot tell the format from the fields {sorted(obj)}: LongBench needs "
                        "input/context/answers, plain needs prompt/answers, GSM8K needs question/answer")


def load_data(spec: str, fmt: str = "auto") -> list[DataTask]:
    """The tasks in one ``[NAME=]FILE``: a LongBench file may hold several datasets (one task each)."""
    if fmt not in FORMATS:
        raise ZoomKVError(f"unknown data format {fmt!r}; valid: {', '.join(FORMATS)}")
    name, sep, file = spec.partition("=")
    if not sep or Path(spec).expanduser().is_file():  # a path that itself contains '=' stays a path
        name, file = "", spec
    path = Path(file).expanduser()
    records = read_jsonl(path)
    kind = fmt if fmt != "auto" else detect_format(path, *records[0])
    default = name or path.stem
    if kind == "gsm8k":
        problems = [parse_problem(path, line, obj) for line, obj in records]
        return [ManyShotTask(name or f"manyshot_{path.stem}", str(path), problems)]
    parse = longbench_record if kind == "longbench" else plain_record
    groups: dict[str, list[Record]] = {}
    for line, obj in records:
        task, record = parse(path, line, obj, default)
        groups.setdefault(name or task, []).append(record)
    return [LongBenchTask(task, str(path), recs) for task, recs in groups.items()]


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
