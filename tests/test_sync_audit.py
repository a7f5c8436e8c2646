"""The sync audit (zoomkv.memory.sync_audit) and what it says about every registered method's decode step.

A decode step that reads a tensor value back to Python (``.item()``, ``bool(t)``, ``.tolist()``) or builds a
tensor whose shape depends on values (``nonzero``, boolean-mask indexing, ``unique``) stops a GPU once per
occurrence and cannot be captured in a CUDA graph (issue 16). The audit sees those ops on the CPU too, so
this file holds every method to a sync-free decode step in ``make test``; tests/test_cuda.py checks the same
steps under ``torch.cuda.set_sync_debug_mode("error")`` on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import load_tiny, padded_batch
from tests.method_matrix import method_kwargs
from zoomkv import ZoomCache
from zoomkv.memory.sync_audit import SyncAudit, SyncError, audit_decode, classify, summarize
from zoomkv.methods import METHODS, get_method

# Methods whose decode step still reads values back to the host, and why. Each is a strict xfail below: the
# day one of them becomes sync-free its test fails, and it must be moved out of this set.
KNOWN_SYNCING = {
    # semantic_id's step merges rows by a greedy matching over a forest of roots, walked in Python
    # (merging.py: greedy_matching, forest_roots, merge_by_root; method.py: select, _recall, _merge, _reduce):
    # the merge plan is data-dependent by design. Its package belongs to another line of work.
    "semantic_id",
    # InfiniGen fetches the rows whose estimated logit is within alpha of the best: how many is the published
    # algorithm's own decision, made per step from the scores (fetch_count), so the recall's shape is data.
    "infinigen",
    # A generated sentence ends on a boundary token, so how many sentences the index must hold is data: a
    # Python upper bound avoids asking every step, but when it runs out of slots sentencekv reads the true
    # count (once every ~8-16 steps, not per step and layer as before). Without token ids (segments of
    # segment_length tokens) its decode is sync-free.
    "sentencekv",
}

DECODE_STEPS = 20  # crosses Quest's page boundaries, sekv's chunk summaries and clusterkv's reclustering
# Gemma 3's layout (sliding layers) in make test; the fast tier audits every method on Llama's
CASES = [("tiny-llama", (90, 61)), ("tiny-llama", (90,)),
         pytest.param("tiny-gemma3", (90, 61), marks=pytest.mark.heavy)]


def _params():
    for name in sorted(METHODS):
        marks = []
        if name in KNOWN_SYNCING:
            marks = [pytest.mark.xfail(strict=True, raises=AssertionError,
                                       reason=f"{name}'s decode step syncs by design (see KNOWN_SYNCING)")]
        yield pytest.param(name, marks=marks, id=name)


def audit(model_name: str, lengths: tuple[int, ...], name: str, folder, steps: int = DECODE_STEPS,
          with_tokenizer: bool = True):
    """Prefill a batch of ``lengths`` tokens (left padded) with ``name`` at a small budget, then ``steps``
    greedy decode steps, each under a ``SyncAudit``."""
    model, tokenizer = load_tiny(model_name)  # the tokenizer: sentence and chunk ends come from token ids
    tokenizer = tokenizer if with_tokenizer else None
    method = get_method(name, **method_kwargs(name, model, folder))
    budget = max(method.min_budget(), 40) if method.uses_budget else None
    ids, mask = padded_batch(model.config.vocab_size, lengths=lengths)
    return audit_decode(model, ZoomCache(model, method, budget, tokenizer=tokenizer), ids, mask, steps)


@pytest.mark.parametrize("name", list(_params()))
@pytest.mark.parametrize("model_name,lengths", CASES, ids=["llama-padded", "llama-one", "gemma3-padded"])
def test_decode_step_reads_nothing_back(model_name, lengths, name, tmp_path_factory):
    audits = audit(model_name, lengths, name, tmp_path_factory.mktemp("profiles"))
    assert all(a.clean for a in audits), f"{name}: {summarize(audits)}"


@pytest.mark.parametrize("name", ["sekv", "quest", "oracle_topk", "clusterkv"])
def test_reading_only_the_missed_rows_reads_nothing_back(name, tmp_path):
    """The recall a GPU runs (only the rows its buffer misses: ``recallable.plan_swaps``) plans on the device."""
    from zoomkv import native
    from zoomkv.protocol.recallable import recall_misses_only

    with native.torch_path(), recall_misses_only(True):
        audits = audit("tiny-llama", (90, 61), name, tmp_path)
    assert all(a.clean for a in audits), f"{name}: {summarize(audits)}"


def test_sentencekv_reads_back_only_when_its_sentence_slots_may_run_out(tmp_path):
    audits = audit("tiny-llama", (90, 61), "sentencekv", tmp_path, steps=40)
    assert sum(not a.clean for a in audits) <= 40 // 8, summarize(audits)
    assert {e.where.split(":")[0] for a in audits for e in a.events} <= {"zoomkv/methods/sentencekv.py"}


def test_sentencekv_without_token_ids_is_sync_free(tmp_path):
    audits = audit("tiny-llama", (90, 61), "sentencekv", tmp_path, steps=40, with_tokenizer=False)
    assert all(a.clean for a in audits), summarize(audits)


def test_known_syncing_names_registered_methods():
    assert KNOWN_SYNCING <= set(METHODS)


# -- the audit itself -----------------------------------------------------------------------------------
@pytest.mark.parametrize("op", [
    lambda t: t.sum().item(),
    lambda t: int(t[0]),
    lambda t: bool(t.any()),
    lambda t: float(t.max()),
    lambda t: t.tolist(),
    lambda t: t.numpy(),
    lambda t: t.nonzero(),
    lambda t: torch.where(t > 2),
    lambda t: t[t > 2],
    lambda t: t.clone().__setitem__(t > 2, 0),
    lambda t: t.unique(),
    lambda t: torch.equal(t, t),
    lambda t: t.repeat_interleave(t),
    lambda t: torch.bincount(t),
    lambda t: t.masked_select(t > 2),
], ids=["item", "int", "bool", "float", "tolist", "numpy", "nonzero", "where1", "mask-index", "mask-assign",
        "unique", "equal", "repeat_interleave", "bincount", "masked_select"])
def test_the_audit_sees_each_way_of_reading_back(op):
    t = torch.arange(6)
    with SyncAudit() as audit:
        op(t)
    assert audit.events, "not seen"
    assert "test_sync_audit.py" in audit.events[0].where


def test_the_audit_leaves_fixed_shape_ops_alone():
    t = torch.randn(2, 3, 50)
    with SyncAudit() as audit:
        idx = t.topk(7, dim=-1).indices.sort(dim=-1).values
        torch.gather(t, -1, idx)
        t.masked_fill(t > 0, 0.0).amax(-1)
        torch.where(t > 0, t, -t).cumsum(-1)
        t.argsort(dim=-1, stable=True)
        t[:, :, 3:9].clone()
        t.repeat_interleave(2, dim=0)
        torch.searchsorted(torch.arange(10.0), t)
        torch.zeros(4).index_put_((torch.tensor([1, 2]),), torch.ones(2))
    assert audit.clean, audit.format()


def test_raise_on_sync_and_patches_are_undone():
    tolist = torch.Tensor.tolist
    with pytest.raises(SyncError, match="nonzero"), SyncAudit(raise_on_sync=True):
        torch.arange(4).nonzero()
    assert torch.Tensor.tolist is tolist
    assert torch.arange(3).tolist() == [0, 1, 2]


def test_copies_between_devices_are_named():
    """Only CUDA tensors cross devices; classify reads nothing but ``.device`` and ``.is_pinned()``, so stand-ins
    show the rule."""
    from types import SimpleNamespace

    cpu, cuda = torch.empty(3), SimpleNamespace(device=torch.device("cuda", 0))
    to_cpu = {"device": torch.device("cpu")}
    assert classify("aten::_to_copy", (cuda,), to_cpu) == "device-to-host copy"
    assert classify("aten::_to_copy", (cuda,), {**to_cpu, "non_blocking": True}) == "device-to-host copy"
    assert classify("aten::copy_", (cpu, cuda), {}) == "device-to-host copy"
    assert classify("aten::copy_", (cuda, cpu), {}) == "blocking host-to-device copy"
    # non_blocking from pinned memory: queued, nothing waits; from pageable memory CUDA stages it and may wait
    pinned = SimpleNamespace(device=torch.device("cpu"), is_pinned=lambda: True)
    to_cuda = {"device": torch.device("cuda", 0), "non_blocking": True}
    assert classify("aten::copy_", (cuda, pinned, True), {}) is None
    assert classify("aten::_to_copy", (pinned,), to_cuda) is None
    assert classify("aten::copy_", (cuda, cpu, True), {}) == "host-to-device copy from pageable memory"
    assert classify("aten::_to_copy", (cpu,), to_cuda) == "host-to-device copy from pageable memory"
    assert classify("aten::_to_copy", (cpu,), to_cpu) is None
    assert classify("aten::copy_", (cpu, torch.empty(3, device="meta")), {}) is None


def test_the_audit_counts_ops_that_compute_and_not_views():
    x = torch.randn(4, 4)
    with SyncAudit() as audit:
        x.view(16), x.t(), x[1:], x.unsqueeze(0)  # views: no kernel runs
        torch.empty(8), torch.empty_like(x)  # allocations: no kernel runs either
        (x + 1).sum()
    assert audit.ops == 2 and audit.clean
