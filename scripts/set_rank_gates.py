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
from pathlib import Path

from safetensors.torch import load_file, save

from zoomkv.adapters.files import write_folder_atomically
from zoomkv.adapters.weights import sha256
from zoomkv.cli_args import parse_method_args

ON, OFF = 3.0, -3.0  # gate logits: a direction is kept when its logit is > 0
WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"


def layer_list(text: str) -> list[int]:
    """``"0-9,20-29"`` → [0, ..., 9, 20, ..., 29]."""
    out: list[int] = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        out += range(int(first), int(last or first) + 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="an sekv adapter folder")
    parser.add_argument("out", type=Path, help="the folder to write (its files replaced if it exists)")
    parser.add_argument("--layers", required=True, help="layers to cut, e.g. 0-9,20-29")
    parser.add_argument("--keys", type=int, required=True, help="key directions kept in those layers")
    parser.add_argument("--values", type=int, required=True, help="value directions kept in those layers")
    parser.add_argument("--hyper", action="append", default=[], metavar="KEY=VALUE",
                        help="an inference option written into the copy's config (a YAML value)")
    args = parser.parse_args()
    tensors = load_file(str(args.source / WEIGHTS))
    gates = tensors["rank_gate"].clone()  # [layers, 2 (keys, values), head_dim]
    gates.fill_(ON)
    for layer in layer_list(args.layers):
        gates[layer, 0, args.keys:] = OFF
        gates[layer, 1, args.values:] = OFF
    tensors["rank_gate"] = gates
    weights = save(tensors)
    config = json.loads((args.source / CONFIG).read_text())
    config["hyper"].update(parse_method_args(args.hyper))
    config["weights_sha256"] = sha256(weights)
    files = {f.name: f.read_bytes() for f in sorted(args.source.iterdir()) if f.is_file()}
    files |= {WEIGHTS: weights, CONFIG: json.dumps(config, indent=1).encode()}
    print(write_folder_atomically(args.out, files, overwrite=True))


if __name__ == "__main__":
    main()
