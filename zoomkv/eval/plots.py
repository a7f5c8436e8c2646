"""PNG plots of an evaluation: score vs budget per task, score vs device-tier bytes (the Pareto view),
and a NIAH length × depth heatmap per method."""

from __future__ import annotations

import re
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display on servers and CI
import matplotlib.pyplot as plt  # noqa: E402

from zoomkv.eval.rows import GRID_TASK  # noqa: E402
from zoomkv.eval.styles import method_styles  # noqa: E402
from zoomkv.eval.summary import budget_order, config_groups, config_label, task_order  # noqa: E402


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "x"


def _legend(ax: Any, n: int) -> None:
    """Inside the axes for a few lines; to the right of them for many, where it would hide points."""
    if n <= 8:
        ax.legend(fontsize=8)
    else:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)


def _mean_scores(rows: list[dict[str, Any]]) -> dict[tuple[str, str], float]:
    acc: dict[tuple[str, str], list[float]] = defaultdict(list)
    for r in rows:
        acc[(config_label(r), r.get("budget") or "")].append(r["score"])
    return {k: statistics.fmean(v) for k, v in acc.items()}


def score_vs_budget(rows: list[dict[str, Any]], out: Path, task: str | None,
                    styles: dict[str, dict[str, Any]] | None = None) -> Path:
    """Budgets on an evenly spaced categorical axis (they mix row counts and fractions); methods without a
    budget (full, the reference) as horizontal lines."""
    styles = styles or method_styles(rows)
    subset = [r for r in rows if task is None or r["task"] == task]
    means = _mean_scores(subset)
    budgets = sorted({b for (_, b) in means if b}, key=budget_order)
    labels = [lbl for lbl in styles if any((lbl, b) in means for b in budgets)]
    fig, ax = plt.subplots(figsize=(6.4 if len(labels) <= 8 else 9.0, 4.2))
    for label in labels:
        xs = [j for j, b in enumerate(budgets) if (label, b) in means]
        ax.plot(xs, [means[(label, budgets[j])] for j in xs], label=label, **styles[label])
    for label in styles:
        if (label, "") in means:
            ax.axhline(means[(label, "")], color=styles[label]["color"], linestyle="--", linewidth=1,
                       label=f"{label} (reference)" if label == "full" else label)
    ax.set_xticks(range(len(budgets)), budgets)
    ax.set_xlabel("budget (device rows per layer per KV head, or share of the prompt)")
    ax.set_ylabel("score (0–100)")
    ax.set_ylim(-3, 103)
    ax.set_title(f"score vs budget: {task or 'all tasks'}")
    _legend(ax, len(labels) + 1)
    fig.tight_layout()
    path = out / f"score_vs_budget_{_safe(task or 'all')}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def pareto(rows: list[dict[str, Any]], out: Path, styles: dict[str, dict[str, Any]] | None = None) -> Path:
    """Mean score over all rows against mean device-tier MiB per sequence; one line per method."""
    styles = styles or method_styles(rows)
    points: dict[str, list[tuple[float, float, str]]] = defaultdict(list)
    groups = config_groups(rows)
    for (label, budget), rs in groups.items():
        mib = statistics.fmean(r["device_bytes"] for r in rs) / 2**20
        points[label].append((mib, statistics.fmean(r["score"] for r in rs), budget))
    fig, ax = plt.subplots(figsize=(6.4 if len(points) <= 8 else 9.0, 4.2))
    for label in [lbl for lbl in styles if lbl in points]:
        pts = sorted(points[label])
        style = dict(styles[label])
        if label == "full":
            style.update(markersize=12, markerfacecolor="black")
        ax.plot([p[0] for p in pts], [p[1] for p in pts], linestyle="" if len(pts) == 1 else "-", label=label,
                **style)
        for x, y, b in pts:
            if b:
                ax.annotate(b, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    xs = [p[0] for pts in points.values() for p in pts if p[0] > 0]
    if xs and max(xs) > 10 * min(xs):  # compressed methods at a few % of full: a linear axis squeezes them
        ax.set_xscale("log")
    ax.set_xlabel("device-tier KV per sequence (MiB)")
    ax.set_ylabel("mean score (0–100)")
    ax.set_ylim(-3, 103)
    ax.set_title("score vs device memory (up and left is better)")
    _legend(ax, len(points))
    fig.tight_layout()
    path = out / "pareto.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def pareto_memory(rows: list[dict[str, Any]], out: Path, styles: dict[str, dict[str, Any]] | None = None,
                  name: str = "pareto_memory.png") -> Path:
    """Mean score against the whole bill: device plus host tier as a share of full KV, one point per
    configuration and budget, so a method that holds little on the device but more than full KV on the host
    shows where it really stands."""
    styles = styles or method_styles(rows)
    groups = config_groups(rows)
    fig, ax = plt.subplots(figsize=(7.4 if len(groups) <= 8 else 10.0, 4.6))
    for label in [lbl for lbl in styles if any(key[0] == lbl for key in groups)]:
        points = [rs for (lbl, _), rs in groups.items() if lbl == label]
        for i, rs in enumerate(points):
            total = 100 * statistics.fmean((r["device_bytes"] + r["host_bytes"]) / max(r["full_kv_bytes"], 1)
                                           for r in rs)
            tasks = {r.get("task") for r in rs}  # each task weighs the same, as in the summary's avg
            score = statistics.fmean(statistics.fmean(r["score"] for r in rs if r.get("task") == t) for t in tasks)
            ax.plot([total], [score], linestyle="", label=label if i == 0 else None, **styles[label])
            ax.annotate(f"{total:.0f}%", (total, score), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.axvline(100, color="grey", linewidth=0.8, linestyle=":")
    ax.set_xlabel("device + host KV, % of full KV (fp32)")
    ax.set_ylabel("mean score (0–100)")
    ax.set_ylim(-3, 103)
    ax.set_title("score vs total memory (up and left is better)")
    _legend(ax, len({k[0] for k in groups}))
    fig.tight_layout()
    path = out / name
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def niah_heatmaps(rows: list[dict[str, Any]], out: Path) -> list[Path]:
    """One PNG per method: a panel per budget, depth down, context length across, mean score in colour."""
    grid = [r for r in rows if r["task"] == GRID_TASK]
    by_method: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in grid:
        by_method[config_label(r)].append(r)
    paths = []
    for label, rs in by_method.items():
        budgets = sorted({r.get("budget") or "" for r in rs}, key=budget_order)
        lengths = sorted({r["length"] for r in rs})
        depths = sorted({round(float(r["depth"]), 4) for r in rs})
        size = (1.5 + (0.6 + 0.8 * len(lengths)) * len(budgets), 1.6 + 0.4 * len(depths))
        fig, axes = plt.subplots(1, len(budgets), figsize=size, squeeze=False, layout="constrained")
        for ax, budget in zip(axes[0], budgets, strict=True):
            cells: dict[tuple[float, int], list[float]] = defaultdict(list)
            for r in rs:
                if (r.get("budget") or "") == budget:
                    cells[(round(float(r["depth"]), 4), r["length"])].append(r["score"])
            matrix = [[statistics.fmean(cells[(d, n)]) if cells.get((d, n)) else float("nan") for n in lengths]
                      for d in depths]
            image = ax.imshow(matrix, cmap="RdYlGn", vmin=0, vmax=100, aspect="auto")
            ax.set_xticks(range(len(lengths)), [str(n) for n in lengths], fontsize=7)
            ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths], fontsize=7)
            for i, row in enumerate(matrix):
                for j, v in enumerate(row):
                    if v == v:  # not NaN
                        ax.text(j, i, f"{v:.0f}", ha="center", va="center", fontsize=7)
            ax.set_title(f"budget {budget}" if budget else "full KV", fontsize=9)
            ax.set_xlabel("context length", fontsize=8)
        axes[0][0].set_ylabel("needle depth", fontsize=8)
        fig.colorbar(image, ax=list(axes[0]), shrink=0.8)
        fig.suptitle(f"NIAH: {label}", fontsize=10)
        path = out / f"niah_heatmap_{_safe(label)}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def write_plots(rows: list[dict[str, Any]], out: str | Path, methods: list[str] | None = None) -> list[Path]:
    """Every plot of a run, each method in the same colour and marker in all of them."""
    out = Path(out)
    if not rows:
        return []
    styles = method_styles(rows, methods)
    tasks = task_order(rows)
    paths = [score_vs_budget(rows, out, t, styles) for t in tasks]
    if len(tasks) > 1:
        paths.append(score_vs_budget(rows, out, None, styles))
    paths.append(pareto(rows, out, styles))
    paths.append(pareto_memory(rows, out, styles))
    paths += niah_heatmaps(rows, out)
    return paths
