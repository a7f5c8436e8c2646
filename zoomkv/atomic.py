"""Folders written all or nothing, and the working folders that takes: a folder is finished in a staging
folder next to the target, then put in place with renames only. The model cache (``models/gguf.py``) and
adapter folders (``adapters/files.py``) both install through ``replace_folder``.

Every working folder zoomkv makes beside a target (``.NAME.partial-PID-R`` while writing, ``.NAME.old-PID-R``
holding the folder being replaced) is made by ``owned_folder``: a mark inside names the folder itself from
its first moment. A later run removes only marked folders of dead processes (``settle_leftovers``); a folder
that merely matches the name (``.notes.old-2024``, the user's) is never touched, and no name goes into a glob.
A folder moved aside by a replace killed between its two renames is put back when the target is missing,
and kept (with a warning saying where) when it holds a file the target does not.
"""

from __future__ import annotations

import filecmp
import json
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

log = logging.getLogger(__name__)

OWNED_MARK = ".zoomkv-owned"
STAGING_TAG = ".partial-"
ASIDE_TAG = ".old-"


def read_json_object(path: Path, max_bytes: int = 16 << 20) -> dict | None:
    """A JSON object file zoomkv may have written, read only to recognise it: None when it is missing, a
    link, larger than ``max_bytes``, unreadable, not JSON or not an object."""
    try:
        if path.is_symlink() or not path.is_file() or path.stat().st_size > max_bytes:
            return None
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def free_space(path: Path) -> tuple[Path, int]:
    """The bytes free where ``path`` goes, and the folder they were read at: the nearest of ``path`` and its
    parents that exists (a run or cache folder is checked before it is made)."""
    where = path
    while not where.exists() and where.parent != where:
        where = where.parent
    return where, shutil.disk_usage(where).free


def _mark_text(folder: Path) -> str:
    return f"zoomkv working folder {folder.name}\n"


def mark_owned(folder: Path) -> None:
    """Mark ``folder`` as a working folder of ours (the mark names the folder: a copy or a rename is not)."""
    with open(folder / OWNED_MARK, "x", encoding="utf-8") as f:
        f.write(_mark_text(folder))
        f.flush()
        os.fsync(f.fileno())


def owned_folder(parent: Path, name: str, tag: str) -> Path:
    """A new, marked, hidden working folder ``.{name}{tag}{pid}-{random}`` in ``parent``."""
    folder = Path(tempfile.mkdtemp(prefix=f".{name}{tag}{os.getpid()}-", dir=parent))
    try:
        mark_owned(folder)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)  # unmarked: nothing would ever remove it
        raise
    return folder


def is_owned(folder: Path) -> bool:
    """``folder`` is a working folder zoomkv made (its mark, a plain file, names this very folder)."""
    mark = folder / OWNED_MARK
    try:
        if folder.is_symlink() or mark.is_symlink() or not mark.is_file() or mark.stat().st_size > 4096:
            return False
        return mark.read_text(encoding="utf-8") == _mark_text(folder)
    except (OSError, UnicodeDecodeError):
        return False


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def _leftovers(parent: Path, name: str, tag: str) -> list[Path]:
    """Marked working folders ``.{name}{tag}PID-...`` in ``parent`` whose process is gone (or is this one: a
    process writes one target at a time). The names are compared as strings, never globbed."""
    prefix = f".{name}{tag}"
    found = []
    try:
        entries = sorted(os.scandir(parent), key=lambda e: e.name)
    except OSError:
        return []
    for entry in entries:
        if not entry.name.startswith(prefix) or not entry.is_dir(follow_symlinks=False):
            continue
        pid = entry.name[len(prefix):].split("-", 1)[0]
        if not pid.isdigit() or (int(pid) != os.getpid() and pid_alive(int(pid))):
            continue  # not one of ours, or its writer is running right now
        if is_owned(Path(entry.path)):
            found.append(Path(entry.path))
    return found


def _held_elsewhere(old: Path, new: Path, ours: set[str]) -> list[str]:
    """Files under ``old`` that ``new`` does not hold (the same file, hard-linked, or the same bytes); top-level
    names in ``ours`` (files the writer replaces) do not count."""
    missing = []
    for root, dirs, files in os.walk(old):
        rel_root = Path(root).relative_to(old)
        for item in [*files, *(d for d in dirs if (Path(root) / d).is_symlink())]:
            rel = rel_root / item
            if rel_root == Path(".") and item in ours:
                continue
            src, dst = old / rel, new / rel
            try:
                if src.is_symlink():
                    same = dst.is_symlink() and os.readlink(src) == os.readlink(dst)
                else:
                    same = dst.is_file() and (os.path.samefile(src, dst) or filecmp.cmp(src, dst, shallow=False))
            except OSError:
                same = False
            if not same:
                missing.append(str(rel))
    return missing


