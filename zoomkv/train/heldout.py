"""Held-out evaluation of a trained adapter: samples the run never trained on (other seeds, the longest
length), scored by next-token KL to full attention and exact-answer accuracy, the fresh adapter and the
recipe's ``eval_baselines`` beside the trained one at the same budget. Run at the end of training and by
``zoomkv train --eval-only``; written to ``<run>/eval.json``."""

from __future__ import annotations

import json
import logging
from typing import Any

import torch

from zoomkv.adapters.model import ZoomAdapter
from zoomkv.data.training import make_samples
from zoomkv.errors import ConfigError
from zoomkv.locks import lock_inside
from zoomkv.protocol.registry import get_method
from zoomkv.train.config import TrainConfig, load_corpus

logger = logging.getLogger(__name__)


@torch.inference_mode()
def answer_scores(model, tokenizer, texts: list[tuple[str, str]], methods: dict[str, Any],
                  budget: int) -> dict[str, dict[str, float]]:
    """Teacher-forced answer tokens after one prefill per text, for each method: mean next-token KL to full
    attention, and exact-answer accuracy (every answer token the greedy choice) of the compressed and of
    the full model."""
    from zoomkv import compat
    from zoomkv.memory.replay import cache_from_record, record_prefill

    kls: dict[str, list[float]] = {name: [] for name in methods}
    hits: dict[str, list[bool]] = {name: [] for name in methods}
    full_hits = []
    for prompt, answer in texts:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"].to(model.device)
        ans = tokenizer(answer, add_special_tokens=False, return_tensors="pt")["input_ids"].to(model.device)
        full = model(input_ids=torch.cat([ids, ans], 1)).logits[0, ids.shape[1] - 1 : -1].float()
        full_hits.append(bool((full.argmax(-1) == ans[0]).all()))
        record = record_prefill(model, ids)
        for name, method in methods.items():
            cache = cache_from_record(model, record, method, budget)
            logits = [record.last_logits[0]]
            for i in range(ans.shape[1] - 1):
                pos = torch.tensor([[ids.shape[1] + i]], device=model.device)
                out = model(input_ids=ans[:, i : i + 1], position_ids=pos, use_cache=True,
                            **compat.generate_cache_kwargs(cache))
                logits.append(out.logits[0, -1].float())
            student = torch.stack(logits)
            kl = torch.nn.functional.kl_div(student.log_softmax(-1), full.log_softmax(-1), log_target=True,
                                            reduction="none")
            kls[name].append(float(kl.sum(-1).mean()))
            hits[name].append(bool((student.argmax(-1) == ans[0]).all()))
    n = len(texts)
    return {name: {"kl": sum(kls[name]) / n, "accuracy": sum(hits[name]) / n, "full_accuracy": sum(full_hits) / n}
            for name in methods}


def evaluate(model, tokenizer, cfg: TrainConfig, adapter: torch.nn.Module) -> dict[str, Any]:
    """Held-out samples (other seeds, the longest length): the fresh adapter vs the trained one, and the
    recipe's ``eval_baselines`` (training-free methods) at the same budget."""
    # scored on the answer of a task that has one (plain text has none): passkey when the recipe names none
    answered = {t: w for t, w in cfg.task_mix.items() if t != "plain"} or {"passkey": 1.0}
    held = make_samples(tokenizer, answered, cfg.eval_samples, cfg.max_length, cfg.max_length, cfg.seed + 9973,
                        load_corpus(cfg))
    texts = []
    for s in held:
        cut = s.text.rindex(s.answer)
        texts.append((s.text[:cut].rstrip(" "), " " + s.answer))
    methods: dict[str, Any] = {name: cfg.training.make_method(modules, cfg)
                               for name, modules in (("fresh", None), ("trained", adapter))}
    for name in (b.strip() for b in cfg.eval_baselines.split(",") if b.strip()):
        methods[name] = get_method(name)
    return {"budget": cfg.budget, "samples": len(texts), "length": cfg.max_length,
            **answer_scores(model, tokenizer, texts, methods, cfg.budget)}


def evaluate_run(cfg: TrainConfig) -> dict[str, Any]:
    """``--eval-only``: score the run's saved adapter (``<run>/adapter``) as the end of training does."""
    from zoomkv.models import load_model

    folder = cfg.run_dir / "adapter"
    if not folder.is_dir():
        raise ConfigError(f"no trained adapter at {folder}: train the recipe first")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    with lock_inside(cfg.run_dir, "train --eval-only", "run folder"):  # not while a run trains into it
        model, tokenizer = load_model(cfg.model, random_weights=cfg.random_weights)
        loaded = ZoomAdapter.from_pretrained(folder, local_files_only=True)
        loaded.check_base(model)
        scores = evaluate(model, tokenizer, cfg, loaded.modules)
        write_eval(cfg, scores)
    return scores


def write_eval(cfg: TrainConfig, scores: dict[str, Any]) -> None:
    (cfg.run_dir / "eval.json").write_text(json.dumps(scores, indent=2))
    logger.info("eval %s", json.dumps(scores))
