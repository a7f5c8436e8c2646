"""Every source of text and tasks that training and evaluation share, below both in the layering.

``sources``: every text and record source through Hugging Face ``datasets`` (the shipped ``kjv`` and
``python-docs`` corpora, local JSONL / JSON / Parquet / CSV files, folders of text files, saved datasets,
Hub ids). RULER-style synthetic generators (``ruler_niah``, ``ruler_vt``, ``ruler_words``) with their
haystacks (``haystack``: noise, or prose from any source) and word lists (``words``); the ``Sample`` every
task produces and the ``PromptFormat`` that renders it (``sample``); evaluation records (``jsonl``,
``files``: LongBench, LongBench-v2, InfiniteBench, RULER exports, plain and GSM8K formats, read by
``longbench`` and ``manyshot``); the trainer's corpus samples with inserted tasks (``training``); the passkey
prompt (``passkey``). Scoring, result rows and the task registry stay in ``zoomkv.eval``.

A module here imports only ``zoomkv.errors``, ``zoomkv.compat``, ``zoomkv.budget``, ``zoomkv.models`` and
other ``zoomkv.data`` modules.
"""
