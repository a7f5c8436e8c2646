"""sekv's host tier under a byte budget: bits per layer fitted on the teacher cache, an adapter that runs with
its own host format, and the grammar that turns it off."""

from __future__ import annotations

import json

import pytest
import torch

from tests.test_train import TINY, main
from zoomkv import ZoomCache
from zoomkv.adapters.model import ZoomAdapter
from zoomkv.compat import generate_cache_kwargs
from zoomkv.errors import ConfigError
from zoomkv.memory.quant import QuantSpec
from zoomkv.memory.spec import CacheSpec
from zoomkv.methods.sekv.host_bits import fine_code_share, fit_bits
from zoomkv.models import load_model
from zoomkv.runspec import parse_runs
from zoomkv.train.config import load_recipe


def _errors(sensitive: set[int], layers: int = 4) -> dict[int, dict[str, dict[int, float]]]:
    """Output errors where the layers in ``sensitive`` lose much more at fewer bits than the others."""
    return {i: {role: {8: 0.0, 4: 0.01 * (10 if i in sensitive else 1), 2: 0.2 * (10 if i in sensitive else 1)}
                for role in ("keys", "values")} for i in range(layers)}


def test_the_fit_spends_bytes_where_the_output_loses_most_and_meets_the_target():
    spec = QuantSpec.parse("int4")
    pattern, share = fit_bits(_errors({1}), spec, target=0.2, fixed_share=0.0, num_layers=4)
    assert share <= 0.2
    assert pattern[1] == [8, 8] or min(pattern[1]) >= max(min(p) for i, p in enumerate(pattern) if i != 1)
    assert [2, 2] not in pattern[1:2]
    # a looser target keeps more bits everywhere; the sensitive layer never has fewer than the others
    loose, _ = fit_bits(_errors({1}), spec, target=0.25, fixed_share=0.0, num_layers=4)
    assert sum(map(sum, loose)) >= sum(map(sum, pattern))


def test_a_target_below_every_layer_at_two_bits_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="below the smallest host tier"):
        fit_bits(_errors(set()), QuantSpec.parse("int4"), target=0.1, fixed_share=fine_code_share(64, 4),
                 num_layers=4)


def test_recipe_keys_of_the_host_budget_are_checked_at_load():
    with pytest.raises(ConfigError, match="host_budget"):
        load_recipe(TINY, ["host_budget=0.2"])  # no layout to fit in
    with pytest.raises(ConfigError, match="host_format"):
        load_recipe(TINY, ["host_format=int3"])
    with pytest.raises(ConfigError, match="'steps' must be >= 1"):
        load_recipe(TINY, ["steps=0"])  # 0 only refits an init_adapter


def test_an_adapter_runs_with_its_fitted_host_bits_and_can_turn_them_off(tmp_path):
    out = tmp_path / "fit"
    common = ["--recipe", str(TINY), f"teacher_cache={tmp_path / 'teacher'}", "num_samples=2", "queries_per_sample=3",
              "save_every=2", "host_format=int4", "host_budget=0.3"]
    assert main([*common, "steps=2", f"output_dir={out}"]) == 0
    folder = out / "sekv-tiny" / "adapter"
    hyper = json.loads((folder / "adapter_config.json").read_text())["hyper"]
    spec = CacheSpec.build(ZoomAdapter.from_pretrained(folder).make_method(), 64).kv_quant
    assert hyper["host_format"] == "int4" and spec is not None and spec.name == "fit30"
    assert [list(p) for p in spec.layers] == hyper["host_bits"]
    assert {b for p in hyper["host_bits"] for b in p} <= {8, 4, 2}

    model, _ = load_model("tiny-llama")
    ids = torch.randint(3, 250, (1, 200), generator=torch.Generator().manual_seed(0))
    cache = ZoomCache(model, ZoomAdapter.from_pretrained(folder).make_method(), 64)
    model(input_ids=ids, **generate_cache_kwargs(cache), use_cache=True)
    report = cache.memory_report()
    rows = sum(layer.host_tier["keys"].nbytes + layer.host_tier["values"].nbytes for layer in cache.layers)
    full = 2 * ids.shape[1] * model.config.num_key_value_heads * 32 * 4 * model.config.num_hidden_layers
    assert report.host_bytes > 0 and rows <= 0.3 * full * 1.3  # rows at the fitted widths (plus room to grow)

    runs = parse_runs(adapters=[str(folder), f"{folder}+int8"], budgets=["64"])
    assert runs[0].label.endswith("+fit30") and runs[0].cache.kv_quant.layers
    assert runs[1].label.endswith("+int8") and not runs[1].cache.kv_quant.layers  # the variant wins
    off = parse_runs(adapters=[str(folder)], budgets=["64"], method_args={"sekv": {"host_format": "none"}})
    assert off[0].cache.kv_quant is None

    # steps=0 with init_adapter: the same modules, bits refitted to another budget
    assert main([*common[:-1], "host_budget=0.22", "steps=0", f"init_adapter={folder}",
                 f"output_dir={tmp_path / 'refit'}"]) == 0
    refit = tmp_path / "refit" / "sekv-tiny" / "adapter"
    again = json.loads((refit / "adapter_config.json").read_text())["hyper"]["host_bits"]
    assert sum(map(sum, again)) < sum(map(sum, hyper["host_bits"]))
    old, new = ZoomAdapter.from_pretrained(folder).modules, ZoomAdapter.from_pretrained(refit).modules
    assert all(torch.equal(a, b) for a, b in zip(old.state_dict().values(), new.state_dict().values(), strict=True))


