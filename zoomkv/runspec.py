"""One grammar for what a command runs. ``generate``, ``chat``, ``bench`` and ``eval`` take the same flags and the
same ``+variant`` suffixes; this module parses them, once, into ``RunSpec``s (a label and a ``CacheSpec``):

    --method(s) METHOD[+tail][+FORMAT][,...]   registered methods (``zoomkv methods``)
    --adapter DIR_OR_HUB_ID[+tail][+FORMAT]    a trained adapter: its method, run with its modules
    --budget(s) B[,...]          rows (512) or a fraction of the prompt (0.1); an adapter's own when none
    --tail-summary               +tail on every run the command names
    --kv-quant FORMAT            +FORMAT on every run the command names
    --kv-quant-tiers host|all    where +int8 / +int4 quantize: by default the host tier, or the device tier of a
                                 method that keeps everything there (full); anything else is refused
    --method-arg KEY=V           a hyper-parameter of every run the command names; METHOD.KEY=V of that
                                 method's runs only (its adapters' too)
    --prefill-chunk N            the prompt goes through in pieces of N tokens, compressed as they go

``+tail`` adds the softmax tail's row (recallable methods; it is one of the B rows); ``+FORMAT`` holds the host
tier as codes (``zoomkv.memory.quant``: ``int8``, ``int4``, ``int2``, ``k4v2``, ``kivi4``, ``kivi2``, ``int2o4``).
An adapter whose training fitted a host format runs with it unless a ``+FORMAT`` or ``host_format=none``
(``--method-arg``) says otherwise. ``eval`` and ``bench`` run ``full`` first as their reference: flags and
unscoped hyper-parameters apply to the runs the command names, not to that reference. ``generate`` and
``chat`` run one configuration: one method or one adapter, one budget.

Everything is checked here, before a model loads: unknown methods, variants and hyper-parameters, budgets no
method could meet, adapters that are missing or corrupt. The method of each configuration is built once
(an adapter's with its modules) and serves every prompt of the run.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from zoomkv.budget import Budget
from zoomkv.errors import ZoomKVError
from zoomkv.memory.quant import FORMATS_HELP, is_format
from zoomkv.memory.spec import CacheSpec, TrainedModules, quant_spec
from zoomkv.protocol.method import KVMethod
from zoomkv.protocol.registry import get_method

# The suffixes any method or adapter can carry: the softmax tail, a KV quantization format of the host tier.
TAIL = "tail"
ALL_METHODS = "*"  # the scope of an unscoped --method-arg (KEY=V): every run the command names
REFERENCE = "full"  # eval's and bench's reference run


@dataclass(frozen=True)
class RunSpec:
    """One configuration a command runs: what its rows and tables call it, and the cache it runs (an adapter's
    modules and base model in ``cache.trained``)."""

    label: str  # "quest+tail", "sekv+int8", an adapter's "sekv:my-run@1a2b3c4d+int8"
    cache: CacheSpec
    args: str = ""  # the hyper-parameters given on the command line, as text (part of an eval row's identity)

    @property
    def budget(self) -> str | None:
        """The budget as rows and tables write it (``"256"``, ``"0.1"``), None for a method without one."""
        return None if self.cache.budget is None else str(self.cache.budget)


def trailing_variants(label: str) -> tuple[str, list[str]]:
    """``"DIR+int8"`` → ``("DIR", ["int8"])``: the known variants at the end of an adapter's folder or Hub id
    (or of its row label), so a folder whose own name holds a ``+`` keeps it."""
    base, variants = label, []
    while "+" in base and is_variant(base.rsplit("+", 1)[1]):
        base, v = base.rsplit("+", 1)
        variants.insert(0, v)
    return base, variants


def split_variants(label: str) -> tuple[str, list[str]]:
    """``"quest+tail+int8"`` → ``("quest", ["tail", "int8"])``; an unknown, repeated or clashing suffix is refused."""
    base, *variants = label.split("+")
    for v in variants:
        if not is_variant(v):
            raise ZoomKVError(f"unknown method variant '+{v}' in {label!r}; valid: +tail, +FORMAT ({FORMATS_HELP})")
    if len(set(variants)) < len(variants) or len([v for v in variants if is_format(v)]) > 1:
        raise ZoomKVError(f"{label!r}: each variant at most once, and one quantization (+int8, +int4, ...)")
    return base, variants


def is_variant(text: str) -> bool:
    """``tail`` or a quantization format (``int8``, ``k4v2``, ``kivi2``, ...)."""
    return text == TAIL or is_format(text)


def adapter_label(adapter: Any, source: str) -> str:
    """How an adapter's rows are labelled: its method, the folder name or Hub id it came from, and the
    start of its weights' checksum (so a retrained adapter in the same folder makes new rows)."""
    path = Path(source)
    if path.exists():  # a folder's name; a training run's `RUN/adapter` is named after the run
        name = path.resolve().parent.name if path.resolve().name == "adapter" else path.name
    else:
        name = source  # a Hub id
    return f"{adapter.config.method}:{name}@{(adapter.config.weights_sha256 or 'unsigned')[:8]}"


