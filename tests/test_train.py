"""The sekv trainer: recipe validation, the trainable-fraction limit, --dry-run, the loss going down on a
tiny model, and a SIGKILLed run resuming to bitwise the same adapter as an uninterrupted one."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from zoomkv.cli import run_command
from zoomkv.data.training import Sample
from zoomkv.errors import ConfigError, ZoomKVError
from zoomkv.models import load_model
from zoomkv.train.config import load_recipe
from zoomkv.train.sizing import dry_run

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "recipes" / "tiny-llama-sekv.yaml"
SHIPPED = sorted((ROOT / "recipes").rglob("*.yaml"))


def main(argv: list[str]) -> int:
    """``python -m zoomkv.train ARGV``, in this process."""
    return run_command("train", argv, prog="python -m zoomkv.train")


@pytest.mark.parametrize("recipe", [p for p in SHIPPED if "accelerate" not in p.parts], ids=lambda p: p.name)
def test_shipped_recipes_parse_and_say_how_to_run(recipe):
    load_recipe(recipe)
    first = recipe.read_text().splitlines()[0]
    assert first.startswith("# ") and "zoomkv.train" in first or "accelerate launch" in first


def test_recipe_errors_name_the_key_and_the_choices(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown recipe key 'lerning_rate'; valid keys: .*\blr\b"):
        load_recipe(TINY, ["lerning_rate=0.1"])
    with pytest.raises(ConfigError, match=r"'steps': expected int, got str"):
        load_recipe(TINY, ["steps=many"])
    with pytest.raises(ConfigError, match=r"'code_bits' must be one of \(1, 2, 4, 8\), got 3"):
        load_recipe(TINY, ["code_bits=3"])
    with pytest.raises(ConfigError, match=r"'init_adapter': file or folder not found"):
        load_recipe(TINY, [f"init_adapter={tmp_path / 'missing'}"])
    with pytest.raises(ConfigError, match=r"'tasks'.*'poems'; valid: plain, passkey, kv, vartrack, aggregate"):
        load_recipe(TINY, ["tasks=passkey,poems"])
    with pytest.raises(ConfigError, match="recipe file not found"):
        load_recipe(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: tiny-llama\nlayers: [1, 2]\n")
    with pytest.raises(ConfigError, match="flat YAML"):
        load_recipe(bad)
    assert load_recipe(TINY, ["lr=1"]).lr == 1.0  # an int where a float is expected is fine


def test_dry_run_prints_the_fraction_last_without_weights(capsys):
    assert main(["--recipe", str(ROOT / "recipes" / "llama-3-8b" / "sekv.yaml"), "--dry-run"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("trainable_fraction=")
    assert 0 < float(last.split("=")[1]) < 0.0005


def test_overrides_may_follow_the_flags(capsys):
    """``key=value`` overrides on both sides of ``--dry-run`` all apply, in order; an unknown flag or a bare
    word after them is still refused in one line."""
    from zoomkv.cli import _parse, build_parser
    from zoomkv.cli import main as zoomkv_main

    argv = ["--recipe", str(TINY), "steps=3", "--dry-run", "steps=7", "lr=0.5"]
    assert _parse(build_parser(), ["train", *argv]).overrides == ["steps=3", "steps=7", "lr=0.5"]
    assert main(argv) == 0
    assert zoomkv_main(["train", *argv]) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        zoomkv_main(["train", "--recipe", str(TINY), "--dry-run", "--nope"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().endswith("unrecognized arguments: --nope (see zoomkv --help)")
    assert zoomkv_main(["train", "--recipe", str(TINY), "--dry-run", "steps"]) == 2
    assert capsys.readouterr().err.strip() == "zoomkv: error: overrides are key=value, got 'steps'"


REAL_MODEL_RECIPES = [p for p in SHIPPED if p.parent.name in ("smollm2-135m", "llama-3-8b")]


# The one recipe over the card's 0.05% on its own model: sekv's trained hash index (an option, not the default), whose
# projections are 0.28% of SmolLM2-135M; the recipe raises its limit, and on an 8B model it is under 0.05% (below).
OVER_THE_CARD = {"hash32.yaml": 0.005}


def _dry_run_fraction(capsys, *argv: str) -> float:
    assert main(["--dry-run", *argv]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("trainable_fraction=")
    return float(last.split("=")[1])


@pytest.mark.slow
@pytest.mark.parametrize("recipe", REAL_MODEL_RECIPES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_real_model_recipe_is_under_the_trainable_limit(recipe, capsys):
    fraction = _dry_run_fraction(capsys, "--recipe", str(recipe))
    assert 0 < fraction < OVER_THE_CARD.get(recipe.name, 0.0005)  # < 0.05% of the base model


@pytest.mark.slow
def test_a_32_bit_hash_is_under_the_card_on_an_8b_model(capsys):
    fraction = _dry_run_fraction(capsys, "--recipe", str(ROOT / "recipes" / "llama-3-8b" / "sekv.yaml"), "hash_bits=32")
    assert 0.0002 < fraction < 0.0005


def test_oversized_adapter_is_refused(capsys):
    with pytest.raises(ConfigError, match="over max_trainable_fraction"):
        dry_run(load_recipe(TINY, ["max_trainable_fraction=0.000001"]))
    assert main(["--recipe", str(TINY), "--dry-run", "max_trainable_fraction=0.000001"]) == 2
    assert "over max_trainable_fraction" in capsys.readouterr().err


def _loss_decreases(cache: Path) -> None:
    """On one cached sample, every layer, the full objective."""
    import random

    from zoomkv.methods.sekv.modules import SeKVAdapter
    from zoomkv.train.teacher import load_sample

    cfg = load_recipe(TINY)
    sample = load_sample(sorted(cache.glob("sample_*.safetensors"))[-1])
    layers = sample["layers"].tolist()
    adapter = SeKVAdapter(len(layers), 2, 16)
    optimizer = torch.optim.AdamW(adapter.parameters(), lr=0.05)
    losses = []
    for _ in range(6):
        loss, _ = cfg.training.step_loss(adapter, sample, layers, cfg, 10**6, random.Random(0))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] and losses[-1] < losses[1], losses


def test_a_step_reads_only_its_layers_of_a_sample(tmp_path):
    """A micro-batch reads the sample's own tensors and its picked layers' (the rest stay on disk), the same
    tensors a whole read gives, read in place or ahead on a thread; a sample file cut short is one line naming
    it."""
    from zoomkv.train.loop import micro_batch
    from zoomkv.train.teacher import SampleReader, build_cache, extract_sample, load_sample

    model, tokenizer = load_model("tiny-llama")[:2]
    cache = tmp_path / "teacher"
    samples = [Sample("a b c " * 60, "", "plain", 0)]
    path = build_cache(model, tokenizer, samples, cache, n_queries=3, min_pos=16, recent=4, fingerprint={},
                       show_progress=False)[0]
    whole = load_sample(path)
    cfg = load_recipe(TINY, ["layers_per_step=2", "steps=3"])
    sample, layers, _ = micro_batch(cfg, 1, 0, 1, [path])
    assert len(layers) == 2 and set(layers) < set(whole["layers"].tolist())
    per_layer = {f"{kind}.{layer}" for kind in ("k", "v", "q", "attn", "rotary_inv_freq", "rotary_scaling")
                 for layer in layers}
    assert set(sample) == per_layer | {"ids", "surprisal", "positions", "layers", "scaling"}
    assert all(torch.equal(sample[name], whole[name]) for name in sample)
    assert set(whole) == set(extract_sample(model, tokenizer("a b c " * 60, return_tensors="pt")["input_ids"], 3,
                                            16, 4))
    # on another device (here `meta`), what the objectives read as numbers stays on the host: a GPU would wait
    moved = load_sample(path, "meta", layers)
    host = {"ids", "positions", "layers", "scaling", *(f"rotary_scaling.{layer}" for layer in layers)}
    assert {name for name, tensor in moved.items() if tensor.device.type == "cpu"} == host
    # read ahead on a thread (as on a GPU, while the micro-batch before trains): the same tensors; a sample asked
    # for that was not read ahead is read then
    with SampleReader("cpu") as reader:
        reader.read_ahead(path, layers)
        ahead, _, _ = micro_batch(cfg, 1, 0, 1, [path], reader=reader)
        other = micro_batch(cfg, 1, 0, 1, [path], reader=reader)[0]
        assert reader.ahead_used == 1
    assert all(torch.equal(ahead[name], sample[name]) and torch.equal(other[name], sample[name]) for name in sample)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ZoomKVError, match="teacher sample .* cannot be read"):
        micro_batch(cfg, 1, 0, 1, [path])
    with SampleReader("cpu") as reader, pytest.raises(ZoomKVError, match="teacher sample .* cannot be read"):
        reader.read_ahead(path, layers)  # (the thread's error reaches the step that asks for the sample)
        reader.load(path, layers)


def _run(tmp_path: Path, out: str, *extra: str) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "zoomkv.train", "--recipe", str(TINY), f"output_dir={tmp_path / out}",
            f"teacher_cache={tmp_path / 'teacher'}", "num_samples=2", "queries_per_sample=3", "steps=5",
            "save_every=2", "layers_per_step=2", *extra]
    return subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=600)


@pytest.mark.heavy
def test_loss_decreases_and_resume_after_sigkill_is_bitwise(tmp_path):
    full = _run(tmp_path, "a")
    assert full.returncode == 0, full.stderr[-2000:]
    assert "trainable parameters:" in full.stderr and "adapter saved to" in full.stderr
    _loss_decreases(tmp_path / "teacher")
    killed = _run(tmp_path, "b", "kill_at_step=3")
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert not (tmp_path / "b" / "sekv-tiny" / "adapter").exists()
    resumed = _run(tmp_path, "b", "resume=latest")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stderr and "step 2" in resumed.stderr
    a = load_file(str(tmp_path / "a" / "sekv-tiny" / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "b" / "sekv-tiny" / "adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert not torch.equal(a["span_tau"], torch.full_like(a["span_tau"], 2.0))  # it did train
    assert a["code_gain"].abs().sum() > 0
    # adapter-only: nothing the size of the base model was written
    ckpt = tmp_path / "a" / "sekv-tiny" / "checkpoints"
    assert all(f.stat().st_size < 200_000 for f in ckpt.rglob("*") if f.is_file())
    assert (ckpt / "step_000004" / "train_config.yaml").is_file()
    # safetensors + JSON only: nothing a resume or an export reads is a pickle
    assert not [f for f in ckpt.rglob("*") if f.suffix in (".pkl", ".bin", ".pt", ".pth")]
    # the final adapter and any step checkpoint load as ZoomAdapters (and export)
    from zoomkv.adapters.export import export_checkpoint
    from zoomkv.adapters.model import ZoomAdapter

    final = ZoomAdapter.from_pretrained(tmp_path / "a" / "sekv-tiny" / "adapter")
    assert final.config.method == "sekv" and final.config.base_model["name"] == "tiny-llama"
    exported = ZoomAdapter.from_pretrained(export_checkpoint(ckpt / "step_000004", tmp_path / "exported"))
    assert exported.config.hyper == final.config.hyper
    # --eval-only scores the saved adapter beside the fresh one and the named baselines, without training
    args = ["--recipe", str(TINY), "--eval-only", f"output_dir={tmp_path / 'a'}", "eval_samples=1",
            "eval_baselines=quest,snapkv"]
    assert main(args) == 0
    scores = json.loads((tmp_path / "a" / "sekv-tiny" / "eval.json").read_text())
    assert {"fresh", "trained", "quest", "snapkv"} <= set(scores) and scores["samples"] == 1
    assert all(0 <= scores[m]["kl"] < 50 for m in ("fresh", "trained", "quest", "snapkv"))
    assert main(["--recipe", str(TINY), "--eval-only", f"output_dir={tmp_path / 'nothing'}"]) == 2


@pytest.mark.heavy
def test_two_processes_with_the_multi_cpu_launcher(tmp_path):
    """`accelerate launch --config_file recipes/accelerate/multi_cpu.yaml`: two gloo processes train one adapter."""
    args = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
            str(ROOT / "recipes" / "accelerate" / "multi_cpu.yaml"), "-m", "zoomkv.train", "--recipe", str(TINY),
            f"output_dir={tmp_path}", f"teacher_cache={tmp_path / 'teacher'}", "num_samples=2",
            "queries_per_sample=3", "steps=4", "save_every=2"]
    done = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 process(es), multi_cpu" in done.stderr
    assert "all 2 processes hold the same adapter" in done.stderr  # gradients were averaged every step
    from zoomkv.adapters.model import ZoomAdapter

    adapter = ZoomAdapter.from_pretrained(tmp_path / "sekv-tiny" / "adapter")
    assert not torch.equal(adapter.modules.span_tau, torch.full_like(adapter.modules.span_tau, 2.0))
    assert (tmp_path / "sekv-tiny" / "checkpoints" / "step_000004" / "DONE").is_file()
    # one process with the same global batch (2 samples a step) ends with the same adapter, up to the
    # order of floating-point sums
    one = _run(tmp_path, "one", "samples_per_step=2", "steps=4", "layers_per_step=0")
    assert one.returncode == 0, one.stderr[-2000:]
    single = ZoomAdapter.from_pretrained(tmp_path / "one" / "sekv-tiny" / "adapter").modules.state_dict()
    for name, tensor in adapter.modules.state_dict().items():
        torch.testing.assert_close(single[name], tensor, atol=1e-4, rtol=1e-4, msg=name)


@pytest.mark.heavy
def test_tensorboard_logs_the_losses(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    done = _run(tmp_path, "tb", "tensorboard=true", "steps=3")
    assert done.returncode == 0, done.stderr[-2000:]
    events = sorted((tmp_path / "tb" / "sekv-tiny" / "tb").glob("events.out.tfevents.*"))
    assert events
    acc = EventAccumulator(str(events[0]))
    acc.Reload()
    assert "train/loss" in acc.Tags()["scalars"]
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3]


def test_a_position_of_the_objective_reads_no_number_from_its_tensors():
    """A GPU waits at every number read back from a tensor (``aten::_local_scalar_dense``): a step of the 8B
    recipe computes 64 (layer, position) losses, and none of them reads one when given its layer's integer budget,
    which a step reads once for every layer (``recalled_rows``). The anchors are the threshold's top rows in
    fixed shape (whether any row is above it, and how many, were two more reads a position; the rows the router
    chooses among are counted in Python: eight reads a position at first). The losses are those of a position
    that reads its budget itself. With the rescoring stage and the candidates' loss on."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from zoomkv.methods.sekv.method import SeKVConfig
    from zoomkv.methods.sekv.modules import SeKVAdapter
    from zoomkv.methods.sekv.objective import position_losses, recalled_rows

    class ScalarReads(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                ScalarReads.count += 1
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(0)
    h, t, d = 2, 300, 16
    keys, values = torch.randn(h, t, d, generator=g), torch.randn(h, t, d, generator=g)
    teacher = torch.softmax(torch.randn(2 * h, t, generator=g), -1)
    adapter = SeKVAdapter(2, h, d)
    surprisal = torch.rand(t, generator=g)
    surprisal[[60, 150, 200]] = 12.0  # rows above the anchor threshold
    cfg = SeKVConfig()  # its rescoring stage on (rescore_bits=4)
    args = (adapter, 0, keys, values, torch.randn(2 * h, d, generator=g), teacher, surprisal, t - 1, d**-0.5, 40, cfg)
    whole = round(recalled_rows(adapter, 40, cfg).tolist()[0])
    with ScalarReads():
        losses = position_losses(*args, with_recall=True, whole=whole)
    assert losses.recall is not None and ScalarReads.count == 0
    with ScalarReads():
        again = position_losses(*args, with_recall=True)
    assert ScalarReads.count == 1  # the budget, read here
    for field in dataclasses.fields(losses):
        assert torch.equal(getattr(losses, field.name), getattr(again, field.name)), field.name


def test_ranking_loss_prefers_the_ranking_of_the_teacher():
    """The listwise ranking loss: lower when the gains weigh the code coordinates that rank first the row the
    teacher reads, and its gradient reaches the gains, τ and the layer split."""
    from zoomkv.methods.sekv.codes import rotation
    from zoomkv.methods.sekv.method import SeKVConfig
    from zoomkv.methods.sekv.modules import SeKVAdapter
    from zoomkv.methods.sekv.objective import position_losses

    g = torch.Generator().manual_seed(0)
    h, t, d, target = 1, 160, 16, 77
    rot = rotation(d, SeKVAdapter(1, h, d).rotation_seed_of(0))
    q_rot = torch.randn(2, d, generator=g)
    x = torch.randn(h, t, d, generator=g)
    # in the rotated code space the target row agrees with the query on the first half of the coordinates
    # and disagrees on the second half
    sign = torch.sign(q_rot.mean(0))
    x[:, target] = 2.0 * torch.cat([sign[: d // 2], -sign[d // 2:]])
    keys = x @ rot.T
    query = q_rot @ rot.T
    teacher = torch.full((2, t), 0.1 / (t - 1))
    teacher[:, target] = 0.9
    teacher = teacher / teacher.sum(-1, keepdim=True)
    cfg = SeKVConfig(anchor_fraction=0.0)
    values = torch.randn(h, t, d, generator=g)
    args = (keys, values, query, teacher, torch.ones(t), t - 1, d**-0.5, 40, cfg)

    def rank_loss(first_half: bool) -> torch.Tensor:
        adapter = SeKVAdapter(1, h, d)
        with torch.no_grad():
            off = slice(d // 2, d) if first_half else slice(0, d // 2)
            adapter.code_gain[0, :, off] = -5.0
        return position_losses(adapter, 0, *args).rank

    assert rank_loss(True) < position_losses(SeKVAdapter(1, h, d), 0, *args).rank < rank_loss(False)
    adapter = SeKVAdapter(2, h, d)
    s = torch.rand(t, generator=g) * 3
    losses = position_losses(adapter, 0, keys, values, query, teacher, s, t - 1, d**-0.5, 40, SeKVConfig())
    (losses.rank + losses.anchor + losses.split + losses.out).backward()
    assert adapter.code_gain.grad[0].abs().sum() > 0
    assert adapter.span_tau.grad[0] != 0 and adapter.layer_logit.grad.abs().sum() > 0
    assert adapter.summary_bias.grad[0].abs().sum() > 0
    assert adapter.rank_gate.grad[0].abs().sum() > 0  # the rank gates learn from the output error


def test_freeze_holds_the_named_tensors_and_the_rank_gates_learn_at_their_own_rate(tmp_path, capsys):
    """``freeze=`` (an ablation) keeps the named tensors at their start while the rest trains; an unknown name
    is one line naming the adapter's tensors. With a rank budget the gates move at ``gate_lr``: enough for a
    short run to drop directions."""
    common = ["--recipe", str(TINY), f"teacher_cache={tmp_path / 'teacher'}", "num_samples=2", "queries_per_sample=3",
              "steps=4", "save_every=4"]
    assert main([*common, f"output_dir={tmp_path / 'a'}", "freeze=span_tau,layer_logit",
                 "host_rank_target=0.5", "gate_lr=1.0"]) == 0
    assert "held at their start: span_tau, layer_logit" in capsys.readouterr().err
    a = load_file(str(tmp_path / "a" / "sekv-tiny" / "adapter" / "adapter_model.safetensors"))
    assert torch.equal(a["span_tau"], torch.full_like(a["span_tau"], 2.0))
    assert torch.equal(a["layer_logit"], torch.zeros_like(a["layer_logit"]))
    assert a["code_gain"].abs().sum() > 0 and a["summary_bias"].abs().sum() > 0  # the others trained
    kept = (a["rank_gate"] > 0).float().mean()
    assert kept < 1, "gate_lr=1.0 for 4 steps moves gates started at +3 below 0"
    # its moments leave the frozen tensors out: resuming under another freeze is refused in one line
    assert main([*common, f"output_dir={tmp_path / 'a'}", "host_rank_target=0.5", "resume=latest"]) == 2
    assert "freeze='span_tau,layer_logit'" in capsys.readouterr().err
    assert main([*common, f"output_dir={tmp_path / 'b'}", "freeze=span_ta"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'freeze'" in err[0] and "span_tau" in err[0], err


def test_a_rank_budget_on_the_keys_alone_leaves_every_value_direction(tmp_path):
    """``host_rank_values=false``: the gates cut only the keys' directions (for a host tier whose values are
    quantized instead); the value gates stay where they started, on."""
    out = tmp_path / "keys"
    assert main(["--recipe", str(TINY), f"teacher_cache={tmp_path / 'teacher'}", "num_samples=2",
                 "queries_per_sample=3", "steps=4", "save_every=4", f"output_dir={out}", "host_rank_target=0.5",
                 "gate_lr=1.0", "host_rank_values=false"]) == 0
    a = load_file(str(out / "sekv-tiny" / "adapter" / "adapter_model.safetensors"))
    assert torch.equal(a["rank_gate"][:, 1], torch.full_like(a["rank_gate"][:, 1], 3.0))
    assert (a["rank_gate"][:, 0] > 0).float().mean() < 1


def test_the_rank_hinge_sees_the_share_the_host_really_keeps():
    """The budget's hinge is over the hard share of kept directions: logits just below 0 keep nothing, and the
    hinge stops pushing them, though their sigmoids (≈ 0.48) are above a 0.4 target."""
    from zoomkv.methods.sekv.objective import kept_share

    below = torch.full((2, 64), -0.1, requires_grad=True)
    share = kept_share(below)
    assert share.item() == 0.0
    torch.relu(share - 0.4).backward()
    assert below.grad.abs().sum() == 0
    above = torch.full((2, 64), 0.1, requires_grad=True)
    torch.relu(kept_share(above) - 0.4).backward()
    assert kept_share(above).item() == pytest.approx(1.0) and bool((above.grad > 0).all())


def test_the_frozen_model_in_bf16_with_random_weights_trains(tmp_path):
    """What ``scripts/cuda_check.sh`` times on a GPU: a model's shape (a folder with its config and tokenizer)
    built with random weights, frozen in bf16 on the training device, the modules trained in fp32."""
    from zoomkv.models import load_model

    model, tokenizer = load_model("tiny-llama")
    shape = tmp_path / "shape"
    model.config.save_pretrained(shape)
    tokenizer.save_pretrained(shape)
    code = main(["--recipe", str(TINY), f"model={shape}", "random_weights=true", "dtype=bfloat16",
                 f"output_dir={tmp_path / 'out'}", "num_samples=2", "queries_per_sample=2", "steps=3",
                 "layers_per_step=2", "eval_samples=0", "tensorboard=false"])
    assert code == 0
    weights = load_file(tmp_path / "out" / "sekv-tiny" / "adapter" / "adapter_model.safetensors")
    assert weights and all(t.dtype == torch.float32 and torch.isfinite(t).all() for t in weights.values())


def test_an_unknown_model_dtype_is_refused():
    with pytest.raises(ConfigError, match="dtype"):
        load_recipe(TINY, ["dtype=fp8"])
