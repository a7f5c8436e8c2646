"""``zoomkv eval --adapter``: a saved adapter is evaluated as one more method, with the same tokens as the
adapter run directly, its base model checked, and its weights part of the rows' identity."""

from __future__ import annotations

import json

import pytest
import torch

from zoomkv.adapters.errors import AdapterNotFoundError, BaseModelMismatchError
from zoomkv.adapters.model import ZoomAdapter
from zoomkv.cli import main
from zoomkv.commands.eval import config_from_args
from zoomkv.data.sample import PromptFormat
from zoomkv.errors import ZoomKVError
from zoomkv.eval.harness import EvalConfig, run_eval
from zoomkv.eval.tasks import TaskBuilder
from zoomkv.generation import generate_methods
from zoomkv.memory import CacheSpec
from zoomkv.models import load_model


@pytest.fixture
def saved(tmp_path, tiny):
    adapter = ZoomAdapter.initialise(tiny[0], "sekv", {"max_trainable_fraction": 0.01}, budget=64, name="tiny-llama")
    with torch.no_grad():
        adapter.modules.code_gain[:, :, :4].add_(2.0)  # not the default init: the rows must come from these weights
    return adapter, adapter.save_pretrained(tmp_path / "sekv-tiny")


def _cfg(out, adapters, **kw):
    base = dict(model="tiny-llama", out=out, methods=["streamingllm"], budgets=["64"], tasks=["niah_single_1"],
                lengths=[600], samples=2, max_new_tokens=4, progress=False, plots=False, adapters=adapters)
    return EvalConfig(**{**base, **kw})


def _rows(out):
    return [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]


def test_adapter_rows_match_the_adapter_run_directly(tmp_path, tiny, saved):
    adapter, folder = saved
    out = tmp_path / "run"
    rows = run_eval(_cfg(out, [str(folder)]), *tiny)
    label = f"sekv:sekv-tiny@{adapter.config.weights_sha256[:8]}"
    mine = [r for r in rows if r["method"] == label]
    assert len(mine) == 2 and all(r["budget"] == "64" for r in mine)
    assert all(0 < r["device_bytes"] < r["full_kv_bytes"] for r in mine)
    assert f"| {label} | 64 |" in (out / "summary.md").read_text()
    # the same tokens as running the in-memory adapter on the same prompt
    model, tokenizer = tiny
    fmt = PromptFormat(tokenizer, False)
    sample = TaskBuilder(fmt, seed=0, model_max=10**6, essays=None, data=[]).build("niah_single_1", 600, 0)
    direct = generate_methods(model, tokenizer, [fmt.sample_text(sample)], [CacheSpec.build(adapter.make_method(), 64)],
                              max_new_tokens=4, chat=False)[0]
    assert [r["prediction"] for r in mine if r["sample"] == 0] == [direct.texts[0]]


def test_adapter_budget_defaults_to_its_own_and_weights_are_part_of_the_identity(tmp_path, tiny, saved):
    adapter, folder = saved
    out = tmp_path / "run"
    run_eval(_cfg(out, [str(folder)], methods=[], budgets=[], samples=1), *tiny)
    assert {r["budget"] for r in _rows(out) if r["method"].startswith("sekv:")} == {"64"}
    with torch.no_grad():
        adapter.modules.code_gain.sub_(1.0)
    adapter.save_pretrained(folder, overwrite=True)  # retrained in place: its rows are new rows
    run_eval(_cfg(out, [str(folder)], methods=[], budgets=[], samples=1), *tiny)
    assert len([r for r in _rows(out) if r["method"].startswith("sekv:")]) == 2


