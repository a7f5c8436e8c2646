"""RULER's needle-in-a-haystack family, generated offline with the evaluated model's tokenizer.

A needle is "One of the special magic {numbers} for {key} is: {value}."; the eight variants differ in
the haystack (noise sentences, essays, or other needles), the kind of keys and values, and how many
needles are hidden and asked for. The prompt wording follows RULER's template (singular when exactly
one value is asked for) so scores are comparable with published RULER numbers.
"""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass

from zoomkv.data.haystack import Haystack, insert_at_depths, noise_haystack, pick_haystack
from zoomkv.data.sample import PromptFormat, Sample, Turn, fit_units
from zoomkv.data.words import ADJECTIVES, NOUNS


@dataclass(frozen=True)
class NiahSpec:
    haystack: str  # "noise", "essay" or "needles" (distractor needles are the haystack)
    keys: str  # "words" (adjective-noun) or "uuids"
    values: str  # "numbers" (7 digits) or "uuids"
    num_keys: int = 1  # needles with distinct keys; the first ``num_queries`` are asked for
    num_values: int = 1  # values hidden under each key, all asked for
    num_queries: int = 1


NIAH_TASKS: dict[str, NiahSpec] = {
    "niah_single_1": NiahSpec("noise", "words", "numbers"),
    "niah_single_2": NiahSpec("essay", "words", "numbers"),
    "niah_single_3": NiahSpec("essay", "words", "uuids"),
    "niah_multikey_1": NiahSpec("essay", "words", "numbers", num_keys=4),
    "niah_multikey_2": NiahSpec("needles", "words", "numbers"),
    "niah_multikey_3": NiahSpec("needles", "uuids", "uuids"),
    "niah_multivalue": NiahSpec("essay", "words", "numbers", num_values=4),
    "niah_multiquery": NiahSpec("essay", "words", "numbers", num_keys=4, num_queries=4),
}

# Decode length per asked-for value: a 7-digit number is up to 8 tokens, a uuid up to ~36.
_TOKENS_PER_VALUE = {"numbers": 12, "uuids": 40}


def niah_new_tokens(spec: NiahSpec) -> int:
    return _TOKENS_PER_VALUE[spec.values] * spec.num_values * spec.num_queries + 12


def spread_depth(index: int, seed: int = 0) -> float:
    """Sample ``index``'s needle depth: the golden-ratio sequence covers [0, 1] evenly for any number
    of samples, and a sample keeps its depth when a later run asks for more samples (resume-safe)."""
    return (0.5 + (index + seed) * 0.6180339887498949) % 1.0


def _value(rng: random.Random, kind: str) -> str:
    if kind == "numbers":
        return str(rng.randint(1_000_000, 9_999_999))
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _key(rng: random.Random, kind: str) -> str:
    if kind == "words":
        return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _distinct(draw, count: int, taken: set[str]) -> list[str]:
    out: list[str] = []
    while len(out) < count:
        item = draw()
        if item not in taken:
            taken.add(item)
            out.append(item)
    return out


def needle(value_kind: str, key: str, value: str) -> str:
    return f"One of the special magic {value_kind} for {key} is: {value}."


