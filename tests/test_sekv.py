"""sekv's behaviour on hand-built tensors: the key codes and their table scoring, anchors, routing, the
summary row, the layer split, generated rows and the budget, a padded batch, and loading an adapter. (The
generic invariants — B ≥ context is exactly full attention, the budget is never exceeded in generate(), the
decode step reads nothing back — run for every method in test_method_invariants.py, test_extend.py and
test_sync_audit.py.)"""

from __future__ import annotations

import math

import pytest
import torch

from zoomkv import ZoomCache
from zoomkv.adapters.errors import AdapterNotFoundError
from zoomkv.adapters.model import ZoomAdapter, build_adapter_modules
from zoomkv.errors import ConfigError
from zoomkv.memory import replay
from zoomkv.memory.attention import attend
from zoomkv.methods import get_method
from zoomkv.methods.sekv.codes import BITS, code_bytes, decode, encode, levels, rotation, score_codes
from zoomkv.methods.sekv.method import SeKV, pick_anchors, split_budget
from zoomkv.methods.sekv.modules import SeKVAdapter
from zoomkv.models import load_model
from zoomkv.protocol import rotary
from zoomkv.protocol.method import PrefillContext
from zoomkv.protocol.shape import ModelShape, base_fingerprint

H, D, G = 2, 16, 2  # KV heads, head dim, query heads per KV head


@pytest.fixture(scope="module")
def config():
    return load_model("tiny-llama")[0].config


def _memory(config, method, keys, values, surprisal, budget, valid=None, rotary_table=None, kv_quant=None):
    cache = ZoomCache(config, method, budget, kv_quant=kv_quant)
    memory = cache.layers[0]
    memory.lazy_initialization(keys, values)
    memory.seen = keys.shape[2]
    ctx = PrefillContext(layer_idx=0, num_layers=len(cache.layers), keys=keys, values=values,
                         queries=torch.zeros(keys.shape[0], H * G, keys.shape[2], D), valid=valid, budget=budget,
                         scaling=D**-0.5, num_kv_groups=G, zoom_layers=cache.zoom_layer_indices, surprisal=surprisal,
                         rotary=rotary_table)
    method.compress(memory, ctx)
    return memory


def _exact_attention(query, keys, values, scaling):
    k = keys.repeat_interleave(G, dim=1)
    v = values.repeat_interleave(G, dim=1)
    w = torch.softmax(torch.matmul(query, k.transpose(-1, -2)) * scaling, -1)
    return torch.matmul(w, v).transpose(1, 2)


