"""The scores a model card shows: read from what ``zoomkv eval`` wrote (or any JSON of metrics), rounded for
reading, and as the Hub's ``model-index`` results.

``load_scores`` gives ``{"summary": [row, ...], "rows": [row, ...], "models": [name, ...]}``: summary rows with
nested fields flattened (``score.niah_single_1``), the per-sample rows, and the base models the scores were
measured on (``zoomkv export`` refuses scores of another base model).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from huggingface_hub import EvalResult

from zoomkv.adapters.errors import AdapterError

MAX_TABLE_ROWS = 50  # a card is for reading; every row stays in the evaluation's own files
_COUNTS = {"n", "rows", "samples"}  # numbers that count, not score


def load_scores(path: str | Path) -> dict[str, Any]:
    """Read what ``zoomkv eval`` wrote: its ``summary.json`` (``{"run": ..., "summary": [...]}``), its
    ``rows.json`` (a list of rows), a flat dict of metrics, or its whole ``--out`` folder (both files)."""
    path = Path(path)
    if path.is_dir():
        parts = [normalise_scores(_read_json(path / n)) for n in ("summary.json", "rows.json") if (path / n).is_file()]
        if not parts:
            raise AdapterError(f"{path}: no summary.json or rows.json (the output folder of `zoomkv eval`)")
        return {key: [r for p in parts for r in p[key]] for key in ("summary", "rows", "models")}
    return normalise_scores(_read_json(path))


def _read_json(path: Path) -> Any:
    if not path.is_file():
        raise AdapterError(f"scores file not found: {path}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise AdapterError(f"{path}: not valid JSON ({err})") from err


def _flatten(row: dict[str, Any]) -> dict[str, Any]:
    # The eval's summary nests per-task scores ({"score": {"niah": 0.9}}): one column per task reads better.
    out: dict[str, Any] = {}
    for k, v in row.items():
        if isinstance(v, dict):
            out.update({f"{k}.{sub}": x for sub, x in v.items()})
        else:
            out[k] = v
    return out


def normalise_scores(data: Any) -> dict[str, Any]:
    """→ ``{"summary": [row, ...], "rows": [row, ...], "models": [...]}`` whatever shape the eval wrote."""
    def as_rows(x: Any) -> list[dict[str, Any]]:
        if x is None:
            return []
        if isinstance(x, list):
            return [_flatten(r) if isinstance(r, dict) else {"value": r} for r in x]
        if isinstance(x, dict):
            if all(not isinstance(v, (dict, list)) for v in x.values()):
                return [x]  # one flat row of metrics
            return [_flatten({"name": k, **v}) if isinstance(v, dict) else {"name": k, "value": v}
                    for k, v in x.items()]
        return [{"value": x}]

    if isinstance(data, dict) and ("summary" in data or "rows" in data):
        out = {"summary": as_rows(data.get("summary")), "rows": as_rows(data.get("rows"))}
        run = data.get("run")
        models = [run["model"]] if isinstance(run, dict) and isinstance(run.get("model"), str) else []
    elif isinstance(data, list):
        out, models = {"summary": [], "rows": as_rows(data)}, []
    else:
        out, models = {"summary": as_rows(data), "rows": []}, []
    models += [r["model"] for r in out["rows"] if isinstance(r.get("model"), str)]
    return {**out, "models": list(dict.fromkeys(models))}


# -- reading ---------------------------------------------------------------------------------------------
def is_eval_summary(rows: list[dict[str, Any]]) -> bool:
    """Summary rows of ``zoomkv eval`` (a method label and per-task scores), not some other JSON of metrics."""
    return bool(rows) and all("config" in r and any(k.startswith("score.") for k in r) for r in rows)


def _tasks(rows: list[dict[str, Any]]) -> list[str]:
    return list(dict.fromkeys(k.removeprefix("score.") for r in rows for k in r if k.startswith("score.")))


def _round(v: Any) -> Any:
    if isinstance(v, float):
        return float(f"{v:.4g}")
    if isinstance(v, list):
        return [_round(x) for x in v]
    return v


def _cell(v: Any) -> str:
    v = _round(v)
    if isinstance(v, list):
        return "[" + ", ".join(_cell(x) for x in v) + "]"
    return str(v).replace("|", "\\|").replace("\n", " ")


def _percent(v: Any) -> str:
    return f"{100 * v:.1f}%" if isinstance(v, int | float) else "–"


def eval_table(rows: list[dict[str, Any]]) -> str:
    """``zoomkv eval``'s summary as its own summary.md reads: a score per task (0–100, one decimal) with its
    95% interval in whole points and the samples behind it, the average, device and host bytes against full
    KV, decode time against full."""
    tasks = _tasks(rows)
    cols = ["method", "budget", *tasks, "avg", "device / full", "host / full", "decode × full"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows[:MAX_TABLE_ROWS]:
        cells = [str(r.get("config", r.get("method", ""))), str(r.get("budget") or "–")]
        for t in tasks:
            value, interval, n = r.get(f"score.{t}"), r.get(f"interval95.{t}"), r.get(f"samples.{t}")
            if not isinstance(value, int | float):
                cells.append("–")
                continue
            cell = f"{value:.1f}"
            if isinstance(interval, list) and len(interval) == 2:
                cell += f" [{interval[0]:.0f}–{interval[1]:.0f}]"
            cells.append(cell + (f" n={n}" if n is not None else ""))
        avg = r.get("avg")
        ratio = r.get("decode_ratio")
        cells += [f"{avg:.1f}" if isinstance(avg, int | float) else "–", _percent(r.get("device_ratio")),
                  _percent(r.get("host_ratio")), f"{ratio:.2f}" if isinstance(ratio, int | float) else "–"]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines + _more(rows))


def plain_table(rows: list[dict[str, Any]]) -> str:
    """Any other rows of metrics: one column per field, numbers to four significant digits."""
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows[:MAX_TABLE_ROWS]:
        lines.append("| " + " | ".join(_cell(row.get(c, "")) for c in columns) + " |")
    return "\n".join(lines + _more(rows))


def _more(rows: list[dict[str, Any]]) -> list[str]:
    return [f"\n({len(rows) - MAX_TABLE_ROWS} more rows in the evaluation's files)"] if len(rows) > MAX_TABLE_ROWS else []


# -- the Hub's model-index -------------------------------------------------------------------------------
def adapter_rows(rows: list[dict[str, Any]], method: str, weights_sha256: str | None) -> list[dict[str, Any]]:
    """The summary rows that measured this adapter: ``zoomkv eval --adapter`` labels them
    ``METHOD:NAME@SHA8`` (``+variants``); rows of these very weights when the label's checksum says so."""
    ours = [r for r in rows if str(r.get("method", "")).startswith(f"{method}:")]
    if weights_sha256:
        exact = [r for r in ours if f"@{weights_sha256[:8]}" in str(r["method"])]
        ours = exact or ours
    return ours


def eval_results(summary: list[dict[str, Any]], method: str, weights_sha256: str | None) -> list[EvalResult]:
    """``model-index`` results: every task score of the adapter's own rows (the baselines' rows are in the
    card's table, not in its metadata), or, for a JSON of named metrics, every metric."""
    results = []
    if is_eval_summary(summary):
        for r in adapter_rows(summary, method, weights_sha256):
            budget = r.get("budget")
            for task in _tasks([r]):
                value = r.get(f"score.{task}")
                if isinstance(value, int | float):
                    results.append(EvalResult(
                        task_type="text-generation", task_name=task, dataset_type=task, dataset_name=task,
                        metric_type="score", metric_name=f"score (0–100) at budget {budget}",
                        metric_value=round(float(value), 1),
                        metric_config=None if budget is None else f"budget={budget}"))
        return results
    for r in summary:
        name = str(r.get("name") or r.get("task") or "scores")
        for key, value in r.items():
            if key in _COUNTS or isinstance(value, bool) or not isinstance(value, int | float):
                continue
            results.append(EvalResult(task_type="text-generation", task_name=name, dataset_type=name,
                                      dataset_name=name, metric_type=key, metric_value=_round(value)))
    return results
