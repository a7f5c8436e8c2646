"""The method interface: what a KV method does at prefill (``compress``) and at each decode step
(``append`` the new row, then ``select`` the rows to attend to).

A method object holds only hyper-parameters. Everything it stores per layer goes into that layer's
``LayerMemory``: tensors into ``memory.device_tier`` or ``memory.host_tier`` (so they are counted in the
memory report), small Python values into ``memory.meta``.
"""

from __future__ import annotations

import dataclasses
import decimal
import math
import types
import typing
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch

from zoomkv.errors import BudgetError, ConfigError


class RowBufferLike(Protocol):
    """A growable row buffer (either tier) as a method sees it (``zoomkv.memory.tiers.RowBuffer``, or its quantized kind):
    ``view()`` is every row held, ``gather(idx)`` only rows ``idx`` (the quantized kind decodes only those)."""

    length: int

    def view(self) -> torch.Tensor:
        """Every row held, ``[batch, kv_heads, n, dim]`` (a quantized buffer decodes them all)."""

    def gather(self, idx: torch.Tensor | None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``idx`` (``[batch, kv_heads, k]``) only; ``None``: every row; into ``out`` when given."""

    def gather_to_slots(self, idx: torch.Tensor, dest: torch.Tensor, fetch: torch.Tensor, out: torch.Tensor) -> None:
        """Rows ``idx`` into ``out``'s slots ``dest`` where ``fetch`` (``[batch, kv_heads, k]`` each); the other
        slots keep what they hold (``zoomkv.protocol.recallable.plan_swaps`` plans them)."""

    def append(self, rows: torch.Tensor) -> None:
        """Add rows at the end (``[batch, kv_heads, m, dim]``), growing the buffer as needed."""


class Memory(Protocol):
    """What a method sees of one layer's memory (``zoomkv.memory.layer.LayerMemory`` is the real one): the two
    tiers it stores tensors in, small Python values in ``meta``, and the buffer factories that put a tensor
    in the right tier (pinned host memory on CUDA, quantized rows when asked)."""

    layer_idx: int
    device_tier: dict[str, Any]
    host_tier: dict[str, Any]
    meta: dict[str, Any]
    key_dim: int
    value_dim: int
    dtype: torch.dtype

    def host_rows(self, tensor: torch.Tensor, quantize: bool = True, role: str = "rows") -> RowBufferLike:
        """A growable host-tier buffer holding ``tensor``, coded as the cache's KV format says for ``role``."""

    def device_rows_buffer(self, tensor: torch.Tensor, role: str = "rows", room: int = 0) -> RowBufferLike:
        """A growable device-tier buffer holding ``tensor`` (coded only when every tier is quantized), with
        ``room`` rows allocated past it."""

    def device_buffer(self, rows: int, dim: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A preallocated device-tier tensor for ``rows`` rows per KV head."""


@dataclass
class PrefillContext:
    """What the runtime hands a method once the prompt went through a layer with exact attention."""

    layer_idx: int
    num_layers: int
    keys: torch.Tensor  # [batch, kv_heads, T, head_dim], after RoPE
    values: torch.Tensor  # [batch, kv_heads, T, head_dim]
    queries: torch.Tensor  # [batch, q_heads, T, head_dim], after RoPE: methods slice an observation window
    valid: torch.Tensor | None  # [batch, T] bool, False on left padding; None when nothing is padded
    budget: int | None  # rows per KV head on the device tier; None for methods without a budget
    scaling: float
    num_kv_groups: int  # query heads per KV head
    zoom_layers: tuple[int, ...] | None = None  # indices of the layers the cache compresses (None: all)
    input_ids: torch.Tensor | None = None  # [batch, T] prompt token ids (None if the forward got embeddings)
    tokenizer: Any = None  # the model's tokenizer when the caller gave ZoomCache one (token classes, punctuation)
    model_name: str | None = None  # what the model was loaded as (calibration profiles are keyed on it)
    surprisal: torch.Tensor | None = None  # [batch, T] nats, only for methods with needs_surprisal
    # the layer's rotary table (inv_freq [head_dim / 2], scaling; zoomkv.protocol.rotary), for methods that
    # work on keys before RoPE; None when the model's RoPE is not one the runtime can rebuild
    rotary: tuple[torch.Tensor, float] | None = None
    # Statistics of this prefill alone (e.g. H2O's accumulated attention), kept for other methods and budgets
    # replaying the same prefill (zoomkv.memory.replay shares the dict between its copies of the context).
    derived: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class Selection:
    """The rows one decode step attends to, per KV head: one softmax over all of them.

    ``bias`` is added to each row's logit (``-inf`` hides a row, ``log n`` lets one summary row stand
    for n). ``use_model_mask`` says the rows are exactly the sequence in order, so the model's own
    attention mask applies as is (only ``full`` does this).
    """

    keys: torch.Tensor  # [batch, kv_heads, k, head_dim] on the device tier
    values: torch.Tensor
    bias: torch.Tensor | None = None  # [batch, kv_heads, k]
    use_model_mask: bool = False


@dataclass
class MethodConfig:
    """Base of every method's hyper-parameter dataclass."""

    def to_dict(self) -> dict[str, Any]:
        """The hyper-parameters as a dict."""
        return dataclasses.asdict(self)


def value_fits(hint: Any, value: Any) -> bool:
    """Whether ``value`` has the type a config field declares (``int``, ``float``, ``str``, ``bool``, unions
    with None, ``tuple[int, ...]``); an int is a float, a bool is not an int. Method configs and training
    recipes are both checked with it."""
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return any(value_fits(a, value) for a in args)
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if typing.get_origin(hint) is tuple:
        inner = args[0] if args else Any
        return isinstance(value, tuple | list) and all(value_fits(inner, v) for v in value)
    if hint is Any or not isinstance(hint, type):
        return True
    return isinstance(value, hint)


def _allowed(hint: Any) -> tuple[Any, ...]:
    """The types a field's hint lets through (``float | None`` → float, NoneType)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return typing.get_args(hint)
    return (hint,)


# An exponent past this is no count anything runs to; int() of it would build a number of that many digits.
_MAX_EXPONENT = 4000


def coerce_number(hint: Any, value: Any, name: str) -> Any:
    """``value`` as the number a field of type ``hint`` takes, when it came as text that is one: PyYAML reads
    YAML 1.1, where ``1e-3`` (an exponent without a dot) is a string, so ``lr: 1e-3`` in a recipe and
    ``lr=1e-3`` on a command line arrive as ``'1e-3'``. A float field takes what Python's ``float()`` takes,
    finite; a whole-number field a whole number however written (``1e6``). A field that takes text keeps
    it; anything else is returned as it is, for the type check to name. ``name`` says what the value is
    for in the one-line error (``recipe key 'lr'``)."""
    if not isinstance(value, str) or value_fits(hint, value):
        return value
    allowed = _allowed(hint)
    text = value.strip()
    if float in allowed:
        try:
            number = float(text)
        except ValueError:
            return value
        if not math.isfinite(number):  # 1e400 is out of range, not of the wrong type
            raise ConfigError(f"{name} must be a finite number, got {value!r}")
        return number
    if int in allowed:
        try:
            exact = decimal.Decimal(text)
        except decimal.InvalidOperation:
            return value
        if not exact.is_finite() or exact != exact.to_integral_value():
            return value
        if exact.adjusted() > _MAX_EXPONENT:
            raise ConfigError(f"{name} must be a whole number of at most {_MAX_EXPONENT} digits, got {value!r}")
        return int(exact)
    return value


def coerce_hyperparameters(config_class: type, values: dict[str, Any], method: str) -> dict[str, Any]:
    """``values`` with numbers given as text (``--method-arg tau=1e-3``) made numbers, field by field."""
    hints = typing.get_type_hints(config_class)
    return {k: coerce_number(hints[k], v, f"hyper-parameter {k!r} of method {method!r}") if k in hints else v
            for k, v in values.items()}


def check_hyperparameters(config_class: type, values: dict[str, Any], method: str) -> None:
    """A hyper-parameter of the wrong type fails here, naming it, instead of deep inside a step."""
    hints = typing.get_type_hints(config_class)
    for name, value in values.items():
        hint = hints.get(name)
        if hint is not None and not value_fits(hint, value):
            wanted = getattr(hint, "__name__", None) or str(hint)
            raise ConfigError(f"hyper-parameter {name!r} of method {method!r} must be {wanted}, "
                              f"got {type(value).__name__} {value!r}")


def kv_rows(value: object) -> int:
    """Rows per KV head a device-tier KV buffer (a tensor or a row buffer) occupies: its allocated capacity,
    since that is what is held."""
    if value is None:
        return 0
    if isinstance(value, torch.Tensor):
        return value.shape[2]
    return value.capacity


class KVMethod:
    """Base class of a KV method: what the runtime asks of every method, and the defaults.

    Subclasses set ``name``, ``config_class`` (a ``MethodConfig`` dataclass of the published defaults) and a
    one-line ``citation``, and implement the three hooks: ``compress`` (after the prompt's exact attention),
    ``append`` (each decode step's new row) and ``select`` (the rows a step attends to, as a ``Selection``).
    ``EvictionMethod`` and ``RecallableMethod`` write the shared parts of each family once;
    ``docs/writing-a-method.md`` shows a whole method."""

    name: ClassVar[str]
    config_class: ClassVar[type[MethodConfig]] = MethodConfig
    citation: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    recallable: ClassVar[bool] = False  # keeps every row (host tier) and can bring any back
    uses_budget: ClassVar[bool] = True
    quantizable_device: ClassVar[bool] = False  # stores device rows through memory.device_rows_buffer
    needs_surprisal: ClassVar[bool] = False  # compress gets ctx.surprisal (computed after the last layer)
    # compress reads ctx.queries (an observation window, query statistics). False: a layer that waits for the
    # surprisal is held without them (at 4K tokens, batch 4, SmolLM2's queries of every layer are 1.1 GB).
    reads_queries: ClassVar[bool] = True
    # select may read cache.attention_inputs (every attention module's input this step; see
    # zoomkv.memory.speculation): a property where a config option decides
    needs_attention_inputs: bool = False
    needs_profile: ClassVar[bool] = False  # needs an offline `zoomkv calibrate` profile (tested in its own file)

    def __init__(self, config: MethodConfig | None = None, **overrides: Any):
        if config is None:
            config = self.make_config(**overrides)
        elif overrides:
            overrides = coerce_hyperparameters(type(config), overrides, self.name)
            check_hyperparameters(type(config), overrides, self.name)
            config = dataclasses.replace(config, **overrides)
        self.config = config

    @classmethod
    def make_config(cls, **hyperparameters: Any) -> MethodConfig:
        """The method's config with these hyper-parameters; an unknown name or a value of the wrong type fails
        here, naming it."""
        fields = {f.name for f in dataclasses.fields(cls.config_class)}
        unknown = sorted(set(hyperparameters) - fields)
        if unknown:
            raise ConfigError(f"unknown hyper-parameter(s) {unknown} for method {cls.name!r}; valid: {sorted(fields)}")
        hyperparameters = coerce_hyperparameters(cls.config_class, hyperparameters, cls.name)
        check_hyperparameters(cls.config_class, hyperparameters, cls.name)
        return cls.config_class(**hyperparameters)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config})"

    def host_format(self) -> tuple[str, list[list[int]], str]:
        """The host tier's KV format when the command names none (``zoomkv.memory.quant``'s grammar: ``"int4"``,
        ``"kivi4"``; ``"none"``: full precision), per model layer ``[key bits, value bits]`` when fitted (else
        ``[]``), and what tables call the fitted pattern. A trained adapter's method may carry one."""
        return "none", [], ""

    # -- budget ---------------------------------------------------------------------------------------
    def min_budget(self) -> int:
        """The smallest budget this method can meet (its fixed rows: sinks, windows...)."""
        return 1

    def check_budget(self, budget: int | None) -> None:
        """Raise ``BudgetError`` unless this method can run at ``budget`` rows (None: only for a method without one)."""
        if not self.uses_budget:
            return
        if budget is None:
            raise BudgetError(f"method {self.name!r} needs a budget (e.g. --budget 256 or --budget 0.1)")
        if budget < self.min_budget():
            raise BudgetError(
                f"method {self.name!r} cannot meet a budget of {budget} rows: it needs at least "
                f"{self.min_budget()} (with {self.config})"
            )

    def layer_budget(
        self, layer_idx: int, num_layers: int, budget: int, zoom_layers: Sequence[int] | None = None
    ) -> int:
        """Device rows per KV head this layer may hold. Methods that spread the budget over layers
        (PyramidKV, CompressKV) override this; their budgets over the compressed layers ``zoom_layers``
        (all ``num_layers`` when None; hybrid models compress only their full-attention layers) must sum
        to ``len(zoom_layers) * budget``."""
        return budget

    def dense_layer(self, layer_idx: int, num_layers: int) -> bool:
        """Layers the published method keeps uncompressed (e.g. Quest's first two). They are exempt from
        the budget, reported as ``dense`` in the memory report, and configurable to zero."""
        return False

    def keep_query_statistics(self, ctx: PrefillContext) -> None:
        """Called, for a method that does not read ``ctx.queries`` (``reads_queries`` False), before a layer that
        waits for the surprisal lets its queries go: keep what ``compress`` needs of them in ``ctx.derived``
        (a moment, not the queries). Nothing by default."""

    # -- the three hooks --------------------------------------------------------------------------------
    def compress(self, memory: Memory, ctx: PrefillContext) -> None:
        """After the prompt's exact attention: keep what the method keeps of ``ctx.keys`` / ``ctx.values`` in
        ``memory``'s tiers, at most ``ctx.budget`` device rows per KV head (the runtime checks)."""
        raise NotImplementedError

    def append(self, memory: Memory, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store one decode step's new rows (``[batch, kv_heads, 1, head_dim]``)."""
        raise NotImplementedError

    def select(self, memory: Memory, query: torch.Tensor) -> Selection:
        """Choose (recall, reconstruct) the rows this step attends to; ``query`` is ``[batch, q_heads, n, d]``:
        one token while decoding (after ``append``), or the ``n`` tokens of a new input after compression
        (before ``extend``: one selection of stored rows serves them all; their own rows are added by the
        runtime, causally)."""
        raise NotImplementedError

    def graph_key(self, memory: Memory, query: torch.Tensor) -> Hashable | None:
        """Asked before a decode step's ``append`` (after ``prepare_step``), where steps are captured: a key of everything the step (``append_on_device``, then
        ``select``) depends on in Python (sizes, budgets, which path it takes), when it is one a CUDA graph can
        replay: fixed shapes, no value read back to the host, positions and the state it hands the next step kept
        on the device; None (the default): ``append`` and ``select`` run as they are. The runtime captures the step
        once its key repeats and replays it while the key and the tiers' buffers stay (``zoomkv.memory.graphs``)."""
        return None

    def prepare_step(self, memory: Memory, rows: int) -> None:
        """Before ``graph_key``, at each decode step where steps are captured (``zoomkv.memory.graphs.capturable``):
        room for ``rows`` more rows in every buffer the step writes (a buffer that grows is a new one: the step is
        captured again). Default: nothing."""

    def append_on_device(self, memory: Memory, key: torch.Tensor, value: torch.Tensor) -> None:
        """``append``'s work on tensors alone, at positions read on the device (a step with a ``graph_key``)."""
        raise NotImplementedError(f"{self.name} has no graph_key, so no append on the device")

    def appended(self, memory: Memory, rows: int) -> None:
        """``append``'s Python side after ``append_on_device`` (or its replay): the buffers' lengths."""
        raise NotImplementedError(f"{self.name} has no graph_key, so no append on the device")

    def extend(self, memory: Memory, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store the rows of a multi-token input that arrives after compression (a follow-up question, the
        next chat turn, the next chunk of a long prompt), ``[batch, kv_heads, n, head_dim]``, within the
        budget. Default: append them one at a time, exactly as decoding them would."""
        for i in range(keys.shape[2]):
            self.append(memory, keys[:, :, i : i + 1], values[:, :, i : i + 1])

    def device_rows(self, memory: Memory) -> int:
        """KV rows per KV head this layer holds on the device tier now (resident + recall buffers)."""
        return kv_rows(memory.device_tier.get("keys")) + kv_rows(memory.device_tier.get("recall_keys"))


def group_query(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[batch, q_heads, q, d]`` → ``[batch, kv_heads, groups * q, d]``: query head h serves KV head
    ``h // groups``, as in transformers' ``repeat_kv``."""
    b, hq, q, d = query.shape
    return query.reshape(b, kv_heads, (hq // kv_heads) * q, d)


# Scores held at once when many new tokens score every row (a chunk of a long prefill, a question): a chunk of
# 4,096 tokens over 32K rows in batch 8 would otherwise hold 137 GB of fp32 logits in one tensor.
SCORES_AT_ONCE = 1 << 25


def query_blocks(query: torch.Tensor, width: int) -> Iterator[torch.Tensor]:
    """``query`` ``[batch, q_heads, q, d]`` a block of positions at a time, so that its scores against ``width``
    rows stay near ``SCORES_AT_ONCE`` elements (one block, the query itself, at a decode step)."""
    b, hq, q, _ = query.shape
    step = max(1, SCORES_AT_ONCE // max(1, b * hq * width))
    for start in range(0, q, step):
        yield query if step >= q else query[:, :, start:start + step]


def summed_over_queries(score: Callable[[torch.Tensor], torch.Tensor], query: torch.Tensor, width: int,
                        largest: bool = False) -> torch.Tensor:
    """``score(block)`` over ``query_blocks``, summed (``largest``: the elementwise maximum): a vote over a
    group's query rows (``score`` reduces its block's rows, e.g. ``softmax(...).sum(2)``) without the whole
    ``[b, h, g·q, width]`` at once."""
    total = None
    for block in query_blocks(query, width):
        part = score(block)
        total = part if total is None else torch.maximum(total, part) if largest else total.add_(part)
    return total
