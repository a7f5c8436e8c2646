"""What every task produces (``Sample``), how it becomes the model's input (``PromptFormat``), and the
search that sizes a synthetic context to a target token length (``fit_units``)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from zoomkv.errors import ZoomKVError

# The metrics a sample or a data record may name. ``zoomkv.eval.metrics.METRICS`` implements exactly these,
# in this order; the data readers check names against this list, since data cannot import eval.
METRIC_NAMES: tuple[str, ...] = (
    "string_match_all", "string_match_part", "qa_f1", "qa_f1_zh", "rouge_l", "rouge_l_zh", "classification",
    "retrieval", "retrieval_zh", "count", "code_sim", "exact_number", "choice", "infbench_choice",
)


@dataclass
class Turn:
    """A follow-up question over the same context, asked after the previous answer (multi-turn tasks)."""

    question: str  # the text appended after the previous answer
    answer_prefix: str
    answers: list[str]
    max_new_tokens: int


@dataclass
class Sample:
    """One prompt with its references. ``prompt`` is the user's turn; ``answer_prefix`` is where the
    model's reply starts (RULER primes the answer this way: after the assistant header in chat mode)."""

    task: str
    length: int  # target length (synthetic) or truncation limit (data files), in tokens
    index: int
    prompt: str
    answer_prefix: str
    answers: list[str]
    metric: str  # one of METRIC_NAMES
    max_new_tokens: int
    depth: float | None = None
    haystack: str = ""
    all_classes: list[str] | None = None
    chat: bool | None = None  # a task that must not use the chat template (LongBench's few-shot and code)
    first_line: bool = False  # score only the reply's first line (LongBench's few-shot tasks)
    meta: dict[str, Any] = field(default_factory=dict)
    # Where the question starts in ``prompt`` (a character offset): the query-agnostic protocol compresses
    # what comes before it and asks the rest afterwards. None: the whole prompt is context.
    question_at: int | None = None
    # Multi-turn tasks: more questions, each asked on the same cache after the previous answer (plain text,
    # no chat template); the sample's own prompt is turn 1. Each turn is scored on its own.
    follow_ups: list[Turn] = field(default_factory=list)


# a floor for tokenizers that cannot list their vocabulary: a token of more characters than this is rare
MIN_CHARS_PER_TOKEN = 32


class PromptFormat:
    """Turns (prompt, answer prefix) into the exact text the model reads, and counts its tokens.

    ``chat=None`` uses the tokenizer's chat template when it has one. The count is of the whole model
    input, template included, with ``add_special_tokens=False`` as ``zoomkv.generation`` encodes it.
    """

    def __init__(self, tokenizer: Any, chat: bool | None = None):
        self.tokenizer = tokenizer
        self.has_template = bool(getattr(tokenizer, "chat_template", None))
        self.chat = self.has_template if chat is None else (chat and self.has_template)

    @functools.cached_property
    def chars_per_token(self) -> int:
        """The most characters one token can stand for (its longest vocabulary entry, whose text, byte-level or
        sentencepiece, is never shorter than what it decodes to): ``n`` tokens cover at most ``n *`` this many
        characters, so a text can be cut to that many before it is tokenized (a 100 MB record is not)."""
        try:
            longest = max((len(t) for t in self.tokenizer.get_vocab()), default=0)
        except (AttributeError, TypeError, NotImplementedError):
            longest = 0
        return max(longest, MIN_CHARS_PER_TOKEN)

    def uses_chat(self, chat: bool | None = None) -> bool:
        """Whether a prompt is wrapped: a sample's own setting (``chat``) wins over the run's."""
        return self.chat if chat is None else (chat and self.has_template)

    def render(self, prompt: str, answer_prefix: str = "", chat: bool | None = None) -> str:
        if not self.uses_chat(chat):
            return prompt + answer_prefix
        head = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        # the assistant header already ends the line: a leading space would be an odd first token
        return head + answer_prefix.lstrip()

    def count(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def measure(self, prompt: str, answer_prefix: str = "", chat: bool | None = None) -> int:
        return self.count(self.render(prompt, answer_prefix, chat))

    def sample_text(self, sample: Sample) -> str:
        return self.render(sample.prompt, sample.answer_prefix, sample.chat)

    def context_text(self, sample: Sample) -> str:
        """The start of ``sample_text`` that holds the context and not the question (chat template head
        included): what the query-agnostic protocol compresses before the question arrives."""
        text = self.sample_text(sample)
        at = len(sample.prompt) if sample.question_at is None else sample.question_at
        return text[: text.index(sample.prompt) + at]


def fit_units(measure: Callable[[int], int], target: int, *, what: str, start: int = 64, most: int | None = None) -> int:
    """The largest unit count ``n`` (at most ``most``) whose prompt ``measure(n)`` fits in ``target`` tokens.

    Token counts grow with ``n`` (give or take a merge at a seam), so an exponential probe for an upper
    bound followed by bisection needs about 2·log2(n) tokenisations.
    """
    if measure(0) > target:
        raise ZoomKVError(
            f"{what}: a length of {target} tokens is too short, its template alone takes {measure(0)} tokens"
        )
    lo, hi = 0, max(1, start)
    if most is not None:
        if measure(most) <= target:
            return most
        hi = min(hi, most)
    while measure(hi) <= target:
        lo, hi = hi, hi * 2
        if most is not None:
            hi = min(hi, most)
        if hi > 50_000_000:
            raise ZoomKVError(f"{what}: cannot reach {target} tokens (the haystack does not grow)")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if measure(mid) <= target:
            lo = mid
        else:
            hi = mid
    return lo