def args_text(kwargs: Mapping[str, Any]) -> str:
    return ",".join(f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in sorted(kwargs.items()))


def parse_runs(methods: Sequence[str] = (), adapters: Sequence[str] = (), budgets: Sequence[str | int | float] = (),
               *, method_args: Mapping[str, Mapping[str, Any]] | None = None, tail_summary: bool = False,
               kv_quant: str | None = None, kv_quant_tiers: str | None = None, prefill_chunk: int | None = None,
               reference: bool = False, default_budgets: Sequence[str] = ()) -> list[RunSpec]:
    """Every configuration: each method (as labelled, variants included) at each budget, then each adapter at
    each budget (its own when none is given). ``method_args``: ``{METHOD: {key: value}}``, ``ALL_METHODS``
    for every named run. ``reference``: ``full`` first (eval, bench). ``default_budgets``: the methods'
    budgets when none is given (bench's 256)."""
    labels = list(dict.fromkeys(m.strip() for m in methods if m.strip()))
    scoped = {k: dict(v) for k, v in (method_args or {}).items()}
    flags = ([TAIL] if tail_summary else []) + ([kv_quant] if kv_quant not in (None, "", "none") else [])
    parsed = _budgets(budgets)
    runs: list[RunSpec] = []
    if reference:
        labels = [m for m in labels if m != REFERENCE]
        runs.append(RunSpec(REFERENCE, CacheSpec(_method(REFERENCE, scoped.get(REFERENCE, {}))),
                            args_text(scoped.get(REFERENCE, {}))))
    loaded = [_load_adapter(a) for a in dict.fromkeys(adapters)]
    named = {split_variants(m)[0] for m in labels} | set(labels) | {a.config.method for a, _, _ in loaded}
    unknown = sorted(set(scoped) - named - {ALL_METHODS, REFERENCE if reference else ALL_METHODS})
    if unknown:
        raise ZoomKVError(f"--method-args names method(s) {', '.join(unknown)} that no --method or --adapter runs")
    if ALL_METHODS in scoped and not labels and not loaded:
        raise ZoomKVError("--method-args KEY=VALUE sets a hyper-parameter of the runs named by --methods or "
                          "--adapter, and none is named (the full reference takes none; METHOD.KEY=VALUE for one)")
    for label in labels:
        base, variants = split_variants(label)
        kwargs = {**scoped.get(ALL_METHODS, {}), **scoped.get(base, {}), **scoped.get(label, {})}
        method = _method(base, kwargs)  # unknown names and hyper-parameters fail here
        label, variants = _with_flags(label, variants, flags)
        chosen = (parsed or _budgets(default_budgets)) if method.uses_budget else [None]
        if not chosen:
            raise ZoomKVError(f"method {label!r} needs a budget: give --budget, e.g. --budget 128 (eval, bench: "
                              "--budgets 128,512)")
        runs += [_run(label, _cache(method, b, variants, kv_quant_tiers, prefill_chunk), variants, kwargs)
                 for b in chosen]
    for adapter, source, variants in loaded:
        kwargs = {**scoped.get(ALL_METHODS, {}), **scoped.get(adapter.config.method, {})}
        method = adapter.make_method(**kwargs)  # built once, with its modules: every budget and prompt shares it
        label, variants = _with_flags(adapter_label(adapter, source) + "".join("+" + v for v in variants),
                                      variants, flags)
        chosen = parsed or _budgets([adapter.config.budget] if adapter.config.budget is not None else [])
        if not chosen:
            raise ZoomKVError(f"adapter {source!r} records no budget: give --budget")
        trained = TrainedModules(adapter.modules, adapter.config.base_model)
        runs += [_run(label, _cache(method, b, variants, kv_quant_tiers, prefill_chunk, trained), variants, kwargs)
                 for b in chosen]
    return runs


