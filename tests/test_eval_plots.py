"""The plots of one run agree on each method's look, keep coincident points visible and use no pale colours."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib
import pytest

matplotlib.use("Agg")
import matplotlib.image  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402

from zoomkv.eval import plots  # noqa: E402
from zoomkv.eval.styles import PALETTE, contrast_on_white, method_styles  # noqa: E402

METHODS = ["full", "oracle_topk", "quest", "snapkv", "streamingllm", "h2o", "pyramidkv", "clusterkv", "infinigen",
           "compresskv", "sentencekv", "semanticache", "sekv", "quest+tail", "semantic_id", "semantic_id+tail"]


def _rows(methods: list[str], tasks: tuple[str, ...] = ("niah_single_1", "vt")) -> list[dict[str, Any]]:
    rows = []
    for m, method in enumerate(methods):
        for budget in ([None] if method == "full" else ["64", "128"]):
            for t, task in enumerate(tasks):
                # snapkv and quest score 0 with the same bytes: one point on top of the other
                zero = method in ("snapkv", "quest")
                rows.append({"method": method, "method_args": "", "budget": budget, "task": task, "length": 512,
                             "depth": None, "sample": 0, "score": 0.0 if zero else float((m * 7 + t * 3) % 100),
                             "device_bytes": (1 if budget is None else int(budget)) * (2**14 if zero else 2**13 + m),
                             "full_kv_bytes": 2**20, "host_bytes": 0, "decode_ms_per_token": 1.0, "prefill_s": 0.1})
    return rows


def _record(monkeypatch) -> list[tuple[str, str, str]]:
    """What every Axes.plot draws: (label, colour, marker)."""
    drawn: list[tuple[str, str, str]] = []
    original = Axes.plot

    def plot(self, *args, **kwargs):
        lines = original(self, *args, **kwargs)
        for line in lines:
            drawn.append((line.get_label(), matplotlib.colors.to_hex(line.get_color()), line.get_marker()))
        return lines

    monkeypatch.setattr(Axes, "plot", plot)
    return drawn


def test_a_method_looks_the_same_in_every_plot_of_a_run(tmp_path, monkeypatch):
    drawn = _record(monkeypatch)
    rows = _rows(METHODS)
    paths = plots.write_plots(rows, tmp_path, METHODS)
    assert {p.name for p in paths} >= {"pareto.png", "pareto_memory.png", "score_vs_budget_niah_single_1.png", "score_vs_budget_vt.png",
                                       "score_vs_budget_all.png"}
    looks: dict[str, set[tuple[str, str]]] = {}
    for label, colour, marker in drawn:
        looks.setdefault(label, set()).add((colour, marker))
    budgeted = [m for m in METHODS if m != "full"]
    assert set(budgeted) <= set(looks)
    for label in budgeted:
        assert len(looks[label]) == 1, (label, looks[label])  # one colour and marker in pareto and every score plot
    # ...and no two methods share both
    assert len({next(iter(looks[m])) for m in budgeted}) == len(budgeted)


def test_no_pale_colours_on_white():
    assert min(contrast_on_white(c) for c in PALETTE) >= 3.0
    styles = method_styles(_rows(METHODS))
    assert styles["full"]["color"] == "black"
    assert all(s["color"] in PALETTE for label, s in styles.items() if label != "full")


def _pixels_near(image: Any, colour: str, tolerance: float = 0.12) -> int:
    rgb = matplotlib.colors.to_rgb(colour)
    diff = abs(image[..., :3] - rgb).max(axis=-1)
    return int((diff < tolerance).sum())


@pytest.mark.parametrize("which", ["pareto", "score_vs_budget"])
def test_points_at_the_same_place_stay_visible(tmp_path, monkeypatch, which):
    """quest and snapkv at score 0 with the same bytes: both methods' colours are in the plot (hollow markers
    of different shapes), not only the one drawn last. The legend, which shows every colour anyway, is left out."""
    monkeypatch.setattr(plots, "_legend", lambda ax, n: None)
    rows = _rows(["full", "quest", "snapkv"], tasks=("niah_single_1",))
    styles = method_styles(rows)
    path: Path = (plots.pareto(rows, tmp_path, styles) if which == "pareto"
                  else plots.score_vs_budget(rows, tmp_path, "niah_single_1", styles))
    image = matplotlib.image.imread(path)
    for method in ("quest", "snapkv"):
        assert _pixels_near(image, styles[method]["color"]) > 10, method
