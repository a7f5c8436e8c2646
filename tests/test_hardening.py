"""Hardening (issue 15): training refuses settings out of range and non-finite losses, ``resume`` refuses a
checkpoint of another base model, the adapter checksum is verified on every load path, sizes in an adapter
config are checked before anything is allocated, and export deletes no file it did not write."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from zoomkv.cli import run_command
from zoomkv.errors import ConfigError
from zoomkv.train.config import load_recipe

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "recipes" / "tiny-llama-sekv.yaml"
TINY_SEMANTIC = ROOT / "recipes" / "tiny-llama-semantic-id.yaml"


# -- 1. recipe ranges, non-finite losses ------------------------------------------------------------------


@pytest.mark.parametrize("override, key", [
    ("lr=.nan", "lr"), ("lr=-0.1", "lr"), ("lr=0", "lr"), ("lr=.inf", "lr"), ("budget=0", "budget"),
    ("threads=-2", "threads"), ("weight_decay=-1", "weight_decay"), ("grad_clip=.nan", "grad_clip"),
    ("grad_clip=-1", "grad_clip"), ("steps=0", "steps"), ("seed=-1", "seed"), ("recent=-1", "recent"),
    ("max_trainable_fraction=0", "max_trainable_fraction"), ("layers_per_step=-1", "layers_per_step"),
    ("code_bits=3", "code_bits"), ("anchor_fraction=1.5", "anchor_fraction"), ("w_rank=.nan", "w_rank"),
    ("gain_lr=-1", "gain_lr"), ("rotation_seed=-1", "rotation_seed"), ("sinks=-1", "sinks"),
])
def test_recipe_values_out_of_range_are_refused(override, key):
    with pytest.raises(ConfigError, match=rf"recipe key '{key}' must be"):
        load_recipe(TINY, [override])


@pytest.mark.parametrize("override, key", [("sem_hidden=4", "sem_hidden"), ("pair_rows=1", "pair_rows"),
                                           ("id_bits=31", "id_bits"), ("sem_dim=0", "sem_dim")])
def test_semantic_id_recipe_values_out_of_range_are_refused(override, key):
    with pytest.raises(ConfigError, match=rf"recipe key '{key}' must be"):
        load_recipe(TINY_SEMANTIC, [override])


def test_out_of_range_recipe_exits_2_before_the_model_loads(monkeypatch, capsys):
    import zoomkv.models

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(zoomkv.models, "load_model", no_model)
    for override in ("lr=.nan", "lr=-1", "budget=0", "threads=-2"):
        assert run_command("train", ["--recipe", str(TINY), override], prog="train") == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "must be" in err[0], err
    assert load_recipe(TINY, ["grad_clip=0"]).grad_clip == 0.0  # 0: no clipping, as documented


# A training run whose loss turns NaN at step 3 (after the step-2 checkpoint), through the CLI.
NAN_AT_STEP_3 = textwrap.dedent("""
    import sys
    from zoomkv.methods.sekv.objective import SeKVTraining
    from zoomkv.cli import run_command

    original = SeKVTraining.step_loss

    def step_loss(self, modules, sample, layers, recipe, step, rng):
        loss, logs = original(self, modules, sample, layers, recipe, step, rng)
        return (loss * float("nan"), logs) if step >= 3 else (loss, logs)

    SeKVTraining.step_loss = step_loss
    sys.exit(run_command("train", sys.argv[1:], prog="python -m zoomkv.train"))
