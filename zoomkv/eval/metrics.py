"""Scoring functions, each ``metric(prediction, answers, **extra) -> score in [0, 100]``.

RULER's two substring metrics, LongBench's family (token F1 with SQuAD-style normalisation, ROUGE-L,
classification, passage retrieval and count, code edit similarity), LongBench-v2's and InfiniteBench's
multiple-choice accuracy and the exact-number metric of GSM8K-style reasoning. A sample is scored against
every reference answer and keeps the best, as LongBench's ``eval.py`` does; RULER's ``string_match_all``
instead needs every reference in the prediction.

The LongBench metrics follow the published implementation (THUDM/LongBench ``metrics.py``), written
anew here on maintained packages:

- ROUGE-L through the ``rouge`` package, the one LongBench calls, the same way (its ROUGE-L F; an error
  such as an empty prediction scores 0), so scores equal LongBench's own.
- Chinese text is segmented with jieba (``" ".join(jieba.cut(text))``) for ROUGE-L and token F1, as
  LongBench does.
- Code similarity is fuzzywuzzy's ``fuzz.ratio`` as LongBench installs it (without python-Levenshtein):
  difflib's ratio, rounded to a whole percent, 100 for equal strings, 0 when either is empty.
  (rapidfuzz is not a dependency; difflib is the same matcher fuzzywuzzy falls back on.)
- Classification keeps LongBench's quirk: a label that is only part of the right one is dropped while the
  list is walked, which skips the label after it.
"""

from __future__ import annotations

import difflib
import functools
import logging
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


def _best(prediction: str, answers: Sequence[str], one: Callable[[str, str], float]) -> float:
    return 100.0 * max((one(prediction, a) for a in answers), default=0.0)


@functools.lru_cache(maxsize=1)
def _jieba():
    """jieba, with its "Building prefix dict" banner (logged to stderr on first use) silenced."""
    import jieba

    jieba.setLogLevel(logging.WARNING)
    return jieba


def jieba_words(text: str) -> list[str]:
    """jieba's segmentation of ``text`` (accurate mode, HMM on: jieba's defaults, as LongBench calls it)."""
    return list(_jieba().cut(text, cut_all=False))


def qa_f1(prediction: str, answers: Sequence[str], **_: Any) -> float:
    return _best(prediction, answers, lambda p, a: _f1(normalize_answer(p).split(), normalize_answer(a).split()))


def _zh_tokens(text: str) -> list[str]:
    # LongBench: jieba words, each normalised (lowercase, no punctuation or whitespace), empty ones dropped
    return [w for w in (normalize_zh(t) for t in jieba_words(text)) if w]


def qa_f1_zh(prediction: str, answers: Sequence[str], **_: Any) -> float:
    return _best(prediction, answers, lambda p, a: _f1(_zh_tokens(p), _zh_tokens(a)))


@functools.lru_cache(maxsize=1)
def _rouge():
    from rouge import Rouge

    return Rouge(metrics=["rouge-l"])


def rouge_l_pair(prediction: str, reference: str) -> float:
    """LongBench's ``rouge_score`` of one pair in [0, 1]: the ``rouge`` package's ROUGE-L F, which LongBench
    calls; any error it raises (an empty prediction; a recursion limit on very long texts) scores 0, as
    LongBench's bare ``except`` does."""
    try:
        return float(_rouge().get_scores([prediction], [reference], avg=True)["rouge-l"]["f"])
    except Exception:  # LongBench: `except: return 0.0`
        return 0.0


def rouge_l(prediction: str, answers: Sequence[str], **_: Any) -> float:
    return _best(prediction, answers, rouge_l_pair)


def rouge_l_zh(prediction: str, answers: Sequence[str], **_: Any) -> float:
    """LongBench's ``rouge_zh_score``: both texts as jieba words joined by spaces, then ``rouge_l_pair``."""
    return _best(prediction, answers,
                 lambda p, a: rouge_l_pair(" ".join(jieba_words(p)), " ".join(jieba_words(a))))


# ------------------------------------------------------------------------ classification, retrieval, count


