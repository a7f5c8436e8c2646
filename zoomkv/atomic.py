"""Folders written all or nothing: finished in a staging folder next to the target, then put in place
with renames only. The model cache (``models/gguf.py``) and adapter folders (``adapters/files.py``) both
install through ``replace_folder``."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def replace_folder(staged: Path, target: Path, aside: Path) -> None:
    """Put the finished folder ``staged`` at ``target`` so a reader sees the old folder, nothing, or the new
    one, never a partial one. An existing ``target`` is first renamed to ``aside`` (rename(2) cannot replace
    a non-empty folder) and deleted once the new one is in place; if the new one cannot be put in place,
    the old one is put back."""
    moved = False
    if target.exists():
        os.replace(target, aside)
        moved = True
    try:
        os.replace(staged, target)
    except BaseException:
        if moved and not target.exists():
            os.replace(aside, target)
        raise
    if moved:
        shutil.rmtree(aside, ignore_errors=True)


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
