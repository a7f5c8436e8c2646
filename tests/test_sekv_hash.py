"""sekv's trained hash index (``hash_bits``): the learned key and query projections whose signs are the index.

What makes it that index: a row's device codes are ``hash_bits / 8`` bytes (and the RMS), scored against the
query's projection; it starts as the rotated key's first ``hash_bits`` coordinates (at ``hash_bits = head_dim``
exactly today's codes); the compiled CPU step and the torch path pick the same rows; the distillation loss
reaches both projections through the signs (straight-through); the adapter records it and a bad value is one
line at load."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.test_sekv_native import G, H, _assert_same, _both, _memory
from zoomkv.errors import ConfigError
from zoomkv.methods.sekv import native
from zoomkv.methods.sekv.codes import code_bytes
from zoomkv.methods.sekv.method import SeKV, SeKVConfig
from zoomkv.methods.sekv.modules import SeKVAdapter
from zoomkv.methods.sekv.objective import position_losses, prefix_student
from zoomkv.models import load_model

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def config():
    return load_model("tiny-llama")[0].config


def _hashed(config, d: int, bits: int, seed: int = 0) -> SeKVAdapter:
    torch.manual_seed(seed)
    adapter = SeKVAdapter(config.num_hidden_layers, H, d, hash_bits=bits)
    with torch.no_grad():  # trained-looking: projections off their start, query and key sides apart
        adapter.hash_key.add_(torch.randn_like(adapter.hash_key) * 0.1)
        adapter.hash_query.mul_(1.5).add_(torch.randn_like(adapter.hash_query) * 0.1)
        adapter.code_gain.normal_(0, 0.3)
    return adapter


@pytest.mark.skipif(native.library() is None, reason="no C++ compiler: the torch path is all there is")
@pytest.mark.parametrize("d,bits", [(16, 8), (16, 16), (64, 32), (64, 64)])
@pytest.mark.parametrize("kwargs", [{}, {"rescore_from": "host"}, {"rescore_bits": 0}])
def test_the_compiled_step_scores_the_hash_as_the_torch_path_does(config, d, bits, kwargs):
    method = SeKV(adapter=_hashed(config, d, bits), **kwargs)
    memory, g = _memory(config, method, t=300, budget=48, seed=1, batch=2, d=d)
    for _ in range(3):  # new rows coded by the compiled append
        method.append(memory, torch.randn(2, H, 1, d, generator=g), torch.randn(2, H, 1, d, generator=g))
        _assert_same(*_both(method, memory, torch.randn(2, H * G, 1, d, generator=g) * 2))
    assert memory.device_tier["codes"].view().shape[-1] == bits // 8


def _appended_codes(prefilled) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The index's codes and RMS after 1, 3 and 1 new rows, appended by torch and by the compiled step, each on a
    fresh ``prefilled()`` (a method and its memory after the prefill, and a generator)."""
    views = []
    for torch_path in (True, False):
        method, memory, g = prefilled()
        with native.torch_path() if torch_path else torch.no_grad():
            for rows in (1, 3, 1):
                method.append(memory, torch.randn(2, H, rows, 64, generator=g), torch.randn(2, H, rows, 64, generator=g))
        views.append((memory.device_tier["codes"].view().clone(), memory.device_tier["code_rms"].view().clone()))
    return views


@pytest.mark.skipif(native.library() is None, reason="no C++ compiler: the torch path is all there is")
def test_the_compiled_append_writes_the_hash_codes_of_the_torch_append(config):
    def prefilled():
        method = SeKV(adapter=_hashed(config, 64, 32))
        return method, *_memory(config, method, t=120, budget=40, seed=8, batch=2, d=64)

    (codes0, rms0), (codes1, rms1) = _appended_codes(prefilled)
    assert codes0.shape == codes1.shape == (2, H, 125, 4)
    assert (codes0 != codes1).float().mean() < 1e-2  # a projection at 0 may round the other way
    torch.testing.assert_close(rms0.float(), rms1.float(), rtol=2e-3, atol=1e-4)