def test_methods_take_a_host_format_through_method_args():
    runs = parse_runs(["sekv"], budgets=["64"], method_args={"*": {"host_format": "kivi2"}})
    assert runs[0].label == "sekv+kivi2" and runs[0].cache.kv_quant.key_layout == "channel"


def test_the_fit_charges_keys_for_moving_the_attention_and_values_only_for_the_output():
    from zoomkv.methods.sekv.host_bits import output_errors

    g = torch.Generator().manual_seed(0)
    h, hq, n, d = 2, 4, 96, 32
    keys = torch.randn(h, n, d, generator=g) * 2
    q = torch.randn(hq, 3, d, generator=g)
    attn = torch.softmax(torch.einsum("hpd,hnd->hpn", q, keys.repeat_interleave(2, 0)) * d**-0.5, -1)
    sample = {"scaling": torch.tensor(d**-0.5), "positions": torch.tensor([n - 3, n - 2, n - 1]),
              "layers": torch.tensor([0]), "k.0": keys, "v.0": torch.randn(h, n, d, generator=g), "q.0": q,
              "attn.0": attn}
    spec = QuantSpec.parse("int4")
    with_kl = output_errors([sample], spec, [16])[0]
    without = output_errors([sample], spec, [16], kl=False)[0]
    assert with_kl["values"] == without["values"]  # coded values leave the weights where they were
    assert with_kl["keys"][2] > without["keys"][2] > 0  # coded keys move them: charged for it
    assert without["keys"][2] > without["keys"][4] > without["keys"][8]


def test_the_host_format_and_the_rescoring_source_change_no_trained_weight(tmp_path):
    """The quickstart recipe carries its host format: the adapter it trains is the one trained without it,
    with the format recorded (what BENCHMARKS measured by adding the format to the earlier adapter)."""
    from safetensors.torch import load_file

    common = ["--recipe", str(TINY), f"teacher_cache={tmp_path / 'teacher'}", "num_samples=2", "queries_per_sample=3",
              "steps=3", "save_every=3"]
    assert main([*common, f"output_dir={tmp_path / 'plain'}"]) == 0
    assert main([*common, f"output_dir={tmp_path / 'kivi'}", "host_format=kivi4", "rescore_from=host"]) == 0
    plain = load_file(str(tmp_path / "plain" / "sekv-tiny" / "adapter" / "adapter_model.safetensors"))
    kivi = load_file(str(tmp_path / "kivi" / "sekv-tiny" / "adapter" / "adapter_model.safetensors"))
    assert plain.keys() == kivi.keys() and all(torch.equal(plain[k], kivi[k]) for k in plain)
    hyper = json.loads((tmp_path / "kivi" / "sekv-tiny" / "adapter" / "adapter_config.json").read_text())["hyper"]
    assert hyper["host_format"] == "kivi4" and hyper["rescore_from"] == "host"
