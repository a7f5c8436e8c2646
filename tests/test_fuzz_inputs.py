"""Bad input, generated (issue 15): a table of cases over every command's arguments, recipe YAML, adapter
configs and JSONL eval records. Each runs in this process through ``zoomkv.cli.main`` (tiny models) and
must either succeed (exit 0) or exit 2 with exactly one line on stderr that names the problem; none may
print a traceback, and loading an adapter config never allocates more than the weights it names.

A case is ``(id, argv, expect)``: ``expect`` is ``"ok"`` (must succeed), a substring the one error line must
hold, or ``None`` (either outcome is fine; when it fails, the one-line rule still holds). ``{name}`` in an
argument is a file from the ``files`` fixture (see ``FILES``); ``{out}`` a fresh, not yet existing path.
"""

from __future__ import annotations

import io
import json
import re
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from zoomkv.cli import main

ROOT = Path(__file__).resolve().parents[1]
TINY_RECIPE = ROOT / "recipes" / "tiny-llama-sekv.yaml"

# -- the harness ------------------------------------------------------------------------------------------

BINARY = bytes(range(256)) * 8 + b"\x00\xff\xfe" * 100
LATIN1 = "Caf\u00e9 cr\u00e8me, the pass key is 71934. ".encode("latin-1") * 8
PROMPT = "The pass key is 71934. Remember it. " + "Grass is green, the sky is blue. " * 6 + "The pass key is"


def _readonly(tmp: Path) -> Path:
    """A folder nothing can be written under (as root a mode does not stop writes: /sys refuses them)."""
    folder = tmp / "readonly"
    folder.mkdir()
    folder.chmod(0o555)
    probe = folder / "probe"
    try:
        probe.mkdir()
    except OSError:
        return folder
    probe.rmdir()
    return Path("/sys/zoomkv-fuzz")


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    tmp = tmp_path_factory.mktemp("fuzz")
    made: dict[str, Any] = {
        "text": PROMPT, "binary": BINARY, "latin1": LATIN1, "empty": "", "blank": "  \n\t\n",
        "existing": "a file where a folder should be",
    }
    out = {}
    for name, content in made.items():
        path = tmp / f"{name}.txt"
        path.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
        out[name] = str(path)
    out["missing"] = str(tmp / "no-such-file.txt")
    (tmp / "folder").mkdir()
    out["dir"] = str(tmp / "folder")
    out["readonly"] = str(_readonly(tmp) / "out")
    out["tmp"] = str(tmp)
    return out


class Case:
    """One fuzz case: the arguments, what is expected, optional stdin."""

    def __init__(self, id: str, argv: list[str], expect: str | None, stdin: str | bytes = ""):
        self.id, self.argv, self.expect, self.stdin = id, argv, expect, stdin

    def __repr__(self) -> str:
        return self.id


def _fill(argv: list[str], files: dict[str, str], out: str) -> list[str]:
    return [a.format(out=out, **files) for a in argv]


# Progress on stderr is not an error report: bench's stage lines ("[bench    0.1s] loading ...") and progress bars.
PROGRESS = re.compile(r"^\[bench +[\d.]+s\] |\d+%\||\d+/\d+ \[[\d:<?]+")
CASE_SECONDS = 60  # a huge number accepted would run for ever: the case fails instead


class CaseTooLong(Exception):
    pass


def _too_long(signum, frame):
    raise CaseTooLong(f"still running after {CASE_SECONDS} s (a huge value accepted?)")


