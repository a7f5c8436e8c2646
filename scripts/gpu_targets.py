"""The GPU issue's targets, read from the tables ``scripts/cuda_check.sh`` wrote: each one measured, met or not.

    python scripts/gpu_targets.py OUT_DIR        # cuda_check.sh runs it last

Every number comes from one ``zoomkv bench`` table (one process: its ``hf`` row is the reference of its ratios);
a part that did not run, or a row missing from its table, is said so, never guessed.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

PARTS = {
    "long": "llama8b_32k_b8.md",
    "chunked": "llama8b_32k_b8_chunked.md",
    "profile": "llama8b_16k_profile.md",
    "fit": "llama8b_32k_b32_fit.md",
    "uncaptured": "llama8b_16k_uncaptured.md",
}


def read_table(path: Path) -> dict[str, dict[str, str]] | None:
    """A bench table's rows by method: cells by column name (the decode columns named ``decode × full`` and
    ``decode × hf``, the prefill's ``prefill × ...``), or None where the file or its table is missing."""
    if not path.is_file():
        return None
    lines: list[str] = []
    for line in path.read_text(encoding="utf-8").splitlines():  # the first table only (--profile prints another)
        if line.startswith("|"):
            lines.append(line)
        elif lines:
            break
    lines = [line for line in lines if not line.startswith("|---")]
    if not lines:
        return None
    names, phase = [], "prefill"
    for cell in (c.strip() for c in lines[0].strip("|").split("|")):
        if cell.startswith("decode"):
            phase = "decode"
        names.append(f"{phase} {cell}" if cell.startswith("×") else cell)
    rows = {}
    for line in lines[1:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = dict(zip(names, cells, strict=False))
    return rows


def shape(path: Path) -> str | None:
    """The prompt shape a bench table was measured at, from its header line (``32K x 8``), or None."""
    if not path.is_file():
        return None
    found = re.search(r"prompt (\d+) tokens(?: x (\d+) sequences)?", path.read_text(encoding="utf-8"))
    if found is None:
        return None
    tokens, batch = int(found.group(1)), int(found.group(2) or 1)
    return f"{round(tokens / 1024)}K x {batch}" if tokens >= 1024 else f"{tokens} tokens x {batch}"


def number(row: dict[str, str] | None, column: str) -> float | None:
    try:
        return float(row[column].replace(",", "")) if row is not None else None
    except (KeyError, ValueError):
        return None


def out_of_memory(row: dict[str, str] | None) -> bool:
    return row is not None and any("out of device memory" in cell for cell in row.values())


def targets(folder: Path) -> list[tuple[str, str, str]]:
    """(target, measured, verdict) lines."""
    tables = {part: read_table(folder / name) for part, name in PARTS.items()}
    shapes = {part: shape(folder / name) for part, name in PARTS.items()}
    lines: list[tuple[str, str, str]] = []

    def ratio(part: str, method: str, limit: float, target: str, column: str = "decode × hf") -> None:
        table = tables[part]
        value = number(table.get(method) if table else None, column)
        if value is None:
            lines.append((target, f"not measured ({PARTS[part]}: {'no table' if table is None else 'no row'})", "?"))
        else:  # the shape it ran at beside it: cuda_check.sh's batch follows the GPU's memory
            lines.append((target, f"{value:.2f}x `hf` ({shapes[part]})",
                          "met" if value <= limit else f"not met (limit {limit})"))

    ratio("long", "full", 1.0, "2. `full` <= 1.0x `hf`, 32K x 8")
    ratio("profile", "full", 1.0, "2. `full` <= 1.0x `hf`, 16K x 1")
    ratio("long", "sekv", 0.35, "3. `sekv` <= 0.35x `hf`, 32K x 8")
    ratio("profile", "sekv", 0.8, "3. `sekv` <= 0.8x `hf`, 16K x 1")
    ratio("long", "quest", 0.6, "3. `quest` <= 0.6x `hf`, 32K x 8")
    profile = tables["profile"] or {}
    for method in ("sekv", "quest", "clusterkv", "oracle_topk"):
        syncs = number(profile.get(method), "syncs/step")
        lines.append((f"4. 0 host waits a step, `{method}`", "not measured" if syncs is None else f"{syncs:g}",
                      "?" if syncs is None else "met" if syncs == 0 else "not met"))
    for part, what in (("long", "one-shot"), ("chunked", "chunks of 4K")):
        row = (tables[part] or {}).get("sekv")
        peak, full_kv = number(row, "CUDA peak MiB"), number(row, "full KV MiB")
        target = f"5. `sekv` CUDA peak above the weights <= 25% of full KV, 32K x 8, {what}"
        if peak is None or not full_kv:
            lines.append((target, "not measured", "?"))
        else:
            share = peak / full_kv
            lines.append((target, f"{peak:,.0f} MiB = {share:.0%} of {full_kv:,.0f}", "met" if share <= 0.25 else
                          "not met"))
    fit = tables["fit"] or {}
    sekv_fit = next((row for name, row in fit.items() if name.startswith("sekv")), None)
    both_out = out_of_memory(fit.get("hf")) and out_of_memory(fit.get("full"))
    decodes = number(sekv_fit, "decode tok/s")
    lines.append(("5. `hf` and `full` out of device memory at 32 x 32K, `sekv` decodes",
                  "not measured" if not fit else f"hf/full out of memory: {both_out}; sekv {decodes} tok/s",
                  "?" if not fit else "met" if both_out and decodes else "not met"))
    hf_long = number((tables["long"] or {}).get("hf"), "decode tok/s")
    if decodes and hf_long:
        lines.append(("6. `sekv` tok/s >= 3x `hf`'s, each at its largest batch measured",
                      f"{decodes / hf_long:.2f}x ({shapes['fit']} against {shapes['long']})",
                      "met" if decodes >= 3 * hf_long else "not met"))
    else:
        lines.append(("6. `sekv` tok/s >= 3x `hf`'s at the largest batch", "not measured", "?"))
    for method in ("sekv", "quest"):
        captured = number(profile.get(method), "decode × hf")
        uncaptured = number((tables["uncaptured"] or {}).get(method), "decode × hf")
        lines.append((f"CUDA graphs: `{method}` at 16K x 1, captured / uncaptured",
                      "not measured" if captured is None or uncaptured is None else
                      f"{captured:.2f}x / {uncaptured:.2f}x `hf`", "-"))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="cuda_check.sh's output folder")
    args = parser.parse_args(argv)
    print("| target | measured | |\n|---|---|---|")
    for target, measured, verdict in targets(args.folder):
        print(f"| {target} | {measured} | {verdict} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
