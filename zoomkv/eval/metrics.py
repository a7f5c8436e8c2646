"""Scoring functions, each ``metric(prediction, answers, **extra) -> score in [0, 100]``.

RULER's two substring metrics, LongBench's family (token F1 with SQuAD-style normalisation, ROUGE-L,
classification, passage retrieval and count, code edit similarity) and the exact-number metric of
GSM8K-style reasoning. A sample is scored against every reference answer and keeps the best, as
LongBench does; RULER's ``string_match_all`` instead needs every reference in the prediction.

Written from the metrics' published definitions. Two deliberate differences from LongBench's code:
ROUGE-L is the sentence-level LCS F-measure (the ``rouge`` package's summary-level union-LCS variant
differs on multi-sentence texts), and the Chinese metrics tokenise into characters rather than with
jieba (not a dependency here). Code similarity uses difflib's ratio where LongBench uses fuzzywuzzy's,
which is the same ratio when python-Levenshtein is absent.
"""

from __future__ import annotations

import difflib
import re
import string
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from zoomkv.data.manyshot import parse_number
from zoomkv.errors import ZoomKVError

Metric = Callable[..., float]

_CONTROL = re.compile(r"[\x00-\x1f]")
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_ZH_PUNCT = set("！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏.")


def clean_prediction(text: str) -> str:
    """RULER's post-processing: control characters become line breaks, outer whitespace goes."""
    return _CONTROL.sub("\n", text).strip()


def normalize_answer(text: str) -> str:
    """SQuAD/LongBench normalisation: lowercase, drop ASCII punctuation, drop the articles a/an/the,
    collapse whitespace. The order matters: punctuation goes before articles, so "the-end" → "theend"."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in string.punctuation)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def normalize_zh(text: str) -> str:
    """Chinese variant: lowercase, drop ASCII and CJK punctuation and all whitespace."""
    text = text.lower()
    return "".join(ch for ch in text if ch not in string.punctuation and ch not in _ZH_PUNCT and not ch.isspace())


# ------------------------------------------------------------------------------------------------ RULER


def string_match_all(prediction: str, answers: Sequence[str], **_: Any) -> float:
    """Share of the references found (case-insensitively) in the prediction, × 100."""
    if not answers:
        return 0.0
    pred = clean_prediction(prediction).lower()
    return 100.0 * sum(a.lower() in pred for a in answers) / len(answers)


def string_match_part(prediction: str, answers: Sequence[str], **_: Any) -> float:
    """100 if any reference is found (case-insensitively) in the prediction, else 0."""
    pred = clean_prediction(prediction).lower()
    return 100.0 if any(a.lower() in pred for a in answers) else 0.0


# ------------------------------------------------------------------------------------ token F1, ROUGE-L


def _f1(pred_tokens: Sequence[str], ref_tokens: Sequence[str]) -> float:
    common = sum((Counter(pred_tokens) & Counter(ref_tokens)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred_tokens), common / len(ref_tokens)
    return 2 * precision * recall / (precision + recall)


def _lcs(a: Sequence[str], b: Sequence[str]) -> int:
    # one row of the dynamic-programming table at a time: summaries can be thousands of tokens long
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def _rouge_l(pred_tokens: Sequence[str], ref_tokens: Sequence[str]) -> float:
    lcs = _lcs(pred_tokens, ref_tokens) if pred_tokens and ref_tokens else 0
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(pred_tokens), lcs / len(ref_tokens)
    return 2 * precision * recall / (precision + recall)


def _best(prediction: str, answers: Sequence[str], one: Callable[[str, str], float]) -> float:
    return 100.0 * max((one(prediction, a) for a in answers), default=0.0)


def qa_f1(prediction: str, answers: Sequence[str], **_: Any) -> float:
    return _best(prediction, answers, lambda p, a: _f1(normalize_answer(p).split(), normalize_answer(a).split()))


def qa_f1_zh(prediction: str, answers: Sequence[str], **_: Any) -> float:
    return _best(prediction, answers, lambda p, a: _f1(list(normalize_zh(p)), list(normalize_zh(a))))


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def rouge_l(prediction: str, answers: Sequence[str], **_: Any) -> float:
    return _best(prediction, answers, lambda p, a: _rouge_l(_words(p), _words(a)))


def rouge_l_zh(prediction: str, answers: Sequence[str], **_: Any) -> float:
    return _best(prediction, answers, lambda p, a: _rouge_l(list(normalize_zh(p)), list(normalize_zh(a))))


# ------------------------------------------------------------------------ classification, retrieval, count


def _classification(prediction: str, answer: str, all_classes: Sequence[str]) -> float:
    # Classes named in the prediction; a class that is only a substring of the right one ("NUM" inside
    # "NUM:date") does not count against it. Credit is split among the classes named.
    named = [c for c in all_classes if c in prediction]
    named = [c for c in named if not (c in answer and c != answer)]
    return 1.0 / len(named) if answer in named else 0.0


def classification(prediction: str, answers: Sequence[str], all_classes: Sequence[str] | None = None,
                   **_: Any) -> float:
    if not all_classes:
        raise ZoomKVError("the classification metric needs all_classes (the list of valid labels)")
    return _best(prediction, answers, lambda p, a: _classification(p, a, all_classes))


def _share_equal(prediction: str, target: str) -> float:
    numbers = re.findall(r"\d+", prediction)
    return sum(n == target for n in numbers) / len(numbers) if numbers else 0.0


def _retrieval(prediction: str, answer: str, pattern: str) -> float:
    found = re.findall(pattern, answer)
    return _share_equal(prediction, found[0]) if found else 0.0


def retrieval(prediction: str, answers: Sequence[str], **_: Any) -> float:
    """The right paragraph number's share of all numbers in the prediction (gold: "Paragraph 7")."""
    return _best(prediction, answers, lambda p, a: _retrieval(p, a, r"Paragraph (\d+)"))


