"""Synthetic long-context training samples, generated offline from a seed with the model's own tokenizer.

Retrieval (a pass key; one key-value pair among many) and tracking (a chain of variable assignments), hidden
in natural-ish filler sentences, question and answer at the end: the answer tokens are where the teacher's
attention reaches far back, which is what the router must learn to follow. Sample ``i`` of ``n`` has a
length between ``min_length`` and ``max_length`` growing with ``i`` (the curriculum walks them in order).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

SUBJECTS = ["The farmer", "A small boat", "The old library", "Our neighbour", "The river", "A quiet student",
            "The committee", "The baker", "A red kite", "The museum guide", "The orchestra", "A tired traveller"]
VERBS = ["walked past", "talked about", "looked at", "painted", "repaired", "described", "waited near",
         "carried", "measured", "photographed", "ignored", "remembered"]
OBJECTS = ["the wooden bridge", "a bowl of soup", "the morning train", "the city walls", "an empty field",
           "the harbour lights", "a stack of letters", "the garden gate", "the winter market", "a broken clock"]
TAILS = ["before noon.", "in the rain.", "without a word.", "for a while.", "again and again.", "near the hills.",
         "with some care.", "after dinner.", "as usual.", "on Sunday."]
WORDS = ["apple", "violet", "harbor", "copper", "maple", "falcon", "silver", "meadow", "lantern", "pepper",
         "cobalt", "willow", "quartz", "saffron", "ember", "glacier"]


@dataclass
class Sample:
    text: str
    answer: str
    task: str
    length: int  # target length in tokens


def _filler(rng: random.Random) -> str:
    return f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(TAILS)} "


def _fill(tokenizer, rng: random.Random, facts: list[str], question: str, answer: str, length: int) -> str:
    """Filler sentences up to ~``length`` tokens, with ``facts`` at random depths, then question + answer."""
    fixed = len(tokenizer(" ".join(facts) + question + answer, add_special_tokens=False)["input_ids"])
    per = max(1.0, len(tokenizer(_filler(random.Random(0)) * 4, add_special_tokens=False)["input_ids"]) / 4)
    n = max(len(facts) + 1, round((length - fixed) / per))
    sentences = [_filler(rng) for _ in range(n)]
    slots = sorted(rng.sample(range(n), len(facts)))
    for slot, fact in zip(reversed(slots), reversed(facts), strict=True):
        sentences.insert(slot, fact + " ")
    return "".join(sentences) + question + answer


def make_sample(tokenizer, task: str, length: int, seed: int) -> Sample:
    rng = random.Random(seed)
    if task == "passkey":
        key = str(rng.randint(10000, 99999))
        facts = [f"The pass key is {key}. Remember it."]
        question, answer = "\nWhat is the pass key? The pass key is", f" {key}."
    elif task == "kv":
        keys = rng.sample(WORDS, 4)
        vals = [str(rng.randint(100, 999)) for _ in keys]
        facts = [f"The value of {k} is {v}." for k, v in zip(keys, vals, strict=True)]
        i = rng.randrange(len(keys))
        question, answer = f"\nWhat is the value of {keys[i]}? The value of {keys[i]} is", f" {vals[i]}."
    elif task == "vartrack":
        names = rng.sample(["X", "Y", "Z", "Q", "R", "S", "T", "U"], 3)
        value = str(rng.randint(1000, 9999))
        facts = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:], strict=False)]
        question, answer = f"\nWhich value does VAR {names[-1]} hold? VAR {names[-1]} holds", f" {value}."
    else:
        raise ValueError(f"unknown task {task!r}")
    return Sample(_fill(tokenizer, rng, facts, question, answer, length), answer.strip(" ."), task, length)


def make_samples(tokenizer, tasks: list[str], n: int, min_length: int, max_length: int, seed: int) -> list[Sample]:
    """``n`` samples, lengths growing linearly from ``min_length`` to ``max_length`` (the curriculum order)."""
    out = []
    for i in range(n):
        length = min_length + round((max_length - min_length) * i / max(1, n - 1))
        out.append(make_sample(tokenizer, tasks[i % len(tasks)], length, seed * 100_003 + i))
    return out


def curriculum_index(step: int, total_steps: int, n: int, seed: int) -> int:
    """Which sample step ``step`` trains on: drawn from the shortest samples first, the pool growing to all
    of them by mid-training. A pure function of (seed, step), so a resumed run sees exactly the same data."""
    unlocked = max(1, min(n, round(n * (0.3 + 1.4 * step / max(1, total_steps)))))
    return random.Random(seed * 1_000_003 + step).randrange(unlocked)
