"""Writing an adapter folder so that a crash never leaves a half adapter behind.

Everything is written into a hidden staging folder next to the target, fsynced, then renamed onto the
target in one ``rename(2)``. Replacing a folder replaces only the files being written: any other file in
it (the user's) is hard-linked (or copied) into the staging folder first, so it is there after the rename
and nothing but the old copies of our own files is deleted. The staging folder carries an ``.zoomkv-incomplete`` marker from its first
byte until after the rename, and the loader refuses any folder with that marker: a kill at any point
(mid-write, between the rename and the marker's removal) leaves nothing that loads. The next export of
the same name sweeps staging folders of dead processes and replaces a marked target without needing
``overwrite``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

from zoomkv.adapters.errors import AdapterExistsError
from zoomkv.atomic import follow_umask, replace_folder

INCOMPLETE_MARKER = ".zoomkv-incomplete"
_STAGING_TAG = ".partial-"
_OLD_TAG = ".old-"


def _fsync_dir(path: Path) -> None:
    # The rename is only durable once the directory entry is on disk; some filesystems refuse, harmless.
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale(parent: Path, name: str) -> None:
    """Remove staging / replaced folders of ``name`` left by exports whose process is gone."""
    for tag in (_STAGING_TAG, _OLD_TAG):
        for path in parent.glob(f".{name}{tag}*"):
            pid_part = path.name[len(f".{name}{tag}"):].split("-", 1)[0]
            if pid_part.isdigit() and _pid_alive(int(pid_part)) and int(pid_part) != os.getpid():
                continue  # another export of the same name is running right now
            shutil.rmtree(path, ignore_errors=True)


def is_incomplete(folder: Path) -> bool:
    return (folder / INCOMPLETE_MARKER).exists()


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:  # a filesystem without hard links
        shutil.copy2(src, dst, follow_symlinks=False)


def keep_other_files(old: Path, staging: Path, ours: set[str]) -> None:
    """Carry every entry of ``old`` that is not one of ``ours`` into ``staging`` (hard links: the old folder
    keeps them too until the rename, so a crash in between loses nothing)."""
    for entry in old.iterdir():
        if entry.name in ours:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.copytree(entry, staging / entry.name, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(str(entry), str(staging / entry.name))


def write_folder_atomically(out: str | Path, files: Mapping[str, bytes], *, overwrite: bool = False) -> Path:
    """Write ``files`` (name → bytes, in order) as the folder ``out``, all or nothing. Over an existing folder
    (``overwrite``) only those files are replaced; other files in it are kept."""
    out = Path(out)
    parent = out.parent
    parent.mkdir(parents=True, exist_ok=True)
    sweep_stale(parent, out.name)
    if (out.exists() or out.is_symlink()) and not out.is_dir():
        raise AdapterExistsError(f"{out} exists and is not a folder (it is never replaced)")
    if out.exists() and not overwrite and not is_incomplete(out):
        raise AdapterExistsError(f"{out} already exists (pass --overwrite to replace it)")
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}{_STAGING_TAG}{os.getpid()}-", dir=parent))
    try:
        follow_umask(staging)  # mkdtemp makes it 0700; the folder it becomes is made as mkdir would
        _write_file(staging / INCOMPLETE_MARKER, b"export in progress\n")
        for name, data in files.items():
            _write_file(staging / name, data)
        if out.is_dir():
            keep_other_files(out, staging, {*files, INCOMPLETE_MARKER})
        _fsync_dir(staging)
        # A failed overwrite changes nothing: the previous adapter is put back.
        replace_folder(staging, out, parent / f".{out.name}{_OLD_TAG}{os.getpid()}-{os.urandom(4).hex()}")
        _fsync_dir(parent)
        (out / INCOMPLETE_MARKER).unlink()
        _fsync_dir(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out
