"""Writing an adapter folder so that a crash never leaves a half adapter behind, nor loses a user's file.

Everything is written into a staging folder inside a marked working folder next to the target
(``zoomkv.atomic.owned_folder``), fsynced, then renamed onto the target (``replace_folder``). Replacing a folder
replaces only the files being written: any other file in it (the user's) is hard-linked (or copied) into the
staging folder first, so it is there after the rename and nothing but the old copies of our own files is
deleted. Only a folder zoomkv wrote (an adapter, a training checkpoint, an interrupted export) is ever replaced,
and only with ``overwrite``; a folder of anything else is refused, empty folders aside. The staging folder
carries an ``.zoomkv-incomplete`` marker from its first byte until after the rename, and the loader refuses any
folder with that marker: a kill at any point (mid-write, between the renames, before the marker's removal)
leaves nothing that loads, and nothing of the user's only in a folder a later run deletes. The next export of
the same name puts back a folder a kill left aside, sweeps the marked working folders of dead processes, and
replaces a marked target without needing ``overwrite``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

from zoomkv.adapters.errors import AdapterExistsError
from zoomkv.atomic import STAGING_TAG, owned_folder, read_json_object, replace_folder, settle_leftovers

INCOMPLETE_MARKER = ".zoomkv-incomplete"
# what identifies a folder zoomkv wrote: an adapter's config, a training checkpoint's meta (names as in
# config.py / checkpoint.py, which import this module)
_CONFIG_NAME, _META_NAME = "adapter_config.json", "adapter_meta.json"


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


def sweep_stale(parent: Path, name: str, ours: set[str] | frozenset[str] = frozenset()) -> None:
    """Put back or remove what exports of ``name`` killed midway left (marked working folders only)."""
    settle_leftovers(parent, name, {*ours, INCOMPLETE_MARKER})


def is_incomplete(folder: Path) -> bool:
    return (folder / INCOMPLETE_MARKER).exists()


def is_adapter_folder(folder: Path) -> bool:
    """A folder zoomkv wrote: an adapter (its ``adapter_config.json`` is zoomkv's), a training checkpoint (its
    ``adapter_meta.json``), or an export that was interrupted (the incomplete marker)."""
    if is_incomplete(folder):
        return True
    config = read_json_object(folder / _CONFIG_NAME)
    if config is not None and (config.get("library_name") == "zoomkv" or {"format_version", "method"} <= set(config)):
        return True
    meta = read_json_object(folder / _META_NAME)
    return meta is not None and {"method", "state_sha256"} <= set(meta)


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


def check_target(out: Path, *, overwrite: bool) -> None:
    """Refuse a target that is not ours to replace: a file, a folder zoomkv did not write (unless empty), or
    an adapter without ``overwrite`` (an interrupted export is replaced without it)."""
    if (out.exists() or out.is_symlink()) and not out.is_dir():
        raise AdapterExistsError(f"{out} exists and is not a folder (it is never replaced)")
    if out.is_symlink():
        raise AdapterExistsError(f"{out} is a symbolic link (it is never replaced); give the folder it points to")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not is_adapter_folder(out):
        raise AdapterExistsError(f"{out} is a folder of other files, not an adapter (no zoomkv "
                                 f"{_CONFIG_NAME}): --overwrite replaces an adapter, never another folder; "
                                 "choose another --out")
    if not overwrite and not is_incomplete(out):
        raise AdapterExistsError(f"{out} already exists (pass --overwrite to replace it)")


def write_folder_atomically(out: str | Path, files: Mapping[str, bytes], *, overwrite: bool = False) -> Path:
    """Write ``files`` (name → bytes, in order) as the folder ``out``, all or nothing. Over an existing
    adapter folder (``overwrite``) only those files are replaced; other files in it are kept."""
    out = Path(out)
    parent = out.parent
    parent.mkdir(parents=True, exist_ok=True)
    sweep_stale(parent, out.name, set(files))
    check_target(out, overwrite=overwrite)
    work = owned_folder(parent, out.name, STAGING_TAG)
    try:
        staging = work / out.name
        staging.mkdir()  # as mkdir makes any folder: the umask's mode
        _write_file(staging / INCOMPLETE_MARKER, b"export in progress\n")
        for name, data in files.items():
            _write_file(staging / name, data)
        if out.is_dir():
            keep_other_files(out, staging, {*files, INCOMPLETE_MARKER})
        _fsync_dir(staging)
        # A failed overwrite changes nothing: the previous adapter is put back.
        replace_folder(staging, out)
        _fsync_dir(parent)
        (out / INCOMPLETE_MARKER).unlink()
        _fsync_dir(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out
