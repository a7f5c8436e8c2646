"""One colour and marker per method label for every plot of a run, so ``pareto.png``, each
``score_vs_budget_*.png`` and the diagnostics plots agree, and the methods of a wide table stay apart.

The colours are saturated enough to read on white (each at least 3:1 contrast against it, the WCAG ratio for
graphics); markers are drawn hollow and a little larger for later labels sharing a shape, so two methods at
the same point (two methods at score 0 and the same bytes) both stay visible. ``full`` is the reference:
black, everywhere.
"""

from __future__ import annotations

from typing import Any

from zoomkv.eval.summary import config_order

# Distinct hues, every one dark enough for white paper (``contrast_on_white`` ≥ 3 is tested). 14 colours and
# 11 markers: their pairs repeat only after 154 labels.
PALETTE = (
    "#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#d95f02", "#8c564b", "#c51b7d",
    "#00838f", "#808000", "#1b9e77", "#7570b3", "#e7298a", "#a6761d", "#000080",
)
MARKERS = "osD^v<>pXhP"
REFERENCE = {"color": "black", "marker": "*"}
LINESTYLES = ("-", "--", ":", "-.")


def contrast_on_white(color: str) -> float:
    """WCAG contrast ratio of an ``#rrggbb`` colour against white (1 to 21)."""
    def linear(c: float) -> float:
        return c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4

    r, g, b = (linear(int(color[i:i + 2], 16) / 255) for i in (1, 3, 5))
    luminance = 0.2126 * r + 0.7152 * g + 0.0722 * b
    return 1.05 / (luminance + 0.05)


def style(index: int) -> dict[str, Any]:
    """Label ``index``'s look: its colour, its hollow marker, and a marker size that grows each time the
    markers come round again, so labels sharing a shape at one point still show both outlines."""
    size = 6 + 3 * ((index // len(MARKERS)) % 3)
    return {"color": PALETTE[index % len(PALETTE)], "marker": MARKERS[index % len(MARKERS)],
            "markerfacecolor": "none", "markeredgewidth": 1.4, "markersize": size}


def method_styles(rows: list[dict[str, Any]], methods: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """Every config label of ``rows`` (a method with its arguments) → its plot style, in the summary's order
    (full first, then the methods as asked), so one run's plots all give a method the same look."""
    labels = list(dict.fromkeys(label for label, _ in config_order(rows, methods)))
    styles: dict[str, dict[str, Any]] = {}
    index = 0
    for label in labels:
        if label == "full":
            styles[label] = dict(REFERENCE)
            continue
        styles[label] = style(index)
        index += 1
    return styles
