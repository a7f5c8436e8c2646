"""``semantic_id`` on hand-built tensors (merging, protection, log-n exactness, recall and re-merge, budget)
and its projector; the runtime invariants run for it in test_method_invariants.py (it needs no profile)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers import assert_all_tensors_in_tiers, load_tiny
from zoomkv import ZoomCache
from zoomkv.adapters.model import build_adapter_modules
from zoomkv.compat import generate_cache_kwargs
from zoomkv.errors import BudgetError, ConfigError
from zoomkv.memory import LayerMemory
from zoomkv.memory.attention import attend
from zoomkv.methods import get_method
from zoomkv.methods.semantic_id.merging import COMPRESSED, RAW, RECALLED, match_score
from zoomkv.methods.semantic_id.projector import InputCorrection, SemanticProjector, pca_basis, semantic_input
from zoomkv.protocol.method import PrefillContext, Selection
from zoomkv.protocol.shape import ModelShape

D = 8
SCALE = D**-0.5


def make_layer(method, budget: int, keys: torch.Tensor, layer_idx: int = 2) -> LayerMemory:
    memory = ZoomCache(load_tiny()[0], method, budget).layers[layer_idx]
    memory.lazy_initialization(keys, keys)
    return memory


def prefill(method, memory, keys, values, budget, valid=None, input_ids=None, tokenizer=None) -> None:
    b, h, t, d = keys.shape
    ctx = PrefillContext(2, 4, keys, values, torch.zeros(b, h, t, d), valid, budget, SCALE, 1,
                         input_ids=input_ids, tokenizer=tokenizer)
    method.compress(memory, ctx)
    memory.compressed = True




def full_output(q: torch.Tensor, memory: LayerMemory) -> torch.Tensor:
    """Exact attention over every original row (the host tier keeps them all)."""
    keys, values = memory.host_tier["keys"].view(), memory.host_tier["values"].view()
    return attend(q, Selection(keys, values), SCALE)


def groups_of(memory: LayerMemory, b: int = 0, h: int = 0) -> dict[int, list[int]]:
    """Group slot → its original rows, read from the host index."""
    out: dict[int, list[int]] = {}
    for row, g in enumerate(memory.host_tier["group_of"].view()[b, h, :, 0].tolist()):
        if g >= 0:
            out.setdefault(g, []).append(row)
    return out


def prototype_rows(copies: int, protos: int, key_noise: float, value_noise: float, seed: int = 0):
    """4 random sink rows, ``protos`` prototypes × ``copies`` near-copies (interleaved), 8 random recent rows.
    Returns keys, values ``[1, 1, T, D]`` and the prototype of each row (-1 for sinks/recent)."""
    g = torch.Generator().manual_seed(seed)
    base_k = torch.randn(protos, D, generator=g) * 3
    base_v = torch.randn(protos, D, generator=g)
    which = torch.arange(protos).repeat(copies)
    mid_k = base_k[which] + key_noise * torch.randn(len(which), D, generator=g)
    mid_v = base_v[which] + value_noise * torch.randn(len(which), D, generator=g)
    keys = torch.cat([torch.randn(4, D, generator=g), mid_k, torch.randn(8, D, generator=g)])
    values = torch.cat([torch.randn(4, D, generator=g), mid_v, torch.randn(8, D, generator=g)])
    label = torch.cat([torch.full((4,), -1), which, torch.full((8,), -1)])
    return keys[None, None], values[None, None], label


# -- the projector -----------------------------------------------------------------------------------------
def test_projector_initialisation_is_exactly_pca_and_tiny():
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(50, 64, generator=g), torch.randn(50, 64, generator=g)
    proj = SemanticProjector.from_pca(keys, values, sem_dim=16)
    x = semantic_input(keys, values)
    mean, basis = pca_basis(x, None, 16)
    torch.testing.assert_close(proj(x), (x - mean) @ basis.T, atol=1e-5, rtol=1e-5)
    # the top principal direction carries the most variance, and the basis is orthonormal
    torch.testing.assert_close(basis @ basis.T, torch.eye(16), atol=1e-5, rtol=0)
    proj_var = ((x - mean) @ basis.T).var(0)
    assert proj_var[0] >= proj_var[-1]
    # deterministic default (block pooling), never random: two fresh modules are identical
    a, b = SemanticProjector(64), SemanticProjector(64)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert sum(p.numel() for p in a.parameters()) < 5000 < 0.0005 * 135e6
    # the adapter registry builds it from the model's shape alone
    shape = ModelShape.from_config(load_tiny()[0].config)
    module = build_adapter_modules("semantic_id", shape, {"sem_dim": 4, "hidden": 8})
    assert isinstance(module, SemanticProjector) and module.in_dim == 2 * shape.head_dim


def test_projector_round_trips_through_safetensors(tmp_path):
    proj = SemanticProjector.from_pca(torch.randn(30, D), torch.randn(30, D), sem_dim=4, hidden=12)
    proj.save(tmp_path / "p.safetensors")
    back = SemanticProjector.load(tmp_path / "p.safetensors")
    x = torch.randn(5, 2 * D)
    torch.testing.assert_close(back(x), proj(x))
    method = get_method("semantic_id", sem_dim=4, hidden=12, projector=str(tmp_path / "p.safetensors"))
    keys, values, _ = prototype_rows(6, 3, 0.0, 0.0)
    memory = make_layer(method, 24, keys)
    prefill(method, memory, keys, values, 24)  # merging hashes through the trained module
    assert memory.meta["merged"] and "proj_basis" not in memory.device_tier
    with pytest.raises(ConfigError):
        get_method("semantic_id", projector=str(tmp_path / "missing.safetensors"))
    with pytest.raises(ConfigError):
        get_method("semantic_id").attach_adapter(torch.nn.Linear(2, 2))


def test_projector_travels_as_a_zoomkv_adapter(tmp_path):
    from zoomkv.adapters.model import ZoomAdapter

    adapter = ZoomAdapter.initialise(load_tiny()[0], "semantic_id", {"sem_dim": 8, "hidden": 16})
    assert isinstance(adapter.make_method()._projector, SemanticProjector)  # through attach_adapter
    adapter.save_pretrained(tmp_path / "adapter")
    method = ZoomAdapter.from_pretrained(tmp_path / "adapter").make_method(sem_dim=8, hidden=16)
    x = torch.randn(3, 32)
    torch.testing.assert_close(method._projector(x), adapter.modules(x))


def _plain(x):
    return x.view() if not isinstance(x, torch.Tensor) else x


def test_input_correction_keeps_the_per_sequence_pca_and_reshapes_what_it_is_fitted_to(tmp_path):
    """The third projector design: the method still fits its PCA to each sequence and head, on the rows
    the trained correction gives. Its start (the identity) is exactly the untrained method; a correction
    that weighs keys above values moves the basis; it travels as an adapter with ``design``."""
    from zoomkv.adapters.model import ZoomAdapter

    keys, values, _ = prototype_rows(6, 3, 0.3, 0.05)
    plain, corrected = get_method("semantic_id"), get_method("semantic_id")
    corrected.attach_adapter(InputCorrection(2 * D, rank=4))
    mem_plain, mem_corrected = make_layer(plain, 24, keys), make_layer(corrected, 24, keys)
    prefill(plain, mem_plain, keys, values, 24)
    prefill(corrected, mem_corrected, keys, values, 24)
    assert mem_plain.meta["merged"] and mem_corrected.meta["merged"]
    assert mem_plain.device_tier.keys() == mem_corrected.device_tier.keys()
    for name, tensor in mem_plain.device_tier.items():
        assert torch.equal(_plain(tensor), _plain(mem_corrected.device_tier[name])), name

    skewed = InputCorrection(2 * D, rank=4)
    with torch.no_grad():
        skewed.gain[:D] = 4.0  # keys weigh five times their values
    method = get_method("semantic_id")
    method.attach_adapter(skewed)
    memory = make_layer(method, 24, keys)
    prefill(method, memory, keys, values, 24)
    assert "proj_basis" in memory.device_tier  # still the per-sequence PCA, now of the corrected rows
    assert not torch.allclose(memory.device_tier["proj_basis"], mem_plain.device_tier["proj_basis"], atol=1e-3)
    mean, _ = pca_basis(skewed(semantic_input(keys, values))[0, 0], None, 8)
    assert torch.allclose(memory.device_tier["proj_mean"][0, 0], mean, atol=1e-4)

    adapter = ZoomAdapter.initialise(load_tiny()[0], "semantic_id", {"design": "pca_correction", "correction_rank": 4})
    assert isinstance(adapter.modules, InputCorrection) and adapter.modules.rank == 4
    with torch.no_grad():
        adapter.modules.mix_out.normal_()
    adapter.save_pretrained(tmp_path / "adapter")
    back = ZoomAdapter.from_pretrained(tmp_path / "adapter").make_method()
    z = torch.randn(3, adapter.modules.in_dim)
    torch.testing.assert_close(back._projector(z), adapter.modules(z))
    shape = ModelShape.from_config(load_tiny()[0].config)
    with pytest.raises(ConfigError, match="design"):
        build_adapter_modules("semantic_id", shape, {"design": "lookup"})
    with pytest.raises(ConfigError):
        build_adapter_modules("semantic_id", shape, {"design": "pca_correction", "correction_rank": 10**6})


# -- merging --------------------------------------------------------------------------------------------------
def test_merges_near_duplicates_and_indexes_their_originals():
    keys, values, label = prototype_rows(copies=8, protos=5, key_noise=0.05, value_noise=0.01)
    method = get_method("semantic_id")
    memory = make_layer(method, 32, keys)
    prefill(method, memory, keys, values, 32)
    groups = groups_of(memory)
    merged = {g: rows for g, rows in groups.items() if len(rows) > 1}
    # each prototype's 8 copies form one group; nothing else merged (sinks, recent rows stay alone)
    assert sorted(sorted(int(label[r]) for r in rows) for rows in merged.values()) == [[p] * 8 for p in range(5)]
    assert len(groups) == 4 + 5 + 8
    tier, host = memory.device_tier, memory.host_tier
    recall = memory.meta["recall"]
    for g, rows in groups.items():
        assert int(tier["count"][0, 0, g]) == len(rows)
        assert int(tier["state"][0, 0, g]) == (COMPRESSED if len(rows) > 1 else RAW)
        # the index maps the group to exactly its originals, and the representative is their mean
        start = int(host["starts"][0, 0, g])
        assert host["perm"][0, 0, start : start + len(rows)].tolist() == rows
        torch.testing.assert_close(tier["keys"][0, 0, recall + g], keys[0, 0, rows].mean(0))
        torch.testing.assert_close(tier["values"][0, 0, recall + g], values[0, 0, rows].mean(0))
    assert_all_tensors_in_tiers(memory)


def test_merged_row_of_identical_keys_attends_exactly_like_the_originals():
    # identical keys per prototype, values differing: log(n) + the mean value is still exact
    keys, values, _ = prototype_rows(copies=6, protos=4, key_noise=0.0, value_noise=0.01)
    method = get_method("semantic_id")
    memory = make_layer(method, 30, keys)
    prefill(method, memory, keys, values, 30)
    n = keys.shape[2]
    method.append(memory, torch.randn(1, 1, 1, D), torch.randn(1, 1, 1, D))
    for seed in range(3):
        q = torch.randn(1, 2, 1, D, generator=torch.Generator().manual_seed(seed)) * 3  # 2 query heads (GQA)
        sel = method.select(memory, q)
        assert sel.keys.shape[2] <= 30
        counts = memory.device_tier["count"][0, 0, : memory.meta["groups"]]
        assert sorted(counts.tolist(), reverse=True)[:4] == [6, 6, 6, 6]
        assert int((memory.device_tier["state"] == RECALLED).sum()) == 0  # nothing disagrees: no recall
        torch.testing.assert_close(attend(q, sel, SCALE), full_output(q, memory), atol=1e-5, rtol=1e-5)
    assert memory.host_tier["keys"].length == n + 1


def test_recalls_originals_when_members_disagree_and_merges_them_again():
    g = torch.Generator().manual_seed(3)
    base = torch.zeros(D)
    base[0] = 4.0
    group = base.repeat(6, 1)
    group[:, 5] = torch.tensor([1.0, -1.0, 0.5, -0.5, 1.0, -1.0])  # the members differ along channel 5 only
    group_v = torch.randn(D, generator=g) + 0.01 * torch.randn(6, D, generator=g)
    dup = torch.randn(D, generator=g).repeat(10, 1)  # ten identical rows: merged exactly
    dup_v = torch.randn(D, generator=g) + 0.01 * torch.randn(10, D, generator=g)
    keys = torch.cat([torch.randn(4, D, generator=g), group, dup, torch.randn(2, D, generator=g)])[None, None]
    values = torch.cat([torch.randn(4, D, generator=g), group_v, dup_v, torch.randn(2, D, generator=g)])[None, None]
    method = get_method("semantic_id", id_bits=0, recent=2, recall_fraction=0.3)
    budget = 20  # 22 rows: recall buffer 6, 14 group slots
    memory = make_layer(method, budget, keys)
    prefill(method, memory, keys, values, budget)
    tier = memory.device_tier
    slots = {tuple(rows): s for s, rows in groups_of(memory).items()}
    slot = slots[tuple(range(4, 10))]
    assert tuple(range(10, 20)) in slots and len(slots) == 4 + 1 + 1 + 2
    assert int(tier["state"][0, 0, slot]) == COMPRESSED
    method.append(memory, torch.randn(1, 1, 1, D, generator=g), torch.randn(1, 1, 1, D, generator=g))

    disagree = torch.zeros(1, 1, 1, D)
    disagree[..., 5] = 4.0  # logits of the members spread by ±4·scaling: match 1/cosh(1.41) ≈ 0.46
    sel = method.select(memory, disagree)
    assert int(tier["state"][0, 0, slot]) == RECALLED
    recalled = tier["keys"][0, 0, : memory.meta["recall"]][tier["recall_ok"][0, 0]]
    torch.testing.assert_close(recalled, group)  # the originals, in one batched copy
    assert sel.bias[0, 0, memory.meta["recall"] + slot] == float("-inf")  # representative hidden
    assert sel.keys.shape[2] <= budget and method.device_rows(memory) <= budget
    # everything else is unmerged, so with the group recalled this step is exactly full attention
    torch.testing.assert_close(attend(disagree, sel, SCALE), full_output(disagree, memory), atol=1e-5, rtol=1e-5)

    agree = torch.zeros(1, 1, 1, D)
    agree[..., 0] = 2.0  # blind to channel 5: the members agree, the representative serves again
    sel = method.select(memory, agree)
    assert int(tier["state"][0, 0, slot]) == COMPRESSED
    assert sel.bias[0, 0, memory.meta["recall"] + slot] == pytest.approx(math.log(6))
    torch.testing.assert_close(attend(agree, sel, SCALE), full_output(agree, memory), atol=1e-5, rtol=1e-5)
    assert int(tier["state"][0, 0, slot]) == COMPRESSED
    sel = method.select(memory, disagree)  # and it can be recalled again
    assert int(tier["state"][0, 0, slot]) == RECALLED


def test_match_definition():
    q = torch.zeros(1, 1, 1, 4)
    q[..., 1] = 2.0
    var = torch.zeros(1, 1, 2, 4)
    var[0, 0, 0, 1] = 1.0  # members at ±1 along channel 1: logits ±2·scaling
    var[0, 0, 1, 2] = 1.0  # spread along a channel the query ignores
    m = match_score(q, var, 0.5)[0, 0, 0]
    # two members with logits s ± σ: the merged row carries 2·e^s of e^(s+σ) + e^(s-σ)
    assert m[0].item() == pytest.approx(2 / (math.exp(1) + math.exp(-1)))
    assert m[1].item() == pytest.approx(1.0)
    assert (1 / math.cosh(math.log(2))) == pytest.approx(0.8)  # the default threshold is σ = ln 2


# -- protection -----------------------------------------------------------------------------------------------
def protected_case():
    """60 random rows, one of them (30) along a direction no other row takes, and row 40 an exact copy of
    row 20 whose token is a digit."""
    g = torch.Generator().manual_seed(5)
    t = 60
    keys = torch.randn(1, 1, t, D, generator=g)
    values = torch.randn(1, 1, t, D, generator=g)
    keys[..., -1] = 0.0
    values[..., -1] = 0.0
    keys[0, 0, 30] = 0.0
    keys[0, 0, 30, -1] = 5.0
    values[0, 0, 30] = 0.0
    values[0, 0, 30, -1] = 1.0
    keys[0, 0, 40] = keys[0, 0, 20]
    values[0, 0, 40] = values[0, 0, 20]
    tok = load_tiny()[1]
    ids = torch.tensor([tok.convert_tokens_to_ids("a")] * t)[None]
    ids[0, 40] = tok.convert_tokens_to_ids("7")
    return g, keys, values, ids, tok


def test_never_merges_protected_rows_even_under_pressure():
    g, keys, values, ids, tok = protected_case()
    t, rare, number = keys.shape[2], 30, 40
    method = get_method("semantic_id")
    budget = 24  # 60 rows into 24: most rows must merge below every threshold
    memory = make_layer(method, budget, keys)
    prefill(method, memory, keys, values, budget, input_ids=ids, tokenizer=tok)
    groups = groups_of(memory)
    alone = {rows[0] for rows in groups.values() if len(rows) == 1}
    assert {0, 1, 2, 3} <= alone  # sinks
    assert set(range(t - 8, t)) <= alone  # recent rows
    assert rare in alone and number in alone
    assert memory.device_tier["protected"][0, 0, [s for s, r in groups.items() if r in ([rare], [number])]].all()
    # still protected after many decode steps and merges
    for _ in range(30):
        method.append(memory, torch.randn(1, 1, 1, D, generator=g), torch.randn(1, 1, 1, D, generator=g))
        method.select(memory, torch.randn(1, 2, 1, D, generator=g))
        assert method.device_rows(memory) <= budget
    alone = {rows[0] for rows in groups_of(memory).values() if len(rows) == 1}
    assert {0, 1, 2, 3, rare, number} <= alone
    assert memory.meta["merges"] > 1


def test_without_its_token_id_the_duplicate_merges():
    """The control: with no token ids the digit row is an ordinary exact duplicate and merges."""
    _, keys, values, _, _ = protected_case()
    method = get_method("semantic_id")
    memory = make_layer(method, 24, keys)
    prefill(method, memory, keys, values, 24)
    assert any(20 in rows and 40 in rows for rows in groups_of(memory).values())
    alone = {rows[0] for rows in groups_of(memory).values() if len(rows) == 1}
    assert 30 in alone  # the rare row is protected from the rows alone


# -- budget ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("budget", [18, 19, 25, 40, 77])
def test_budget_never_exceeded(budget):
    method = get_method("semantic_id")
    g = torch.Generator().manual_seed(budget)
    b, h, n = 2, 2, 70
    keys = torch.randn(b, h, n, D, generator=g)
    values = torch.randn(b, h, n, D, generator=g)
    keys[:, :, 10:40] = keys[:, :, 10:11] + 0.1 * torch.randn(b, h, 30, D, generator=g)  # some near-duplicates
    valid = torch.ones(b, n, dtype=torch.bool)
    valid[1, :13] = False
    memory = make_layer(method, budget, keys)
    prefill(method, memory, keys, values, budget, valid=valid)
    for i in range(60):
        method.append(memory, torch.randn(b, h, 1, D, generator=g), torch.randn(b, h, 1, D, generator=g))
        q = torch.randn(b, 2 * h, 1, D, generator=g) * 3
        sel = method.select(memory, q)
        assert method.device_rows(memory) <= budget and sel.keys.shape[2] <= budget
        out = attend(q, sel, SCALE)
        assert torch.isfinite(out).all()
        # padding is never attended: its rows belong to no group
        assert (memory.host_tier["group_of"].view()[1, :, :13] == -1).all()
        total = memory.device_tier["count"].sum(-1)
        assert total[0].tolist() == [n + i + 1] * h and total[1].tolist() == [n - 13 + i + 1] * h
    assert_all_tensors_in_tiers(memory)


def test_min_budget_and_bad_settings():
    method = get_method("semantic_id")
    assert method.min_budget() == 18
    assert method.layout(method.min_budget()).feasible and not method.layout(method.min_budget() - 1).feasible
    assert get_method("semantic_id", recent=0, num_sinks=0).min_budget() < 18
    for bad in ({"key_threshold": 1.5}, {"recall_threshold": 0.0}, {"recall_fraction": 1.0}, {"hidden": 8},
                {"num_sinks": -1}, {"id_bits": 40}):
        with pytest.raises(ConfigError):
            get_method("semantic_id", **bad)
    with pytest.raises(BudgetError):
        ZoomCache(load_tiny()[0], "semantic_id", 17)


def test_generate_compresses_recalls_and_stays_within_budget():
    model, tok = load_tiny()
    text = "The pass key is 40213. Remember it. " + "The grass is green. The sky is blue. " * 6
    enc = tok([text, text[30:]], return_tensors="pt", padding=True, add_special_tokens=False)
    cache = ZoomCache(model, "semantic_id", 48, tokenizer=tok)
    model.generate(**enc, max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0,
                   **generate_cache_kwargs(cache))
    assert cache.max_device_rows <= 48
    layers = [layer for layer in cache.layers if isinstance(layer, LayerMemory)]
    assert all(layer.meta["merged"] and layer.meta["merges"] >= 2 for layer in layers)
    report = cache.memory_report()
    assert report.device_bytes < report.full_kv_bytes and report.host_bytes > 0
    for layer in layers:
        assert_all_tensors_in_tiers(layer)
