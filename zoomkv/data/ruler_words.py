"""RULER's aggregation tasks: common words (cwe, a numbered list where ten words recur most) and frequent
words (fwe, Zipf-distributed coded words; name the three most frequent)."""

from __future__ import annotations

import hashlib
import random
import string
from collections import Counter

import numpy as np

from zoomkv.data.sample import PromptFormat, Sample, fit_units
from zoomkv.data.words import PLAIN_WORDS, vocabulary

CWE_NEW_TOKENS, FWE_NEW_TOKENS = 120, 50
NUM_COMMON = 10


# ------------------------------------------------------------------------------------------ common words


def cwe_template(context: str) -> tuple[str, str]:
    prompt = ("Below is a numbered list of words. In these words, some appear more often than others. "
              f"Memorize the ones that appear most often.\n{context}\n"
              f"Question: What are the {NUM_COMMON} most common words in the above list?")
    return prompt, f" Answer: The top {NUM_COMMON} words that appear most often in the list are:"


def _numbered(words: list[str]) -> str:
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))


class _Pool:
    """Distinct words in a seeded order fixed per sample, so which words are common or rare does not
    change while the list length is searched: plain words first, shuffled (the common ten are always
    plain words), then shuffled compounds for lists longer than the plain vocabulary."""

    def __init__(self, key: str):
        self.rng = random.Random(key)
        self.words = list(PLAIN_WORDS)
        self.rng.shuffle(self.words)

    def first(self, n: int) -> list[str]:
        if n > len(self.words):
            extra = vocabulary(n)[len(self.words):]
            self.rng.shuffle(extra)
            self.words += extra
        return self.words[:n]


def _word_list(pool: list[str], order: random.Random, n_rare: int, freq_common: int, freq_rare: int,
               singles: int = 0) -> tuple[list[str], list[str]]:
    common, rare, once = pool[:NUM_COMMON], pool[NUM_COMMON:NUM_COMMON + n_rare], pool[NUM_COMMON + n_rare:]
    words = common * freq_common + rare * freq_rare + once
    order.shuffle(words)
    return words, common


def _cwe_example(seed: int) -> str:
    rng = random.Random(f"{seed}:cwe-example")
    pool = list(PLAIN_WORDS)
    rng.shuffle(pool)
    words, common = _word_list(pool[:NUM_COMMON + 15], rng, 15, 3, 1)
    prompt, prefix = cwe_template(_numbered(words))
    return prompt + prefix + " " + _numbered(common) + "\n\n"