""")


def _train(tmp: Path, *extra: str, script: str | None = None) -> subprocess.CompletedProcess:
    head = ["-c", script] if script else ["-m", "zoomkv.train"]
    args = [sys.executable, *head, "--recipe", str(TINY), f"output_dir={tmp / 'runs'}",
            f"teacher_cache={tmp / 'teacher'}", "num_samples=2", "queries_per_sample=3", "steps=4", "save_every=2",
            "layers_per_step=2", *extra]
    return subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=600)


@pytest.fixture(scope="module")
def nan_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    tmp = tmp_path_factory.mktemp("nan")
    return tmp, _train(tmp, script=NAN_AT_STEP_3)


@pytest.mark.heavy
def test_non_finite_loss_stops_the_run_and_saves_nothing_after(nan_run):
    tmp, done = nan_run
    assert done.returncode == 2, done.stderr[-3000:]
    err = [line for line in done.stderr.splitlines() if "error:" in line]
    assert len(err) == 1 and "step 3: the loss is nan" in err[0], done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    run = tmp / "runs" / "sekv-tiny"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000002"]
    assert not (run / "adapter").exists()
    import torch

    from zoomkv.adapters.model import ZoomAdapter

    kept = ZoomAdapter.from_pretrained(run / "checkpoints" / "step_000002")
    assert all(bool(torch.isfinite(p).all()) for p in kept.modules.parameters())


def test_non_finite_gradient_or_update_is_refused():
    import torch
    from accelerate import Accelerator

    from zoomkv.train.guards import NonFiniteTrainingError, gradient_norm, stop_unless_finite

    accelerator = Accelerator(cpu=True)
    module = torch.nn.Linear(2, 2)
    (module.weight.sum() * float("inf")).backward()
    with pytest.raises(NonFiniteTrainingError, match="step 7: the gradient norm is (nan|inf)"):
        stop_unless_finite(accelerator, 7, Path("nowhere"), loss=torch.tensor(1.0), grad_norm=gradient_norm(module))
    with torch.no_grad():
        module.bias.fill_(float("inf"))
    with pytest.raises(NonFiniteTrainingError, match="weights non-finite.*no checkpoint was written"):
        stop_unless_finite(accelerator, 8, Path("nowhere"), adapter=module)
    stop_unless_finite(accelerator, 9, Path("nowhere"), loss=torch.tensor(1.0), grad_norm=torch.tensor(2.0))


# -- 2. resume refuses another base model ----------------------------------------------------------------


@pytest.mark.heavy
def test_resume_refuses_a_checkpoint_of_another_base_model(nan_run):
    tmp, _ = nan_run
    done = _train(tmp, "resume=latest", "model=tiny-qwen3")
    assert done.returncode == 2, done.stderr[-3000:]
    err = [line for line in done.stderr.splitlines() if "error:" in line]
    assert len(err) == 1 and "base model 'tiny-llama', not the recipe's model 'tiny-qwen3'" in err[0], err
    assert "Traceback" not in done.stderr
    checkpoints = tmp / "runs" / "sekv-tiny" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_000002"]
    meta = json.loads((checkpoints / "step_000002" / "adapter_meta.json").read_text())
    assert meta["base_model"]["name"] == "tiny-llama"  # not stamped as the new model


@pytest.fixture(scope="module")
def step_2_checkpoint(tmp_path_factory) -> Path:
    """A tiny run trained in this process to its step-2 checkpoint (what the resume checks read)."""
    tmp = tmp_path_factory.mktemp("run")
    args = ["--recipe", str(TINY), f"output_dir={tmp / 'runs'}", f"teacher_cache={tmp / 'teacher'}", "num_samples=2",
            "queries_per_sample=3", "steps=2", "save_every=2", "layers_per_step=2", "--quiet"]
    assert run_command("train", args, prog="train") == 0
    return tmp / "runs" / "sekv-tiny" / "checkpoints" / "step_000002"


def test_resume_refuses_same_name_other_shape(step_2_checkpoint):
    from zoomkv.models import load_model
    from zoomkv.protocol.shape import base_fingerprint
    from zoomkv.train.checkpoints import check_resume

    folder = step_2_checkpoint
    cfg = load_recipe(TINY)
    check_resume(folder, cfg, base_fingerprint(load_model("tiny-llama")[0], name="tiny-llama"))
    qwen = base_fingerprint(load_model("tiny-qwen3")[0], name="tiny-llama")  # renamed, another architecture
    with pytest.raises(ConfigError, match="differ in model_type"):
        check_resume(folder, cfg, qwen)
    with pytest.raises(ConfigError, match="method 'sekv', not 'semantic_id'"):
        check_resume(folder, load_recipe(TINY_SEMANTIC))


# -- 3. the checksum, on every load path ------------------------------------------------------------------

from tests.test_adapter_artifact import PROBE, fresh_adapter, llama, probe_method  # noqa: E402,F401  (fixtures)
from zoomkv.adapters.config import CONFIG_NAME, WEIGHTS_NAME  # noqa: E402
from zoomkv.adapters.errors import AdapterConfigError, AdapterWeightsError  # noqa: E402
from zoomkv.adapters.model import ZoomAdapter  # noqa: E402


def _edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / CONFIG_NAME).read_text())
    for key, value in changes.items():
        if value is ...:
            config.pop(key, None)
        else:
            config[key] = value
    (folder / CONFIG_NAME).write_text(json.dumps(config))


def _flip_a_byte(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[-3] ^= 0xFF  # inside a tensor: still valid safetensors, other content
    file.write_bytes(bytes(data))


@pytest.mark.parametrize("sha", [None, ...], ids=["null", "missing"])
def test_an_adapter_without_a_checksum_is_refused(tmp_path, probe_method, llama, capsys, sha):  # noqa: F811
    folder = fresh_adapter(llama[0]).save_pretrained(tmp_path / "a")
    _edit_config(folder, weights_sha256=sha)
    with pytest.raises(AdapterWeightsError, match="no checksum recorded"):
        ZoomAdapter.from_pretrained(folder)
    from zoomkv.cli import main

    assert main(["export", str(folder), "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no checksum recorded" in err[0]
    assert not (tmp_path / "b").exists()


def test_checkpoint_files_are_verified_too(tmp_path, probe_method, llama):  # noqa: F811
    from zoomkv.adapters.checkpoint import META_NAME, STATE_NAME, write_checkpoint
    from zoomkv.adapters.export import export_checkpoint

    adapter = fresh_adapter(llama[0])
    c = adapter.config
    ckpt = write_checkpoint(tmp_path / "ckpt", adapter.modules, method=c.method, hyper=c.hyper,
                            base_model=c.base_model, shape=c.model_shape())
    assert ZoomAdapter.from_pretrained(ckpt).config.method == PROBE
    _flip_a_byte(ckpt / STATE_NAME)
    with pytest.raises(AdapterWeightsError, match="checksum mismatch"):
        export_checkpoint(ckpt, tmp_path / "out")
    meta = json.loads((ckpt / META_NAME).read_text())
    del meta["state_sha256"]
    (ckpt / META_NAME).write_text(json.dumps(meta))
    with pytest.raises(AdapterConfigError, match=r"missing field\(s\) \['state_sha256'\]"):
        ZoomAdapter.from_pretrained(ckpt)
    assert not (tmp_path / "out").exists()


def test_resume_verifies_the_checkpoint_and_optimizer_state(step_2_checkpoint, tmp_path):
    import torch

    from zoomkv.train.checkpoints import OPTIMIZER_NAME, load_checkpoint_state

    folder = step_2_checkpoint
    kept = ZoomAdapter.from_pretrained(folder)
    cfg = load_recipe(TINY)
    optimizer = torch.optim.AdamW(cfg.training.param_groups(kept.modules, cfg))
    assert load_checkpoint_state(folder, kept.modules, optimizer) == 2
    copy = tmp_path / "flipped"
    import shutil

    shutil.copytree(folder, copy)
    _flip_a_byte(copy / OPTIMIZER_NAME)
    with pytest.raises(AdapterWeightsError, match="checksum mismatch"):
        load_checkpoint_state(copy, kept.modules, optimizer)



def test_every_peft_load_path_verifies_the_checksum(tmp_path, probe_method, llama):  # noqa: F811
    pytest.importorskip("peft")
    from peft import PeftModel, get_peft_model

    from zoomkv.adapters.peft_integration import ZoomKVPeftConfig
    from zoomkv.adapters.weights import sha256
    from zoomkv.models import load_model

    model = llama[0]
    good = fresh_adapter(model).save_pretrained(tmp_path / "good")
    loaded = PeftModel.from_pretrained(load_model("tiny-llama")[0], str(good))
    flipped = fresh_adapter(model, seed=1).save_pretrained(tmp_path / "flipped")
    _flip_a_byte(flipped / WEIGHTS_NAME)
    null = fresh_adapter(model, seed=2).save_pretrained(tmp_path / "null")
    _edit_config(null, weights_sha256=None)
    for bad, match in ((flipped, "checksum mismatch"), (null, "no checksum recorded")):
        with pytest.raises(AdapterWeightsError, match=match):
            PeftModel.from_pretrained(load_model("tiny-llama")[0], str(bad))
        with pytest.raises(AdapterWeightsError, match=match):
            loaded.load_adapter(str(bad), adapter_name="second")
    # A config made by hand was never checked against the file: refused rather than trusted.
    unverified = ZoomKVPeftConfig.for_model(model, PROBE, {"scale": 4.0})
    with pytest.raises(AdapterWeightsError, match="not verified"):
        PeftModel.from_pretrained(load_model("tiny-llama")[0], str(good), config=unverified)
    # PEFT's own save records the checksum, so what it writes loads everywhere.
    peft_model = get_peft_model(load_model("tiny-llama")[0], ZoomKVPeftConfig.for_model(model, PROBE, {"scale": 4.0}))
    peft_model.save_pretrained(tmp_path / "peft")
    written = json.loads((tmp_path / "peft" / CONFIG_NAME).read_text())["weights_sha256"]
    assert written == sha256((tmp_path / "peft" / WEIGHTS_NAME).read_bytes())
    ZoomAdapter.from_pretrained(tmp_path / "peft")
    PeftModel.from_pretrained(load_model("tiny-llama")[0], str(tmp_path / "peft"))


@pytest.mark.heavy
def test_peft_loads_a_zoomkv_folder_after_just_import_zoomkv(tmp_path, llama):  # noqa: F811
    pytest.importorskip("peft")
    folder = ZoomAdapter.initialise(llama[0], "sekv", {"code_bits": 1, "rotation_seed": 8},
                                    name="tiny-llama").save_pretrained(tmp_path / "sekv")
    script = textwrap.dedent("""
        import sys
        import zoomkv
        assert "peft" not in sys.modules, "import zoomkv imported peft"
        from peft import PeftModel
        from zoomkv.models import load_model
        model = PeftModel.from_pretrained(load_model("tiny-llama")[0], sys.argv[1])
        print(type(model.peft_config["default"]).__name__)
    """)
    done = subprocess.run([sys.executable, "-c", script, str(folder)], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "ZoomKVPeftConfig"


# -- 4. sizes checked before anything is allocated; no path followed -------------------------------------


def _sekv_folder(tmp_path: Path, model) -> Path:
    adapter = ZoomAdapter.initialise(model, "sekv", {"code_bits": 1, "rotation_seed": 8},
                                     name="tiny-llama")
    return adapter.save_pretrained(tmp_path / "sekv")


@pytest.mark.heavy
@pytest.mark.parametrize("head_dim", [10**9, 2 * 10**7])
def test_huge_sizes_in_an_adapter_config_are_refused_before_allocating(tmp_path, llama, head_dim):  # noqa: F811
    folder = _sekv_folder(tmp_path, llama[0])
    config = json.loads((folder / CONFIG_NAME).read_text())
    _edit_config(folder, shape={**config["shape"], "head_dim": head_dim})
    with pytest.raises(AdapterConfigError, match="refused before allocating"):
        ZoomAdapter.from_pretrained(folder)
    # With the base model's size forged too, the weights file's own shapes refuse it, still before allocating:
    # measured in a fresh process, the load's peak memory stays far below the 0.6 GB head_dim=2e7 would take.
    _edit_config(folder, shape={**config["shape"], "head_dim": head_dim, "num_parameters": 10**15})
    script = textwrap.dedent("""
        import resource, sys
        from zoomkv.adapters.model import ZoomAdapter
        from zoomkv.adapters.errors import AdapterShapeError
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            ZoomAdapter.from_pretrained(sys.argv[1])
        except AdapterShapeError as err:
            print("refused:", err)
        print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
    """)
    done = subprocess.run([sys.executable, "-c", script, str(folder)], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    refused, grown_mb = done.stdout.strip().splitlines()[-2:]
    assert refused.startswith("refused:") and "code_gain: file (4, 2, 16)" in refused, done.stdout
    assert int(grown_mb) < 200, done.stdout


def test_bad_sizes_through_the_cli_and_peft(tmp_path, llama, capsys):  # noqa: F811
    from zoomkv.adapters.errors import AdapterShapeError
    from zoomkv.cli import main

    folder = _sekv_folder(tmp_path, llama[0])
    config = json.loads((folder / CONFIG_NAME).read_text())
    for hyper, shape, match in (
        ({"rotation_seed": "abc"}, {}, "'rotation_seed' must be an integer in [0, 2147483647]"),
        ({"code_bits": 3}, {}, "code_bits must be one of (1, 2, 4, 8)"),
        ({"code_bit": 2}, {}, "unknown hyper-parameter(s) ['code_bit']"),  # misspelt: never ignored silently
        ({}, {"head_dim": "x"}, "head_dim must be an integer"),
        ({}, {"layer_types": 7}, "layer_types must be a list"),
    ):
        _edit_config(folder, hyper={**config["hyper"], **hyper}, shape={**config["shape"], **shape})
        assert main(["export", str(folder), "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and match in err[0], err
    pytest.importorskip("peft")
    from peft import PeftModel

    from zoomkv.models import load_model

    _edit_config(folder, hyper=config["hyper"], shape={**config["shape"], "head_dim": 2 * 10**7, "num_parameters": 10**15})
    with pytest.raises(AdapterShapeError, match=r"code_gain: file \(4, 2, 16\)"):
        PeftModel.from_pretrained(load_model("tiny-llama")[0], str(folder))


def test_an_adapter_config_never_names_a_file(tmp_path, llama):  # noqa: F811
    from zoomkv.methods.semantic_id.projector import SemanticProjector

    outside = tmp_path / "outside.safetensors"
    SemanticProjector(16, 8, 16).save(outside)
    adapter = ZoomAdapter.initialise(llama[0], "semantic_id", {"sem_dim": 8, "hidden": 16}, name="tiny-llama")
    folder = adapter.save_pretrained(tmp_path / "sem")
    assert ZoomAdapter.from_pretrained(folder).make_method().config.projector is None
    config = json.loads((folder / CONFIG_NAME).read_text())
    _edit_config(folder, hyper={**config["hyper"], "projector": str(outside)})
    with pytest.raises(ConfigError, match="'projector' names a file"):
        ZoomAdapter.from_pretrained(folder)
    adapter.config.hyper["projector"] = str(outside)  # a config built in code: make_method refuses it too
    with pytest.raises(AdapterConfigError, match=r"\['projector'\] name a file"):
        adapter.make_method()


# -- 5. export deletes nothing it did not write; folders follow the umask ---------------------------------


def test_overwrite_replaces_only_the_adapters_own_files(tmp_path, probe_method, llama, capsys):  # noqa: F811
    from zoomkv.cli import main

    out = fresh_adapter(llama[0], seed=1).save_pretrained(tmp_path / "out")
    (out / "notes.txt").write_text("mine")
    (out / "runs").mkdir()
    (out / "runs" / "log.txt").write_text("also mine")
    (out / "link").symlink_to("notes.txt")
    new = fresh_adapter(llama[0], seed=2).save_pretrained(tmp_path / "new")
    assert main(["export", str(new), "--out", str(out), "--overwrite"]) == 0
    assert (out / "notes.txt").read_text() == "mine"
    assert (out / "runs" / "log.txt").read_text() == "also mine"
    assert (out / "link").is_symlink() and (out / "link").read_text() == "mine"
    assert (out / WEIGHTS_NAME).read_bytes() == (new / WEIGHTS_NAME).read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new", "out"]  # no staging or old folder left
    capsys.readouterr()
    # A file where the folder would go is never replaced.
    (tmp_path / "afile").write_text("keep")
    assert main(["export", str(new), "--out", str(tmp_path / "afile"), "--overwrite"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a folder" in err[0]
    assert (tmp_path / "afile").read_text() == "keep"


def test_a_failed_overwrite_keeps_the_users_files(tmp_path, probe_method, llama, monkeypatch):  # noqa: F811
    import zoomkv.adapters.files as files

    out = fresh_adapter(llama[0], seed=1).save_pretrained(tmp_path / "out")
    (out / "notes.txt").write_text("mine")

    def crash(*args, **kwargs):
        raise OSError("disk gone")

    monkeypatch.setattr(files, "replace_folder", crash)
    with pytest.raises(OSError, match="disk gone"):
        fresh_adapter(llama[0], seed=2).save_pretrained(out, overwrite=True)
    assert (out / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    ZoomAdapter.from_pretrained(out)


@pytest.mark.parametrize("umask, mode", [(0o022, 0o755), (0o077, 0o700), (0o002, 0o775)])
def test_adapter_and_checkpoint_folders_follow_the_umask(tmp_path, probe_method, llama, umask, mode):  # noqa: F811
    import os

    from zoomkv.adapters.checkpoint import write_checkpoint

    adapter = fresh_adapter(llama[0])
    c = adapter.config
    before = os.umask(umask)
    try:
        folder = adapter.save_pretrained(tmp_path / "adapter")
        again = adapter.save_pretrained(tmp_path / "adapter", overwrite=True)
        ckpt = write_checkpoint(tmp_path / "ckpt", adapter.modules, method=c.method, hyper=c.hyper,
                                base_model=c.base_model, shape=c.model_shape())
    finally:
        os.umask(before)
    for path in (folder, again, ckpt):
        assert path.stat().st_mode & 0o777 == mode, (path, oct(path.stat().st_mode))
    assert (folder / WEIGHTS_NAME).stat().st_mode & 0o777 == 0o666 & ~umask
