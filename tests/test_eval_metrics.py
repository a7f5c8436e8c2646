"""Every metric against values worked out by hand (scores are on a 0-100 scale)."""

from __future__ import annotations

import pytest

from zoomkv.errors import ZoomKVError
from zoomkv.eval.metrics import (
    classification,
    clean_prediction,
    code_sim,
    count,
    exact_number,
    extract_final_number,
    normalize_answer,
    qa_f1,
    qa_f1_zh,
    retrieval,
    retrieval_zh,
    rouge_l,
    score,
    string_match_all,
    string_match_part,
)


@pytest.mark.parametrize("text,expected", [
    ("The Cat!", "cat"),                        # lowercase, punctuation, article
    ("An apple, a day.", "apple day"),          # every article goes, commas and full stop too
    ("the-end", "theend"),                      # punctuation goes first, so no article is left to remove
    ("anthem theatre", "anthem theatre"),       # articles only as whole words
    ("  hello \n\t world  ", "hello world"),    # whitespace collapses
    ("A", ""),
])
def test_normalize_answer_quirks(text, expected):
    assert normalize_answer(text) == expected


def test_qa_f1_by_hand():
    # pred tokens [cat, sat, on, mat], gold [cat, on, mat]: P = 3/4, R = 1, F1 = 6/7
    assert qa_f1("the cat sat on the mat", ["a cat on a mat"]) == pytest.approx(100 * 6 / 7)
    # repeated tokens count once per occurrence in both: P = 1/2, R = 1, F1 = 2/3
    assert qa_f1("cat cat", ["cat"]) == pytest.approx(100 * 2 / 3)
    # the best of several references
    assert qa_f1("Paris", ["London", "paris."]) == 100.0
    assert qa_f1("", ["x"]) == 0.0
    assert qa_f1("the", ["a"]) == 0.0  # both normalise to nothing


def test_rouge_l_by_hand():
    # LongBench scores ROUGE-L with the `rouge` package: summary level, whitespace words with case kept, each
    # distinct word counted once, F = 2PR / (P + R + 1e-8). [The cat sat on the mat.] against [the cat on the
    # mat]: distinct reference words {the, cat, on, mat} m = 4, distinct prediction words {The, cat, sat, on,
    # the, mat} n = 6, union LCS [cat on the mat] = 4: R = 1, P = 4/6, F = 0.8 (what LongBench reports)
    assert rouge_l("The cat sat on the mat.", ["the cat on the mat"]) == pytest.approx(80.0, abs=1e-5)
    # lower case: n = 5 distinct {the, cat, sat, on, mat}, LCS 4 distinct: R = 1, P = 4/5, F = 8/9
    assert rouge_l("the cat sat on the mat", ["the cat on the mat"]) == pytest.approx(100 * 8 / 9, abs=1e-5)
    # reversed order: LCS 1 of 4 both ways
    assert rouge_l("a b c d", ["d c b a"]) == pytest.approx(25.0, abs=1e-5)
    assert rouge_l("", ["a"]) == 0.0


def test_classification_splits_credit_and_ignores_substring_labels():
    classes = ["NUM:date", "NUM", "LOC"]
    assert classification("NUM:date", ["NUM:date"], all_classes=classes) == 100.0  # NUM is inside the answer
    assert classification("LOC or NUM:date", ["NUM:date"], all_classes=classes) == 50.0
    assert classification("LOC", ["NUM:date"], all_classes=classes) == 0.0
    with pytest.raises(ZoomKVError):
        classification("LOC", ["LOC"], all_classes=None)


def test_retrieval_and_count():
    assert retrieval("Paragraph 7", ["Paragraph 7"]) == 100.0
    assert retrieval("Paragraph 7 or Paragraph 12", ["Paragraph 7"]) == 50.0
    assert retrieval("no idea", ["Paragraph 7"]) == 0.0
    assert retrieval_zh("段落3", ["段落3"]) == 100.0
    assert count("There are 12 unique paragraphs, not 13", ["12"]) == 50.0
    assert count("12", ["12"]) == 100.0


