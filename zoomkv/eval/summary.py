"""Aggregates rows into one line per method × budget, and writes them as ``summary.json`` and a Markdown
table: score per task, device/host bytes as a share of full KV, decode time against ``full`` on the
same prompts of the same run."""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from zoomkv.eval.rows import GRID_TASK


def config_label(row: dict[str, Any]) -> str:
    args = row.get("method_args") or ""
    return row["method"] + (f"({args})" if args else "")


def budget_order(budget: str | None) -> tuple[int, float]:
    if not budget:
        return (0, 0.0)
    value = float(budget)
    return (1, value) if value <= 1 else (2, value)  # fractions, then row counts


def config_order(rows: list[dict[str, Any]], methods: list[str] | None = None) -> list[tuple[str, str]]:
    """(label, budget) pairs: full first, then methods in the order asked, budgets ascending."""
    pairs = {(config_label(r), r.get("budget") or "", r["method"]) for r in rows}
    rank = {m: i for i, m in enumerate(methods or [])}
    ordered = sorted(pairs, key=lambda p: (p[2] != "full", rank.get(p[2], len(rank)), p[0], budget_order(p[1])))
    return [(label, budget) for label, budget, _ in ordered]


def task_order(rows: list[dict[str, Any]]) -> list[str]:
    return list(dict.fromkeys(r["task"] for r in rows))


def wilson(p: float, n: int, z: float = 1.959964) -> tuple[float, float]:
    """95% Wilson score interval of a proportion ``p`` observed over ``n`` samples (exact binomial coverage
    is close to 95% even at small n and p near 0 or 1, unlike p ± 1.96·sqrt(p(1-p)/n)). A task whose scores
    are partial (several answers) gets the interval of its mean treated as a proportion."""
    if n <= 0:
        return (0.0, 1.0)
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (max(0.0, centre - half), min(1.0, centre + half))


def _sample_key(row: dict[str, Any]) -> tuple[Any, ...]:
    return (row["task"], row["length"], row.get("depth") if row["task"] == GRID_TASK else None, row["sample"])


