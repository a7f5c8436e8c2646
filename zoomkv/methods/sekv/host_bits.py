"""The host tier's bits, layer by layer, fitted to a byte budget (recipe keys ``host_format``, ``host_budget``).

Which layer's keys or values can lose bits is a discrete choice a gradient does not make, so it is fitted on
the teacher cache once the steps are done: for every compressed layer, keys and values, and every width
(8, 4, 2 bits in ``host_format``'s layout), the cached query positions attend their exact top-``budget`` rows
(what a recall brings back) with that part of the layer coded as the host tier codes it
(``zoomkv.memory.quant.row_buffer``, the runtime's own coder) and the rest exact; the relative squared error of
the attention output against the exact one, plus the KL divergence of the attention weights (``host_fit_kl``),
is that choice's cost. Then, from 8 bits everywhere, the step down
that costs the least error per byte saved is taken until the host tier (rows, scales and the router's finer
codes) fits ``host_budget`` of fp32 full KV. The result, ``host_bits``, is a hyper-parameter of the adapter
(one ``[key bits, value bits]`` per model layer, like PEFT's ``rank_pattern``), so loading it needs no code.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from zoomkv.errors import ConfigError
from zoomkv.memory.quant import BITS, QuantSpec, RowQuant, row_buffer


def fine_code_share(head_dim: int, rescore_bits: int) -> float:
    """The router's finer codes on the host tier (codes and an fp16 RMS a row and KV head), as a share of fp32
    keys and values."""
    return 0.0 if not rescore_bits else (head_dim * rescore_bits / 8 + 2) / (2 * head_dim * 4)


def _attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, chosen: torch.Tensor,
               scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` ``[h, g, d]`` over rows ``chosen`` (``[h, k]`` indices) of ``keys``/``values`` ``[h, n, d]``: the
    output and the log attention weights."""
    at = chosen[..., None].expand(-1, -1, keys.shape[-1])
    k, v = keys.gather(1, at), values.gather(1, at)
    logw = torch.log_softmax(torch.matmul(q, k.transpose(-1, -2)) * scaling, -1)
    return torch.matmul(logw.exp(), v), logw


def output_errors(samples: Sequence[dict[str, torch.Tensor]], spec: QuantSpec, budgets: Sequence[int],
                  bits: Sequence[int] = BITS, kl: bool = True) -> dict[int, dict[str, dict[int, float]]]:
    """``{model layer: {"keys" | "values": {bits: cost}}}`` over the samples' cached query positions, each
    attending its exact top rows, ``budgets[i]`` of them in the ``i``-th compressed layer (sekv's budget split).
    The cost: the attention output's relative squared error, plus (``kl``) the KL divergence of the attention
    weights from the exact ones — what coded keys do and coded values cannot: move the attention to other
    rows. (Without it the first fit spent 2-bit keys where the mean output barely moved, and lost needles that
    2-bit values keep; BENCHMARKS.md, "Host formats on the held-out prompts".)"""
    sums: dict[int, dict[str, dict[int, float]]] = {}
    count: dict[int, int] = {}
    with torch.no_grad():
        for sample in samples:
            scaling = float(sample["scaling"])
            positions = sample["positions"].tolist()
            for pos, layer in enumerate(sample["layers"].tolist()):
                budget = max(1, int(budgets[pos]))
                keys, values = sample[f"k.{layer}"].float(), sample[f"v.{layer}"].float()
                h, _, d = keys.shape
                coded = {(role, b): row_buffer(x[None], _role(spec, role, b)).view()[0]
                         for role, x in (("keys", keys), ("values", values)) for b in bits}
                for p, t in enumerate(positions):
                    n = t + 1
                    if n <= budget:
                        continue
                    q = sample[f"q.{layer}"][:, p].float().view(h, -1, d)
                    mass = sample[f"attn.{layer}"][:, p, :n].float().view(h, -1, n).sum(1)
                    chosen = mass.topk(budget, -1).indices
                    exact, exact_logw = _attention(q, keys[:, :n], values[:, :n], chosen, scaling)
                    norm = exact.pow(2).sum().clamp_min(1e-12)
                    layer_sums = sums.setdefault(layer, {"keys": dict.fromkeys(bits, 0.0),
                                                         "values": dict.fromkeys(bits, 0.0)})
                    for (role, b), rows in coded.items():
                        k = rows[:, :n] if role == "keys" else keys[:, :n]
                        v = rows[:, :n] if role == "values" else values[:, :n]
                        out, logw = _attention(q, k, v, chosen, scaling)
                        err = (out - exact).pow(2).sum() / norm
                        if kl:  # mean over the query heads of KL(exact || coded)
                            err = err + (exact_logw.exp() * (exact_logw - logw)).sum(-1).mean()
                        layer_sums[role][b] += float(err)
                    count[layer] = count.get(layer, 0) + 1
    return {layer: {role: {b: e / count[layer] for b, e in r.items()} for role, r in roles.items()}
            for layer, roles in sums.items()}