def settle_leftovers(parent: Path, name: str, ours: Iterable[str] = ()) -> None:
    """Before writing ``parent/name``: clear what killed writers of it left, losing nothing.

    An aside folder (the old ``name`` moved away by ``replace_folder``) is put back when ``name`` is missing
    (the kill fell between the two renames), deleted when ``name`` holds every file it holds (names in
    ``ours``, the writer's own files, aside), and otherwise kept with a warning saying where it is. Staging
    folders of dead processes are then deleted: what they hold besides new files is hard links (or copies) of
    files still in ``name`` or an aside folder."""
    target = parent / name
    ours = set(ours) | {OWNED_MARK}
    for aside in _leftovers(parent, name, ASIDE_TAG):
        old = aside / name
        if old.exists() or old.is_symlink():
            if not (target.exists() or target.is_symlink()):
                os.replace(old, target)
                log.warning("put %s back from %s, where an interrupted write had moved it", target, aside)
            else:
                missing = _held_elsewhere(old, target, ours) if old.is_dir() and not old.is_symlink() else [name]
                if missing:
                    log.warning("kept %s: an interrupted write left there an earlier %s holding %s, which %s "
                                "does not; move what you need out of it, then delete it", old, name,
                                ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else ""), target)
                    continue
        remove_aside(aside)
    for staging in _leftovers(parent, name, STAGING_TAG):
        shutil.rmtree(staging, ignore_errors=True)


def replace_folder(staged: Path, target: Path) -> None:
    """Put the finished folder ``staged`` at ``target`` so a reader sees the old folder, nothing, or the new
    one, never a partial one. An existing ``target`` is first moved into a marked aside folder
    (``.NAME.old-PID-R/NAME``: rename(2) cannot replace a non-empty folder), which is deleted once the new one
    is in place; if the new one cannot be put in place, the old one is put back. A kill between the two
    renames leaves the old folder whole in the aside folder, and the next ``settle_leftovers`` puts it back."""
    aside = None
    if target.exists() or target.is_symlink():
        aside = owned_folder(target.parent, target.name, ASIDE_TAG)
        try:
            os.replace(target, aside / target.name)
        except BaseException:
            shutil.rmtree(aside, ignore_errors=True)
            raise
    try:
        os.replace(staged, target)
    except BaseException:
        if aside is not None and not (target.exists() or target.is_symlink()):
            os.replace(aside / target.name, target)
            shutil.rmtree(aside, ignore_errors=True)
        raise
    if aside is not None:
        remove_aside(aside)


def remove_aside(aside: Path) -> None:
    """Delete an aside folder whose target is back in place. What cannot be deleted (an immutable file, one in
    a folder of another owner) stays, and so does the folder's mark, so a later run may still sweep it; a
    warning names the folder and what is left, instead of a hidden folder nobody is told of."""
    left: list[str] = []

    def failed(function: object, path: str, error: object) -> None:
        left.append(path)

    on_error = {"onexc": failed} if sys.version_info >= (3, 12) else {"onerror": failed}
    for entry in sorted(os.scandir(aside), key=lambda e: e.name):
        if entry.name == OWNED_MARK:
            continue
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, **on_error)  # type: ignore[arg-type]
        else:
            try:
                os.unlink(entry.path)
            except OSError:
                left.append(entry.path)
    if not left:
        shutil.rmtree(aside, ignore_errors=True)
        return
    shown = ", ".join(str(Path(p).relative_to(aside)) for p in left[:3]) + (" ..." if len(left) > 3 else "")
    log.warning("could not remove %s, the earlier copy of a folder now replaced: %s could not be deleted "
                "(immutable, or not yours to delete); the new folder is in place, delete that one when you can",
                aside, shown)


def write_file_atomically(path: Path, write: Callable[[Path], object]) -> Path:
    """Write one file all or nothing: ``write(tmp)`` fills a new hidden temporary file beside ``path`` (a unique
    name: no file of the user's is ever written over on the way), which then replaces ``path`` in one rename.
    The temporary file is removed if anything fails."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        os.chmod(tmp, 0o666 & ~current_umask())  # mkstemp makes it 0600; the file is made as open() would
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def current_umask() -> int:
    """The process umask, read without changing it where the system says it (Linux), else set and restored."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def follow_umask(folder: Path) -> None:
    """Give a folder made by ``tempfile.mkdtemp`` (always 0700) the mode ``mkdir`` would have given it."""
    os.chmod(folder, 0o777 & ~current_umask())


def follow_umask_tree(folder: Path) -> None:
    """Give ``folder`` and everything in it the modes ``mkdir`` / ``open`` would have given them: writers
    that go through a temporary file (transformers' ``save_pretrained`` among them) leave files 0600."""
    mask = current_umask()
    os.chmod(folder, 0o777 & ~mask)
    for path in folder.rglob("*"):
        if not path.is_symlink():
            os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~mask)
