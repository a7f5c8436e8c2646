"""The synthetic task registry (RULER families and the NIAH grid) and the dispatcher that turns any
task name, synthetic or from a data file, into samples."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from zoomkv.data.files import DataTask
from zoomkv.data.haystack import Haystack
from zoomkv.data.ruler_niah import (
    MULTITURN_TASK,
    NIAH_TASKS,
    NiahSpec,
    generate_niah,
    generate_niah_multiturn,
    niah_new_tokens,
)
from zoomkv.data.ruler_vt import MAX_NEW_TOKENS as VT_NEW_TOKENS
from zoomkv.data.ruler_vt import generate_vt
from zoomkv.data.ruler_words import CWE_NEW_TOKENS, FWE_NEW_TOKENS, generate_cwe, generate_fwe
from zoomkv.data.sample import PromptFormat, Sample
from zoomkv.errors import ZoomKVError
from zoomkv.eval.rows import GRID_TASK

__all__ = ["GRID_TASK", "SYNTHETIC_TASKS", "SyntheticTask", "TaskBuilder", "check_task_names", "row_task"]


def row_task(task: str, turn: int = 1) -> str:
    """The task name a row carries: a multi-turn task's rows are ``TASK.TURN``."""
    spec = SYNTHETIC_TASKS.get(task)
    return f"{task}.{turn}" if spec is not None and spec.turns > 1 else task

_DESCRIPTIONS = {
    "niah_single_1": "one number under a word key, noise haystack",
    "niah_single_2": "one number under a word key, prose haystack",
    "niah_single_3": "one uuid under a word key, prose haystack",
    "niah_multikey_1": "one of 4 keyed numbers asked for, prose haystack",
    "niah_multikey_2": "one number among a haystack of other keyed numbers",
    "niah_multikey_3": "one uuid under a uuid key among a haystack of other keyed uuids",
    "niah_multivalue": "all 4 numbers hidden under one key, prose haystack",
    "niah_multiquery": "the numbers of 4 keys at once, prose haystack",
    MULTITURN_TASK: "4 turns on one compressed context: one key's number per turn, each answer kept (scored per turn)",
    "vt": "variable tracking: every variable a value reaches through a 4-hop chain",
    "cwe": "common words: the 10 most frequent words of a numbered list",
    "fwe": "frequent words: the 3 most frequent coded words of a Zipf-distributed text",
}


@dataclass(frozen=True)
class SyntheticTask:
    name: str
    description: str
    generate: Callable[..., Sample]  # (fmt, length, index, *, seed, depth) -> Sample
    essay: bool  # runs on the prose of --haystack
    max_new_tokens: int  # per turn
    turns: int = 1  # a multi-turn task's rows are labelled TASK.1, TASK.2, ... (one per turn)


def _synthetic() -> dict[str, SyntheticTask]:
    tasks = {name: SyntheticTask(name, _DESCRIPTIONS[name], partial(generate_niah, name), spec.haystack == "essay",
                                 niah_new_tokens(spec))
             for name, spec in NIAH_TASKS.items()}
    tasks[MULTITURN_TASK] = SyntheticTask(MULTITURN_TASK, _DESCRIPTIONS[MULTITURN_TASK], generate_niah_multiturn, True,
                                          niah_new_tokens(NiahSpec("essay", "words", "numbers")), turns=4)
    tasks["vt"] = SyntheticTask("vt", _DESCRIPTIONS["vt"], generate_vt, False, VT_NEW_TOKENS)
    tasks["cwe"] = SyntheticTask("cwe", _DESCRIPTIONS["cwe"], generate_cwe, False, CWE_NEW_TOKENS)
    tasks["fwe"] = SyntheticTask("fwe", _DESCRIPTIONS["fwe"], generate_fwe, False, FWE_NEW_TOKENS)
    return tasks


SYNTHETIC_TASKS: dict[str, SyntheticTask] = _synthetic()


def check_task_names(names: list[str]) -> list[str]:
    unknown = [n for n in names if n not in SYNTHETIC_TASKS]
    if unknown:
        raise ZoomKVError(
            f"unknown task(s) {', '.join(repr(n) for n in unknown)}; valid tasks: {', '.join(SYNTHETIC_TASKS)} "
            f"(the NIAH grid runs with --grid-lengths; your own files with --data FILE.jsonl)"
        )
    return names


class TaskBuilder:
    """Builds sample ``index`` of any task at a length (and depth, for the grid)."""

    def __init__(self, fmt: PromptFormat, *, seed: int, model_max: int, essays: Haystack | None,
                 data: list[DataTask]):
        self.fmt, self.seed, self.model_max, self.essays = fmt, seed, model_max, essays
        self.data = {t.name: t for t in data}

    def build(self, task: str, length: int, index: int, depth: float | None = None) -> Sample:
        if task in self.data:
            return self.data[task].build(self.fmt, length, index, model_max=self.model_max, seed=self.seed)
        if task == GRID_TASK:  # single needle; on the prose haystack, as niah_single_2 does (noise if asked)
            base = "niah_single_2" if self.essays is not None and self.essays.kind == "prose" else "niah_single_1"
            return generate_niah(base, self.fmt, length, index, seed=self.seed, essays=self.essays, depth=depth,
                                 name=GRID_TASK)
        spec = SYNTHETIC_TASKS[task]
        kwargs = {"essays": self.essays} if spec.essay or task in NIAH_TASKS else {}
        return spec.generate(self.fmt, length, index, seed=self.seed, depth=depth, **kwargs)