def run_case(argv: list[str], expect: str | None, capsys, monkeypatch, stdin: str | bytes = "") -> tuple[int, str]:
    """Run ``zoomkv ARGV`` here; check the outcome against the one-line rule and ``expect``."""
    stream = io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8") if isinstance(stdin, bytes) else io.StringIO(stdin)
    monkeypatch.setattr(sys, "stdin", stream)
    previous = signal.signal(signal.SIGALRM, _too_long)
    signal.alarm(CASE_SECONDS)
    try:
        code = main(argv)
    except SystemExit as done:  # argparse
        code = done.code
    except BaseException as err:  # the bug this file looks for: it would have been a traceback
        pytest.fail(f"zoomkv {' '.join(argv)[:300]}: traceback ({type(err).__name__}: {str(err)[:500]})")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err, captured.err[-2000:]
    assert code in (0, 2), (code, captured.err[-2000:])
    if code == 2:
        lines = [line for line in re.split(r"[\r\n]", captured.err) if line.strip() and not PROGRESS.search(line)]
        assert len(lines) == 1, f"zoomkv {' '.join(argv)[:300]}: {len(lines)} lines on stderr:\n{captured.err[-2000:]}"
        assert "error" in lines[0]
        assert expect != "ok", f"zoomkv {' '.join(argv)[:300]}: expected to succeed: {lines[0]}"
        if expect not in (None, "ok"):
            assert expect in lines[0], lines[0]
        return code, lines[0]
    assert expect in (None, "ok") or not expect, f"zoomkv {' '.join(argv)[:300]} succeeded; expected {expect!r}"
    return code, captured.err


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    """No case reaches the network: the Hub is offline for every load and push."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.chdir(ROOT)


def cases(command: list[str], table: list[tuple]) -> list[Case]:
    out = []
    for row in table:
        id, args, expect, *rest = row
        out.append(Case(f"{' '.join(command[:1])}:{id}", [*command, *args], expect, *rest))
    return out


# -- (a) every command's arguments ------------------------------------------------------------------------

TINY = ["--model", "tiny-llama", "--chat", "off"]
GEN = ["generate", *TINY, "--max-new-tokens", "2"]
GEN_P = [*GEN, "--prompt", PROMPT]
COMPRESS = ["--method", "snapkv", "--budget", "64"]

# The numbers every int option is tried with: (value, what the error names or None for "either").
INT_VALUES = [("abc", "invalid int"), ("2.5", "invalid int"), ("", "invalid int"), ("nan", "invalid int"),
              ("-1", None), ("0", None), ("99999999999999999999", None)]

GENERATE = cases(GEN, [
    ("ok", ["--prompt", PROMPT], "ok"),
    ("ok-snapkv", ["--prompt", PROMPT, *COMPRESS], "ok"),
    ("unknown-method", ["--prompt", PROMPT, "--method", "nope"], "unknown method 'nope'"),
    ("empty-method", ["--prompt", PROMPT, "--method", ""], "method"),
    ("unknown-model", ["--prompt", PROMPT, "--model", "no-such-model"], "no-such-model"),
    ("model-dotdot", ["--prompt", PROMPT, "--model", "a/.."], "a/.."),
    ("model-missing-path", ["--prompt", PROMPT, "--model", "{missing}"], "no-such-file"),
    ("model-empty-dir", ["--prompt", PROMPT, "--model", "{dir}"], "folder"),
    ("model-binary-file", ["--prompt", PROMPT, "--model", "{binary}"], "binary"),
    ("budget-word", ["--prompt", PROMPT, "--method", "snapkv", "--budget", "lots"], "budget"),
    ("budget-zero", ["--prompt", PROMPT, "--method", "snapkv", "--budget", "0"], "budget"),
    ("budget-negative", ["--prompt", PROMPT, "--method", "snapkv", "--budget", "-5"], "budget"),
    ("budget-nan", ["--prompt", PROMPT, "--method", "snapkv", "--budget", "nan"], "budget"),
    ("budget-inf", ["--prompt", PROMPT, "--method", "snapkv", "--budget", "inf"], "budget"),
    ("budget-huge", ["--prompt", PROMPT, "--method", "snapkv", "--budget", "1e30"], "budget"),
    ("budget-huge-int", ["--prompt", PROMPT, "--method", "snapkv", "--budget", "9" * 40], "budget"),
    ("budget-fraction-over-1", ["--prompt", PROMPT, "--method", "snapkv", "--budget", "1.5"], "budget"),
    ("budget-fraction-tiny", ["--prompt", PROMPT, "--method", "oracle_topk", "--budget", "1e-9"], None),
    ("budget-missing", ["--prompt", PROMPT, "--method", "snapkv"], "needs a budget"),
    ("budget-for-full", ["--prompt", PROMPT, "--budget", "32"], "takes no budget"),  # held by nothing (issue 32)
    ("budget-for-full-named", ["--prompt", PROMPT, "--method", "full", "--budget", "8"], "takes no budget"),
    ("adapter-empty", ["--prompt", PROMPT, "--adapter", ""], "empty"),
    ("method-arg-abc", ["--prompt", PROMPT, "--method", "quest", "--budget", "32", "--method-arg", "page_size=abc"],
     "page_size"),
    ("method-arg-float", ["--prompt", PROMPT, "--method", "quest", "--budget", "32", "--method-arg", "page_size=2.5"],
     "page_size"),
    ("method-arg-bool", ["--prompt", PROMPT, "--method", "quest", "--budget", "32", "--method-arg", "page_size=true"],
     "page_size"),
    ("method-arg-negative", ["--prompt", PROMPT, "--method", "quest", "--budget", "32",
                             "--method-arg", "page_size=-4"], "page_size"),
    ("method-arg-zero", ["--prompt", PROMPT, "--method", "quest", "--budget", "32", "--method-arg", "page_size=0"],
     "page_size"),
    ("method-arg-huge", ["--prompt", PROMPT, "--method", "quest", "--budget", "32",
                         "--method-arg", "page_size=99999999999999999999"], None),
    ("method-arg-nan", ["--prompt", PROMPT, "--method", "snapkv", "--budget", "32", "--method-arg", "window=.nan"],
     "window"),
    ("method-arg-list", ["--prompt", PROMPT, "--method", "snapkv", "--budget", "32", "--method-arg", "window=[8]"],
     "window"),
    ("method-arg-map", ["--prompt", PROMPT, "--method", "snapkv", "--budget", "32", "--method-arg", "window={{a: 1}}"],
     "window"),
    ("method-arg-bad-yaml", ["--prompt", PROMPT, "--method", "snapkv", "--budget", "32", "--method-arg", "window=[8"],
     "window"),
    ("method-arg-yaml-tag", ["--prompt", PROMPT, "--method", "snapkv", "--budget", "32",
                             "--method-arg", "window=!!python/object/apply:os.system [ls]"], "window"),
    ("method-arg-no-eq", ["--prompt", PROMPT, "--method", "snapkv", "--budget", "32", "--method-arg", "window"],
     "key=value"),
    ("method-arg-empty-key", ["--prompt", PROMPT, "--method", "snapkv", "--budget", "32", "--method-arg", "=8"],
     None),
    ("method-arg-unknown", ["--prompt", PROMPT, "--method", "snapkv", "--budget", "32", "--method-arg", "nope=1"],
     "nope"),
    ("method-arg-empty-value", ["--prompt", PROMPT, "--method", "snapkv", "--budget", "32",
                                "--method-arg", "window="], "window"),
    ("method-arg-for-full", ["--prompt", PROMPT, "--method-arg", "window=8"], "window"),
    ("prompt-empty", ["--prompt", ""], "empty"),
    ("prompt-file-missing", ["--prompt-file", "{missing}"], "not found"),
    ("prompt-file-binary", ["--prompt-file", "{binary}"], "not UTF-8"),
    ("prompt-file-latin1", ["--prompt-file", "{latin1}"], "UTF-8"),
    ("prompt-file-empty", ["--prompt-file", "{empty}"], "empty"),
    ("prompt-file-blank", ["--prompt-file", "{blank}"], "empty"),
    ("prompt-file-dir", ["--prompt-file", "{dir}"], "prompt file"),
    ("prompt-file-ok", ["--prompt-file", "{text}"], "ok"),
    ("prompt-and-file", ["--prompt", "x", "--prompt-file", "{text}"], "not allowed with"),
    ("prompt-too-long", ["--prompt", "a" * 5000], "5000"),
    ("max-new-huge", ["--prompt", PROMPT, "--max-new-tokens", "99999999999999999999"], "new tokens"),
    ("max-new-negative", ["--prompt", PROMPT, "--max-new-tokens", "-1"], "max_new_tokens"),
    ("max-new-zero", ["--prompt", PROMPT, "--max-new-tokens", "0"], None),
    ("max-new-abc", ["--prompt", PROMPT, "--max-new-tokens", "abc"], "invalid int"),
    ("prefill-chunk-zero", ["--prompt", PROMPT, *COMPRESS, "--prefill-chunk", "0"], "prefill"),
    ("prefill-chunk-negative", ["--prompt", PROMPT, *COMPRESS, "--prefill-chunk", "-8"], "prefill"),
    ("prefill-chunk-huge", ["--prompt", PROMPT, *COMPRESS, "--prefill-chunk", "99999999999999999999"], None),
    ("prefill-chunk-abc", ["--prompt", PROMPT, "--prefill-chunk", "abc"], "invalid int"),
    ("prefill-chunk-ok", ["--prompt", PROMPT, *COMPRESS, "--prefill-chunk", "8"], "ok"),
    ("kv-quant-bad", ["--prompt", PROMPT, "--kv-quant", "int3"], "unknown KV quantization"),
    ("kv-quant-ok", ["--prompt", PROMPT, *COMPRESS, "--kv-quant", "int4"], "ok"),
    ("kv-quant-all-tiers", ["--prompt", PROMPT, *COMPRESS, "--kv-quant", "int8", "--kv-quant-tiers", "all"],
     "kv-quant-tiers"),
    ("chat-bad", ["--prompt", PROMPT, "--chat", "maybe"], "invalid choice"),
    ("dtype-bad", ["--prompt", PROMPT, "--dtype", "float7"], "float7"),
    ("dtype-empty", ["--prompt", PROMPT, "--dtype", ""], "dtype"),
    ("device-bad", ["--prompt", PROMPT, "--device", "gpu9"], "gpu9"),
    ("device-cuda7", ["--prompt", PROMPT, "--device", "cuda:7"], "cuda:7"),
    ("device-negative", ["--prompt", PROMPT, "--device", "cuda:-1"], "cuda:-1"),
    ("adapter-missing", ["--prompt", PROMPT, "--adapter", "{missing}"], "no-such-file"),
    ("adapter-dotdot", ["--prompt", PROMPT, "--adapter", "a/.."], "a/.."),
    ("adapter-file", ["--prompt", PROMPT, "--adapter", "{binary}"], "binary"),
    ("adapter-empty-dir", ["--prompt", PROMPT, "--adapter", "{dir}"], "adapter_config.json"),
    ("unknown-flag", ["--prompt", PROMPT, "--bogus"], "unrecognized arguments"),
    ("json", ["--prompt", PROMPT, "--json", "--method", "quest", "--budget", "64", "--tail-summary"], "ok"),
    ("tail-summary-eviction", ["--prompt", PROMPT, *COMPRESS, "--tail-summary"], "tail_summary"),
])

CHAT_BASE = ["chat", *TINY, "--max-new-tokens", "2"]
CHAT = cases(CHAT_BASE, [
    ("ok", ["--context-file", "{text}", *COMPRESS], "ok", "What is the pass key?\n/memory\n\n/quit\n"),
    ("no-context", [], "--context-file"),
    ("context-missing", ["--context-file", "{missing}"], "not found"),
    ("context-binary", ["--context-file", "{binary}"], "not UTF-8"),
    ("context-latin1", ["--context-file", "{latin1}"], "UTF-8"),
    ("context-empty", ["--context-file", "{empty}"], "empty"),
    ("context-dir", ["--context-file", "{dir}"], "context file"),
    ("unknown-method", ["--context-file", "{text}", "--method", "nope"], "unknown method"),
    ("budget-bad", ["--context-file", "{text}", "--method", "snapkv", "--budget", "-3"], "budget"),
    ("method-arg-bad", ["--context-file", "{text}", *COMPRESS, "--method-arg", "window=abc"], "window"),
    ("method-arg-bad-yaml", ["--context-file", "{text}", *COMPRESS, "--method-arg", "window={{"], "window"),
    ("max-new-negative", ["--context-file", "{text}", "--max-new-tokens", "-5"], "max_new_tokens"),
    ("max-new-huge", ["--context-file", "{text}", "--max-new-tokens", "99999999999999999999"], "new tokens"),
    ("prefill-chunk-zero", ["--context-file", "{text}", *COMPRESS, "--prefill-chunk", "0"], "prefill"),
    ("adapter-missing", ["--context-file", "{text}", "--adapter", "{missing}"], "no-such-file"),
    ("binary-question", ["--context-file", "{text}", *COMPRESS], "UTF-8", b"\xff\x00\x01 what?\n"),
    # undecodable bytes as a surrogateescape stdin hands them over: refused as --context-file refuses them (issue 43)
    ("surrogate-question", ["--context-file", "{text}", *COMPRESS], "UTF-8", "\udcff\x00\x01 what?\n"),
    ("long-question", ["--context-file", "{text}", *COMPRESS], None, "why " * 3000 + "\n"),
])

BENCH_BASE = ["bench", "--model", "tiny-llama", "--new-tokens", "2", "--repeats", "1", "--no-warmup"]
BENCH = cases(BENCH_BASE, [
    ("ok", ["--length", "64", "--methods", "snapkv", "--budgets", "64"], "ok"),
    ("length-negative", ["--length", "-5"], "length"),
    ("length-zero", ["--length", "0"], "length"),
    ("length-huge", ["--length", "99999999999999999999"], "length"),
    ("length-abc", ["--length", "abc"], "invalid int"),
    ("new-tokens-negative", ["--length", "64", "--new-tokens", "-1"], "new-tokens"),
    ("new-tokens-huge", ["--length", "64", "--new-tokens", "99999999999999999999"], "new-tokens"),
    ("repeats-zero", ["--length", "64", "--repeats", "0"], "repeats"),
    ("repeats-negative", ["--length", "64", "--repeats", "-3"], "repeats"),
    ("budgets-word", ["--length", "64", "--methods", "snapkv", "--budgets", "lots"], "budget"),
    ("budgets-empty", ["--length", "64", "--methods", "snapkv", "--budgets", ","], "budget"),
    ("budgets-negative", ["--length", "64", "--methods", "snapkv", "--budgets", "-1"], "budget"),
    ("methods-unknown", ["--length", "64", "--methods", "nope"], "unknown method"),
    ("prefill-chunk-word", ["--length", "64", "--prefill-chunk", "abc"], "prefill"),
    ("prefill-chunk-zero", ["--length", "64", "--prefill-chunk", "0"], "prefill"),
    ("prefill-chunk-negative", ["--length", "64", "--prefill-chunk", "-4"], "prefill"),
    ("model-unknown", ["--length", "64", "--model", "nope"], "nope"),
    ("dtype-bad", ["--length", "64", "--dtype", "int3"], "int3"),
    ("batch-size-huge", ["--length", "64", "--batch-size", "100000000"], "--batch-size 100000000"),
    ("device-bad", ["--length", "64", "--device", "cuda:7"], "cuda:7"),
])

EVAL_BASE = ["eval", "--model", "tiny-llama", "--samples", "1", "--length", "512", "--max-new-tokens", "2",
             "--no-plots", "--quiet", "--tasks", "niah_single_1"]
EVAL = cases(EVAL_BASE, [
    ("ok", ["--methods", "snapkv", "--budgets", "64", "--out", "{out}"], "ok"),
    ("no-out", [], "--out"),
    ("out-existing-file", ["--out", "{existing}"], "is a file"),
    ("out-readonly", ["--out", "{readonly}"], "cannot write"),
    ("out-under-file", ["--out", "{existing}/sub"], "is a file"),
    ("samples-zero", ["--samples", "0", "--out", "{out}"], "samples"),
    ("samples-negative", ["--samples", "-2", "--out", "{out}"], "samples"),
    ("samples-huge", ["--samples", "99999999999999999999", "--out", "{out}"], "samples"),
    ("samples-abc", ["--samples", "abc", "--out", "{out}"], "invalid int"),
    ("length-word", ["--length", "abc", "--out", "{out}"], "--length"),
    ("length-negative", ["--length", "-5", "--out", "{out}"], "length"),
    ("length-zero", ["--length", "0", "--out", "{out}"], "length"),
    ("length-huge", ["--length", "99999999999999999999", "--out", "{out}"], "length"),
    ("length-empty", ["--length", ",", "--out", "{out}"], "--length"),
    ("budgets-word", ["--methods", "snapkv", "--budgets", "lots", "--out", "{out}"], "budget"),
    ("budgets-negative", ["--methods", "snapkv", "--budgets", "-8", "--out", "{out}"], "budget"),
    ("budgets-missing", ["--methods", "snapkv", "--out", "{out}"], "budget"),
    ("methods-unknown", ["--methods", "nope", "--budgets", "8", "--out", "{out}"], "unknown method"),
    ("tasks-unknown", ["--tasks", "nope", "--out", "{out}"], "nope"),
    ("tasks-empty", ["--tasks", ",", "--out", "{out}"], None),
    ("batch-zero", ["--batch-size", "0", "--out", "{out}"], "batch-size"),
    ("batch-negative", ["--batch-size", "-1", "--out", "{out}"], "batch-size"),
    ("batch-huge", ["--batch-size", "99999999999999999999", "--out", "{out}"], None),
    ("seed-negative", ["--seed", "-1", "--out", "{out}"], None),
    ("seed-huge", ["--seed", "99999999999999999999", "--out", "{out}"], None),
    ("threads-negative", ["--threads", "-2", "--out", "{out}"], "threads"),
    ("threads-huge", ["--threads", "99999999999999999999", "--out", "{out}"], "threads"),
    ("max-new-negative", ["--max-new-tokens", "-3", "--out", "{out}"], "max-new-tokens"),
    ("max-new-huge", ["--max-new-tokens", "99999999999999999999", "--out", "{out}"], "--max-new-tokens"),
    ("prefill-chunk-zero", ["--methods", "snapkv", "--budgets", "64", "--prefill-chunk", "0", "--out", "{out}"],
     "prefill"),
    ("grid-lengths-word", ["--grid-lengths", "abc", "--out", "{out}"], "--grid-lengths"),
    ("grid-lengths-negative", ["--tasks", "", "--grid-lengths", "-64", "--out", "{out}"], "length"),
    ("grid-depths-out-of-range", ["--tasks", "", "--grid-lengths", "512", "--grid-depths", "2", "--out", "{out}"],
     "depth"),
    ("grid-depths-nan", ["--tasks", "", "--grid-lengths", "512", "--grid-depths", "nan", "--out", "{out}"], "depth"),
    ("grid-depths-word", ["--tasks", "", "--grid-lengths", "512", "--grid-depths", "x", "--out", "{out}"],
     "--grid-depths"),
    ("method-args-bad", ["--methods", "snapkv", "--budgets", "64", "--method-args", "snapkv.window=abc",
                         "--out", "{out}"], "window"),
    ("method-args-bad-yaml", ["--methods", "snapkv", "--budgets", "64", "--method-args", "snapkv.window=[1",
                              "--out", "{out}"], "window"),
    ("method-args-unscoped", ["--methods", "snapkv", "--budgets", "64", "--method-args", "nope=8",
                              "--out", "{out}"], "nope"),
    ("method-args-other-method", ["--methods", "snapkv", "--budgets", "64", "--method-args", "quest.page_size=8",
                                  "--out", "{out}"], "quest"),
    ("method-args-unknown-method", ["--methods", "snapkv", "--budgets", "64", "--method-args", "nope.x=1",
                                    "--out", "{out}"], "nope"),
    # niah_single_1 reads no haystack: a bad one is refused all the same (issue 32)
    ("haystack-missing", ["--tasks", "niah_single_1", "--haystack", "{missing}", "--out", "{out}"], "--haystack"),
    ("haystack-binary", ["--tasks", "niah_single_1", "--haystack", "{binary}", "--out", "{out}"], "--haystack"),
    ("haystack-missing-essay", ["--tasks", "niah_single_2", "--haystack", "{missing}", "--out", "{out}"],
     "--haystack"),
    ("adapter-missing", ["--adapter", "{missing}", "--out", "{out}"], "no-such-file"),
    ("adapter-dotdot", ["--adapter", "a/..", "--out", "{out}"], "a/.."),
    ("data-format-bad", ["--data", "{text}", "--data-format", "csvx", "--out", "{out}"], "invalid choice"),
    ("protocol-bad", ["--protocol", "both", "--out", "{out}"], "invalid choice"),
    ("dtype-bad", ["--dtype", "float7", "--out", "{out}"], "float7"),
    ("device-bad", ["--device", "cuda:7", "--out", "{out}"], "cuda:7"),
])

EXPORT = cases(["export"], [
    ("missing", ["{missing}", "--out", "{out}"], "no-such-file"),
    ("file", ["{binary}", "--out", "{out}"], "binary"),
    ("empty-dir", ["{dir}", "--out", "{out}"], "adapter_config.json"),
    ("dotdot", ["a/..", "--out", "{out}"], None),
    ("no-args", [], "CHECKPOINT"),
])

PUSH = cases(["push"], [
    ("missing", ["{missing}", "--repo-id", "me/x"], "no-such-file"),
    ("file", ["{binary}", "--repo-id", "me/x"], "binary"),
    ("empty-dir", ["{dir}", "--repo-id", "me/x"], "adapter_config.json"),
    ("no-repo", ["{dir}"], "--repo-id"),
])

CK = ["compresskv", "--model", "tiny-llama", "--samples", "1", "--length", "64", "--out", "{out}"]
IG = ["infinigen", "--model", "tiny-llama", "--tokens", "64", "--output", "{out}"]
CALIBRATE = cases(["calibrate"], [
    ("no-profile", [], "required"),
    ("unknown-profile", ["nope"], "invalid choice"),
    ("compresskv-no-model", ["compresskv"], "--model"),
    ("compresskv-unknown-model", ["compresskv", "--model", "nope"], "nope"),
    ("compresskv-samples-zero", [*CK, "--samples", "0"], "samples"),
    ("compresskv-samples-huge", [*CK, "--samples", "99999999999999999999"], "samples"),
    ("compresskv-length-negative", [*CK, "--length", "-1"], "length"),
    ("compresskv-length-huge", [*CK, "--length", "99999999999999999999"], "length"),
    ("compresskv-top-heads-zero", [*CK, "--top-heads", "0"], "top-heads"),
    ("compresskv-error-budget-negative", [*CK, "--error-budget", "-4"], "error-budget"),
    ("compresskv-window-zero", [*CK, "--window", "0"], "window"),
    ("compresskv-kernel-zero", [*CK, "--kernel-size", "0"], "kernel-size"),
    ("compresskv-answer-negative", [*CK, "--answer-tokens", "-2"], "answer-tokens"),
    ("compresskv-out-dir", [*CK, "--out", "{dir}"], "folder"),
    ("compresskv-out-readonly", [*CK, "--out", "{readonly}"], None),
    ("infinigen-tokens-zero", [*IG, "--tokens", "0"], "tokens"),
    ("infinigen-tokens-huge", [*IG, "--tokens", "99999999999999999999"], "tokens"),
    ("infinigen-ratio-negative", [*IG, "--partial-ratio", "-0.5"], "partial-ratio"),
    ("infinigen-ratio-nan", [*IG, "--partial-ratio", "nan"], "partial-ratio"),
    ("infinigen-ratio-word", [*IG, "--partial-ratio", "x"], "invalid float"),
    ("infinigen-text-binary", [*IG, "--text-file", "{binary}"], "not UTF-8"),
    ("infinigen-text-missing", [*IG, "--text-file", "{missing}"], "not found"),
    ("infinigen-text-latin1", [*IG, "--text-file", "{latin1}"], "UTF-8"),
    ("infinigen-text-short", [*IG, "--text-file", "{text}"], "ok"),
    ("infinigen-output-readonly", [*IG, "--output", "{readonly}"], None),
    ("infinigen-output-dir", [*IG, "--output", "{dir}"], "folder"),
])

LISTS = cases([], [
    ("models", ["models"], "ok"),
    ("models-extra", ["models", "x"], "unrecognized arguments"),
    ("methods", ["methods"], "ok"),
    ("methods-one", ["methods", "quest"], "ok"),
    ("methods-unknown", ["methods", "nope"], "unknown method"),
    ("methods-empty", ["methods", ""], None),
    ("no-command", [], "required"),
    ("unknown-command", ["nope"], "invalid choice"),
])

# Every int option of every command with every bad number: an error names the option, or it runs.
INT_OPTIONS = [
    (GEN_P, "--max-new-tokens"), (GEN_P + COMPRESS, "--prefill-chunk"),
    (BENCH_BASE + ["--length", "64"], "--new-tokens"), (BENCH_BASE + ["--length", "64"], "--repeats"),
    (BENCH_BASE, "--length"),
    (EVAL_BASE + ["--out", "{out}"], "--samples"), (EVAL_BASE + ["--out", "{out}"], "--batch-size"),
    (EVAL_BASE + ["--out", "{out}"], "--threads"), (EVAL_BASE + ["--out", "{out}"], "--max-new-tokens"),
]
INTS = [Case(f"int:{base[0]}{flag}={value or 'empty'}", [*base, flag, value],
             expect)
        for base, flag in INT_OPTIONS for value, expect in INT_VALUES]

CLI_CASES = GENERATE + CHAT + BENCH + EVAL + EXPORT + PUSH + CALIBRATE + LISTS + INTS


@pytest.mark.parametrize("case", CLI_CASES, ids=repr)
def test_cli_arguments(case, files, tmp_path, capsys, monkeypatch):
    code, _ = run_case(_fill(case.argv, files, str(tmp_path / "out")), case.expect, capsys, monkeypatch, case.stdin)
    if case.expect == "ok":
        assert code == 0


# -- (b) recipe YAML --------------------------------------------------------------------------------------

RECIPE = TINY_RECIPE.read_text(encoding="utf-8")


def _recipe_with(**changes: str) -> str:
    """The tiny recipe with ``key: value`` lines replaced (or added); a value of None drops the key."""
    lines = [line for line in RECIPE.splitlines() if line.split(":")[0].strip() not in changes]
    return "\n".join(lines + [f"{k}: {v}" for k, v in changes.items() if v is not None]) + "\n"


LAUGHS = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 9)}]\n" for i in range(8))

# (id, the recipe file's content, expected)
RECIPE_CASES = [
    ("ok", RECIPE, "ok"),
    ("ok-overrides-file", _recipe_with(lr="0.01", steps="3"), "ok"),
    ("malformed-flow", RECIPE + "lr: [0.1\n", "recipe"),
    ("malformed-indent", RECIPE + "  bad: indent\n x: 1\n", "recipe"),
    ("malformed-tab", RECIPE + "\tlr: 0.1\n", "recipe"),
    ("malformed-quote", RECIPE + "run_name: 'unterminated\n", "recipe"),
    ("malformed-colons", ": : :\n", "recipe"),
    ("yaml-python-tag", RECIPE + "lr: !!python/object/apply:os.system [ls]\n", "recipe"),
    ("yaml-unknown-tag", RECIPE + "lr: !custom 1\n", "recipe"),
    ("yaml-billion-laughs", RECIPE + LAUGHS, "recipe"),
    ("yaml-deep-nesting", RECIPE + "lr: " + "[" * 5000 + "]" * 5000 + "\n", "recipe"),
    ("yaml-two-documents", RECIPE + "---\nlr: 0.1\n", "recipe"),
    ("top-level-list", "- model\n- method\n", "mapping"),
    ("top-level-string", "just some words\n", "mapping"),
    ("top-level-number", "42\n", "mapping"),
    ("empty", "", "method"),
    ("null", "~\n", "method"),
    ("binary", BINARY, "recipe"),
    ("latin1", LATIN1, "recipe"),
    ("utf16", RECIPE.encode("utf-16"), "recipe"),
    ("bom", "\ufeff" + RECIPE, None),
    ("nested-map", _recipe_with(lr="{a: 1}"), "key: scalar"),
    ("nested-list", _recipe_with(steps="[1, 2]"), "key: scalar"),
    ("nested-model", _recipe_with(model="{name: tiny-llama}"), "key: scalar"),
    ("method-list", _recipe_with(method="[sekv]"), "key: scalar"),
    ("method-missing", _recipe_with(method=None), "method"),
    ("method-unknown", _recipe_with(method="nope"), "method"),
    ("method-training-free", _recipe_with(method="snapkv"), "method"),
    ("method-number", _recipe_with(method="5"), "method"),
    ("model-number", _recipe_with(model="5"), "model"),
    ("model-unknown", _recipe_with(model="no-such-model"), "no-such-model"),
    ("model-null", _recipe_with(model="~"), "model"),
    ("steps-word", _recipe_with(steps="abc"), "steps"),
    ("steps-float", _recipe_with(steps="1.5"), "steps"),
    ("steps-bool", _recipe_with(steps="true"), "steps"),
    ("steps-zero", _recipe_with(steps="0"), "steps"),
    ("steps-negative", _recipe_with(steps="-1"), "steps"),
    ("steps-huge", _recipe_with(steps="99999999999999999999"), None),
    ("steps-inf", _recipe_with(steps=".inf"), "steps"),
    ("lr-word", _recipe_with(lr="fast"), "lr"),
    ("lr-bool", _recipe_with(lr="true"), "lr"),
    ("lr-nan", _recipe_with(lr=".nan"), "lr"),
    ("lr-inf", _recipe_with(lr="1e400"), "lr"),
    ("lr-negative", _recipe_with(lr="-0.1"), "lr"),
    ("lr-huge", _recipe_with(lr="1e300"), None),
    ("budget-zero", _recipe_with(budget="0"), "budget"),
    ("budget-float", _recipe_with(budget="2.5"), "budget"),
    ("budget-word", _recipe_with(budget="lots"), "budget"),
    ("budget-huge", _recipe_with(budget="99999999999999999999"), None),
    ("seed-huge", _recipe_with(seed="99999999999999999999"), "seed"),
    ("seed-negative", _recipe_with(seed="-1"), "seed"),
    ("threads-huge", _recipe_with(threads="99999999999999999999"), "threads"),
    ("threads-negative", _recipe_with(threads="-2"), "threads"),
    ("fraction-over-1", _recipe_with(max_trainable_fraction="2"), "max_trainable_fraction"),
    ("min-length-tiny", _recipe_with(min_length="8"), "min_length"),
    ("max-length-below-min", _recipe_with(max_length="100"), "max_length"),
    ("max-length-huge", _recipe_with(max_length="99999999999999999999"), None),
    ("num-samples-zero", _recipe_with(num_samples="0"), "num_samples"),
    ("tensorboard-word", _recipe_with(tensorboard="maybe"), "tensorboard"),
    ("tensorboard-number", _recipe_with(tensorboard="2"), "tensorboard"),
    ("threads-string", _recipe_with(threads="'1'"), "ok"),  # a number written as text is that number (issue 43)
    ("threads-word", _recipe_with(threads="'one'"), "threads"),
    ("tasks-unknown", _recipe_with(tasks="nope"), "tasks"),
    ("tasks-bad-weight", _recipe_with(tasks="passkey:abc"), "tasks"),
    ("tasks-negative-weight", _recipe_with(tasks="passkey:-1"), "tasks"),
    ("tasks-number", _recipe_with(tasks="5"), "tasks"),
    ("data-number", _recipe_with(data="5"), "data"),
    ("output-dir-number", _recipe_with(output_dir="5"), None),
    ("init-adapter-missing", _recipe_with(init_adapter="/no/such/adapter"), "init_adapter"),
    ("init-adapter-file", _recipe_with(init_adapter=str(ROOT / "README.md")), "init_adapter"),
    ("resume-number", _recipe_with(resume="5"), "resume"),
    ("unknown-key", RECIPE + "foo: 1\n", "foo"),
    ("unknown-key-case", RECIPE + "LR: 0.1\n", "LR"),
    ("empty-key", RECIPE + "'': 1\n", "unknown recipe key"),
    ("number-key", RECIPE + "5: 1\n", "unknown recipe key"),
    ("null-key", RECIPE + "~: 1\n", "unknown recipe key"),
    ("duplicate-key", RECIPE + "lr: 0.02\n", "duplicate key 'lr'"),
    # the method's own keys: sizes that would allocate far more than the base model
    ("code-bits-huge", _recipe_with(code_bits="99999999999999999999"), "code_bits"),
    ("code-bits-odd", _recipe_with(code_bits="3"), "code_bits"),
    ("code-bits-word", _recipe_with(code_bits="abc"), "code_bits"),
    ("anchor-fraction-out-of-range", _recipe_with(anchor_fraction="1.5"), "anchor_fraction"),
    ("rotation-seed-huge", _recipe_with(rotation_seed="99999999999999999999"), "rotation_seed"),
    ("w-rank-nan", _recipe_with(w_rank=".nan"), "w_rank"),
    ("gain-lr-negative", _recipe_with(gain_lr="-1"), "gain_lr"),
]

# (id, command-line overrides after the recipe, expected)
OVERRIDE_CASES = [
    ("ok", ["steps=3", "lr=0.02"], "ok"),
    ("bad-yaml", ["lr=[0.1"], "lr"),
    ("yaml-tag", ["lr=!!python/object/apply:os.system [ls]"], "lr"),
    ("no-equals", ["lr"], "key=value"),
    ("empty-key", ["=1"], "recipe key"),
    ("unknown", ["foo=1"], "foo"),
    ("word", ["steps=abc"], "steps"),
    ("nested", ["lr={a: 1}"], "lr"),
    ("list", ["steps=[1]"], "steps"),
    ("empty-value", ["lr="], "lr"),
    ("nan", ["lr=.nan"], "lr"),
    ("method-unknown", ["method=nope"], "method"),
    ("samples-per-step-huge", ["samples_per_step=1000000000"], "samples_per_step"),
    ("eval-baselines-unknown", ["eval_baselines=nosuch", "eval_samples=0"], "eval_baselines"),
    ("eval-baselines-unknown-evaluated", ["eval_baselines=quest,nosuch", "eval_samples=1"], "nosuch"),
]

RECIPE_FILES = [("missing", None, "not found"), ("folder", "DIR", "not found")]


def _write(path: Path, content: str | bytes) -> Path:
    path.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
    return path


@pytest.mark.parametrize("id, content, expect", RECIPE_CASES, ids=[c[0] for c in RECIPE_CASES])
def test_recipe_yaml(id, content, expect, tmp_path, capsys, monkeypatch):
    recipe = _write(tmp_path / "recipe.yaml", content)
    argv = ["train", "--recipe", str(recipe), "--dry-run", f"output_dir={tmp_path / 'runs'}"]
    code, _ = run_case(argv, expect, capsys, monkeypatch)
    assert code == 0 or expect != "ok"
    assert not (tmp_path / "runs").exists()  # a dry run writes nothing


@pytest.mark.parametrize("id, overrides, expect", OVERRIDE_CASES, ids=[c[0] for c in OVERRIDE_CASES])
def test_recipe_overrides(id, overrides, expect, tmp_path, capsys, monkeypatch):
    argv = ["train", "--recipe", str(TINY_RECIPE), "--dry-run", *overrides]
    code, _ = run_case(argv, expect, capsys, monkeypatch)
    assert code == 0 or expect != "ok"


@pytest.mark.parametrize("id, name, expect", RECIPE_FILES, ids=[c[0] for c in RECIPE_FILES])
def test_recipe_file(id, name, expect, tmp_path, capsys, monkeypatch):
    path = tmp_path if name == "DIR" else tmp_path / "nope.yaml"
    run_case(["train", "--recipe", str(path), "--dry-run"], expect, capsys, monkeypatch)


# -- (c) adapter configs ----------------------------------------------------------------------------------

def _peak_kb() -> int | None:
    try:
        return int(re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))
    except (OSError, AttributeError):
        return None


def _reset_peak() -> bool:
    """Linux resets the process's peak RSS (VmHWM) when 5 is written to clear_refs (since 4.0)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


