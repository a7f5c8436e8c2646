"""Result rows: appended to ``rows.jsonl`` as each prompt finishes (flushed and synced), so an interrupted
run resumes where it stopped, and exported as JSON and CSV at the end.

``run.json`` records what makes rows comparable (model, chat template, seed, ...). Resuming into a
folder whose rows came from a different setting is refused rather than silently mixed.
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import Any

from zoomkv.errors import ZoomKVError

# CSV column order; rows.jsonl holds the same fields.
FIELDS = (
    "method", "method_args", "budget", "budget_rows", "task", "length", "depth", "sample", "score", "metric",
    "device_bytes", "host_bytes", "full_kv_bytes", "prefill_s", "decode_ms_per_token", "prompt_tokens",
    "new_tokens", "batch_size", "haystack", "chat", "protocol", "model", "prediction", "answers",
)

GRID_TASK = "niah_grid"
OUTPUT_PATTERNS = ("rows.jsonl", "rows.json", "rows.csv", "summary.json", "summary.md", "score_vs_budget_*.png",
                   "pareto.png", "niah_heatmap_*.png", "diagnostics_*.png")


def row_key(row: dict[str, Any]) -> tuple[Any, ...]:
    """What identifies a row within one run. Depth is part of it only on the grid, where it is a
    coordinate; elsewhere it is a property of the sample."""
    depth = row.get("depth") if row["task"] == GRID_TASK else None
    return (row["task"], int(row["length"]), None if depth is None else round(float(depth), 4), int(row["sample"]),
            row["method"], row.get("method_args") or "", row.get("budget") or "")


def check_output_folder(out: str | Path, *, create: bool = False) -> Path:
    """``--out``: a folder that is there or can be made (a file in the way, a read-only place: one
    ``ZoomKVError`` naming it). Without ``create`` nothing is left behind: a probe folder is made and removed
    where the first missing folder would go."""
    out = Path(out).expanduser()
    if out.exists() and not out.is_dir():
        raise ZoomKVError(f"--out {out} is a file, not a folder")
    base = out
    while not base.exists() and base.parent != base:
        base = base.parent
    if not base.is_dir():
        raise ZoomKVError(f"--out {out}: {base} is a file, not a folder")
    try:
        if create:
            out.mkdir(parents=True, exist_ok=True)
        else:
            import tempfile

            os.rmdir(tempfile.mkdtemp(prefix=".zoomkv-probe-", dir=base))
    except OSError as err:
        raise ZoomKVError(f"--out {out}: cannot write there ({err.strerror or err})") from None
    return out


class RowStore:
    def __init__(self, out: str | Path, identity: dict[str, Any], *, overwrite: bool = False):
        self.out = check_output_folder(out, create=True)
        self.path = self.out / "rows.jsonl"
        run_file = self.out / "run.json"
        if overwrite:  # everything an earlier run wrote here, so no stale plot outlives its rows
            for pattern in OUTPUT_PATTERNS:
                for stale in self.out.glob(pattern):
                    stale.unlink(missing_ok=True)
        elif run_file.is_file() and self.path.is_file():
            self._check_identity(run_file, identity)
        run_file.write_text(json.dumps(identity, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        self.rows: list[dict[str, Any]] = self._load()
        self.done = {row_key(r) for r in self.rows}

    def _check_identity(self, run_file: Path, identity: dict[str, Any]) -> None:
        try:
            old = json.loads(run_file.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return
        if isinstance(old, dict):
            old.setdefault("protocol", "query-aware")  # rows written before protocols existed put the question in
        diff = [k for k in identity if k in old and old[k] != identity[k]]
        if diff:
            what = "; ".join(f"{k}: {old[k]!r} there, {identity[k]!r} now" for k in diff)
            raise ZoomKVError(f"{self.out} holds rows of a different run ({what}); use another --out, or "
                              "--overwrite to start afresh")

    def _load(self) -> list[dict[str, Any]]:
        if not self.path.is_file():
            return []
        lines = self.path.read_text(encoding="utf-8").split("\n")
        rows, good = [], []
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
                good.append(line)
            except json.JSONDecodeError:
                if number >= len(lines) - 1:  # the last line, cut off by an interruption: redo that row
                    self.path.write_text("".join(g + "\n" for g in good), encoding="utf-8")
                    break
                raise ZoomKVError(f"{self.path}:{number}: bad JSON; fix or delete the line to resume") from None
        # One row per key, the first: rows of several runs put together (--report-only) share their `full` rows.
        unique: dict[tuple[Any, ...], dict[str, Any]] = {}
        for r in rows:
            unique.setdefault(row_key(r), r)
        return list(unique.values())

    def has(self, key: tuple[Any, ...]) -> bool:
        return key in self.done

    def append(self, rows: list[dict[str, Any]]) -> None:
        fresh = [r for r in rows if row_key(r) not in self.done]
        if not fresh:
            return
        with open(self.path, "a", encoding="utf-8") as fh:
            for r in fresh:
                fh.write(json.dumps(r, ensure_ascii=False) + "\n")
            fh.flush()
            os.fsync(fh.fileno())  # the row is done only once it is on disk
        self.rows += fresh
        self.done.update(row_key(r) for r in fresh)


def write_tables(rows: list[dict[str, Any]], out: str | Path) -> None:
    out = Path(out)
    (out / "rows.json").write_text(json.dumps(rows, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    with open(out / "rows.csv", "w", encoding="utf-8", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(FIELDS), extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            writer.writerow({k: json.dumps(v, ensure_ascii=False) if isinstance(v, list | dict) else v
                             for k, v in r.items()})
