"""Teacher signals, extracted once per sample with the frozen model at full attention and cached as
safetensors, so training steps never rerun the base model.

Per sample: token ids, surprisal, the chosen query positions, and per compressed layer the post-RoPE
keys and values (fp16), the queries at the chosen positions and the teacher's attention distribution
there (fp16; per-span mass and output are sums over it). Positions are picked where attention reaches far
back (mass on tokens older than the recent window, averaged over layers and heads), plus the last one.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from zoomkv import compat
from zoomkv.atomic import read_json_object
from zoomkv.data.training import Sample
from zoomkv.errors import ConfigError, ZoomKVError
from zoomkv.memory.replay import record_prefill, record_surprisal
from zoomkv.protocol.method import SCORES_AT_ONCE

CACHE_VERSION = 2  # 2: each layer's rotary table
# Written first into a folder the cache claims: a teacher cache writes (and rewrites) only inside a folder that
# was new or empty, or holds this mark (or, from before it, a meta.json of ours), never among a user's files.
CACHE_MARK = ".zoomkv-teacher-cache"


def is_cache_folder(folder: Path) -> bool:
    """A teacher cache zoomkv wrote: its mark, or (caches written before the mark) its ``meta.json``."""
    if (folder / CACHE_MARK).is_file():
        return True
    data = read_json_object(folder / "meta.json", max_bytes=1 << 20)
    return data is not None and {"version", "n", "model", "num_samples"} <= set(data)


def check_cache_folder(folder: Path) -> None:
    """Refuse a teacher cache folder that holds anything but a teacher cache of ours (empty is fine)."""
    if (folder.exists() or folder.is_symlink()) and not folder.is_dir():
        raise ConfigError(f"recipe key 'teacher_cache': {folder} is a file, not a folder")
    if folder.is_dir() and any(folder.iterdir()) and not is_cache_folder(folder):
        raise ConfigError(f"recipe key 'teacher_cache': {folder} holds files that are not a zoomkv teacher cache; "
                          "name a new or empty folder (the cache writes meta.json and sample_*.safetensors there)")


def encode(tokenizer, text: str) -> torch.Tensor:
    return tokenizer(text, return_tensors="pt")["input_ids"]


@torch.inference_mode()
def extract_sample(model, ids: torch.Tensor, n_queries: int, min_pos: int, recent: int) -> dict[str, torch.Tensor]:
    record = record_prefill(model, ids)
    surprisal = record_surprisal(model, record)[0].float()
    t = ids.shape[1]
    layers = sorted(record.contexts)
    # the signals are computed where the model ran (a GPU's), then saved from the host
    device = record.contexts[layers[0]].keys.device
    cands = torch.arange(min(max(min_pos, t // 2), t - 1), t, device=device)
    # Two passes, so that no layer's attention over every candidate is ever held: the far mass of each candidate
    # (summed over layers) picks the queries, then only the picked queries' attention is computed again.
    far = torch.zeros(len(cands), device=device)
    for layer in layers:
        ctx = record.contexts[layer]
        keys = _query_heads(ctx)
        for block in _candidate_blocks(len(cands), ctx.queries.shape[1], t):
            at = cands[block]
            probs = _attention_rows(ctx, keys, at, t)
            old = torch.arange(t, device=device)[None, :] < (at[:, None] - recent - 32)
            far[block] += (probs * old).sum(-1).mean(0)
    pick = far[:-1].topk(min(n_queries - 1, len(cands) - 1)).indices if len(cands) > 1 else \
        torch.zeros(0, dtype=torch.long, device=device)
    chosen = torch.cat([pick, torch.tensor([len(cands) - 1], device=device)]).sort().values
    positions = cands[chosen]
    out: dict[str, torch.Tensor] = {"ids": ids[0].clone(), "surprisal": surprisal, "positions": positions.clone(),
                                    "layers": torch.tensor(layers)}
    for layer in layers:
        ctx = record.contexts[layer]
        out[f"k.{layer}"] = ctx.keys[0].half().contiguous()
        out[f"v.{layer}"] = ctx.values[0].half().contiguous()
        out[f"q.{layer}"] = ctx.queries[0][:, positions].float().contiguous()
        out[f"attn.{layer}"] = _attention_rows(ctx, _query_heads(ctx), positions, t).half().contiguous()
        table = compat.rotary_frequencies(model.config, layer)
        if table is not None:  # the keys' RoPE, for objectives that work on keys before it
            out[f"rotary_inv_freq.{layer}"] = table[0].contiguous()
            out[f"rotary_scaling.{layer}"] = torch.tensor(table[1])
    out["scaling"] = torch.tensor(record.contexts[layers[0]].scaling)
    return {name: tensor.cpu() for name, tensor in out.items()}


def _query_heads(ctx) -> torch.Tensor:
    """A layer's keys in float, one copy per query head: ``[hq, T, d]``."""
    return ctx.keys[0].float().repeat_interleave(ctx.num_kv_groups, dim=0)


