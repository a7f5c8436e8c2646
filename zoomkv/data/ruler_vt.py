"""RULER's variable tracking (multi-hop): a chain ``VAR A = 12345``, ``VAR B = VAR A``, ... hidden in noise
sentences; the model must name every variable that ends up holding the value."""

from __future__ import annotations

import random
import string

from zoomkv.data.haystack import insert_at_depths, noise_haystack
from zoomkv.data.sample import PromptFormat, Sample, fit_units

MAX_NEW_TOKENS = 30
# An in-context example is prepended, as RULER does, when it takes at most this share of the context.
_EXAMPLE_SHARE = 0.2


def _names(rng: random.Random, count: int) -> list[str]:
    out: list[str] = []
    while len(out) < count:
        name = "".join(rng.choices(string.ascii_uppercase, k=5))
        if name not in out:
            out.append(name)
    return out


def vt_template(context: str, value: str, n_vars: int) -> tuple[str, str]:
    prompt = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
              f"{context}\nQuestion: Find all variables that are assigned the value {value} in the text above.")
    prefix = (f" Answer: According to the chain(s) of variable assignment in the text above, {n_vars} "
              f"variables are assigned the value {value}, they are: ")
    return prompt, prefix


def _chains(rng: random.Random, num_chains: int, num_hops: int) -> tuple[list[list[str]], list[str], list[str]]:
    """Per chain its statements in order; each chain's value; the variable names of the first chain."""
    names = _names(rng, num_chains * (num_hops + 1))
    values = [str(v) for v in rng.sample(range(10000, 100000), num_chains)]
    chains = []
    for c in range(num_chains):
        var = names[c * (num_hops + 1):(c + 1) * (num_hops + 1)]
        chains.append([f"VAR {var[0]} = {values[c]}."] + [f"VAR {var[i]} = VAR {var[i - 1]}." for i in range(1, len(var))])
    return chains, values, names[: num_hops + 1]


def _placed(rng: random.Random, chains: list[list[str]], first_depth: float | None) -> list[tuple[float, str]]:
    placed = []
    for c, statements in enumerate(chains):
        depths = sorted(rng.random() for _ in statements)  # a chain reads in order
        if c == 0 and first_depth is not None:
            depths = [first_depth] + sorted(first_depth + (1 - first_depth) * rng.random() for _ in statements[1:])
        placed += list(zip(depths, statements, strict=True))
    return placed


def _example(seed: int) -> str:
    rng = random.Random(f"{seed}:vt-example")
    chains, values, names = _chains(rng, 1, 4)
    context = insert_at_depths(noise_haystack().take(60), _placed(rng, chains, None))
    prompt, prefix = vt_template(context, values[0], len(names))
    return prompt + prefix + " ".join(names) + "\n\n"


def generate_vt(
    fmt: PromptFormat, length: int, index: int, *, seed: int = 0, num_chains: int = 1, num_hops: int = 4,
    depth: float | None = None,
) -> Sample:
    rng = random.Random(f"{seed}:vt:{length}:{index}")
    chains, values, names = _chains(rng, num_chains, num_hops)
    placed = _placed(rng, chains, depth)
    example = _example(seed)
    if fmt.count(example) > _EXAMPLE_SHARE * length:  # too short a context to afford the example
        example = ""
    hay = noise_haystack()

    def build(n: int) -> tuple[str, str]:
        prompt, prefix = vt_template(insert_at_depths(hay.take(n), placed), values[0], len(names))
        return example + prompt, prefix

    n = fit_units(lambda n: fmt.measure(*build(n)), length, what="vt")
    prompt, prefix = build(n)
    return Sample(
        task="vt", length=length, index=index, prompt=prompt, answer_prefix=prefix, answers=names,
        question_at=prompt.rindex("\nQuestion:"),
        metric="string_match_all", max_new_tokens=MAX_NEW_TOKENS, depth=placed[0][0], haystack=hay.note,
        meta={"value": values[0], "units": n, "example": bool(example)},
    )
