"""Bad input gets one clear line, never a traceback; budgets parse as documented."""

from __future__ import annotations

import json

import pytest

from zoomkv.budget import Budget
from zoomkv.cli import main
from zoomkv.errors import BudgetError


@pytest.mark.parametrize(
    "text,rows,fraction",
    [("512", 512, None), (512, 512, None), ("0.1", None, 0.1), (0.25, None, 0.25), ("1.0", None, 1.0), ("64.0", 64, None)],
)
def test_budget_parses(text, rows, fraction):
    b = Budget.parse(text)
    assert (b.rows, b.fraction) == (rows, fraction)


@pytest.mark.parametrize("text", ["0", "-3", "abc", "", "nan", "inf", "1.5", True, -0.2])
def test_budget_rejects(text):
    with pytest.raises(BudgetError):
        Budget.parse(text)


def test_budget_over_model_limit():
    with pytest.raises(BudgetError, match="exceeds the model's maximum context of 4096"):
        Budget.parse("100000", max_rows=4096)


def test_fraction_resolves_against_prompt():
    assert Budget.parse("0.1").resolve(2000) == 200
    assert Budget.parse("0.001").resolve(10) == 1


def _err(capsys, argv):
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 2, captured
    assert "Traceback" not in captured.err
    return captured.err


def test_unknown_model_lists_valid(capsys):
    err = _err(capsys, ["generate", "--model", "no-such-model", "--method", "full", "--prompt", "hi"])
    assert "smollm2-135m" in err and "tiny-llama" in err


def test_unknown_method_lists_valid(capsys):
    err = _err(capsys, ["generate", "--model", "tiny-llama", "--method", "nope", "--prompt", "hi"])
    assert "oracle_topk" in err and "full" in err


@pytest.mark.parametrize("budget", ["0", "-5", "lots", "100000000"])
def test_bad_budget(capsys, budget):
    err = _err(capsys, ["generate", "--model", "tiny-llama", "--method", "oracle_topk", "--budget", budget, "--prompt", "hi"])
    assert "budget" in err


def test_missing_budget_for_budgeted_method(capsys):
    err = _err(capsys, ["generate", "--model", "tiny-llama", "--method", "oracle_topk", "--prompt", "hi"])
    assert "needs a budget" in err


def test_empty_prompt(capsys, tmp_path):
    assert "empty" in _err(capsys, ["generate", "--model", "tiny-llama", "--prompt", "   "])
    f = tmp_path / "p.txt"
    f.write_text("")
    assert "empty" in _err(capsys, ["generate", "--model", "tiny-llama", "--prompt-file", str(f)])
    assert "not found" in _err(capsys, ["generate", "--model", "tiny-llama", "--prompt-file", str(tmp_path / "x")])


def test_prompt_too_long_names_both_lengths(capsys):
    err = _err(capsys, ["generate", "--model", "tiny-llama", "--chat", "off", "--prompt", "a" * 5000, "--max-new-tokens", "4"])
    assert "5000" in err and "4096" in err


