"""A decode step (its append and its selection) captured once and replayed (zoomkv.memory.graphs), held on the CPU.

A CUDA graph replays its kernels with the arguments of the step it was captured in. On the CPU, ``graphs.emulated()``
captures by tracing (``make_fx``), which holds tensors by reference and bakes every Python value in, as a graph
does: a step that should read its row count on the device but slices by a Python length replays the length of its
capture. These tests show that the emulation catches exactly that, and that sekv's step of fixed shapes (the GPU's
path: torch ops, rows written at a position read on the device, the recall reading only the rows its buffer
misses) and Quest's, replayed this way, compute every step what they compute run as they are: the same tokens and
logits, across a buffer's growth (a new capture), with padding in the batch, with the quickstart's host rescoring
and `k8v4` host tier.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import greedy, load_tiny, max_logit_diff, padded_batch
from zoomkv import ZoomCache, native
from zoomkv.memory import graphs
from zoomkv.memory.sync_audit import audit_decode
from zoomkv.memory.tiers import RowBuffer
from zoomkv.methods import get_method
from zoomkv.methods.sekv.method import SeKV
from zoomkv.methods.sekv.modules import SeKVAdapter
from zoomkv.protocol.recallable import recall_misses_only
from zoomkv.protocol.shape import ModelShape


def _rows_after(step, before: int, after: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's output captured when the buffer held ``before`` rows, replayed and run as it is at ``after``."""
    buf = RowBuffer.empty_like(1, 1, 16, 1, dtype=torch.float32, device=torch.device("cpu"))
    buf.append(torch.arange(1.0, before + 1)[None, None, :, None])
    buf.length_tensor()
    query = torch.ones(1, 1, 1, 1)
    with graphs.emulated():
        graph, _ = graphs.capture("key", lambda q: step(buf, q), (query,), memory=None)
    buf.append(torch.arange(before + 1.0, after + 1)[None, None, :, None])
    return graph.replay(query)[0], step(buf, query)[0]


def test_a_replay_holds_the_python_values_of_its_capture_as_a_cuda_graph_does():
    """The emulation is faithful where it matters: a length read in Python is baked into the capture (the replay
    sums the rows of the capture's step), a count read on the device is not."""

    def by_length(buf: RowBuffer, q: torch.Tensor) -> tuple[torch.Tensor]:
        return (buf.view().sum(2, keepdim=True) * q,)

    def by_count(buf: RowBuffer, q: torch.Tensor) -> tuple[torch.Tensor]:
        live = torch.arange(buf.capacity) < buf.length_tensor()
        return (torch.where(live[None, None, :, None], buf.data, 0.0).sum(2, keepdim=True) * q,)

    buf = RowBuffer.empty_like(1, 1, 16, 1, dtype=torch.float32, device=torch.device("cpu"))
    buf.data.fill_(float("nan"))  # what an unfilled row may hold: a step of fixed shapes masks it out
    baked, eager = _rows_after(by_length, 3, 5)
    assert baked.item() == 6.0 and eager.item() == 15.0
    replayed, eager = _rows_after(by_count, 3, 5)
    assert replayed.item() == eager.item() == 15.0


@pytest.mark.parametrize("fmt", [None, "k8v4", "int4"])
def test_rows_written_at_a_count_are_the_rows_appended(fmt):
    """``write_at`` (the append a graph replays: its position read from a tensor) holds what ``append`` holds, for
    rows stored as they are and coded row by row (tests/test_cuda.py: into pinned memory from a GPU)."""
    from zoomkv.memory.quant import QuantizedRowBuffer, QuantSpec

    rows = torch.randn(2, 4, 40, 64, generator=torch.Generator().manual_seed(0))

    def made() -> RowBuffer:
        if fmt is None:
            return RowBuffer.with_room(rows[:, :, :8], 4)
        return QuantizedRowBuffer(rows[:, :, :8], QuantSpec.parse(fmt).for_rows("keys", 0))

    written, appended = made(), made()
    assert written.writes_at
    at = torch.full((1,), 8, dtype=torch.long)
    for i in range(8, 40):
        written.reserve(1)
        written.write_at(rows[:, :, i : i + 1], at)
        at.add_(1)
        written.note_written(1, from_gpu=False)
        appended.append(rows[:, :, i : i + 1])
        assert torch.equal(written.gather(torch.full((2, 4, 1), i))[:, :, 0], appended.view()[:, :, i])
    assert written.length == appended.length == 40 and torch.equal(written.view(), appended.view())