def test_code_sim_takes_first_code_line():
    assert code_sim("```python\nx = foo(1)\n```", ["x = foo(1)"]) == 100.0
    # "return a+b" vs "return a + b": 10 matching characters of 10 + 12 → 2·10/22 = 90.9%, and fuzzywuzzy's
    # ratio (LongBench's) rounds to a whole percent: 91
    assert code_sim("# add them\nreturn a+b", ["return a + b"]) == 91.0
    assert code_sim("// only comments", ["x"]) == 0.0


def test_ruler_string_match():
    pred = "The numbers are 123 and 456."
    assert string_match_all(pred, ["123", "456", "789"]) == pytest.approx(200 / 3)
    assert string_match_part(pred, ["123", "789"]) == 100.0
    assert string_match_part(pred, ["789"]) == 0.0
    assert string_match_all("ABC-def", ["abc", "DEF"]) == 100.0  # case-insensitive
    assert clean_prediction("\x00 42\x01") == "42"


def test_exact_number():
    assert exact_number("So 5 + 3 = 8. The answer is 1,234.", ["1234"]) == 100.0
    assert exact_number("The answer is $18.00", ["18"]) == 100.0
    assert exact_number("she has 5 + 3 = 8 apples", ["8"]) == 100.0  # no marker: the last number
    assert exact_number("The answer is 7", ["8"]) == 0.0
    assert exact_number("nothing numeric", ["8"]) == 0.0
    # a many-shot model writing on into the next example is cut at "Question:"
    assert extract_final_number("It is 7.\n\nQuestion: what is 9 + 1?") == 7.0
    assert extract_final_number("#### -3") == -3.0


def test_chinese_f1_uses_jieba_words():
    # LongBench segments with jieba: 北京大学。 → [北京大学, 。] → [北京大学] after punctuation; 北京 → [北京]:
    # no word in common, F1 = 0 (splitting characters would have given 2/3)
    assert qa_f1_zh("北京大学。", ["北京"]) == 0.0
    # 我爱北京天安门。 → [我, 爱, 北京, 天安门]; 我爱北京 → [我, 爱, 北京]: P = 3/4, R = 1, F1 = 6/7
    assert qa_f1_zh("我爱北京天安门。", ["我爱北京"]) == pytest.approx(100 * 6 / 7)


def test_score_dispatch():
    assert score("qa_f1", "Paris", ["paris"]) == 100.0
    with pytest.raises(ZoomKVError, match="valid metrics"):
        score("bleu", "a", ["a"])


def test_metric_registry_matches_the_names_data_files_may_use():
    # the data readers (zoomkv.data) validate a record's metric against METRIC_NAMES without importing eval
    from zoomkv.data.sample import METRIC_NAMES
    from zoomkv.eval.metrics import METRICS

    assert tuple(METRICS) == METRIC_NAMES


def test_wilson_interval_matches_the_published_formula():
    from zoomkv.eval.summary import wilson

    # Wilson (1927) / Agresti & Coull (1998): 8 of 10 → [0.490, 0.943]; 0 of 10 → [0, 0.278]; 10 of 10 → [0.722, 1]
    lo, hi = wilson(0.8, 10)
    assert abs(lo - 0.4902) < 1e-3 and abs(hi - 0.9433) < 1e-3
    assert wilson(0.0, 10)[0] == 0.0 and abs(wilson(0.0, 10)[1] - 0.2775) < 1e-3
    assert abs(wilson(1.0, 10)[0] - 0.7225) < 1e-3 and abs(wilson(1.0, 10)[1] - 1.0) < 1e-9


def test_summary_says_when_rows_hold_different_samples():
    from zoomkv.eval.summary import aggregate, markdown

    def row(method, sample, score):
        return {"method": method, "budget": "64" if method != "full" else None, "task": "t", "length": 100,
                "sample": sample, "score": score, "device_bytes": 1, "host_bytes": 0, "full_kv_bytes": 2,
                "decode_ms_per_token": 1.0, "prefill_s": 0.1}

    even = [row("full", i, 100.0) for i in range(3)] + [row("snapkv", i, 0.0) for i in range(3)]
    assert "not a like-for-like" not in markdown(aggregate(even), even, {})
    uneven = even[:-1]  # snapkv resumed short of full's samples
    text = markdown(aggregate(uneven), uneven, {})
    assert "not a like-for-like" in text and "n=2" in text