def config_groups(rows: list[dict[str, Any]]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """The rows of each configuration and budget: ``{(config_label, budget or ""): rows}``, in row order."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[(config_label(r), r.get("budget") or "")].append(r)
    return groups


def aggregate(rows: list[dict[str, Any]], methods: list[str] | None = None) -> list[dict[str, Any]]:
    full_decode = {_sample_key(r): r["decode_ms_per_token"] for r in rows if r["method"] == "full"}
    groups = config_groups(rows)
    tasks = task_order(rows)
    out = []
    for label, budget in config_order(rows, methods):
        rs = groups[(label, budget)]
        per_task = {t: statistics.fmean(r["score"] for r in rs if r["task"] == t)
                    for t in tasks if any(r["task"] == t for r in rs)}
        counts = {t: sum(1 for r in rs if r["task"] == t) for t in per_task}
        intervals = {t: [100 * x for x in wilson(per_task[t] / 100, counts[t])] for t in per_task}
        lengths = sorted({r["length"] for r in rs})
        per_length = {n: statistics.fmean(r["score"] for r in rs if r["length"] == n) for n in lengths}
        # decode ratio: summed over the prompts this config shares with full, so both see the same prompts
        paired = [(r["decode_ms_per_token"], full_decode[_sample_key(r)]) for r in rs
                  if _sample_key(r) in full_decode and r["decode_ms_per_token"] > 0]
        full_sum = sum(f for _, f in paired)
        out.append({
            "config": label, "method": rs[0]["method"], "method_args": rs[0].get("method_args") or "",
            "budget": budget or None, "rows": len(rs),
            "score": per_task, "score_by_length": per_length, "samples": counts, "interval95": intervals,
            "avg": statistics.fmean(per_task.values()),
            "device_mib": statistics.fmean(r["device_bytes"] for r in rs) / 2**20,
            "device_ratio": statistics.fmean(r["device_bytes"] / max(r["full_kv_bytes"], 1) for r in rs),
            "host_ratio": statistics.fmean(r["host_bytes"] / max(r["full_kv_bytes"], 1) for r in rs),
            "decode_ms_per_token": statistics.fmean(r["decode_ms_per_token"] for r in rs),
            "decode_ratio": sum(m for m, _ in paired) / full_sum if full_sum else None,
            "prefill_s": statistics.fmean(r["prefill_s"] for r in rs),
        })
    return out


def _fmt(value: float | None, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def markdown(summary: list[dict[str, Any]], rows: list[dict[str, Any]], header: dict[str, Any]) -> str:
    tasks = task_order(rows)
    lines = [f"# zoomkv eval: {header.get('model', '')}", ""]
    for key in ("command", "protocol", "prefill_chunk", "chat", "seed", "samples", "lengths", "batch_size",
                "processes"):
        if header.get(key) not in (None, ""):
            lines.append(f"- {key}: `{header[key]}`")
    hay = sorted({r["haystack"] for r in rows if r.get("haystack") and r["haystack"] != "data"})
    if hay:
        lines.append(f"- haystacks: {'; '.join(hay)}")
    lines += ["", "Scores are 0–100, averaged over samples (and lengths). Bytes are per sequence, at the end of "
              "decoding, as a share of what full KV holds for the same tokens; decode × full compares ms/token "
              "with `full` on the same prompts in this run.", ""]
    cols = ["method", "budget", *tasks, "avg", "device / full", "host / full", "decode ms/tok", "decode × full"]
    lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for s in summary:
        cells = [s["config"], s["budget"] or "–", *(_fmt(s["score"].get(t), ".1f") for t in tasks),
                 _fmt(s["avg"], ".1f"), _fmt(s["device_ratio"], ".1%"), _fmt(s["host_ratio"], ".1%"),
                 _fmt(s["decode_ms_per_token"], ".1f"), _fmt(s["decode_ratio"], ".2f")]
        lines.append("| " + " | ".join(cells) + " |")
    if len({tuple(sorted(s["samples"].items())) for s in summary}) > 1:  # a folder resumed or merged unevenly
        lines += ["", "Rows differ in which tasks or how many samples they hold (n in the interval table below): "
                  "their avg, bytes and speed are over different prompts, not a like-for-like comparison."]
    lines += ["", "## 95% intervals (Wilson, per task cell: score [low–high], samples)", "",
              "| method | budget | " + " | ".join(tasks) + " |", "|" + "---|" * (len(tasks) + 2)]
    for s in summary:
        cells = []
        for t in tasks:
            if t in s["score"]:
                lo, hi = s["interval95"][t]
                cells.append(f"{s['score'][t]:.0f} [{lo:.0f}–{hi:.0f}] n={s['samples'][t]}")
            else:
                cells.append("–")
        lines.append(f"| {s['config']} | {s['budget'] or '–'} | " + " | ".join(cells) + " |")
    lengths = sorted({r["length"] for r in rows})
    if len(lengths) > 1:
        lines += ["", "## Score by length (all tasks)", "", "| method | budget | " + " | ".join(map(str, lengths)) + " |",
                  "|" + "---|" * (len(lengths) + 2)]
        for s in summary:
            vals = [_fmt(s["score_by_length"].get(n), ".1f") for n in lengths]
            lines.append(f"| {s['config']} | {s['budget'] or '–'} | " + " | ".join(vals) + " |")
    prefill = [r["prefill_s"] for r in rows if r["method"] == "full"]
    if prefill:
        lines += ["", f"Prefill (shared by every method of a prompt batch): mean {statistics.fmean(prefill):.2f} s."]
    return "\n".join(lines) + "\n"


def write_summary(rows: list[dict[str, Any]], out: str | Path, header: dict[str, Any],
                  methods: list[str] | None = None) -> list[dict[str, Any]]:
    out = Path(out)
    summary = aggregate(rows, methods)
    (out / "summary.json").write_text(json.dumps({"run": header, "summary": summary}, indent=1) + "\n",
                                      encoding="utf-8")
    (out / "summary.md").write_text(markdown(summary, rows, header), encoding="utf-8")
    return summary
