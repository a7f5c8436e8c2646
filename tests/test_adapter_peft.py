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