def _role(spec: QuantSpec, role: str, bits: int) -> RowQuant:
    q = spec.for_rows(role)
    return RowQuant(bits, q.group_size, q.layout, q.outliers)


def fit_bits(errors: dict[int, dict[str, dict[int, float]]], spec: QuantSpec, target: float,
             fixed_share: float, num_layers: int, head_dim: int = 64) -> tuple[list[list[int]], float]:
    """Per model layer ``[key bits, value bits]`` (layers without errors: ``spec``'s own) whose host tier is at
    most ``target`` of fp32 full KV, ``fixed_share`` (the finer codes) included; and the share reached.
    Greedy: the step down with the least error per byte saved, from the widest everywhere."""
    layers = sorted(errors)
    widths = sorted(BITS, reverse=True)
    chosen = {(layer, role): widths[0] for layer in layers for role in ("keys", "values")}

    def share() -> float:  # of fp32 keys and values, over the fitted layers
        bits = sum(_bits_per_value(spec, role, head_dim, b) for (_, role), b in chosen.items())
        return fixed_share + bits / (32 * 2 * len(layers))

    while share() > target + 1e-9:
        best, best_cost = None, float("inf")
        for (layer, role), b in chosen.items():
            if b == widths[-1]:
                continue
            lower = widths[widths.index(b) + 1]
            saved = _bits_per_value(spec, role, head_dim, b) - _bits_per_value(spec, role, head_dim, lower)
            cost = (errors[layer][role][lower] - errors[layer][role][b]) / saved
            if cost < best_cost:
                best, best_cost = (layer, role), cost
        if best is None:
            raise ConfigError(f"recipe key 'host_budget': {target:.3f} of full KV is below the smallest host tier "
                              f"of format {spec.name} ({share():.3f}: every layer at {widths[-1]} bits, the "
                              "router's finer codes included)")
        chosen[best] = widths[widths.index(chosen[best]) + 1]
    kb, vb = spec.for_rows("keys").bits, spec.for_rows("values").bits
    pattern = [[chosen.get((i, "keys"), kb), chosen.get((i, "values"), vb)] for i in range(num_layers)]
    return pattern, share()


def _bits_per_value(spec: QuantSpec, role: str, head_dim: int, bits: int) -> float:
    return _role(spec, role, bits).bits_per_value(head_dim)


def fit_host_bits(samples: Sequence[dict[str, Any]], host_format: str, target: float, budgets: Sequence[int],
                  head_dim: int, rescore_bits: int, kl: bool = True) -> tuple[list[list[int]], dict[str, Any]]:
    """``host_bits`` for an adapter (``budgets``: each compressed layer's rows) and what the fit measured."""
    spec = QuantSpec.parse(host_format)
    if spec is None:
        raise ConfigError("recipe key 'host_budget' needs a host_format (the layout its bits are fitted in), "
                          "e.g. host_format: kivi4")
    errors = output_errors(samples, spec, budgets, kl=kl)
    if not errors:
        raise ConfigError("the teacher cache has no query position past the layers' budgets: nothing to fit "
                          "host_budget on (longer samples: min_length)")
    num_layers = max(errors) + 1
    pattern, reached = fit_bits(errors, spec, target, fine_code_share(head_dim, rescore_bits), num_layers, head_dim)
    report = {"host_share": round(reached, 4),
              "errors": {str(layer): {role: {str(b): round(e, 5) for b, e in r.items()} for role, r in roles.items()}
                         for layer, roles in sorted(errors.items())}}
    return pattern, report
