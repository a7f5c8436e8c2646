"""``make demo``: the embedded default model answers a passkey question from a ~2K-token prompt, once with
``full`` and once with ``oracle_topk`` holding 10% of the rows on the device tier; prints text and memory.
"""

from __future__ import annotations

import sys
import time

from zoomkv.data.passkey import passkey_prompt
from zoomkv.errors import ZoomKVError
from zoomkv.generation import generate_text
from zoomkv.models import DEFAULT_MODEL, load_model


def main() -> int:
    t0 = time.perf_counter()
    print(f"loading {DEFAULT_MODEL} (the first run converts the GGUF once, 20-80 s; later runs take about a second)")
    try:
        model, tokenizer = load_model(DEFAULT_MODEL)
    except ZoomKVError as err:
        print(f"zoomkv: error: {err}", file=sys.stderr)
        return 2
    print(f"loaded in {time.perf_counter() - t0:.1f} s")
    prompt = passkey_prompt(tokenizer, 2048, depth=0.5, seed=7)
    print(f"\nprompt: ~2K tokens of filler with a pass key ({prompt.answer}) at depth 50%\n")
    for method, budget in [("full", None), ("oracle_topk", "0.1")]:
        result = generate_text(model, tokenizer, prompt.text, method=method, budget=budget, max_new_tokens=12, chat=False)
        ok = "correct" if prompt.answer in result.text else "WRONG"
        print(f"=== {method}" + (f" (budget {budget} → {result.memory.budget} rows)" if budget else "") + " ===")
        print(f"answer: {result.text.strip()!r}  [{ok}]")
        print(f"prefill {result.prefill_s:.2f} s, decode {result.decode_ms_per_token:.1f} ms/token")
        print(result.memory.format())
        print()
    print("next: `zoomkv generate --help`, `zoomkv methods`, `zoomkv bench` (see README.md)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