def retrieval_zh(prediction: str, answers: Sequence[str], **_: Any) -> float:
    return _best(prediction, answers, lambda p, a: _retrieval(p, a, r"段落(\d+)"))


def count(prediction: str, answers: Sequence[str], **_: Any) -> float:
    """The right count's share of all numbers in the prediction."""
    return _best(prediction, answers, lambda p, a: _share_equal(p, str(a).strip()))


# ------------------------------------------------------------------------------------------------ code


def _first_code_line(prediction: str) -> str:
    # The first line that is code, not a fence or a comment: models often open with ``` or an explanation.
    for line in prediction.lstrip("\n").split("\n"):
        if "`" not in line and "#" not in line and "//" not in line:
            return line
    return ""


def code_sim(prediction: str, answers: Sequence[str], **_: Any) -> float:
    line = _first_code_line(prediction)
    return _best(prediction, answers, lambda p, a: difflib.SequenceMatcher(None, line, a).ratio())


# ---------------------------------------------------------------------------------------- exact number

_NUMBER = r"-?\$?\d[\d,]*(?:\.\d+)?"


def extract_final_number(prediction: str) -> float | None:
    """The answer a worked solution ends with: after "The answer is" or "####", else its last number.

    Anything from a following "Question:" on is cut first: many-shot prompts invite the model to go
    on writing the next example.
    """
    text = re.split(r"\n\s*(?:Question|Q):", prediction)[0]
    for marker in (r"answer is\s*:?\s*(" + _NUMBER + ")", r"####\s*(" + _NUMBER + ")"):
        found = re.findall(marker, text, flags=re.IGNORECASE)
        if found:
            return parse_number(found[-1])
    numbers = re.findall(_NUMBER, text)
    return parse_number(numbers[-1]) if numbers else None


def exact_number(prediction: str, answers: Sequence[str], **_: Any) -> float:
    got = extract_final_number(prediction)
    if got is None:
        return 0.0
    for a in answers:
        want = parse_number(str(a))
        if want is not None and abs(got - want) < 1e-6 * max(1.0, abs(want)):
            return 100.0
    return 0.0


METRICS: dict[str, Metric] = {
    "string_match_all": string_match_all,
    "string_match_part": string_match_part,
    "qa_f1": qa_f1,
    "qa_f1_zh": qa_f1_zh,
    "rouge_l": rouge_l,
    "rouge_l_zh": rouge_l_zh,
    "classification": classification,
    "retrieval": retrieval,
    "retrieval_zh": retrieval_zh,
    "count": count,
    "code_sim": code_sim,
    "exact_number": exact_number,
}


def get_metric(name: str) -> Metric:
    if name not in METRICS:
        raise ZoomKVError(f"unknown metric {name!r}; valid metrics: {', '.join(METRICS)}")
    return METRICS[name]


def score(metric: str, prediction: str, answers: Sequence[str], all_classes: Sequence[str] | None = None) -> float:
    """``metric`` of ``prediction`` against ``answers``, on a 0–100 scale."""
    return float(get_metric(metric)(prediction, list(answers), all_classes=all_classes))
