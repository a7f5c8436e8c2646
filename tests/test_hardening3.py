"""Hardening, round three (issue 43): numbers as users write them, one writer per folder, bounded work, no
traceback on a Ctrl-C at start-up, adapter weights that cannot show what they are, silent cuts said.

Each case fails on the code before the issue and passes after. Bad input is one line on stderr and exit 2
(``run_case``, the fuzz harness's rule). The concurrent cases run two real processes: the first is a real
command held at a known point (a function of it wrapped to wait for a file), the second the plain command.
"""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
import time
from collections import namedtuple
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.test_fuzz_inputs import ST_PROMPT, TINY_RECIPE, _copy, adapters, run_case  # noqa: F401  (fixture)
from zoomkv.cli import main
from zoomkv.errors import ConfigError
from zoomkv.train.config import load_recipe

ROOT = Path(__file__).resolve().parents[1]
RECIPE = TINY_RECIPE.read_text(encoding="utf-8")
SUBPROCESS_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                  "PYTHONPATH": str(ROOT)}


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.chdir(ROOT)


def _recipe(tmp: Path, **changes: str) -> Path:
    """The tiny recipe with ``key: value`` lines replaced (or added), written to a file."""
    lines = [line for line in RECIPE.splitlines() if line.split(":")[0].strip() not in changes]
    path = tmp / "recipe.yaml"
    path.write_text("\n".join(lines + [f"{k}: {v}" for k, v in changes.items()]) + "\n", encoding="utf-8")
    return path


def _only_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err[-2000:]
    return lines[0]


# -- 1. a valid number refused ------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["file", "flag"])
def test_a_float_in_exponent_notation_is_that_number(where, tmp_path):
    """``lr: 1e-3`` (PyYAML reads it as text) trained at 0.001, from the recipe file or the command line; the
    method's own float keys alike."""
    values = {"lr": "1e-3", "w_rank": "5E-1", "anchor_fraction": "2.5e-2"}
    if where == "file":
        cfg = load_recipe(_recipe(tmp_path, **values))
    else:
        cfg = load_recipe(TINY_RECIPE, [f"{k}={v}" for k, v in values.items()])
    assert cfg.lr == 0.001 and isinstance(cfg.lr, float)
    assert cfg.options.w_rank == 0.5 and cfg.options.anchor_fraction == 0.025


def test_a_float_in_exponent_notation_through_the_cli(tmp_path, capsys, monkeypatch):
    code, _ = run_case(["train", "--recipe", str(_recipe(tmp_path, lr="1e-3")), "--dry-run", "lr=2e-3"], "ok",
                       capsys, monkeypatch)
    assert code == 0


@pytest.mark.parametrize("value", ["1e308", "1e309", "1e400", "-1e-3", "1e3"])
@pytest.mark.parametrize("where", ["file", "flag"])
def test_a_float_out_of_range_is_a_range_error(value, where, tmp_path):
    """Out of range (1e308: no learning rate; 1e309: past the largest float) says so, never 'expected float'."""
    with pytest.raises(ConfigError) as caught:
        if where == "file":
            load_recipe(_recipe(tmp_path, lr=value))
        else:
            load_recipe(TINY_RECIPE, [f"lr={value}"])
    assert "recipe key 'lr' must be" in str(caught.value) and "expected" not in str(caught.value)


def test_a_whole_number_in_exponent_notation(tmp_path):
    assert load_recipe(TINY_RECIPE, ["steps=1e1", "save_every=5e0"]).steps == 10
    with pytest.raises(ConfigError, match="recipe key 'steps': expected int"):
        load_recipe(TINY_RECIPE, ["steps=1.5e0"])


@pytest.mark.parametrize("args, expect", [
    (["--method", "h2o", "--budget", "64", "--method-arg", "heavy_ratio=5e-1,recent_ratio=5e-1"], "ok"),
    (["--method", "snapkv", "--budget", "64", "--method-arg", "window=1.6e1"], "ok"),
    (["--method", "h2o", "--budget", "64", "--method-arg", "heavy_ratio=1e400"], "must be a finite number"),
    (["--method", "h2o", "--budget", "64", "--method-arg", "heavy_ratio=nan"], "must be a finite number"),
])
def test_method_args_in_exponent_notation(args, expect, capsys, monkeypatch):
    run_case(["generate", "--model", "tiny-llama", *ST_PROMPT, *args], expect, capsys, monkeypatch)


