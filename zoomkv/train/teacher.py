"""Teacher signals, extracted once per sample with the frozen model at full attention and cached as
safetensors, so training steps never rerun the base model.

Per sample: token ids, surprisal, the chosen query positions, and per compressed layer the post-RoPE
keys and values (fp16), the queries at the chosen positions and the teacher's attention distribution
there (fp16; per-span mass and output are sums over it). Positions are picked where attention reaches far
back (mass on tokens older than the recent window, averaged over layers and heads), plus the last one.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Collection, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from zoomkv import compat
from zoomkv.atomic import free_space, read_json_object
from zoomkv.data.training import Sample
from zoomkv.errors import ConfigError, ZoomKVError
from zoomkv.logs import human_bytes
from zoomkv.memory.pinned import to_device
from zoomkv.memory.replay import record_prefill, record_surprisal
from zoomkv.protocol.method import SCORES_AT_ONCE
from zoomkv.protocol.shape import ModelShape

CACHE_VERSION = 2  # 2: each layer's rotary table
# Written first into a folder the cache claims: a teacher cache writes (and rewrites) only inside a folder that
# was new or empty, or holds this mark (or, from before it, a meta.json of ours), never among a user's files.
CACHE_MARK = ".zoomkv-teacher-cache"
SAFETENSORS_ENTRY = 96  # header bytes a tensor takes in a sample file, about (name, dtype, shape, offsets)


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
    meta_path = folder / "meta.json"
    fingerprint = {**fingerprint, "version": CACHE_VERSION, "n": len(samples)}
    paths = [folder / f"sample_{i:05d}.safetensors" for i in range(len(samples))]
    if _recorded(meta_path) == fingerprint and all(_readable(p) for p in paths):
        return paths
    ids = [encode(tokenizer, sample.text) for sample in samples]
    shape = ModelShape.from_config(model.config)
    check_cache_space(folder, paths, [sample_bytes(shape, x.shape[1], n_queries, min_pos) for x in ids])
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / CACHE_MARK).is_file():
        (folder / CACHE_MARK).write_text("zoomkv teacher cache\n", encoding="utf-8")
    meta_path.unlink(missing_ok=True)
    for sample_ids, path in tqdm(list(zip(ids, paths, strict=True)), desc="teacher signals", disable=not show_progress):
        tensors = extract_sample(model, sample_ids, n_queries, min_pos, recent)
        tmp = path.with_suffix(".tmp")
        save_file(tensors, str(tmp))
        tmp.replace(path)
    meta_path.write_text(json.dumps(fingerprint, sort_keys=True))
    return paths


def sample_bytes(shape: ModelShape, t: int, n_queries: int, min_pos: int) -> int:
    """What ``extract_sample`` writes for a ``t``-token sample of a model of ``shape``: the ids and surprisal, and
    per compressed layer its keys and values (fp16), the chosen queries (fp32) and their attention rows (fp16)."""
    n = min(n_queries, t - min(max(min_pos, t // 2), t - 1))  # the candidates run from there to the last token
    hq, kv, d = shape.num_attention_heads, shape.num_kv_heads, shape.head_dim
    per_layer = 2 * kv * t * d * 2 + hq * n * d * 4 + hq * n * t * 2 + d // 2 * 4 + 8 + 6 * SAFETENSORS_ENTRY
    return t * (8 + 4) + n * 8 + len(shape.full_attention_layers) * (per_layer + 8) + 5 * SAFETENSORS_ENTRY


def check_cache_space(folder: Path, paths: list[Path], sizes: list[int]) -> None:
    """Before the first sample is extracted: the samples (``sizes`` bytes, to be written at ``paths``) fit in the
    space left where the cache goes, the files of an older cache they replace one by one counted as free. A cache
    that would fill the disk is refused now, not after hours of extraction."""
    where, free = free_space(folder)
    free += sum(p.stat().st_size for p in paths if p.is_file())
    need = sum(sizes) + max(sizes, default=0)  # and one sample's temporary file
    if need > free:
        raise ConfigError(f"recipe keys 'num_samples'/'max_length': the teacher signals of {len(sizes):,} samples "
                          f"take {human_bytes(sum(sizes))}, over the {human_bytes(free)} free in {where}; lower "
                          "num_samples or max_length, point teacher_cache at a larger disk, or free some space")


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


def load_sample(path: Path, device: torch.device | str = "cpu", layers: Collection[int] | None = None
                ) -> dict[str, torch.Tensor]:
    """A cached teacher sample, its tensors on ``device`` (the adapter's; a GPU's copies queued, the host not
    waiting for them) but those read as numbers. With ``layers``, only those layers' tensors are read (the rest
    stay on disk: a step of the 8B recipe trains 8 of 32) beside the sample's own (ids, surprisal, positions, the
    layer list)."""
    return place_sample(read_sample(path, layers), device)


def read_sample(path: Path, layers: Collection[int] | None = None) -> dict[str, torch.Tensor]:
    """``load_sample``'s tensors as read, on the host."""
    wanted = None if layers is None else {str(layer) for layer in layers}
    with _reading(path) as f:
        return {name: f.get_tensor(name) for name in f.keys()
                if wanted is None or not _per_layer(name) or name.rsplit(".", 1)[1] in wanted}