@pytest.mark.parametrize("d", [16, 64])
def test_an_untrained_hash_of_head_dim_bits_is_todays_index(config, d):
    plain, hashed = SeKV(adapter=SeKVAdapter(config.num_hidden_layers, H, d)), \
        SeKV(adapter=SeKVAdapter(config.num_hidden_layers, H, d, hash_bits=d))
    mem0, _ = _memory(config, plain, t=200, budget=48, seed=3, batch=2, d=d)
    mem1, _ = _memory(config, hashed, t=200, budget=48, seed=3, batch=2, d=d)
    assert torch.equal(mem0.device_tier["codes"].view(), mem1.device_tier["codes"].view())
    query = torch.randn(2, H * G, 1, d)
    with native.torch_path():
        torch.testing.assert_close(plain.router_scores(mem0, query), hashed.router_scores(mem1, query),
                                   rtol=1e-4, atol=1e-4)


def test_fewer_bits_hold_fewer_device_bytes(config):
    """The index's bytes a row are ``bits / 8 + 2`` (the RMS): at 32 bits on head_dim 64, 6 where the rotated key's
    signs take 10; the device tier counts them, and the layer's two projections (float32) beside them."""
    got = {}
    for bits in (0, 32, 16):
        adapter = SeKVAdapter(config.num_hidden_layers, H, 64, hash_bits=bits)
        memory, _ = _memory(config, SeKV(adapter=adapter), t=400, budget=48, seed=5, batch=1, d=64)
        codes = memory.device_tier["codes"].view().numel() + 2 * memory.device_tier["code_rms"].view().numel()
        assert codes == 400 * H * code_bytes(bits or 64, 1)
        got[bits] = memory.device_bytes
    projections = {bits: 2 * H * 64 * bits * 4 for bits in (0, 32, 16)}
    assert got[0] - got[32] == 400 * H * 4 - projections[32]
    assert got[32] - got[16] == 400 * H * 2 + projections[32] - projections[16]


def test_the_hash_trains_through_its_signs():
    """The listwise loss reaches both projections (the signs' gradient taken straight through), the forward pass
    is the codes inference keeps, and a key projection that puts the teacher's row on the query's side ranks it
    higher than one that puts it on the other side."""
    g = torch.Generator().manual_seed(0)
    h, t, d, bits, target = 1, 160, 16, 8, 77
    keys, values = torch.randn(h, t, d, generator=g), torch.randn(h, t, d, generator=g)
    query = torch.randn(2, d, generator=g)
    teacher = torch.full((2, t), 0.1 / (t - 1))
    teacher[:, target] = 0.9
    cfg = SeKVConfig(anchor_fraction=0.0, rescore_bits=0)
    adapter = SeKVAdapter(2, h, d, hash_bits=bits)
    student = prefix_student(adapter, 0, keys, torch.ones(t), t, cfg)
    assert student.hashed.shape == (h, t, bits)
    levels = student.hashed.detach().abs() / student.hashed.detach().pow(2).mean(-1, keepdim=True).sqrt()
    torch.testing.assert_close(levels, torch.ones_like(levels))  # one level a row: signs times the RMS
    losses = position_losses(adapter, 0, keys, values, query, teacher, torch.ones(t), t - 1, d**-0.5, 40, cfg)
    losses.rank.backward()
    assert adapter.hash_key.grad[0].abs().sum() > 0 and adapter.hash_query.grad[0].abs().sum() > 0
    assert adapter.hash_key.grad[1].abs().sum() == 0  # layer 1 took no part

    def rank_with_target_sign(sign: float) -> float:
        a = SeKVAdapter(1, h, d, hash_bits=bits)
        k = keys.clone()
        qh = query.mean(0) @ a.hash_query[0, 0].detach()  # the target row's projections agree with the query's
        k[:, target] = sign * 3 * torch.linalg.lstsq(a.hash_key[0, 0].detach().T, qh[:, None]).solution[:, 0]
        return float(position_losses(a, 0, k, values, query, teacher, torch.ones(t), t - 1, d**-0.5, 40, cfg).rank.detach())

    assert rank_with_target_sign(1.0) < rank_with_target_sign(-1.0)


