"""How much of the attention output survives when the host tier keeps keys and values at a lower rank.

For the rank-budget target of sekv (issue: trained modules): on cached teacher samples (a training run's
``teacher/`` folder), every compressed layer's keys and/or values are replaced by their best rank-``r``
approximation in the sequence's own principal directions (what ``zoomkv.methods.sekv.host`` stores), and
the attention output at the cached query positions is compared with the exact one: the relative squared
error, averaged over heads and positions, then summarised over layers and samples. ``--exact-sinks N``
keeps the first N rows exact and fits the directions to the rest.

    python scripts/host_rank_probe.py checkpoints/sekv-smollm2-quickstart/teacher --ranks 8,16,32,48 --exact-sinks 4
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from zoomkv.methods.sekv.host import truncated
from zoomkv.train.teacher import load_sample


def low_rank(x: torch.Tensor, rank: int, exact: int) -> torch.Tensor:
    """``x`` ``[h, n, d]`` with rows ``exact:`` in their top ``rank`` principal directions (the first kept):
    the training objective's ``truncated`` with the first ``rank`` gates on."""
    gates = (torch.arange(x.shape[-1]) < rank).float()
    return torch.cat([x[:, :exact], truncated(x[:, exact:], gates)], 1)


def output_error(sample: dict[str, torch.Tensor], layer: int, rank: int, which: str, exact: int) -> float:
    scaling = float(sample["scaling"])
    keys, values = sample[f"k.{layer}"].float(), sample[f"v.{layer}"].float()
    queries = sample[f"q.{layer}"].float()
    h = keys.shape[0]
    approx_k = low_rank(keys, rank, exact) if "k" in which else keys
    approx_v = low_rank(values, rank, exact) if "v" in which else values
    errors = []
    for p, t in enumerate(sample["positions"].tolist()):
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
            errs = torch.tensor([output_error(s, layer, rank, which, args.exact_sinks)
                                 for s in samples for layer in s["layers"].tolist()])
            print(f"| {rank} | {which} | {errs.mean():.3f} | {errs.median():.3f} | {errs.max():.3f} |")


if __name__ == "__main__":
    main()
