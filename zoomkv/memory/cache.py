"""``ZoomCache``: a transformers ``Cache`` whose full-attention layers are ``LayerMemory``s run by a KV method.

    cache = ZoomCache(model, method="oracle_topk", budget=256)
    out = model.generate(**inputs, **generate_cache_kwargs(cache))   # i.e. cache=cache / past_key_values=cache
    print(cache.memory_report().format())

Sliding-window layers of hybrid models (Gemma 3) keep transformers' own sliding-window layer: they are
already bounded, so they pass through untouched (and are reported as device-tier bytes).
"""

from __future__ import annotations

import functools
import threading
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicSlidingWindowLayer

from zoomkv import compat
from zoomkv.budget import Budget
from zoomkv.errors import ConfigError, ZoomKVError
from zoomkv.memory import graphs, speculation
from zoomkv.memory.attention import ATTENTION_NAME, finish_prefill, mark_active
from zoomkv.memory.diagnostics import SelectionProbe
from zoomkv.memory.layer import LayerMemory
from zoomkv.memory.quant import QuantSpec
from zoomkv.memory.spec import CacheSpec
from zoomkv.memory.surprisal import token_surprisal
from zoomkv.protocol.method import KVMethod


@dataclass
class LayerReport:
    """One layer's line of a ``MemoryReport``: its kind and its bytes per tier."""

    layer: int
    kind: str  # "zoom" (run by the method), "dense" (kept whole by the method's design), "sliding" (untouched)
    device_bytes: int
    host_bytes: int
    full_kv_bytes: int
    max_device_rows: int  # per KV head, over all decode steps so far (zoom layers)
    peak_device_bytes: int = 0  # high-water mark, KV attended in passing included (the prompt, a chunk, a turn)
    peak_device_rows: int = 0  # the same in rows per KV head (zoom layers)


@dataclass
class MemoryReport:
    """What a ``ZoomCache`` holds, per layer and in total (``cache.memory_report()``).

    Bytes of the device tier (the accelerator, or the CPU without one: the rows a step attends to, the method's
    index) and of the host tier (CPU memory: the rows a recallable method keeps), next to what transformers' own
    cache would hold for the same tokens (``full_kv_bytes``); KV only, no weights. ``format()`` prints it,
    ``to_dict()`` is the ``--json`` form."""

    method: str
    budget: int | None
    tokens: int
    layers: list[LayerReport] = field(default_factory=list)

    @property
    def device_bytes(self) -> int:
        """Bytes on the device tier, summed over layers."""
        return sum(r.device_bytes for r in self.layers)

    @property
    def host_bytes(self) -> int:
        """Bytes on the host tier, summed over layers (quantized rows at their coded size)."""
        return sum(r.host_bytes for r in self.layers)

    @property
    def full_kv_bytes(self) -> int:
        """What transformers' own cache would hold for the same tokens, at the model's dtype."""
        return sum(r.full_kv_bytes for r in self.layers)

    @property
    def peak_device_bytes(self) -> int:
        """Sum of the layers' device-tier high-water marks: an upper bound of the KV bytes the device held at
        once (layers peak one after another while a prompt goes through)."""
        return sum(r.peak_device_bytes for r in self.layers)

    @property
    def peak_device_rows(self) -> int:
        """The most device rows per KV head any compressed layer held at any moment, rows attended in passing
        included (dense layers, which a method keeps whole by design, and sliding layers are left out)."""
        return max((r.peak_device_rows for r in self.layers if r.kind == "zoom"), default=0)

    def totals(self) -> dict[str, int]:
        """The totals over layers: device, host and full-KV bytes, and the device tier's peaks."""
        return {"device_bytes": self.device_bytes, "host_bytes": self.host_bytes, "full_kv_bytes": self.full_kv_bytes,
                "peak_device_bytes": self.peak_device_bytes, "peak_device_rows": self.peak_device_rows}

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON values: method, budget, tokens, the totals and every layer's line."""
        return {
            "method": self.method,
            "budget": self.budget,
            "tokens": self.tokens,
            **self.totals(),
            "layers": [asdict(r) for r in self.layers],
        }

    def format(self) -> str:
        """The report as a few lines of text: each tier in MiB and as a share of full KV."""
        full = max(self.full_kv_bytes, 1)
        budget = f"budget {self.budget if self.budget is not None else '-'} rows"
        if self.budget is not None and self.layers and not any(r.kind == "zoom" for r in self.layers):
            budget += " held by no layer: every layer kept whole"  # (quest with dense_layers >= the layers)
        lines = [
            f"memory ({self.method}, {budget}, {self.tokens} tokens):",
            f"  device tier {_mib(self.device_bytes):>10}  ({self.device_bytes / full:6.1%} of full KV)",
            f"  host tier   {_mib(self.host_bytes):>10}  ({self.host_bytes / full:6.1%} of full KV)",
            f"  full KV     {_mib(self.full_kv_bytes):>10}",
            f"  device peak {_mib(self.peak_device_bytes):>10}  ({self.peak_device_bytes / full:6.1%} of full KV; "
            f"{self.peak_device_rows} rows per KV head at most, rows attended in passing included)",
        ]
        return "\n".join(lines)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


