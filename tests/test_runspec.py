"""One run grammar (``zoomkv.runspec``): ``generate``, ``chat``, ``bench`` and ``eval`` read the same flags and
``+variant`` suffixes into the same ``RunSpec``; a bad spec is one line and exit 2 on every command, before any
model loads; ``bench`` times adapters and variants, labelled as ``eval`` labels them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from zoomkv.adapters.model import ZoomAdapter
from zoomkv.cli import build_parser, main
from zoomkv.cli_args import run_from_args, runs_from_args
from zoomkv.commands import bench as bench_command
from zoomkv.commands.eval import config_from_args
from zoomkv.errors import ZoomKVError
from zoomkv.eval.harness import EvalConfig, method_runs, run_eval
from zoomkv.runspec import RunSpec, adapter_label, parse_run, parse_runs

PACKAGE = Path(__file__).resolve().parents[1] / "zoomkv"


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tiny):
    """A tiny sekv adapter whose weights are not the default init (as tests/test_eval_adapter.py makes one)."""
    adapter = ZoomAdapter.initialise(tiny[0], "sekv", {"max_trainable_fraction": 0.01}, budget=64, name="tiny-llama")
    with torch.no_grad():
        adapter.modules.code_gain[:, :, :4].add_(2.0)
    return adapter, adapter.save_pretrained(tmp_path_factory.mktemp("adapters") / "sekv-tiny")


def _parse(command: str, *argv: str):
    return build_parser().parse_args([command, *argv])


def _named_runs(command: str, *argv: str) -> list[RunSpec]:
    """The runs each command makes of its arguments, without the reference run eval and bench add."""
    if command in ("generate", "chat"):
        extra = ["--context-file", "doc.txt"] if command == "chat" else []
        return [run_from_args(_parse(command, *argv, *extra))]
    if command == "bench":
        runs = runs_from_args(_parse("bench", *argv), default_budgets=bench_command.DEFAULT_BUDGETS)
    else:
        runs = method_runs(config_from_args(_parse("eval", *argv, "--out", "unused")))
    assert runs[0].label == "full" and runs[0].cache.budget is None
    return runs[1:]


def _seen(run: RunSpec) -> tuple:
    c = run.cache
    quant = None if c.kv_quant is None else (c.kv_quant.bits, c.kv_quant.tiers)
    return (run.label, run.budget, run.args, c.method.name, c.method.config, c.tail_summary, quant, c.prefill_chunk)


SPELLINGS = [
    ["--method", "quest+tail+int8", "--budget", "32", "--method-arg", "page_size=8", "--prefill-chunk", "64"],
    ["--methods", "quest", "--budgets", "32", "--tail-summary", "--kv-quant", "int8", "--method-args",
     "quest.page_size=8", "--prefill-chunk", "64"],
    ["--method", "quest+tail", "--budget", "32", "--kv-quant", "int8", "--method-arg", "page_size=8",
     "--prefill-chunk", "64"],
]


@pytest.mark.parametrize("command", ["generate", "chat", "eval"])
def test_every_command_reads_the_same_spec_the_same_way(command):
    """Flags and suffixes mean the same thing on every command: one run, the same cache spec."""
    expected = ("quest+tail+int8", "32", "page_size=8", "quest", None, True, (8, "host"), 64)
    for argv in SPELLINGS:
        (run,) = _named_runs(command, *argv)
        seen = _seen(run)
        assert seen[:4] + seen[5:] == expected[:4] + expected[5:], argv
        assert run.cache.method.config.page_size == 8


def test_bench_reads_the_same_spec():
    """bench's --prefill-chunk adds chunked runs beside the one-shot ones (its comparison): the rest is the same."""
    for argv in SPELLINGS:
        argv = argv[:-2]
        (run,) = _named_runs("bench", *argv)
        assert _seen(run)[:3] == ("quest+tail+int8", "32", "page_size=8")
        assert (run.cache.tail_summary, run.cache.kv_quant.bits, run.cache.method.config.page_size) == (True, 8, 8)


def test_full_with_a_quantization_quantizes_its_device_tier_everywhere():
    for command, argv in [("generate", ["--method", "full", "--kv-quant", "int4"]), ("chat", ["--method", "full+int4"]),
                          ("eval", ["--method", "full+int4"]), ("bench", ["--method", "full+int4"])]:
        (run,) = _named_runs(command, *argv)
        assert (run.label, run.cache.kv_quant.tiers, run.cache.kv_quant.bits) == ("full+int4", "all", 4)
    with pytest.raises(ZoomKVError, match="quantize nothing"):
        parse_run("full", kv_quant="int8", kv_quant_tiers="host")


