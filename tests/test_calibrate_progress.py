"""``zoomkv calibrate`` shows a progress bar on a terminal (over CompressKV's samples, over InfiniGen's
prefill and layers) and none when stderr is not one (pipes, logs, these tests) unless asked for."""

from __future__ import annotations

import torch

from zoomkv.calibrate.compresskv import calibrate
from zoomkv.calibrate.infinigen import build_profile
from zoomkv.models import load_model


def test_compresskv_bar_over_the_samples(capsys):
    model, tok = load_model("tiny-llama")
    kwargs = dict(model_name="tiny-llama", samples=2, length=300, accept_all=True)
    calibrate(model, tok, **kwargs)  # stderr is captured, not a terminal: no bar
    assert "calibrate compresskv" not in capsys.readouterr().err
    calibrate(model, tok, progress=True, **kwargs)
    err = capsys.readouterr().err
    assert "calibrate compresskv" in err and "2/2" in err and "used=2" in err


def test_infinigen_bar_over_the_prefill_and_layers(tmp_path, capsys):
    model, _ = load_model("tiny-llama")
    ids = torch.arange(3, 67)[None]
    build_profile(model, ids, "tiny-llama", output=tmp_path / "quiet.safetensors")
    assert "calibrate infinigen" not in capsys.readouterr().err
    layers = len(model.model.layers)
    build_profile(model, ids, "tiny-llama", output=tmp_path / "bar.safetensors", progress=True)
    err = capsys.readouterr().err
    assert "calibrate infinigen: layers" in err and f"{layers + 1}/{layers + 1}" in err