def _hashed(config, width: int = 1) -> SeKV:
    """sekv with a trained hash index's shape (8 sign bits a KV head; ``width`` 4: 4, 2 and 1-bit coordinates), its
    projections nudged off their start."""
    d = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    torch.manual_seed(0)
    layout = [[0, 4, 0] if i % 2 else [2, 0, 0] for i in range(config.num_hidden_layers)] if width > 1 else None
    adapter = SeKVAdapter(config.num_hidden_layers, config.num_key_value_heads, d, hash_bits=8, hash_width=width,
                          hash_layout=layout)
    with torch.no_grad():
        adapter.hash_key.add_(torch.randn_like(adapter.hash_key) * 0.1)
    return SeKV(adapter=adapter)


SEKV_CASES = {  # name: (the method, host format, prompt lengths, steps)
    "codes-rescoring": (lambda config: get_method("sekv"), None, (400, 290), 24),
    "quickstart-shape": (lambda config: get_method("sekv", rescore_from="host"), "k8v4", (400, 290), 24),
    "trained-hash": (_hashed, None, (400, 290), 16),
    "mixed-widths": (lambda config: _hashed(config, width=4), None, (400, 290), 16),
    "fitted-index": (lambda config: get_method("sekv", fit_bits=16, rescore_from="host"), "k8v4", (400, 290), 16),
    # the short sequence holds fewer real rows than stage one's 156 candidates: padding fills its picks
    "short-sequence": (lambda config: get_method("sekv", rescore_from="host"), None, (400, 100), 16),
    # 140 steps: the codes' buffer grows (128 rows past the prompt), so every layer is captured again
    "growth": (lambda config: get_method("sekv"), None, (300,), 140),
}
QUEST_CASES = {  # name: (prompt lengths, steps, ZoomCache options, reading only the missed rows)
    "padded": ((400, 290), 40, {}, True),
    "padding-only-pages": ((400, 30), 20, {}, True),
    "every-row-read": ((300,), 40, {}, False),
    "with-tail": ((400, 290), 24, {"tail_summary": True}, True),
}


@pytest.mark.parametrize("mode", ["1", "step"])  # whole decoder layers captured (the default), or the cache's steps
@pytest.mark.parametrize("case", list(SEKV_CASES))
def test_sekvs_replayed_step_computes_what_its_step_computes(case, mode, monkeypatch):
    monkeypatch.setenv("ZOOMKV_CUDA_GRAPHS", mode)
    make, host_format, lengths, steps = SEKV_CASES[case]
    model, _ = load_tiny("tiny-llama")
    ids, mask = padded_batch(model.config.vocab_size, lengths=lengths)
    layers = model.config.num_hidden_layers

    def run():
        return greedy(model, ids, mask, ZoomCache(model, make(model.config), 40, kv_quant=host_format), new=steps)

    replayed, eager, counts = _replayed_and_eager(run, misses_only=True)
    assert torch.equal(replayed.sequences, eager.sequences)
    assert max_logit_diff(replayed.scores, eager.scores) <= 1e-5
    # every layer captured once (twice across the growth), whole or its cache step; every step after a replay
    assert counts["captures"] == (2 if case == "growth" else 1) * layers, counts
    assert counts["layer_captures"] == (counts["captures"] if mode == "1" else 0), counts
    assert counts["replays"] >= (steps - 7) * layers, counts