def test_generate_json(capsys):
    code = main(["generate", "--model", "tiny-llama", "--method", "oracle_topk", "--budget", "0.5",
                 "--chat", "off", "--prompt", "hello world, " * 8, "--max-new-tokens", "5", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert isinstance(out["text"], str)
    mem = out["memory"]
    assert set(["device_bytes", "host_bytes", "full_kv_bytes"]) <= set(mem)
    assert 0 < mem["device_bytes"] < mem["full_kv_bytes"] <= mem["host_bytes"]
    assert out["budget"] == (out["prompt_tokens"] + 1) // 2


def test_models_and_methods_list(capsys):
    assert main(["models"]) == 0
    assert "smollm2-135m" in capsys.readouterr().out
    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    assert "full" in out and "oracle_topk" in out


def test_unknown_hyperparameter_lists_valid(capsys):
    err = _err(capsys, ["generate", "--model", "tiny-llama", "--method", "snapkv", "--budget", "64",
                        "--method-args", "window=8,no_such=1", "--prompt", "hi"])
    assert "no_such" in err and "kernel_size" in err


def test_impossible_settings(capsys):
    err = _err(capsys, ["generate", "--model", "tiny-llama", "--method", "snapkv", "--budget", "16", "--prompt", "hi"])
    assert "cannot meet a budget of 16" in err
    err = _err(capsys, ["generate", "--model", "tiny-llama", "--method", "clusterkv", "--budget", "64",
                        "--method-arg", "cluster_size=0", "--prompt", "hi"])
    assert "cluster_size" in err


def test_methods_name_prints_every_hyper_parameter_with_its_help(capsys):
    import dataclasses

    from zoomkv.methods import METHODS

    for name, cls in METHODS.items():  # every config field says what it does
        for f in dataclasses.fields(cls.config_class):
            assert f.metadata.get("help"), f"{name}.{f.name} has no help text"
    assert main(["methods", "quest"]) == 0
    out = capsys.readouterr().out
    assert "page_size=16" in out and "rows per page" in out and "Tang et al." in out
    assert main(["methods", "nope"]) == 2
    assert "unknown method 'nope'" in capsys.readouterr().err


def test_a_hyper_parameter_of_the_wrong_type_is_refused_by_name(capsys):
    from zoomkv.errors import ConfigError
    from zoomkv.methods import get_method

    for bad in ({"page_size": 2.5}, {"page_size": "x"}, {"page_size": True}, {"group_score": 3}):
        with pytest.raises(ConfigError, match=f"hyper-parameter '{next(iter(bad))}' of method 'quest' must be"):
            get_method("quest", **bad)
    assert get_method("quest", page_size=8).config.page_size == 8
    assert get_method("snapkv", window=16).config.window == 16
    code = main(["generate", "--model", "tiny-llama", "--method", "quest", "--budget", "64",
                 "--method-arg", "page_size=abc", "--prompt", "hello"])
    err = capsys.readouterr().err
    assert code == 2 and "page_size" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_every_command_help_has_its_whole_description(capsys):
    """`zoomkv CMD --help` shows the first paragraph of the command's docstring whole, never cut at the end of
    its first line mid-sentence (`zoomkv chat --help` did)."""
    import importlib

    from zoomkv.cli import COMMANDS, main

    for name, module_name, _ in COMMANDS:
        first = importlib.import_module(module_name).__doc__.strip("\n").split("\n\n")[0]
        with pytest.raises(SystemExit):
            main([name, "--help"])
        shown = " ".join(capsys.readouterr().out.split())
        assert " ".join(first.split()) in shown, name
        assert first.rstrip().endswith((".", ":", ")")), f"{name}: its description stops mid-sentence"


def test_eval_help_documents_the_plain_format_and_the_default_haystack(tmp_path, capsys):
    """`zoomkv eval --help` shows the plain JSONL record (and the record it shows loads as one), and says what
    the eval README says about the haystack: kjv prose by default for the essay tasks, noise for the rest."""
    import json
    import re
    from pathlib import Path

    from zoomkv.cli import main
    from zoomkv.data.files import load_data

    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    text = capsys.readouterr().out
    record = re.search(r"^\s*(\{\"prompt\".*\})\s*$", text, re.M)
    assert record, "no plain JSONL record in --help"
    (tmp_path / "mine.jsonl").write_text(record.group(1) + "\n")
    (task,) = load_data(str(tmp_path / "mine.jsonl"), "auto")
    assert task.size == 1 and json.loads(record.group(1))["answers"] == ["71934"]
    assert "kjv" in text and "by default" in text and "noise" in text
    readme = (Path(__file__).parent.parent / "zoomkv" / "eval" / "README.md").read_text()
    assert "fall back to the noise haystack" not in readme and "`kjv`" in readme and "the default" in readme
