"""Everything an evaluation writes at the end: rows as JSON and CSV, the summary, the plots."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zoomkv.eval import diagnostics
from zoomkv.eval.rows import write_tables
from zoomkv.eval.summary import write_summary


def write_outputs(rows: list[dict[str, Any]], out: str | Path, header: dict[str, Any],
                  methods: list[str] | None = None, *, plots: bool = True) -> list[Path]:
    """Write rows.json, rows.csv, summary.json, summary.md and (with ``plots``) the PNGs; return the paths."""
    out = Path(out)
    write_tables(rows, out)
    write_summary(rows, out, header, methods)
    diagnosed = diagnostics.markdown(rows)
    if diagnosed:
        with open(out / "summary.md", "a", encoding="utf-8") as fh:
            fh.write("\n".join(diagnosed) + "\n")
    paths = [out / name for name in ("rows.jsonl", "rows.json", "rows.csv", "summary.json", "summary.md")]
    if plots and rows:
        from zoomkv.eval.plots import write_plots  # matplotlib only when drawing

        paths += write_plots(rows, out, methods)
        paths += diagnostics.plot(rows, out, methods)
    return paths
