"""Write a training checkpoint as a shareable adapter folder.

    zoomkv export checkpoints/run-3/step-2000 --out checkpoints/sekv-smollm2 --scores eval.json
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", metavar="CHECKPOINT",
                        help="folder with adapter_state.safetensors + adapter_meta.json (or an adapter folder)")
    parser.add_argument("--out", default=None, help="target folder (default: checkpoints/<checkpoint name>)")
    parser.add_argument("--scores", default=None, metavar="FILE", help="`zoomkv eval` output for the model card: its summary.json / rows.json, or its --out folder")
    parser.add_argument("--budget", default=None, help="the budget the scores were measured at (rows or fraction)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing adapter folder")


def _budget(text: str | None) -> str | int | float | None:
    if text is None:
        return None
    from zoomkv.budget import Budget

    Budget.parse(text)  # the same validation as --budget everywhere else (BudgetError → exit 2)
    try:
        return int(text)
    except ValueError:
        return float(text)


def run(args: argparse.Namespace) -> int:
    from zoomkv.adapters.card import load_scores
    from zoomkv.adapters.export import export_checkpoint

    scores = load_scores(args.scores) if args.scores else None
    checkpoint = Path(args.checkpoint)
    out = Path(args.out) if args.out else Path("checkpoints") / checkpoint.resolve().name
    folder = export_checkpoint(checkpoint, out, scores=scores, budget=_budget(args.budget), overwrite=args.overwrite)
    print(f"exported adapter to {folder}")
    return 0
