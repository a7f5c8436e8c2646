"""``infinigen``: the SVD skew concentrates q·k in few channels, the partial estimate ranks the true top rows
first, the alpha threshold sizes the fetch; the calibrate command writes a profile; and, since the method
needs a profile (so test_method_invariants.py skips it), the runtime invariants on tiny models here."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import greedy as _generate
from tests.helpers import load_tiny, max_logit_diff
from tests.helpers import padded_batch as _batch
from zoomkv import ZoomCache
from zoomkv.cli import main as cli_main
from zoomkv.compat import generate_cache_kwargs
from zoomkv.errors import ConfigError, ZoomKVError
from zoomkv.memory import LayerMemory
from zoomkv.memory.tiers import RowBuffer
from zoomkv.methods import get_method
from zoomkv.methods.infinigen import estimate_scores, fetch_count
from zoomkv.methods.infinigen_profile import PROFILE_FILE, partial_channels, save_profile, skew_and_channels
from zoomkv.protocol.method import PrefillContext


@pytest.fixture(scope="module")
def profiles(tmp_path_factory):
    """Profiles of the tiny models, written by the real command into a temporary folder."""
    folder = tmp_path_factory.mktemp("profiles")
    out = {}
    for name in ("tiny-llama", "tiny-gemma3"):
        path = folder / f"{name}.safetensors"
        assert cli_main(["calibrate", "infinigen", "--model", name, "--tokens", "192", "--output", str(path)]) == 0
        out[name] = str(path)
    return out


def correlated(t: int, d: int, seed: int):
    """Queries and keys whose energy lives in a few directions, hidden by a random rotation."""
    g = torch.Generator().manual_seed(seed)
    scales = torch.tensor([8.0, 6.0, 4.0] + [0.3] * (d - 3))
    rotation, _ = torch.linalg.qr(torch.randn(d, d, generator=g))
    q = (torch.randn(t, d, generator=g) * scales) @ rotation.T
    k = (torch.randn(t, d, generator=g) * scales) @ rotation.T
    return q, k


def partial_error(q, k, basis, channels):
    """Relative error of q·k computed from ``channels`` of the ``basis``-rotated vectors."""
    exact = q @ k.T
    approx = (q @ basis)[:, channels] @ (k @ basis)[:, channels].T
    return ((approx - exact).norm() / exact.norm()).item()


# -- the skew --------------------------------------------------------------------------------------------------
def test_skew_is_orthogonal_and_concentrates_qk_in_a_fifth_of_the_channels():
    d = 16
    q, k = correlated(512, d, seed=0)
    skew, channels = skew_and_channels(q[None], k[None], 0.2)
    assert skew.shape == (1, d, d) and channels.shape == (1, partial_channels(d, 0.2)) == (1, 4)
    torch.testing.assert_close(skew[0].T @ skew[0], torch.eye(d), atol=1e-5, rtol=0)
    torch.testing.assert_close((q @ skew[0]) @ (k @ skew[0]).T, q @ k.T, atol=1e-3, rtol=1e-4)  # exact rotation
    skewed = partial_error(q, k, skew[0], channels[0])
    # the best 4 raw channels, chosen by the same criterion, cannot capture what the rotation hides
    raw = (q.abs().mean(0) * k.abs().mean(0)).topk(4).indices
    unskewed = partial_error(q, k, torch.eye(d), raw)
    assert skewed < 0.1 and unskewed > 3 * skewed


def test_group_shares_one_skew_fitted_on_all_its_query_heads():
    qa, k = correlated(256, 8, seed=1)
    qb, _ = correlated(256, 8, seed=5)
    same, _ = skew_and_channels(torch.stack([qa, qb, qb, qa]), torch.stack([k, k]), 0.25)
    assert same.shape == (2, 8, 8)
    # a KV head's skew depends on the set of its group's queries, not on their order (up to sign)
    torch.testing.assert_close(same[0].abs(), same[1].abs(), atol=1e-4, rtol=0)
    split, channels = skew_and_channels(torch.stack([qa, qa, qb, qb]), torch.stack([k, k]), 0.25)
    assert channels.shape == (2, 2) and not torch.allclose(split[0].abs(), split[1].abs(), atol=1e-2)


# -- the estimate ----------------------------------------------------------------------------------------------
def test_estimate_ranks_the_true_top_rows_first():
    d, n = 16, 200
    q_samples, k_samples = correlated(512, d, seed=2)
    skew, channels = skew_and_channels(q_samples[None], k_samples[None], 0.2)
    partial = torch.gather(skew, 2, channels[:, None, :].expand(1, d, -1))  # A[:, C]
    _, keys = correlated(n, d, seed=3)
    query = q_samples[:1]
    keys[[17, 90, 151]] = query * 0.6  # three rows the query matches strongly
    exact = (query @ keys.T)[0]
    estimate = estimate_scores(query.view(1, 1, 1, d), (keys @ partial[0]).view(1, 1, n, -1), partial, 1.0)
    true_top = set(exact.topk(3).indices.tolist())
    assert true_top == {17, 90, 151}
    assert set(estimate[0, 0, 0].topk(3).indices.tolist()) == true_top
    # and the estimate's top 10 hold the exact top 5
    assert set(exact.topk(5).indices.tolist()) <= set(estimate[0, 0, 0].topk(10).indices.tolist())


def test_fetch_count_is_the_mean_over_heads_of_rows_within_alpha_of_the_best():
    scores = torch.tensor([[[[10.0, 9.0, 6.0, 1.0], [3.0, 2.9, 2.8, 2.7]]]])  # [b, h, g, n]
    assert fetch_count(scores, 4.0) == 3  # head 0: 10, 9 and 6.0 > 6; head 1: all 4 → mean 3.0
    assert fetch_count(scores, 0.5) == 2
    assert fetch_count(scores.masked_fill(torch.tensor([False, False, False, True]), float("-inf")), 4.0) == 2


# -- the profile -----------------------------------------------------------------------------------------------
def test_without_a_profile_it_names_the_calibrate_command(tmp_path, monkeypatch):
    monkeypatch.setenv("ZOOMKV_CACHE", str(tmp_path))
    model, _ = load_tiny("tiny-llama")
    ids = torch.randint(5, 200, (1, 30))
    with pytest.raises(ZoomKVError, match="zoomkv calibrate infinigen --model tiny-llama"):
        model.generate(input_ids=ids, max_new_tokens=2, do_sample=False,
                       **generate_cache_kwargs(ZoomCache(model, "infinigen", 16)))
    with pytest.raises(ConfigError):
        get_method("infinigen", alpha=0)


def test_profile_is_found_by_model_name_and_checked_against_the_model(tmp_path, monkeypatch, profiles):
    monkeypatch.setenv("ZOOMKV_CACHE", str(tmp_path))
    model, _ = load_tiny("tiny-llama")
    ids = torch.randint(5, 200, (1, 40))
    assert cli_main(["calibrate", "infinigen", "--model", "tiny-llama", "--tokens", "64"]) == 0
    assert (tmp_path / "profiles" / "tiny-llama" / PROFILE_FILE).is_file()
    cache = ZoomCache(model, "infinigen", 16)
    model.generate(input_ids=ids, max_new_tokens=3, do_sample=False, **generate_cache_kwargs(cache))
    assert cache.layers[2].meta["profile"].endswith(PROFILE_FILE)
    # a profile of another shape (Gemma's single full layer, 1 KV head) is refused with both described
    gemma = ZoomCache(model, "infinigen", 16, profile=profiles["tiny-gemma3"])
    with pytest.raises(ConfigError, match="layer"):
        model.generate(input_ids=ids, max_new_tokens=2, do_sample=False, **generate_cache_kwargs(gemma))
    wrong = tmp_path / "wrong.safetensors"
    save_profile(wrong, {2: (torch.eye(8).expand(2, 8, 8).clone(), torch.zeros(2, 2, dtype=torch.long))}, {})
    with pytest.raises(ConfigError, match="dim 8"):
        model.generate(input_ids=ids, max_new_tokens=2, do_sample=False,
                       **generate_cache_kwargs(ZoomCache(model, "infinigen", 16, profile=str(wrong), dense_layers=2)))


# -- layer behaviour -------------------------------------------------------------------------------------------
def test_recalls_the_needle_rows_and_the_newest_within_the_budget(profiles):
    model, _ = load_tiny("tiny-llama")
    method = get_method("infinigen", profile=profiles["tiny-llama"])
    g = torch.Generator().manual_seed(4)
    b, h, n, d, budget = 2, 2, 120, 16, 24
    keys = torch.randn(b, h, n, d, generator=g) * 0.3
    keys[:, :, 40] = 0.0
    keys[:, :, 40, :] = torch.linspace(1, 2, d) * 3  # one row every query direction below favours
    values = torch.arange(n, dtype=torch.float32).view(1, 1, n, 1).expand(b, h, n, d).clone()
    valid = torch.ones(b, n, dtype=torch.bool)
    valid[1, :30] = False
    memory = ZoomCache(model, method, budget).layers[2]
    memory.lazy_initialization(keys, values)
    ctx = PrefillContext(2, 4, keys, values, torch.zeros(b, 2 * h, n, d), valid, budget, d**-0.5, 2)
    method.compress(memory, ctx)
    assert memory.device_tier["partial_keys"].view().shape == (b, h, n, 4)  # 20% of 16 channels → 4
    method.append(memory, torch.zeros(b, h, 1, d), torch.full((b, h, 1, d), float(n)))
    sel = method.select(memory, torch.linspace(1, 2, d).expand(b, 2 * h, 1, d) * 2)
    assert sel.keys.shape[2] <= budget and method.device_rows(memory) <= budget
    for bi in range(b):
        rows = sel.values[bi, 0, :, 0][torch.isfinite(sel.bias[bi, 0])].tolist() if sel.bias is not None \
            else sel.values[bi, 0, :, 0].tolist()
        assert 40 in rows and rows[-1] == n and rows == sorted(rows)
    padded = sel.values[1, 0, :, 0][torch.isfinite(sel.bias[1, 0])]
    assert (padded >= 30).all()
    state = {k: v for k, v in vars(memory).items() if k != "cache"}

    def nbytes(obj):
        if isinstance(obj, torch.Tensor):
            return obj.nbytes
        if isinstance(obj, RowBuffer):
            return obj.nbytes
        if isinstance(obj, dict):
            return sum(nbytes(v) for v in obj.values())
        return 0

    assert nbytes(state) == memory.device_bytes + memory.host_bytes  # every tensor lives in a tier


# -- runtime invariants (test_method_invariants.py skips needs_profile methods) ---------------------------------
@pytest.mark.parametrize("family", ["tiny-llama", "tiny-gemma3"])
def test_large_budget_is_exactly_full(profiles, family):
    model, _ = load_tiny(family)
    ids, mask = _batch(model.config.vocab_size)
    ref = _generate(model, ids, mask, ZoomCache(model, "full"))
    for overrides in ({}, {"dense_layers": 0}):
        out = _generate(model, ids, mask, ZoomCache(model, "infinigen", 4096, profile=profiles[family], **overrides))
        assert torch.equal(out.sequences, ref.sequences)
        assert max_logit_diff(out.scores, ref.scores) < 1e-4


@pytest.mark.parametrize("family", ["tiny-llama", "tiny-gemma3"])
def test_small_budget_never_exceeded_with_and_without_the_tail_row(profiles, family):
    model, _ = load_tiny(family)
    ids, mask = _batch(model.config.vocab_size, lengths=(90, 75))
    budget = 40
    for tail in (False, True):
        method = get_method("infinigen", profile=profiles[family], dense_layers=0)
        cache = ZoomCache(model, method, budget, tail_summary=tail)
        checked: list[int] = []

        def select(memory, query, method=method, inner=method.select, checked=checked, tail=tail):
            sel = inner(memory, query)
            assert method.device_rows(memory) + tail <= budget and sel.keys.shape[2] + tail <= budget
            checked.append(memory.layer_idx)
            return sel

        method.select = select
        _generate(model, ids, mask, cache, new=24)
        assert checked and cache.max_device_rows <= budget
        report = cache.memory_report()
        zoom = [r for r in report.layers if r.kind == "zoom"]
        assert zoom and all(isinstance(cache.layers[r.layer], LayerMemory) for r in zoom)
        assert sum(r.device_bytes for r in zoom) < sum(r.full_kv_bytes for r in zoom)


def test_calibrate_command_is_listed_and_documented(capsys):
    with pytest.raises(SystemExit) as done:
        cli_main(["calibrate", "--help"])
    assert done.value.code == 0 and "infinigen" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli_main(["calibrate", "infinigen", "--help"])
    assert "--partial-ratio" in capsys.readouterr().out
    assert cli_main(["calibrate", "infinigen", "--model", "tiny-llama", "--tokens", "4"]) == 2  # too few tokens


# -- speculation from the previous layer ------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["tiny-llama", "tiny-qwen3", "tiny-gemma3"])
def test_speculative_query_rebuilds_the_real_query_from_a_layers_input(family):
    """q_proj → q_norm → RoPE from the captured input reproduces the query the attention received: so the
    speculated query from layer i-1's input is exactly what layer i would compute from that input."""
    from zoomkv.memory.speculation import speculative_query
    from zoomkv.methods.oracle_topk import OracleTopK

    class Probe(OracleTopK):
        needs_attention_inputs = True
        checked: list[float] = []

        def select(self, memory, query):
            own = memory.cache.attention_inputs[memory.layer_idx]
            rebuilt = speculative_query(own, own.hidden)
            self.checked.append((rebuilt - query).abs().max().item())
            return super().select(memory, query)

    model, _ = load_tiny(family)
    ids, mask = _batch(model.config.vocab_size, lengths=(60, 48))
    probe = Probe()
    _generate(model, ids, mask, ZoomCache(model, probe, 32), new=4)
    assert probe.checked and max(probe.checked) < 1e-5, max(probe.checked)


