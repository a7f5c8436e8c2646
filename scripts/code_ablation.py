"""sekv's index at equal bits: how much of the teacher's attention each way of coding the keys lets the router find.

For held-out prompts (an eval task on a haystack, built as ``zoomkv eval`` builds them), the frozen model reads the
whole prompt once; at the last ``--queries`` positions (the question and the answer's start: the queries a
query-agnostic cache is asked with) the teacher's attention over every row is kept, per layer. With ``--answer``
the model reads the prompt and then the expected answer (teacher forcing), and the queries are the decode steps'
that write it: the answer's tokens are each read from rows the question's own queries may not weigh (a number
begun right and finished wrong is lost there, not at the question). Each coding then
estimates every row's logit from its codes alone, the router's group vote picks the best rows of the budget
(sinks and recent rows always in, as inference), and the table reports

- **mass**: the teacher attention (mean over the group's query heads) on the rows picked, sinks and recent included;
- **recall**: the share of the teacher's own top rows (the same count, outside sinks and recent rows) picked;
- **mass, two stages**: ``--candidates`` x the rows by the codes, then the best by the exact key (sekv's
  ``rescore_from=host``: what the default adapter does), which needs the codes to find candidates only;
- **top row kept**: the share of (KV head, query) pairs whose teacher's single most attended row (outside sinks and
  recent rows) the two stages keep: a needle's next digit is one row, which the mass barely weighs.

Codings (every one also keeps each row's fp16 RMS, as sekv's index does):

- ``exact``: the keys themselves (exact top-B: ``oracle_topk``, the upper bound of any index);
- ``sign``: today's index, the signs of the centred key rotated by the layer's fixed random rotation (head_dim
  bits), the query through the adapter's gains (``--adapter`` without a hash; none: gains 1);
- ``simhash-B``: the signs of ``B`` random hyperplanes (Gaussian, fixed seed), the query through the same ones;
- ``orth-B``: the same with orthonormal hyperplanes (the first ``B`` columns of another random rotation: what a
  trained hash starts from);
- ``pca-B``: the signs of the sequence's own top-``B`` principal directions of the centred keys, whitened (each
  coordinate scaled to unit variance; the query side carries the scale back), per KV head;
- ``qfit-B``: no training, this prompt's own statistics: the directions closest to the query-key product under the
  second moments of the context's queries (every position but the last 64: the question and the answer's start)
  and of its centred keys, ``B`` bits spread over them at 4, 2 and 1 bits a coordinate by their weight
  (``zoomkv.methods.sekv.hashing.fit_layout``: the fit a ``hash_width: 4`` adapter makes on its training cache);
  ``qfit1-B``: the same fit at one bit a coordinate, over ``B`` directions (measured only here: it ranks worse);
- ``trained-B`` / the adapter's name: an adapter's trained hash (``hash_bits``: its key and query projections; with
  ``hash_width`` above one, its layout of 4-, 2- and 1-bit coordinates).

    python scripts/code_ablation.py --length 4096 --samples 20 --adapter checkpoints/sekv-hash32/adapter \\
        --out runs/code-ablation-4k

The teacher's signals are cached per prompt in ``--out`` (a killed run continues), the table is printed and
written to ``--out``/table.md, and the numbers to ``--out``/result.json.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from zoomkv.methods.sekv.codes import decode, decode_layout, encode, encode_layout, rotation  # noqa: E402
from zoomkv.methods.sekv.hashing import fit_layout  # noqa: E402

QUESTION = 64  # the prompt's last positions left out of the context's query moment (qfit)
METRICS = ("mass", "recall", "two_stage", "top_row")  # what selection_scores returns, in its order


def extract(model, ids: torch.Tensor, queries: int, appended: int = 0) -> dict[str, torch.Tensor]:
    """Per layer: post-RoPE keys ``[h, T, d]`` (fp16), the last ``queries`` positions' queries ``[hq, Q, d]``, the
    teacher's attention there ``[hq, Q, T]``, and the context's query moment per KV head ``[h, d, d]`` (qfit: over the
    prompt but its last ``QUESTION`` positions, ``appended`` answer tokens after it left out too)."""
    from zoomkv.memory.replay import record_prefill

    with torch.inference_mode():
        record = record_prefill(model, ids)
    t = ids.shape[1]
    at = torch.arange(t - queries, t)
    out: dict[str, torch.Tensor] = {"length": torch.tensor(t), "positions": at}
    for layer, ctx in sorted(record.contexts.items()):
        k = ctx.keys[0].float()
        q = ctx.queries[0][:, at].float()
        logits = torch.matmul(q, k.repeat_interleave(ctx.num_kv_groups, 0).transpose(-1, -2)) * ctx.scaling
        logits = logits.masked_fill(torch.arange(t)[None, None, :] > at[None, :, None], float("-inf"))
        out[f"k.{layer}"] = k.half().contiguous()
        out[f"q.{layer}"] = q.contiguous()
        out[f"attn.{layer}"] = torch.softmax(logits, -1).half()
        out["scaling"] = torch.tensor(ctx.scaling)
        context = ctx.queries[0][:, : t - appended - QUESTION].double()
        context = context.reshape(k.shape[0], -1, context.shape[-1])  # a KV head's group: its query heads' rows
        out[f"qm.{layer}"] = (context.transpose(-1, -2) @ context / context.shape[1]).float().contiguous()
    return out


def build_prompts(args) -> list[tuple[str, int, torch.Tensor]]:
    from zoomkv.data.haystack import text_haystack
    from zoomkv.data.sample import PromptFormat
    from zoomkv.eval.tasks import TaskBuilder
    from zoomkv.models import load_model

    model, tokenizer = load_model(args.model)
    fmt = PromptFormat(tokenizer)
    builder = TaskBuilder(fmt, seed=args.seed, model_max=1 << 20, essays=text_haystack(args.haystack), data=[])
    folder = Path(args.out) / "teacher"
    folder.mkdir(parents=True, exist_ok=True)
    found = []
    for task in args.tasks.split(","):
        for i in range(args.samples):
            # the mode in the name: a folder extracted at the question's queries is not read as the answer's
            path = folder / f"{task}_{args.length}_{i:03d}{'_answer' if args.answer else ''}.safetensors"
            if not path.is_file():
                sample = builder.build(task, args.length, i)
                ids = tokenizer(fmt.sample_text(sample), add_special_tokens=False, return_tensors="pt")["input_ids"]
                queries, appended = args.queries, 0
                if args.answer:  # the decode steps that write the first answer: the prompt's last position, then
                    # each answer token but the last (the step after it writes nothing scored)
                    answer = tokenizer(" " + sample.answers[0], add_special_tokens=False,
                                       return_tensors="pt")["input_ids"]
                    ids, queries, appended = torch.cat([ids, answer[:, :-1]], 1), answer.shape[1], answer.shape[1] - 1
                torch.set_num_threads(args.threads)
                tensors = extract(model, ids, queries, appended=appended)
                save_file(tensors, str(path.with_suffix(".tmp")))
                path.with_suffix(".tmp").replace(path)
                print(f"teacher {path.name}: {ids.shape[1]} tokens", flush=True)
            found.append((task, i, path))
    return found


# -- codings: per layer, (key projection, query projection) [h, d, b] for a sequence's centred keys -----------
def projections(kind: str, layer: int, keys: torch.Tensor, adapters: dict) -> tuple[torch.Tensor, torch.Tensor]:
    h, _, d = keys.shape
    if kind == "sign" or kind.startswith("sign:"):
        adapter = adapters.get(kind.partition(":")[2])
        seed = adapter.rotation_seed_of(layer) if adapter is not None else layer
        rot = rotation(d, seed)[None].expand(h, -1, -1)
        gains = adapter.gains(layer).detach()[:, None, :] if adapter is not None else 1.0
        return rot, rot * gains
    name, _, bits = kind.rpartition("-")
    b = int(bits) if bits.isdigit() else 0
    if name == "simhash":  # Charikar's random hyperplanes: independent Gaussian directions
        g = torch.Generator().manual_seed(1000 + layer)
        planes = torch.randn(d, b, generator=g)[None].expand(h, -1, -1)
        return planes, planes
    if name == "orth":  # orthonormal random hyperplanes: the first b columns of another random rotation
        planes = rotation(d, 1000 + layer)[:, :b][None].expand(h, -1, -1)
        return planes, planes
    if name == "pca":
        x = keys - keys.mean(1, keepdim=True)
        cov = torch.matmul(x.transpose(-1, -2), x) / x.shape[1]  # [h, d, d]
        var, vec = torch.linalg.eigh(cov.double())
        top = vec[..., -b:].flip(-1).float()  # [h, d, b]: the b largest directions first
        sd = var[..., -b:].flip(-1).clamp_min(1e-12).sqrt().float()[:, None, :]
        return top / sd, top * sd
    adapter = adapters[kind]
    key, query = adapter.hash_projections(layer)
    return key.detach(), query.detach()


def estimates(kind: str, layer: int, keys: torch.Tensor, queries: torch.Tensor, adapters: dict,
              query_moment: torch.Tensor | None = None) -> torch.Tensor:
    """``[h, g, Q, n]`` estimated logits (before scaling) of every row for every query from the coding's codes."""
    h, n, d = keys.shape
    if kind == "exact":  # the keys themselves: exact top-B, the selection's upper bound (oracle_topk)
        return torch.matmul(queries.view(h, -1, d), keys.transpose(-1, -2)).view(h, -1, queries.shape[1], n)
    if kind.startswith(("qfit-", "qfit1-")):
        if query_moment is None:
            raise SystemExit("qfit needs the context's query moment: this teacher cache predates it (delete its "
                             "folder, --out/teacher, to extract it again)")
        name, _, bits = kind.partition("-")
        x = keys - keys.mean(1, keepdim=True)
        pk, pq, (layout,) = fit_layout(query_moment.double()[None], (x.transpose(-1, -2) @ x / n).double()[None],
                                       int(bits), 1 if name == "qfit1" else 4, min(d, int(bits)))
        used = sum(layout)
        rows = decode_layout(*encode_layout(torch.matmul(x, pk[0, ..., :used]), layout), layout)
        q = torch.matmul(queries.view(h, -1, d), pq[0, ..., :used])
        return torch.matmul(q, rows.transpose(-1, -2)).view(h, -1, queries.shape[1], n)
    pk, pq = projections(kind, layer, keys, adapters)
    x = torch.matmul(keys - keys.mean(1, keepdim=True), pk)  # [h, n, b]
    adapter = adapters.get(kind)
    if adapter is not None and getattr(adapter, "hash_bits", 0):
        layout = adapter.hash_layout[layer]
        rows = decode_layout(*encode_layout(x, layout), layout)
    else:
        rows = decode(*encode(x, 1), 1)
    q = torch.matmul(queries.view(h, -1, d), pq)  # [h, g·Q, b]
    return torch.matmul(q, rows.transpose(-1, -2)).view(h, -1, queries.shape[1], n)