class ZoomCache(Cache):
    """The KV cache ``model.generate()`` runs with: each full-attention layer a ``LayerMemory`` whose rows a
    KV method keeps within B device rows per KV head, the rest on the host tier.

    ``ZoomCache(model, spec)`` with a ``CacheSpec``, or ``ZoomCache(model, "quest", 256, kv_quant="int8", ...)``:
    the same keywords as ``CacheSpec.build``, which makes the spec. Building one attaches zoomkv's attention to
    the model (run without a ``ZoomCache``, an attached model is plain sdpa). Pass it with
    ``model.generate(**inputs, **generate_cache_kwargs(cache))``; ``memory_report()`` gives its bytes per tier;
    a second ``generate()`` with the same cache and longer ``input_ids`` extends the compressed context.
    ``prefill_chunk=N`` puts long prompts through in pieces of N tokens; ``tokenizer=`` lets methods read
    token classes; ``diagnose=True`` scores each step's selection against full attention."""

    def __init__(
        self,
        model_or_config: Any,
        method: str | KVMethod | CacheSpec = "full",
        budget: str | int | float | Budget | None = None,
        *,
        tokenizer: Any = None,
        diagnose: bool = False,
        **options: Any,
    ):
        config = getattr(model_or_config, "config", model_or_config)
        if isinstance(method, CacheSpec):
            if budget is not None or options:
                raise ConfigError("a CacheSpec carries the budget and every option: give them to it, not to ZoomCache")
            self.spec = method
        else:
            self.spec = CacheSpec.build(method, budget, **options)
        self.spec.check_model(model_or_config)  # the model itself: its registry name (zoomkv_name) is the base name
        self.method = self.spec.method
        self.budget_rows: int | None = None  # resolved at prefill
        self.tokenizer = tokenizer
        # diagnose: every decode step's selection scored against full attention (zoomkv.memory.diagnostics)
        self.probe = SelectionProbe(lambda: self.budget_rows) if diagnose else None
        self.prompt_ids: torch.Tensor | None = None  # set by the model's forward pre-hook (see attach)
        self.step_ids: torch.Tensor | None = None  # ids of the forward in progress: the prompt, then each token
        # rows a chunked prefill stores after its first piece: a pinned host tier makes room for them at once, where
        # growing a piece at a time would page-lock and copy the whole buffer again for every piece
        self.rows_to_come = 0
        self.pending: dict[int, Any] = {}  # layers waiting for surprisal before they compress
        # Each attention module's input at the decode step in progress (methods that look a layer ahead).
        self.attention_inputs: dict[int, Any] = {}
        self.model_name: str | None = getattr(model_or_config, "zoomkv_name", None) or getattr(
            config, "_name_or_path", None
        )
        types = compat.layer_types(config)
        layers: list[Any] = []
        for i, kind in enumerate(types):
            if kind == "full_attention":
                layers.append(LayerMemory(i, self))
            elif kind in ("sliding_attention", "chunked_attention"):
                layers.append(DynamicSlidingWindowLayer(sliding_window=compat.sliding_window(config)))
            else:
                raise NotImplementedError(f"layer type {kind!r} (layer {i}) is not supported by ZoomCache")
        self.num_layers_total = len(layers)
        self.zoom_layer_indices = tuple(i for i, layer in enumerate(layers) if isinstance(layer, LayerMemory))
        self.num_zoom_layers = len(self.zoom_layer_indices)
        # Each compressed layer's rotary table (PrefillContext.rotary), for methods that work before RoPE. A
        # table depends only on the layer's type: built once per type (~2 ms each), not once per layer.
        by_type: dict[str, tuple[torch.Tensor, float] | None] = {}
        self.rotary = {}
        for i in self.zoom_layer_indices:
            if types[i] not in by_type:
                by_type[types[i]] = compat.rotary_frequencies(config, i)
            self.rotary[i] = by_type[types[i]]
        super().__init__(layers=layers)
        if hasattr(model_or_config, "config"):
            attach(model_or_config)

    # transformers calls this right before the attention function of the same layer
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        """transformers' cache call before a layer's attention: marks a compressed layer active, then stores as the layer does."""
        if isinstance(self.layers[layer_idx], LayerMemory):
            mark_active(self, layer_idx)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def zoom_layer(self, layer_idx: int) -> LayerMemory | None:
        """Layer ``layer_idx``'s ``LayerMemory``, or None for a sliding-window layer (passed through untouched)."""
        layer = self.layers[layer_idx]
        return layer if isinstance(layer, LayerMemory) else None

    @property
    def budget(self) -> Budget | None:
        """The budget as given (rows or a share of the prompt); None for a method without one."""
        return self.spec.budget

    @property
    def tail_summary(self) -> bool:
        """Whether each step adds the softmax-tail row (one of the B rows)."""
        return self.spec.tail_summary

    @property
    def kv_quant(self) -> QuantSpec | None:
        """The host tier's KV format (``int8``, ``kivi4``, ...), None for full precision."""
        return self.spec.kv_quant

    @property
    def prefill_chunk(self) -> int | None:
        """Longer inputs go through in pieces of this many tokens, compressed as they go (_prefill_in_chunks)."""
        return self.spec.prefill_chunk

    def resolve_budget(self, context_length: int) -> int | None:
        """The budget in rows for a prompt of ``context_length`` tokens, fixed at the first prefill and checked against the method."""
        if self.budget is None:
            return None
        if self.budget_rows is None:
            self.budget_rows = self.budget.resolve(context_length)
            self.method.check_budget(self.spec.method_budget(self.budget_rows))
        return self.budget_rows

    def memory_report(self) -> MemoryReport:
        """Bytes per tier of every layer now, next to full KV (see ``MemoryReport``)."""
        report = MemoryReport(method=self.method.name, budget=self.budget_rows, tokens=self.get_seq_length())
        for i, layer in enumerate(self.layers):
            if isinstance(layer, LayerMemory):
                kind = "dense" if self.method.dense_layer(i, self.num_layers_total) else "zoom"
                report.layers.append(
                    LayerReport(i, kind, layer.device_bytes, layer.host_bytes, layer.full_kv_bytes, layer.max_device_rows,
                                max(layer.peak_device_bytes, layer.device_bytes), layer.peak_device_rows)
                )
            else:
                held = 0
                if getattr(layer, "is_initialized", False) and layer.keys is not None:
                    held = layer.keys.nbytes + layer.values.nbytes
                report.layers.append(LayerReport(i, "sliding", held, 0, held, 0, held, 0))
        return report

    @property
    def max_device_rows(self) -> int:
        """The most device rows per KV head any compressed layer held at a decode step so far."""
        return max((layer.max_device_rows for layer in self.layers if isinstance(layer, LayerMemory)), default=0)

    def release(self) -> None:
        """Free every tensor this cache holds now; for a caller done with it (its report read). The cache
        cannot be used afterwards.

        Why not just drop the last reference: a ZoomCache and its ``LayerMemory``s point at each other
        (``layer.cache``), and a selection probe's budget callback closes over the cache, so the cache is
        in reference cycles that refcounting never frees. It then waits for Python's cyclic GC, whose
        full collections are rare in a process holding a model (one runs only once the objects that
        survived since the last one are a quarter of all long-lived objects): a long ``zoomkv eval`` kept
        every prompt's dead caches (host tiers with all KV, the prefill record's queries) and grew by GBs.
        Emptying ``layers`` breaks the cycles: the layers and their tiers go at once, the shell with the
        caller's last reference."""
        self.layers.clear()
        self.probe = None
        self.pending.clear()
        self.attention_inputs.clear()
        self.prompt_ids = self.step_ids = None
        self.__dict__.pop("recorder", None)  # zoomkv.memory.replay's prefill contexts (the record keeps its own)
        self.__dict__.pop("surprisal", None)
        if getattr(_running, "cache", None) is self:  # the last forward's pointer must not keep even the shell
            _running.cache = None


