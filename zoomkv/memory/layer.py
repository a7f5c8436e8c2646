"""``LayerMemory``: one full-attention layer's share of a ``ZoomCache``.

It is a transformers cache layer (``CacheLayerMixin``) so ``generate()`` can drive it, but the rows it
holds are the method's business: ``update`` only records that tokens arrived; the zoomkv attention
function (``zoomkv.memory.attention``) then calls the method's ``compress`` at prefill and
``append``/``select`` at each decode step.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import CacheLayerMixin

from zoomkv.memory import pinned as pinned_memory
from zoomkv.memory.quant import row_buffer
from zoomkv.memory.tiers import RowBuffer, Tier

HOST_ROOM = 256  # rows a GPU machine's pinned host buffers hold past the prompt


class LayerMemory(CacheLayerMixin):
    """One full-attention layer of a ``ZoomCache``: the method's rows in two counted tiers.

    ``device_tier`` and ``host_tier`` hold the tensors the method stores (every one counted in
    ``memory_report()``), ``meta`` its Python values; ``host_rows``, ``device_rows_buffer`` and ``device_buffer``
    make buffers in the right tier (pinned host memory on CUDA, coded rows when the cache quantizes KV). It is a
    transformers cache layer, but ``update`` only counts the tokens: the zoomkv attention function calls the
    method's ``compress``, ``append`` and ``select``."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, layer_idx: int, cache: Any):  # the ZoomCache that owns it (cache.py builds layers)
        super().__init__()
        self.layer_idx = layer_idx
        self.cache = cache
        self.seen = 0  # true number of tokens this layer has been given (positions continue from here)
        self.compressed = False
        self.device_tier = Tier("device", torch.device("cpu"))
        self.host_tier = Tier("host", torch.device("cpu"))
        self.meta: dict[str, Any] = {}
        self.batch = self.kv_heads = self.key_dim = self.value_dim = 0
        self.dtype = torch.float32
        self.max_device_rows = 0  # the most device-tier rows per KV head seen at any decode step
        # High-water marks of the device tier, counting KV rows attended exactly in passing (the prompt at a
        # one-shot prefill; a chunk or a turn going through): what peak memory really is.
        self.peak_device_bytes = 0
        self.peak_device_rows = 0

    def __repr__(self) -> str:
        return f"LayerMemory(layer={self.layer_idx}, seen={self.seen}, method={self.cache.method.name})"

    # -- transformers' cache-layer protocol ----------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Take the batch, KV heads, head sizes, dtype and device from the layer's first keys and values."""
        self.device = key_states.device
        self.device_tier.device = key_states.device
        self.batch, self.kv_heads, _, self.key_dim = key_states.shape
        self.value_dim = value_states.shape[-1]
        self.dtype = key_states.dtype
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        """Count the tokens that arrived and hand them back: the method, not transformers, decides what is stored."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.seen += key_states.shape[2]
        # The zoomkv attention function reads the method's rows; what we return is what exact attention
        # over this call's tokens needs (the prompt at prefill), or the new row while decoding.
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """Masks span every true position: the tokens seen so far plus the new ones."""
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        """Tokens this layer has been given (true positions, whatever the method keeps)."""
        return self.seen

    def get_max_length(self) -> int:
        """No fixed maximum (-1)."""
        return -1

    def reset(self) -> None:
        """Forget every row and statistic: the layer as built."""
        self.seen = 0
        self.compressed = False
        self.device_tier.clear()
        self.host_tier.clear()
        self.meta.clear()
        self.max_device_rows = 0
        self.peak_device_bytes = 0
        self.peak_device_rows = 0
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        """Refused: compressed rows cannot be un-seen."""
        raise NotImplementedError("a ZoomCache cannot be cropped: compressed rows cannot be un-seen")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Refused: beam search is not supported."""
        raise NotImplementedError("beam search is not supported with a ZoomCache; use greedy or sampling")

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Refused: ``num_return_sequences > 1`` is not supported."""
        raise NotImplementedError("num_return_sequences > 1 is not supported with a ZoomCache")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Refused: batch selection is not supported."""
        raise NotImplementedError("batch selection is not supported with a ZoomCache")

    def offload(self) -> None:  # tiers are managed by the method, not by transformers' offloading
        """Nothing: the method manages the tiers, not transformers' offloading."""
        pass

    def prefetch(self) -> None:
        """Nothing: the method manages the tiers, not transformers' offloading."""
        pass

    # -- helpers for methods ---------------------------------------------------------------------------
    @property
    def pin_host(self) -> bool:
        """Whether host-tier copies are pinned (on a CUDA machine, so recalls copy back without blocking)."""
        return self.device.type == "cuda"

    def to_host(self, tensor: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        """A host-tier copy (pinned on a CUDA machine, so recalls can copy back without blocking;
        ``non_blocking``: the copy from the GPU is queued, and only stream-ordered GPU work may read it)."""
        if tensor.device.type == "cpu" and not self.pin_host:
            return tensor.contiguous()
        out = pinned_memory.empty(tensor.shape, tensor.dtype) if self.pin_host else \
            torch.empty(tensor.shape, dtype=tensor.dtype)
        out.copy_(tensor, non_blocking=non_blocking and self.pin_host and tensor.is_cuda)
        return out

    @property
    def host_room(self) -> int:
        """Rows a pinned host buffer holds past the ones it is made with: ``HOST_ROOM`` for the decode steps, and the
        rest of a prompt prefilled in pieces (``ZoomCache.rows_to_come``)."""
        return HOST_ROOM + getattr(self.cache, "rows_to_come", 0)

    def host_rows(self, tensor: torch.Tensor, quantize: bool = True, role: str = "rows") -> RowBuffer:
        """A growable host-tier row buffer initialised with ``tensor`` (``[b, h, n, d]``); codes when the cache
        quantizes KV, coded as the format says for ``role`` (``"keys"``, ``"values"``, or other ``"rows"``) of
        this layer (masks and other non-float tensors are never quantized, nor rows a method stores with
        ``quantize=False``: its own codes' scales, which are not KV)."""
        spec = self.cache.kv_quant
        if spec is not None and quantize and tensor.is_floating_point() and tensor.shape[-1]:  # 0 wide: nothing to code
            rows_spec = spec.for_rows(role, self.layer_idx)
            # per-token codes of a GPU's rows are made on the GPU and only the codes cross to the host (the
            # prompt's bf16 rows would otherwise be coded by torch's ops on the host: minutes at 32 x 32K tokens)
            on_device = tensor.is_cuda and self.pin_host and rows_spec.layout == "token" and not rows_spec.outliers
            coded = row_buffer(tensor if on_device else self.to_host(tensor), rows_spec, pinned=self.pin_host,
                               open_device=self.device, room=self.host_room if self.pin_host else 0)
            if self.pin_host:  # room, as below (a per-token buffer was made with it)
                coded.reserve(self.host_room)
            return coded
        if self.pin_host and tensor.is_cuda:
            # Room for the next rows, which a GPU step writes without waiting: growing copies on the host, after
            # waiting for the copies in flight (once per HOST_ROOM rows or ~3%, not per step).
            return RowBuffer.with_room(tensor, self.host_room, pinned=True)
        return RowBuffer(self.to_host(tensor), pinned=self.pin_host)

    @property
    def quantize_device(self) -> bool:
        """Whether the device tier's rows are quantized too (``--kv-quant-tiers all``, e.g. ``full+int8``)."""
        return self.cache.kv_quant is not None and self.cache.kv_quant.tiers == "all"

    def device_rows_buffer(self, tensor: torch.Tensor, role: str = "rows", room: int = 0) -> RowBuffer:
        """Device-tier rows that grow while decoding, quantized (as ``role``, keys or values) when the cache
        quantizes every tier; ``room``: rows allocated past them, written in place by the next appends."""
        if self.quantize_device and tensor.is_floating_point() and role in ("keys", "values"):
            return row_buffer(tensor, self.cache.kv_quant.for_rows(role, self.layer_idx))
        return RowBuffer.with_room(tensor, room)

    def device_buffer(self, rows: int, dim: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A preallocated device-tier buffer for ``rows`` recalled rows per KV head."""
        return torch.empty(self.batch, self.kv_heads, rows, dim, dtype=dtype or self.dtype, device=self.device)

    @property
    def device_bytes(self) -> int:
        """Bytes on this layer's device tier."""
        return self.device_tier.nbytes

    @property
    def host_bytes(self) -> int:
        """Bytes on this layer's host tier."""
        return self.host_tier.nbytes

    @property
    def full_kv_bytes(self) -> int:
        """What transformers' DynamicCache would hold for the same tokens."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.batch * self.kv_heads * self.seen * (self.key_dim + self.value_dim) * elem