def _replayed_and_eager(run, misses_only: bool):
    """``run()`` with its selections captured and replayed (emulated), then as it runs on the CPU; the captures and
    replays the first made."""
    with torch.no_grad(), native.torch_path(), recall_misses_only(misses_only):
        with graphs.emulated():
            before = graphs.counts()
            replayed = run()
            counts = {name: graphs.counts()[name] - before[name] for name in before}
        eager = run()
    return replayed, eager, counts


@pytest.mark.parametrize("model_name", ["tiny-llama", pytest.param("tiny-gemma3", marks=pytest.mark.heavy)])
@pytest.mark.parametrize("case", list(QUEST_CASES))
def test_quests_replayed_step_computes_what_its_step_computes(case, model_name):
    """Quest in fixed shapes: every allocated page scored, those past the page count out, always ``k`` pages of
    rows (the newest page's unfilled slots name rows of a page not chosen, masked): the same tokens, and the
    logits of recalling the filled rows alone within float rounding."""
    lengths, steps, options, misses = QUEST_CASES[case]
    model, _ = load_tiny(model_name)  # (Gemma 3: sliding layers beside the compressed ones, run as they are)
    ids, mask = padded_batch(model.config.vocab_size, lengths=lengths)
    dense = get_method("quest").config.dense_layers  # Quest keeps its first layers whole
    compressed = sum(i >= dense for i in ModelShape.from_config(model.config).full_attention_layers)

    def run():
        return greedy(model, ids, mask, ZoomCache(model, "quest", 64, **options), new=steps)

    replayed, eager, counts = _replayed_and_eager(run, misses_only=misses)
    assert torch.equal(replayed.sequences, eager.sequences)
    assert max_logit_diff(replayed.scores, eager.scores) <= 1e-5
    assert counts["captures"] >= compressed and counts["replays"] >= (steps - 7) * compressed, counts


def test_nothing_is_captured_where_graphs_are_off_or_a_dispatch_mode_watches(monkeypatch):
    """``ZOOMKV_CUDA_GRAPHS=0`` runs every step as it is; so does a step under the sync audit (a dispatch mode,
    which would see a replay as nothing), and that step of fixed shapes reads nothing back to the host."""
    model, _ = load_tiny("tiny-llama")
    ids, mask = padded_batch(model.config.vocab_size, lengths=(400, 290))
    method = get_method("sekv", rescore_from="host")
    with torch.no_grad(), native.torch_path(), recall_misses_only(True), graphs.emulated():
        before = graphs.counts()
        audits = audit_decode(model, ZoomCache(model, method, 40), ids, mask, steps=6)
        assert all(a.clean for a in audits), [str(e) for a in audits for e in a.events]
        monkeypatch.setenv("ZOOMKV_CUDA_GRAPHS", "0")
        greedy(model, ids, mask, ZoomCache(model, method, 40), new=6)
        assert graphs.counts() == before


def test_the_sync_audit_counts_a_replayable_step_as_one_launch():
    """Under the audit a step runs uncaptured (a dispatch mode would see a replay as nothing), and its launches are
    counted both ways: as they run (``ops``) and as the one replay a GPU would make (``launches_captured``)."""
    model, _ = load_tiny("tiny-llama")
    ids, mask = padded_batch(model.config.vocab_size, lengths=(400, 290))
    with torch.no_grad(), native.torch_path(), recall_misses_only(True):
        plain = audit_decode(model, ZoomCache(model, "quest", 40), ids, mask, steps=2)[-1]
        with graphs.emulated():
            audit = audit_decode(model, ZoomCache(model, "quest", 40), ids, mask, steps=2)[-1]
    compressed = model.config.num_hidden_layers - get_method("quest").config.dense_layers
    assert plain.launches_captured == plain.ops  # nothing replayable where steps are not captured
    assert audit.ops - audit.launches_captured == audit.in_graphs > 10 * compressed
