"""Training semantic_id's projector: the teacher's pair labels, the SimHash collision probability, a run
that moves equivalent pairs together, and the adapter it writes running inside generate()."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import greedy, padded_batch
from zoomkv import ZoomCache
from zoomkv.adapters.model import ZoomAdapter
from zoomkv.methods.semantic_id.method import simhash_ids
from zoomkv.methods.semantic_id.objective import (
    collision_probability,
    neighbour_loss,
    off_diagonal,
    pair_targets,
)
from zoomkv.methods.semantic_id.projector import InputCorrection, SemanticProjector
from zoomkv.models import load_model

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "recipes" / "tiny-llama-semantic-id.yaml"


def test_pair_targets_follow_the_teacher_queries_and_the_values():
    d = 8
    q = torch.zeros(3, d)
    q[:, 0] = 1.0  # every query reads channel 0 only
    k = torch.zeros(4, d)
    k[1, 1] = 5.0  # row 1 differs from row 0 where no query looks: same logits
    k[2, 0] = 3.0  # row 2 differs on channel 0: a logit gap of 3 > ln 2
    k[3] = k[0]
    v = torch.ones(4, d)
    v[3, : d // 2] = -1.0  # row 3: same key as row 0, orthogonal value
    eq = pair_targets(k, v, q, scaling=1.0, sigma=math.log(2), value_threshold=0.95)
    assert eq[0, 1] and eq[1, 0]
    assert not eq[0, 2] and not eq[1, 2]
    assert not eq[0, 3]


def test_neighbour_loss_prefers_semantic_neighbours_that_the_teacher_finds_equivalent():
    """The listwise loss is lower when each row's nearest semantic vector is its most equivalent row for the
    teacher (rows 0/1 and 2/3 share logits under every query), and its gradient reaches the vectors."""
    d = 8
    q = torch.zeros(3, d)
    q[:, 0] = 1.0
    k = torch.zeros(4, d)
    k[0, 0], k[1, 0], k[2, 0], k[3, 0] = 0.0, 0.1, 4.0, 4.1
    v = torch.ones(4, d)
    args = (k, v, q, 1.0, math.log(2), 0.95, 0.1)
    paired = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9]], requires_grad=True)
    crossed = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.9, 0.1], [0.1, 0.9]])
    good = neighbour_loss(paired, *args)
    assert good < neighbour_loss(crossed, *args)
    good.backward()
    assert paired.grad.abs().sum() > 0


def test_the_pairs_are_what_a_mask_off_the_diagonal_picks_in_fixed_shape():
    """The pairs of a step's sampled rows in the order ``~eye`` picks them, as indices made on the device (a
    boolean mask's count is a wait on a GPU)."""
    for n in range(1, 7):
        m = torch.randn(n, n)
        assert torch.equal(m.flatten()[off_diagonal(n, m.device)], m[~torch.eye(n, dtype=torch.bool)])


def test_collision_probability_is_simhash_collision_rate():
    sem = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
    p = collision_probability(sem, bits=4)
    assert torch.allclose(p[0, 1], torch.tensor(1.0), atol=5e-3)  # the clamp that keeps arccos differentiable
    assert torch.allclose(p[0, 2], torch.tensor(0.5**4), atol=1e-4)
    assert p[0, 3] < 1e-3
    # the same rate, counted: two vectors at 60 degrees under many random 4-bit hashes
    a, b = torch.tensor([1.0, 0.0]), torch.tensor([0.5, math.sqrt(3) / 2])
    hits = sum(int(simhash_ids(a[None], 4, s) == simhash_ids(b[None], 4, s)) for s in range(2000)) / 2000
    expected = float(collision_probability(torch.stack([a, b]), 4)[0, 1])
    assert abs(hits - expected) < 0.04, (hits, expected)


@pytest.mark.heavy
def test_training_moves_equivalent_pairs_together_and_the_adapter_runs(tmp_path):
    args = [sys.executable, "-m", "zoomkv.train", "--recipe", str(RECIPE), f"output_dir={tmp_path}"]
    done = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "semantic-id-tiny"
    pairs = json.loads((run / "pairs.json").read_text())
    assert pairs["trained"]["loss"] < pairs["fresh"]["loss"]
    gain_eq = pairs["trained"]["collide_eq"] - pairs["fresh"]["collide_eq"]
    gain_other = pairs["trained"]["collide_other"] - pairs["fresh"]["collide_other"]
    assert gain_eq > 0 and gain_eq > 2 * gain_other, pairs
    adapter = ZoomAdapter.from_pretrained(run / "adapter")
    assert adapter.config.method == "semantic_id" and isinstance(adapter.modules, SemanticProjector)
    assert adapter.config.hyper["id_bits"] == 6
    model, _ = load_model("tiny-llama")
    ids, mask = padded_batch(model.config.vocab_size, lengths=(120, 100))
    method = adapter.make_method()
    assert method._projector is adapter.modules
    calls = []
    adapter.modules.register_forward_hook(lambda *_: calls.append(1))
    cache = ZoomCache(model, method, 40)
    out = greedy(model, ids, mask, cache, new=8)  # the runtime raises if a step holds more than B rows
    assert out.sequences.shape[1] == ids.shape[1] + 8
    assert calls, "the trained projector was never used to hash the rows"


@pytest.mark.heavy
def test_training_a_correction_of_the_per_sequence_pca(tmp_path):
    """``design=pca_correction``: the module trained is the correction of the PCA's input (the identity at
    its start, so its fresh score is the untrained method's); the loss falls and the adapter runs."""
    args = [sys.executable, "-m", "zoomkv.train", "--recipe", str(RECIPE), f"output_dir={tmp_path}",
            "design=pca_correction", "correction_rank=4", "loss=neighbours", "lr=0.05"]
    done = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "semantic-id-tiny"
    pairs = json.loads((run / "pairs.json").read_text())
    assert pairs["trained"]["loss"] < pairs["fresh"]["loss"], pairs
    adapter = ZoomAdapter.from_pretrained(run / "adapter")
    assert isinstance(adapter.modules, InputCorrection)
    assert adapter.config.hyper["design"] == "pca_correction" and adapter.config.hyper["correction_rank"] == 4
    assert adapter.modules.mix_out.abs().sum() > 0  # trained away from the identity
    model, _ = load_model("tiny-llama")
    ids, mask = padded_batch(model.config.vocab_size, lengths=(120, 100))
    cache = ZoomCache(model, adapter.make_method(), 40)
    out = greedy(model, ids, mask, cache, new=8)
    assert out.sequences.shape[1] == ids.shape[1] + 8
    assert any("proj_basis" in layer.device_tier for layer in cache.layers if hasattr(layer, "device_tier"))
