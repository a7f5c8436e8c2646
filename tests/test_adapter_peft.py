"""The zoomkv adapter as a PEFT method: get_peft_model, save_pretrained, PeftModel.from_pretrained, and
both directions between PEFT's folders and ``zoomkv export`` folders give exactly the same tokens."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("peft")

from peft import PeftModel, get_peft_model  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from tests.test_adapter_artifact import (  # noqa: E402,F401
    PROBE,
    PROMPT,
    _rewrite_weights,
    fresh_adapter,
    probe_method,
    run,
)
from zoomkv.adapters.config import CONFIG_NAME, WEIGHTS_NAME  # noqa: E402
from zoomkv.adapters.errors import AdapterError, AdapterKeysError, AdapterShapeError, BaseModelMismatchError  # noqa: E402
from zoomkv.adapters.model import ZoomAdapter  # noqa: E402
from zoomkv.adapters.peft_integration import (  # noqa: E402
    ZoomKVPeftConfig,
    cache_from_peft,
    load_peft_adapter,
    register,
)
from zoomkv.compat import generate_cache_kwargs  # noqa: E402
from zoomkv.models import load_model  # noqa: E402


def peft_run(peft_model, tokenizer, budget: int = 8, new: int = 12) -> list[int]:
    inputs = tokenizer([PROMPT], return_tensors="pt")
    cache = cache_from_peft(peft_model, budget)
    with torch.inference_mode():
        out = peft_model.generate(**inputs, max_new_tokens=new, do_sample=False, min_new_tokens=new,
                                  pad_token_id=tokenizer.pad_token_id, **generate_cache_kwargs(cache))
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def test_registered_as_peft_method():
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING, PEFT_TYPE_TO_TUNER_MAPPING
    from peft.utils import PeftType

    register()  # idempotent
    assert PeftType("ZOOMKV") is PeftType.ZOOMKV
    assert PEFT_TYPE_TO_CONFIG_MAPPING[PeftType.ZOOMKV] is ZoomKVPeftConfig
    assert PEFT_TYPE_TO_TUNER_MAPPING[PeftType.ZOOMKV].__name__ == "ZoomKVTuner"


@pytest.mark.usefixtures("probe_method")
def test_export_loads_through_peft_with_same_tokens(tmp_path):
    model, tok = load_model("tiny-llama")
    adapter = fresh_adapter(model)
    expected = run(model, tok, adapter)
    folder = adapter.save_pretrained(tmp_path / "export")
    assert json.loads((folder / CONFIG_NAME).read_text())["peft_type"] == "ZOOMKV"
    peft_model = PeftModel.from_pretrained(load_model("tiny-llama")[0], str(folder))
    assert peft_run(peft_model, tok) == expected


@pytest.mark.usefixtures("probe_method")
def test_peft_save_loads_in_zoomkv_with_same_tokens(tmp_path):
    model, tok = load_model("tiny-llama")
    torch.manual_seed(3)
    peft_model = get_peft_model(model, ZoomKVPeftConfig.for_model(model, PROBE, {"scale": 4.0}, budget=8))
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable == ["base_model.zoomkv_modules.default.query_shift"]  # the base model is frozen
    expected = peft_run(peft_model, tok)
    peft_model.save_pretrained(tmp_path / "peft")
    assert sorted(load_file(tmp_path / "peft" / WEIGHTS_NAME)) == ["base_model.zoomkv_modules.query_shift",
                                                                   "base_model.zoomkv_modules.steps"]
    saved = json.loads((tmp_path / "peft" / CONFIG_NAME).read_text())
    # the base model under its one name (not PEFT's name_or_path of the model), and the task AutoPeft needs
    assert saved["base_model_name_or_path"] == saved["base_model"]["name"] == "tiny-llama"
    assert saved["task_type"] == "CAUSAL_LM"
    loaded = ZoomAdapter.from_pretrained(tmp_path / "peft")
    fresh, _ = load_model("tiny-llama")
    assert run(fresh, tok, loaded) == expected
    again = PeftModel.from_pretrained(load_model("tiny-llama")[0], str(tmp_path / "peft"))
    assert peft_run(again, tok) == expected


@pytest.mark.usefixtures("probe_method")
def test_peft_refuses_wrong_base_and_bad_weights(tmp_path):
    llama, _ = load_model("tiny-llama")
    folder = fresh_adapter(llama).save_pretrained(tmp_path / "a")
    with pytest.raises(BaseModelMismatchError, match="tiny-llama.*tiny-qwen3"):
        PeftModel.from_pretrained(load_model("tiny-qwen3")[0], str(folder))
    _rewrite_weights(folder, {"query_shift": torch.zeros(4, 2, 16)})
    with pytest.raises(AdapterKeysError, match="missing"):
        PeftModel.from_pretrained(load_model("tiny-llama")[0], str(folder))
    _rewrite_weights(folder, {"query_shift": torch.zeros(4, 2, 3), "steps": torch.zeros((), dtype=torch.int64)})
    with pytest.raises(AdapterShapeError):
        PeftModel.from_pretrained(load_model("tiny-llama")[0], str(folder))
    (folder / WEIGHTS_NAME).unlink()
    (folder / "adapter_model.bin").write_bytes(b"pickle would run here")
    with pytest.raises(AdapterError, match="never loaded"):
        load_peft_adapter(load_model("tiny-llama")[0], folder)


@pytest.mark.usefixtures("probe_method")
def test_peft_generate_compresses_by_itself(tmp_path):
    """``PeftModel.from_pretrained(base, folder).generate(...)`` runs the adapter in a ZoomCache at the budget
    its config records: the same tokens as ``ZoomAdapter.from_pretrained`` + its cache, other than plain
    attention's; the base model's own ``generate`` is plain attention; a cache passed in is used as given."""
    model, tok = load_model("tiny-llama")
    folder = fresh_adapter(model).save_pretrained(tmp_path / "a")  # records budget=8
    loaded = ZoomAdapter.from_pretrained(folder)
    expected = run(load_model("tiny-llama")[0], tok, loaded, budget=8)
    inputs = tok([PROMPT], return_tensors="pt")
    settings = {"max_new_tokens": 12, "min_new_tokens": 12, "do_sample": False, "pad_token_id": tok.pad_token_id}
    plain = model.generate(**inputs, **settings)[0, inputs["input_ids"].shape[1]:].tolist()
    assert plain != expected  # the budget is small enough that compression changes the answer

    peft_model = PeftModel.from_pretrained(load_model("tiny-llama")[0], str(folder))
    with torch.inference_mode():
        auto = peft_model.generate(**inputs, **settings)[0, inputs["input_ids"].shape[1]:].tolist()
        off = peft_model.get_base_model().generate(**inputs, **settings)[0, inputs["input_ids"].shape[1]:].tolist()
        again = peft_model.generate(**inputs, **settings)[0, inputs["input_ids"].shape[1]:].tolist()
    assert auto == expected and again == expected
    assert off == plain
    assert "generate" not in vars(peft_model.get_base_model())  # the wrapper lives for one call only
    assert peft_run(peft_model, tok, budget=8) == expected  # an explicit cache still works
    from transformers import DynamicCache

    with torch.inference_mode():  # and so does another kind of cache: plain attention then
        dynamic = peft_model.generate(**inputs, **settings, **generate_cache_kwargs(DynamicCache()))
    assert dynamic[0, inputs["input_ids"].shape[1]:].tolist() == plain
    # PEFT's own switch: inside disable_adapter() generate is plain attention, and the adapter is back after.
    with torch.inference_mode():
        with peft_model.disable_adapter():
            disabled = peft_model.generate(**inputs, **settings)[0, inputs["input_ids"].shape[1]:].tolist()
        enabled = peft_model.generate(**inputs, **settings)[0, inputs["input_ids"].shape[1]:].tolist()
    assert disabled == plain and enabled == expected


@pytest.mark.usefixtures("probe_method")
def test_peft_generate_without_a_budget_says_how_to_give_one():
    model, tok = load_model("tiny-llama")
    peft_model = get_peft_model(model, ZoomKVPeftConfig.for_model(model, PROBE, {"scale": 4.0}))
    inputs = tok([PROMPT], return_tensors="pt")
    with pytest.raises(AdapterError, match=r"records no budget.*cache_from_peft\(peft_model, budget="):
        peft_model.generate(**inputs, max_new_tokens=2)
    assert "generate" not in vars(peft_model.get_base_model())
    with torch.inference_mode():
        out = peft_model.generate(**inputs, max_new_tokens=2, **generate_cache_kwargs(cache_from_peft(peft_model, 8)))
    assert out.shape[1] == inputs["input_ids"].shape[1] + 2


@pytest.fixture
def saved_base(tmp_path):
    """tiny-llama saved as a folder, and loaded from it: its path is a name AutoModelForCausalLM can load, as a
    Hub id would be for a real base model."""
    model, tok = load_model("tiny-llama")
    model.save_pretrained(tmp_path / "base")
    tok.save_pretrained(tmp_path / "base")
    return load_model(str(tmp_path / "base"))


@pytest.mark.usefixtures("probe_method")
def test_autopeft_loads_an_export_and_generates_with_its_cache(tmp_path, saved_base, capfd):
    """``AutoPeftModelForCausalLM.from_pretrained(adapter_dir)`` loads the base model the config names and its
    ``generate`` runs the adapter's cache (the same tokens as zoomkv's own loader); ``pipeline("text-generation")``
    takes the result without PEFT's "not supported" error and gives the same text."""
    from peft import AutoPeftModelForCausalLM, PeftModelForCausalLM
    from transformers import pipeline

    model, tok = saved_base
    adapter = fresh_adapter(model)
    expected = run(model, tok, adapter)
    folder = adapter.save_pretrained(tmp_path / "export")
    config = json.loads((folder / CONFIG_NAME).read_text())
    assert config["task_type"] == "CAUSAL_LM" and config["inference_mode"] is True
    assert config["peft_version"] == __import__("peft").__version__
    assert config["base_model_name_or_path"] == config["base_model"]["name"] == str(tmp_path / "base")

    peft_model = AutoPeftModelForCausalLM.from_pretrained(str(folder))
    assert isinstance(peft_model, PeftModelForCausalLM)
    inputs = tok([PROMPT], return_tensors="pt")
    settings = {"max_new_tokens": 12, "min_new_tokens": 12, "do_sample": False, "pad_token_id": tok.pad_token_id}
    with torch.inference_mode():
        out = peft_model.generate(**inputs, **settings)[0, inputs["input_ids"].shape[1]:].tolist()
        plain = peft_model.get_base_model().generate(**inputs, **settings)[0, inputs["input_ids"].shape[1]:].tolist()
    assert out == expected and plain != expected  # the adapter's cache, not plain attention

    capfd.readouterr()
    generator = pipeline("text-generation", model=peft_model, tokenizer=tok)
    text = generator(PROMPT, return_full_text=False, **settings)[0]["generated_text"]
    assert "not supported" not in capfd.readouterr().err
    assert text == tok.decode(expected, skip_special_tokens=True)
    # PeftModel.from_pretrained gives the same class, so the pipeline takes it too.
    assert isinstance(PeftModel.from_pretrained(load_model(str(tmp_path / "base"))[0], str(folder)),
                      PeftModelForCausalLM)


