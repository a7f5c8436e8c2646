"""``zoomkv chat``: a conversation over one document compressed once, driven by scripted stdin."""

from __future__ import annotations

import io
import re

import pytest

from zoomkv.cli import main


def _chat(monkeypatch, capsys, script: str, *args: str) -> tuple[int, str, str]:
    monkeypatch.setattr("sys.stdin", io.StringIO(script))
    code = main(["chat", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_questions_in_turn_extend_one_compressed_cache(tmp_path, monkeypatch, capsys):
    doc = tmp_path / "doc.txt"
    doc.write_text("The grass is green. The sky is blue. " * 40 + "The pass key is 31415. " + "Here we go. " * 40)
    code, out, err = _chat(monkeypatch, capsys, "What is the pass key?\n/memory\nAnd once more?\n/quit\nignored\n",
                           "--model", "tiny-llama", "--method", "oracle_topk", "--budget", "48", "--context-file", str(doc),
                           "--max-new-tokens", "6")
    assert code == 0, err
    lines = [line for line in out.splitlines() if re.search(r"\[\d+ tokens", line)]
    tokens = [int(re.search(r"\[(\d+) tokens", line).group(1)) for line in lines]
    assert len(tokens) == 3 and tokens[0] < tokens[1] < tokens[2]  # the document, then each turn added to it
    device = [float(re.search(r"device ([\d.]+) MiB", line).group(1)) for line in lines]
    host = [float(re.search(r"host ([\d.]+) MiB", line).group(1)) for line in lines]
    assert all(d < h for d, h in zip(device, host, strict=True))  # the budget holds; everything is kept
    assert "> What is the pass key?" in out and "> And once more?" in out and "ignored" not in out
    assert "memory (oracle_topk, budget 48 rows" in out  # /memory


@pytest.mark.parametrize("setup,message", [
    (lambda p: None, "context file not found"),
    (lambda p: p.write_bytes(b"\xff\xfe\x00binary"), "not UTF-8 text"),
    (lambda p: p.write_text("   \n"), "the document is empty"),
])
def test_bad_context_files_get_one_line_and_exit_2(tmp_path, monkeypatch, capsys, setup, message):
    doc = tmp_path / "doc.txt"
    setup(doc)
    code, out, err = _chat(monkeypatch, capsys, "hi\n", "--model", "tiny-llama", "--context-file", str(doc))
    assert code == 2 and message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
