"""The adapter artefact: config, weights, export, loading, errors, model card, offline Hub cache, CLI.

A test-only trained method (``adapter_probe``) stands in for sekv / semantic_id: oracle top-k recall
whose scoring query is shifted by a learned per-layer, per-KV-head vector from its adapter module, so the
recalled rows, and so the generated tokens, depend on the adapter's weights. It is registered by a
fixture and removed afterwards, so the generic method-invariant tests never see it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from zoomkv.adapters.card import load_scores, render_card
from zoomkv.adapters.checkpoint import STATE_NAME, write_checkpoint
from zoomkv.adapters.config import CONFIG_NAME, WEIGHTS_NAME, ZoomAdapterConfig
from zoomkv.adapters.errors import (
    AdapterConfigError,
    AdapterError,
    AdapterExistsError,
    AdapterKeysError,
    AdapterNotFoundError,
    AdapterOfflineError,
    AdapterShapeError,
    AdapterVersionError,
    AdapterWeightsError,
    BaseModelMismatchError,
)
from zoomkv.adapters.export import export_checkpoint
from zoomkv.adapters.model import ZoomAdapter, cache_from_adapter
from zoomkv.adapters.weights import sha256, tensors_to_bytes
from zoomkv.compat import generate_cache_kwargs
from zoomkv.errors import ZoomKVError
from zoomkv.methods.oracle_topk import OracleTopK, OracleTopKConfig
from zoomkv.models import load_model
from zoomkv.protocol.method import Selection, group_query
from zoomkv.protocol.recallable import padding_bias, recall_rows
from zoomkv.protocol.registry import register_method, unregister_method
from zoomkv.protocol.shape import ModelShape
from zoomkv.protocol.training import MethodTraining

PROBE = "adapter_probe"


class ProbeModules(torch.nn.Module):
    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.query_shift = torch.nn.Parameter(torch.randn(num_layers, kv_heads, head_dim) * scale)
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))


class ProbeTraining(MethodTraining):
    def build_modules(self, shape: ModelShape, hyper: dict[str, Any]) -> torch.nn.Module:
        return ProbeModules(shape.num_layers, shape.num_kv_heads, shape.head_dim, float(hyper.get("scale", 1.0)))

    def with_modules(self, config: ProbeConfig, modules: torch.nn.Module | None) -> ProbeMethod:
        method = ProbeMethod(config)
        method.adapter = modules
        return method


@dataclass
class ProbeConfig(OracleTopKConfig):
    scale: float = 1.0


class ProbeMethod(OracleTopK):
    name = PROBE
    config_class = ProbeConfig
    summary = "test-only: oracle top-k with a learned query shift"
    adapter: torch.nn.Module | None = None  # set by ProbeTraining.with_modules

    def select(self, memory, query: torch.Tensor) -> Selection:
        keys = memory.host_tier["keys"].view()
        n = keys.shape[2]
        k = min(memory.meta["budget"], n)
        q = group_query(query, keys.shape[1]).to(keys.device)
        if self.adapter is not None:
            shift = self.adapter.query_shift[memory.layer_idx].to(q.dtype)  # [kv_heads, d]
            q = q + shift[None, :, None, :]
        score = torch.matmul(q, keys.transpose(-1, -2)).float().amax(dim=2)
        idx = score.topk(k, dim=-1).indices.sort(dim=-1).values if k < n else None
        rk, rv, idx = recall_rows(memory, memory.host_tier["keys"], memory.host_tier["values"], idx)
        return Selection(rk, rv, padding_bias(None, idx, keys.shape[1], query.dtype, query.device))


@pytest.fixture
def probe_method():
    register_method(PROBE, ProbeConfig, ProbeMethod, training=ProbeTraining())
    yield PROBE
    unregister_method(PROBE)


@pytest.fixture(scope="module")
def llama():
    return load_model("tiny-llama")


@pytest.fixture(scope="module")
def qwen():
    return load_model("tiny-qwen3")


PROMPT = "The pass key is 71934. Remember it. " + "Grass is green, the sky is blue. " * 12 + "The pass key is"


def fresh_adapter(model, seed: int = 0, scale: float = 4.0) -> ZoomAdapter:
    torch.manual_seed(seed)
    return ZoomAdapter.initialise(model, PROBE, {"scale": scale}, budget=8)


def run(model, tokenizer, adapter: ZoomAdapter, budget: int = 8, new: int = 12) -> list[int]:
    inputs = tokenizer([PROMPT], return_tensors="pt")
    cache = cache_from_adapter(model, adapter, budget)
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=new, do_sample=False, min_new_tokens=new,
                             pad_token_id=tokenizer.pad_token_id, **generate_cache_kwargs(cache))
    return out[0, inputs["input_ids"].shape[1]:].tolist()


# ----------------------------------------------------------------------------------------- round trip
def test_round_trip_same_tokens(tmp_path, probe_method, llama):
    model, tok = llama
    adapter = fresh_adapter(model)
    before = run(model, tok, adapter)
    out = adapter.save_pretrained(tmp_path / "probe")
    assert sorted(p.name for p in out.iterdir()) == ["README.md", CONFIG_NAME, WEIGHTS_NAME]
    loaded = ZoomAdapter.from_pretrained(out)
    for key, value in adapter.modules.state_dict().items():
        assert torch.equal(value, loaded.modules.state_dict()[key])
    assert run(model, tok, loaded) == before
    # The weights do steer the method: other weights recall other rows.
    other = fresh_adapter(model, seed=1, scale=50.0)
    assert run(model, tok, other) != before or not torch.equal(other.modules.query_shift, adapter.modules.query_shift)


def test_config_is_sorted_versioned_and_fingerprinted(tmp_path, probe_method, llama):
    model, _ = llama
    out = fresh_adapter(model).save_pretrained(tmp_path / "a")
    text = (out / CONFIG_NAME).read_text()
    data = json.loads(text)
    assert list(data) == sorted(data)
    assert data["format_version"] == 1 and data["method"] == PROBE and data["hyper"] == {"scale": 4.0}
    assert data["base_model"]["name"] == "tiny-llama" and data["base_model"]["num_layers"] == 4
    assert data["toolkit_version"] and 0 < data["trainable_fraction"] < 1 and data["budget"] == 8
    # Deterministic: saving the same adapter again gives the same bytes.
    again = ZoomAdapter.from_pretrained(out).save_pretrained(tmp_path / "b")
    assert (again / CONFIG_NAME).read_text() == text
    assert (again / WEIGHTS_NAME).read_bytes() == (out / WEIGHTS_NAME).read_bytes()


# ----------------------------------------------------------------------------------------- errors
def test_wrong_base_model_names_both(tmp_path, probe_method, llama, qwen):
    adapter = fresh_adapter(llama[0])
    with pytest.raises(BaseModelMismatchError) as err:
        adapter.attach(qwen[0])
    msg = str(err.value)
    assert "tiny-llama" in msg and "tiny-qwen3" in msg and "model_type" in msg and "'llama'" in msg
    with pytest.raises(BaseModelMismatchError):
        cache_from_adapter(qwen[0], adapter, 8)
    saved = adapter.save_pretrained(tmp_path / "a")
    with pytest.raises(BaseModelMismatchError):
        ZoomAdapter.from_pretrained(saved, model=qwen[0])


def test_same_architecture_other_size_is_refused(probe_method, llama):
    adapter = fresh_adapter(llama[0])
    adapter.config.base_model = {**adapter.config.base_model, "hidden_size": 999, "name": "other-model"}
    with pytest.raises(BaseModelMismatchError, match=r"other-model.*tiny-llama.*hidden_size: adapter 999"):
        adapter.check_base(llama[0])


@pytest.fixture
def saved(tmp_path, probe_method, llama) -> Path:
    return fresh_adapter(llama[0]).save_pretrained(tmp_path / "saved")


def test_truncated_weights(saved):
    data = (saved / WEIGHTS_NAME).read_bytes()
    (saved / WEIGHTS_NAME).write_bytes(data[: len(data) // 2])
    with pytest.raises(AdapterWeightsError, match="corrupt or truncated"):
        ZoomAdapter.from_pretrained(saved)
    # Also caught by safetensors itself when the checksum recorded is that of the truncated file.
    config = json.loads((saved / CONFIG_NAME).read_text())
    config["weights_sha256"] = sha256((saved / WEIGHTS_NAME).read_bytes())
    (saved / CONFIG_NAME).write_text(json.dumps(config))
    with pytest.raises(AdapterWeightsError, match="not a readable safetensors"):
        ZoomAdapter.from_pretrained(saved)


def test_corrupt_weights_bytes(saved):
    data = bytearray((saved / WEIGHTS_NAME).read_bytes())
    data[-3] ^= 0xFF  # a flipped bit in a tensor: valid safetensors, wrong content
    (saved / WEIGHTS_NAME).write_bytes(bytes(data))
    with pytest.raises(AdapterWeightsError, match="checksum"):
        ZoomAdapter.from_pretrained(saved)
    (saved / WEIGHTS_NAME).write_bytes(b"\x00" * 7)
    with pytest.raises(AdapterWeightsError):
        ZoomAdapter.from_pretrained(saved)


def _rewrite_weights(folder: Path, tensors: dict[str, torch.Tensor], *, identity: bool = True) -> None:
    """New weights, with their checksum recorded (the checksum is never optional) and, unless ``identity`` is
    False, the identity of the config beside them (weights that record none are refused before their keys and
    shapes are looked at)."""
    if identity:
        stamp = ZoomAdapterConfig.from_json_file(folder / CONFIG_NAME).weights_identity()
        (folder / WEIGHTS_NAME).write_bytes(tensors_to_bytes(tensors, stamp))
    else:
        save_file(tensors, str(folder / WEIGHTS_NAME))
    config = json.loads((folder / CONFIG_NAME).read_text())
    config["weights_sha256"] = sha256((folder / WEIGHTS_NAME).read_bytes())
    (folder / CONFIG_NAME).write_text(json.dumps(config))


def test_missing_and_unexpected_keys(saved):
    _rewrite_weights(saved, {"query_shift": torch.zeros(4, 2, 16)})
    with pytest.raises(AdapterKeysError, match=r"missing \['steps'\]"):
        ZoomAdapter.from_pretrained(saved)
    _rewrite_weights(saved, {"query_shift": torch.zeros(4, 2, 16), "steps": torch.zeros((), dtype=torch.int64),
                             "extra": torch.zeros(1)})
    with pytest.raises(AdapterKeysError, match=r"unexpected \['extra'\]"):
        ZoomAdapter.from_pretrained(saved)


def test_wrong_shapes(saved):
    _rewrite_weights(saved, {"query_shift": torch.zeros(4, 2, 8), "steps": torch.zeros((), dtype=torch.int64)})
    with pytest.raises(AdapterShapeError, match=r"query_shift: file \(4, 2, 8\) vs modules \(4, 2, 16\)"):
        ZoomAdapter.from_pretrained(saved)


@pytest.mark.parametrize(("change", "error", "match"), [
    ({"format_version": 99}, AdapterVersionError, "format_version 99 is not supported"),
    ({"format_version": None}, AdapterConfigError, "format_version"),
    ({"surprise": 1}, AdapterConfigError, r"unknown field\(s\) \['surprise'\]"),
    ({"hyper": "scale=4"}, AdapterConfigError, "'hyper' has type str"),
])
def test_bad_config(saved, change, error, match):
    config = json.loads((saved / CONFIG_NAME).read_text())
    config.update(change)
    if change.get("format_version", 0) is None:
        del config["format_version"]
    (saved / CONFIG_NAME).write_text(json.dumps(config))
    with pytest.raises(error, match=match):
        ZoomAdapter.from_pretrained(saved)


def test_bad_config_json_and_missing_files(saved, tmp_path):
    (saved / CONFIG_NAME).write_text("{not json")
    with pytest.raises(AdapterConfigError, match="not valid JSON"):
        ZoomAdapter.from_pretrained(saved)
    (saved / CONFIG_NAME).unlink()
    with pytest.raises(AdapterNotFoundError, match="no adapter_config.json"):
        ZoomAdapter.from_pretrained(saved)
    with pytest.raises(AdapterNotFoundError, match="not a Hub id"):
        ZoomAdapter.from_pretrained(str(tmp_path / "nope" / "deeper" / "x"))


def test_hyper_parameters_must_be_json(probe_method, llama):
    with pytest.raises(AdapterConfigError, match="JSON values"):
        ZoomAdapter.initialise(llama[0], PROBE, {"scale": 1.0, "callback": object()})


def test_every_error_is_a_zoomkv_error():
    for cls in (AdapterConfigError, AdapterVersionError, AdapterWeightsError, AdapterKeysError, AdapterShapeError,
                AdapterNotFoundError, AdapterOfflineError, AdapterExistsError, BaseModelMismatchError):
        assert issubclass(cls, AdapterError) and issubclass(cls, ZoomKVError)


def test_nothing_is_unpickled(monkeypatch, saved):
    def refuse(*args: Any, **kwargs: Any):
        raise AssertionError("torch.load / pickle must never run on an adapter")

    import pickle

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    ZoomAdapter.from_pretrained(saved)


# ----------------------------------------------------------------------------------------- export
def _checkpoint(tmp_path: Path, model, seed: int = 0) -> Path:
    adapter = fresh_adapter(model, seed)
    c = adapter.config
    return write_checkpoint(tmp_path / "ckpt" / "step-10", adapter.modules, method=c.method, hyper=c.hyper,
                            base_model=c.base_model, shape=c.model_shape(), budget=c.budget, extra={"step": 10})


def test_export_from_checkpoint_round_trip(tmp_path, probe_method, llama):
    model, tok = llama
    ckpt = _checkpoint(tmp_path, model)
    out = export_checkpoint(ckpt, tmp_path / "checkpoints" / "probe")
    assert run(model, tok, ZoomAdapter.from_pretrained(out)) == run(model, tok, fresh_adapter(model))
    with pytest.raises(AdapterExistsError):
        export_checkpoint(ckpt, out)
    export_checkpoint(ckpt, out, overwrite=True)


def test_export_crash_leaves_nothing_loadable(tmp_path, probe_method, llama, monkeypatch):
    import zoomkv.adapters.files as export

    ckpt = _checkpoint(tmp_path, llama[0])
    out = tmp_path / "checkpoints" / "probe"
    real = export._write_file
    written: list[str] = []

    def crash_midway(path: Path, data: bytes) -> None:
        if path.name == WEIGHTS_NAME:
            path.write_bytes(data[: len(data) // 3])  # a half-written weights file, then the "kill"
            written.append(path.name)
            raise OSError("simulated crash while writing the weights")
        real(path, data)

    monkeypatch.setattr(export, "_write_file", crash_midway)
    with pytest.raises(OSError, match="simulated crash"):
        export_checkpoint(ckpt, out)
    assert written and not out.exists()
    assert not out.parent.exists()  # the staging folder is gone too, and the folder made to hold it (and the lock)
    monkeypatch.setattr(export, "_write_file", real)
    export_checkpoint(ckpt, out)
    ZoomAdapter.from_pretrained(out)


def test_crash_during_overwrite_keeps_previous_adapter(tmp_path, probe_method, llama, monkeypatch):
    import zoomkv.adapters.files as export

    model = llama[0]
    first = fresh_adapter(model, 0).save_pretrained(tmp_path / "a")
    before = (first / WEIGHTS_NAME).read_bytes()
    real_replace = export.os.replace
    calls = {"n": 0}

    def fail_second(src: Any, dst: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 2:  # the staging → target rename
            raise OSError("simulated crash at the rename")
        real_replace(src, dst)

    monkeypatch.setattr(export.os, "replace", fail_second)
    with pytest.raises(OSError):
        fresh_adapter(model, 1).save_pretrained(first, overwrite=True)
    monkeypatch.setattr(export.os, "replace", real_replace)
    assert (first / WEIGHTS_NAME).read_bytes() == before
    ZoomAdapter.from_pretrained(first)


@pytest.mark.heavy
def test_sigkill_during_export_then_rerun(tmp_path, probe_method, llama):
    """A real kill: a subprocess exports and SIGKILLs itself right after the staging folder is renamed
    onto the target, before the incomplete marker is removed (the last moment anything could go wrong)."""
    ckpt = _checkpoint(tmp_path, llama[0])
    out = tmp_path / "checkpoints" / "probe"
    script = f"""