@pytest.mark.parametrize("family", ["tiny-llama", "tiny-gemma3"])
def test_previous_layer_speculation_is_the_default_and_differs_from_same_layer(profiles, family):
    model, _ = load_tiny(family)
    ids, mask = _batch(model.config.vocab_size, lengths=(90, 75))
    picked = {}
    for mode in ("previous_layer", "same_layer"):
        method = get_method("infinigen", profile=profiles[family], dense_layers=0, speculate=mode)
        cache = ZoomCache(model, method, 40)
        inner, rows = method.select, []

        def select(memory, query, inner=inner, rows=rows):
            sel = inner(memory, query)
            rows.append(round(sel.keys.float().sum().item(), 3))  # which rows were recalled
            return sel

        method.select = select
        _generate(model, ids, mask, cache, new=12)
        steps = {layer.layer_idx: layer.meta.get("speculated_steps", 0) for layer in cache.layers
                 if isinstance(layer, LayerMemory)}
        picked[mode] = rows
        if mode == "previous_layer":
            assert get_method("infinigen", profile=profiles[family]).config.speculate == mode  # the default
            assert sum(steps.values()) > 0 and steps.get(0, 0) == 0  # layer 0 has no previous layer
        else:
            assert sum(steps.values()) == 0
    assert picked["previous_layer"] != picked["same_layer"]  # another query, other rows recalled
    with pytest.raises(ConfigError, match="speculate"):
        get_method("infinigen", profile=profiles["tiny-llama"], speculate="next_layer")
