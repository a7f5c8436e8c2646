"""The pages a user reads: every public name has a docstring (the API reference, ``make docs``, is built from
them), every relative link of README.md and docs/ resolves (anchors included), the README's Python snippet runs,
and README.md and BENCHMARKS.md stay the size they promise."""

from __future__ import annotations

import contextlib
import csv
import importlib
import inspect
import io
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BENCHMARKS = ROOT / "BENCHMARKS.md"
DOCS = ROOT / "docs"

# The public API: a module's ``__all__`` (None) or the names listed. ``make docs`` renders these modules.
PUBLIC: dict[str, list[str] | None] = {
    "zoomkv": None,
    "zoomkv.memory": None,
    "zoomkv.protocol": None,
    "zoomkv.methods": None,
    "zoomkv.adapters": None,
    "zoomkv.models": None,
    "zoomkv.generation": ["generate_text", "generate_methods", "GenerationResult"],
    "zoomkv.conversation": ["Conversation"],
    "zoomkv.runspec": ["RunSpec", "parse_runs", "parse_run"],
    "zoomkv.compat": ["generate_cache_kwargs"],
    "zoomkv.cli": ["main", "build_parser"],
    "zoomkv.adapters.peft_integration": ["cache_from_peft"],
}


def _own_doc(obj: object) -> str:
    """A docstring written for ``obj``: a dataclass's generated ``Name(field: type, ...)`` does not count."""
    doc = inspect.getdoc(obj) or ""
    if inspect.isclass(obj) and (obj.__doc__ is None or obj.__doc__.startswith(obj.__name__ + "(")):
        return ""
    return doc


def _public_names() -> list[tuple[str, object]]:
    found: dict[int, tuple[str, object]] = {}
    for module_name, names in PUBLIC.items():
        module = importlib.import_module(module_name)
        for name in names if names is not None else module.__all__:
            obj = getattr(module, name)
            if not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue  # constants and registries' dicts (METHODS) document themselves where defined
            found.setdefault(id(obj), (f"{module_name}.{name}", obj))
            if inspect.isclass(obj):
                for member, value in vars(obj).items():
                    if member.startswith("_"):
                        continue
                    func = value.__func__ if isinstance(value, classmethod | staticmethod) else value
                    func = func.fget if isinstance(func, property) else func
                    if inspect.isfunction(func):
                        found.setdefault(id(func), (f"{module_name}.{name}.{member}", getattr(obj, member)))
    return sorted(found.values(), key=lambda item: item[0])


def test_every_public_name_has_a_docstring():
    missing = [name for name, obj in _public_names() if not _own_doc(obj).strip()]
    assert missing == [], "public names without a docstring (the API reference shows them empty): " + ", ".join(missing)


def test_the_public_api_is_the_one_the_reference_page_lists():
    """docs/api.md names the public names a user starts from; each of them exists."""
    text = (DOCS / "api.md").read_text(encoding="utf-8")
    for dotted in re.findall(r"`(zoomkv(?:\.\w+)+)`", text):
        module_name, _, attr = dotted.rpartition(".")
        try:
            module = importlib.import_module(dotted)
            continue
        except ModuleNotFoundError:
            module = importlib.import_module(module_name)
        assert hasattr(module, attr), f"docs/api.md names {dotted}, which does not exist"


# ----------------------------------------------------------------------------------------- links
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)  # no headings inside code
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.*)$", text, re.M)}


def _pages() -> list[Path]:
    return [README, BENCHMARKS, *sorted(DOCS.glob("*.md"))]


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for target in LINK.findall(page.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(f"{target}: no heading '#{anchor}' in {resolved.relative_to(ROOT)}")
    assert broken == [], f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_readme_links_every_docs_page():
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in LINK.findall(README.read_text(encoding="utf-8"))}
    unlinked = [p.name for p in DOCS.glob("*.md") if p.resolve() not in linked]
    assert unlinked == [], f"docs pages the README does not link: {unlinked}"


# ----------------------------------------------------------------------------------------- the README
def _section(text: str, heading: str) -> str:
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else None]


def test_readme_is_one_screen_of_each_thing():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) < 200
    figure = re.search(r"!\[[^\]]*\]\(([^)]+\.png)\)", text)
    assert figure and (ROOT / figure.group(1)).stat().st_size < 200_000
    caption = text[figure.end():figure.end() + 600]
    assert re.search(r"\b\d+ samples a task", caption), "the figure's caption says its sample size"
    rows = [line for line in _section(text, "What it buys").splitlines() if line.startswith("| ")][1:]
    assert 1 <= len(rows) <= 8
    assert len(BENCHMARKS.read_text(encoding="utf-8").splitlines()) < 700


def test_the_figure_and_the_table_show_the_same_numbers():
    """docs/figures/heldout-4k.csv (what scripts/readme_figure.py draws) holds the README table's numbers."""
    lines = [x for x in (DOCS / "figures" / "heldout-4k.csv").read_text().splitlines() if x and not x.startswith("#")]
    points = {(float(r["score"]), float(r["device"]), float(r["host"]), float(r["decode"]) if r["decode"] else None)
              for r in csv.DictReader(lines)}
    rows = [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in _section(README.read_text(encoding="utf-8"), "What it buys").splitlines() if line.startswith("|")]
    header = rows[0]

    def column(start: str) -> int:  # by name: a column added later (a GPU ratio) is read past
        return next(i for i, h in enumerate(header) if h.startswith(start))

    score, device, host, decode = column("score"), column("device"), column("host"), column("decode × `full` (CPU)")
    table = {(float(r[score]), float(r[device].rstrip("%")), float(r[host].rstrip("%")),
              None if r[decode] in ("–", "-") else float(r[decode])) for r in rows[2:]}
    assert points == table


def test_the_readme_snippet_runs(tmp_path):
    """The README's snippet, as written, against the tiny test model and a tiny exported sekv adapter."""
    from zoomkv.adapters import ZoomAdapter
    from zoomkv.models import load_model

    section = _section(README.read_text(encoding="utf-8"), "Use a trained adapter")
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert len(code.strip().splitlines()) <= 10
    model, _ = load_model("tiny-llama")
    folder = tmp_path / "adapter"
    ZoomAdapter.initialise(model, "sekv", {"max_trainable_fraction": 0.01}, budget=64,
                           name="tiny-llama").save_pretrained(folder)
    assert '"smollm2-135m"' in code and '"checkpoints/sekv-smollm2-quickstart/adapter"' in code
    code = code.replace('"smollm2-135m"', '"tiny-llama"').replace(
        '"checkpoints/sekv-smollm2-quickstart/adapter"', repr(str(folder)))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "README.md", "exec"), {})
    assert printed.getvalue().strip(), "the snippet prints the generated text"


def test_zoomkv_methods_prints_each_default_as_written(capsys):
    """docs/methods.md sends users to `zoomkv methods` for the published defaults: each is a value, not an object."""
    from zoomkv.cli import main

    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    assert "host_bits=[]" in out and " object at 0x" not in out
