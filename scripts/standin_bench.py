"""``zoomkv bench --device cuda`` on a machine without a GPU: the CUDA stand-in (``tests/cuda_standin.py``).

The rows' numbers are the GPU code paths' own (the Triton kernels run under Triton's interpreter), their waits a
decode step (``--sync-audit``) are what a GPU would count, and the CUDA peak column is the device memory the
stand-in counts (each live storage in 512-byte blocks, as CUDA's caching allocator; not the temporaries inside one
op: torch's attention on the CPU computes the scores FlashAttention never holds). Times are the CPU's, slower
than a GPU's by orders: read the memory and the waits, not the speed. With ``--peak-lines N`` each row also
lists the N source lines that allocated most of what its run's peak held (a table, or ``cuda_peak_lines`` under
``--json``): where a prefill's device memory goes, before a GPU is lent.

    python scripts/standin_bench.py --peak-lines 8 -- --model tiny-llama --length 2000 --methods full,sekv \\
        --budgets 64 --prefill-chunk 256 --repeats 1 --no-warmup

Everything after ``--`` is ``zoomkv bench``'s (``--device cuda`` is added). Needs a CPU-only torch, Triton and a
C++ compiler (the stand-in's device guard).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: the kernels run interpreted

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from tests import cuda_standin  # noqa: E402


def bench_on_standin(monkeypatch, bench_args: list[str], peak_lines: int = 0) -> int:
    """``zoomkv bench`` with ``bench_args`` inside an active stand-in; ``peak_lines`` lines behind each row's peak."""
    from zoomkv import bench
    from zoomkv.cli import main

    cuda_standin.as_gpu(monkeypatch)
    cuda_standin.trace(peak_lines > 0)
    peaks: list[dict[str, int]] = []  # at each timed run's end (bench reads the peak once a run, in row order)
    rows: list[dict] = []

    def max_memory_allocated(device=None) -> int:
        peaks.append(cuda_standin.peak_by_location())
        return cuda_standin.max_memory_allocated(device)

    def run_bench(*args, **kwargs) -> list[dict]:
        rows.extend(run(*args, **kwargs))
        return rows

    run = bench.run_bench
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", max_memory_allocated)
    monkeypatch.setattr(bench, "run_bench", run_bench)
    args = bench_args if "--device" in bench_args else [*bench_args, "--device", "cuda"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["bench", *args])
    text = out.getvalue()
    if rc or not peak_lines:
        print(text, end="")
        return rc
    # the last repeat's runs, one a row that ran (a row out of memory has none; the stand-in's device is large)
    measured = [i for i, row in enumerate(rows) if not row["out_of_memory"]]
    lines = {i: list(peak.items())[:peak_lines] for i, peak in zip(measured, peaks[-len(measured):], strict=True)}
    if "--json" in args:
        report = json.loads(text)
        for i, row in enumerate(report["rows"]):
            row["cuda_peak_lines"] = dict(lines.get(i, []))
        print(json.dumps(report))
        return rc
    print(text)
    print(f"Device memory at each run's peak, by the line that allocated it ({peak_lines} largest, MiB):\n")
    print("| method | budget | prefill chunk | lines |\n|---|---|---|---|")
    for i, row in enumerate(rows):
        cells = "; ".join(f"{size / 2**20:.2f} `{line}`" for line, size in lines.get(i, []))
        print(f"| {row['method']} | {row['budget'] or '-'} | {row['prefill_chunk'] or 'one-shot'} | {cells} |")
    return rc


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peak-lines", type=int, default=0, help="list the N lines behind each row's CUDA peak")
    args = parser.parse_args(argv[:split])
    if not cuda_standin.available():
        print("standin_bench: the CUDA stand-in needs a CPU-only torch and a C++ compiler", file=sys.stderr)
        return 2
    import pytest

    with pytest.MonkeyPatch.context() as monkeypatch, cuda_standin.active(monkeypatch):
        return bench_on_standin(monkeypatch, argv[split + 1:], args.peak_lines)


if __name__ == "__main__":
    sys.exit(main())
