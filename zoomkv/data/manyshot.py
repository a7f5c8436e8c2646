"""Many-shot reasoning from a JSONL of GSM8K-style pairs (``question``, ``answer`` ending in ``#### N``).

Each test question is preceded by as many worked examples from the same file as fit in the target
length (never the question itself), and scored with the exact-number metric.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zoomkv.data.jsonl import DataFileError, require
from zoomkv.data.sample import PromptFormat, Sample, fit_units

MAX_NEW_TOKENS = 128
INSTRUCTION = "Solve each math problem step by step, then give the final number as \"The answer is N.\"\n\n"
PREFIX = "\nAnswer:"
_CALCULATOR = re.compile(r"<<[^>]*>>")  # GSM8K's calculator annotations: not part of the written solution


def parse_number(text: str) -> float | None:
    """A written number ("1,234", "$5", "7.") as a float, else None: how a GSM8K answer is read, and
    how ``zoomkv.eval.metrics.exact_number`` reads the model's."""
    text = text.replace(",", "").replace("$", "").strip().rstrip(".")
    try:
        return float(text)
    except ValueError:
        return None


@dataclass(frozen=True)
class Problem:
    question: str
    solution: str
    answer: str


def parse_problem(path: Path, line: int, obj: dict[str, Any]) -> Problem:
    require(path, line, obj, {"question": (str,), "answer": (str, int, float)}, "GSM8K")
    text = str(obj["answer"])
    solution, sep, final = text.rpartition("####")
    if not sep:  # a bare number is a valid answer too, with no worked solution to show
        solution, final = "", text
    if parse_number(final) is None:
        raise DataFileError(path, line, f"field 'answer' should end in '#### <number>', got {text[-40:]!r}")
    return Problem(obj["question"].strip(), _CALCULATOR.sub("", solution).strip(),
                   final.strip().replace(",", "").rstrip("."))


def _shot(p: Problem) -> str:
    worked = f"{p.solution}\n" if p.solution else ""
    return f"Question: {p.question}{PREFIX} {worked}The answer is {p.answer}.\n\n"


class ManyShotTask:
    def __init__(self, name: str, source: str, problems: list[Problem]):
        self.name, self.source, self.problems = name, source, problems

    @property
    def size(self) -> int:
        return len(self.problems)

    def _order(self, seed: int) -> list[int]:
        order = list(range(len(self.problems)))
        random.Random(f"{seed}:{self.name}").shuffle(order)
        return order

    def records_cut(self, fmt: PromptFormat, length: int, count: int, *, model_max: int) -> int:
        """None: a many-shot prompt takes as many whole worked examples as the length holds, and cuts none."""
        return 0

    def build(self, fmt: PromptFormat, length: int, index: int, *, model_max: int, seed: int = 0) -> Sample:
        order = self._order(seed)
        test = self.problems[order[index]]
        pool = [self.problems[j] for j in order if j != order[index]]
        random.Random(f"{seed}:{self.name}:{length}:{index}").shuffle(pool)
        limit = min(length, model_max - MAX_NEW_TOKENS)

        def prompt(k: int) -> str:
            return INSTRUCTION + "".join(_shot(p) for p in pool[:k]) + f"Question: {test.question}"

        k = fit_units(lambda k: fmt.measure(prompt(k), PREFIX), limit, what=self.name, start=8, most=len(pool))
        text = prompt(k)
        return Sample(
            task=self.name, length=length, index=index, prompt=text, answer_prefix=PREFIX,
            answers=[test.answer], metric="exact_number", max_new_tokens=MAX_NEW_TOKENS, haystack="data",
            meta={"shots": k}, question_at=text.rindex("Question: "),
        )
