"""The passkey retrieval prompt (Mohtashami & Jaggi, 2023): a number hidden in repetitive filler.

Used by the runtime's retrieval test and by ``zoomkv bench`` to build prompts of a given token length.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

INTRO = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about it.\n"
)
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
QUESTION = "\nWhat is the pass key? The pass key is"


@dataclass
class PasskeyPrompt:
    text: str
    answer: str
    depth: float


def passkey_prompt(tokenizer, length: int, depth: float = 0.5, seed: int = 0) -> PasskeyPrompt:
    """A prompt of about ``length`` tokens (in ``tokenizer``) with the key at ``depth`` (0 = start)."""
    rng = random.Random(seed)
    key = str(rng.randint(10000, 99999))
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
    fixed = len(tokenizer(INTRO + needle + QUESTION, add_special_tokens=False)["input_ids"])
    per_filler = len(tokenizer(FILLER * 8, add_special_tokens=False)["input_ids"]) / 8
    n = max(1, round((length - fixed) / per_filler))
    before = round(n * depth)
    text = INTRO + FILLER * before + needle + FILLER * (n - before) + QUESTION
    return PasskeyPrompt(text=text, answer=key, depth=depth)