import os, signal, sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
import test_adapter_artifact as t
import zoomkv.adapters.files as export
from zoomkv.protocol.registry import register_method
register_method(t.PROBE, t.ProbeConfig, t.ProbeMethod, training=t.ProbeTraining())
real = export._fsync_dir
def killer(path):
    real(path)
    if path == export.Path({str(out.parent)!r}):
        os.kill(os.getpid(), signal.SIGKILL)
export._fsync_dir = killer
from zoomkv.adapters.export import export_checkpoint
export_checkpoint({str(ckpt)!r}, {str(out)!r})
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    assert out.exists() and (out / WEIGHTS_NAME).exists()  # renamed, complete files, but still marked
    with pytest.raises(AdapterNotFoundError, match="incomplete export"):
        ZoomAdapter.from_pretrained(out)
    export_checkpoint(ckpt, out)  # the re-run replaces it without --overwrite
    ZoomAdapter.from_pretrained(out)
    assert [p.name for p in out.parent.iterdir()] == ["probe"]


def test_stale_staging_of_a_dead_export_is_swept(tmp_path, probe_method, llama):
    from zoomkv.atomic import mark_owned

    ckpt = _checkpoint(tmp_path, llama[0])
    parent = tmp_path / "checkpoints"
    stale = parent / ".probe.partial-999999999-abcd"  # a pid no process has: its export was killed
    (stale / "probe").mkdir(parents=True)
    mark_owned(stale)  # the working folders an export makes carry this mark from their first moment
    (stale / "probe" / WEIGHTS_NAME).write_bytes(b"half")
    theirs = parent / ".probe.partial-999999998-user"  # the same kind of name, not made by zoomkv: kept
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    export_checkpoint(ckpt, parent / "probe")
    assert sorted(p.name for p in parent.iterdir()) == [".probe.partial-999999998-user", "probe"]


