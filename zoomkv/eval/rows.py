"""Result rows: appended to ``rows.jsonl`` as each prompt finishes (flushed and synced), so an interrupted
run resumes where it stopped, and exported as JSON and CSV at the end.

``run.json`` records what makes rows comparable (model, chat template, seed, ...). Resuming into a
folder whose rows came from a different setting is refused rather than silently mixed.
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from zoomkv.atomic import read_json_object
from zoomkv.errors import ZoomKVError
from zoomkv.locks import LOCK_NAME

# CSV column order; rows.jsonl holds the same fields.
FIELDS = (
    "method", "method_args", "budget", "budget_rows", "task", "length", "depth", "sample", "score", "metric",
    "device_bytes", "host_bytes", "full_kv_bytes", "prefill_s", "decode_ms_per_token", "prompt_tokens",
    "new_tokens", "batch_size", "haystack", "chat", "protocol", "model", "prediction", "answers",
)

GRID_TASK = "niah_grid"
# What the report writes at the end (besides rows.jsonl): run.json lists the ones it wrote ("outputs"), and only
# those are ever replaced or deleted (--overwrite); a file there of one of these names that it does not list is
# the user's, and the run is refused before anything is written.
REPORT_PATTERNS = ("rows.json", "rows.csv", "summary.json", "summary.md", "score_vs_budget_*.png", "pareto.png",
                   "pareto_memory.png",
                   "niah_heatmap_*.png", "diagnostics_*.png")
OUTPUT_PATTERNS = ("rows.jsonl", *REPORT_PATTERNS)
RUN_FILE = "run.json"


def row_key(row: dict[str, Any]) -> tuple[Any, ...]:
    """What identifies a row within one run. Depth is part of it only on the grid, where it is a
    coordinate; elsewhere it is a property of the sample."""
    depth = row.get("depth") if row["task"] == GRID_TASK else None
    return (row["task"], int(row["length"]), None if depth is None else round(float(depth), 4), int(row["sample"]),
            row["method"], row.get("method_args") or "", row.get("budget") or "")


# What a row needs to be told apart from the others (row_key) and summarised: field → the JSON types it may hold.
ROW_TYPES: dict[str, tuple[type, ...]] = {
    "task": (str,), "length": (int,), "sample": (int,), "method": (str,),
    "method_args": (str, type(None)), "budget": (str, type(None)), "depth": (int, float, type(None)),
    "score": (int, float, type(None)),
}
REQUIRED_ROW_FIELDS = ("task", "length", "sample", "method")


def check_row(row: Any, where: str) -> None:
    """A row read back from a rows file holds the fields that identify it, of the types zoomkv writes; else
    one ``ZoomKVError`` naming the file and line (a hand-edited or foreign row is refused, not half-read)."""
    if not isinstance(row, dict):
        raise ZoomKVError(f"{where}: a row is a JSON object, got {type(row).__name__}; fix or delete the line "
                          "to resume")
    missing = [k for k in REQUIRED_ROW_FIELDS if k not in row]
    if missing:
        raise ZoomKVError(f"{where}: the row lacks {', '.join(map(repr, missing))}; fix or delete the line to "
                          "resume")
    for key, types in ROW_TYPES.items():
        value = row.get(key)
        if key in row and (not isinstance(value, types) or (isinstance(value, bool) and bool not in types)):
            raise ZoomKVError(f"{where}: the row's {key!r} is {value!r}; fix or delete the line to resume")


def check_output_folder(out: str | Path, *, create: bool = False) -> Path:
    """``--out``: a folder that is there or can be made (a file in the way, a read-only place: one
    ``ZoomKVError`` naming it). Without ``create`` nothing is left behind: a probe folder is made and removed
    where the first missing folder would go."""
    out = Path(out).expanduser()
    if out.exists() and not out.is_dir():
        raise ZoomKVError(f"--out {out} is a file, not a folder")
    base = out
    while not base.exists() and base.parent != base:
        base = base.parent
    if not base.is_dir():
        raise ZoomKVError(f"--out {out}: {base} is a file, not a folder")
    try:
        if create:
            out.mkdir(parents=True, exist_ok=True)
        else:
            import tempfile

            os.rmdir(tempfile.mkdtemp(prefix=".zoomkv-probe-", dir=base))
    except OSError as err:
        raise ZoomKVError(f"--out {out}: cannot write there ({err.strerror or err})") from None
    return out


_BAD = object()  # a line that is not JSON
IDENTITY_REQUIRED = ("model", "seed")  # what run.json must record for rows to be resumed
PART_GLOB = "rows.part-*.jsonl"  # one per process of a sharded run, merged into rows.jsonl at its end


def _run_record(out: Path) -> dict[str, Any] | None:
    """``run.json`` when it is an evaluation run's (it lists its outputs, or, written before that, names the
    model and seed); None when missing or anything else."""
    record = read_json_object(out / RUN_FILE)
    if record is None:
        return None
    if isinstance(record.get("outputs"), list) or {"model", "seed"} <= set(record):
        return record
    return None


def _written(record: dict[str, Any] | None) -> set[str] | None:
    """The report files run.json says the run wrote (None: a run from before the list, whose files of the
    report's names were all its own)."""
    if record is None:
        return set()
    outputs = record.get("outputs")
    if not isinstance(outputs, list) or record.get("writing_report") is True:
        return None  # (or a report killed midway: the files of its names that appeared since are its own)
    return {name for name in outputs if isinstance(name, str) and _is_report_name(name)}


def _is_report_name(name: str) -> bool:
    import fnmatch

    return "/" not in name and "\\" not in name and any(fnmatch.fnmatchcase(name, p) for p in REPORT_PATTERNS)


def check_eval_folder(out: str | Path, *, report_only: bool = False) -> None:
    """Before anything is written: ``--out`` is new or empty, or holds an evaluation run of ours (its
    ``run.json``), or (``--report-only``) rows put there to be reported; and none of the report's files that
    would be replaced there is a file the run did not write. Every refusal is one ``ZoomKVError`` line."""
    out = Path(out).expanduser()
    if not out.is_dir() or not any(p.name != LOCK_NAME for p in out.iterdir()):  # a writer's lock alone: empty
        return
    record = _run_record(out)
    if record is None and (out / RUN_FILE).exists():
        raise ZoomKVError(f"--out {out}: its {RUN_FILE} is not a zoomkv eval run's; use a new or empty folder")
    if record is None and not report_only:
        raise ZoomKVError(f"--out {out} holds files and no zoomkv eval run (no {RUN_FILE}); use a new or empty "
                          "folder, or the folder of an earlier run to resume it")
    written = _written(record)
    if written is None:
        return
    foreign = sorted({p.name for pattern in REPORT_PATTERNS for p in out.glob(pattern)} - written)
    if foreign:
        raise ZoomKVError(f"--out {out}: {', '.join(foreign[:4])}{' ...' if len(foreign) > 4 else ''} "
                          f"{'was' if len(foreign) == 1 else 'were'} not written by zoomkv eval ({RUN_FILE} does not "
                          "list them) and would be replaced; move them, or use another --out")


def part_name(rank: int) -> str:
    return f"rows.part-{rank:05d}.jsonl"


class RowStore:
    """The rows of one ``--out`` folder: ``rows.jsonl`` plus, while a sharded run is on (or after one was
    killed), each process's ``rows.part-NNNNN.jsonl``. Every process reads them all (a row any process
    finished is done), appends only to its own file (``part``: its rank; None: ``rows.jsonl`` itself), and the
    main process merges the parts into ``rows.jsonl`` at the end (``merge``)."""

    def __init__(self, out: str | Path, *, part: int | None = None):
        # made only when the first thing is written into it (run.json, once the run's first prompts are built):
        # a run refused before that leaves no folder behind
        self.out = check_output_folder(out)
        self.path = self.out / "rows.jsonl"
        self.write_path = self.path if part is None else self.out / part_name(part)
        self.run_file = self.out / RUN_FILE
        self.rows: list[dict[str, Any]] = []
        self.done: set[tuple[Any, ...]] = set()

    def has_rows(self) -> bool:
        return self.path.is_file() or any(self.out.glob(PART_GLOB))

    def clear(self) -> None:
        """``--overwrite``: the rows and every report file an earlier run wrote here (those run.json lists, of
        the report's names), so no stale plot outlives its rows; nothing else."""
        written = _written(_run_record(self.out))
        stale = {p for pattern in REPORT_PATTERNS for p in self.out.glob(pattern)
                 if written is None or p.name in written}
        for path in [self.path, *self.out.glob(PART_GLOB), *sorted(stale)]:
            path.unlink(missing_ok=True)

    def recorded_identity(self) -> dict[str, Any]:
        old = dict(_run_record(self.out) or {})
        old.pop("outputs", None)
        old.pop("writing_report", None)
        if old:
            old.setdefault("protocol", "query-aware")  # rows written before protocols existed put the question in
        return old

    def check_identity(self, identity: dict[str, Any], *, resuming: bool = True) -> None:
        """Refuse rows of another run (model, seed, chat, ...): the settings both record and differ in. A
        setting given as None is not known yet (``--chat auto`` before the tokenizer is loaded). Rows to resume
        (``resuming``; not ``--report-only``, which adds none) need a run.json that records their model and seed,
        and rows that name no other model: else nothing tells them apart from another run's."""
        if not self.has_rows():
            return
        old = self.recorded_identity()
        missing = [k for k in IDENTITY_REQUIRED if k in identity and k not in old]
        if resuming and missing:
            raise ZoomKVError(f"{self.run_file} does not record the {' and '.join(missing)} of the rows in {self.out} "
                              "(missing, corrupt or edited), so they cannot be told from another run's; use another "
                              "--out, or --overwrite to start afresh")
        if resuming and "model" in identity:
            models = sorted({str(r.get("model")) for r in self.load() if r.get("model") not in (None, identity["model"])})
            if models:
                raise ZoomKVError(f"{self.out} holds rows of model(s) {', '.join(models)}, not {identity['model']!r} "
                                  f"(whatever {RUN_FILE} says); use another --out, or --overwrite to start afresh")
        diff = [k for k in identity if k in old and identity[k] is not None and old[k] != identity[k]]
        if diff:
            what = "; ".join(f"{k}: {old[k]!r} there, {identity[k]!r} now" for k in diff)
            raise ZoomKVError(f"{self.out} holds rows of a different run ({what}); use another --out, or "
                              "--overwrite to start afresh")

    def record_identity(self, identity: dict[str, Any]) -> None:
        """Write run.json: this run's settings over the ones recorded (a setting this run does not use, such as
        the haystack of a run without essay tasks, stays as an earlier run recorded it)."""
        merged = {**(self.recorded_identity() if self.has_rows() else {}), **identity}
        old = _run_record(self.out) or {}
        self._write_record({**merged, "outputs": old.get("outputs") if isinstance(old.get("outputs"), list) else [],
                            "writing_report": old.get("writing_report") is True})

    def record_outputs(self, paths: list[Path], *, writing: bool = False) -> None:
        """Around the report: ``writing`` before it (a report killed midway leaves the files it wrote claimed),
        then the files it wrote added to run.json's list (those still there stay listed)."""
        record = dict(_run_record(self.out) or {})
        before = _written({**record, "writing_report": False})
        listed = {n for n in before or set() if (self.out / n).is_file()}
        names = listed | {p.name for p in paths if p.parent == self.out and _is_report_name(p.name)}
        self._write_record({**record, "outputs": sorted(names), "writing_report": writing})

    def _write_record(self, record: dict[str, Any]) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        tmp = self.out / f".{RUN_FILE}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        os.replace(tmp, self.run_file)

    def load(self) -> list[dict[str, Any]]:
        """Read every row file (``rows.jsonl`` first, then the parts by rank): one row per key, the first."""
        rows: list[dict[str, Any]] = []
        for path in [self.path, *sorted(self.out.glob(PART_GLOB))]:
            rows += self._read(path)
        unique: dict[tuple[Any, ...], dict[str, Any]] = {}
        for r in rows:
            unique.setdefault(row_key(r), r)
        self.rows = list(unique.values())
        self.done = set(unique)
        return self.rows

    def _read(self, path: Path) -> list[dict[str, Any]]:
        if not path.is_file():
            return []
        try:
            lines = path.read_text(encoding="utf-8").split("\n")
        except UnicodeDecodeError as err:
            line = path.read_bytes()[: err.start].count(b"\n") + 1
            raise ZoomKVError(f"{path}:{line}: not UTF-8 text (byte {err.start}); fix or delete the line to "
                              "resume") from None
        rows, good = [], []
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                row = _BAD
            if row is not _BAD:
                check_row(row, f"{path}:{number}")
                rows.append(row)
                good.append(line)
            else:
                if number >= len(lines) - 1:  # the last line, cut off by an interruption: redo that row
                    if path == self.write_path:  # another process's file is its to repair (it may be writing)
                        path.write_text("".join(g + "\n" for g in good), encoding="utf-8")
                    break
                raise ZoomKVError(f"{path}:{number}: bad JSON; fix or delete the line to resume") from None
        return rows

    def has(self, key: tuple[Any, ...]) -> bool:
        return key in self.done

    def append(self, rows: list[dict[str, Any]]) -> None:
        fresh = [r for r in rows if row_key(r) not in self.done]
        if not fresh:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        with open(self.write_path, "a", encoding="utf-8") as fh:
            for r in fresh:
                fh.write(json.dumps(r, ensure_ascii=False) + "\n")
            fh.flush()
            os.fsync(fh.fileno())  # the row is done only once it is on disk
        self.rows += fresh
        self.done.update(row_key(r) for r in fresh)

    def merge(self, order: Callable[[dict[str, Any]], Any]) -> list[dict[str, Any]]:
        """Main process, once every process is done: the parts' rows join ``rows.jsonl`` (after its own rows,
        sorted by ``order``, stably, so each prompt batch's rows stay in the order they were written: the
        order one process would have written them in), the file is replaced in one rename, then the parts
        are removed. A kill at any point loses no row (a row in both places is read once)."""
        parts = sorted(self.out.glob(PART_GLOB))
        own = self._read(self.path)
        if parts:
            keys = {row_key(r) for r in own}
            new: list[dict[str, Any]] = []
            for part in parts:
                for r in self._read(part):
                    if row_key(r) not in keys:
                        keys.add(row_key(r))
                        new.append(r)
            new.sort(key=order)
            tmp = self.path.with_name(f".rows.jsonl.{os.getpid()}.tmp")
            with open(tmp, "w", encoding="utf-8") as fh:
                for r in own + new:
                    fh.write(json.dumps(r, ensure_ascii=False) + "\n")
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path)
            for part in parts:
                part.unlink(missing_ok=True)
        self.write_path = self.path
        return self.load()


def write_tables(rows: list[dict[str, Any]], out: str | Path) -> None:
    out = Path(out)
    (out / "rows.json").write_text(json.dumps(rows, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    with open(out / "rows.csv", "w", encoding="utf-8", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(FIELDS), extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            writer.writerow({k: json.dumps(v, ensure_ascii=False) if isinstance(v, list | dict) else v
                             for k, v in r.items()})
