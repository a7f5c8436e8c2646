"""The adapter's ``README.md``: Hub metadata (YAML front matter) plus a human summary, how to load it, and
the scores.

Metadata goes through ``huggingface_hub.ModelCardData`` so the front matter is exactly what the Hub
parses: ``library_name: zoomkv``, ``license``, ``base_model`` (only when it is a Hub id; a local path or a
registered test model is not one and the Hub would reject it), tags, the scores as ``model-index`` results
(``zoomkv.adapters.scores``) and a ``zoomkv`` block with the method, budget and trainable fraction for tools.
The same card is written by ``zoomkv export`` and by PEFT's ``save_pretrained`` / ``push_to_hub``
(``peft_integration``), so both publish the same repository.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from huggingface_hub import ModelCard, ModelCardData

from zoomkv.adapters.config import LIBRARY_NAME, ZoomAdapterConfig
from zoomkv.adapters.scores import eval_results, eval_table, is_eval_summary, load_scores, plain_table
from zoomkv.models.registry import base_license, hub_name

__all__ = ["CARD_HEADING", "base_model_hub_id", "load_scores", "render_card"]

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
CARD_HEADING = "# zoomkv adapter: "  # how a card this module wrote begins its body (peft_integration looks for it)


def base_model_hub_id(name: str | None) -> str | None:
    if not name:
        return None
    name = hub_name(name)
    return name if _HUB_ID.match(name) and not Path(name).expanduser().exists() else None


def _usage(config: ZoomAdapterConfig, base_name: str | None) -> list[str]:
    budget = config.budget if config.budget is not None else 256
    own = "at the budget it records" if config.budget is not None else "(this adapter records no budget: pass one)"
    return [
        "## Use",
        "",
        "Set `ADAPTER` to this repository's id (or the folder it was downloaded to). With zoomkv's loader:",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "from zoomkv.adapters.model import cache_from_adapter",
        "from zoomkv.compat import generate_cache_kwargs",
        "",
        'ADAPTER = "<this repo id or folder>"',
        f'model = AutoModelForCausalLM.from_pretrained("{base_name}")',
        f'tokenizer = AutoTokenizer.from_pretrained("{base_name}")',
        'inputs = tokenizer("<a long document, then a question>", return_tensors="pt")',
        f"cache = cache_from_adapter(model, ADAPTER, budget={budget!r})  # checks the base model, runs the adapter",
        "out = model.generate(**inputs, max_new_tokens=64, **generate_cache_kwargs(cache))",
        "```",
        "",
        "With PEFT (`pip install zoomkv[peft]`; `tokenizer` and `inputs` as above): `generate()` builds the "
        f"adapter's cache by itself, {own}, and so does the text-generation pipeline:",
        "",
        "```python",
        "import zoomkv  # makes zoomkv a PEFT method",
        "from peft import AutoPeftModelForCausalLM",
        "from transformers import pipeline",
        "",
        "model = AutoPeftModelForCausalLM.from_pretrained(ADAPTER)  # loads the base model too",
        "out = model.generate(**inputs, max_new_tokens=64)",
        'generator = pipeline("text-generation", model=model, tokenizer=tokenizer)',
        "```",
        "",
    ]


def render_card(config: ZoomAdapterConfig, scores: dict[str, Any] | None = None, *,
                license: str | None = None) -> str:
    """The card for ``config``; ``scores`` as ``load_scores`` reads them; ``license`` a Hub licence id (default:
    the registered base model's licence, the terms an adapter of it is shared under; else ``unknown``)."""
    base = config.base_model
    base_name = base.get("name")
    hub_id = base_model_hub_id(base_name)
    summary = (scores or {}).get("summary") or []
    results = eval_results(summary, config.method, config.weights_sha256)
    short = (base_name or "a base model").rsplit("/", 1)[-1]
    data = ModelCardData(
        library_name=LIBRARY_NAME,
        license=license or base_license(base_name) or "unknown",
        base_model=hub_id,
        pipeline_tag="text-generation",
        tags=["zoomkv", "kv-cache", "long-context", "peft", config.method],
        model_name=f"zoomkv {config.method} adapter for {short}" if results else None,
        eval_results=results or None,
        zoomkv={
            "method": config.method,
            "budget": config.budget,
            "trainable_fraction": config.trainable_fraction,
            "format_version": config.format_version,
            "toolkit_version": config.toolkit_version,
            "base_model_name": base_name,
            "base_model_revision": base.get("revision"),
        },
    )
    fraction = "unknown" if config.trainable_fraction is None else f"{config.trainable_fraction:.3e}"
    budget = "not recorded" if config.budget is None else f"{config.budget} (rows per KV head on the device tier)"
    fp = ", ".join(f"{k}={base[k]}" for k in sorted(base) if k not in ("name", "revision"))
    body = [
        f"{CARD_HEADING}{config.method}",
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
        *_usage(config, base_name),
        "## Scores",
        "",
    ]
    if summary and is_eval_summary(summary):
        body += ["Measured by `zoomkv eval`: scores 0–100 per task with their 95% interval (Wilson) and samples; "
                 "bytes per sequence as a share of full KV; decode time against `full` on the same prompts.", "",
                 eval_table(summary), ""]
    elif summary:
        body += [plain_table(summary), ""]
    elif scores and scores.get("rows"):
        body += ["Per row:", "", plain_table(scores["rows"]), ""]
    else:
        body += ["Not measured yet (export with `--scores` to include the output of `zoomkv eval`).", ""]
    # Assembled by hand rather than with ModelCard.from_template: that renders through Jinja, and score
    # names or texts containing "{{" would be evaluated as template code.
    text = f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(body)
    ModelCard(text)  # parse it back: a card the Hub cannot read must fail here, not after the upload
    return text
