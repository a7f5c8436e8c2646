"""Long-context training samples, made offline from a seed with the model's own tokenizer.

Text comes from a corpus (any data source: the recipe's ``data``, by default the Python documentation that
ships with Python) or, without one, from generated filler sentences. Tasks: ``plain`` (the corpus text
alone: the teacher picks the positions whose attention reaches far back, as in any prose), and synthetic
tasks inserted into the text at random sentence boundaries, question and answer at the end — retrieval
(``passkey``; ``kv``, one key-value pair among many), multi-hop (``vartrack``, a chain of variable
assignments) and aggregation (``aggregate``, every special word in the text). Their answer tokens are where
the teacher's attention reaches far back, which is what the router must learn to follow. Sample ``i`` of
``n`` has a length between ``min_length`` and ``max_length`` growing with ``i`` (the curriculum walks them
in order); tasks are mixed by weight (``plain:2,passkey:1``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from zoomkv.data.haystack import Haystack, insert_at_depths
from zoomkv.data.sample import fit_units
from zoomkv.errors import ZoomKVError

TASKS = ("plain", "passkey", "kv", "vartrack", "aggregate")

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


def _facts(task: str, rng: random.Random) -> tuple[list[str], str, str]:
    """The facts to hide, the question and the answer of a synthetic task."""
    if task == "passkey":
        key = str(rng.randint(10000, 99999))
        return [f"The pass key is {key}. Remember it."], "\nWhat is the pass key? The pass key is", f" {key}."
    if task == "kv":
        keys = rng.sample(WORDS, 4)
        vals = [str(rng.randint(100, 999)) for _ in keys]
        facts = [f"The value of {k} is {v}." for k, v in zip(keys, vals, strict=True)]
        i = rng.randrange(len(keys))
        return facts, f"\nWhat is the value of {keys[i]}? The value of {keys[i]} is", f" {vals[i]}."
    if task == "vartrack":
        names = rng.sample(["X", "Y", "Z", "Q", "R", "S", "T", "U"], 3)
        value = str(rng.randint(1000, 9999))
        facts = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:], strict=False)]
        return facts, f"\nWhich value does VAR {names[-1]} hold? VAR {names[-1]} holds", f" {value}."
    if task == "aggregate":
        words = rng.sample(WORDS, 3)
        facts = [f"One special word is {w}." for w in words]
        return facts, "\nList every special word in the text above. The special words are", f" {', '.join(words)}."
    raise ZoomKVError(f"unknown training task {task!r}; valid: {', '.join(TASKS)}")


def _corpus_text(tokenizer, corpus: Haystack, rng: random.Random, facts: list[str], tail: str, length: int) -> str:
    """A window of the corpus (at a random word) with ``facts`` at random sentence boundaries, then ``tail``,
    cut to the most words that keep the whole within ``length`` tokens."""
    offset = rng.randrange(len(corpus.words))
    depths = sorted(rng.random() for _ in facts)
    stream = corpus.words[offset:] + corpus.words[:offset]

    def text(n: int) -> str:
        words = list(stream[:n]) if n <= len(stream) else corpus.take(n)
        return insert_at_depths(words, list(zip(depths, facts, strict=True))) + tail

    def measure(n: int) -> int:
        return len(tokenizer(text(n), add_special_tokens=False)["input_ids"])

    if measure(0) >= length:  # the task alone fills the length (short curricula, byte tokenizers): no corpus text
        return text(0)
    return text(fit_units(measure, length, what="training sample", start=max(16, length // 2)))


def make_sample(tokenizer, task: str, length: int, seed: int, corpus: Haystack | None = None) -> Sample:
    """Sample ``seed`` of ``task`` at about ``length`` tokens, on ``corpus`` text (else filler sentences)."""
    rng = random.Random(seed)
    if task == "plain":
        if corpus is None:
            raise ZoomKVError("the 'plain' training task needs a corpus (recipe key 'data')")
        return Sample(_corpus_text(tokenizer, corpus, rng, [], "", length), "", task, length)
    facts, question, answer = _facts(task, rng)
    if corpus is None:
        return Sample(_fill(tokenizer, rng, facts, question, answer, length), answer.strip(" ."), task, length)
    return Sample(_corpus_text(tokenizer, corpus, rng, facts, question + answer, length), answer.strip(" ."),
                  task, length)


def parse_task_mix(spec: str) -> dict[str, float]:
    """``"plain:2,passkey,kv:0.5"`` → task weights (1 when not given). Refuses unknown tasks and weights
    that are not positive numbers."""
    mix: dict[str, float] = {}
    for item in (p.strip() for p in spec.split(",")):
        if not item:
            continue
        name, _, weight = item.partition(":")
        name = name.strip()
        if name not in TASKS:
            raise ZoomKVError(f"unknown training task {name!r}; valid: {', '.join(TASKS)}")
        try:
            value = float(weight) if weight.strip() else 1.0
        except ValueError:
            raise ZoomKVError(f"training task {name!r}: weight {weight!r} is not a number") from None
        if not value > 0 or value == float("inf"):
            raise ZoomKVError(f"training task {name!r}: weight must be a positive number, got {weight!r}")
        mix[name] = value
    if not mix:
        raise ZoomKVError("no training tasks given")
    return mix


def task_sequence(mix: dict[str, float], n: int, seed: int) -> list[str]:
    """``n`` task names in proportion to their weights (largest remainders), in a seeded order."""
    total = sum(mix.values())
    exact = {t: n * w / total for t, w in mix.items()}
    counts = {t: int(v) for t, v in exact.items()}
    for t in sorted(exact, key=lambda t: exact[t] - counts[t], reverse=True)[: n - sum(counts.values())]:
        counts[t] += 1
    seq = [t for t in mix for _ in range(counts[t])]
    random.Random(seed).shuffle(seq)
    return seq


def make_samples(tokenizer, tasks: list[str] | dict[str, float], n: int, min_length: int, max_length: int,
                 seed: int, corpus: Haystack | None = None) -> list[Sample]:
    """``n`` samples, lengths growing linearly from ``min_length`` to ``max_length`` (the curriculum order).
    ``tasks``: a list taken in turn, or a weight per task (mixed in proportion)."""
    order = (task_sequence(tasks, n, seed) if isinstance(tasks, dict)
             else [tasks[i % len(tasks)] for i in range(n)])
    return [make_sample(tokenizer, order[i], length, seed * 100_003 + i, corpus)
            for i, length in enumerate(sample_lengths(n, min_length, max_length))]


def sample_lengths(n: int, min_length: int, max_length: int) -> list[int]:
    """The token lengths of ``make_samples``' ``n`` samples: from ``min_length`` to ``max_length`` in equal steps."""
    return [min_length + round((max_length - min_length) * i / max(1, n - 1)) for i in range(n)]


def curriculum_index(step: int, total_steps: int, n: int, seed: int) -> int:
    """Which sample step ``step`` trains on: drawn from the shortest samples first, the pool growing to all
    of them by mid-training. A pure function of (seed, step), so a resumed run sees exactly the same data."""
    unlocked = max(1, min(n, round(n * (0.3 + 1.4 * step / max(1, total_steps)))))
    return random.Random(seed * 1_000_003 + step).randrange(unlocked)