def _join(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + ", and " + items[-1]


def niah_template(spec: NiahSpec, queries: list[str], context: str) -> tuple[str, str]:
    kind = spec.values
    query = _join(queries)
    if spec.num_values * spec.num_queries == 1:
        one = kind[:-1]
        prompt = (f"A special magic {one} is hidden within the following text. Make sure to memorize it. "
                  f"I will quiz you about the {one} afterwards.\n{context}\n"
                  f"What is the special magic {one} for {query} mentioned in the provided text?")
        return prompt, f" The special magic {one} for {query} mentioned in the provided text is"
    prompt = (f"Some special magic {kind} are hidden within the following text. Make sure to memorize it. "
              f"I will quiz you about the {kind} afterwards.\n{context}\n"
              f"What are all the special magic {kind} for {query} mentioned in the provided text?")
    return prompt, f" The special magic {kind} for {query} mentioned in the provided text are"


class _Distractors:
    """Distractor needles drawn in a fixed order, so the first n are the same whatever n is."""

    def __init__(self, spec: NiahSpec, rng: random.Random, taken_keys: set[str]):
        self.spec, self.rng, self.taken = spec, rng, taken_keys
        self.items: list[str] = []

    def first(self, n: int) -> list[str]:
        while len(self.items) < n:
            key = _distinct(lambda: _key(self.rng, self.spec.keys), 1, self.taken)[0]
            self.items.append(needle(self.spec.values, key, _value(self.rng, self.spec.values)))
        return self.items[:n]


def generate_niah(
    task: str, fmt: PromptFormat, length: int, index: int, *, seed: int = 0,
    essays: Haystack | None = None, depth: float | None = None, name: str | None = None,
) -> Sample:
    """Sample ``index`` of ``task`` at ``length`` tokens; the first answer's needle sits at ``depth``
    (default: ``spread_depth(index)``), any others at seeded random depths. ``name`` labels the sample
    (and errors) when another task reuses this one, as the NIAH grid does."""
    spec = NIAH_TASKS[task]
    label = name or task
    rng = random.Random(f"{seed}:{task}:{length}:{index}")
    depth = spread_depth(index, seed) if depth is None else depth
    taken: set[str] = set()
    keys = _distinct(lambda: _key(rng, spec.keys), max(spec.num_keys, spec.num_queries), taken)
    used_values: set[str] = set()
    values = {k: _distinct(lambda: _value(rng, spec.values), spec.num_values, used_values) for k in keys}
    queries = keys[: spec.num_queries]
    answers = [v for k in queries for v in values[k]]
    real = [needle(spec.values, k, v) for k in keys for v in values[k]]
    # the first answer's needle goes at the requested depth; the rest anywhere, in shuffled order
    placed = [(depth, real[0])] + [(rng.random(), text) for text in real[1:]]

    if spec.haystack == "needles":
        distractors = _Distractors(spec, rng, taken)
        note = "needles"
        pad_words = noise_haystack()

        def context(n: int, pad: int = 0) -> str:
            items = list(distractors.first(n))
            for d, text in sorted(placed, key=lambda p: p[0], reverse=True):
                items.insert(round(d * n), text)
            # A needle is 20-70 tokens: a few noise words after the last one bring the prompt to the
            # target length, which whole needles alone would miss by up to one needle.
            return " ".join(items + pad_words.take(pad))
    else:
        hay = pick_haystack(spec.haystack, essays)
        note = hay.note

        def context(n: int, pad: int = 0) -> str:
            return insert_at_depths(hay.take(n), placed)

    n = fit_units(lambda n: fmt.measure(*niah_template(spec, queries, context(n))), length, what=label)
    pad = 0
    if spec.haystack == "needles":
        pad = fit_units(lambda m: fmt.measure(*niah_template(spec, queries, context(n, m))), length, what=label,
                        most=200)
    prompt, prefix = niah_template(spec, queries, context(n, pad))
    return Sample(
        task=label, length=length, index=index, prompt=prompt, answer_prefix=prefix, answers=answers,
        question_at=prompt.rindex("\nWhat "),
        metric="string_match_all", max_new_tokens=niah_new_tokens(spec),
        depth=depth, haystack=note, meta={"keys": queries, "units": n, "pad_words": pad},
    )


# Multi-turn: the needles of niah_multiquery, asked for one key per turn on the same compressed context,
# each answer staying in the cache (SCBench's shared-context, multi-request setting).
MULTITURN_BASE = "niah_multiquery"
MULTITURN_TASK = "niah_multiturn"


def generate_niah_multiturn(fmt: PromptFormat, length: int, index: int, *, seed: int = 0,
                            essays: Haystack | None = None, depth: float | None = None) -> Sample:
    """Sample ``index`` of the multi-turn NIAH task: ``niah_multiquery``'s context and keys, turn 1 asks for
    the first key's number (singular wording, as niah_single), each follow-up for the next key."""
    one = NiahSpec("essay", "words", "numbers")  # one value asked per turn: RULER's singular wording

    def ask(key: str) -> tuple[str, str]:
        return (f"\nWhat is the special magic number for {key} mentioned in the provided text?",
                f" The special magic number for {key} mentioned in the provided text is")

    def first_turn(target: int) -> tuple[Sample, str, str, str]:
        base = generate_niah(MULTITURN_BASE, fmt, target, index, seed=seed, essays=essays, depth=depth)
        question, prefix = ask(base.meta["keys"][0])
        # the plural introduction stays: several numbers are hidden
        return base, base.prompt[: base.question_at] + question, question, prefix

    # Turn 1 asks for one key, not four: its prompt is shorter than niah_multiquery's at the same length, so
    # the context is built for the difference more (turn 1 then measures ``length`` like every task).
    base, prompt, question, prefix = first_turn(length)
    base, prompt, question, prefix = first_turn(length + length - fmt.measure(prompt, prefix))
    keys = base.meta["keys"]
    turns = [Turn(*ask(k), [answer], niah_new_tokens(one)) for k, answer in zip(keys[1:], base.answers[1:],
                                                                              strict=True)]
    return Sample(
        task=MULTITURN_TASK, length=length, index=index, prompt=prompt, answer_prefix=prefix,
        answers=base.answers[:1], question_at=base.question_at, metric="string_match_all",
        max_new_tokens=niah_new_tokens(one), depth=base.depth, haystack=base.haystack,
        meta={**base.meta, "keys": keys[:1], "turn_keys": keys, "turns": len(keys)}, follow_ups=turns,
    )
