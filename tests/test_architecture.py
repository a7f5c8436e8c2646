"""The package's layers point one way (docs/ARCHITECTURE.md): built from the source's imports, every
import between top-level parts of ``zoomkv/`` goes to the same layer or one below, and the parts import
each other in no cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "zoomkv"

# Bottom to top. Parts in one layer may import each other (never in a cycle); a part never imports a
# higher layer. zoomkv/__init__.py, the package face, is above them all (it re-exports the public API).
LAYERS: list[set[str]] = [
    {"errors", "logs", "compat", "budget", "version", "atomic", "launch", "locks", "native", "kernels", "models", "data"},
    {"protocol"},
    {"memory"},
    {"methods"},
    {"adapters"},
    {"train"},
    {"generation", "conversation", "runspec", "eval", "bench", "calibrate"},
    {"commands", "cli", "cli_args", "demo", "__main__"},
]
LAYER_OF = {part: i for i, layer in enumerate(LAYERS) for part in layer}
FACE = "__init__"


def part_of(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    if rel.name == "__main__.py":  # an entry point (python -m zoomkv.train) stands with the command line
        return "__main__"
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def imported_parts(path: Path) -> set[tuple[str, int]]:
    """Top-level parts of zoomkv this file imports (anywhere in it, lazily or under TYPE_CHECKING too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] if node.module != "zoomkv" else [f"zoomkv.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "zoomkv":
                target = parts[1] if len(parts) > 1 else FACE
                if not (PACKAGE / target).is_dir() and not (PACKAGE / f"{target}.py").is_file():
                    target = FACE  # a name the face defines
                found.add((target, node.lineno))
    return found


def import_graph() -> dict[str, dict[str, list[str]]]:
    """part -> imported part -> the places (file:line) that import it."""
    graph: dict[str, dict[str, list[str]]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        source = part_of(path)
        for target, line in imported_parts(path):
            if target != source:
                graph.setdefault(source, {}).setdefault(target, []).append(f"{path.relative_to(PACKAGE.parent)}:{line}")
    return graph


def test_every_part_has_a_layer():
    parts = {part_of(p) for p in PACKAGE.rglob("*.py")} - {FACE}
    assert sorted(parts - set(LAYER_OF)) == [], "place new top-level parts in LAYERS (and docs/ARCHITECTURE.md)"


def test_no_import_points_up():
    upward = []
    for source, targets in import_graph().items():
        for target, places in targets.items():
            if source == FACE:
                continue
            if target == FACE or LAYER_OF.get(target, -1) > LAYER_OF.get(source, -1):
                upward.append(f"{source} -> {target}: {', '.join(places)}")
    assert upward == []


def test_no_cycle_between_parts():
    graph = {s: set(t) - {FACE} for s, t in import_graph().items() if s != FACE}
    seen: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        seen[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if seen.get(nxt) == 1:
                cycles.append(" -> ".join([*path[path.index(nxt):], nxt]))
            elif nxt not in seen:
                visit(nxt, [*path, nxt])
        seen[node] = 2

    for start in sorted(graph):
        if start not in seen:
            visit(start, [start])
    assert cycles == []


@pytest.mark.parametrize("name", ["methods/_", "adapters/_", "memory/_"])
def test_private_modules_stay_in_their_package(name):
    """A ``_module`` is private to its package: nothing outside the package imports it."""
    package = name.split("/")[0]
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if part_of(path) == package:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(f"zoomkv.{package}."):
                if node.module.split(".")[2].startswith("_"):
                    offenders.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.module}")
    assert offenders == []


def test_the_training_loop_names_no_method():
    """Everything method-specific reaches zoomkv/train through the registry's MethodTraining."""
    hits = []
    for path in sorted((PACKAGE / "train").glob("*.py")):
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if "semantic_id" in line or '"sekv"' in line:
                hits.append(f"{path.name}:{i}: {line.strip()}")
    assert hits == []
