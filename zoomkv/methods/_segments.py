"""Cutting a token sequence into sentences or delimiter chunks (``sentencekv``, ``semanticache``).

Both methods cut the prompt where a punctuation token ends a sentence (or a clause):

- **prompt ids**: ``ctx.input_ids`` (``[batch, T]``, captured by the runtime's forward pre-hook);
- **boundary ids**: which ids end a segment depends on the tokenizer. A method's ``boundary_token_ids``
  hyper-parameter wins; otherwise they are computed once per tokenizer from ``ctx.tokenizer``'s vocabulary
  (``boundary_token_ids(tokenizer)``) and kept in the layer's ``meta`` for decoding;
- **generated ids**: the runtime does not hand methods the id of each generated token yet. They are read
  from ``memory.cache.step_ids`` (``[batch, 1]``, the ids of the forward call in progress) when present,
  so the proposed runtime change switches token boundaries on for generated text without touching the
  methods;
- **fallback**: without ids or boundary ids the sequence is cut into fixed-length segments of real tokens,
  counted from each sequence's first real token so left padding does not shift them.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from zoomkv.errors import ConfigError

if TYPE_CHECKING:
    from zoomkv.memory.layer import LayerMemory
    from zoomkv.protocol.method import PrefillContext

# Characters that end a sentence (SentenceKV's published list: . ! ? and their CJK forms, ellipses and
# newlines), and the wider set of delimiters that end a clause (SemantiCache also cuts at , ; :).
SENTENCE_MARKS = ".!?。！？…\n"
CLAUSE_MARKS = SENTENCE_MARKS + ",;:，；：、"

# Boundary ids per tokenizer and mark set; weak keys, so a dropped tokenizer takes its entry with it.
_BOUNDARY_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def boundary_token_ids(tokenizer: Any, marks: str = SENTENCE_MARKS) -> tuple[int, ...]:
    """Ids of the tokens that end a segment: every token whose text, spaces and tabs removed, is made only
    of ``marks`` (so ``"."``, ``" ."``, ``"..."``, ``".\\n"`` and ``"\\n\\n"`` all count, ``"3.5"`` does not).

    Works from the decoded text of each id, so it is independent of how a tokenizer spells its pieces
    (byte-level ``Ċ``, SentencePiece ``▁``, plain bytes). Special tokens never count."""
    allowed = set(marks)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    size = len(tokenizer)
    texts = tokenizer.batch_decode([[i] for i in range(size)], skip_special_tokens=False,
                                   clean_up_tokenization_spaces=False)
    out = []
    for i, text in enumerate(texts):
        stripped = text.replace(" ", "").replace("\t", "").replace("\r", "")
        if i not in special and stripped and set(stripped) <= allowed:
            out.append(i)
    return tuple(out)


def normalize_ids(ids: Iterable[int] | None, name: str = "boundary_token_ids") -> tuple[int, ...] | None:
    """A hyper-parameter given as a list (YAML, ``--method-arg``) or tuple → a sorted tuple of ints."""
    if ids is None:
        return None
    try:
        out = tuple(sorted({int(i) for i in ids}))
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{name} must be a list of token ids, got {ids!r}") from err
    if any(i < 0 for i in out):
        raise ConfigError(f"{name} must be non-negative token ids, got {out}")
    return out


def resolve_boundary_ids(configured: tuple[int, ...] | None, tokenizer: Any, marks: str) -> tuple[int, ...] | None:
    """The boundary ids to use: the configured ones, else the tokenizer's (computed once per tokenizer)."""
    if configured is not None:
        return configured
    if tokenizer is None:
        return None
    try:
        per_tokenizer = _BOUNDARY_CACHE.setdefault(tokenizer, {})
    except TypeError:  # a tokenizer that cannot be weakly referenced: compute it every time
        return boundary_token_ids(tokenizer, marks)
    if marks not in per_tokenizer:
        # Scanning a vocabulary takes a moment: once per tokenizer and mark set, not once per layer.
        per_tokenizer[marks] = boundary_token_ids(tokenizer, marks)
    return per_tokenizer[marks]


def prompt_token_ids(ctx: PrefillContext) -> torch.Tensor | None:
    """The prompt's token ids ``[batch, T]`` (None when the forward got embeddings)."""
    ids = getattr(ctx, "input_ids", None)
    b, _, t, _ = ctx.keys.shape
    if isinstance(ids, torch.Tensor) and ids.shape == (b, t):
        return ids
    return None


def step_token_ids(memory: LayerMemory, batch: int) -> torch.Tensor | None:
    """The ids ``[batch]`` of the tokens this decode step feeds in, if the runtime provides them."""
    ids = getattr(getattr(memory, "cache", None), "step_ids", None)
    if isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[0] == batch:
        return ids[:, -1]
    return None


def boundary_mask(ids: torch.Tensor, boundary_ids: tuple[int, ...]) -> torch.Tensor:
    """Bool mask of the positions of ``ids`` that hold a boundary token."""
    return torch.isin(ids, _boundary_table(tuple(boundary_ids), ids.dtype, ids.device))


@functools.lru_cache(maxsize=64)
def _boundary_table(boundary_ids: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # Made once per device: building it from a Python list is a blocking host-to-device copy, which a decode
    # step calling boundary_mask would otherwise make every step (a GPU synchronisation).
    return torch.tensor(boundary_ids, dtype=dtype, device=device)


def segment_ids(
    batch: int,
    length: int,
    device: torch.device,
    valid: torch.Tensor | None,
    boundary: torch.Tensor | None,
    max_length: int | None,
) -> torch.Tensor:
    """Segment id of every position, ``[batch, length]`` long, counting from 0 at each sequence's first
    real token; -1 on left padding.

    A boundary token belongs to the segment it ends (the next token starts a new one). With ``max_length``
    a segment is also cut every ``max_length`` tokens; with ``boundary`` None that is the whole rule (the
    fixed-length fallback)."""
    if valid is None:
        valid = torch.ones(batch, length, dtype=torch.bool, device=device)
    valid = valid.to(device)
    ends = torch.zeros(batch, length, dtype=torch.bool, device=device) if boundary is None else boundary.to(device)
    ends = ends & valid
    if max_length is not None:
        pos = torch.arange(length, device=device).expand(batch, length)
        # A segment starts at the first real token and after every boundary; cummax carries the latest start.
        starts = valid & ~torch.cat([torch.ones_like(valid[:, :1]), valid[:, :-1]], dim=1)  # first real token
        starts |= torch.cat([torch.zeros_like(ends[:, :1]), ends[:, :-1]], dim=1)
        start_at = torch.where(starts, pos, torch.zeros_like(pos)).cummax(dim=1).values
        ends = ends | (valid & ((pos - start_at) % max_length == max_length - 1))
    ends_long = ends.long()
    seg = ends_long.cumsum(dim=1) - ends_long  # exclusive: the boundary stays in the segment it ends
    return seg.masked_fill(~valid, -1)
