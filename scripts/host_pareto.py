"""Score against the whole memory bill (device + host tier, % of full KV) over several `zoomkv eval` runs.

Each run folder's ``rows.jsonl`` is read (``full``, the reference every run repeats, is taken from the first run
only); one plot (``eval.plots.pareto_memory``) and one Markdown table (``eval.summary``) of every configuration
are written to ``--out``. ``--points CSV`` adds configurations measured in earlier runs on the same prompts
(``label,score,device,host``: mean score, device and host tier in % of full KV), drawn as the same kind of
point; the CSV names the BENCHMARKS table they come from. Over the runs of BENCHMARKS.md, "Host formats on the
held-out prompts":

    python scripts/host_pareto.py runs/heldout-b128-hostformats runs/heldout-b128-int4-trained \\
        runs/heldout-b128-k8v4-host runs/heldout-b128-kivi4g64-host --points docs/host-tier/earlier.csv --out runs/host-pareto
"""

from __future__ import annotations

import argparse
import csv
import json
import re
from collections import Counter
from pathlib import Path

from zoomkv.eval.plots import pareto_memory
from zoomkv.eval.summary import aggregate, config_label, markdown


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="zoomkv eval --out folders")
    parser.add_argument("--out", type=Path, required=True, help="folder for host_pareto.png and host_pareto.md")
    parser.add_argument("--min-samples", type=int, default=20, help="plot configurations with this many samples a task")
    parser.add_argument("--points", type=Path, help="CSV of earlier runs' points: label,score,device,host (%% of full)")
    args = parser.parse_args()
    rows, seen = [], set()
    for run in args.runs:
        run_rows = [json.loads(line) for line in (run / "rows.jsonl").read_text().splitlines() if line.strip()]
        labels = {config_label(r) for r in run_rows}
        rows += [r for r in run_rows if config_label(r) not in seen]
        seen |= labels
    tasks = {r["task"] for r in rows}
    counts = Counter((config_label(r), r["task"]) for r in rows)
    # the plot shows what may be claimed: configurations with every task at --min-samples; the table all
    # "sekv:NAME@1a2b3c4d+kivi4" → "sekv:NAME+kivi4" in the legend (the table keeps the checksums)
    plotted = [dict(r, method=re.sub(r"@[0-9a-f]{8}", "", r["method"])) for r in rows
               if all(counts[(config_label(r), t)] >= args.min_samples for t in tasks)]
    args.out.mkdir(parents=True, exist_ok=True)
    table = markdown(aggregate(rows), rows, {"command": "python scripts/host_pareto.py " + " ".join(map(str, args.runs))})
    if args.points:  # one pseudo-row a point: the plot averages rows, and one row is its own mean
        for line in csv.DictReader(x for x in args.points.read_text().splitlines() if not x.startswith("#")):
            if line["label"] in seen:
                continue
            plotted.append({"method": line["label"], "budget": "128", "score": float(line["score"]),
                            "device_bytes": float(line["device"]), "host_bytes": float(line["host"]),
                            "full_kv_bytes": 100.0})
    pareto_memory(plotted, args.out, name="host_pareto.png")
    (args.out / "host_pareto.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
