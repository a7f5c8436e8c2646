"""``zoomkv train`` / ``python -m zoomkv.train``: run a recipe, or ``--dry-run`` to size the adapter.

    python -m zoomkv.train --recipe recipes/smollm2-135m/quickstart.yaml steps=50 resume=latest
    python -m zoomkv.train --recipe recipes/llama-3-8b/sekv.yaml --dry-run   # no weights loaded
    python -m zoomkv.train --recipe recipes/smollm2-135m/quickstart.yaml --eval-only eval_samples=6

The run's log (sizes, processes, ``step N:`` lines, where the adapter went) is on stderr above the progress
bars; ``--quiet`` keeps warnings only, ``-v`` adds where caches and checkpoints went.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recipe", required=True, help="flat YAML recipe (recipes/<model>/<method>.yaml)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the trainable parameter count and fraction, then exit")
    parser.add_argument("--eval-only", action="store_true",
                        help="score the run's trained adapter on held-out samples (fresh adapter and "
                             "eval_baselines beside it) without training; writes eval.json")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="override recipe keys")


def run(args: argparse.Namespace) -> int:
    from zoomkv.train.config import load_recipe
    cfg = load_recipe(args.recipe, args.overrides)  # every recipe error surfaces here, before a model loads
    if args.dry_run:
        from zoomkv.train.sizing import dry_run

        dry_run(cfg)
        return 0
    if args.eval_only:
        from zoomkv.train.heldout import evaluate_run

        evaluate_run(cfg)
        return 0
    from zoomkv.train.loop import train

    train(cfg)
    return 0