class Allocations:
    """The most bytes of parameters and buffers (off the meta device) one adapter build registered while this
    is active: each call of ``build_adapter_modules`` counted on its own (export loads the adapter, then reads
    the written copy back: two builds, each the size of the weights)."""

    def __init__(self, monkeypatch) -> None:
        self.bytes = 0
        self._current = 0
        self._monkeypatch = monkeypatch

    def _count(self, module, name, tensor) -> None:
        if tensor is not None and tensor.device.type != "meta":
            self._current += tensor.numel() * tensor.element_size()
            self.bytes = max(self.bytes, self._current)

    def __enter__(self) -> Allocations:
        from torch.nn.modules.module import (
            register_module_buffer_registration_hook,
            register_module_parameter_registration_hook,
        )

        import zoomkv.adapters.model as model_module

        build = model_module.build_adapter_modules

        def counted(*args, **kwargs):
            self._current = 0
            return build(*args, **kwargs)

        self._monkeypatch.setattr(model_module, "build_adapter_modules", counted)
        self._handles = [register_module_parameter_registration_hook(self._count),
                         register_module_buffer_registration_hook(self._count)]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, Path]:
    """A real sekv and semantic_id adapter of tiny-llama, written by ``save_pretrained`` (as export does)."""
    import torch

    from zoomkv.adapters.model import ZoomAdapter
    from zoomkv.models import load_model

    tmp = tmp_path_factory.mktemp("adapters")
    model = load_model("tiny-llama")[0]
    torch.manual_seed(0)
    sekv = ZoomAdapter.initialise(model, "sekv", {"code_bits": 1, "rotation_seed": 8},
                                  name="tiny-llama", budget=64)
    semantic = ZoomAdapter.initialise(model, "semantic_id", {"sem_dim": 8, "hidden": 16}, name="tiny-llama",
                                      budget=64)
    # the same method on another base model of the same adapter shapes, and with another hyper-parameter
    qwen = ZoomAdapter.initialise(load_model("tiny-qwen2")[0], "sekv", {"code_bits": 1, "rotation_seed": 8},
                                  name="tiny-qwen2", budget=64)
    bits = ZoomAdapter.initialise(model, "sekv", {"code_bits": 2, "rotation_seed": 8}, name="tiny-llama", budget=64)
    return {"sekv": sekv.save_pretrained(tmp / "sekv"), "semantic_id": semantic.save_pretrained(tmp / "semantic_id"),
            "sekv-qwen2": qwen.save_pretrained(tmp / "sekv-qwen2"), "sekv-bits2": bits.save_pretrained(tmp / "sekv-bits2")}


