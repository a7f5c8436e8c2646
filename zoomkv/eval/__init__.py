"""Evaluation: RULER-style synthetic tasks, a NIAH grid, LongBench/plain/GSM8K JSONL tasks, and one
harness that runs every method × budget on them with a shared prefill (``zoomkv eval``).
The tasks' generators and file readers live in ``zoomkv.data``; scoring, rows and reports live here.

The submodules import torch and transformers lazily where they can; importing this package is cheap.
"""

from __future__ import annotations

from typing import Any

__all__ = ["EvalConfig", "run_eval"]


def __getattr__(name: str) -> Any:  # keep `import zoomkv.eval.cli` (run by every zoomkv command) light
    if name in __all__:
        from zoomkv.eval import harness

        return getattr(harness, name)
    raise AttributeError(name)
