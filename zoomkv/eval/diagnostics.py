"""What ``zoomkv eval --diagnose`` adds to a run: per method and budget, the share of full attention mass
its selections kept and their overlap with the exact top-B rows — over all, per layer, per KV head and per
answer token (``zoomkv.memory.diagnostics`` measures them; each result row carries its own under
``diagnostics``). The summary gets a table; the plots show where a method loses the mass."""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from zoomkv.eval.summary import budget_order, config_label


def _groups(rows: list[dict[str, Any]]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    out: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        if r.get("diagnostics"):
            out[(config_label(r), r.get("budget") or "")].append(r["diagnostics"])
    return dict(sorted(out.items(), key=lambda kv: (budget_order(kv[0][1]), kv[0][0])))


def per_layer(diags: list[dict[str, Any]], key: str) -> tuple[list[int], list[list[float]]]:
    """The layers, and per layer the mean over rows of each KV head's ``key`` (mass or overlap)."""
    layers = diags[0]["layers"]
    table = [[statistics.fmean(d[key][i][h] for d in diags if d["layers"] == layers)
              for h in range(len(diags[0][key][i]))] for i in range(len(layers))]
    return layers, table


def by_step(diags: list[dict[str, Any]]) -> list[float]:
    """Mean mass kept at each answer token (over the rows that reached it)."""
    longest = max(len(d["mass_by_step"]) for d in diags)
    return [statistics.fmean(d["mass_by_step"][s] for d in diags if len(d["mass_by_step"]) > s)
            for s in range(longest)]


def needle_share(diags: list[dict[str, Any]]) -> float | None:
    """Share of full attention's mass on the needle's tokens that the selections kept, mass-weighted over
    rows, layers, heads and steps (None when no row measured a needle)."""
    full = sum(d.get("needle_full", 0.0) for d in diags)
    return sum(d.get("needle_kept", 0.0) for d in diags) / full if full > 0 else None


def needle_by_step(diags: list[dict[str, Any]]) -> list[float]:
    """Mean over rows of the needle share kept at each answer token (rows with a needle there)."""
    steps = [d["needle_by_step"] for d in diags if d.get("needle_by_step")]
    longest = max((len(s) for s in steps), default=0)
    out = []
    for i in range(longest):
        vals = [s[i] for s in steps if len(s) > i and s[i] is not None]
        out.append(statistics.fmean(vals) if vals else float("nan"))
    return out


def markdown(rows: list[dict[str, Any]]) -> list[str]:
    groups = _groups(rows)
    if not groups:
        return []
    lines = ["", "## Selection diagnostics (share of full attention kept; `--diagnose`)", "",
             "Mass: the share of full attention's mass on the exact rows each step attended (summary rows count for "
             "nothing). Overlap: the share of the exact top-B rows it held. Means over rows, layers, KV heads and steps; "
             "the weakest layer is the one with the least mass. Needle: the share of full attention's mass on the "
             "answer's tokens in the context that was kept (mass-weighted), over all answer tokens, at the first and "
             "at the later ones.", "",
             "| method | budget | rows | mass kept | top-B overlap | first token mass | later tokens mass | weakest layer (mass) "
             "| needle kept | needle, first token | needle, later tokens |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (label, budget), diags in groups.items():
        layers, mass = per_layer(diags, "mass")
        _, overlap = per_layer(diags, "overlap")
        layer_mass = [statistics.fmean(m) for m in mass]
        steps = by_step(diags)
        later = f"{statistics.fmean(steps[1:]):.3f}" if len(steps) > 1 else "–"
        weakest = min(range(len(layers)), key=lambda i: layer_mass[i])
        share = needle_share(diags)
        by = needle_by_step(diags)
        needle = ["–" if share is None else f"{share:.3f}", f"{by[0]:.3f}" if by else "–",
                  f"{statistics.fmean(v for v in by[1:] if v == v):.3f}" if any(v == v for v in by[1:]) else "–"]
        lines.append(f"| {label} | {budget or '–'} | {len(diags)} | {statistics.fmean(layer_mass):.3f} | "
                     f"{statistics.fmean(statistics.fmean(o) for o in overlap):.3f} | {steps[0]:.3f} | {later} | "
                     f"{layers[weakest]} ({layer_mass[weakest]:.3f}) | " + " | ".join(needle) + " |")
    return lines


def _save_shares(plt: Any, fig: Any, axes: Any, titles: tuple[str, str], xlabel: str, legend_ax: Any,
                 path: Path) -> Path:
    """Two panels of shares in [0, 1]: titles, axes, the legend on ``legend_ax``, saved to ``path``."""
    for ax, title in zip(axes, titles, strict=True):
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    legend_ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot(rows: list[dict[str, Any]], out: Path, methods: list[str] | None = None) -> list[Path]:
    """``diagnostics_layers.png`` (mass and overlap per layer, a line per method and budget),
    ``diagnostics_steps.png`` (mass per answer token) and ``diagnostics_heads.png`` (layer × KV head mass,
    one panel per method and budget). A method has the colour and marker it has in the run's other plots;
    its budgets differ by line style."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from zoomkv.eval.styles import LINESTYLES, method_styles

    groups = _groups(rows)
    if not groups:
        return []
    styles = method_styles(rows, methods)
    budgets_of: dict[str, list[str]] = defaultdict(list)
    for label, budget in groups:
        budgets_of[label].append(budget)

    def look(label: str, budget: str) -> dict[str, Any]:
        which = budgets_of[label].index(budget) % len(LINESTYLES)
        return {**styles.get(label, {}), "markersize": 5, "linestyle": LINESTYLES[which]}

    paths = []
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharex=True)
    for (label, budget), diags in groups.items():
        for ax, key in zip(axes, ("mass", "overlap"), strict=True):
            layers, table = per_layer(diags, key)
            ax.plot(layers, [statistics.fmean(t) for t in table], label=f"{label} @ {budget or '–'}",
                    **look(label, budget))
    paths.append(_save_shares(plt, fig, axes, ("share of full attention mass kept, per layer",
                                                "overlap with exact top-B rows, per layer"),
                              "layer", axes[1], out / "diagnostics_layers.png"))

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharex=True)
    for (label, budget), diags in groups.items():
        steps = by_step(diags)
        axes[0].plot(range(1, len(steps) + 1), steps, label=f"{label} @ {budget or '–'}", **look(label, budget))
        needle = needle_by_step(diags)
        if needle:
            axes[1].plot(range(1, len(needle) + 1), needle, label=f"{label} @ {budget or '–'}",
                         **look(label, budget))
    paths.append(_save_shares(plt, fig, axes, ("mass kept per answer token (mean over layers and heads)",
                                                "needle's attention mass kept per answer token"),
                              "answer token", axes[0], out / "diagnostics_steps.png"))

    n = len(groups)
    fig, axes = plt.subplots(1, n, figsize=(2.2 * n + 1, 6), squeeze=False)
    for ax, ((label, budget), diags) in zip(axes[0], groups.items(), strict=True):
        layers, table = per_layer(diags, "mass")
        image = ax.imshow(table, aspect="auto", vmin=0, vmax=1, cmap="viridis", origin="lower")
        ax.set_title(f"{label}\n@ {budget or '–'}", fontsize=8)
        ax.set_xlabel("KV head")
        ax.set_yticks(range(0, len(layers), max(1, len(layers) // 10)),
                      [layers[i] for i in range(0, len(layers), max(1, len(layers) // 10))])
    axes[0][0].set_ylabel("layer")
    fig.colorbar(image, ax=axes[0].tolist(), shrink=0.8, label="mass kept")
    paths.append(out / "diagnostics_heads.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths
