"""Write a training checkpoint as a shareable adapter folder.

    zoomkv export checkpoints/run-3/step-2000 --out checkpoints/sekv-smollm2 --scores eval.json
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from zoomkv.adapters.weights import STAMP_FLAG
from zoomkv.errors import ZoomKVError

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", metavar="CHECKPOINT",
                        help="folder with adapter_state.safetensors + adapter_meta.json (or an adapter folder)")
    parser.add_argument("--out", default=None, help="target folder (default: checkpoints/<checkpoint name>)")
    parser.add_argument("--scores", default=None, metavar="FILE", help="`zoomkv eval` output for the model card: its summary.json / rows.json, or its --out folder")
    parser.add_argument("--budget", default=None, help="the budget the scores were measured at (rows or fraction)")
    parser.add_argument("--license", default=None, metavar="ID",
                        help="the card's licence, a Hub licence id such as apache-2.0 or mit (default: the registered "
                             "base model's licence, else unknown)")
    parser.add_argument(STAMP_FLAG, action="store_true",
                        help="for weights that record no identity (the method, hyper-parameters and base model they "
                             "were saved for: exports older than any release): take them as the config beside them "
                             "says, and write the adapter with that identity recorded")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing adapter folder (its adapter files only: other files in it are "
                             "kept); a folder that is not an adapter is never replaced")


def _budget(text: str | None) -> str | int | float | None:
    if text is None:
        return None
    from zoomkv.budget import Budget

    Budget.parse(text)  # the same validation as --budget everywhere else (BudgetError → exit 2)
    try:
        return int(text)
    except ValueError:
        return float(text)


def _scores(path: str) -> dict[str, Any]:
    """``load_scores``, with the eval's per-sample rows summarised as its summary.md does when no summary came
    with them (a card shows per-task scores and intervals, not raw rows)."""
    from zoomkv.adapters.scores import load_scores, normalise_scores

    scores = load_scores(path)
    if not scores["summary"] and scores["rows"] and all({"method", "task", "score"} <= set(r) for r in scores["rows"]):
        from zoomkv.eval.summary import aggregate

        try:
            summary = aggregate(scores["rows"])
        except (KeyError, TypeError, ValueError):  # rows of another tool: shown as they are
            return scores
        scores = {**scores, "summary": normalise_scores({"summary": summary})["summary"]}
    return scores


def run(args: argparse.Namespace) -> int:
    from zoomkv.adapters.export import export_checkpoint

    scores = _scores(args.scores) if args.scores else None
    checkpoint = Path(args.checkpoint)
    if args.out is not None and not args.out.strip():  # not the default path: an empty name is a mistake
        raise ZoomKVError("--out needs a folder name, got an empty one (leave --out out for "
                          f"checkpoints/{checkpoint.resolve().name})")
    out = Path(args.out) if args.out is not None else Path("checkpoints") / checkpoint.resolve().name
    folder = export_checkpoint(checkpoint, out, scores=scores, budget=_budget(args.budget), overwrite=args.overwrite,
                               license=args.license, stamp_identity=args.stamp_identity)
    log.info("exported adapter to %s", folder)
    return 0