def test_a_recipe_trains_and_records_the_hash(tmp_path):
    from zoomkv.adapters.model import ZoomAdapter
    from zoomkv.cli import run_command

    code = run_command("train", ["--recipe", str(ROOT / "recipes" / "tiny-llama-sekv.yaml"), "hash_bits=8",
                                 f"output_dir={tmp_path}", "num_samples=2", "queries_per_sample=2", "steps=4",
                                 "layers_per_step=2", "eval_samples=0", "tensorboard=false",
                                 "max_trainable_fraction=1"], prog="zoomkv train")
    assert code == 0
    folder = tmp_path / "sekv-tiny" / "adapter"
    hyper = json.loads((folder / "adapter_config.json").read_text())["hyper"]
    assert hyper["hash_bits"] == 8
    start = SeKVAdapter(hyper["num_layers"], hyper["kv_heads"], hyper["head_dim"], hash_bits=8)
    weights = load_file(folder / "adapter_model.safetensors")
    assert not torch.equal(weights["hash_key"], start.hash_key.detach())  # it moved
    method = ZoomAdapter.from_pretrained(folder).make_method()
    assert method.adapter.hash_bits == 8
    # a recorded width that is no whole number of bytes is one line at load
    data = json.loads((folder / "adapter_config.json").read_text())
    data["hyper"]["hash_bits"] = 12
    (folder / "adapter_config.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="hash_bits"):
        ZoomAdapter.from_pretrained(folder)


def test_a_bad_recipe_width_is_one_line(tmp_path, capsys):
    from zoomkv.cli import run_command

    code = run_command("train", ["--recipe", str(ROOT / "recipes" / "tiny-llama-sekv.yaml"), "hash_bits=12",
                                 f"output_dir={tmp_path}", "--dry-run"], prog="zoomkv train")
    assert code == 2
    err = capsys.readouterr().err
    assert "hash_bits" in err and "Traceback" not in err


def test_the_ablation_script_ranks_every_coding(tmp_path, monkeypatch):
    """``scripts/code_ablation.py`` on a tiny model: every coding gets a mass and a recall in [0, 1], and the exact
    keys as a 'coding' keep the teacher's top row at every step."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import code_ablation

    model, _ = load_model("tiny-llama")
    ids = torch.randint(0, model.config.vocab_size, (1, 300), generator=torch.Generator().manual_seed(0))
    tensors = code_ablation.extract(model, ids, queries=3, appended=2)  # as --answer: 2 answer tokens read
    path = tmp_path / "p.safetensors"
    from safetensors.torch import save_file

    save_file(tensors, str(path))
    shape = (model.config.num_hidden_layers, model.config.num_key_value_heads,
             model.config.hidden_size // model.config.num_attention_heads)
    adapters = {"trained:x": SeKVAdapter(*shape, hash_bits=8),
                "trained:w": SeKVAdapter(*shape, hash_bits=8, hash_width=4, hash_layout=[[2, 0, 0]] * shape[0])}
    kinds = ["exact", "sign", "simhash-8", "orth-8", "pca-8", "qfit-8", "trained:x", "trained:w"]
    args = type("A", (), {"budget": 48, "sinks": 4, "recent": 16, "candidates": 4.0})()
    result = code_ablation.evaluate([("t", 0, path)], kinds, adapters, args)
    for kind in kinds:
        prompt = result[kind]["per_prompt"][0]
        assert 0 < prompt["mass"] <= 1 and 0 <= prompt["recall"] <= 1
        assert prompt["two_stage"] >= prompt["mass"] - 0.05  # exact rescoring of candidates loses little
        assert 0 <= prompt["top_row"] <= 1
    assert result["exact"]["per_prompt"][0]["top_row"] == 1.0  # the keys themselves keep the teacher's top row
    table = code_ablation.table(result, kinds, "sign", {k: 8 for k in kinds})
    assert table.count("\n") == len(kinds) + 1


def test_code_bits_other_than_one_is_refused_with_a_hash(config):
    with pytest.raises(ConfigError, match="trained hash of 16 bits"):
        SeKV(adapter=SeKVAdapter(2, H, 16, hash_bits=16), code_bits=2)


def test_the_fitted_start_reproduces_a_low_rank_query_key_product():
    """``hash_init: fit``: where the query-key product has rank ``b``, the fitted projections (before their signs)
    give it back exactly, and the key coordinates come out uncorrelated with unit variance."""
    from zoomkv.methods.sekv.hashing import fit_projections

    g = torch.Generator().manual_seed(0)
    d, b = 16, 8
    basis = torch.randn(d, b, generator=g, dtype=torch.float64)
    keys = torch.randn(4000, b, generator=g, dtype=torch.float64) @ basis.T * 3  # keys in a b-dim subspace
    queries = torch.randn(500, d, generator=g, dtype=torch.float64) + 1.0
    key_proj, query_proj = fit_projections(queries.T @ queries / 500, keys.T @ keys / 4000, b)
    z = keys.float() @ key_proj
    torch.testing.assert_close((queries.float() @ query_proj) @ z.T, queries.float() @ keys.float().T,
                               rtol=1e-3, atol=2e-2)
    torch.testing.assert_close(z.T @ z / 4000, torch.eye(b), rtol=0, atol=2e-2)


def test_the_candidates_loss_pulls_a_missed_row_into_the_candidates():
    """``w_recall``'s loss: zero gradient while the teacher's top row is among the candidates, a push up on its
    estimate (and down on none of the others') when the index ranks it out."""
    from zoomkv.methods.sekv.objective import candidate_miss

    n = 50
    region = torch.ones(n, dtype=torch.bool)
    teacher = torch.full((1, 1, n), 0.1 / (n - 1))
    teacher[..., 2] = 0.9
    inside = torch.linspace(100, 0, n)[None, None].clone().requires_grad_(True)  # row 2 ranks 3rd of 8 candidates
    candidate_miss(inside, teacher, region, rows=2, candidates=4.0).backward()
    missed = torch.linspace(100, 0, n)[None, None]
    missed[..., 2] = -5.0
    missed.requires_grad_(True)
    loss = candidate_miss(missed, teacher, region, rows=2, candidates=4.0)
    loss.backward()
    assert inside.grad[..., 2].abs() < 1e-3 < missed.grad[..., 2].abs()
    assert missed.grad[..., 2] < 0 and loss > 1.0  # gradient descent raises the missed row's estimate


# -- hash_width: projections at 4, 2 and 1 bits (a layout per layer) ------------------------------------------------
def test_a_mixed_layout_packs_whole_bytes_and_scores_what_it_decodes():
    """``(n4, n2, n1)`` = (2, 8, 8): 32 bits in 4 bytes, one RMS over the 18 coordinates; each group quantized as
    ``encode`` quantizes at its width; the byte-table score is the query's dot product with the decoded row; at all
    ones, exactly ``encode(x, 1)``."""
    from zoomkv.methods.sekv.codes import (
        decode_layout,
        encode,
        encode_layout,
        layout_bits,
        levels,
        quantize,
        score_layout,
    )

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, H, 50, 32, generator=g) * torch.linspace(3, 0.2, 32)
    layout = (2, 8, 8)
    codes, rms = encode_layout(x, layout)
    assert codes.shape == (2, H, 50, 4) and layout_bits(layout) == 32
    rows = decode_layout(codes, rms, layout)
    assert rows.shape == (2, H, 50, 18)
    used = x[..., :18]
    torch.testing.assert_close(rms.float(), used.pow(2).mean(-1, keepdim=True).sqrt(), rtol=1e-3, atol=1e-4)
    for a, b, bits in ((0, 2, 4), (2, 10, 2), (10, 18, 1)):  # each group: its width's levels of the shared RMS
        got = rows[..., a:b] / rms.float()
        assert (got[..., None] - levels(bits)).abs().amin(-1).max() < 1e-3
        z = used[..., a:b] / used.pow(2).mean(-1, keepdim=True).sqrt()
        assert torch.equal(quantize(z, bits), (got[..., None] - levels(bits)).abs().argmin(-1))
    err4 = (rows[..., :2] - used[..., :2]).pow(2).mean() / used[..., :2].pow(2).mean()
    err1 = (rows[..., 10:] - used[..., 10:]).pow(2).mean() / used[..., 10:].pow(2).mean()
    assert err4 < 0.05 < err1  # 4 bits keep a coordinate far better than a sign
    query = torch.randn(2, H, 4, 32, generator=g)
    torch.testing.assert_close(score_layout(query, codes, rms, layout), query[..., :18] @ rows.transpose(-1, -2),
                               rtol=1e-4, atol=1e-4)
    ones = encode_layout(x, (0, 0, 32))
    assert torch.equal(ones[0], encode(x, 1)[0]) and torch.equal(ones[1], encode(x, 1)[1])


def test_the_widths_go_where_the_logit_weighs():
    """``allocate``: directions of equal weight take a bit each; a few strong ones take 4 or 2 bits (reverse
    water-filling), never wider than ``width``, always ``bits`` in whole bytes a width, at the least weighted
    error of every such layout."""
    from zoomkv.methods.sekv.hashing import _DISTORTION, allocate

    assert allocate([1.0] * 32, 32, 4) == (0, 0, 32)
    steep = [2.0 ** -j for j in range(32)]
    n4, n2, n1 = allocate(steep, 32, 4)
    assert n4 > 0 and 4 * n4 + 2 * n2 + n1 == 32 and n4 % 2 == n2 % 4 == n1 % 8 == 0
    assert allocate(steep, 32, 2)[0] == 0 and allocate(steep, 32, 1) == (0, 0, 32)

    def cost(layout):
        widths = [4] * layout[0] + [2] * layout[1] + [1] * layout[2]
        return sum(w * _DISTORTION[b] for w, b in zip(steep, widths + [0] * (32 - len(widths)), strict=True))

    every = [(a, b, 32 - 4 * a - 2 * b) for a in range(0, 9, 2) for b in range(0, 17, 4)
             if 32 - 4 * a - 2 * b >= 0 and (32 - 4 * a - 2 * b) % 8 == 0]
    assert cost((n4, n2, n1)) == min(cost(v) for v in every)


@pytest.mark.parametrize("layout,match", [
    ([[2, 8, 8]], "one \\[n4, n2, n1\\] for each"),
    ([[2, 8, 8], [2, 8, 4]], "whole bytes"),
    ([[2, 8, 8], [0, 8, 8]], "not 32 bits"),
    ([[2, 8, 8], [2, "8", 8]], "is not \\[n4, n2, n1\\]"),
    ([[2, 8, 8], [4, 12, -8]], "is not \\[n4, n2, n1\\]"),
])
def test_a_bad_recorded_layout_is_one_line(layout, match):
    with pytest.raises(ConfigError, match=match):
        SeKVAdapter(2, H, 64, hash_bits=32, hash_width=4, hash_layout=layout)
    with pytest.raises(ConfigError, match="hash_width"):
        SeKVAdapter(2, H, 64, hash_bits=32, hash_width=3)
    with pytest.raises(ConfigError, match="at most 2 bits"):
        SeKVAdapter(2, H, 64, hash_bits=32, hash_width=2, hash_layout=[[2, 8, 8]] * 2)


def _mixed(config, seed: int = 0) -> SeKVAdapter:
    adapter = _hashed(config, 64, 32, seed)
    layers = config.num_hidden_layers
    mixed = SeKVAdapter(layers, H, 64, hash_bits=32, hash_width=4,
                        hash_layout=[[2, 8, 8] if i % 2 else [4, 4, 8] for i in range(layers)])
    mixed.load_state_dict(adapter.state_dict())
    return mixed


def test_the_step_scores_a_mixed_layout_from_its_bytes(config):
    """A row's device codes are 4 bytes at 32 bits whatever the layout; the router's score of every row is the
    query's projections against the decoded codes, rows appended after the prefill coded alike, and the step
    picks rows."""
    from zoomkv.methods.sekv.codes import decode_layout

    adapter = _mixed(config)
    method = SeKV(adapter=adapter)
    memory, g = _memory(config, method, t=300, budget=48, seed=2, batch=2, d=64)
    method.append(memory, torch.randn(2, H, 2, 64, generator=g), torch.randn(2, H, 2, 64, generator=g))
    dev = memory.device_tier
    layout = memory.meta["hash_layout"]
    assert dev["codes"].view().shape == (2, H, 302, 4) and dev["hash_key"].shape[-1] == sum(layout)
    query = torch.randn(2, H * G, 1, 64, generator=g)
    hashed = torch.matmul(query.view(2, H, G, 64), dev["hash_query"])
    rows = decode_layout(dev["codes"].view(), dev["code_rms"].view(), layout)
    expected = torch.matmul(hashed, rows.transpose(-1, -2)) * memory.meta["scaling"]
    got = method.router_scores(memory, query)
    anchors = dev["anchor_pos"].clamp_min(0)  # anchors keep the rotated key's finer codes
    keep = torch.ones_like(got, dtype=torch.bool).scatter(-1, anchors[:, None, None, :].expand(-1, H, G, -1), False)
    torch.testing.assert_close(got[keep], expected[keep], rtol=1e-4, atol=1e-4)
    selection = method.select_rows(memory, query)
    assert selection.keys.shape[2] == 48


def test_a_recipe_fits_trains_and_records_a_mixed_layout(tmp_path):
    """``hash_width=4 hash_init=fit``: the fit allocates each layer's widths from the teacher cache, the steps train
    the projections through the quantizer, the adapter records width and layout, loads them back, and a layout
    that does not add up is one line at load; the width without the fit is refused in the recipe."""
    from zoomkv.adapters.model import ZoomAdapter
    from zoomkv.cli import run_command

    base = ["--recipe", str(ROOT / "recipes" / "tiny-llama-sekv.yaml"), "hash_bits=16", f"output_dir={tmp_path}",
            "num_samples=2", "queries_per_sample=2", "steps=3", "layers_per_step=2", "eval_samples=0",
            "tensorboard=false", "max_trainable_fraction=1", "hash_width=4"]
    assert run_command("train", [*base, "hash_init=rotation", "--dry-run"], prog="zoomkv train") == 2
    assert run_command("train", [*base, "hash_init=fit"], prog="zoomkv train") == 0
    folder = tmp_path / "sekv-tiny" / "adapter"
    hyper = json.loads((folder / "adapter_config.json").read_text())["hyper"]
    assert hyper["hash_width"] == 4 and len(hyper["hash_layout"]) == hyper["num_layers"]
    assert all(4 * a + 2 * b + c == 16 for a, b, c in hyper["hash_layout"])
    method = ZoomAdapter.from_pretrained(folder).make_method()
    assert [list(v) for v in method.adapter.hash_layout] == hyper["hash_layout"]
    data = json.loads((folder / "adapter_config.json").read_text())
    data["hyper"]["hash_layout"][0] = [2, 0, 0]
    (folder / "adapter_config.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="hash_layout"):
        ZoomAdapter.from_pretrained(folder)


# -- fit_bits: codes fitted to the context itself at the prefill --------------------------------------------------
def test_the_fitted_moments_read_only_the_valid_positions():
    """``query_moment`` / ``fit_context``: what sits in left padding changes nothing; the layout is ``bits`` bits
    shared by the batch, the projections each sequence's and head's own."""
    from zoomkv.methods.sekv.codes import layout_bits
    from zoomkv.methods.sekv.hashing import fit_context, query_moment

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, H * G, 90, 16, generator=g) * torch.linspace(2, 0.1, 16)
    k = torch.randn(2, H, 90, 16, generator=g) * torch.linspace(0.1, 3, 16)
    valid = torch.ones(2, 90, dtype=torch.bool)
    valid[1, :30] = False
    q2, k2 = q.clone(), k.clone()
    q2[1, :, :30], k2[1, :, :30] = 1e3, -1e3  # padding's garbage
    m1, m2 = query_moment(q, valid, H), query_moment(q2, valid, H)
    torch.testing.assert_close(m1, m2)
    first = q[0, :G].reshape(-1, 16).double()  # KV head 0: its query heads' rows (a float32 sum each chunk)
    torch.testing.assert_close(m1[0, 0], first.T @ first / (90 * G), rtol=1e-4, atol=1e-4)
    key1, query1, layout1 = fit_context(m1, k, valid, 16)
    key2, query2, layout2 = fit_context(m2, k2, valid, 16)
    assert layout1 == layout2 and layout_bits(layout1) == 16 and key1.shape == (2, H, 16, sum(layout1))
    torch.testing.assert_close(key1, key2)
    torch.testing.assert_close(query1, query2)


def test_a_fitted_index_ranks_an_anisotropic_context_better_than_the_signs():
    """Keys and queries whose energy sits in few directions (as a model's do): the fitted codes' estimate of every
    row's logit follows the exact logits more closely than the rotated key's signs at the same 64 bits, and at
    32 bits no worse than them — the reason for ``fit_bits``."""
    from zoomkv.methods.sekv.codes import decode, decode_layout, encode, encode_layout, rotation
    from zoomkv.methods.sekv.hashing import fit_context, query_moment

    g = torch.Generator().manual_seed(1)
    d, t = 64, 2000
    basis = torch.linalg.qr(torch.randn(d, d, generator=g))[0]
    k = (torch.randn(1, 1, t, d, generator=g) * torch.logspace(0.5, -1.5, d)) @ basis.T
    q = (torch.randn(1, 1, t, d, generator=g) * torch.logspace(0, -1, d)) @ basis.T
    centred = k - k.mean(2, keepdim=True)
    exact = q[0, 0, -50:] @ centred[0, 0].T

    def corr(est):
        return float(torch.corrcoef(torch.stack([est.flatten(), exact.flatten()]))[0, 1])

    rot = rotation(d, 0)
    signs = corr((q[0, 0, -50:] @ rot) @ decode(*encode(centred[0, 0] @ rot, 1), 1).T)
    fitted = {}
    for bits in (32, 64):
        key, query, layout = fit_context(query_moment(q, None, 1), centred, None, bits)
        rows = decode_layout(*encode_layout(centred[0, 0] @ key[0, 0], layout), layout)
        fitted[bits] = corr((q[0, 0, -50:] @ query[0, 0]) @ rows.T)
    assert fitted[64] > signs + 0.02 and fitted[32] > signs


def test_the_runtime_keeps_the_query_moment_the_fit_needs(config):
    """A live prefill (sekv holds no queries while it waits for the surprisal: ``keep_query_statistics`` keeps
    their moment) and a replay of the recorded prefill (queries kept) fit the same index: the same projections,
    layout and codes on every layer; the greedy tokens run through the fitted step."""
    from tests.helpers import greedy, load_tiny, padded_batch
    from zoomkv import ZoomCache
    from zoomkv.memory.replay import cache_from_record, record_prefill

    model, _ = load_tiny("tiny-llama")
    ids, mask = padded_batch(model.config.vocab_size, lengths=(300, 220))
    live = ZoomCache(model, SeKV(fit_bits=16), 40)
    out = greedy(model, ids, mask, live, new=3)
    assert out.sequences.shape[1] == ids.shape[1] + 3
    replayed = cache_from_record(model, record_prefill(model, ids, mask), SeKV(fit_bits=16), 40)
    for i in range(model.config.num_hidden_layers):
        a, b = live.zoom_layer(i), replayed.zoom_layer(i)
        assert a.meta["hash_layout"] == b.meta["hash_layout"]
        torch.testing.assert_close(a.device_tier["hash_query"], b.device_tier["hash_query"], rtol=2e-3, atol=2e-3)
        n = b.device_tier["codes"].view().shape[2]
        same = (a.device_tier["codes"].view()[:, :, :n] == b.device_tier["codes"].view()).float().mean()
        assert same > 0.97  # (a coordinate at a level's edge may round the other way)


def test_fit_bits_is_checked(config):
    with pytest.raises(ConfigError, match="fit_bits"):
        SeKV(fit_bits=12)
    with pytest.raises(ConfigError, match="one or the other"):
        SeKV(adapter=SeKVAdapter(2, H, 16, hash_bits=16), fit_bits=16)
    method = SeKV(fit_bits=32)
    with pytest.raises(ConfigError, match="more than head_dim"):
        _memory(config, method, t=100, budget=40, seed=0, d=16)


def _fitted_memory(config, method, t, budget, seed, batch=2, d=64):
    """``_memory`` with queries that have a moment to fit (anisotropic, as a model's are)."""
    from zoomkv import ZoomCache
    from zoomkv.protocol.method import PrefillContext

    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, H, t, d, generator=g) * (1 + torch.rand(batch, H, 1, d, generator=g) * 3)
    values = torch.randn(batch, H, t, d, generator=g)
    queries = torch.randn(batch, H * G, t, d, generator=g) * torch.logspace(0.5, -1, d)
    cache = ZoomCache(config, method, budget)
    memory = cache.layers[0]
    memory.lazy_initialization(keys, values)
    memory.seen = t
    ctx = PrefillContext(layer_idx=0, num_layers=len(cache.layers), keys=keys, values=values, queries=queries,
                         valid=None, budget=budget, scaling=d**-0.5, num_kv_groups=G,
                         zoom_layers=cache.zoom_layer_indices, surprisal=torch.rand(batch, t, generator=g) ** 4 * 10)
    method.compress(memory, ctx)
    return memory, g


