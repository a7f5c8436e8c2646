"""Training data through ``datasets``: a recipe's ``data`` (a shipped corpus, a user's folder of text files,
a JSONL file), cut to the curriculum's lengths, with synthetic tasks inserted at their weights."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from zoomkv.data.haystack import text_haystack
from zoomkv.data.training import make_samples, parse_task_mix, task_sequence
from zoomkv.errors import ConfigError, ZoomKVError
from zoomkv.train.config import load_corpus, load_recipe

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "recipes" / "tiny-llama-sekv.yaml"
STORY = ("The lighthouse keeper climbed the stairs at dusk. She trimmed the wick and wound the clock. "
         "Ships passed far out in the fog, and she wrote each one in her book. ")


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from zoomkv.models import ensure_converted, get_model_spec

    return AutoTokenizer.from_pretrained(str(ensure_converted(get_model_spec("smollm2-135m"))))


@pytest.fixture()
def user_folder(tmp_path):
    folder = tmp_path / "my-docs"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text(STORY * 30)
    (folder / "sub" / "b.md").write_text(STORY.replace("lighthouse", "harbour") * 30)
    (folder / "notes.bin").write_bytes(b"\x00\xff")
    return folder


def test_task_mix_weights_and_errors():
    assert parse_task_mix("plain:2, passkey ,kv:0.5") == {"plain": 2.0, "passkey": 1.0, "kv": 0.5}
    seq = task_sequence({"plain": 2.0, "passkey": 1.0, "kv": 1.0}, 12, seed=3)
    assert sorted(seq) == sorted(["plain"] * 6 + ["passkey"] * 3 + ["kv"] * 3)
    assert seq == task_sequence({"plain": 2.0, "passkey": 1.0, "kv": 1.0}, 12, seed=3)  # seeded
    for spec, message in [("poems", "unknown training task 'poems'"), ("kv:x", "not a number"),
                          ("kv:0", "positive"), ("kv:-1", "positive"), ("kv:nan", "positive"), ("", "no training")]:
        with pytest.raises(ZoomKVError, match=message):
            parse_task_mix(spec)


def test_samples_are_corpus_text_with_tasks_inserted(tok):
    corpus = text_haystack("python-docs")
    samples = make_samples(tok, {"plain": 1.0, "passkey": 1.0, "vartrack": 1.0, "aggregate": 1.0}, 8, 512, 1024,
                           seed=0, corpus=corpus)
    assert sorted(s.task for s in samples) == ["aggregate"] * 2 + ["passkey"] * 2 + ["plain"] * 2 + ["vartrack"] * 2
    for s in samples:
        n = len(tok(s.text, add_special_tokens=False)["input_ids"])
        assert s.length - 8 <= n <= s.length, (s.task, n, s.length)  # cut to the curriculum's length
        if s.task == "plain":
            assert s.answer == "" and "pass key" not in s.text
        else:
            assert s.text.rstrip(".").endswith(s.answer)
    passkey = next(s for s in samples if s.task == "passkey")
    key = passkey.answer
    assert passkey.text.count(key) == 2  # the fact in the text, the answer after the question
    assert passkey.text.index(f"The pass key is {key}.") < passkey.text.rindex("What is the pass key?")
    again = make_samples(tok, {"plain": 1.0, "passkey": 1.0, "vartrack": 1.0, "aggregate": 1.0}, 8, 512, 1024,
                         seed=0, corpus=corpus)
    assert [s.text for s in again] == [s.text for s in samples]  # a resumed run sees the same data


def test_recipe_data_from_a_users_folder(tok, user_folder, tmp_path):
    cfg = load_recipe(TINY, [f"data={user_folder}", "tasks=plain:3,kv"])
    corpus = load_corpus(cfg)
    assert "harbour" in corpus.words and "lighthouse" in corpus.words
    samples = make_samples(tok, cfg.task_mix, 4, 200, 300, seed=1, corpus=corpus)
    assert [s.task for s in samples].count("plain") == 3
    assert all("keeper" in s.text for s in samples)
    rows = tmp_path / "docs.jsonl"
    rows.write_text("".join(json.dumps({"body": STORY * 20, "id": i}) + "\n" for i in range(3)))
    cfg = load_recipe(TINY, [f"data={rows}", "data_field=body"])
    assert load_corpus(cfg).words[:3] == ("The", "lighthouse", "keeper")


def test_bad_data_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match="'plain' needs a corpus"):
        load_recipe(TINY, ["data=", "tasks=plain"])
    with pytest.raises(ZoomKVError, match="data source not found"):
        load_corpus(load_recipe(TINY, [f"data={tmp_path / 'missing.jsonl'}"]))
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"body": STORY}) + "\n")
    with pytest.raises(ZoomKVError, match="no field 'text'; its fields: body"):
        load_corpus(load_recipe(TINY, [f"data={rows}"]))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "unterminated\n')
    with pytest.raises(ZoomKVError, match="cannot load data source"):
        load_corpus(load_recipe(TINY, [f"data={bad}"]))


@pytest.mark.heavy
def test_bad_data_through_the_cli_is_one_line(tmp_path):
    """``python -m zoomkv.train``: one line, exit 2, before any model loads."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"body": STORY}) + "\n")
    proc = subprocess.run([sys.executable, "-m", "zoomkv.train", "--recipe", str(TINY), f"data={rows}",
                           f"output_dir={tmp_path / 'out'}"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "no field 'text'" in proc.stderr.strip().splitlines()[-1]


def test_a_task_longer_than_the_curriculum_length_is_kept_whole():
    """The shipped tiny recipe asks for 128 tokens, which a byte tokenizer's vartrack question alone
    exceeds: the sample is the task without corpus text, not an error."""
    from tests.helpers import load_tiny

    _, byte_tok = load_tiny("tiny-llama")
    corpus = text_haystack("python-docs")
    samples = make_samples(byte_tok, {"vartrack": 1.0, "plain": 1.0}, 2, 128, 128, seed=0, corpus=corpus)
    vartrack = next(s for s in samples if s.task == "vartrack")
    assert vartrack.text.startswith("VAR ") and vartrack.text.endswith(vartrack.answer + ".")
    plain = next(s for s in samples if s.task == "plain")
    assert len(byte_tok(plain.text, add_special_tokens=False)["input_ids"]) <= 128