def _pointed_keys(t=200, target=70, seed=0):
    """Random keys; the query of every head points at row ``target`` (a scaled copy of its key)."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(1, H, t, D, generator=g)
    values = torch.randn(1, H, t, D, generator=g)
    query = (keys[:, :, target] * 3.0).repeat_interleave(G, dim=1)[:, :, None]  # [1, H*G, 1, D]
    return keys, values, query


# -- codes ------------------------------------------------------------------------------------------------
def test_rotation_is_orthogonal_and_a_function_of_the_seed():
    r = rotation(D, 3)
    torch.testing.assert_close(r @ r.T, torch.eye(D), atol=1e-5, rtol=0)
    assert torch.equal(r, rotation(D, 3)) and not torch.equal(r, rotation(D, 4))


@pytest.mark.parametrize("bits", BITS)
def test_codes_pack_to_bits_and_table_scores_equal_the_decoded_dot_product(bits):
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(2, H, 50, D, generator=g) * 3
    codes, rms = encode(x, bits)
    assert codes.dtype == torch.uint8 and codes.shape == (2, H, 50, D * bits // 8)
    assert code_bytes(D, bits) == D * bits // 8 + 2
    dec = decode(codes, rms, bits)
    q = torch.randn(2, H, G, D, generator=g)
    torch.testing.assert_close(score_codes(q, codes, rms, bits), q @ dec.transpose(-1, -2), atol=1e-3, rtol=1e-3)
    # more bits, closer to the keys: the relative error falls with every bit
    err = ((dec - x).norm(dim=-1) / x.norm(dim=-1)).mean()
    assert err < {1: 0.65, 2: 0.4, 4: 0.11, 8: 0.01}[bits]
    if bits == 1:  # one bit keeps each coordinate's sign, at the Gaussian's mean magnitude
        assert torch.equal(dec > 0, x > 0)
        assert torch.allclose(levels(1).abs(), torch.full((2,), math.sqrt(2 / math.pi)))


def test_one_bit_codes_still_find_the_row_a_query_points_to():
    keys, _, query = _pointed_keys(t=500, target=321)
    rot = rotation(D, 0)
    x = (keys - keys.mean(2, keepdim=True)) @ rot
    codes, rms = encode(x, 1)
    q = (query.view(1, H, G, D) @ rot)
    assert bool((score_codes(q, codes, rms, 1).argmax(-1) == 321).all())


# -- anchors ----------------------------------------------------------------------------------------------
def test_anchors_are_the_most_surprising_tokens_outside_sinks_and_recent():
    s = torch.zeros(2, 100)
    s[0, [2, 30, 50, 97]] = 10.0  # 2 is a sink, 97 in the recent window
    s[0, 60] = 5.0
    s[1, [10, 20]] = 8.0
    valid = torch.ones(2, 100, dtype=torch.bool)
    pos = pick_anchors(s, valid, tau=2.0, most=5, skip=4, stop=90)
    assert pos[0].tolist() == [30, 50, 60]
    assert pos[1].tolist() == [-1, 10, 20]  # fewer anchors: -1 fills the row
    assert pick_anchors(s, valid, tau=2.0, most=2, skip=4, stop=90)[0].tolist() == [30, 50]  # capped
    assert pick_anchors(s, valid, tau=100.0, most=5, skip=4, stop=90).shape[1] == 0  # nothing clears τ


def test_anchors_are_scored_from_their_finer_codes(config):
    keys, values, query = _pointed_keys()
    s = torch.zeros(1, 200)
    s[0, 70] = 20.0
    method = SeKV(anchor_fraction=0.05)
    memory = _memory(config, method, keys, values, s, budget=40)
    assert memory.device_tier["anchor_pos"].tolist() == [[70]]
    scores = method.router_scores(memory, query)
    dev = memory.device_tier
    q = query.view(1, H, G, D).float() @ dev["code_rotation"]
    fine = score_codes(q, dev["anchor_codes"], dev["anchor_rms"], 4)[..., 0] * D**-0.5
    coarse = score_codes(q, dev["codes"].view(), dev["code_rms"].view(), 1) * D**-0.5
    torch.testing.assert_close(scores[..., 70], fine)
    torch.testing.assert_close(scores[..., 69], coarse[..., 69])


# -- routing, the summary row, the budget ------------------------------------------------------------------
def test_router_recalls_the_row_the_query_points_to_and_the_summary_row_stands_for_the_rest(config):
    keys, values, query = _pointed_keys(target=70)
    method = SeKV()
    memory = _memory(config, method, keys, values, torch.zeros(1, 200), budget=40)
    sel = method.select(memory, query)
    assert sel.keys.shape[2] == 40  # 39 recalled rows + the summary row
    recalled = sel.keys[0, :, :39]
    assert all(bool((recalled[h] == keys[0, h, 70]).all(-1).any()) for h in range(H))
    # sinks and the newest rows always count
    for pos in (0, 1, 2, 3, 199, 184):
        assert all(bool((recalled[h] == keys[0, h, pos]).all(-1).any()) for h in range(H))
    # the summary row: the mean of every row not recalled, standing for them with log(count)
    chosen = torch.zeros(H, 200, dtype=torch.bool)
    for h in range(H):
        chosen[h] = (keys[0, h][:, None] == recalled[h][None]).all(-1).any(-1)
    for h in range(H):
        torch.testing.assert_close(sel.keys[0, h, 39], keys[0, h][~chosen[h]].mean(0), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(sel.values[0, h, 39], values[0, h][~chosen[h]].mean(0), atol=1e-5, rtol=1e-5)
        assert math.isclose(float(sel.bias[0, h, 39]), math.log(161), rel_tol=1e-5)
    assert method.device_rows(memory) == 40
    # a trained summary bias moves the row's weight; without the row the budget is all recalled rows
    adapter = SeKVAdapter(4, H, D)
    with torch.no_grad():
        adapter.summary_bias[0] = torch.tensor([1.0, -2.0])
    biased = SeKV(adapter=adapter)
    sel = biased.select(_memory(config, biased, keys, values, torch.zeros(1, 200), budget=40), query)
    assert torch.allclose(sel.bias[0, :, 39], torch.tensor([1.0, -2.0]) + math.log(161))
    plain = SeKV(summary_row=False)
    memory = _memory(config, plain, keys, values, torch.zeros(1, 200), budget=40)
    sel = plain.select(memory, query)
    assert sel.keys.shape[2] == 40 == plain.device_rows(memory) and "sekv_tail_count" not in memory.device_tier


def test_everything_exact_while_it_fits_then_within_budget(config):
    keys, values, query = _pointed_keys(t=50, target=20)
    method = SeKV()
    memory = _memory(config, method, keys, values, torch.rand(1, 50), budget=64)
    out = attend(query, method.select(memory, query), D**-0.5)
    torch.testing.assert_close(out, _exact_attention(query, keys, values, D**-0.5), atol=1e-5, rtol=1e-5)
    g = torch.Generator().manual_seed(5)
    for _ in range(30):  # outgrows the budget while decoding: never over it, every row coded
        method.append(memory, torch.randn(1, H, 1, D, generator=g), torch.randn(1, H, 1, D, generator=g))
        sel = method.select(memory, query)
        assert sel.keys.shape[2] <= 64 and method.device_rows(memory) <= 64
    assert memory.device_tier["codes"].length == 80 == memory.host_tier["keys"].length


def test_index_bytes_are_the_codes(config):
    keys, values, _ = _pointed_keys(t=400)
    memory = _memory(config, SeKV(anchor_fraction=0.0), keys, values, torch.zeros(1, 400), budget=40)
    dev = memory.device_tier
    per_row = dev["codes"].data.shape[-1] * dev["codes"].data.element_size() + dev["code_rms"].data.element_size()
    assert per_row == code_bytes(D, 1) == 4
    kv_row = 2 * D * keys.element_size()
    assert per_row / kv_row < 0.04


def test_split_budget_sums_to_the_total_and_keeps_the_floor():
    assert split_budget(40, [1, 1, 1, 1], 5) == [10, 10, 10, 10]
    out = split_budget(100, [0.1, 3.0, 0.5, 0.4], 8)
    assert sum(out) == 100 and min(out) >= 8 and out[1] == max(out)
    with pytest.raises(ConfigError):
        split_budget(10, [1, 1, 1], 5)


def test_a_trained_layer_split_moves_rows_and_generate_stays_within_it():
    from zoomkv.compat import generate_cache_kwargs

    model, _ = load_model("tiny-llama")
    shape = ModelShape.from_model(model)
    adapter = build_adapter_modules("sekv", shape, {"max_trainable_fraction": 0.05})
    with torch.no_grad():
        adapter.layer_logit.copy_(torch.linspace(-1, 1, adapter.num_layers))
    method = SeKV(adapter=adapter)
    n = adapter.num_layers
    budgets = [method.layer_budget(i, n, 40, list(range(n))) for i in range(n)]
    assert sum(budgets) == 40 * n and budgets == sorted(budgets) and budgets[0] < budgets[-1]
    ids = torch.randint(5, 250, (1, 150), generator=torch.Generator().manual_seed(1))
    cache = ZoomCache(model, method, 40)
    model.generate(input_ids=ids, max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0,
                   **generate_cache_kwargs(cache))
    held = [cache.layers[i].max_device_rows for i in range(n)]
    assert all(h <= b for h, b in zip(held, budgets, strict=True)) and max(held) > 40


def test_gains_weigh_the_router_coordinates(config):
    keys, values, query = _pointed_keys()
    adapter = SeKVAdapter(4, H, D)
    plain = SeKV(adapter=adapter)
    before = plain.router_scores(_memory(config, plain, keys, values, torch.zeros(1, 200), budget=40), query)
    with torch.no_grad():
        adapter.code_gain[0, :, : D // 2] = -20.0  # the first half of the rotated coordinates switched off
    memory = _memory(config, plain, keys, values, torch.zeros(1, 200), budget=40)
    after = plain.router_scores(memory, query)
    dev = memory.device_tier
    assert dev["code_gains"].shape == (H, D)  # read at the compression, held where the step reads it
    q = query.view(1, H, G, D).float() @ dev["code_rotation"]
    q[..., : D // 2] = 0
    expect = score_codes(q, dev["codes"].view(), dev["code_rms"].view(), 1) * D**-0.5
    torch.testing.assert_close(after, expect, atol=1e-5, rtol=1e-4)
    assert not torch.allclose(before, after)


def test_left_padded_batch_compresses_within_budget():
    from zoomkv.compat import generate_cache_kwargs

    model, _ = load_model("tiny-llama")
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(5, 250, (2, 120), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :50] = 0  # the second row has 70 real tokens
    ids[1, :50] = 0
    cache = ZoomCache(model, SeKV(), 56)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30, min_new_tokens=30, do_sample=False,
                         pad_token_id=0, **generate_cache_kwargs(cache))
    assert out.shape[1] == 150
    assert 0 < cache.max_device_rows <= 56
    memory = cache.layers[0]
    # padding is never summarised: the summary row's count is each row's real tokens (29 appended: the 30th
    # token is sampled from the last step and never enters the cache)
    count = memory.device_tier["sekv_tail_count"][:, 0, 0]
    assert count.tolist() == [120 + 29, 70 + 29]
    # the sinks are each row's first real tokens
    assert memory.device_tier["sink_pos"].tolist() == [[0, 1, 2, 3], [50, 51, 52, 53]]


def test_adapter_by_module_or_folder(config, tmp_path):
    shape = ModelShape.from_config(config, num_parameters=10**6)
    adapter = build_adapter_modules("sekv", shape, {"max_trainable_fraction": 0.01})
    with torch.no_grad():
        adapter.span_tau.add_(1.5)
    assert get_method("sekv", adapter=adapter).adapter is adapter
    fp = base_fingerprint(config, name="tiny-llama")
    ZoomAdapter.from_modules(adapter, "sekv", {**adapter.hyper()}, shape=shape, fingerprint=fp).save_pretrained(
        tmp_path / "ad")
    loaded = ZoomAdapter.from_pretrained(tmp_path / "ad").make_method().adapter
    # the settings an adapter was trained with come with it, unless given explicitly
    ZoomAdapter.from_modules(adapter, "sekv", {**adapter.hyper(), "code_bits": 2, "anchor_fraction": 0.2},
                             shape=shape, fingerprint=fp).save_pretrained(tmp_path / "ad2")
    assert ZoomAdapter.from_pretrained(tmp_path / "ad2").make_method().config.code_bits == 2
    assert ZoomAdapter.from_pretrained(str(tmp_path / "ad2")).make_method().config.anchor_fraction == 0.2
    assert ZoomAdapter.from_pretrained(tmp_path / "ad2").make_method(code_bits=4).config.code_bits == 4
    for (k, a), (_, b) in zip(adapter.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), k
    with pytest.raises(AdapterNotFoundError, match="no such folder"):
        ZoomAdapter.from_pretrained(tmp_path / "missing")
    with pytest.raises(ConfigError, match="SeKVAdapter"):
        get_method("sekv", adapter=str(tmp_path / "ad2"))
    wrong = SeKVAdapter(3, H, D)
    keys, values, _ = _pointed_keys()
    with pytest.raises(ConfigError, match="built for 3 layers"):
        _memory(config, SeKV(adapter=wrong), keys, values, torch.ones(1, 200), budget=100)
    # a fresh adapter: every gain 1, τ = 2, one budget per layer
    fresh = SeKVAdapter(4, H, D)
    assert torch.equal(fresh.gains(0), torch.ones(H, D))
    assert math.isclose(float(fresh.span_tau[0].detach()), 2.0)
    assert torch.equal(fresh.layer_shares(), torch.ones(4))


def test_the_second_stage_rescores_candidates_with_the_host_tiers_finer_codes(config):
    """Rows whose one-bit codes tie (same signs, same RMS) are told apart by their 4-bit codes: the row
    holding its energy where the query points is recalled only with the second stage."""
    t, target = 200, 100
    rot = rotation(D, 0)  # a fresh method's rotation of layer 0
    x = torch.full((t, D), 1.0)
    x[target] = 0.0
    x[target, :4] = 2.0  # same signs as every row, unit RMS, its energy on the first four coordinates
    x[target, 4:] = 1e-3
    x[1::2] = -x[0::2]  # each row's opposite: the mean key is zero, centring changes nothing
    keys = (x @ rot.T).expand(1, H, t, D).contiguous()
    values = torch.randn(1, H, t, D, generator=torch.Generator().manual_seed(3))
    q_rot = torch.zeros(D)
    q_rot[:4] = 3.0
    q_rot[4:] = 0.1
    query = (q_rot @ rot.T).expand(1, H * G, 1, D).contiguous()
    budget = 4 + 16 + 2 + 1  # sinks, recent, two recalled rows, the summary row
    two = SeKV(anchor_fraction=0.0)
    memory = _memory(config, two, keys, values, torch.zeros(1, t), budget=budget)
    assert memory.host_tier["fine_codes"].view().shape == (1, H, t, D * 4 // 8)
    assert memory.device_tier["cand_codes"].shape[2] == math.ceil(4.0 * (budget - 1))
    recalled = two.select(memory, query).keys[0, :, : budget - 1]
    assert all(bool((recalled[h] == keys[0, h, target]).all(-1).any()) for h in range(H))
    one = SeKV(anchor_fraction=0.0, rescore_bits=0)
    memory = _memory(config, one, keys, values, torch.zeros(1, t), budget=budget)
    scores = one.router_scores(memory, query)[0, 0, 0]
    assert torch.allclose(scores[0::2], scores[target])  # one bit cannot tell the target from any even row


def _low_rank_before_rope(t, rank, table, pad=0, seed=0):
    """Keys of rank ``rank`` before RoPE (sinks far off it), rotated at positions ``-pad .. t - pad - 1``."""
    g = torch.Generator().manual_seed(seed)
    basis = torch.randn(H, rank, D, generator=g)
    before = torch.matmul(torch.randn(1, H, t, rank, generator=g), basis) + 0.5
    before[:, :, pad:pad + 4] = torch.randn(1, H, 4, D, generator=g) * 20  # the sinks: outliers of their own
    cos, sin = rotary.angles((torch.arange(t) - pad).clamp_min(0)[None, None], *table)
    return rotary.apply(before, cos, sin)


@pytest.mark.parametrize("pad", [0, 3])
def test_rank_gates_before_rope_recall_low_rank_keys_exactly(config, pad):
    table = (1.0 / 10000 ** (torch.arange(0, D, 2) / D), 1.0)
    t = 120
    keys = _low_rank_before_rope(t, 4, table, pad)
    values = torch.randn(1, H, t, D)
    valid = (torch.arange(t) >= pad)[None] if pad else None
    adapter = SeKVAdapter(4, H, D)
    with torch.no_grad():
        adapter.rank_gate[0, 0, 4:] = -1.0  # keys: 4 of 16 principal directions; values: all
    errors = {}
    for basis in ("pre_rope", "post_rope"):
        method = SeKV(adapter=adapter, host_key_basis=basis, host_exact_sinks=True)
        memory = _memory(config, method, keys, values, torch.zeros(1, t), budget=40, valid=valid,
                         rotary_table=table)
        assert memory.host_tier["keys"].view().shape == (1, H, t, 4)
        # a generated row (position t - pad) joins the same way
        nxt = _low_rank_before_rope(t + 1, 4, table, pad)[:, :, -1:]
        method.append(memory, nxt, values[:, :, :1])
        recalled, _, _ = method._recall(memory, None)
        truth = torch.cat([keys, nxt], 2)
        err = (recalled - truth)[:, :, pad:].abs().max()
        errors[basis] = float(err)
        sinks = recalled[:, :, pad:pad + 4]
        assert torch.equal(sinks, keys[:, :, pad:pad + 4])  # the sinks stay exact either way
    assert errors["pre_rope"] < 1e-3  # rank 4 before RoPE: the 4 directions hold every key
    assert errors["post_rope"] > 0.1  # after RoPE each position turns the keys: rank 4 is not enough


def test_rank_gates_keep_the_host_rows_in_their_principal_directions(config):
    keys, values, query = _pointed_keys(t=200, target=70)
    adapter = SeKVAdapter(4, H, D)
    with torch.no_grad():
        adapter.rank_gate[0, 0, 6:] = -1.0  # keys: the first 6 of 16 principal directions; values: all
    method = SeKV(adapter=adapter)
    memory = _memory(config, method, keys, values, torch.zeros(1, 200), budget=40)
    host = memory.host_tier
    assert host["keys"].view().shape == (1, H, 200, 6) and host["values"].view().shape == (1, H, 200, D)
    full = _memory(config, SeKV(), keys, values, torch.zeros(1, 200), budget=40)
    assert memory.host_bytes < full.host_bytes
    # a recalled key is its best approximation in those 6 directions (centred): the rank-6 PCA of the keys
    sel = method.select(memory, query)
    centred = keys[0] - keys[0].mean(1, keepdim=True)
    _, _, vh = torch.linalg.svd(centred, full_matrices=False)
    best = centred @ vh[:, :6].transpose(-1, -2) @ vh[:, :6] + keys[0].mean(1, keepdim=True)  # [H, 200, D]
    recalled = sel.keys[0, :, :39]
    for h in range(H):
        dist = torch.cdist(recalled[h], best[h], compute_mode="donot_use_mm_for_euclid_dist")
        assert float(dist.min(-1).values.max()) < 1e-4
    # rows generated later are projected onto the same directions; values stay exact
    method.append(memory, keys[:, :, :1] * 2, values[:, :, :1])
    assert host["keys"].view().shape[2] == 201
    assert torch.equal(host["values"].view()[:, :, 200:], values[:, :, :1])
    # a context that fits the budget stays exact whatever the gates (B >= context is full attention)
    small = _memory(config, method, keys[:, :, :30], values[:, :, :30], torch.zeros(1, 30), budget=40)
    assert small.host_tier["keys"].view().shape == (1, H, 30, D)


def test_training_truncates_the_host_rows_as_inference_recalls_them(config):
    from zoomkv.methods.sekv.host import truncated

    table = (1.0 / 10000 ** (torch.arange(0, D, 2) / D), 1.0)
    t = 90
    keys = _low_rank_before_rope(t, 6, table) + 0.05 * torch.randn(1, H, t, D)
    values = torch.randn(1, H, t, D)
    adapter = SeKVAdapter(4, H, D)
    with torch.no_grad():
        adapter.rank_gate[0, 0, 5:] = -1.0
        adapter.rank_gate[0, 1, 9:] = -1.0
    method = SeKV(adapter=adapter, host_key_basis="pre_rope", host_exact_sinks=True)
    memory = _memory(config, method, keys, values, torch.zeros(1, t), budget=40, rotary_table=table)
    rk, rv, _ = method._recall(memory, None)
    gates = (adapter.rank_gate[0] > 0).float()
    rope = rotary.angles(torch.arange(t), *table)
    exact = torch.arange(t) < 4
    assert torch.allclose(truncated(keys[0], gates[0], exact, rope), rk[0], atol=1e-4)
    assert torch.allclose(truncated(values[0], gates[1], exact), rv[0], atol=1e-4)


def test_teacher_samples_carry_the_rotary_table_the_objective_unrotates_with():
    from zoomkv import compat
    from zoomkv.methods.sekv.method import SeKVConfig
    from zoomkv.methods.sekv.objective import sample_rope
    from zoomkv.train.teacher import extract_sample

    model = load_model("tiny-llama")[0]
    sample = extract_sample(model, torch.randint(3, 200, (1, 48)), 3, 16, 4)
    layer = int(sample["layers"][0])
    inv_freq, scaling = compat.rotary_frequencies(model.config, layer)
    assert torch.equal(sample[f"rotary_inv_freq.{layer}"], inv_freq)
    cos, sin = sample_rope(sample, layer, 48, SeKVConfig(host_key_basis="pre_rope"))
    # the cached keys rotated back are rows whose norm RoPE kept (rotation) and whose position 0 is unchanged
    keys = sample[f"k.{layer}"].float()
    before = rotary.undo(keys, cos, sin)
    assert torch.allclose(before.norm(dim=-1), keys.norm(dim=-1), atol=1e-3)
    assert torch.allclose(before[:, 0], keys[:, 0])
    assert sample_rope(sample, layer, 48, SeKVConfig()) is None  # post_rope: the objective never unrotates


def test_teacher_signals_never_hold_a_layers_attention_over_every_candidate(monkeypatch):
    """The teacher picks the queries whose attention reaches furthest back (summed over layers) and keeps their
    attention rows: computed in blocks of candidates, it gives what one pass over all of them gives, and no
    softmax it takes is larger than its block (at the 8B recipe's 16K tokens one layer's would be 17 GB)."""
    from zoomkv.train import teacher

    model = load_model("tiny-qwen3")[0]  # 4 layers, GQA (2 query heads a KV head), some queries reaching far back
    ids = torch.randint(3, 200, (1, 300), generator=torch.Generator().manual_seed(0))
    n_queries, min_pos, recent = 5, 64, 16
    record = replay.record_prefill(model, ids)
    t, layers = ids.shape[1], sorted(record.contexts)
    cands = torch.arange(t // 2, t)
    far, probs_by_layer = torch.zeros(len(cands)), {}
    for layer in layers:  # the definition: every candidate's attention at once
        ctx = record.contexts[layer]
        k = ctx.keys[0].float().repeat_interleave(ctx.num_kv_groups, dim=0)
        logits = (ctx.queries[0][:, cands].float() @ k.transpose(-1, -2)) * ctx.scaling
        probs = torch.softmax(logits.masked_fill(torch.arange(t)[None] > cands[:, None], float("-inf")), -1)
        probs_by_layer[layer] = probs
        far += (probs * (torch.arange(t)[None] < cands[:, None] - recent - 32)).sum(-1).mean(0)
    chosen = torch.cat([far[:-1].topk(n_queries - 1).indices, torch.tensor([len(cands) - 1])]).sort().values
    assert chosen.tolist() != list(range(len(cands) - n_queries, len(cands)))  # not merely the last ones

    sizes = []
    softmax = torch.softmax
    monkeypatch.setattr(teacher.torch, "softmax", lambda x, dim: sizes.append(x.numel()) or softmax(x, dim))
    block = probs_by_layer[layers[0]].shape[0] * t * 20  # 20 candidates a block: 8 blocks a layer
    monkeypatch.setattr(teacher, "SCORES_AT_ONCE", block)
    sample = teacher.extract_sample(model, ids, n_queries, min_pos, recent)
    assert max(sizes) <= block < probs_by_layer[layers[0]].numel()
    assert torch.equal(sample["positions"], cands[chosen])
    for layer in layers:
        assert torch.equal(sample[f"attn.{layer}"], probs_by_layer[layer][:, chosen].half())


def test_rank_gates_keep_the_anchors_exact_on_the_host_tier(config):
    keys, values, _ = _pointed_keys(t=200, target=70)
    surprisal = torch.zeros(1, 200)
    surprisal[0, [70, 120]] = 10.0  # two surprising tokens: the anchors
    adapter = SeKVAdapter(4, H, D)
    with torch.no_grad():
        adapter.rank_gate[0, :, 3:] = -1.0  # 3 of 16 directions for keys and values
    exact = SeKV(adapter=adapter, host_exact_anchors=True)
    memory = _memory(config, exact, keys, values, surprisal, budget=40)
    assert memory.device_tier["anchor_pos"].tolist() == [[70, 120]]
    assert memory.host_tier["exact_anchor_keys"].view().shape == (1, H, 2, D)
    rk, rv, _ = exact._recall(memory, None)
    for row in (70, 120):
        assert torch.equal(rk[:, :, row], keys[:, :, row]) and torch.equal(rv[:, :, row], values[:, :, row])
    assert (rk[:, :, 71] - keys[:, :, 71]).abs().max() > 0.1  # the others: rank 3 of 16
    # a recall of some rows (in any order) finds the anchors among them
    idx = torch.tensor([[[5, 120, 70, 33]]]).expand(1, H, -1)
    rk, _, _ = exact._recall(memory, idx)
    assert torch.equal(rk[:, :, 1], keys[:, :, 120]) and torch.equal(rk[:, :, 2], keys[:, :, 70])
    plain = _memory(config, SeKV(adapter=adapter), keys, values, surprisal, budget=40)
    assert (SeKV(adapter=adapter)._recall(plain, None)[0][:, :, 70] - keys[:, :, 70]).abs().max() > 0.1
    assert memory.host_bytes > plain.host_bytes  # the exact copies are counted


@pytest.mark.parametrize("bits, tol", [(16, 1e-2), (8, 6e-2)])
def test_a_quantized_host_tier_recalls_the_anchors_from_their_finer_copy(config, bits, tol):
    keys, values, query = _pointed_keys(t=200, target=70)
    surprisal = torch.zeros(1, 200)
    surprisal[0, [70, 120]] = 10.0  # two surprising tokens: the anchors
    fine = SeKV(host_anchor_bits=bits)
    memory = _memory(config, fine, keys, values, surprisal, budget=40, kv_quant="int2")
    assert memory.device_tier["anchor_pos"].tolist() == [[70, 120]]
    assert memory.host_tier["exact_anchor_values"].view().shape == (1, H, 2, D)
    rk, rv, _ = fine._recall(memory, None)
    for row in (70, 120):
        assert (rk[:, :, row] - keys[:, :, row]).abs().max() < tol
        assert (rv[:, :, row] - values[:, :, row]).abs().max() < tol
    assert (rk[:, :, 71] - keys[:, :, 71]).abs().max() > 0.2  # the other rows: 2-bit codes
    plain = _memory(config, SeKV(), keys, values, surprisal, budget=40, kv_quant="int2")
    assert memory.host_bytes > plain.host_bytes  # the copies are counted
    # a decode step (the compiled selection where it builds, the recall in torch) returns the finer row 70
    def nearest(sel):  # per head: how far the closest selected key is from row 70's
        return (sel.keys - keys[:, :, 70, None]).abs().amax(-1).amin(-1)
    assert bool((nearest(fine.select(memory, query)) < tol).all())
    assert bool((nearest(SeKV().select(plain, query)) > 0.2).all())
    assert _memory(config, fine, keys, values, surprisal, budget=40).host_tier.get("exact_anchor_keys") is None
    with pytest.raises(ConfigError, match="host_anchor_bits"):
        SeKV(host_anchor_bits=4)


def test_rank_gates_keep_rows_after_compression_exact(config):
    keys, values, _ = _pointed_keys(t=200, target=70)
    adapter = SeKVAdapter(4, H, D)
    with torch.no_grad():
        adapter.rank_gate[0, :, 3:] = -1.0
    method = SeKV(adapter=adapter, host_exact_late=True)
    memory = _memory(config, method, keys, values, torch.zeros(1, 200), budget=40)
    new_k, new_v = torch.randn(1, H, 5, D), torch.randn(1, H, 5, D)
    method.extend(memory, new_k, new_v)  # a question after compression
    method.append(memory, new_k[:, :, :1] * 3, new_v[:, :, :1] * 3)  # then a generated token
    assert memory.host_tier["keys"].view().shape == (1, H, 206, 3)  # the low-rank copy keeps the indexing
    rk, rv, _ = method._recall(memory, None)
    assert torch.equal(rk[:, :, 200:205], new_k) and torch.equal(rv[:, :, 205:], new_v[:, :, :1] * 3)
    assert (rk[:, :, 150] - keys[:, :, 150]).abs().max() > 0.1  # the compressed context: rank 3 of 16
    idx = torch.tensor([[[10, 203, 205]]]).expand(1, H, -1)
    rk, _, _ = method._recall(memory, idx)
    assert torch.equal(rk[:, :, 1], new_k[:, :, 3]) and torch.equal(rk[:, :, 2], new_k[:, :, 0] * 3)


@pytest.mark.parametrize("bits", ["int8", "int4"])
def test_rank_gates_and_quantization_compose(config, bits):
    """A rank-gated host tier under kv_quant stores its coordinates quantized: fewer bytes than either cut
    alone, and rows recalled about as the unquantized low-rank tier gives them (an odd number of kept
    directions included: int4 pads it to a byte)."""
    keys, values, _ = _pointed_keys(t=200, target=70)
    adapter = SeKVAdapter(4, H, D)
    with torch.no_grad():
        adapter.rank_gate[0, 0, 5:] = -1.0  # keys: 5 of 16 directions (odd); values: all 16
    method = SeKV(adapter=adapter, host_exact_late=True)

    def memory_with(quant, gated):
        m = method if gated else SeKV()
        return m, _memory(config, m, keys, values, torch.zeros(1, 200), budget=40, kv_quant=quant)

    m_q, both = memory_with(bits, True)
    m_r, rank_only = memory_with(None, True)
    _, quant_only = memory_with(bits, False)
    assert both.host_tier["keys"].view().shape == (1, H, 200, 5)
    assert both.host_bytes < rank_only.host_bytes and both.host_bytes < quant_only.host_bytes
    rk_q, rv_q, _ = m_q._recall(both, None)
    rk_r, rv_r, _ = m_r._recall(rank_only, None)
    tol = 0.05 if bits == "int8" else 0.5  # half a quantization step of these rows' range
    assert (rk_q - rk_r).abs().max() < tol and (rv_q - rv_r).abs().max() < tol
    assert (rk_r - keys).abs().max() > 0.5  # and the rank cut still shows: 5 of 16 directions
    # a generated row joins quantized too
    m_q.append(both, keys[:, :, :1], values[:, :, :1])
    assert both.host_tier["keys"].view().shape == (1, H, 201, 5)
    # gates that keep no key direction at all (a trained layer can): the keys are their mean, nothing to code
    with torch.no_grad():
        adapter.rank_gate[0, 0, :] = -1.0
    m_none, none_kept = memory_with(bits, True)
    assert none_kept.host_tier["keys"].view().shape == (1, H, 200, 0)
    rk, _, _ = m_none._recall(none_kept, None)
    assert torch.allclose(rk, keys.mean(2, keepdim=True).expand_as(rk), atol=1e-5)


def test_a_quantization_group_that_does_not_divide_the_head_is_refused(config):
    with pytest.raises(ConfigError, match="does not divide head_dim"):
        ZoomCache(config, "quest", 40, kv_quant="int8", kv_quant_group=6)


def test_rescoring_from_the_host_keys_is_refused_where_rank_gates_cut_them(config):
    keys, values, _ = _pointed_keys(t=200, target=70)
    adapter = SeKVAdapter(4, H, D)
    with torch.no_grad():
        adapter.rank_gate[0, 0, 6:] = -1.0  # the host tier holds the keys' coordinates, not the keys
    with pytest.raises(ConfigError, match="rescore_from=host"):
        _memory(config, SeKV(adapter=adapter, rescore_from="host"), keys, values, torch.zeros(1, 200), budget=40)

