"""sekv's compiled CPU router (``zoomkv/methods/sekv/native``) against the torch path it replaces: the same
rows for every configuration (one and two stages, anchors, gains, padding, batches, several code widths),
the same codes for new rows, the same generated text through a model, and the fallback when it cannot
be built."""

from __future__ import annotations

import contextlib
import ctypes
import threading
import warnings
from pathlib import Path

import pytest
import torch
from torch.utils import cpp_extension

from tests.helpers import greedy, load_tiny, max_logit_diff, padded_batch
from zoomkv import ZoomCache
from zoomkv import native as zoomkv_native
from zoomkv.memory.quant import QuantSpec
from zoomkv.methods import get_method
from zoomkv.methods.sekv import native
from zoomkv.methods.sekv.codes import encode, rotation
from zoomkv.methods.sekv.method import SeKV
from zoomkv.methods.sekv.modules import SeKVAdapter
from zoomkv.models import load_model
from zoomkv.protocol.method import PrefillContext

H, D, G = 2, 16, 2

pytestmark = pytest.mark.skipif(native.library() is None, reason="no C++ compiler: the torch path is all there is")


@pytest.fixture(scope="module")
def config():
    return load_model("tiny-llama")[0].config


def _memory(config, method, t, budget, seed, batch=1, valid=None, d=D, kv_quant=None):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, H, t, d, generator=g) * (1 + torch.rand(batch, H, 1, d, generator=g) * 3)
    values = torch.randn(batch, H, t, d, generator=g)
    surprisal = torch.rand(batch, t, generator=g) ** 4 * 10
    cache = ZoomCache(config, method, budget, kv_quant=kv_quant)
    memory = cache.layers[0]
    memory.lazy_initialization(keys, values)
    memory.seen = t
    ctx = PrefillContext(layer_idx=0, num_layers=len(cache.layers), keys=keys, values=values,
                         queries=torch.zeros(batch, H * G, t, d), valid=valid, budget=budget, scaling=d**-0.5,
                         num_kv_groups=G, zoom_layers=cache.zoom_layer_indices, surprisal=surprisal)
    method.compress(memory, ctx)
    return memory, g


def _both(method, memory, query):
    with native.torch_path():
        reference = method.select(memory, query)
    fast = method.select(memory, query)
    return reference, fast


def _assert_same(reference, fast):
    torch.testing.assert_close(fast.keys, reference.keys)
    torch.testing.assert_close(fast.values, reference.values)
    if reference.bias is None:
        assert fast.bias is None
    else:
        torch.testing.assert_close(fast.bias, reference.bias)


def _adapter(config, seed):
    torch.manual_seed(seed)
    adapter = SeKVAdapter(config.num_hidden_layers, H, D)  # trained-looking: gains off 1, a lower tau
    with torch.no_grad():
        adapter.code_gain.normal_(0, 0.5)
        adapter.span_tau.fill_(0.5)
    return adapter


@pytest.mark.parametrize("kwargs", [
    {},  # two stages: 1-bit codes, anchors at 4 bits, 4-bit rescoring
    {"rescore_bits": 0},  # one stage
    {"code_bits": 2, "anchor_bits": 8, "rescore_bits": 8, "candidates": 2.5},
    {"sinks": 0, "recent": 0, "anchor_fraction": 0.0},
    {"summary_row": False, "anchor_fraction": 0.2},
    {"rescore_from": "host"},  # the second stage scores the host tier's keys: no finer codes held
    {"rescore_from": "host", "sinks": 0, "recent": 0},
])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_native_router_picks_the_rows_the_torch_path_picks(config, kwargs, seed):
    method = SeKV(adapter=_adapter(config, seed) if seed else None, **kwargs)
    memory, g = _memory(config, method, t=300, budget=48, seed=seed, batch=2)
    for _ in range(3):  # decode steps: new rows get codes from the native encoder
        key, value = torch.randn(2, H, 1, D, generator=g), torch.randn(2, H, 1, D, generator=g)
        method.append(memory, key, value)
        query = torch.randn(2, H * G, 1, D, generator=g) * 2
        _assert_same(*_both(method, memory, query))


@pytest.mark.parametrize("t", [300, 333])
def test_native_router_at_head_dim_64(config, t):
    """Head dim 64 at one bit: the 16-rows-at-a-time path (AVX-512 where the CPU has it), and the rows after the
    last whole 16."""
    method = SeKV()
    memory, g = _memory(config, method, t=t, budget=48, seed=7, batch=2, d=64)
    for _ in range(3):
        method.append(memory, torch.randn(2, H, 1, 64, generator=g), torch.randn(2, H, 1, 64, generator=g))
        _assert_same(*_both(method, memory, torch.randn(2, H * G, 1, 64, generator=g) * 2))