# -- 2. one writer per folder: two real processes -----------------------------------------------------------

HELD = """
import sys, time
from pathlib import Path
import {module} as target

ready, go = Path({ready!r}), Path({go!r})
original = target.{name}

def held(*args, **kwargs):
    if not ready.exists():  # the first call: say so, and wait for the test to let go
        ready.write_text("held")
        while not go.exists():
            time.sleep(0.05)
    return original(*args, **kwargs)

target.{name} = held
from zoomkv.cli import main
sys.exit(main({argv!r}))
"""


class Held:
    """A real zoomkv command in a process of its own, held inside ``module.name`` until ``release``."""

    def __init__(self, tmp: Path, module: str, name: str, argv: list[str]):
        self.ready, self.go = tmp / "held.ready", tmp / "held.go"
        script = HELD.format(module=module, name=name, ready=str(self.ready), go=str(self.go), argv=argv)
        self.proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env=SUBPROCESS_ENV,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def wait_until_held(self, timeout: float = 240) -> None:
        start = time.monotonic()
        while not self.ready.exists():
            if self.proc.poll() is not None:
                raise AssertionError(f"the first command ended before it was held: {self.proc.communicate()}")
            if time.monotonic() - start > timeout:
                self.proc.kill()
                raise AssertionError("the first command was never held")
            time.sleep(0.1)

    def release(self) -> tuple[int, str]:
        self.go.write_text("go")
        _, err = self.proc.communicate(timeout=600)
        return self.proc.returncode, err


def _zoomkv(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zoomkv", *argv], cwd=ROOT, env=SUBPROCESS_ENV,
                          capture_output=True, text=True, timeout=600)


def _refused_by(second: subprocess.CompletedProcess, first: Held, folder: Path) -> None:
    """The second command: exit 2, one line naming the folder and the first command's pid and host."""
    assert second.returncode == 2, second.stderr[-2000:]
    line = _only_line(second.stderr)
    assert str(folder) in line and f"pid {first.proc.pid} on " in line and "being written" in line, line


def _train_args(out: Path, *extra: str) -> list[str]:
    return ["train", "--recipe", str(TINY_RECIPE), f"output_dir={out}", "run_name=mix", "num_samples=2",
            "queries_per_sample=3", "steps=2", "save_every=1", "layers_per_step=2", "-q", *extra]


@pytest.mark.heavy
def test_two_trainings_of_one_run_folder(tmp_path):
    """The second `zoomkv train run_name=mix` (other lr and seed) is refused naming the folder and the holder;
    the folder holds the first run alone, and no lock file is left."""
    runs = tmp_path / "runs"
    first = Held(tmp_path, "zoomkv.train.loop", "train_step", _train_args(runs))
    first.wait_until_held()
    second = _zoomkv(*_train_args(runs, "lr=0.02", "seed=1"))
    _refused_by(second, first, runs / "mix")
    code, err = first.release()
    assert code == 0, err[-2000:]
    saved = yaml.safe_load((runs / "mix" / "adapter" / "train_config.yaml").read_text())
    assert saved["lr"] == 0.05 and saved["seed"] == 0  # the first run's, not the second's
    assert not (runs / "mix" / ".zoomkv-lock").exists()