def parse_run(method: str | None = None, adapter: str | None = None, budget: str | int | float | None = None,
              **options: Any) -> RunSpec:
    """The one configuration of ``generate`` or ``chat``: a method (``full`` when neither is given) or an
    adapter, at one budget. A method and an adapter together are refused: the adapter runs its own method."""
    if adapter is not None and method is not None:
        raise ZoomKVError(f"--adapter runs the adapter's own method; --method {method!r} contradicts it: give one "
                          "of them (an adapter's variants: --adapter DIR+int8, --tail-summary, --kv-quant)")
    if method is not None and not method.strip():
        raise ZoomKVError("--method needs a method name (see `zoomkv methods`)")
    budgets = [b for b in str(budget or "").split(",") if b.strip()]
    if len(budgets) > 1:
        raise ZoomKVError(f"--budget takes one budget here (rows or a fraction), got {budget!r}")
    if method is not None and "," in method:
        raise ZoomKVError(f"--method takes one method here, got {method!r}")
    runs = parse_runs([] if adapter is not None else [method or REFERENCE],
                      [adapter] if adapter is not None else [], budgets, **options)
    if budgets and runs[0].cache.budget is None:  # held by nothing: a report of "budget 8" would be a lie
        raise ZoomKVError(f"method {runs[0].cache.method.name!r} keeps every row on the device and takes no budget; "
                          f"--budget {budgets[0]} would hold nothing (give a method that compresses, see "
                          "`zoomkv methods`)")
    return runs[0]


def _budgets(values: Sequence[str | int | float]) -> list[Budget]:
    """Each budget parsed (the only place the command line's budgets are), in order, the same budget once."""
    parsed = [Budget.parse(v) for v in values if str(v).strip()]
    return list({str(b): b for b in parsed if b is not None}.values())


def _method(name: str, kwargs: Mapping[str, Any]) -> KVMethod:
    if not name:
        raise ZoomKVError("an empty method name (see `zoomkv methods`)")
    return get_method(name, **kwargs)


def _load_adapter(spec: str) -> tuple[Any, str, list[str]]:
    """(the adapter, where it came from, its variants): ``DIR+int8`` is ``DIR`` with ``+int8`` unless a folder
    of that very name exists."""
    from zoomkv.adapters.model import ZoomAdapter

    if not spec or not spec.strip():
        raise ZoomKVError("--adapter needs an adapter folder or Hub id, got an empty name")
    source, variants = (spec, []) if Path(spec).exists() else trailing_variants(spec)
    split_variants("x" + "".join("+" + v for v in variants))  # repeated or clashing variants are refused
    return ZoomAdapter.from_pretrained(source), source, variants  # missing, corrupt, offline: before the model


def _with_flags(label: str, variants: list[str], flags: list[str]) -> tuple[str, list[str]]:
    """The label and variants with the command's --tail-summary / --kv-quant added as suffixes."""
    for flag in flags:
        if flag in variants:
            continue
        if is_format(flag) and any(is_format(v) for v in variants):
            raise ZoomKVError(f"--kv-quant {flag} and the variant of {label!r} ask for two quantizations")
        label, variants = f"{label}+{flag}", [*variants, flag]
    return label, variants


def _run(label: str, cache: CacheSpec, variants: list[str], kwargs: Mapping[str, Any]) -> RunSpec:
    """A run labelled with its host format too when the method brought its own (an adapter's fitted one)."""
    if cache.kv_quant is not None and not any(is_format(v) for v in variants):
        label = f"{label}+{cache.kv_quant.name}"
    return RunSpec(label, cache, args_text(kwargs))


def _cache(method: KVMethod, budget: Budget | None, variants: list[str], tiers: str | None,
           prefill_chunk: int | None, trained: TrainedModules | None = None) -> CacheSpec:
    quant = next((v for v in variants if is_format(v)), None)
    return CacheSpec(method, budget, TAIL in variants, quant_spec(method, quant, tiers), prefill_chunk, trained)


def with_prefill_chunk(run: RunSpec, chunk: int | None) -> RunSpec:
    """The same configuration with its prompt put through in pieces of ``chunk`` tokens (bench's comparison)."""
    return replace(run, cache=replace(run.cache, prefill_chunk=chunk))