def generate_cwe(fmt: PromptFormat, length: int, index: int, *, seed: int = 0, depth: float | None = None) -> Sample:
    """RULER's setting is 10 common words × 30 and the rest × 3; for contexts too short to hold 300 list
    entries, both frequencies shrink so the common words still take at most about half the context."""
    per_entry = fmt.count(_numbered(vocabulary(50))) / 50
    freq_common = int(max(2, min(30, 0.5 * length / (NUM_COMMON * per_entry))))
    freq_rare = max(1, min(3, freq_common // 2))
    example = _cwe_example(seed)
    if fmt.count(example) > 0.2 * length:  # RULER's in-context example, when the context can afford it
        example = ""
    key = f"{seed}:cwe:{length}:{index}"
    pool = _Pool(key)

    def build(n: int, singles: int = 0) -> tuple[tuple[str, str], list[str]]:
        words, common = _word_list(pool.first(NUM_COMMON + n + singles), random.Random(f"{key}:{n}:{singles}"),
                                   n, freq_common, freq_rare, singles)
        prompt, prefix = cwe_template(_numbered(words))
        return (example + prompt, prefix), common

    n = fit_units(lambda n: fmt.measure(*build(n)[0]), length, what="cwe")
    # a rare word takes freq_rare entries; words seen once fill what is left up to the target length
    singles = fit_units(lambda m: fmt.measure(*build(n, m)[0]), length, what="cwe", most=4 * freq_rare)
    (prompt, prefix), common = build(n, singles)
    return Sample(
        task="cwe", length=length, index=index, prompt=prompt, answer_prefix=prefix, answers=common,
        question_at=prompt.rindex("\nQuestion:"),
        metric="string_match_all", max_new_tokens=CWE_NEW_TOKENS, haystack="word list",
        meta={"freq_common": freq_common, "freq_rare": freq_rare, "units": n, "singles": singles,
              "example": bool(example)},
    )


# ---------------------------------------------------------------------------------------- frequent words


def fwe_template(context: str) -> tuple[str, str]:
    prompt = ("Read the following coded text and track the frequency of each coded word. Find the three most "
              f"frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please "
              "ignore the dots '....'. What are the three most frequently appeared words in the above coded text?")
    return prompt, " Answer: According to the coded text above, the three most frequently appeared words are:"


class _ZipfStream:
    """Coded words whose ranks follow Zipf(alpha), drawn in a fixed order so the first n never change."""

    def __init__(self, key: str, alpha: float, vocab_size: int):
        rng = random.Random(key)
        vocab: list[str] = []
        while len(vocab) < vocab_size:
            word = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 7)))
            if word not in vocab:
                vocab.append(word)
        self.vocab, self.alpha = vocab, alpha
        self.np_rng = np.random.default_rng(int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little"))
        self.words: list[str] = []

    def first(self, n: int) -> list[str]:
        while len(self.words) < n:
            ranks = self.np_rng.zipf(self.alpha, size=4096)
            self.words += [self.vocab[r - 1] for r in ranks if r <= len(self.vocab)]
        return self.words[:n]


def _dotted(words: list[str], key: str) -> str:
    rng = random.Random(key)
    out, next_dots = [], rng.randint(5, 15)
    for i, w in enumerate(words, 1):
        out.append(w)
        if i == next_dots and i < len(words):
            out.append("....")
            next_dots += rng.randint(5, 15)
    return " ".join(out)


def untie(words: list[str]) -> list[str]:
    """``words`` with any tie at third place broken: the last occurrence of each word tied with the
    third is rewritten as the most frequent word, so the three answers are well defined and the text
    keeps its length (a word shorter would do too, but shrinks the prompt by a whole word per tie)."""
    ranked = Counter(words).most_common()
    if len(ranked) <= 3 or ranked[2][1] > ranked[3][1]:
        return words
    top, third = ranked[0][0], ranked[2][1]
    out = list(words)
    for word, c in ranked[3:]:
        if c == third:
            out[len(out) - 1 - out[::-1].index(word)] = top
    return out


def top_words(words: list[str], k: int) -> list[str] | None:
    """The ``k`` most frequent words, or None when the k-th ties with the next (no single right answer)."""
    ranked = Counter(words).most_common(k + 1)
    if len(ranked) < k or (len(ranked) > k and ranked[k - 1][1] == ranked[k][1]):
        return None
    return [w for w, _ in ranked[:k]]


def generate_fwe(
    fmt: PromptFormat, length: int, index: int, *, seed: int = 0, alpha: float = 2.0, vocab_size: int = 1000,
    depth: float | None = None,
) -> Sample:
    key = f"{seed}:fwe:{length}:{index}"
    stream = _ZipfStream(key, alpha, vocab_size)

    def build(n: int) -> tuple[str, str]:
        return fwe_template(_dotted(untie(stream.first(n)), key))

    n = fit_units(lambda n: fmt.measure(*build(n)), length, what="fwe")
    answers = top_words(untie(stream.first(n)), 3) or []
    prompt, prefix = build(n)
    return Sample(
        task="fwe", length=length, index=index, prompt=prompt, answer_prefix=prefix, answers=answers,
        question_at=prompt.rindex("\nQuestion:"),
        metric="string_match_all", max_new_tokens=FWE_NEW_TOKENS, haystack="coded words",
        meta={"alpha": alpha, "units": n},
    )
