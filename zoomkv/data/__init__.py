"""Every source of text and tasks that training and evaluation share, below both in the layering.

RULER-style synthetic generators (``ruler_niah``, ``ruler_vt``, ``ruler_words``) with their haystacks
(``haystack``) and word lists (``words``); the ``Sample`` every task produces and the ``PromptFormat`` that
renders it (``sample``); the user's JSONL files (``jsonl``, ``files``: LongBench, plain and GSM8K formats, read
by ``longbench`` and ``manyshot``); the trainer's synthetic samples (``training``); the passkey prompt
(``passkey``). Scoring, result rows and the task registry stay in ``zoomkv.eval``.

A module here imports only ``zoomkv.errors``, ``zoomkv.compat``, ``zoomkv.budget``, ``zoomkv.models`` and
other ``zoomkv.data`` modules.
"""