@pytest.mark.heavy
def test_two_trainings_started_together_never_both_succeed(tmp_path):
    """The issue's own case, unheld (two runs of one run_name started together: both passed the run folder's
    guard, both trained into it, both said "adapter saved"): whichever takes the folder second is refused in
    one line (by the lock while the first trains, by the run folder's guard after it)."""
    runs = tmp_path / "runs"
    first = subprocess.Popen([sys.executable, "-m", "zoomkv", *_train_args(runs)], cwd=ROOT, env=SUBPROCESS_ENV,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    second = _zoomkv(*_train_args(runs, "lr=0.02", "seed=1"))
    _, first_err = first.communicate(timeout=600)
    codes = sorted([first.returncode, second.returncode])
    assert codes == [0, 2], (first_err[-1500:], second.stderr[-1500:])
    loser = second.stderr if second.returncode == 2 else first_err
    assert str(runs / "mix") in _only_line(loser)


def _eval_args(out: Path) -> list[str]:
    return ["eval", "--model", "tiny-llama", "--tasks", "niah_single_1", "--length", "512", "--samples", "2",
            "--max-new-tokens", "2", "--methods", "snapkv", "--budgets", "64", "--no-plots", "--quiet", "--out",
            str(out)]


@pytest.mark.heavy
def test_two_evals_into_one_out(tmp_path):
    """The second eval into one --out is refused; the first writes every row once."""
    out = tmp_path / "eval"
    first = Held(tmp_path, "zoomkv.eval.harness", "generate_methods", _eval_args(out))
    first.wait_until_held()
    _refused_by(_zoomkv(*_eval_args(out)), first, out)
    code, err = first.release()
    assert code == 0, err[-2000:]
    rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    keys = [(r["method"], r["budget"], r["task"], r["sample"]) for r in rows]
    assert len(keys) == len(set(keys)) == 4  # full and snapkv, 2 samples each, each once
    assert not (out / ".zoomkv-lock").exists()


@pytest.fixture(scope="module")
def sekv_adapter(tmp_path_factory) -> Path:
    from zoomkv.adapters.model import ZoomAdapter
    from zoomkv.models import load_model

    model = load_model("tiny-llama")[0]
    adapter = ZoomAdapter.initialise(model, "sekv", {"code_bits": 1, "rotation_seed": 8}, name="tiny-llama",
                                     budget=64)
    return adapter.save_pretrained(tmp_path_factory.mktemp("adapter") / "sekv")


@pytest.mark.heavy
def test_two_exports_into_one_out(tmp_path, sekv_adapter):
    """The second export into one --out is refused while the first writes it (it used to call the first one's
    folder an interrupted export); the first finishes, and nothing of the lock or its staging is left."""
    out = tmp_path / "exported"
    first = Held(tmp_path, "zoomkv.adapters.files", "_write_file", ["export", str(sekv_adapter), "--out", str(out)])
    first.wait_until_held()
    _refused_by(_zoomkv("export", str(sekv_adapter), "--out", str(out)), first, out)
    code, err = first.release()
    assert code == 0, err[-2000:]
    from zoomkv.adapters.model import ZoomAdapter

    ZoomAdapter.from_pretrained(out)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_a_lock_left_by_a_killed_command_is_taken_over(tmp_path, sekv_adapter, capsys, monkeypatch):
    """flock is let go by the kernel however its holder ends: a lock file a SIGKILL left behind holds nobody."""
    out = tmp_path / "exported"
    (tmp_path / ".exported.zoomkv-lock").write_text("zoomkv export (pid 999999 on gone, since then)\n")
    run_case(["export", str(sekv_adapter), "--out", str(out)], "ok", capsys, monkeypatch)
    assert not (tmp_path / ".exported.zoomkv-lock").exists()


def test_a_file_of_the_users_where_the_lock_goes_is_never_written(tmp_path, capsys, monkeypatch):
    out = tmp_path / "eval"
    out.mkdir()
    (out / ".zoomkv-lock").write_text("my notes\n")
    run_case(["eval", "--model", "tiny-llama", "--tasks", "niah_single_1", "--length", "512", "--samples", "1",
              "--max-new-tokens", "2", "--no-plots", "--quiet", "--out", str(out)], "not one of zoomkv's", capsys,
             monkeypatch)
    assert (out / ".zoomkv-lock").read_text() == "my notes\n"


def test_the_lock_is_refused_in_one_line_in_process(tmp_path, capsys, monkeypatch):
    """What a held run folder looks like to a second train of it (the lock held here, by this test)."""
    from zoomkv.locks import lock_inside

    runs = tmp_path / "runs"
    with lock_inside(runs / "mix", "train", "run folder"):
        run_case(_train_args(runs), f"run folder {runs / 'mix'} is being written by zoomkv train (pid {os.getpid()}",
                 capsys, monkeypatch)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # the folders the lock made went with it


# -- 3. bounded work ----------------------------------------------------------------------------------------


def test_steps_1e30_is_refused_before_anything_is_written(tmp_path, capsys, monkeypatch):
    recipe = _recipe(tmp_path, steps="1e30")
    run_case(["train", "--recipe", str(recipe), f"output_dir={tmp_path / 'runs'}"], "recipe key 'steps' must be at "
             "most 10,000,000", capsys, monkeypatch)
    assert not (tmp_path / "runs").exists()


def test_checkpoints_that_would_not_fit_are_refused_before_the_first_step(tmp_path, capsys, monkeypatch):
    import zoomkv.atomic as atomic

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(atomic.shutil, "disk_usage", lambda path: usage(2**30, 2**30 - 5 * 2**20, 5 * 2**20))
    run_case(_train_args(tmp_path / "runs", "steps=100000", "save_every=1"), "100,000 checkpoints of", capsys,
             monkeypatch)
    assert not (tmp_path / "runs").exists()


def test_a_teacher_cache_that_would_not_fit_is_refused_before_it_is_written(tmp_path, capsys, monkeypatch):
    """The teacher signals of 64 samples of 2K tokens (every layer's keys and values) do not fit in 5 MB: refused
    before the extraction, naming the size, and nothing of the cache written. With room, the estimate is what the
    samples take (within 10%)."""
    import zoomkv.atomic as atomic
    from zoomkv.data.training import Sample
    from zoomkv.models import load_model
    from zoomkv.protocol.shape import ModelShape
    from zoomkv.train import teacher

    usage = namedtuple("usage", "total used free")
    real = shutil.disk_usage
    monkeypatch.setattr(atomic.shutil, "disk_usage", lambda path: usage(2**30, 2**30 - 5 * 2**20, 5 * 2**20))
    cache = tmp_path / "cache"
    run_case(_train_args(tmp_path / "runs", "num_samples=64", "min_length=2048", "max_length=2048",
                         f"teacher_cache={cache}"), "the teacher signals of 64 samples take", capsys, monkeypatch)
    assert not cache.exists()
    monkeypatch.setattr(atomic.shutil, "disk_usage", real)

    model, tokenizer = load_model("tiny-llama")[:2]
    shape = ModelShape.from_config(model.config)
    samples = [Sample(text, "", "plain", 0) for text in ("a b c " * 200, "x y " * 150)]
    paths = teacher.build_cache(model, tokenizer, samples, cache, n_queries=3, min_pos=64, recent=16,
                                fingerprint={}, show_progress=False)
    for sample, path in zip(samples, paths, strict=True):
        expected = teacher.sample_bytes(shape, teacher.encode(tokenizer, sample.text).shape[1], 3, 64)
        assert 0.9 * expected <= path.stat().st_size <= expected
    # --dry-run says it before anything runs: the 8B recipe's 256 samples of 2K to 16K tokens take ~325 GB
    assert main(["train", "--recipe", str(ROOT / "recipes/llama-3-8b/sekv.yaml"), "--dry-run"]) == 0
    assert "teacher cache: about 325.0 GB on disk for 256 samples" in capsys.readouterr().out


def test_a_missing_dependency_is_one_line_naming_what_to_install(tmp_path, capsys, monkeypatch):
    """A package zoomkv requires but imports only where a command needs it (``datasets``, for every text source)
    missing from the environment: one line naming it and the pip command, exit 2, nothing written. A missing
    module zoomkv does not declare is a bug: it is not dressed up as one line."""
    from zoomkv.cli import missing_dependency

    texts = tmp_path / "texts"  # a folder of the user's text (a shipped corpus, once loaded, stays in memory)
    texts.mkdir()
    (texts / "a.txt").write_text("Some prose of the user's. " * 200, encoding="utf-8")
    monkeypatch.setitem(sys.modules, "datasets", None)
    run_case(_train_args(tmp_path / "runs", f"data={texts}", "tasks=plain:1"), "the package 'datasets', which "
             "zoomkv requires, is not installed: pip install 'datasets", capsys, monkeypatch)
    assert not (tmp_path / "runs").exists()
    assert missing_dependency(ModuleNotFoundError("no module named x", name="no_such_package")) is None
    assert "pip install 'pyyaml" in missing_dependency(ModuleNotFoundError("no module named yaml", name="yaml"))


# -- 4. one huge record -------------------------------------------------------------------------------------


def test_a_huge_record_is_cut_by_characters_before_it_is_tokenized(tmp_path, capsys, monkeypatch):
    """A 20 MB context at --length 256: the tokenizer never sees more than what 256 tokens can hold."""
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    seen: list[int] = []
    call = PreTrainedTokenizerBase.__call__

    def spy(self, text=None, *args, **kwargs):  # noqa: ANN001
        seen.extend(len(t) for t in (text if isinstance(text, list | tuple) else [text]) if isinstance(t, str))
        return call(self, text, *args, **kwargs)

    monkeypatch.setattr(PreTrainedTokenizerBase, "__call__", spy)
    words = "the grass is green and the sky is blue " * (20 * 2**20 // 40)
    data = tmp_path / "huge.jsonl"
    data.write_text(json.dumps({"prompt": "What is the pass key?", "answers": ["71934"],
                                "context": "The pass key is 71934. " + words}) + "\n", encoding="utf-8")
    run_case(["eval", "--model", "tiny-llama", "--data", str(data), "--length", "256", "--max-new-tokens", "2",
              "--samples", "1", "--no-plots", "--quiet", "--out", str(tmp_path / "out")], "ok", capsys, monkeypatch)
    assert seen and max(seen) < 2**20, f"the tokenizer was handed {max(seen):,} characters"
    rows = [json.loads(line) for line in (tmp_path / "out" / "rows.jsonl").read_text().splitlines()]
    assert all(r["prompt_tokens"] <= 256 for r in rows)


# -- 5. Ctrl-C during start-up ------------------------------------------------------------------------------

SIGINT_ON_IMPORT = """
# A real SIGINT, delivered while `import transformers` runs (the package imports it at start-up).
import importlib.abc, os, signal, sys

class Interrupt(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "transformers":
            sys.meta_path.remove(self)
            # as in a terminal: a run started in the background inherits SIGINT ignored, and would not see it
            signal.signal(signal.SIGINT, signal.default_int_handler)
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, Interrupt())
"""

CONSOLE_SCRIPT = """
import sys
from zoomkv.cli import main
if __name__ == "__main__":
    sys.exit(main())
"""


@pytest.fixture(scope="module")
def interrupted_start(tmp_path_factory) -> dict[str, Any]:
    hook = tmp_path_factory.mktemp("sigint")
    (hook / "sitecustomize.py").write_text(SIGINT_ON_IMPORT)
    (hook / "zoomkv").write_text(CONSOLE_SCRIPT)  # what pip's console script does, under the same name
    return {"dir": hook, "env": {**SUBPROCESS_ENV, "PYTHONPATH": f"{hook}{os.pathsep}{ROOT}"}}


@pytest.mark.parametrize("argv", [["-m", "zoomkv", "methods"], ["{dir}/zoomkv", "methods"],
                                  ["-m", "zoomkv.train", "--recipe", str(TINY_RECIPE), "--dry-run"]],
                         ids=["python-m-zoomkv", "console-script", "python-m-zoomkv.train"])
def test_ctrl_c_while_importing_is_one_line_and_exit_130(argv, interrupted_start):
    argv = [a.format(dir=interrupted_start["dir"]) for a in argv]
    done = subprocess.run([sys.executable, *argv], cwd=ROOT, env=interrupted_start["env"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 130, done.stderr[-2000:]
    assert _only_line(done.stderr) == "zoomkv: interrupted"


def test_a_program_importing_zoomkv_still_gets_its_keyboard_interrupt(interrupted_start):
    done = subprocess.run([sys.executable, "-c", "import zoomkv"], cwd=ROOT, env=interrupted_start["env"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "KeyboardInterrupt" in done.stderr


# -- 6. weights that cannot show what they are ---------------------------------------------------------------


def _without_identity(folder: Path, **hyper: Any) -> None:
    """The issue's edit: the config's hyper-parameters changed, the weights' identity record removed (the same
    tensors), the checksum recomputed to match."""
    from safetensors.torch import load_file, save_file

    from zoomkv.adapters.weights import sha256

    weights = folder / "adapter_model.safetensors"
    save_file(load_file(weights), str(weights))
    config = json.loads((folder / "adapter_config.json").read_text())
    config["hyper"].update(hyper)
    config["weights_sha256"] = sha256(weights.read_bytes())
    (folder / "adapter_config.json").write_text(json.dumps(config))


def test_weights_without_identity_are_refused_with_the_command_that_re_exports_them(
        tmp_path, adapters, capsys, monkeypatch):  # noqa: F811
    folder = _copy(adapters, "sekv", tmp_path)
    _without_identity(folder, rotation_seed=9)
    generate = ["generate", "--model", "tiny-llama", *ST_PROMPT, "--adapter"]
    _, line = run_case([*generate, str(folder)], "record no identity", capsys, monkeypatch)
    command = shlex.split(line.split("re-export them: ", 1)[1])
    assert command[:2] == ["zoomkv", "export"] and "--stamp-identity" in command
    run_case(command[1:], "ok", capsys, monkeypatch)  # the command it gives works, and its output loads
    stamped = Path(command[command.index("--out") + 1])
    run_case([*generate, str(stamped)], "ok", capsys, monkeypatch)
    from zoomkv.adapters.weights import read_identity

    assert read_identity(stamped / "adapter_model.safetensors")["hyper"]["rotation_seed"] == 9


def test_a_training_checkpoint_without_identity_is_refused_too(tmp_path, adapters, capsys, monkeypatch):  # noqa: F811
    from safetensors.torch import load_file, save_file

    from zoomkv.adapters.checkpoint import write_checkpoint
    from zoomkv.adapters.model import ZoomAdapter
    from zoomkv.adapters.weights import sha256

    c = ZoomAdapter.from_pretrained(adapters["sekv"]).config
    folder = write_checkpoint(tmp_path / "step_000002", ZoomAdapter.from_pretrained(adapters["sekv"]).modules,
                              method=c.method, hyper=c.hyper, base_model=c.base_model, shape=c.model_shape(),
                              budget=c.budget)
    state = folder / "adapter_state.safetensors"
    save_file(load_file(state), str(state))
    meta = json.loads((folder / "adapter_meta.json").read_text())
    meta["state_sha256"] = sha256(state.read_bytes())
    (folder / "adapter_meta.json").write_text(json.dumps(meta))
    run_case(["export", str(folder), "--out", str(tmp_path / "out")], "--stamp-identity", capsys, monkeypatch)
    run_case(["export", str(folder), "--out", str(tmp_path / "out"), "--stamp-identity"], "ok", capsys, monkeypatch)


def test_peft_saves_weights_that_record_their_identity(tmp_path):
    peft = pytest.importorskip("peft")
    from zoomkv.adapters.model import ZoomAdapter
    from zoomkv.adapters.peft_integration import ZoomKVPeftConfig
    from zoomkv.adapters.weights import read_identity
    from zoomkv.models import load_model

    model = load_model("tiny-llama")[0]
    config = ZoomKVPeftConfig.for_model(model, "sekv", {"code_bits": 1, "rotation_seed": 8}, budget=64,
                                        name="tiny-llama")
    peft.get_peft_model(model, config).save_pretrained(tmp_path / "peft")
    assert read_identity(tmp_path / "peft" / "adapter_model.safetensors")["method"] == "sekv"
    ZoomAdapter.from_pretrained(tmp_path / "peft")


# -- 7. records cut without a word --------------------------------------------------------------------------


def _long_records(path: Path, lengths: list[int]) -> Path:
    filler = "the grass is green and the sky is blue. "
    path.write_text("".join(json.dumps({"prompt": "What is the pass key?", "answers": ["71934"],
                                        "context": "The pass key is 71934. " + filler * n}) + "\n"
                            for n in lengths), encoding="utf-8")
    return path


@pytest.mark.parametrize("length, expect", [(None, "2 of 3 records are"), ("4096", None)],
                         ids=["length-defaulted", "length-given"])
def test_records_cut_to_the_length_are_said(length, expect, tmp_path, capsys, monkeypatch):
    """Without --length, records longer than what runs are cut with a warning that says how many and to what;
    with --length the user asked for that cut (no warning)."""
    # tiny-llama's tokenizer takes a byte a token: ~0.8K, ~6K and ~8K tokens, against its 4K
    data = _long_records(tmp_path / "long.jsonl", [20, 150, 200])
    argv = ["eval", "--model", "tiny-llama", "--data", str(data), "--max-new-tokens", "1", "--samples", "3",
            "--no-plots", "--quiet", "--out", str(tmp_path / "out"), *(["--length", length] if length else [])]
    code, err = run_case(argv, "ok", capsys, monkeypatch)
    warned = [line for line in err.splitlines() if "records are" in line]
    if expect is None:
        assert warned == []
    else:
        assert len(warned) == 1 and expect in warned[0] and "cut in the middle" in warned[0], err


# -- 8. a key given twice in adapter_config.json -------------------------------------------------------------


@pytest.mark.parametrize("key, value", [("budget", "32"), ("code_bits", "2")], ids=["top-level", "in-hyper"])
def test_a_key_given_twice_in_adapter_config_is_refused(key, value, tmp_path, adapters, capsys,  # noqa: F811
                                                         monkeypatch):
    folder = _copy(adapters, "sekv", tmp_path)
    config = folder / "adapter_config.json"
    text = config.read_text()
    first = re.search(rf'\n(\s*)"{key}": [^,\n]+', text)
    assert first is not None
    text = text[:first.end()] + f',\n{first.group(1)}"{key}": {value}' + text[first.end():]
    config.write_text(text)
    json.loads(text)  # valid JSON, which keeps the last value
    run_case(["export", str(folder), "--out", str(tmp_path / "out")], f"key '{key}' is given twice", capsys,
             monkeypatch)


# -- also seen -------------------------------------------------------------------------------------------------


def test_chat_refuses_non_utf8_stdin_as_the_context_file_does(tmp_path, capsys, monkeypatch):
    """Python's own stdin under a C locale reads with surrogateescape: the bytes came through as '?'."""
    doc = tmp_path / "doc.txt"
    doc.write_text("The pass key is 71934. " * 8)
    stdin = io.TextIOWrapper(io.BytesIO(b"what is \xff\xfe the key?\n"), encoding="utf-8", errors="surrogateescape")
    monkeypatch.setattr(sys, "stdin", stdin)
    code = main(["chat", "--model", "tiny-llama", "--context-file", str(doc), "--max-new-tokens", "2",
                 "--chat", "off"])
    assert code == 2
    assert "not UTF-8" in _only_line(capsys.readouterr().err)


def test_an_aside_folder_that_cannot_be_deleted_is_said_and_stays_marked(tmp_path, sekv_adapter, caplog):
    """An old folder holding an immutable file cannot be deleted after the replace: a warning names it and its
    mark stays (it used to be left hidden, unmarked and unmentioned)."""
    from zoomkv.adapters.model import ZoomAdapter
    from zoomkv.atomic import OWNED_MARK

    if shutil.which("chattr") is None:
        pytest.skip("no chattr")
    out = ZoomAdapter.from_pretrained(sekv_adapter).save_pretrained(tmp_path / "out")
    notes = out / "notes.txt"
    notes.write_text("mine")
    if subprocess.run(["chattr", "+i", str(notes)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not allowed here")
    try:
        with caplog.at_level("WARNING"):
            ZoomAdapter.from_pretrained(sekv_adapter).save_pretrained(out, overwrite=True)
        aside = [p for p in tmp_path.iterdir() if p.name.startswith(".out.old-")]
        assert len(aside) == 1 and (aside[0] / OWNED_MARK).is_file()
        assert any(str(aside[0]) in r.getMessage() and "notes.txt" in r.getMessage() for r in caplog.records)
        assert (out / "notes.txt").read_text() == "mine"
    finally:
        for path in tmp_path.rglob("notes.txt"):
            subprocess.run(["chattr", "-i", str(path)], capture_output=True)


@pytest.mark.heavy
def test_hub_tests_pass_on_an_offline_cluster():
    """HF_HUB_OFFLINE=1 in the environment (many offline clusters set it) does not fail the loopback Hub tests."""
    env = {**SUBPROCESS_ENV, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/test_adapter_hub.py"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, textwrap.shorten(done.stdout[-3000:], 3000)