def _weights_bytes(folder: Path) -> int:
    """What the weights file names: the bytes of its tensors, from its header (nothing loaded)."""
    import struct

    data = (folder / "adapter_model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    return sum(end - start for key, v in header.items() if key != "__metadata__" for start, end in [v["data_offsets"]])


MISSING = object()


def _set(path: str, value: Any):
    """An edit of the config: ``path`` is ``key`` or ``key.sub``; MISSING drops it."""
    def edit(config: dict) -> dict:
        *parents, last = path.split(".")
        node = config
        for p in parents:
            node = node[p]
        if value is MISSING:
            node.pop(last, None)
        else:
            node[last] = value
        return config
    edit.__name__ = f"{path}={value!r}"[:60]
    return edit


def _text(content: str | bytes):
    """The whole config file replaced by ``content``."""
    return content


# (id, adapter, edit of the config dict or the file's new content, expected)
ADAPTER_CASES = [
    ("ok", "sekv", _set("toolkit_version", "0.0.1"), "ok"),
    ("ok-semantic-id", "semantic_id", _set("toolkit_version", "0.0.1"), "ok"),
    ("not-json", "sekv", _text("{not json"), "not valid JSON"),
    ("empty-file", "sekv", _text(""), "not valid JSON"),
    ("binary-file", "sekv", _text(BINARY), "not valid JSON"),
    ("latin1-file", "sekv", _text(LATIN1), "not valid JSON"),
    ("json-list", "sekv", _text("[1, 2]"), "expected a JSON object"),
    ("json-string", "sekv", _text('"adapter"'), "expected a JSON object"),
    ("json-null", "sekv", _text("null"), "expected a JSON object"),
    ("json-deep", "sekv", _text("[" * 100_000 + "]" * 100_000), "adapter_config.json"),
    ("json-nan", "sekv", lambda c: json.dumps(c).replace('"rotation_seed": 8', '"rotation_seed": NaN'), "rotation_seed"),
    ("json-infinity", "sekv", lambda c: json.dumps(c).replace('"rotation_seed": 8', '"rotation_seed": 1e999'),
     "rotation_seed"),
    ("json-huge-int", "sekv", lambda c: json.dumps(c).replace('"rotation_seed": 8', '"rotation_seed": ' + "9" * 5000),
     "not valid JSON"),
    ("method-missing", "sekv", _set("method", MISSING), "method"),
    ("method-number", "sekv", _set("method", 5), "method"),
    ("method-null", "sekv", _set("method", None), "method"),
    ("method-unknown", "sekv", _set("method", "nope"), "nope"),
    ("method-training-free", "sekv", _set("method", "snapkv"), "snapkv"),
    ("method-path", "sekv", _set("method", "../../etc/passwd"), "etc/passwd"),
    ("method-other-trainable", "sekv", _set("method", "semantic_id"), None),
    ("hyper-missing", "sekv", _set("hyper", MISSING), "hyper"),
    ("hyper-list", "sekv", _set("hyper", [1]), "hyper"),
    ("hyper-string", "sekv", _set("hyper", "x"), "hyper"),
    ("hyper-null", "sekv", _set("hyper", None), "hyper"),
    ("hyper-empty", "sekv", _set("hyper", {}), None),
    ("seed-word", "sekv", _set("hyper.rotation_seed", "abc"), "rotation_seed"),
    ("seed-negative", "sekv", _set("hyper.rotation_seed", -1), "rotation_seed"),
    ("seed-float", "sekv", _set("hyper.rotation_seed", 2.5), "rotation_seed"),
    ("seed-bool", "sekv", _set("hyper.rotation_seed", True), "rotation_seed"),
    ("seed-null", "sekv", _set("hyper.rotation_seed", None), "rotation_seed"),
    ("seed-list", "sekv", _set("hyper.rotation_seed", [8]), "rotation_seed"),
    ("seed-map", "sekv", _set("hyper.rotation_seed", {"a": 1}), "rotation_seed"),
    ("seed-2-63", "sekv", _set("hyper.rotation_seed", 2**63), "rotation_seed"),
    ("seed-10-30", "sekv", _set("hyper.rotation_seed", 10**30), "rotation_seed"),
    # another rotation, same shapes: the weights record the rotation they were trained with (issue 32)
    ("seed-other", "sekv", _set("hyper.rotation_seed", 9), "saved for another adapter"),
    ("code-bits-word", "sekv", _set("hyper.code_bits", "abc"), "code_bits"),
    ("code-bits-odd", "sekv", _set("hyper.code_bits", 3), "code_bits"),
    ("code-bits-huge", "sekv", _set("hyper.code_bits", 10**30), "code_bits"),
    ("anchor-fraction-negative", "sekv", _set("hyper.anchor_fraction", -0.5), "anchor_fraction"),
    ("sinks-word", "sekv", _set("hyper.sinks", "x"), "sinks"),
    ("head-dim-2e7", "sekv", _set("shape.head_dim", 2 * 10**7), "refused before allocating"),
    ("hyper-unknown", "sekv", _set("hyper.foo", 1), None),
    ("sem-dim-huge", "semantic_id", _set("hyper.sem_dim", 10**9), "sem_dim"),
    ("hidden-huge", "semantic_id", _set("hyper.hidden", 10**8), "refused before allocating"),
    # sekv's modules are sized by the model: a size in its hyper must be the model's, not ignored (issue 32)
    ("hyper-num-layers-huge", "sekv", _set("hyper.num_layers", 10**9), "num_layers"),
    ("hyper-head-dim-huge", "sekv", _set("hyper.head_dim", 10**9), "head_dim"),
    ("hyper-kv-heads-other", "sekv", _set("hyper.kv_heads", 3), "kv_heads"),
    # the model's own size, but not what the weights were saved with: an edited config is not the weights' config
    ("hyper-num-layers-model", "sekv", _set("hyper.num_layers", 4), "saved for another adapter"),
    ("projector-path", "semantic_id", _set("hyper.projector", "/etc/passwd"), "projector"),
    ("projector-relative", "semantic_id", _set("hyper.projector", "../sekv/adapter_model.safetensors"),
     "projector"),
    ("shape-missing", "sekv", _set("shape", MISSING), "shape"),
    ("shape-string", "sekv", _set("shape", "x"), "shape"),
    ("shape-empty", "sekv", _set("shape", {}), "shape"),
    ("num-layers-huge", "sekv", _set("shape.num_layers", 10**9), None),
    ("num-layers-negative", "sekv", _set("shape.num_layers", -1), "num_layers"),
    ("num-layers-word", "sekv", _set("shape.num_layers", "x"), "num_layers"),
    ("num-layers-null", "sekv", _set("shape.num_layers", None), "num_layers"),
    ("kv-heads-huge", "sekv", _set("shape.num_kv_heads", 10**9), None),
    ("head-dim-zero", "sekv", _set("shape.head_dim", 0), "head_dim"),
    ("head-dim-huge", "sekv", _set("shape.head_dim", 10**12), None),
    ("layer-types-number", "sekv", _set("shape.layer_types", 7), "layer_types"),
    ("layer-types-huge", "sekv", _set("shape.layer_types", ["full_attention"] * 100_000), None),
    ("num-parameters-zero", "sekv", _set("shape.num_parameters", 0), None),
    ("num-parameters-negative", "sekv", _set("shape.num_parameters", -5), "num_parameters"),
    ("num-parameters-huge", "sekv", _set("shape.num_parameters", 10**15), "ok"),
    ("num-parameters-huge-and-head-dim", "sekv",
     lambda c: _set("shape.head_dim", 2 * 10**7)(_set("shape.num_parameters", 10**15)(c)), "code_gain"),
    ("base-model-string", "sekv", _set("base_model", "tiny-llama"), "base_model"),
    ("base-model-empty", "sekv", _set("base_model", {}), "base_model"),
    ("base-model-name-number", "sekv", _set("base_model.name", 5), None),
    ("budget-word", "sekv", _set("budget", "lots"), "budget"),
    ("budget-negative", "sekv", _set("budget", -1), "budget"),
    ("budget-zero", "sekv", _set("budget", 0), "budget"),
    ("budget-huge", "sekv", _set("budget", 1e30), None),  # loads; generate holds it against the model
    ("budget-nan", "sekv", lambda c: json.dumps(c).replace('"budget": 64', '"budget": NaN'), "budget"),
    ("budget-list", "sekv", _set("budget", [64]), "budget"),
    ("budget-null", "sekv", _set("budget", None), "ok"),
    ("budget-fraction", "sekv", _set("budget", "0.5"), "ok"),
    ("format-version-future", "sekv", _set("format_version", 999), "format_version"),
    ("format-version-string", "sekv", _set("format_version", "1"), "format_version"),
    ("format-version-missing", "sekv", _set("format_version", MISSING), "format_version"),
    ("format-version-list", "sekv", _set("format_version", [1]), "format_version"),
    ("sha-null", "sekv", _set("weights_sha256", None), "no checksum recorded"),
    ("sha-missing", "sekv", _set("weights_sha256", MISSING), "no checksum recorded"),
    ("sha-number", "sekv", _set("weights_sha256", 5), "weights_sha256"),
    ("sha-wrong", "sekv", _set("weights_sha256", "0" * 64), "checksum mismatch"),
    ("sha-empty", "sekv", _set("weights_sha256", ""), "checksum"),
    ("fraction-word", "sekv", _set("trainable_fraction", "x"), "trainable_fraction"),
    ("fraction-negative", "sekv", _set("trainable_fraction", -1), None),
    ("toolkit-number", "sekv", _set("toolkit_version", 5), "toolkit_version"),
    ("library-number", "sekv", _set("library_name", 5), "library_name"),
    ("peft-type-lora", "sekv", _set("peft_type", "LORA"), None),
    ("unknown-field", "sekv", _set("foo", 1), "foo"),
]

# (id, adapter, what is done to the weights file, expected)
WEIGHTS_CASES = [
    ("missing", "sekv", None, "adapter_model.safetensors"),
    ("empty", "sekv", b"", "adapter_model.safetensors"),
    ("binary", "sekv", BINARY, "adapter_model.safetensors"),
    ("truncated", "sekv", "truncate", "adapter_model.safetensors"),
    ("other-adapters", "sekv", "semantic_id", "checksum mismatch"),
    ("huge-header", "sekv", (10**15).to_bytes(8, "little") + b"{}", "adapter_model.safetensors"),
]


def _copy(adapters: dict[str, Path], name: str, tmp: Path) -> Path:
    import shutil

    return Path(shutil.copytree(adapters[name], tmp / name))


def _edited(adapters: dict[str, Path], name: str, edit: Any, tmp: Path) -> Path:
    """A copy of adapter ``name`` whose config is edited (a function of the dict) or replaced (text/bytes)."""
    folder = _copy(adapters, name, tmp)
    config_file = folder / "adapter_config.json"
    if callable(edit):
        edited = edit(json.loads(config_file.read_text()))
        edit = edited if isinstance(edited, str) else json.dumps(edited)
    _write(config_file, edit)
    return folder


def _load_through_cli(folder: Path, expect: str | None, tmp: Path, capsys, monkeypatch) -> tuple[int, int, int]:
    """``zoomkv export`` of the folder (the CLI's adapter load path); returns the exit code, the bytes of
    modules built off the meta device and the growth of the process's peak RSS."""
    before = _peak_kb() if _reset_peak() else None
    with Allocations(monkeypatch) as allocated:
        code, _ = run_case(["export", str(folder), "--out", str(tmp / "exported")], expect, capsys, monkeypatch)
    grown = (_peak_kb() - before) * 1024 if before is not None else 0
    return code, allocated.bytes, grown


# Growth of the peak RSS a load may show beyond the weights: Python objects, torch's first use of an op.
RSS_SLACK = 64 * 2**20


@pytest.mark.parametrize("id, name, edit, expect", ADAPTER_CASES, ids=[c[0] for c in ADAPTER_CASES])
def test_adapter_config(id, name, edit, expect, adapters, tmp_path, capsys, monkeypatch):
    folder = _edited(adapters, name, edit, tmp_path)
    named = _weights_bytes(folder)
    code, allocated, grown = _load_through_cli(folder, expect, tmp_path, capsys, monkeypatch)
    assert allocated <= named, f"built {allocated} bytes of modules; the weights file names {named}"
    assert grown <= named + RSS_SLACK, f"peak RSS grew by {grown / 2**20:.0f} MiB loading a {named}-byte adapter"
    assert (code == 0) == (tmp_path / "exported" / "adapter_config.json").is_file()


# `zoomkv export` and `zoomkv push` of a good adapter with bad options; {adapter} is its folder.
EXPORT_OPTIONS = [
    ("ok", ["export", "{adapter}", "--out", "{out}", "--budget", "0.25"], "ok"),
    ("out-readonly", ["export", "{adapter}", "--out", "{readonly}"], None),
    ("out-existing-file", ["export", "{adapter}", "--out", "{existing}"], "exists"),
    ("out-existing-file-overwrite", ["export", "{adapter}", "--out", "{existing}", "--overwrite"], "not a folder"),
    ("out-under-file", ["export", "{adapter}", "--out", "{existing}/sub"], None),
    ("out-is-itself", ["export", "{adapter}", "--out", "{adapter}", "--overwrite"], None),
    ("budget-word", ["export", "{adapter}", "--out", "{out}", "--budget", "lots"], "budget"),
    ("budget-negative", ["export", "{adapter}", "--out", "{out}", "--budget", "-3"], "budget"),
    ("scores-missing", ["export", "{adapter}", "--out", "{out}", "--scores", "{missing}"], "no-such-file"),
    ("scores-binary", ["export", "{adapter}", "--out", "{out}", "--scores", "{binary}"], "binary"),
    ("scores-latin1", ["export", "{adapter}", "--out", "{out}", "--scores", "{latin1}"], "latin1"),
    ("scores-empty", ["export", "{adapter}", "--out", "{out}", "--scores", "{empty}"], "empty"),
    ("scores-dir", ["export", "{adapter}", "--out", "{out}", "--scores", "{dir}"], "folder"),
    ("push-offline", ["push", "{adapter}", "--repo-id", "me/x"], "offline"),
    ("push-bad-repo", ["push", "{adapter}", "--repo-id", "a/../b"], None),
    ("out-empty", ["export", "{adapter}", "--out", ""], "--out needs a folder name"),
]


@pytest.mark.parametrize("id, argv, expect", EXPORT_OPTIONS, ids=[c[0] for c in EXPORT_OPTIONS])
def test_export_and_push_options(id, argv, expect, adapters, files, tmp_path, capsys, monkeypatch):
    folder = _copy(adapters, "sekv", tmp_path)
    before = sorted(p.name for p in folder.iterdir())
    defaults = sorted(p.name for p in (ROOT / "checkpoints").iterdir())
    run_case([a.format(adapter=folder, out=tmp_path / "out", **files) for a in argv], expect, capsys, monkeypatch)
    assert sorted(p.name for p in folder.iterdir()) == before  # the source adapter is never harmed
    assert Path(files["existing"]).is_file()
    assert sorted(p.name for p in (ROOT / "checkpoints").iterdir()) == defaults  # nothing at the default --out


@pytest.mark.parametrize("id, name, change, expect", WEIGHTS_CASES, ids=[c[0] for c in WEIGHTS_CASES])
def test_adapter_weights_file(id, name, change, expect, adapters, tmp_path, capsys, monkeypatch):
    folder = _copy(adapters, name, tmp_path)
    weights = folder / "adapter_model.safetensors"
    named = weights.stat().st_size
    if change is None:
        weights.unlink()
    elif change == "truncate":
        weights.write_bytes(weights.read_bytes()[: named // 2])
    elif change in adapters:
        weights.write_bytes((adapters[change] / weights.name).read_bytes())
    else:
        weights.write_bytes(change)
    code, allocated, grown = _load_through_cli(folder, expect, tmp_path, capsys, monkeypatch)
    assert code == 2
    assert allocated <= named and grown <= named + RSS_SLACK


THROUGH_GENERATE = [c for c in ADAPTER_CASES if c[0] in ("ok", "r-max-word", "r-max-1e9", "sha-null", "method-unknown",
                                                          "budget-word", "budget-huge", "json-deep",
                                                          "num-parameters-huge-and-r-max", "hyper-unknown")]


@pytest.mark.parametrize("id, name, edit, expect", THROUGH_GENERATE, ids=[c[0] for c in THROUGH_GENERATE])
def test_adapter_config_through_generate(id, name, edit, expect, adapters, tmp_path, capsys, monkeypatch):
    """The same configs through ``generate --adapter``, which also loads the base model and attaches."""
    folder = _edited(adapters, name, edit, tmp_path)
    run_case([*GEN_P, "--adapter", str(folder)], expect, capsys, monkeypatch)


# -- (d) JSONL eval records -------------------------------------------------------------------------------

GOOD = {"prompt": "What is the pass key?", "context": PROMPT, "answers": ["71934"]}


def _jsonl(*records: Any) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)


def _with(**changes: Any) -> dict:
    record = dict(GOOD)
    for key, value in changes.items():
        if value is MISSING:
            record.pop(key, None)
        else:
            record[key] = value
    return record


# (id, the file's content, expected)
JSONL_CASES = [
    ("ok", _jsonl(GOOD, _with(prompt="And the key?")), "ok"),
    ("ok-blank-lines", "\n\n" + _jsonl(GOOD) + "\n  \n", "ok"),
    ("ok-longbench", _jsonl({"input": "What is the pass key?", "context": PROMPT, "answers": ["71934"],
                             "dataset": "passage_retrieval_en"}), None),
    ("empty-file", "", "no records"),
    ("blank-file", "\n \n\t\n", "no records"),
    ("not-json", "{not json}\n", "jsonl:1"),
    ("not-json-second-line", _jsonl(GOOD, "{\"prompt\": "), "jsonl:2"),
    ("trailing-comma", '{"prompt": "x", "answers": ["y"],}\n', "jsonl:1"),
    ("list-line", _jsonl([1, 2]), "jsonl:1"),
    ("number-line", _jsonl(5), "jsonl:1"),
    ("string-line", _jsonl("\"just text\""), "jsonl:1"),
    ("null-line", "null\n", "jsonl:1"),
    ("empty-object", _jsonl({}), "jsonl:1"),
    ("binary", BINARY, None),
    ("latin1", LATIN1, None),
    ("bom", "\ufeff" + _jsonl(GOOD), None),
    ("prompt-missing", _jsonl(_with(prompt=MISSING)), "jsonl:1"),
    ("answers-missing", _jsonl(_with(answers=MISSING)), "answers"),
    ("prompt-number", _jsonl(_with(prompt=5)), "prompt"),
    ("prompt-null", _jsonl(_with(prompt=None)), "prompt"),
    ("prompt-list", _jsonl(_with(prompt=["x"])), "prompt"),
    ("prompt-object", _jsonl(_with(prompt={"a": 1})), "prompt"),
    ("prompt-empty", _jsonl(_with(prompt="", context="")), None),
    ("answers-number", _jsonl(_with(answers=5)), "answers"),
    ("answers-null", _jsonl(_with(answers=None)), "answers"),
    ("answers-empty", _jsonl(_with(answers=[])), None),
    ("answers-numbers", _jsonl(_with(answers=[71934])), None),
    ("answers-objects", _jsonl(_with(answers=[{"a": 1}])), "answers"),
    ("answers-nested", _jsonl(_with(answers=[["71934"]])), "answers"),
    ("context-number", _jsonl(_with(context=5)), "context"),
    ("context-huge", _jsonl(_with(context="word " * 200_000)), None),
    ("prompt-huge", _jsonl(_with(prompt="word " * 20_000, context="")), None),
    ("metric-unknown", _jsonl(_with(metric="nope")), "metric"),
    ("metric-number", _jsonl(_with(metric=5)), "metric"),
    ("max-new-word", _jsonl(_with(max_new_tokens="x")), "max_new_tokens"),
    ("max-new-negative", _jsonl(_with(max_new_tokens=-1)), "max_new_tokens"),
    ("max-new-zero", _jsonl(_with(max_new_tokens=0)), "max_new_tokens"),
    ("max-new-float", _jsonl(_with(max_new_tokens=1.5)), "max_new_tokens"),
    ("max-new-bool", _jsonl(_with(max_new_tokens=True)), "max_new_tokens"),
    ("max-new-huge", _jsonl(_with(max_new_tokens=10**30)), "max_new_tokens"),
    ("max-new-inf", '{"prompt": "x", "answers": ["y"], "max_new_tokens": Infinity}\n', "max_new_tokens"),
    ("max-new-nan", '{"prompt": "x", "answers": ["y"], "max_new_tokens": NaN}\n', "max_new_tokens"),
    ("huge-integer", '{"prompt": "x", "answers": ["y"], "max_new_tokens": ' + "9" * 5000 + "}\n", "jsonl:1"),
    ("deep-nesting", '{"prompt": "x", "answers": ' + "[" * 100_000 + "]" * 100_000 + "}\n", "jsonl:1"),
    ("chat-word", _jsonl(_with(chat="yes")), None),
    ("all-classes-number", _jsonl(_with(metric="classification", all_classes=5)), "all_classes"),
    ("classification-no-classes", _jsonl(_with(metric="classification")), "all_classes"),
    ("task-number", _jsonl(_with(task=5)), None),
    ("answer-prefix-number", _jsonl(_with(answer_prefix=5)), "answer_prefix"),
    ("first-line-word", _jsonl(_with(first_line="x")), None),
    ("mixed-formats", _jsonl(GOOD, {"input": "q", "context": "c", "answers": ["a"]}), None),
    ("second-record-bad", _jsonl(GOOD, _with(answers=5)), "jsonl:2"),
    ("unknown-format", _jsonl({"text": "hello"}), "cannot tell the format"),
    ("longbench-v2-bad-answer", _jsonl({"question": "q", "context": "c", "answer": "E", "choice_A": "a",
                                        "choice_B": "b", "choice_C": "c", "choice_D": "d"}), "answer"),
    ("ruler-outputs-null", _jsonl({"input": "q", "outputs": None}), "outputs"),
    ("gsm8k-answer-number", _jsonl({"question": "2+2?", "answer": 4}), None),
    ("infinitebench-options-number", _jsonl({"context": "c", "input": "q", "answer": "a", "options": 5}), "options"),
]

EVAL_DATA = ["eval", "--model", "tiny-llama", "--samples", "1", "--max-new-tokens", "2", "--no-plots", "--quiet",
             "--length", "512"]


@pytest.mark.parametrize("id, content, expect", JSONL_CASES, ids=[c[0] for c in JSONL_CASES])
def test_jsonl_records(id, content, expect, tmp_path, capsys, monkeypatch):
    data = _write(tmp_path / "records.jsonl", content)
    run_case([*EVAL_DATA, "--data", str(data), "--out", str(tmp_path / "out")], expect, capsys, monkeypatch)


@pytest.mark.parametrize("id, source, expect", [
    ("missing", "{missing}", "no-such-file"), ("folder", "{dir}", None), ("binary-txt", "{binary}", None),
    ("empty-name", "=", None), ("named-missing", "mine={missing}", "no-such-file"),
])
def test_data_sources(id, source, expect, files, tmp_path, capsys, monkeypatch):
    run_case([*EVAL_DATA, "--data", source.format(**files), "--out", str(tmp_path / "out")], expect, capsys,
             monkeypatch)


# -- (e) files zoomkv reads back: models, adapter weights, teacher caches, eval rows, profiles (issue 32) ----
# Each case spoils one file of a good artefact (a saved model folder, an eval run, a training run, a calibration
# profile) in a copy and runs the command that reads it: one line and exit 2, or (a cache zoomkv owns) rebuilt.

ST_PROMPT = ["--chat", "off", "--max-new-tokens", "2", "--prompt", PROMPT]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """Good artefacts to spoil: tiny-llama saved as a model folder, an eval run, CompressKV and InfiniGen
    profiles of tiny-llama."""
    from zoomkv.models import load_model

    tmp = tmp_path_factory.mktemp("saved")
    model, tokenizer = load_model("tiny-llama")
    model.save_pretrained(tmp / "model")
    tokenizer.save_pretrained(tmp / "model")
    out: dict[str, Path] = {"model": tmp / "model", "eval": tmp / "eval"}
    assert main([*EVAL_BASE, "--methods", "snapkv", "--budgets", "64", "--out", str(out["eval"])]) == 0
    out["compresskv"] = tmp / "compresskv.json"
    assert main(["calibrate", "compresskv", "--model", "tiny-llama", "--samples", "1", "--length", "64",
                 "--accept-all", "--quiet", "--out", str(out["compresskv"])]) == 0
    out["compresskv-qwen2"] = tmp / "compresskv-qwen2.json"
    assert main(["calibrate", "compresskv", "--model", "tiny-qwen2", "--samples", "1", "--length", "64",
                 "--accept-all", "--quiet", "--out", str(out["compresskv-qwen2"])]) == 0
    out["infinigen"] = tmp / "infinigen.safetensors"
    assert main(["calibrate", "infinigen", "--model", "tiny-llama", "--tokens", "64", "--quiet",
                 "--output", str(out["infinigen"])]) == 0
    return out


def _copytree(src: Path, dst: Path) -> Path:
    import shutil

    return Path(shutil.copytree(src, dst))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def _pickled_model(folder: Path) -> None:
    """The weights as a pickle that would run code if unpickled (torch's weights_only load refuses it)."""
    import os

    import torch

    class Payload:
        def __reduce__(self):
            return (os.system, ("echo pwned > /dev/null",))

    (folder / "model.safetensors").unlink()
    torch.save({"model.embed_tokens.weight": Payload()}, folder / "pytorch_model.bin")


def _model_case(spoil):
    def make(saved, tmp):
        folder = _copytree(saved["model"], tmp / "model")
        spoil(folder)
        return ["generate", "--model", str(folder), *ST_PROMPT]
    return make


def _rows_case(spoil):
    def make(saved, tmp):
        folder = _copytree(saved["eval"], tmp / "eval")
        spoil(folder / "rows.jsonl")
        return [*EVAL_BASE, "--methods", "snapkv", "--budgets", "64", "--out", str(folder)]
    return make


def _drop_task(rows: Path) -> None:
    lines = rows.read_text().splitlines()
    first = json.loads(lines[0])
    del first["task"]
    rows.write_text("\n".join([json.dumps(first), *lines[1:]]) + "\n")


def _latin1_row(rows: Path) -> None:
    data = rows.read_bytes()
    at = data.index(b'"prediction": "') + len(b'"prediction": "')
    rows.write_bytes(data[:at] + b"caf\xe9 " + data[at:])


def _profile_case(method: str, spoil):
    def make(saved, tmp):
        profile = spoil(saved, tmp)
        return ["generate", "--model", "tiny-llama", *ST_PROMPT, "--method", method, "--budget", "32",
                "--method-arg", f"profile={profile}"]
    return make


def _binary_file(saved, tmp) -> Path:
    return _write(tmp / "profile.bin", BINARY)


def _truncated(name: str):
    def spoil(saved, tmp) -> Path:
        path = tmp / saved[name].name
        path.write_bytes(saved[name].read_bytes()[: saved[name].stat().st_size // 2])
        return path
    return spoil


def _adapter_weights(fill: float):
    """The sekv adapter with every weight set to ``fill`` and the checksum recomputed to match."""
    def make(saved, tmp, adapters):
        import torch
        from safetensors.torch import load_file

        from zoomkv.adapters.weights import read_identity, sha256, tensors_to_bytes

        folder = _copy(adapters, "sekv", tmp)
        weights = folder / "adapter_model.safetensors"
        data = tensors_to_bytes({k: torch.full_like(v, fill) for k, v in load_file(weights).items()},
                                read_identity(weights))  # the same adapter's: only the values are spoiled
        weights.write_bytes(data)
        _edit_json(folder / "adapter_config.json", lambda c: c.update(weights_sha256=sha256(data)))
        return ["generate", "--model", "tiny-llama", *ST_PROMPT, "--adapter", str(folder)]
    return make


# (id, the spoiled artefact → argv, expected)
READ_BACK_CASES = [
    ("model-pickled-bin", _model_case(_pickled_model), "torch refused"),
    ("model-truncated-safetensors", _model_case(lambda f: _truncate(f / "model.safetensors")), "truncated"),
    ("model-layers-1e9", _model_case(lambda f: _edit_json(f / "config.json",
                                                          lambda c: c.update(num_hidden_layers=10**9))),
     "refused before allocating"),
    ("model-layers-1e9-float", _model_case(
        lambda f: (f / "config.json").write_text((f / "config.json").read_text().replace(
            '"num_hidden_layers": 4', '"num_hidden_layers": 1e9'))), "num_hidden_layers"),
    ("model-no-weights", _model_case(lambda f: (f / "model.safetensors").unlink()), "no file named"),  # was 2 lines
    ("model-config-not-json", _model_case(lambda f: (f / "config.json").write_text("{not json")), "config.json"),
    ("model-hidden-1e9", _model_case(lambda f: _edit_json(f / "config.json", lambda c: c.update(hidden_size=10**9))),
     "refused before allocating"),
    ("adapter-weights-nan", _adapter_weights(float("nan")), "non-finite"),
    ("adapter-weights-inf", _adapter_weights(float("inf")), "non-finite"),
    ("rows-missing-task", _rows_case(_drop_task), "rows.jsonl:1: the row lacks 'task'"),
    ("rows-not-utf8", _rows_case(_latin1_row), "rows.jsonl:1: not UTF-8"),
    ("rows-list", _rows_case(lambda rows: rows.write_text("[1, 2]\n" + rows.read_text())), "rows.jsonl:1"),
    ("compresskv-profile-binary", _profile_case("compresskv", _binary_file), "not a CompressKV profile"),
    ("compresskv-profile-truncated", _profile_case("compresskv", _truncated("compresskv")), "CompressKV profile"),
    ("infinigen-profile-binary", _profile_case("infinigen", _binary_file), "not a zoomkv infinigen profile"),
    ("infinigen-profile-truncated", _profile_case("infinigen", _truncated("infinigen")),
     "not a zoomkv infinigen profile"),
    ("infinigen-profile-json", _profile_case("infinigen", lambda saved, tmp: saved["compresskv"]),
     "not a zoomkv infinigen profile"),
]


@pytest.mark.parametrize("id, make, expect", READ_BACK_CASES, ids=[c[0] for c in READ_BACK_CASES])
def test_files_read_back(id, make, expect, saved, adapters, tmp_path, capsys, monkeypatch):
    import inspect

    argv = make(saved, tmp_path, adapters) if len(inspect.signature(make).parameters) == 3 else make(saved, tmp_path)
    run_case(argv, expect, capsys, monkeypatch)


def test_chat_with_stdin_closed(files, capsys, monkeypatch):
    """``zoomkv chat ... <&-``: Python's sys.stdin is None; refused before the model loads."""
    monkeypatch.setattr(sys, "stdin", None)
    code = main([*CHAT_BASE, "--context-file", files["text"], *COMPRESS])
    err = capsys.readouterr().err
    assert code == 2 and "standard input, which is closed" in err and "Traceback" not in err


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A finished tiny training run (its teacher cache in <run>/teacher)."""
    out = tmp_path_factory.mktemp("trained")
    assert main(["train", "--recipe", str(TINY_RECIPE), f"output_dir={out}", "steps=2", "--quiet"]) == 0
    return out


@pytest.mark.heavy
@pytest.mark.parametrize("id, spoil", [
    ("sample-truncated", lambda teacher: _truncate(teacher / "sample_00001.safetensors")),
    ("meta-corrupt", lambda teacher: (teacher / "meta.json").write_text('{"model": "tiny-llama", ')),
    ("meta-binary", lambda teacher: (teacher / "meta.json").write_bytes(BINARY)),
])
def test_teacher_cache_spoiled(id, spoil, trained, tmp_path, capsys, monkeypatch):
    """A spoiled teacher cache (zoomkv's own derived files) is extracted again, not a traceback."""
    from safetensors.torch import load_file

    out = _copytree(trained, tmp_path / "runs")
    teacher = out / "sekv-tiny" / "teacher"
    spoil(teacher)
    code, _ = run_case(["train", "--recipe", str(TINY_RECIPE), f"output_dir={out}", "steps=2", "overwrite=true",
                        "--quiet"], "ok", capsys, monkeypatch)
    assert code == 0
    for sample in teacher.glob("sample_*.safetensors"):
        load_file(sample)
    json.loads((teacher / "meta.json").read_text())


# -- (f) silent wrong results: refused, or said (issue 32) ---------------------------------------------------

def _weights_swapped(source: str):
    """The sekv adapter with the weights of adapter ``source`` (same names and shapes), checksum recomputed."""
    def make(saved, tmp, adapters):
        from zoomkv.adapters.weights import sha256

        folder = _copy(adapters, "sekv", tmp)
        data = (adapters[source] / "adapter_model.safetensors").read_bytes()
        (folder / "adapter_model.safetensors").write_bytes(data)
        _edit_json(folder / "adapter_config.json", lambda c: c.update(weights_sha256=sha256(data)))
        return ["generate", "--model", "tiny-llama", *ST_PROMPT, "--adapter", str(folder)]
    return make


def _weights_as(dtype: str):
    """The sekv adapter's weights cast to ``dtype`` (values kept), checksum recomputed."""
    def make(saved, tmp, adapters):
        import torch
        from safetensors.torch import load_file

        from zoomkv.adapters.weights import read_identity, sha256, tensors_to_bytes

        folder = _copy(adapters, "sekv", tmp)
        weights = folder / "adapter_model.safetensors"
        data = tensors_to_bytes({k: v.to(getattr(torch, dtype)) for k, v in load_file(weights).items()},
                                read_identity(weights))
        weights.write_bytes(data)
        _edit_json(folder / "adapter_config.json", lambda c: c.update(weights_sha256=sha256(data)))
        return ["generate", "--model", "tiny-llama", *ST_PROMPT, "--adapter", str(folder)]
    return make


def _checkpoint(spoil):
    """A training checkpoint folder of the sekv adapter (as the trainer writes one), spoiled, then exported."""
    def make(saved, tmp, adapters):
        from zoomkv.adapters.checkpoint import write_checkpoint
        from zoomkv.adapters.model import ZoomAdapter

        adapter = ZoomAdapter.from_pretrained(adapters["sekv"])
        c = adapter.config
        folder = write_checkpoint(tmp / "step_000002", adapter.modules, method=c.method, hyper=c.hyper,
                                  base_model=c.base_model, shape=c.model_shape(), budget=c.budget)
        spoil(folder)
        return ["export", str(folder), "--out", str(tmp / "exported")]
    return make


def _run_json(edit, model: str = "tiny-qwen2"):
    """The eval run of tiny-llama with its run.json edited, resumed as a run of ``model``."""
    def make(saved, tmp):
        folder = _copytree(saved["eval"], tmp / "eval")
        _edit_json(folder / "run.json", edit)
        return [*EVAL_BASE, "--model", model, "--methods", "snapkv", "--budgets", "64", "--out", str(folder)]
    return make


def _keep_only(*keys: str):
    def edit(record: dict) -> None:
        for key in list(record):
            if key not in keys:
                del record[key]
    return edit


SILENT_CASES = [
    ("weights-of-another-base-model", _weights_swapped("sekv-qwen2"), "saved for another adapter"),
    ("weights-of-other-hyper", _weights_swapped("sekv-bits2"), "hyper-parameters ['code_bits']"),
    ("weights-1e30", _adapter_weights(1e30), "out of any trained range"),
    ("weights-gain-100", _adapter_weights(100.0), "code_gain"),
    ("weights-int64", _weights_as("int64"), "wrong dtype"),
    ("weights-float16", _weights_as("float16"), "ok"),  # another float precision is cast, as ever
    ("checkpoint-marked-incomplete", _checkpoint(lambda f: (f / ".zoomkv-incomplete").write_text("x")),
     "unfinished"),
    ("checkpoint-without-done", _checkpoint(lambda f: (f / "trainer_state.json").write_text("{}")), "without DONE"),
    ("checkpoint-with-done", _checkpoint(lambda f: [(f / n).write_text("{}") for n in ("trainer_state.json", "DONE")]),
     "ok"),
    ("compresskv-profile-other-model", _profile_case("compresskv", lambda saved, tmp: saved["compresskv-qwen2"]),
     "calibrated on 'tiny-qwen2', not on 'tiny-llama'"),
    ("run-json-without-model", _run_json(lambda r: r.pop("model")), "does not record the model"),
    ("run-json-outputs-only", _run_json(_keep_only("outputs")), "does not record the model and seed"),
    ("run-json-other-model", _run_json(lambda r: r.update(model="tiny-qwen2")), "rows of model(s) tiny-llama"),
    ("run-json-same-run", _run_json(lambda r: None, model="tiny-llama"), "ok"),
]


@pytest.mark.parametrize("id, make, expect", SILENT_CASES, ids=[c[0] for c in SILENT_CASES])
def test_silent_wrong_results(id, make, expect, saved, adapters, tmp_path, capsys, monkeypatch):
    import inspect

    argv = make(saved, tmp_path, adapters) if len(inspect.signature(make).parameters) == 3 else make(saved, tmp_path)
    code, _ = run_case(argv, expect, capsys, monkeypatch)
    assert (code == 0) == (expect == "ok")


def test_adapter_and_method_together(adapters, tmp_path, capsys, monkeypatch):
    """``generate --adapter X --method quest`` would run X's method and drop --method: refused."""
    run_case([*GEN_P, "--adapter", str(adapters["sekv"]), "--method", "quest"], "contradicts", capsys, monkeypatch)


@pytest.mark.parametrize("name, expect", [("sekv-qwen2", "differ in model_type"), ("sekv", "ok")])
def test_init_adapter_base_model(name, expect, adapters, capsys, monkeypatch):
    """``init_adapter=`` of another base model is refused (not only another method)."""
    argv = ["train", "--recipe", str(TINY_RECIPE), "--dry-run", f"init_adapter={adapters[name]}"]
    code, _ = run_case(argv, expect, capsys, monkeypatch)
    assert (code == 0) == (expect == "ok")


def test_dense_layers_covering_the_model(capsys, monkeypatch):
    """quest with dense_layers past the model's layers compresses nothing: said on stderr and in the report,
    not reported as a budget of 32 rows held."""
    code = main([*GEN_P, "--method", "quest", "--budget", "32", "--method-arg", "dense_layers=1000"])
    captured = capsys.readouterr()
    assert code == 0 and captured.err.count("compresses none of this model's 4 layers") == 1
    assert "budget 32 rows held by no layer" in captured.out


# -- (g) a failed eval leaves no stray output: nothing is written before its first prompts are built (issue 32) --

STRAY_CASES = [
    ("length-too-short", ["--tasks", "niah_single_1", "--length", "256"], "too short"),
    ("record-too-long", ["--data", _jsonl(_with(prompt="word " * 20_000))], "over the limit"),
    ("record-without-context", ["--data", _jsonl(_with(context=MISSING))], "no context to compress"),
    ("record-with-empty-context", ["--data", _jsonl(_with(context=""))], "no context to compress"),
]


@pytest.mark.parametrize("existing", [False, True], ids=["new-out", "empty-out"])
@pytest.mark.parametrize("id, args, expect", STRAY_CASES, ids=[c[0] for c in STRAY_CASES])
def test_failed_eval_leaves_nothing(id, args, expect, existing, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    if existing:
        out.mkdir()
    if args[0] == "--data":
        args = ["--data", str(_write(tmp_path / "records.jsonl", args[1]))]
    base = [a for a in EVAL_BASE if a not in ("--tasks", "niah_single_1")]
    run_case([*base, *args, "--out", str(out)], expect, capsys, monkeypatch)
    assert (out.is_dir() and not any(out.iterdir())) if existing else not out.exists()


def test_record_without_context_query_aware(tmp_path, capsys, monkeypatch):
    """The plain format's context is optional where nothing is compressed before the question."""
    data = _write(tmp_path / "records.jsonl", _jsonl(_with(context=MISSING)))
    base = [a for a in EVAL_BASE if a not in ("--tasks", "niah_single_1")]
    code, _ = run_case([*base, "--data", str(data), "--protocol", "query-aware", "--out", str(tmp_path / "out")],
                       "ok", capsys, monkeypatch)
    assert code == 0 and (tmp_path / "out" / "rows.jsonl").is_file()