def attach(model: torch.nn.Module) -> torch.nn.Module:
    """Route the model's attention through zoomkv. Without a ZoomCache it still behaves as plain sdpa.

    Also hooks the model's forward so a ZoomCache learns the prompt's token ids before prefill (methods
    that protect numbers or cut sentences need them; the attention function only sees hidden states).
    """
    compat.set_attention(model, ATTENTION_NAME)
    if not getattr(model, "_zoomkv_hooked", False):
        model.register_forward_pre_hook(_capture_prompt_ids, with_kwargs=True)
        norm = compat.final_norm(model)
        if norm is not None:
            norm.register_forward_hook(functools.partial(_after_final_norm, model))
        model._zoomkv_hooked = True
    if not getattr(model, "_zoomkv_attention_hooked", False):
        for module in model.modules():
            if hasattr(module, "q_proj") and hasattr(module, "layer_idx") and hasattr(module, "head_dim"):
                module.register_forward_pre_hook(_capture_attention_input, with_kwargs=True)
        model._zoomkv_attention_hooked = True
    if not getattr(model, "_zoomkv_layers_hooked", False):
        for module in model.modules():  # decoder layers: their decode step may replay from a CUDA graph
            attention = getattr(module, "self_attn", None)
            if isinstance(getattr(attention, "layer_idx", None), int) and "forward" not in module.__dict__:
                module.forward = functools.partial(_decoder_layer, module.forward, attention.layer_idx)
        model._zoomkv_layers_hooked = True
    return model


