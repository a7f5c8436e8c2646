"""The README's figure: score against the whole memory bill and against decode time, one point per method.

Reads a CSV of measured points (``label,score,device,host,decode``: mean score, device and host tier in % of fp32
full KV, decode time per token as a multiple of ``full``'s, empty where not measured), copied from BENCHMARKS.md
with the tables they come from named in its header, and draws two panels with the eval plots' look
(``zoomkv.eval.styles``: one colour and marker per method, ``full`` the black star):

    python scripts/readme_figure.py docs/figures/heldout-4k.csv --out docs/figures/heldout-4k.png \\
        --title "held-out prose, 4K tokens, B=128, SmolLM2-135M (n=20 a task, 2 tasks)"
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from zoomkv.eval.styles import method_styles  # noqa: E402


def read_points(path: Path) -> list[dict[str, object]]:
    """The CSV's rows (``#`` lines are its header notes): floats, ``decode`` None where empty."""
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line and not line.startswith("#")]
    points = []
    for row in csv.DictReader(lines):
        points.append({"label": row["label"], "score": float(row["score"]), "device": float(row["device"]),
                       "host": float(row["host"]), "decode": float(row["decode"]) if row["decode"] else None})
    return points


def draw(points: list[dict[str, object]], out: Path, title: str) -> Path:
    """Left: score against device + host (% of full KV); right: score against decode × full (measured points)."""
    styles = method_styles([{"method": p["label"]} for p in points])
    fig, (bill, speed) = plt.subplots(1, 2, figsize=(9.6, 3.9), sharey=True)
    for p in points:
        style = dict(styles[p["label"]])
        if p["label"] == "full":
            style.update(markersize=12, markerfacecolor="black")
        total = p["device"] + p["host"]
        bill.plot([total], [p["score"]], linestyle="", label=p["label"], **style)
        if p["decode"] is not None:
            speed.plot([p["decode"]], [p["score"]], linestyle="", **style)
            speed.annotate(f"{p['decode']:.2f}×", (p["decode"], p["score"]), textcoords="offset points",
                           xytext=(4, 4), fontsize=7)
    bill.set_title("score vs memory (up and left is better)", fontsize=9)
    missing = [p["label"] for p in points if p["decode"] is None]
    speed.set_title("score vs decode time" + (f" ({', '.join(missing)}: not benched)" if missing else ""), fontsize=9)
    bill.axvline(100, color="grey", linewidth=0.8, linestyle=":")
    bill.set_xlabel("device + host KV, % of full KV (fp32)")
    bill.set_ylabel("mean score (0–100)")
    bill.set_ylim(-3, 103)
    speed.axvline(1.0, color="grey", linewidth=0.8, linestyle=":")
    speed.set_xlabel("decode time per token, × full (CPU)")
    fig.legend(*bill.get_legend_handles_labels(), fontsize=8, loc="lower center", ncol=4, frameon=False)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("points", type=Path, help="CSV: label,score,device,host,decode")
    parser.add_argument("--out", type=Path, required=True, help="the PNG to write")
    parser.add_argument("--title", default="", help="the figure's title (say the sample size)")
    args = parser.parse_args()
    print(draw(read_points(args.points), args.out, args.title))


if __name__ == "__main__":
    main()