def selection_scores(logits: torch.Tensor, teacher: torch.Tensor, budget: int, sinks: int, recent: int,
                     candidates: float, exact: torch.Tensor) -> tuple[float, float, float, float]:
    """One query position: ``logits`` / ``teacher`` / ``exact`` ``[h, g, n]`` → (mass, recall, two-stage mass, top
    row kept by the two stages)."""
    h, g, n = teacher.shape
    region = torch.zeros(n, dtype=torch.bool)
    region[sinks: n - recent] = True
    rows = budget - 1 - sinks - recent  # the summary row takes one
    a = teacher.mean(1)  # [h, n]
    fixed = (a * ~region).sum(-1)
    def picked_mass(vote: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        top = vote.masked_fill(~region, float("-inf")).topk(count, -1).indices
        return top, fixed + a.gather(-1, top).sum(-1)
    vote = torch.softmax(logits, -1).sum(1)
    top, mass = picked_mass(vote, rows)
    best = a.masked_fill(~region, float("-inf")).topk(rows, -1).indices
    recall = torch.zeros(h, n).scatter_(-1, best, 1.0).gather(-1, top).sum(-1) / rows
    m = min(int(region.sum()), math.ceil(candidates * (rows + 1 + sinks + recent)) - sinks - recent)
    cand = vote.masked_fill(~region, float("-inf")).topk(m, -1).indices
    exact_vote = torch.softmax(exact, -1).sum(1).gather(-1, cand)
    chosen = cand.gather(-1, exact_vote.topk(rows, -1).indices)
    two = fixed + a.gather(-1, chosen).sum(-1)
    first = best[:, :1]  # [h, 1]: the teacher's top row in the region
    kept = (chosen == first).any(-1).float()
    return float(mass.mean()), float(recall.mean()), float(two.mean()), float(kept.mean())


def evaluate(paths, kinds: list[str], adapters: dict, args) -> dict:
    result: dict[str, dict] = {kind: {"mass": {}, "recall": {}, "two_stage": {}, "top_row": {}, "per_prompt": []}
                               for kind in kinds}
    for task, i, path in paths:
        tensors = load_file(str(path))
        scaling = float(tensors["scaling"])
        layers = sorted(int(k.split(".")[1]) for k in tensors if k.startswith("k."))
        sums = {kind: [0.0] * len(METRICS) for kind in kinds}
        for pos, layer in enumerate(layers):
            keys = tensors[f"k.{layer}"].float()
            queries = tensors[f"q.{layer}"].float()  # [hq, Q, d]
            h, n, count = keys.shape[0], keys.shape[1], queries.shape[1]
            attn = tensors[f"attn.{layer}"].float().view(h, -1, count, n)  # [h, g, Q, T]
            exact = torch.matmul(queries, keys.repeat_interleave(queries.shape[0] // h, 0).transpose(-1, -2))
            exact = (exact * scaling).view(h, -1, count, n)
            seen = [n - (count - 1 - j) for j in range(count)]  # the rows query j reads (causal)
            for kind in kinds:
                est = estimates(kind, pos, keys, queries, adapters, tensors.get(f"qm.{layer}")) * scaling
                got = [selection_scores(est[:, :, j, :upto], attn[:, :, j, :upto], args.budget, args.sinks,
                                        args.recent, args.candidates, exact[:, :, j, :upto])
                       for j, upto in enumerate(seen)]
                for slot, name in enumerate(METRICS):
                    value = sum(x[slot] for x in got) / len(got)
                    result[kind][name].setdefault(str(pos), []).append(value)
                    sums[kind][slot] += value / len(layers)
        for kind in kinds:
            result[kind]["per_prompt"].append({"task": task, "index": i, **dict(zip(METRICS, sums[kind], strict=True))})
        print(f"{path.name}: " + ", ".join(f"{k} {sums[k][0]:.3f}" for k in kinds), flush=True)
    return result


def interval(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% interval (normal approximation over prompts)."""
    n = len(values)
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / max(1, n - 1))
    return mean, 1.96 * sd / math.sqrt(n)


def table(result: dict, kinds: list[str], reference: str, bits: dict[str, int]) -> str:
    lines = ["| coding | bits a row | device bytes a row | mass (95% CI) | recall of top rows | mass, two stages "
             f"| top row kept, two stages | layers at or above `{reference}`'s mass |", "|---|---|---|---|---|---|---|---|"]
    ref = result[reference]["mass"]
    for kind in kinds:
        r = result[kind]
        mass = interval([p["mass"] for p in r["per_prompt"]])
        recall = interval([p["recall"] for p in r["per_prompt"]])
        two = interval([p["two_stage"] for p in r["per_prompt"]])
        top = interval([p["top_row"] for p in r["per_prompt"]])
        layer_means = {layer: sum(v) / len(v) for layer, v in r["mass"].items()}
        ref_means = {layer: sum(v) / len(v) for layer, v in ref.items()}
        above = sum(layer_means[layer] >= ref_means[layer] - 1e-9 for layer in layer_means)
        size = "–" if kind == "exact" else bits[kind] // 8 + 2
        lines.append(f"| {kind} | {bits[kind]} | {size} | {mass[0]:.3f} ± {mass[1]:.3f} | "
                     f"{recall[0]:.3f} ± {recall[1]:.3f} | {two[0]:.3f} ± {two[1]:.3f} | {top[0]:.3f} ± {top[1]:.3f} | "
                     f"{above} / {len(layer_means)} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--tasks", default="niah_single_2,niah_multikey_1")
    p.add_argument("--haystack", default="kjv")
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--samples", type=int, default=20, help="prompts per task")
    p.add_argument("--queries", type=int, default=8, help="query positions per prompt (the prompt's last)")
    p.add_argument("--answer", action="store_true", help="the queries of the decode steps that write the expected "
                                                         "answer (teacher forcing), not the prompt's last positions")
    p.add_argument("--budget", type=int, default=128)
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--recent", type=int, default=16)
    p.add_argument("--candidates", type=float, default=4.0)
    p.add_argument("--bits", default="16,32,64", help="bits a row of the untrained hashes")
    p.add_argument("--adapter", action="append", default=[], help="a sekv adapter: its trained hash, or (no hash) "
                                                                    "its gains on today's codes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    paths = build_prompts(args)
    from zoomkv.adapters.model import ZoomAdapter

    adapters, kinds, bits = {}, ["exact", "sign"], {}
    probe = load_file(str(paths[0][2]))
    d = next(v for k, v in probe.items() if k.startswith("k.")).shape[-1]
    bits["sign"], bits["exact"] = d, 16 * d  # exact: the fp16 key (no index bytes: it reads the host rows)
    for b in (int(x) for x in args.bits.split(",") if x):
        for name in ("simhash", "orth", "pca", "qfit", "qfit1"):
            kinds.append(f"{name}-{b}")
            bits[f"{name}-{b}"] = b
    for path in args.adapter:
        modules = ZoomAdapter.from_pretrained(path).modules
        label = f"{'trained' if modules.hash_bits else 'sign'}:{Path(path).parent.name}"
        adapters[label] = adapters[label.partition(":")[2]] = modules
        kinds.append(label)
        bits[label] = modules.hash_bits or d
    result = evaluate(paths, kinds, adapters, args)
    text = table(result, kinds, "sign", bits)
    at = "the decode steps writing each answer" if args.answer else f"the last {args.queries} positions of each"
    header = (f"{len(paths)} prompts ({args.tasks} at {args.length} tokens over {args.haystack}), {at}, "
              f"B={args.budget}, {args.model}")
    print(header + "\n\n" + text)
    out = Path(args.out)
    (out / "table.md").write_text(header + "\n\n" + text + "\n", encoding="utf-8")
    (out / "result.json").write_text(json.dumps({"args": vars(args), "result": result}), encoding="utf-8")


if __name__ == "__main__":
    main()