@pytest.mark.skipif(native.library() is None, reason="no C++ compiler: the torch path is all there is")
@pytest.mark.parametrize("index", ["mixed", "fit32", "fit64", "fit16"])
@pytest.mark.parametrize("kwargs", [{}, {"rescore_from": "host"}])
def test_the_compiled_step_reads_mixed_widths_and_fitted_codes_as_torch_does(config, index, kwargs):
    """The compiled CPU step scores a layout of 4-, 2- and 1-bit codes (byte tables of each byte's width, the
    16-row register path included) and each sequence's own fitted projections as the torch path does; its append
    codes new rows alike."""
    if index == "mixed":
        method = SeKV(adapter=_mixed(config), **kwargs)
        memory, g = _memory(config, method, t=300, budget=48, seed=1, batch=2, d=64)
    else:
        method = SeKV(fit_bits=int(index[3:]), **kwargs)
        memory, g = _fitted_memory(config, method, t=300, budget=48, seed=1)
    assert memory.meta["hash_layout"][0] + memory.meta["hash_layout"][1] > 0  # widths above one bit
    for _ in range(3):  # new rows coded by the compiled append
        method.append(memory, torch.randn(2, H, 1, 64, generator=g), torch.randn(2, H, 1, 64, generator=g))
        _assert_same(*_both(method, memory, torch.randn(2, H * G, 1, 64, generator=g) * 2))
    bits = 32 if index == "mixed" else int(index[3:])
    assert memory.device_tier["codes"].view().shape[-1] == bits // 8