def test_checkpoint_errors(tmp_path, probe_method, llama):
    with pytest.raises(AdapterNotFoundError):
        export_checkpoint(tmp_path / "missing", tmp_path / "out")
    ckpt = _checkpoint(tmp_path, llama[0])
    (ckpt / STATE_NAME).write_bytes((ckpt / STATE_NAME).read_bytes()[:40])
    with pytest.raises(AdapterWeightsError):
        export_checkpoint(ckpt, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------------------- model card
SCORES = {
    "summary": {"ruler_niah": {"accuracy": 0.93, "n": 40}, "longbench_qa": {"f1": 0.41, "n": 20}},
    "rows": [{"task": "ruler_niah", "length": 4096, "accuracy": 0.95}, {"task": "ruler_niah", "length": 8192,
                                                                          "accuracy": 0.91}],
}


def test_model_card_metadata(tmp_path, probe_method, llama):
    from huggingface_hub import ModelCard

    scores_file = tmp_path / "eval.json"
    scores_file.write_text(json.dumps(SCORES))
    out = fresh_adapter(llama[0]).save_pretrained(tmp_path / "a", scores=load_scores(scores_file))
    card = ModelCard.load(out / "README.md")
    data = card.data.to_dict()
    assert data["library_name"] == "zoomkv" and data["license"] == "unknown"  # a test model has no licence
    assert {"zoomkv", "kv-cache", PROBE} <= set(data["tags"])
    assert data["zoomkv"]["method"] == PROBE and data["zoomkv"]["budget"] == 8
    assert data["zoomkv"]["base_model_name"] == "tiny-llama"
    assert 0 < data["zoomkv"]["trainable_fraction"] < 1
    # Named metrics of another tool become model-index results (counts are not metrics).
    results = {(r.dataset_name, r.metric_type): r.metric_value for r in card.data.eval_results}
    assert results == {("ruler_niah", "accuracy"): 0.93, ("longbench_qa", "f1"): 0.41}
    text = card.text
    for needle in ("tiny-llama", PROBE, "budget", "trainable fraction", "0.93"):
        assert needle in text
    assert "8192" not in text  # the raw rows stay in the evaluation's files when a summary came with them
    # Both loaders in the usage section.
    assert "cache_from_adapter(model, ADAPTER" in text and "AutoPeftModelForCausalLM.from_pretrained(ADAPTER)" in text
    assert 'pipeline("text-generation", model=model' in text


def _eval_folder(tmp_path: Path, adapter: ZoomAdapter, model: str = "tiny-llama") -> Path:
    """What `zoomkv eval --adapter` writes: the adapter's rows labelled METHOD:NAME@SHA8 beside full's."""
    out = tmp_path / "eval"
    out.mkdir(exist_ok=True)
    label = f"{PROBE}:a@{(adapter.config.weights_sha256 or 'unsigned')[:8]}"
    summary = [
        {"config": "full", "method": "full", "budget": None, "rows": 2, "score": {"niah_single": 100.0},
         "samples": {"niah_single": 2}, "interval95": {"niah_single": [34.23802239546493, 100.0]}, "avg": 100.0,
         "device_ratio": 1.0, "host_ratio": 0.0, "decode_ratio": 1.0},
        {"config": label, "method": label, "budget": "8", "rows": 2, "score": {"niah_single": 75.0},
         "samples": {"niah_single": 2}, "interval95": {"niah_single": [20.65491, 99.123456789]}, "avg": 75.0,
         "device_ratio": 0.123456, "host_ratio": 0.87654, "decode_ratio": 0.81234},
    ]
    (out / "summary.json").write_text(json.dumps({"run": {"model": model}, "summary": summary}))
    (out / "rows.json").write_text(json.dumps([{"task": "niah_single", "length": 512, "score": 100.0, "model": model},
                                               {"task": "niah_single", "length": 512, "score": 50.0, "model": model}]))
    return out


def test_model_card_from_eval_output_folder(tmp_path, probe_method, llama):
    """The files `zoomkv eval --out DIR` writes: the card's table is the summary rounded as summary.md rounds
    it (no raw rows, no 16-digit intervals), and model-index holds the adapter's own scores."""
    from huggingface_hub import ModelCard

    adapter = fresh_adapter(llama[0])
    adapter.serialise()  # records the weights' checksum, which the eval's label carries
    folder = adapter.save_pretrained(tmp_path / "a", scores=load_scores(_eval_folder(tmp_path, adapter)))
    card = ModelCard.load(folder / "README.md")
    assert "| full | – | 100.0 [34–100] n=2 | 100.0 | 100.0% | 0.0% | 1.00 |" in card.text
    assert "75.0 [21–99] n=2 | 75.0 | 12.3% | 87.7% | 0.81 |" in card.text
    assert "34.238" not in card.text and "| 512 |" not in card.text
    (result,) = card.data.eval_results  # the adapter's row only: full is a baseline, not this model
    assert (result.dataset_name, result.metric_value, result.metric_config) == ("niah_single", 75.0, "budget=8")
    assert card.data.model_name and "model-index:" in (folder / "README.md").read_text()


def test_export_refuses_scores_of_another_base_model(tmp_path, probe_method, llama, capsys):
    """`zoomkv export --scores RUN`: scores measured on another base model than the adapter's are refused in one
    line (exit 2); a registered name and its Hub id are the same model."""
    from zoomkv.cli import main

    ckpt = _checkpoint(tmp_path, llama[0])
    other = _eval_folder(tmp_path, fresh_adapter(llama[0]), model="tiny-qwen3")
    assert main(["export", str(ckpt), "--scores", str(other), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "'tiny-qwen3', not on the adapter's base model 'tiny-llama'" in err
    assert not (tmp_path / "x").exists()
    (tmp_path / "same").mkdir()
    same = _eval_folder(tmp_path / "same", fresh_adapter(llama[0]))
    assert main(["export", str(ckpt), "--scores", str(same), "--out", str(tmp_path / "y"), "--license", "mit"]) == 0
    from huggingface_hub import ModelCard

    assert ModelCard.load(tmp_path / "y" / "README.md").data.license == "mit"
    from zoomkv.adapters.export import check_scores_base

    check_scores_base({"models": ["smollm2-135m"]}, "HuggingFaceTB/SmolLM2-135M-Instruct")  # one model, two names


def test_model_card_base_model_hub_id(probe_method, llama):
    from huggingface_hub import ModelCard

    config = fresh_adapter(llama[0]).config
    config.base_model = {**config.base_model, "name": "smollm2-135m"}
    data = ModelCard(render_card(config)).data.to_dict()
    assert data["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert data["license"] == "apache-2.0"  # the registered base model's licence
    config.base_model = {**config.base_model, "name": "tiny-llama"}
    assert "base_model" not in ModelCard(render_card(config)).data.to_dict()  # not a Hub id: left out


def test_model_card_is_not_a_template(probe_method, llama):
    config = fresh_adapter(llama[0]).config
    text = render_card(config, {"summary": [{"name": "{{ 7*7 }}", "score": 1}], "rows": []})
    assert "{{ 7*7 }}" in text and "49" not in text


# ----------------------------------------------------------------------------------------- CLI
def test_cli_export_and_errors(tmp_path, probe_method, llama, capsys, monkeypatch):
    from zoomkv.cli import main

    ckpt = _checkpoint(tmp_path, llama[0])
    scores = tmp_path / "eval.json"
    scores.write_text(json.dumps(SCORES))
    monkeypatch.chdir(tmp_path)
    assert main(["export", str(ckpt), "--scores", str(scores), "--budget", "8"]) == 0
    out = tmp_path / "checkpoints" / "step-10"
    assert ZoomAdapter.from_pretrained(out).config.budget == 8
    assert "0.93" in (out / "README.md").read_text()
    assert main(["export", str(ckpt)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("zoomkv: error:") and len(err.strip().splitlines()) == 1
    assert main(["push", str(tmp_path / "nothing"), "--repo-id", "me/x"]) == 2
