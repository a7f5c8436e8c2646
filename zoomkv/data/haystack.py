"""Haystacks: RULER's repeated noise sentences, or prose — the shipped King James Bible by default, or
any text source the user names (a folder of essays, a JSONL file, a saved or Hub dataset; see
``zoomkv.data.sources``).

A haystack is a word stream cut to any length, so prompts hit a target token count within a word or
two. Needles go in at sentence boundaries (the one nearest the requested depth), never mid-sentence.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from zoomkv.data.sources import SHIPPED, iter_texts
from zoomkv.errors import ZoomKVError

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
# The prose RULER's essay tasks run on when the user names none: natural text that installs offline, and
# not the corpus the quickstart recipe trains on (python-docs), so evaluation is on text training never saw.
DEFAULT_PROSE = "kjv"
# A haystack longer than this many words is cut: 128K-token prompts need about 100K words.
MAX_WORDS = 400_000


@dataclass(frozen=True)
class Haystack:
    kind: str  # "noise" or "prose"
    words: tuple[str, ...]
    note: str  # what result rows record as their haystack

    def take(self, n: int) -> list[str]:
        """The first ``n`` words, repeating the stream when it is shorter (as RULER repeats its essays)."""
        if n <= len(self.words):
            return list(self.words[:n])
        reps, rest = divmod(n, len(self.words))
        return list(self.words) * reps + list(self.words[:rest])


def noise_haystack(note: str = "noise") -> Haystack:
    return Haystack("noise", tuple(NOISE.split()), note)


@functools.lru_cache(maxsize=4)
def _source_words(source: str, field: str, split: str) -> tuple[str, ...]:
    words: list[str] = []
    # a Hub dataset is streamed: only the first MAX_WORDS words are read, not the whole dataset downloaded
    streaming = source not in SHIPPED and not Path(source).expanduser().exists()
    for text in iter_texts(source, field=field, split=split, streaming=streaming):
        words.extend(text.split())
        if len(words) >= MAX_WORDS:
            break
    return tuple(words[:MAX_WORDS])


def text_haystack(source: str = DEFAULT_PROSE, field: str = "text", split: str = "train") -> Haystack:
    """The words of ``source``'s records (in order, the text of ``field``; at most ``MAX_WORDS``), or
    RULER's noise for ``"noise"``. Refuses a source of under 50 words."""
    if source == "noise":
        return noise_haystack()
    words = _source_words(source, field, split)
    if len(words) < 50:
        raise ZoomKVError(f"haystack {source}: its text holds only {len(words)} words")
    return Haystack("prose", words, f"prose ({source})")


def pick_haystack(kind: str, prose: Haystack | None) -> Haystack:
    """The haystack a task asks for: for RULER's essay tasks the given prose (the shipped default when
    none is given), else noise."""
    if kind == "essay":
        return prose if prose is not None else text_haystack()
    return noise_haystack()


def sentence_starts(words: list[str]) -> list[int]:
    """Word indices where a sentence begins, plus ``len(words)`` (inserting at the very end)."""
    starts = [0]
    starts += [i for i in range(1, len(words)) if words[i - 1].endswith((".", "!", "?", '."', ".'"))]
    if starts[-1] != len(words):
        starts.append(len(words))
    return starts


def insert_at_depths(words: list[str], inserts: list[tuple[float, str]]) -> str:
    """``words`` joined by spaces with each ``(depth, text)`` placed at the sentence boundary nearest
    ``depth`` (0 = before the first word, 1 = after the last). Inserts at one boundary keep their order."""
    starts = sentence_starts(words)
    at: dict[int, list[str]] = {}
    for depth, text in inserts:
        target = min(max(depth, 0.0), 1.0) * len(words)
        pos = min(starts, key=lambda s: (abs(s - target), s))
        at.setdefault(pos, []).append(text)
    pieces: list[str] = []
    for i in range(len(words) + 1):
        pieces.extend(at.get(i, ()))
        if i < len(words):
            pieces.append(words[i])
    return " ".join(pieces)
