"""``make demo``: the main job end to end on the embedded default model (SmolLM2-135M-Instruct).

1. train the quickstart sekv adapter (``recipes/smollm2-135m/quickstart.yaml``) unless
   ``checkpoints/sekv-smollm2-quickstart/adapter`` already holds one;
2. evaluate ``full``, the trained adapter and the strongest baselines under one budget on a small RULER
   subset at ~2K tokens (``zoomkv eval``: accuracy, bytes per tier, decode speed);
3. print the table and say where the rows and plots are.

About 8 minutes on a 2-core CPU the first time (training included: ~6), 2 minutes after.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

from zoomkv.errors import ZoomKVError
from zoomkv.logs import show_on_console
from zoomkv.models import DEFAULT_MODEL

log = logging.getLogger("zoomkv.demo")  # not __main__: `python -m zoomkv.demo` logs under zoomkv too

RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "smollm2-135m" / "quickstart.yaml"
OUT = Path("runs/demo")
BASELINES = ["snapkv", "quest", "clusterkv", "streamingllm"]
BUDGET = "128"
# Tasks the default model solves with full KV at ~2K tokens (BENCHMARKS.md), asked after compression
# (query-agnostic); niah_multiturn asks four questions in turn on one compressed context.
TASKS = ["niah_single_1", "niah_single_3", "niah_multiturn"]


def _adapter() -> Path:
    """The quickstart adapter, trained first when there is none."""
    from zoomkv.train.config import load_recipe
    from zoomkv.train.loop import train

    cfg = load_recipe(RECIPE)
    adapter = cfg.run_dir / "adapter"
    if (adapter / "adapter_config.json").is_file():
        log.info("using the trained adapter in %s (delete it to train again)", adapter)
        return adapter
    log.info("training the quickstart sekv adapter (%s), ~7 minutes on a 2-core CPU", RECIPE.name)
    return train(cfg)


def main() -> int:
    from zoomkv.eval.harness import EvalConfig, run_eval
    from zoomkv.models import load_model

    show_on_console()
    t0 = time.perf_counter()
    try:
        log.info("loading %s (the first run converts the GGUF once, 20-80 s)", DEFAULT_MODEL)
        model, tokenizer = load_model(DEFAULT_MODEL)
        adapter = _adapter()
        log.info("evaluating full, %s and the adapter at budget %s on %s at ~2K tokens (2 samples each), each "
                 "context compressed before its question", ", ".join(BASELINES), BUDGET, ", ".join(TASKS))
        cfg = EvalConfig(model=DEFAULT_MODEL, out=OUT, methods=["full", *BASELINES], budgets=[BUDGET], tasks=TASKS,
                         lengths=[2048], samples=2, adapters=[str(adapter)],
                         overwrite=True,  # the table is this run's: no rows of an earlier adapter or code
                         command=f"zoomkv eval --model {DEFAULT_MODEL} --methods full,{','.join(BASELINES)} "
                                 f"--budgets {BUDGET} --tasks {','.join(TASKS)} --length 2048 --samples 2 "
                                 f"--adapter {adapter} --out {OUT} --overwrite")
        run_eval(cfg, model, tokenizer)
    except ZoomKVError as err:
        print(f"zoomkv: error: {err}", file=sys.stderr)
        return 2
    print((OUT / "summary.md").read_text(encoding="utf-8"))
    plots = sorted(p.name for p in OUT.glob("*.png"))
    print(f"rows: {OUT / 'rows.jsonl'} (and .csv); plots: {', '.join(plots)} in {OUT}/")
    print(f"done in {time.perf_counter() - t0:.0f} s. next: `zoomkv eval --help`, `zoomkv methods`, README.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