def _main(argv: list[str]) -> int:
    """The exit status of ``zoomkv ARGV`` (argparse's usage errors exit through SystemExit)."""
    try:
        return main(argv)
    except SystemExit as exit:
        return int(exit.code)


BAD = [
    ("unknown variant", ["--method", "quest+fp8", "--budget", "32"], "+fp8"),
    ("two quantizations", ["--method", "quest+int4", "--kv-quant", "int8", "--budget", "32"], "two quantizations"),
    ("repeated variant", ["--method", "quest+tail+tail", "--budget", "32"], "at most once"),
    ("tail on eviction", ["--method", "snapkv", "--tail-summary", "--budget", "64"], "recallable"),
    ("unknown method", ["--method", "nope", "--budget", "32"], "unknown method 'nope'"),
    ("budget word", ["--method", "quest", "--budget", "lots"], "budget"),
    ("impossible budget", ["--method", "snapkv", "--budget", "4"], "cannot meet a budget of 4"),
    ("no budget", ["--method", "snapkv", "--budgets", ""], "needs a budget"),
    ("method-arg of no run", ["--method", "quest", "--budget", "32", "--method-arg", "snapkv.window=8"], "snapkv"),
    ("empty adapter", ["--adapter", ""], "empty name"),
    ("missing adapter", ["--adapter", "{tmp}/no-such-adapter"], "no-such-adapter"),
]


@pytest.mark.parametrize("command", ["generate", "chat", "bench", "eval"])
@pytest.mark.parametrize("case,argv,message", BAD, ids=[c[0] for c in BAD])
def test_a_bad_spec_is_one_line_and_exit_2_on_every_command(tmp_path, capsys, command, case, argv, message):
    tail = {"generate": ["--prompt", "hi"], "chat": ["--context-file", str(tmp_path / "doc.txt")],
            "bench": ["--length", "64"], "eval": ["--out", str(tmp_path / "out"), "--quiet"]}[command]
    code = _main([command, "--model", "tiny-llama", *[a.replace("{tmp}", str(tmp_path)) for a in argv], *tail])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out" / "rows.jsonl").exists()


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_one_run_commands_refuse_an_adapter_with_a_method_and_lists(tmp_path, capsys, saved, command):
    _, folder = saved
    tail = ["--prompt", "hi"] if command == "generate" else ["--context-file", str(tmp_path / "doc.txt")]
    for argv, message in [(["--adapter", str(folder), "--method", "quest"], "contradicts"),
                          (["--adapter", str(folder), "--method", "full"], "contradicts"),
                          (["--method", "quest,snapkv", "--budget", "32"], "one method"),
                          (["--method", "quest", "--budget", "32,64"], "one budget"),
                          (["--method", ""], "method name"),
                          (["--adapter", str(folder), "--adapter", str(folder)], "one adapter")]:
        code = _main([command, "--model", "tiny-llama", *argv, *tail])
        err = capsys.readouterr().err
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, (argv, err)


def test_an_adapters_spec_carries_its_method_modules_and_budget(saved):
    adapter, folder = saved
    run = parse_run(adapter=f"{folder}+int8", method_args={"*": {"code_bits": 2}})
    assert run.label == f"{adapter_label(adapter, str(folder))}+int8"
    assert run.budget == "64" and run.cache.kv_quant.tiers == "host" and run.args == "code_bits=2"
    assert run.cache.method.config.code_bits == 2
    torch.testing.assert_close(run.cache.method.adapter.code_gain, adapter.modules.code_gain)
    assert parse_run(adapter=str(folder), budget="0.5").budget == "0.5"


