"""``zoomkv export`` and ``zoomkv push`` (registered by zoomkv.cli through ``register(subparsers)``).

    zoomkv export checkpoints/run-3/step-2000 --out checkpoints/sekv-smollm2 --scores eval.json
    zoomkv push checkpoints/sekv-smollm2 --repo-id user/sekv-smollm2
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def _budget(text: str | None) -> str | int | float | None:
    if text is None:
        return None
    from zoomkv.budget import Budget

    Budget.parse(text)  # the same validation as --budget everywhere else (BudgetError → exit 2)
    try:
        return int(text)
    except ValueError:
        return float(text)


def cmd_export(args: argparse.Namespace) -> int:
    from zoomkv.adapters.card import load_scores
    from zoomkv.adapters.export import export_checkpoint

    scores = load_scores(args.scores) if args.scores else None
    checkpoint = Path(args.checkpoint)
    out = Path(args.out) if args.out else Path("checkpoints") / checkpoint.resolve().name
    folder = export_checkpoint(checkpoint, out, scores=scores, budget=_budget(args.budget), overwrite=args.overwrite)
    print(f"exported adapter to {folder}")
    return 0


def cmd_push(args: argparse.Namespace) -> int:
    from zoomkv.adapters.hub import push_folder
    from zoomkv.adapters.model import ZoomAdapter

    ZoomAdapter.from_pretrained(args.folder)  # never upload something that does not load
    url = push_folder(args.folder, args.repo_id, private=args.private or None, token=args.token,
                      revision=args.revision, commit_message=args.message, endpoint=args.endpoint)
    print(f"pushed {args.folder} to {args.repo_id}: {url}")
    return 0


def register(subparsers: Any) -> None:
    e = subparsers.add_parser("export", help="write a training checkpoint as a shareable adapter folder")
    e.add_argument("checkpoint", metavar="CHECKPOINT",
                   help="folder with adapter_state.safetensors + adapter_meta.json (or an adapter folder)")
    e.add_argument("--out", default=None, help="target folder (default: checkpoints/<checkpoint name>)")
    e.add_argument("--scores", default=None, metavar="FILE", help="`zoomkv eval` output for the model card: its summary.json / rows.json, or its --out folder")
    e.add_argument("--budget", default=None, help="the budget the scores were measured at (rows or fraction)")
    e.add_argument("--overwrite", action="store_true", help="replace an existing adapter folder")
    e.set_defaults(func=cmd_export)

    p = subparsers.add_parser("push", help="upload an exported adapter folder to the Hugging Face Hub")
    p.add_argument("folder", metavar="FOLDER")
    p.add_argument("--repo-id", required=True, help="owner/name")
    p.add_argument("--private", action="store_true")
    p.add_argument("--token", default=None, help="default: the token of `hf auth login` / HF_TOKEN")
    p.add_argument("--revision", default=None, help="branch to push to (default: main)")
    p.add_argument("--message", default=None, help="commit message")
    p.add_argument("--endpoint", default=None, help="Hub endpoint (default: HF_ENDPOINT or huggingface.co)")
    p.set_defaults(func=cmd_push)