@pytest.mark.parametrize("kv_quant", ["int8", "int4", "int2", "k4v2", "kivi4", "kivi2", "int2o4"])
@pytest.mark.parametrize("d", [D, 64])
@pytest.mark.parametrize("rescore_from", ["codes", "host"])
def test_native_recall_decodes_a_quantized_host_tier(config, kv_quant, d, rescore_from):
    """sekv+FORMAT: the compiled recall decodes only the rows it gathers, as the row buffers' gather does (KIVI's
    newest rows exact until their block fills: 254 rows are 7 blocks and 30 more, the second append codes the
    8th). Exact outlier channels take the torch recall, with the same rows."""
    method = SeKV(rescore_from=rescore_from)
    memory, g = _memory(config, method, t=254, budget=40, seed=8, batch=2, d=d, kv_quant=kv_quant)
    assert ("fine_codes" in memory.host_tier) == (rescore_from == "codes")
    spec = QuantSpec.parse(kv_quant)
    layout = native.host_rows(memory.host_tier["keys"])
    assert (layout is None) == bool(spec.outliers)
    if layout is not None:
        assert layout[2] == spec.for_rows("keys").bits and layout[6] == (spec.key_layout == "channel")
    for _ in range(2):
        method.append(memory, torch.randn(2, H, 1, d, generator=g), torch.randn(2, H, 1, d, generator=g))
        _assert_same(*_both(method, memory, torch.randn(2, H * G, 1, d, generator=g)))


@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("kv_quant", ["int2", "kivi4v2"])
def test_the_compiled_recall_reads_the_anchors_finer_copies(config, bits, kv_quant):
    """host_anchor_bits: a recalled anchor comes from its finer copy, in C (8-bit copies) or in torch (fp16
    ones), with the rows and summary row the torch path gives; the selection is the one without copies."""
    kwargs = {"rescore_from": "host", "anchor_fraction": 0.3}
    method, plain = SeKV(host_anchor_bits=bits, **kwargs), SeKV(**kwargs)
    memory, g = _memory(config, method, t=254, budget=40, seed=9, batch=2, d=64, kv_quant=kv_quant)
    coarse, _ = _memory(config, plain, t=254, budget=40, seed=9, batch=2, d=64, kv_quant=kv_quant)
    for _ in range(2):
        key, value = torch.randn(2, H, 1, 64, generator=g), torch.randn(2, H, 1, 64, generator=g)
        method.append(memory, key, value)
        plain.append(coarse, key, value)
        query = torch.randn(2, H * G, 1, 64, generator=g)
        reference, fast = _both(method, memory, query)
        _assert_same(reference, fast)
        without = plain.select(coarse, query)
        assert not torch.equal(fast.keys, without.keys)  # some anchors were recalled, finer
    plan = memory.meta["native_layer"]
    assert plan.args.anchor_copies == (bits == 8) and plan.recall == (bits == 8)


@pytest.mark.parametrize("rescore_from", ["codes", "host"])
def test_native_router_keeps_padding_out(config, rescore_from):
    lengths = torch.tensor([300, 180])
    valid = torch.arange(300)[None, :] >= (300 - lengths)[:, None]  # left padding
    method = SeKV(rescore_from=rescore_from)
    memory, g = _memory(config, method, t=300, budget=40, seed=3, batch=2, valid=valid)
    method.append(memory, torch.randn(2, H, 1, D, generator=g), torch.randn(2, H, 1, D, generator=g))
    reference, fast = _both(method, memory, torch.randn(2, H * G, 1, D, generator=g))
    _assert_same(reference, fast)
    assert torch.isinf(fast.bias).sum() == 0  # 180 real rows: the budget fills from them alone


def test_native_router_on_several_new_queries(config):
    """A follow-up question (several queries at once) votes with every query of the group."""
    method = SeKV()
    memory, g = _memory(config, method, t=260, budget=40, seed=4)
    _assert_same(*_both(method, memory, torch.randn(1, H * G, 5, D, generator=g)))


