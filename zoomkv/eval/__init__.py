"""Evaluation: RULER-style synthetic tasks, a NIAH grid, LongBench/plain/GSM8K JSONL tasks, and one
harness that runs every method × budget on them with a shared prefill (``zoomkv eval``, whose command
module is ``zoomkv/commands/eval.py``). The tasks' generators and file readers live in ``zoomkv.data``;
scoring, rows and reports live here."""