def test_bench_times_an_adapter_and_its_variants_labelled_as_eval_labels_them(capsys, tiny, saved):
    adapter, folder = saved
    args = _parse("bench", "--model", "tiny-llama", "--length", "96", "--new-tokens", "3", "--repeats", "1",
                  "--no-warmup", "--methods", "full,quest+int4", "--adapter", f"{folder},{folder}+int8", "--json")
    from zoomkv.bench import run_bench

    rows = run_bench(args, runs_from_args(args, default_budgets=bench_command.DEFAULT_BUDGETS))
    report = json.loads(capsys.readouterr().out)
    label = f"sekv:sekv-tiny@{adapter.config.weights_sha256[:8]}"
    assert [r["method"] for r in report["rows"]] == ["hf", "full", "quest+int4", label, label + "+int8"]
    by = {r["method"]: r for r in rows}
    assert by["quest+int4"]["budget"] == 256 and by[label]["budget"] == 64  # the adapter's own budget
    assert by[label + "+int8"]["device_bytes"] == by[label]["device_bytes"]
    assert 0 < by[label + "+int8"]["host_bytes"] < 0.5 * by[label]["host_bytes"]
    assert all(r["decode_ratio"] > 0 for r in rows)


def test_eval_builds_each_configurations_method_once(tmp_path, tiny, saved, monkeypatch):
    """Not once to check a budget, then once per prompt batch and once for the warm-up."""
    from zoomkv.protocol.method import KVMethod

    _, folder = saved
    built = []
    real_init = KVMethod.__init__

    def counted(self, *args, **kwargs):
        built.append(self.name)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(KVMethod, "__init__", counted)
    cfg = EvalConfig(model="tiny-llama", out=tmp_path / "run", methods=["quest"], budgets=["48", "64"],
                     adapters=[str(folder)], tasks=["niah_single_1"], lengths=[600], samples=3, max_new_tokens=2,
                     progress=False, plots=False)
    rows = run_eval(cfg, *tiny)
    assert len(rows) == 3 * (1 + 2 + 2)
    # the full reference and each configuration once (every prefill's recording cache adds one plain full)
    assert sorted(m for m in built if m != "full") == ["quest", "sekv"]
    assert not hasattr(tiny[0], "zoomkv_adapter")  # attach leaves no write-only attribute on the model


def test_the_budget_is_parsed_at_one_place_per_entry_point():
    """The run grammar (zoomkv.runspec: generate, chat, bench, eval), Python callers (CacheSpec.build), an adapter
    config read from a file, and the budget ``zoomkv export`` records."""
    counts = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
              if (n := len(re.findall(r"Budget\.parse\(", p.read_text(encoding="utf-8"))))}
    assert counts == {"runspec.py": 1, "memory/spec.py": 1, "adapters/config.py": 1, "commands/export.py": 1}


def test_parse_runs_orders_the_reference_methods_then_adapters(saved):
    _, folder = saved
    runs = parse_runs(["quest", "full", "oracle_topk+tail"], [str(folder)], ["32", "32.0", "0.5"], reference=True)
    assert [(r.label.split(":")[0], r.budget) for r in runs] == [
        ("full", None), ("quest", "32"), ("quest", "0.5"), ("oracle_topk+tail", "32"), ("oracle_topk+tail", "0.5"),
        ("sekv", "32"), ("sekv", "0.5")]
    assert runs[1].cache.method is runs[2].cache.method  # one method object per configuration, every budget


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_an_adapter_of_another_base_model_is_refused_by_its_cache(tmp_path, capsys, command):
    """The base-model check travels in the spec (CacheSpec.trained): no command attaches the adapter itself."""
    from zoomkv.models import load_model

    qwen, _ = load_model("tiny-qwen2")
    folder = ZoomAdapter.initialise(qwen, "sekv", {"max_trainable_fraction": 0.01}, budget=64,
                                    name="tiny-qwen2").save_pretrained(tmp_path / "qwen-adapter")
    tail = ["--prompt", "hello " * 40] if command == "generate" else ["--length", "96", "--repeats", "1",
                                                                      "--no-warmup", "--methods", "full"]
    code = _main([command, "--model", "tiny-llama", "--adapter", str(folder), *tail])
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("[bench")]
    assert code == 2 and len(err) == 1 and "tiny-qwen2" in err[0] and "differ in" in err[0], err


def test_a_cache_names_the_base_model_as_load_model_named_it(tiny, saved):
    """A registry model loads from a converted copy (its config's path is that folder): the cache checks the
    adapter against the model's own name, not the folder's, and says nothing."""
    import warnings

    from zoomkv import ZoomCache

    model = tiny[0]
    before = model.config._name_or_path
    model.config._name_or_path = "/somewhere/a-converted-copy"
    try:
        spec = parse_runs(adapters=[str(saved[1])])[0].cache
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ZoomCache(model, spec)
    finally:
        model.config._name_or_path = before