@pytest.mark.usefixtures("probe_method")
def test_base_model_recorded_as_its_hub_id_and_old_names_still_load(tmp_path, recwarn):
    """A registered base model is recorded under the Hub id its weights come from, in the config (and so in
    PEFT's base_model_name_or_path) and the card alike; an adapter written with the registered name loads, as
    the same model, through zoomkv and PEFT."""
    from huggingface_hub import ModelCard

    model, tok = load_model("tiny-llama")
    adapter = fresh_adapter(model)
    adapter.config.base_model = {**adapter.config.base_model, "name": "smollm2-135m"}
    adapter.config.__post_init__()
    hub_id = "HuggingFaceTB/SmolLM2-135M-Instruct"
    folder = adapter.save_pretrained(tmp_path / "new")
    config = json.loads((folder / CONFIG_NAME).read_text())
    assert config["base_model"]["name"] == config["base_model_name_or_path"] == hub_id
    assert ModelCard.load(folder / "README.md").data.base_model == hub_id
    assert f"`{hub_id}`" in (folder / "README.md").read_text()

    # An older export: the registered name in both fields.
    old = tmp_path / "old"
    old.mkdir()
    for name in ("README.md", WEIGHTS_NAME):
        (old / name).write_bytes((folder / name).read_bytes())
    config["base_model"]["name"] = config["base_model_name_or_path"] = "smollm2-135m"
    for key in ("task_type", "inference_mode", "peft_version"):  # keys it did not write yet
        del config[key]
    (old / CONFIG_NAME).write_text(json.dumps(config))
    loaded = ZoomAdapter.from_pretrained(old)
    assert loaded.config.base_model["name"] == hub_id
    model.zoomkv_name = "smollm2-135m"  # as load_model("smollm2-135m") names the model it loads
    loaded.check_base(model)
    assert not [w for w in recwarn if "loaded onto" in str(w.message)]  # the same model: no warning
    old_config = ZoomKVPeftConfig.from_pretrained(str(old))
    assert old_config.base_model_name_or_path == hub_id and old_config.task_type == "CAUSAL_LM"
    from peft import PeftModelForCausalLM

    peft_model = PeftModel.from_pretrained(load_model("tiny-llama")[0], str(old))
    assert isinstance(peft_model, PeftModelForCausalLM)
    assert peft_run(peft_model, tok) == run(model, tok, adapter)


@pytest.mark.heavy
def test_import_zoomkv_registers_with_peft_after_a_probe():
    """transformers asks importlib whether peft is installed (find_spec) before anything imports it: that probe
    must not use up the hook that registers zoomkv with PEFT when peft is imported for real."""
    import subprocess
    import sys

    code = ("import importlib.util, sys, zoomkv\n"
            "assert 'peft' not in sys.modules\n"
            "assert importlib.util.find_spec('peft') is not None\n"
            "import peft\n"
            "from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING\n"
            "print('ZOOMKV' in PEFT_TYPE_TO_CONFIG_MAPPING)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("True")
