"""Methods with ``needs_surprisal`` get the frozen model's own token surprisal at compress time."""

from __future__ import annotations

import pytest
import torch

from zoomkv import ZoomCache
from zoomkv.compat import generate_cache_kwargs
from zoomkv.memory.replay import cache_from_record, record_prefill
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
        super().compress(memory, ctx)


def _reference(model, ids, mask):
    with torch.no_grad():
        pos = (mask.cumsum(-1) - 1).clamp_min(0)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float()
    logp = torch.log_softmax(logits[:, :-1], -1)
    return -logp.gather(-1, ids[:, 1:, None]).squeeze(-1)  # surprisal of tokens 1..T-1


@pytest.mark.parametrize("family", ["tiny-llama", "tiny-gemma3"])
def test_surprisal_reaches_compress_and_is_exact(family):
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
    torch.testing.assert_close(got[0, 1:], ref[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[1, 7:], ref[1, 6:], atol=1e-4, rtol=1e-4)  # after the padding
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
