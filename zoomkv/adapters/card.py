"""The adapter's ``README.md``: Hub metadata (YAML front matter) plus a human summary and the scores.

Metadata goes through ``huggingface_hub.ModelCardData`` so the front matter is exactly what the Hub
parses: ``library_name: zoomkv``, ``base_model`` (only when it is a Hub id; a local path or a registered
test model is not one and the Hub would reject it), tags, and a ``zoomkv`` block with the method, budget,
trainable fraction and the summary scores for tools.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from huggingface_hub import ModelCard, ModelCardData

from zoomkv.adapters.config import LIBRARY_NAME, ZoomAdapterConfig
from zoomkv.adapters.errors import AdapterError

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# Registered zoomkv model names and the Hub repository their weights come from.
KNOWN_BASE_MODELS = {
    "smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "gemma3-270m": "google/gemma-3-270m",
}
_MAX_ROWS = 50  # a card is for reading; the full rows stay in the eval's JSON


def base_model_hub_id(name: str | None) -> str | None:
    if not name:
        return None
    name = KNOWN_BASE_MODELS.get(name, name)
    return name if _HUB_ID.match(name) and not Path(name).expanduser().exists() else None


def load_scores(path: str | Path) -> dict[str, Any]:
    """Read what ``zoomkv eval`` wrote: its ``summary.json`` (``{"run": ..., "summary": [...]}``), its
    ``rows.json`` (a list of rows), a flat dict of metrics, or its whole ``--out`` folder (both files)."""
    path = Path(path)
    if path.is_dir():
        parts = [normalise_scores(_read_json(path / n)) for n in ("summary.json", "rows.json") if (path / n).is_file()]
        if not parts:
            raise AdapterError(f"{path}: no summary.json or rows.json (the output folder of `zoomkv eval`)")
        return {"summary": [r for p in parts for r in p["summary"]], "rows": [r for p in parts for r in p["rows"]]}
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
    """→ ``{"summary": [row, ...], "rows": [row, ...]}`` whatever shape the eval wrote."""
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
        return {"summary": as_rows(data.get("summary")), "rows": as_rows(data.get("rows"))}
    if isinstance(data, list):
        return {"summary": [], "rows": as_rows(data)}
    return {"summary": as_rows(data), "rows": []}


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v).replace("|", "\\|").replace("\n", " ")


def _table(rows: list[dict[str, Any]]) -> str:
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows[:_MAX_ROWS]:
        lines.append("| " + " | ".join(_cell(row.get(c, "")) for c in columns) + " |")
    if len(rows) > _MAX_ROWS:
        lines.append(f"\n({len(rows) - _MAX_ROWS} more rows in the evaluation's JSON)")
    return "\n".join(lines)


def _scalar_summary(summary: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # Only JSON scalars go into the YAML block: the Hub's metadata parser needs plain YAML.
    return [{k: v for k, v in row.items() if isinstance(v, (str, int, float, bool)) or v is None} for row in summary]


def render_card(config: ZoomAdapterConfig, scores: dict[str, Any] | None = None) -> str:
    base = config.base_model
    base_name = base.get("name")
    hub_id = base_model_hub_id(base_name)
    extra: dict[str, Any] = {
        "zoomkv": {
            "method": config.method,
            "budget": config.budget,
            "trainable_fraction": config.trainable_fraction,
            "format_version": config.format_version,
            "toolkit_version": config.toolkit_version,
            "base_model_name": base_name,
            "base_model_revision": base.get("revision"),
        }
    }
    if scores and scores.get("summary"):
        extra["zoomkv"]["scores"] = _scalar_summary(scores["summary"])
    data = ModelCardData(
        library_name=LIBRARY_NAME,
        base_model=hub_id,
        tags=["zoomkv", "kv-cache", "long-context", config.method],
        **extra,
    )
    fraction = "unknown" if config.trainable_fraction is None else f"{config.trainable_fraction:.3e}"
    budget = "not recorded" if config.budget is None else f"{config.budget} (rows per KV head on the device tier)"
    fp = ", ".join(f"{k}={base[k]}" for k in sorted(base) if k not in ("name", "revision"))
    body = [
        f"# zoomkv adapter: {config.method}",
        "",
        f"A trained `{config.method}` adapter for the [zoomkv](https://pypi.org/project/zoomkv/) two-tier KV cache.",
        "",
        "| | |",
        "|---|---|",
        f"| base model | `{base_name}`" + (f" (revision `{base['revision']}`)" if base.get("revision") else "") + " |",
        f"| method | `{config.method}` |",
        f"| budget | {budget} |",
        f"| trainable fraction | {fraction} of the base model's parameters |",
        f"| format | version {config.format_version}, zoomkv {config.toolkit_version} |",
        f"| base fingerprint | {fp} |",
        "",
        "## Use",
        "",
        "```python",
        "from zoomkv.adapters.model import ZoomAdapter, cache_from_adapter",
        "adapter = ZoomAdapter.from_pretrained(\"<this repo or folder>\")",
        "cache = cache_from_adapter(model, adapter, budget=" + repr(config.budget if config.budget is not None else 256) + ")",
        "out = model.generate(**inputs, cache=cache)",
        "```",
        "",
        "## Scores",
        "",
    ]
    if scores and (scores.get("summary") or scores.get("rows")):
        if scores.get("summary"):
            body += ["Measured by `zoomkv eval` (summary):", "", _table(scores["summary"]), ""]
        if scores.get("rows"):
            body += ["Per task:", "", _table(scores["rows"]), ""]
    else:
        body += ["Not measured yet (export with `--scores` to include the output of `zoomkv eval`).", ""]
    # Assembled by hand rather than with ModelCard.from_template: that renders through Jinja, and score
    # names or texts containing "{{" would be evaluated as template code.
    text = f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(body)
    ModelCard(text)  # parse it back: a card the Hub cannot read must fail here, not after the upload
    return text
