"""Write a copy of an sekv adapter whose host-tier rank gates are set by hand, layer by layer.

For ablations of the rank budget (issue: trained modules): which layers' host rows survive a cut, without
training. In the layers named, the first ``--keys`` key directions and the first ``--values`` value directions
are kept (the directions are the sequence's own principal ones, strongest first); every other layer keeps all
of them. ``--hyper KEY=VALUE`` sets the method's inference options in the copy's config (e.g.
``host_key_basis=pre_rope``, ``host_exact_sinks=true``); the checksum is recomputed, so the copy loads like any
adapter.

    python scripts/set_rank_gates.py checkpoints/sekv-smollm2-quickstart/adapter /tmp/cut-a --layers 0-9 \\
        --keys 16 --values 16 --hyper host_key_basis=pre_rope --hyper host_exact_sinks=true --hyper host_exact_late=true
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from zoomkv.adapters.weights import sha256

ON, OFF = 3.0, -3.0  # gate logits: a direction is kept when its logit is > 0


def layer_list(text: str) -> list[int]:
    """``"0-9,20-29"`` → [0, ..., 9, 20, ..., 29]."""
    out: list[int] = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        out += range(int(first), int(last or first) + 1)
    return out


def parse_value(text: str) -> object:
    return {"true": True, "false": False}.get(text.lower(), text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="an sekv adapter folder")
    parser.add_argument("out", type=Path, help="the folder to write (replaced if it exists)")
    parser.add_argument("--layers", required=True, help="layers to cut, e.g. 0-9,20-29")
    parser.add_argument("--keys", type=int, required=True, help="key directions kept in those layers")
    parser.add_argument("--values", type=int, required=True, help="value directions kept in those layers")
    parser.add_argument("--hyper", action="append", default=[], metavar="KEY=VALUE",
                        help="an inference option written into the copy's config")
    args = parser.parse_args()
    tensors = load_file(str(args.source / "adapter_model.safetensors"))
    gates = tensors["rank_gate"].clone()  # [layers, 2 (keys, values), head_dim]
    gates.fill_(ON)
    for layer in layer_list(args.layers):
        gates[layer, 0, args.keys:] = OFF
        gates[layer, 1, args.values:] = OFF
    tensors["rank_gate"] = gates
    if args.out.exists():
        shutil.rmtree(args.out)
    shutil.copytree(args.source, args.out)
    save_file(tensors, str(args.out / "adapter_model.safetensors"))
    config = json.loads((args.out / "adapter_config.json").read_text())
    for item in args.hyper:
        key, _, value = item.partition("=")
        config["hyper"][key] = parse_value(value)
    config["weights_sha256"] = sha256((args.out / "adapter_model.safetensors").read_bytes())
    (args.out / "adapter_config.json").write_text(json.dumps(config, indent=1))
    print(args.out)


if __name__ == "__main__":
    main()