def _decoder_layer(forward: Any, layer_idx: int, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """A decoder layer's forward: a compressed layer's decode step goes through ``graphs.layer`` (one CUDA graph
    where it can be), everything else as it was."""
    cache = getattr(_running, "cache", None)
    memory = cache.zoom_layer(layer_idx) if cache is not None else None
    if memory is None or not memory.compressed or hidden_states.shape[1] != 1 or layer_idx in cache.pending:
        return forward(hidden_states, *args, **kwargs)
    return graphs.layer(cache, memory, forward, hidden_states, args, kwargs)


def _capture_attention_input(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    cache = getattr(_running, "cache", None)
    if cache is not None and getattr(cache.method, "needs_attention_inputs", False):
        speculation.capture(cache, module, args, kwargs)


_running = threading.local()  # the ZoomCache of the forward pass in progress


def _capture_prompt_ids(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> Any:
    cache = next((kwargs.get(name) for name in ("cache", "past_key_values") if kwargs.get(name) is not None), None)
    _running.cache = cache if isinstance(cache, ZoomCache) else None
    if not isinstance(cache, ZoomCache):
        return None
    ids = kwargs.get("input_ids", args[0] if args and isinstance(args[0], torch.Tensor) else None)
    chunk = cache.prefill_chunk
    if chunk and ids is not None and ids.shape[1] > chunk and not getattr(_running, "chunking", False):
        split = _prefill_in_chunks(module, cache, args, kwargs, ids, chunk)
        if split is not None:
            return split
    cache.step_ids = ids
    if cache.get_seq_length() == 0:
        cache.prompt_ids = ids
    return None


def _prefill_in_chunks(model: torch.nn.Module, cache: ZoomCache, args: tuple, kwargs: dict[str, Any],
                       ids: torch.Tensor, chunk: int) -> tuple[tuple, dict[str, Any]] | None:
    """Run all but the last ``chunk``-sized piece of a long input through the model first, one piece per
    forward (the first is the prefill the method compresses, each next one extends the compressed cache),
    and hand the model's own forward only the last piece: the device tier then never holds more than the
    budget plus one piece per layer. With ``full`` the result equals the one-shot prefill."""
    total = ids.shape[1]
    if cache.get_seq_length() == 0:
        cache.resolve_budget(total)  # a fractional budget is of the whole prompt, not of its first piece
    mask, pos, cpos = kwargs.get("attention_mask"), kwargs.get("position_ids"), kwargs.get("cache_position")
    if mask is not None and mask.dim() != 2:
        raise ZoomKVError("chunked prefill needs a 2D attention mask (batch x tokens)")
    past = mask.shape[1] - total if mask is not None else 0
    # Left padding must go through in the first piece (later pieces are stored as real rows): it starts
    # with the padding and is at least `chunk` long.
    first = chunk
    if mask is not None and cache.get_seq_length() == 0:
        first = max(first, int((mask[:, past:] == 0).sum(dim=1).max()) + 1)
    starts = [0, *range(first, total, chunk)]
    last = starts[-1]  # where the last piece starts: the model's own forward runs it
    if last == 0:
        return None  # the padding needs the whole input in one piece
    _running.chunking = True
    if cache.get_seq_length() == 0:
        cache.rows_to_come = total - starts[1]
    try:
        for start, end in zip(starts, starts[1:], strict=False):
            piece = {k: v for k, v in kwargs.items() if k not in ("input_ids", "inputs_embeds")}
            piece["input_ids"] = ids[:, start:end]
            if mask is not None:
                piece["attention_mask"] = mask[:, : past + end]
            if pos is not None:
                piece["position_ids"] = pos[:, start:end]
            if cpos is not None:
                piece["cache_position"] = cpos[start:end]
            piece["use_cache"] = True
            piece["logits_to_keep"] = 1
            model(**piece)
    finally:
        _running.chunking = False
        cache.rows_to_come = 0
    _running.cache = cache
    rest = ids[:, last:]
    kwargs = dict(kwargs)
    if "input_ids" in kwargs or not args:
        kwargs["input_ids"] = rest
    else:
        args = (rest, *args[1:])
    if pos is not None:
        kwargs["position_ids"] = pos[:, last:]
    if cpos is not None:
        kwargs["cache_position"] = cpos[last:]
    cache.step_ids = rest
    return args, kwargs


def _after_final_norm(model: torch.nn.Module, module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
    """After the prompt went through every layer: surprisal from the final hidden states, then compress
    the layers that waited for it."""
    cache = getattr(_running, "cache", None)
    if cache is None or not cache.pending:
        return
    ids = cache.prompt_ids
    if ids is None:
        raise ZoomKVError(f"method {cache.method.name!r} needs the prompt's token ids (input_ids), not embeddings")
    valid = next(iter(cache.pending.values())).valid
    cache.surprisal = token_surprisal(
        output, ids, model.get_output_embeddings(), valid=valid,
        softcap=getattr(compat.text_config(model.config), "final_logit_softcapping", None), fast=True,
    )
    finish_prefill(cache, cache.surprisal)
