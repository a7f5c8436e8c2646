"""One writer per output folder: a training run's folder, an evaluation's ``--out``, an export's target.

Two commands writing one folder at once both "succeed" and leave one's files over the other's (two trainings
of one ``run_name``: the first run's checkpoints and adapter are gone; two evals of one ``--out``: every row
twice). The first to start holds the folder's lock (``filelock``: ``flock(2)`` on a small file, let go by the
kernel however the holder ends, SIGKILL included); the second is refused with one line naming the folder and
the holder (command, pid, host, since when). The lock file lives in the folder itself (``.zoomkv-lock``) or,
for a folder that is replaced whole by a rename (an export), beside it (``.NAME.zoomkv-lock``), as the export's
other working files do; it is removed when the command ends, and so are the folders the lock itself made if
the command left them empty. A lock file a killed command left behind is taken over, not refused.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from zoomkv.errors import ZoomKVError

log = logging.getLogger(__name__)

LOCK_NAME = ".zoomkv-lock"  # a lock inside the folder it guards
LOCK_SUFFIX = ".zoomkv-lock"  # a lock beside the folder it guards: .NAME.zoomkv-lock
_HOLDER_PREFIX = "zoomkv "  # every holder record starts so: a file that does not is not ours to take
_MAX_RECORD = 4096


class FolderBusyError(ZoomKVError):
    """Another zoomkv command is writing the folder (or something not ours sits where the lock goes)."""


class WriterLock:
    """The lock of one folder for one command: ``acquire`` (refused at once, never waits) and ``release``."""

    def __init__(self, lock_file: Path, folder: Path, command: str, what: str = ""):
        self.lock_file, self.folder, self.command = lock_file, folder, command
        self.what = what or "folder"  # how the refusal names the folder: "run folder", "--out", ...
        self._lock: Any = None
        self._held: os.stat_result | None = None  # the lock file's inode while held
        self._made: list[Path] = []  # folders made to hold the lock file, outermost last

    # -- taking it -------------------------------------------------------------------------------------
    def acquire(self) -> None:
        from filelock import FileLock, Timeout

        self._make_parent()
        self._check_in_the_way()
        lock = FileLock(str(self.lock_file), on_acquired=self._record_holder)
        try:
            lock.acquire(blocking=False)
        except Timeout:
            self._remove_made()
            raise FolderBusyError(f"{self.what} {self.folder} is being written by {self.holder()}; wait for it to "
                                  "end, or write to another folder") from None
        except OSError as err:  # a filesystem without flock (some network mounts): run, saying what is unguarded
            log.warning("cannot lock %s (%s): a second command writing it at the same time would not be refused",
                        self.folder, err.strerror or err)
            return
        self._lock = lock

    def _make_parent(self) -> None:
        """The lock file's folder, made if missing (recorded, so that a refused command leaves none behind)."""
        parent = self.lock_file.parent
        if (parent.exists() or parent.is_symlink()) and not parent.is_dir():
            raise FolderBusyError(f"{self.what} {parent} is a file, not a folder")
        missing = []
        while not parent.exists():
            missing.append(parent)
            parent = parent.parent
        for folder in reversed(missing):
            folder.mkdir()
            self._made.insert(0, folder)

    def _check_in_the_way(self) -> None:
        """A file of that name that is not a lock record of ours (a link, a folder, the user's notes) is never
        written over: refused, naming it."""
        path = self.lock_file
        if not (path.exists() or path.is_symlink()):
            return
        plain = path.is_file() and not path.is_symlink() and path.stat().st_size <= _MAX_RECORD
        record = self._read_record() if plain else None
        if record is None or not (record == "" or record.startswith(_HOLDER_PREFIX)):  # "": a holder writing it
            self._remove_made()
            raise FolderBusyError(f"{path} is in the way of the writer's lock of {self.folder} and is not one of "
                                  "zoomkv's; move it, or write to another folder")

    def _read_record(self) -> str:
        try:
            with open(self.lock_file, "rb") as f:
                return f.read(_MAX_RECORD).decode("utf-8", "replace").strip()
        except OSError:
            return ""

    def _record_holder(self, fd: int) -> None:
        """``filelock``'s ``on_acquired``: write who holds the lock into the lock file (read by the refused)."""
        since = time.strftime("%Y-%m-%d %H:%M:%S")
        record = f"{_HOLDER_PREFIX}{self.command} (pid {os.getpid()} on {socket.gethostname()}, since {since})\n"
        os.ftruncate(fd, 0)
        os.pwrite(fd, record.encode("utf-8"), 0)
        self._held = os.fstat(fd)

    def holder(self) -> str:
        """Who holds the lock, as its holder recorded it."""
        record = self._read_record()
        return record if record.startswith(_HOLDER_PREFIX) else "another process"

    # -- letting it go ---------------------------------------------------------------------------------
    def release(self) -> None:
        """Remove the lock file while still holding it (a process that opened it meanwhile finds it unlinked
        and tries again, so no two ever hold two files), let it go, then remove the folders it made if empty."""
        if self._lock is not None:
            try:
                if self._held is not None and os.path.samestat(os.lstat(self.lock_file), self._held):
                    self.lock_file.unlink()
            except OSError:
                pass
            self._lock.release()
            self._lock, self._held = None, None
        self._remove_made()

    def _remove_made(self) -> None:
        for folder in self._made:  # innermost first; a folder the command wrote into stays
            try:
                folder.rmdir()
            except OSError:
                break
        self._made = []

    def __enter__(self) -> WriterLock:
        self.acquire()
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()


def lock_inside(folder: str | Path, command: str, what: str = "") -> WriterLock:
    """The lock of ``folder``, kept in it (``FOLDER/.zoomkv-lock``): a run folder, an evaluation's ``--out``."""
    folder = Path(folder)
    return WriterLock(folder / LOCK_NAME, folder, command, what)


def lock_beside(target: str | Path, command: str, what: str = "") -> WriterLock:
    """The lock of ``target``, kept beside it (``.NAME.zoomkv-lock``): a folder replaced whole by a rename."""
    target = Path(target)
    return WriterLock(target.parent / f".{target.name}{LOCK_SUFFIX}", target, command, what)


def acquire_on_main(lock: WriterLock, main: bool) -> None:
    """Take ``lock`` in the main process of a launch (``accelerate launch``, ``torchrun``: one writer, however
    many processes it has); every process learns whether it was refused, so a refused launch ends whole
    instead of leaving its other processes waiting for a peer that left."""
    error = None
    if main:
        try:
            lock.acquire()
        except FolderBusyError as err:
            error = str(err)
    error = _from_main(error)
    if error is not None:
        raise FolderBusyError(error)


def _from_main(value: str | None) -> str | None:
    """``value`` as the main process has it, in every process of the launch's process group (if any)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