def _classification(prediction: str, answer: str, all_classes: Sequence[str]) -> float:
    # LongBench: the classes named in the prediction; a class that is only part of the right one ("NUM"
    # inside "NUM:date") is removed, but LongBench removes it from the list it is walking, so the class
    # right after a removed one is never checked and stays. Credit is split among the classes left.
    named = [c for c in all_classes if c in prediction]
    kept, skip_next = [], False
    for c in named:
        if skip_next:
            kept.append(c)
            skip_next = False
        elif c in answer and c != answer:
            skip_next = True
        else:
            kept.append(c)
    return 1.0 / len(kept) if answer in kept else 0.0


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


def fuzz_ratio(a: str, b: str) -> int:
    """fuzzywuzzy's ``fuzz.ratio`` (0.18, pure-Python matcher): 100 for equal strings, 0 if either is
    empty, else difflib's ratio as a whole percent (Python's round)."""
    if a == b:
        return 100
    if not a or not b:
        return 0
    return int(round(100 * difflib.SequenceMatcher(None, a, b).ratio()))


def code_sim(prediction: str, answers: Sequence[str], **_: Any) -> float:
    """LongBench's ``code_sim_score``: fuzz.ratio of the reply's first code line and the reference line."""
    line = _first_code_line(prediction)
    return _best(prediction, answers, lambda p, a: fuzz_ratio(line, a) / 100)


# ------------------------------------------------------------------------------------- multiple choice

_V2_ANSWER = (re.compile(r"The correct answer is \(([A-D])\)"), re.compile(r"The correct answer is ([A-D])"))


def extract_choice(prediction: str) -> str | None:
    """LongBench-v2's reading of a reply: the letter in "The correct answer is (X)", else in "The correct
    answer is X", with every "*" removed first (markdown bold); None when neither is there."""
    text = prediction.replace("*", "")
    for pattern in _V2_ANSWER:
        found = pattern.search(text)
        if found:
            return found.group(1)
    return None


def choice(prediction: str, answers: Sequence[str], **_: Any) -> float:
    """LongBench-v2's accuracy: 100 when the letter the reply states is the answer's letter."""
    return 100.0 if extract_choice(prediction) in {str(a).strip() for a in answers} else 0.0


_IB_PREFIXES = ("answer is:", "answer:", "answer is", "option is")


def _infbench_choice(prediction: str, label: Sequence[str]) -> bool:
    pred = prediction.strip()
    if not pred:
        return False
    if pred[0] in "ABCD":  # a reply that starts with a letter is that letter
        return pred[0] in label
    for c in "\n\"'.,?!{}":
        pred = pred.replace(c, " ")
    while "  " in pred:
        pred = pred.replace("  ", " ")
    for prefix in _IB_PREFIXES:  # else what follows the first answer phrase found
        at = pred.find(prefix)
        if at == -1:
            continue
        after = pred[at + len(prefix) + 1:]
        return bool(after) and any(after.startswith(s) for s in label)
    for word in pred.split():  # else the first word that is a letter
        if word in "ABCD":
            return word in label
    return False


def infbench_choice(prediction: str, answers: Sequence[str], **_: Any) -> float:
    """InfiniteBench's multiple-choice score (``longbook_choice_eng``): ``answers`` is the label, the right
    option's text and its letter; 100 when the reply picks it (see ``_infbench_choice`` for how)."""
    return 100.0 if _infbench_choice(prediction, [str(a) for a in answers]) else 0.0


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
    "choice": choice,
    "infbench_choice": infbench_choice,
}


def get_metric(name: str) -> Metric:
    if name not in METRICS:
        raise ZoomKVError(f"unknown metric {name!r}; valid metrics: {', '.join(METRICS)}")
    return METRICS[name]


def score(metric: str, prediction: str, answers: Sequence[str], all_classes: Sequence[str] | None = None) -> float:
    """``metric`` of ``prediction`` against ``answers``, on a 0–100 scale."""
    return float(get_metric(metric)(prediction, list(answers), all_classes=all_classes))