def test_wrong_base_model_and_missing_adapter_fail_before_any_row(tmp_path, tiny):
    qwen, _ = load_model("tiny-qwen2")
    other = ZoomAdapter.initialise(qwen, "sekv", {"max_trainable_fraction": 0.01}, budget=64, name="tiny-qwen2")
    folder = other.save_pretrained(tmp_path / "qwen-adapter")
    with pytest.raises(BaseModelMismatchError, match="tiny-qwen2"):
        run_eval(_cfg(tmp_path / "a", [str(folder)]), *tiny)
    assert not (tmp_path / "a" / "rows.jsonl").exists() or not _rows(tmp_path / "a")
    with pytest.raises(AdapterNotFoundError):
        run_eval(_cfg(tmp_path / "b", [str(tmp_path / "nowhere")]), *tiny)
    adapter = ZoomAdapter.initialise(tiny[0], "sekv", {"max_trainable_fraction": 0.01}, budget=64, name="tiny-llama")
    with pytest.raises(ZoomKVError, match="budget"):
        run_eval(_cfg(tmp_path / "c", [str(adapter.save_pretrained(tmp_path / "ok"))], methods=[], budgets=["4"]), *tiny)


def test_a_training_runs_adapter_folder_is_named_after_the_run(tmp_path, saved):
    from zoomkv.runspec import adapter_label

    adapter, folder = saved
    run = adapter.save_pretrained(tmp_path / "my-run" / "adapter")
    sha = adapter.config.weights_sha256[:8]
    assert adapter_label(adapter, str(run)) == f"sekv:my-run@{sha}"
    assert adapter_label(adapter, str(folder)) == f"sekv:sekv-tiny@{sha}"
    assert adapter_label(adapter, "user/zoom-adapter") == f"sekv:user/zoom-adapter@{sha}"


def test_cli_takes_repeated_and_comma_separated_adapters(tmp_path, capsys):
    from zoomkv.cli import build_parser

    args = build_parser().parse_args(["eval", "--adapter", "a,b", "--adapter", "user/c", "--out", str(tmp_path)])
    assert config_from_args(args).adapters == ["a", "b", "user/c"]
    assert main(["eval", "--model", "tiny-llama", "--adapter", str(tmp_path / "none"), "--tasks", "niah_single_1",
                 "--length", "600", "--out", str(tmp_path / "o"), "--quiet"]) == 2
    assert "adapter" in capsys.readouterr().err


def test_an_adapter_takes_the_variants_methods_take(tmp_path, tiny, saved):
    """``DIR+int8`` evaluates the adapter with its host tier in int8: its own rows, a smaller host tier, the
    same device tier; an unknown suffix stays part of the path (and is then not found)."""
    adapter, folder = saved
    out = tmp_path / "run"
    rows = run_eval(_cfg(out, [str(folder), f"{folder}+int8"], methods=[], samples=1), *tiny)
    label = f"sekv:sekv-tiny@{adapter.config.weights_sha256[:8]}"
    plain = next(r for r in rows if r["method"] == label)
    quant = next(r for r in rows if r["method"] == label + "+int8")
    assert 0 < quant["host_bytes"] < 0.5 * plain["host_bytes"]
    assert quant["device_bytes"] == plain["device_bytes"]
    with pytest.raises(AdapterNotFoundError):
        run_eval(_cfg(tmp_path / "b", [f"{folder}+int3"], methods=[]), *tiny)


def test_a_reports_command_names_only_what_selects_the_stored_rows(tmp_path):
    """A report reads stored rows: its recorded command carries the folder's identity, not methods or sample
    counts that would read as the report's own (the rows say those)."""
    from zoomkv.cli import build_parser
    from zoomkv.commands.eval import command_line

    parse = build_parser().parse_args
    report = command_line(parse(["eval", "--model", "smollm2-135m", "--report-only", "--protocol", "query-aware",
                                 "--out", str(tmp_path)]))
    assert "--report-only" in report and "--protocol query-aware" in report and str(tmp_path) in report
    assert "--methods" not in report and "--samples" not in report
    run = command_line(parse(["eval", "--model", "smollm2-135m", "--methods", "quest", "--out", str(tmp_path)]))
    assert "--methods quest" in run and "--samples" in run