@pytest.mark.skipif(native.library() is None, reason="no C++ compiler: the torch path is all there is")
@pytest.mark.parametrize("index", ["mixed", "fit32"])
def test_the_compiled_append_writes_mixed_codes_of_the_torch_append(config, index):
    def prefilled():
        if index == "mixed":
            method = SeKV(adapter=_mixed(config))
            return method, *_memory(config, method, t=120, budget=40, seed=8, batch=2, d=64)
        method = SeKV(fit_bits=32)
        return method, *_fitted_memory(config, method, t=120, budget=40, seed=8)

    (codes0, rms0), (codes1, rms1) = _appended_codes(prefilled)
    assert codes0.shape == codes1.shape == (2, H, 125, 4)
    assert (codes0 != codes1).float().mean() < 2e-2  # a projection at a level's edge may round the other way
    torch.testing.assert_close(rms0.float(), rms1.float(), rtol=2e-3, atol=1e-4)


def test_a_recipe_records_fit_bits_and_its_adapter_runs_with_them(tmp_path):
    from zoomkv.adapters.model import ZoomAdapter
    from zoomkv.cli import run_command

    assert run_command("train", ["--recipe", str(ROOT / "recipes" / "tiny-llama-sekv.yaml"), "fit_bits=16",
                                 f"output_dir={tmp_path}", "num_samples=2", "queries_per_sample=2", "steps=2",
                                 "layers_per_step=2", "eval_samples=0", "tensorboard=false"], prog="zoomkv train") == 0
    folder = tmp_path / "sekv-tiny" / "adapter"
    assert json.loads((folder / "adapter_config.json").read_text())["hyper"]["fit_bits"] == 16
    assert ZoomAdapter.from_pretrained(folder).make_method().config.fit_bits == 16
