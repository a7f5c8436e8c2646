"""A recall that reads only the rows its buffer misses (``zoomkv.protocol.recallable``: ``plan_swaps``,
``recall_misses_only``; ``zoomkv.kernels.gather_rows`` with slots). On a GPU machine each recalled row crosses
PCIe, and consecutive steps pick mostly the same rows, so a row held from the last step keeps its slot and only
the others are read. The plan's invariants on random sets, the kernel under Triton's interpreter, and whole
generations: the same tokens as reading every row, fewer rows read."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.helpers import greedy, max_logit_diff, padded_batch
from zoomkv import ZoomCache, native
from zoomkv.kernels.gather import gather_rows, gather_rows_reference, gather_to_slots_reference
from zoomkv.methods import get_method
from zoomkv.models import load_model
from zoomkv.protocol import recallable
from zoomkv.protocol.recallable import plan_swaps, recall_misses_only


def _distinct(g: torch.Generator, b: int, h: int, k: int, n: int) -> torch.Tensor:
    return torch.stack([torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(h)]) for _ in range(b)])


@pytest.mark.parametrize("seed", range(20))
def test_a_held_row_keeps_its_slot_and_a_missing_one_takes_a_free_slot(seed):
    g = torch.Generator().manual_seed(seed)
    k = int(torch.randint(1, 24, (1,), generator=g))
    n = k + int(torch.randint(0, 3 * k, (1,), generator=g))
    held = _distinct(g, 2, 3, k, n)
    if seed % 3 == 0:  # the first step: some or all slots hold nothing
        held[..., : int(torch.randint(0, k + 1, (1,), generator=g))] = -1
    idx = _distinct(g, 2, 3, k, n)
    dest, fetch, rows = plan_swaps(held, idx)
    assert torch.equal(dest.sort(-1).values, torch.arange(k).expand_as(dest))  # every slot written once
    assert torch.equal(rows.gather(-1, dest), idx)  # slot dest[j] holds row idx[j]
    was_held = (idx[..., :, None] == held[..., None, :]).any(-1)
    assert torch.equal(fetch, ~was_held)  # exactly the rows not held are read
    assert torch.equal(held.gather(-1, dest)[was_held], idx[was_held])  # in the slot they were in


def test_the_same_rows_again_read_nothing():
    idx = torch.tensor([[[3, 9, 1, 4]]])
    dest, fetch, rows = plan_swaps(torch.tensor([[[4, 1, 9, 3]]]), idx)
    assert not fetch.any() and torch.equal(rows, torch.tensor([[[4, 1, 9, 3]]]))


@pytest.fixture
def interpreter(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("ZOOMKV_TRITON", "1")


def test_the_plan_kernel_plans_what_the_torch_plan_plans():
    """The kernel (``zoomkv.kernels.plan``, what a GPU runs) against the torch plan, output for output, on random
    sets. In a process of its own: the kernel calls triton.language's reductions, which the interpreter runs only
    when it was on before triton was imported."""
    pytest.importorskip("triton")
    script = textwrap.dedent("""
        import os
        import torch
        from zoomkv import kernels
        from zoomkv.protocol.recallable import plan_swaps
        assert kernels.usable(torch.zeros(1))
        for seed in range(14):
            g = torch.Generator().manual_seed(seed)
            k = int(torch.randint(1, 90, (1,), generator=g)) if seed < 12 else (700, 2100)[seed - 12]  # tiles of 4
            n = k + int(torch.randint(0, 2 * k, (1,), generator=g))
            held, idx = (torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(6)]).view(2, 3, k)
                         for _ in range(2))
            if seed % 2:  # slots that hold nothing yet
                held[..., : int(torch.randint(0, k + 1, (1,), generator=g))] = -1
            os.environ["ZOOMKV_TRITON"] = "1"
            got = plan_swaps(held, idx)  # the kernel, under the interpreter
            os.environ["ZOOMKV_TRITON"] = "0"
            reference = plan_swaps(held, idx)  # the torch plan
            for a, b in zip(got, reference, strict=True):
                assert torch.equal(a, b), (seed, k)
        print("same plans")
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1", "ZOOMKV_TRITON": "1"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0 and "same plans" in done.stdout, done.stderr[-2000:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_writes_the_fetched_rows_to_their_slots_and_reads_no_other(interpreter, dtype):
    g = torch.Generator().manual_seed(7)
    src = torch.randn(2, 3, 50, 40, generator=g).to(dtype)
    idx = _distinct(g, 2, 3, 37, 50)
    dest = torch.stack([torch.stack([torch.randperm(37, generator=g) for _ in range(3)]) for _ in range(2)])
    fetch = torch.rand(2, 3, 37, generator=g) < 0.4
    poisoned = src.clone()
    at = idx[..., None].expand(-1, -1, -1, 40)
    poisoned.scatter_(2, at, torch.where(fetch[..., None], src.gather(2, at), float("nan")).to(dtype))
    out = torch.randn(2, 3, 37, 40, generator=g).to(dtype)
    expected = gather_to_slots_reference(gather_rows_reference(src, idx), out.clone(), dest, fetch)
    gather_rows(poisoned, idx, out, dest=dest, fetch=fetch)
    assert torch.equal(out, expected)  # no NaN: the rows not fetched were never read


def test_the_kernel_reads_only_the_fetched_rows_into_their_own_places(interpreter):
    """``fetch`` without slots (a coded host tier's codes, decoded after): row j to place j where fetched."""
    g = torch.Generator().manual_seed(8)
    src = torch.randint(0, 255, (2, 3, 50, 24), generator=g, dtype=torch.uint8)
    idx = _distinct(g, 2, 3, 20, 50)
    fetch = torch.rand(2, 3, 20, generator=g) < 0.5
    out = torch.zeros(2, 3, 20, 24, dtype=torch.uint8)
    gather_rows(src, idx, out, fetch=fetch)
    expected = torch.where(fetch[..., None], gather_rows_reference(src, idx), 0)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("name", ["sekv", "quest", "oracle_topk", "sentencekv", "quest+int8", "sekv+k8v4",
                                  "quest+kivi4", "sekv-host+k8v4"])  # -host: stage two from the host keys
def test_generation_reads_fewer_rows_and_gives_the_same_tokens(name, monkeypatch):
    model, _ = load_model("tiny-llama")
    ids, mask = padded_batch(model.config.vocab_size, lengths=(150, 117))
    fetched = []
    plan = recallable.plan_swaps

    def counted(held, idx):
        dest, fetch, rows = plan(held, idx)
        fetched.append((int(fetch.sum()), fetch.numel()))
        return dest, fetch, rows

    monkeypatch.setattr(recallable, "plan_swaps", counted)
    method, _, host_format = name.partition("+")  # a coded host tier: its rows decoded into their slots
    method, _, rescore_from = method.partition("-")
    kwargs = {"rescore_from": rescore_from} if rescore_from else {}
    runs = []
    for on in (False, True):
        with native.torch_path(), recall_misses_only(on):
            cache = ZoomCache(model, get_method(method, **kwargs), 32, kv_quant=host_format or None)
            runs.append(greedy(model, ids, mask, cache, new=12))
    every, misses = runs
    assert torch.equal(misses.sequences, every.sequences), name
    assert max_logit_diff(misses.scores, every.scores) < 1e-4, name
    read, asked = map(sum, zip(*fetched, strict=True))
    assert fetched and read < 0.8 * asked, (name, read, asked)  # the first step of a layer reads every row