def _candidate_blocks(n: int, heads: int, t: int) -> list[slice]:
    """Slices of the candidates whose scores (``[heads, block, T]``) stay near ``SCORES_AT_ONCE`` elements: at the 8B
    recipe's 16K tokens one layer's scores for every candidate would be 17 GB."""
    step = max(1, SCORES_AT_ONCE // max(1, heads * t))
    return [slice(start, min(start + step, n)) for start in range(0, n, step)]


def _attention_rows(ctx, keys: torch.Tensor, positions: torch.Tensor, t: int) -> torch.Tensor:
    """The teacher's causal attention of the queries at ``positions`` over the whole sample: ``[hq, n, T]``."""
    q = ctx.queries[0][:, positions].float()  # [hq, n, d]
    logits = torch.matmul(q, keys.transpose(-1, -2)) * ctx.scaling
    causal = torch.arange(t, device=keys.device)[None, :] > positions[:, None]
    return torch.softmax(logits.masked_fill(causal, float("-inf")), -1)


def build_cache(model, tokenizer, samples: list[Sample], folder: Path, *, n_queries: int, min_pos: int, recent: int,
                fingerprint: dict[str, Any], show_progress: bool = True) -> list[Path]:
    """Extract every sample once (skipped when the cache already matches ``fingerprint``), in a folder that is
    new, empty or a teacher cache (``check_cache_folder``)."""
    check_cache_folder(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / CACHE_MARK).is_file():
        (folder / CACHE_MARK).write_text("zoomkv teacher cache\n", encoding="utf-8")
    meta_path = folder / "meta.json"
    fingerprint = {**fingerprint, "version": CACHE_VERSION, "n": len(samples)}
    paths = [folder / f"sample_{i:05d}.safetensors" for i in range(len(samples))]
    if _recorded(meta_path) == fingerprint and all(_readable(p) for p in paths):
        return paths
    meta_path.unlink(missing_ok=True)
    for sample, path in tqdm(list(zip(samples, paths, strict=True)), desc="teacher signals", disable=not show_progress):
        tensors = extract_sample(model, encode(tokenizer, sample.text), n_queries, min_pos, recent)
        tmp = path.with_suffix(".tmp")
        save_file(tensors, str(tmp))
        tmp.replace(path)
    meta_path.write_text(json.dumps(fingerprint, sort_keys=True))
    return paths


def _recorded(meta_path: Path) -> Any:
    """The fingerprint a cache recorded; None when there is none or it cannot be read (a corrupt meta.json
    is a stale cache: it is extracted again)."""
    try:
        return json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _readable(path: Path) -> bool:
    """A cached sample whose safetensors header is whole and covers the file (a truncated one is not)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            f.keys()
    except (OSError, SafetensorError):
        return False
    return True


def load_sample(path: Path, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """A cached teacher sample, its tensors on ``device`` (the adapter's)."""
    try:
        return {name: tensor.to(device) for name, tensor in load_file(str(path)).items()}
    except (OSError, SafetensorError) as err:
        raise ZoomKVError(f"teacher sample {path} cannot be read (corrupt or truncated: "
                          f"{str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__}); "
                          f"delete {path.parent} to extract the teacher signals again") from None


class CachedSamples(Sequence):
    """The cached teacher samples, read from disk when indexed (a slice is another ``CachedSamples``), their
    tensors put on ``device`` (the adapter's)."""

    def __init__(self, paths: list[Path], device: torch.device | str = "cpu"):
        self.paths = list(paths)
        self.device = device

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return CachedSamples(self.paths[index], self.device)
        return load_sample(self.paths[index], self.device)
