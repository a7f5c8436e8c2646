"""Haystacks: RULER's repeated noise sentences, or the user's own essays (a folder of text files).

A haystack is a word stream cut to any length, so prompts hit a target token count within a word or
two. Needles go in at sentence boundaries (the one nearest the requested depth), never mid-sentence.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from zoomkv.errors import ZoomKVError

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
TEXT_SUFFIXES = (".txt", ".md", ".text")
NOISE_FALLBACK = "noise (fallback: no --haystack-dir given)"


@dataclass(frozen=True)
class Haystack:
    kind: str  # "noise" or "essay"
    words: tuple[str, ...]
    note: str  # what result rows record as their haystack

    def take(self, n: int) -> list[str]:
        """The first ``n`` words, repeating the stream when it is shorter (as RULER repeats its essays)."""
        reps, rest = divmod(n, len(self.words))
        return list(self.words) * reps + list(self.words[:rest])


def noise_haystack(note: str = "noise") -> Haystack:
    return Haystack("noise", tuple(NOISE.split()), note)


def essay_haystack(folder: str | Path) -> Haystack:
    """Every text file under ``folder`` (sorted, recursive), read as one stream of words."""
    root = Path(folder).expanduser()
    if not root.is_dir():
        raise ZoomKVError(f"--haystack-dir {root} is not a folder")
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
    if not files:
        raise ZoomKVError(f"--haystack-dir {root} holds no text files ({', '.join(TEXT_SUFFIXES)})")
    words: list[str] = []
    for path in files:
        try:
            words.extend(path.read_text(encoding="utf-8", errors="replace").split())
        except OSError as err:
            raise ZoomKVError(f"cannot read haystack file {path}: {err}") from err
    if len(words) < 50:
        raise ZoomKVError(f"--haystack-dir {root}: its {len(files)} text file(s) hold only {len(words)} words")
    return Haystack("essay", tuple(words), f"essay ({len(files)} files from {root})")


def pick_haystack(kind: str, essays: Haystack | None) -> Haystack:
    """The haystack a task asks for: essays when it wants them and the user gave some, else noise
    (recorded as a fallback, so results never pass a noise run off as an essay run)."""
    if kind == "essay":
        return essays if essays is not None else noise_haystack(NOISE_FALLBACK)
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
