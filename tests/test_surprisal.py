"""Methods with ``needs_surprisal`` get the frozen model's own token surprisal at compress time."""

from __future__ import annotations

import pytest
import torch

from zoomkv import ZoomCache, native
from zoomkv.compat import generate_cache_kwargs
from zoomkv.memory.replay import cache_from_record, record_prefill
from zoomkv.memory.surprisal import SURPRISAL, _bf16_fits, _nll, token_surprisal
from zoomkv.methods.full import Full
from zoomkv.models import load_model


class SurprisalProbe(Full):
    """``full`` that also records the surprisal it was handed (never registered)."""

    name = "surprisal_probe"
    needs_surprisal = True

    def __init__(self):
        super().__init__()
        self.seen: dict[int, torch.Tensor] = {}

    def compress(self, memory, ctx):
        assert ctx.surprisal is not None
        self.seen[memory.layer_idx] = ctx.surprisal
        self.query_rows = ctx.queries.shape[2]
        super().compress(memory, ctx)


class QuerylessProbe(SurprisalProbe):
    reads_queries = False  # as sekv: its layers wait for the surprisal without their queries


def _reference(model, ids, mask):
    with torch.no_grad():
        pos = (mask.cumsum(-1) - 1).clamp_min(0)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float()
    logp = torch.log_softmax(logits[:, :-1], -1)
    return -logp.gather(-1, ids[:, 1:, None]).squeeze(-1)  # surprisal of tokens 1..T-1


@pytest.mark.parametrize("family", ["tiny-llama", "tiny-gemma3"])
def test_surprisal_reaches_compress(family):
    model, _ = load_model(family)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 250, (2, 30), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    probe = SurprisalProbe()
    cache = ZoomCache(model, probe)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0,
                         output_scores=True, return_dict_in_generate=True, **generate_cache_kwargs(cache))
    zoom = cache.zoom_layer_indices
    assert sorted(probe.seen) == list(zoom)  # every compressed layer, after the last layer ran
    got = probe.seen[zoom[0]]
    ref = _reference(model, ids, mask)
    # inference projects through the LM head in bf16 where the CPU multiplies bf16 natively (surprisal.py):
    # within a few hundredths of a nat of float32
    tol = 5e-2 if _bf16_fits(model.get_output_embeddings(), torch.zeros(1)) else 1e-4
    torch.testing.assert_close(got[0, 1:], ref[0], atol=tol, rtol=1e-4)
    torch.testing.assert_close(got[1, 7:], ref[1, 6:], atol=tol, rtol=1e-4)  # after the padding
    assert bool((got[1, :6] == 0).all())  # padding is never surprising
    # deferring compress changes nothing else: same tokens as plain full
    ref_out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                             pad_token_id=0, **generate_cache_kwargs(ZoomCache(model, "full")))
    assert torch.equal(out.sequences, ref_out)
    # and the prefill-once replay hands over the same surprisal
    record = record_prefill(model, ids, mask)
    replay_probe = SurprisalProbe()
    cache_from_record(model, record, replay_probe)
    torch.testing.assert_close(replay_probe.seen[zoom[0]], got, atol=1e-5, rtol=1e-5)


def test_layers_waiting_for_surprisal_hold_their_queries_only_for_methods_that_read_them():
    model, _ = load_model("tiny-llama")
    ids = torch.randint(3, 250, (2, 30), generator=torch.Generator().manual_seed(2))
    out = {}
    for probe in (SurprisalProbe(), QuerylessProbe()):
        cache = ZoomCache(model, probe)
        out[probe.reads_queries] = model.generate(input_ids=ids, max_new_tokens=4, do_sample=False, pad_token_id=0,
                                                  **generate_cache_kwargs(cache))
        assert probe.query_rows == (30 if probe.reads_queries else 0)
    assert torch.equal(out[True], out[False])
    # a prefill recorded for replay keeps them: other methods replaying it may read them
    replayed = QuerylessProbe()
    cache_from_record(model, record_prefill(model, ids, torch.ones_like(ids)), replayed)
    assert replayed.query_rows == 30


def test_the_teachers_surprisal_stays_float32_exact():
    """fast=False (training's teacher records) projects in float32 whatever the CPU: the reference logits."""
    model, _ = load_model("tiny-llama")
    ids = torch.randint(3, 250, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state
    got = token_surprisal(hidden, ids, model.get_output_embeddings())
    torch.testing.assert_close(got[0, 1:], _reference(model, ids, torch.ones_like(ids))[0], atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(SURPRISAL.library() is None, reason="no C++ compiler: surprisal takes the torch path")
def test_the_compiled_surprisal_equals_torchs_log_softmax():
    # bf16 logits as the fast projection writes them: wide and narrow rows, a row far below zero (every term of
    # its sum is tiny next to the max), a vocabulary that is not a multiple of the vector width; then a row with
    # an infinite logit, where neither path has a number.
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(2, 33, 1003, generator=g) * torch.tensor([0.1, 4.0, 30.0]).repeat(11)[None, :, None])
    logits[1, 5] -= 500.0
    logits = logits.to(torch.bfloat16)
    target = torch.randint(0, 1003, (2, 33), generator=g)
    got = _nll(logits, target, None)
    with native.torch_path():
        ref = _nll(logits, target, None)
    assert got.dtype == ref.dtype == torch.float32
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)
    logits[0, 3, 7] = float("inf")
    assert bool(_nll(logits, target, None)[0, 3].isnan()) and bool(_nll(logits, target, None)[0, 4].isfinite())


def test_fast_surprisal_without_the_compiled_kernel_is_the_same():
    model, _ = load_model("tiny-llama")
    ids = torch.randint(3, 250, (2, 70), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state
    got = token_surprisal(hidden, ids, model.get_output_embeddings(), fast=True, chunk=16)
    with native.torch_path():
        ref = token_surprisal(hidden, ids, model.get_output_embeddings(), fast=True, chunk=16)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)