def place_sample(sample: dict[str, torch.Tensor], device: torch.device | str) -> dict[str, torch.Tensor]:
    """A sample read on the host, its tensors on ``device`` but those read as numbers."""
    return {name: tensor if _read_as_numbers(name) else to_device(tensor, device) for name, tensor in sample.items()}


class SampleReader:
    """Cached samples read from disk one ahead, on a thread, while the micro-batch before trains (``ahead``: on a
    GPU, where a read in place, up to ~0.6 GB a step at the 8B recipe's 16K tokens, leaves the device idle). A
    sample is placed on ``device`` when asked for, the tensors ``load_sample`` gives; one not read ahead is read
    then."""

    def __init__(self, device: torch.device | str, ahead: bool = True):
        self.device = device
        self.ahead_used = 0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zoomkv-samples") if ahead else None
        self._ahead: tuple[tuple[Path, tuple[int, ...]], Future] | None = None

    @property
    def reads_ahead(self) -> bool:
        return self._pool is not None

    def read_ahead(self, path: Path, layers: Collection[int]) -> None:
        if self._pool is not None:
            self._ahead = ((path, tuple(layers)), self._pool.submit(read_sample, path, layers))

    def load(self, path: Path, layers: Collection[int]) -> dict[str, torch.Tensor]:
        ahead, self._ahead = self._ahead, None
        if ahead is None or ahead[0] != (path, tuple(layers)):
            return load_sample(path, self.device, layers)
        self.ahead_used += 1
        return place_sample(ahead[1].result(), self.device)

    def __enter__(self) -> SampleReader:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


def sample_layers(path: Path) -> list[int]:
    """The layers a cached teacher sample holds, read without the rest of it."""
    with _reading(path) as f:
        return f.get_tensor("layers").tolist()


@contextlib.contextmanager
def _reading(path: Path) -> Iterator[Any]:
    """A sample file open for reading its tensors one by one; one line for a file that cannot be read."""
    try:
        with safe_open(str(path), framework="pt") as f:
            yield f
    except (OSError, SafetensorError) as err:
        raise ZoomKVError(f"teacher sample {path} cannot be read (corrupt or truncated: "
                          f"{str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__}); "
                          f"delete {path.parent} to extract the teacher signals again") from None


def _read_as_numbers(name: str) -> bool:
    """What the objectives read as Python numbers (the token count, the query positions, the layer list, the
    scales): kept on the host, where a GPU would wait for every read."""
    return name in ("ids", "positions", "layers", "scaling") or name.startswith("rotary_scaling.")


def _per_layer(name: str) -> bool:
    """A tensor of one layer's (``k.12``, ``attn.12``, ``rotary_inv_freq.12``), not of the whole sample."""
    return "." in name and name.rsplit(".", 1)[1].isdigit()


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
