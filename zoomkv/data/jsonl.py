"""Checking the user's data records: every problem is reported as ``FILE:LINE: what is wrong`` for a JSONL
file (``FILE: record N: what is wrong`` for Parquet, CSV and saved datasets, whose records have no lines).
``read_jsonl`` reads a JSONL file line by line: what ``zoomkv.data.files`` falls back on to say which line
of a file ``datasets`` could not load is wrong."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from zoomkv.errors import ZoomKVError


class DataFileError(ZoomKVError):
    """A data file that cannot be used: unreadable, bad JSON, or a record missing a field."""

    def __init__(self, path: Path | str, line: int | None, message: str):
        by_line = str(path).lower().endswith((".jsonl", ".json"))
        where = str(path) if line is None else f"{path}:{line}" if by_line else f"{path}: record {line}"
        super().__init__(f"{where}: {message}")
        self.path, self.line = str(path), line


def read_jsonl(path: str | Path) -> list[tuple[int, dict[str, Any]]]:
    """``(line number, object)`` for every non-blank line of ``path``."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise DataFileError(path, None, "file not found")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise DataFileError(path, None, f"cannot read it as UTF-8 text ({err})") from err
    records = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataFileError(path, number, f"bad JSON ({err.msg} at column {err.colno})") from None
        except ValueError as err:  # an integer of more than 4300 digits
            raise DataFileError(path, number, f"bad JSON ({err})") from None
        except RecursionError:
            raise DataFileError(path, number, "bad JSON (nested too deeply)") from None
        if not isinstance(obj, dict):
            raise DataFileError(path, number, f"expected a JSON object, got {type(obj).__name__}")
        records.append((number, obj))
    if not records:
        raise DataFileError(path, None, "no records (the file is empty)")
    return records


def require(path: str | Path, line: int, obj: dict[str, Any], fields: dict[str, tuple[type, ...]], fmt: str) -> None:
    """Every field in ``fields`` is present with one of its types, else a DataFileError naming it. A field
    that is null counts as missing: a table (Parquet, or JSONL read by ``datasets``) gives every record
    every column, null where the record had none."""
    for name, types in fields.items():
        if obj.get(name) is None:
            raise DataFileError(path, line, f"missing field {name!r} (the {fmt} format needs {', '.join(fields)})")
        if not isinstance(obj[name], types):
            wanted = " or ".join(t.__name__ for t in types)
            raise DataFileError(path, line, f"field {name!r} should be {wanted}, got {type(obj[name]).__name__}")


def string_list(path: str | Path, line: int, value: Any, name: str) -> list[str]:
    """A field holding one answer or a list of them, as a list of strings."""
    items = value if isinstance(value, list) else [value]
    if not items or not all(isinstance(v, str | int | float) for v in items):
        raise DataFileError(path, line, f"field {name!r} should be a string or a non-empty list of strings")
    return [str(v) for v in items]