@pytest.mark.parametrize("kwargs", [{"rescore_bits": 0}, {}, {"rescore_from": "host"}])
def test_native_router_scores_a_long_chunk_a_block_of_queries_at_a_time(config, kwargs):
    """A prefill chunk's queries (here 2 x 700 query rows a KV head over 300 rows) are scored a block of rows at a
    time in the compiled step (``rows_at_once``: ~890 rows here), their votes summed: the rows the torch path
    picks, padding and anchors included. The chunk's last positions all look one way, so a block scored with
    another block's queries picks other rows."""
    lengths = torch.tensor([300, 230])
    valid = torch.arange(300)[None, :] >= (300 - lengths)[:, None]
    method = SeKV(**kwargs)
    memory, g = _memory(config, method, t=300, budget=40, seed=5, batch=2, valid=valid)
    query = torch.randn(2, H * G, 700, D, generator=g) * 0.3
    query[:, :, 500:] = torch.randn(2, H * G, 1, D, generator=g) * 3
    _assert_same(*_both(method, memory, query))


def test_native_encoder_writes_the_codes_of_the_torch_encoder():
    g = torch.Generator().manual_seed(5)
    keys = torch.randn(3, 2, 40, 64, generator=g) * 3
    mean = torch.randn(3, 2, 1, 64, generator=g)
    rot = rotation(64, 7)
    rotated = torch.matmul(keys - mean, rot)
    for bits, fine_bits in ((1, 4), (2, 8), (4, 0)):
        codes, rms, fine, fine_rms = native.encode(keys, mean, rot, bits, fine_bits)
        ref_codes, ref_rms = encode(rotated, bits)
        assert torch.equal(rms, ref_rms)
        # a coordinate at a level boundary may round the other way (float sums in another order): at most 1 in 1000
        assert (codes != ref_codes).float().mean() < 1e-3
        if fine_bits:
            ref_fine, ref_fine_rms = encode(rotated, fine_bits)
            assert torch.equal(fine_rms, ref_fine_rms)
            assert (fine != ref_fine).float().mean() < 1e-3
        else:
            assert fine is None


def test_generate_gives_the_same_text_with_and_without_the_kernel():
    model, _ = load_tiny("tiny-llama")
    ids, mask = padded_batch(model.config.vocab_size, lengths=(90, 64))

    def run():
        return greedy(model, ids, mask, ZoomCache(model, get_method("sekv"), 24), new=8)

    with native.torch_path():
        reference = run()
    fast = run()
    assert torch.equal(fast.sequences, reference.sequences)
    assert max_logit_diff(fast.scores, reference.scores) < 1e-4


def test_without_a_compiler_sekv_runs_the_torch_path_and_says_so(config, monkeypatch):
    monkeypatch.setattr(native.KERNEL, "_lib", None)
    monkeypatch.setattr(native.KERNEL, "_failed", None)

    def no_compiler():
        raise RuntimeError("Error building extension: c++: command not found")

    monkeypatch.setattr(native.KERNEL, "_build", no_compiler)
    method = SeKV()
    memory, g = _memory(config, method, t=200, budget=40, seed=6)
    query = torch.randn(1, H * G, 1, D, generator=g)
    with pytest.warns(RuntimeWarning, match="could not be built.*torch path"):
        sel = method.select(memory, query)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once, not every step
        again = method.select(memory, query)
    torch.testing.assert_close(sel.keys, again.keys)
    assert not native.usable(query)


def test_zoomkv_native_0_turns_it_off(monkeypatch):
    monkeypatch.setenv("ZOOMKV_NATIVE", "0")
    assert not native.usable(torch.zeros(1))


def test_rescoring_from_the_host_keys_over_every_row_is_exact_top_k(config):
    """``rescore_from='host'`` with every row a candidate: the second stage is the teacher's own logits, so the
    rows recalled are the sinks, the newest rows, and the exact top rows of the group's summed softmax."""
    method = SeKV(rescore_from="host", candidates=64.0)
    memory, g = _memory(config, method, t=300, budget=48, seed=11)
    query = torch.randn(1, H * G, 1, D, generator=g) * 2
    for torch_path in (True, False):
        with native.torch_path() if torch_path else contextlib.nullcontext():
            # every one of the 300 rows a candidate (64 x 48), 47 kept beside the summary row
            idx = method._pick(memory, query, 300, 300, 47) if torch_path else method._native_layer(memory).step(query)
        keys = memory.host_tier["keys"].view()
        vote = torch.softmax(torch.matmul(query.view(1, H, G, D), keys.transpose(-1, -2)) * D**-0.5, -1).sum(2)
        vote[..., :4] = float("inf")  # sinks
        vote[..., -16:] = float("inf")  # recent
        expected = vote.topk(47, -1).indices.sort(-1).values
        assert torch.equal(idx, expected)


@pytest.mark.skipif(not Path("/proc/self/maps").exists() or not zoomkv_native.openmp(),
                    reason="OpenMP kernels are built where torch runs on libgomp (Linux)")
