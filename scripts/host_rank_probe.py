"""How much of the attention output survives when the host tier keeps keys and values at a lower rank.

For the rank-budget target of sekv (issue: trained modules): on cached teacher samples (a training run's
``teacher/`` folder), every compressed layer's keys and/or values are replaced by their best rank-``r``
approximation in the sequence's own principal directions (what ``zoomkv.methods.sekv.host`` stores), and
the attention output at the cached query positions is compared with the exact one: the relative squared
error, averaged over heads and positions, then summarised over layers and samples. ``--exact-sinks N``
keeps the first N rows exact and fits the directions to the rest.

Two ways to make keys lower-rank, each optional: ``--pre-rope THETA`` truncates the keys before rotary
position embedding (undone with the model's ``rope_theta``, redone after), where one direction is not smeared
over every position's rotation; ``--query-weighted`` fits the key directions that lose the least *logit*
(``q · (k - k̂)``) rather than the least key, by whitening with the second moment of the queries of the even
cached positions, and measures on the odd ones only (a basis never scored on the queries it was fitted to).

    python scripts/host_rank_probe.py checkpoints/sekv-smollm2-quickstart/teacher --ranks 8,16,32,48 --exact-sinks 4
    python scripts/host_rank_probe.py checkpoints/sekv-smollm2-quickstart/teacher --ranks 16,32 --exact-sinks 4 \
        --pre-rope 100000 --query-weighted
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from zoomkv.methods.sekv.host import truncated
from zoomkv.protocol import rotary as rotary_embedding
from zoomkv.train.teacher import load_sample


def low_rank(x: torch.Tensor, rank: int, exact: int) -> torch.Tensor:
    """``x`` ``[h, n, d]`` with rows ``exact:`` in their top ``rank`` principal directions (the first kept):
    the training objective's ``truncated`` with the first ``rank`` gates on and the first rows exact."""
    gates = (torch.arange(x.shape[-1]) < rank).float()
    return truncated(x, gates, torch.arange(x.shape[1]) < exact if exact else None)


def rotary(x: torch.Tensor, theta: float, undo: bool = False) -> torch.Tensor:
    """Rotary position embedding (the Llama convention, rotate-half) of rows ``x`` ``[h, n, d]`` at positions
    ``0..n-1``; ``undo`` applies the inverse rotation."""
    n, d = x.shape[-2], x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = torch.outer(torch.arange(n, dtype=torch.float64), inv)
    emb = torch.cat([angle, angle], -1)  # float64 angles: the table the published numbers were measured with
    cos, sin = emb.cos().float(), emb.sin().float()
    return rotary_embedding.apply(x, cos, -sin if undo else sin)  # the inverse rotation turns the other way


def whitening(queries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``S`` and ``S⁻¹`` ``[h, d, d]`` with ``S = M^½``, ``M`` the second moment of ``queries`` ``[h, m, d]``
    (plus a small ridge): ``|q · e|²`` summed over the queries is ``|e S|²``."""
    m = queries.transpose(-1, -2) @ queries / queries.shape[1]
    m = m + 1e-4 * m.diagonal(dim1=-2, dim2=-1).mean(-1)[:, None, None] * torch.eye(m.shape[-1])
    vals, vecs = torch.linalg.eigh(m.double())
    root = (vecs * vals.sqrt()[:, None, :]) @ vecs.transpose(-1, -2)
    inv = (vecs * vals.rsqrt()[:, None, :]) @ vecs.transpose(-1, -2)
    return root.float(), inv.float()


def approx_keys(keys: torch.Tensor, rank: int, exact: int, theta: float | None,
                fit_queries: torch.Tensor | None) -> torch.Tensor:
    x = rotary(keys, theta, undo=True) if theta else keys
    if fit_queries is not None:
        if theta:  # the logit q·k is unchanged when both are rotated back by each one's own position
            raise SystemExit("--query-weighted with --pre-rope needs each query's position; use one at a time")
        root, inv = whitening(fit_queries)
        x = low_rank(x @ root, rank, exact) @ inv
    else:
        x = low_rank(x, rank, exact)
    return rotary(x, theta) if theta else x


def output_error(sample: dict[str, torch.Tensor], layer: int, rank: int, which: str, exact: int,
                 theta: float | None = None, query_weighted: bool = False) -> float:
    scaling = float(sample["scaling"])
    keys, values = sample[f"k.{layer}"].float(), sample[f"v.{layer}"].float()
    queries = sample[f"q.{layer}"].float()
    h = keys.shape[0]
    positions = sample["positions"].tolist()
    scored = range(1, len(positions), 2) if query_weighted else range(len(positions))
    fit = queries[:, 0::2].reshape(h, -1, keys.shape[-1]) if query_weighted else None
    approx_k = approx_keys(keys, rank, exact, theta, fit) if "k" in which else keys
    approx_v = low_rank(values, rank, exact) if "v" in which else values
    errors = []
    for p in scored:
        t = positions[p]
        n = t + 1
        q = queries[:, p].view(h, -1, keys.shape[-1])

        def attend(k: torch.Tensor, v: torch.Tensor, q: torch.Tensor = q, n: int = n) -> torch.Tensor:
            weights = torch.softmax(torch.matmul(q, k[:, :n].transpose(-1, -2)) * scaling, -1)
            return torch.matmul(weights, v[:, :n])

        exact_out, approx_out = attend(keys, values), attend(approx_k, approx_v)
        errors.append(((approx_out - exact_out).pow(2).sum(-1) / exact_out.pow(2).sum(-1).clamp_min(1e-12)).mean())
    return float(torch.stack(errors).mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("teacher", type=Path, help="a training run's teacher/ folder")
    parser.add_argument("--ranks", default="8,16,32,48")
    parser.add_argument("--samples", type=int, default=3, help="the last N cached samples")
    parser.add_argument("--exact-sinks", type=int, default=0, help="first rows kept exact")
    parser.add_argument("--pre-rope", type=float, default=None, metavar="THETA",
                        help="truncate keys before rotary embedding (the model's rope_theta)")
    parser.add_argument("--query-weighted", action="store_true",
                        help="key directions that keep the logits of the even cached queries; scored on the odd ones")
    args = parser.parse_args()
    torch.set_num_threads(1)
    paths = sorted(args.teacher.glob("sample_*.safetensors"))[-args.samples:]
    if not paths:
        raise SystemExit(f"no sample_*.safetensors in {args.teacher}")
    print("| kept rank | truncated | mean error | median | worst layer |")
    print("|---|---|---|---|---|")
    samples = [load_sample(p) for p in paths]
    for rank in (int(r) for r in args.ranks.split(",")):
        for which in ("k", "v", "kv"):
            errs = torch.tensor([output_error(s, layer, rank, which, args.exact_sinks, args.pre_rope,
                                              args.query_weighted)
                                 for s in samples for layer in s["layers"].tolist()])
            print(f"| {rank} | {which} | {errs.mean():.3f} | {errs.median():.3f} | {errs.max():.3f} |")


if __name__ == "__main__":
    main()