def test_the_kernels_run_on_torchs_own_openmp_runtime():
    # A second libgomp would bring a second thread pool spinning against torch's on the same cores.
    native.library()
    torch_lib = Path(torch.__file__).parent / "lib"
    loaded = {Path(line.split()[-1]) for line in Path("/proc/self/maps").read_text().splitlines()
              if line.rstrip().endswith("/libgomp.so.1")}
    assert loaded and all(path.parent == torch_lib for path in loaded)


def _views(memory) -> dict[str, torch.Tensor]:
    out = {}
    for tier in (memory.device_tier, memory.host_tier):
        for name, value in tier.items():
            if name.startswith(("recall_", "cand_")):  # a step's scratch rows, not state
                continue
            if hasattr(value, "tensors"):  # a quantized buffer: its codes, scales, minimums
                out |= {f"{name}.{i}": t[:, :, : value.length] for i, t in enumerate(value.tensors()[:3])}
            elif hasattr(value, "view"):
                out[name] = value.view() if not isinstance(value, torch.Tensor) else value
            elif isinstance(value, torch.Tensor):
                out[name] = value
    return out


@pytest.mark.parametrize("kwargs,kv_quant,padded", [
    ({}, None, False),
    ({}, None, True),
    ({"rescore_from": "host"}, "k8v4", False),
    ({"summary_row": False, "rescore_bits": 0}, "int8", True),
    ({"code_bits": 2, "rescore_bits": 8}, "kivi4", False),
])
def test_native_append_writes_what_the_torch_append_writes(config, kwargs, kv_quant, padded):
    valid = (torch.arange(120)[None, :] >= torch.tensor([[0], [30]])) if padded else None
    memories = []
    for torch_path in (True, False):
        method = SeKV(**kwargs)
        memory, g = _memory(config, method, t=120, budget=40, seed=8, batch=2, valid=valid, kv_quant=kv_quant)
        with native.torch_path() if torch_path else contextlib.nullcontext():
            for rows in (1, 1, 3, 1):  # decode steps, and several rows at once (a question after compression)
                method.append(memory, torch.randn(2, H, rows, D, generator=g), torch.randn(2, H, rows, D, generator=g))
        memories.append(_views(memory))
    reference, fast = memories
    assert reference.keys() == fast.keys()
    for name, ref in reference.items():
        got = fast[name]
        assert got.shape == ref.shape, name
        if name in ("codes", "fine_codes"):  # a coordinate at a level boundary may round the other way
            assert (got != ref).float().mean() < 1e-2, name
        else:
            torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6, msg=name)


@pytest.mark.parametrize("kv_quant", [None, "k8v4", "kivi4"])
def test_the_compiled_step_follows_buffers_that_grow_or_change_hands(config, kv_quant):
    """The layer's compiled step is laid out once; appends past every buffer's capacity (they grow and move)
    and appends by the torch path in between (rows it did not see) must not leave it reading stale memory."""
    method = SeKV(rescore_from="host" if kv_quant else "codes")
    memory, g = _memory(config, method, t=200, budget=40, seed=12, batch=2, kv_quant=kv_quant)
    for step in range(150):
        key, value = torch.randn(2, H, 1, D, generator=g), torch.randn(2, H, 1, D, generator=g)
        with native.torch_path() if step % 7 == 3 else contextlib.nullcontext():
            method.append(memory, key, value)
        if step % 10 == 9:
            _assert_same(*_both(method, memory, torch.randn(2, H * G, 1, D, generator=g)))
    assert memory.host_tier["keys"].length == 350
    assert memory.meta["native_layer"].args.n == 350


def test_a_build_killed_midway_does_not_hang_the_next_one(tmp_path, monkeypatch):
    """torch guards an extension's build with a bare file that a killed process leaves behind (Ctrl-C during the
    first build), after which every load waited on it forever at 0% CPU. zoomkv's own flock, held while it loads,
    tells that file stale: the next process builds and runs."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    source = tmp_path / "answer.cpp"
    source.write_text('extern "C" int answer() { return 42; }\n')
    kernel = zoomkv_native.Kernel(source, "a test kernel", {"answer": ([], ctypes.c_int)})
    folder = Path(cpp_extension._get_build_directory(kernel.name(), verbose=False))
    (folder / zoomkv_native.TORCH_BATON).touch()  # what a build killed midway leaves
    built: list = []
    worker = threading.Thread(target=lambda: built.append(kernel.library()), daemon=True)
    worker.start()
    worker.join(timeout=300)
    assert built, "the load waited on a stale build lock"
    assert built[0] is not None and built[0].answer() == 42
