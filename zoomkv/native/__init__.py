"""Compiled CPU kernels: a C++ source built once per machine, called through ``ctypes``.

Each kernel is plain C (no torch headers, so it builds in seconds) compiled on first use with the C++
compiler ``torch.utils.cpp_extension`` finds, cached under ``TORCH_EXTENSIONS_DIR`` (by default
``~/.cache/torch_extensions``) by a name that hashes its source, the shared headers here, the flags and the
CPU. Nothing executes from a file. Without a compiler, or with ``ZOOMKV_NATIVE=0``, every caller takes its
torch path (the reference, same results) and the kernel says so once.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

HEADERS = Path(__file__).parent  # half.h: fp16 conversions as torch rounds them
BUILD_LOCK = "zoomkv.flock"  # in a build's folder: held while zoomkv loads or builds it
TORCH_BATON = "lock"  # torch.utils.cpp_extension's own guard in that folder
_disabled = threading.local()


def enabled() -> bool:
    return os.environ.get("ZOOMKV_NATIVE", "1") != "0" and not getattr(_disabled, "on", False)


@contextlib.contextmanager
def torch_path() -> Iterator[None]:
    """Within this block (this thread), every kernel's caller takes its torch path: tests compare the two."""
    before = getattr(_disabled, "on", False)
    _disabled.on = True
    try:
        yield
    finally:
        _disabled.on = before


def cpu_info(field: str) -> str:
    """One field of Linux's ``/proc/cpuinfo`` for the first processor (``"model name"``, ``"flags"``), or "" where
    there is no such file or field: the build's name hashes the flags, ``zoomkv bench`` prints the model name."""
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == field:
                    return value.strip()
    return ""


def openmp() -> list[str]:
    """``-fopenmp`` where torch runs on libgomp (Linux wheels): a library built with it names ``libgomp.so.1``,
    which the loader resolves to the copy torch already loaded, so a kernel's loops share torch's own threads
    (no second pool spinning against it). Elsewhere the pragmas are ignored and a kernel runs on the calling
    thread."""
    if platform.system() != "Linux" or "OpenMP" not in torch.__config__.parallel_info():
        return []
    return ["-fopenmp"]


def flags(fast_math: bool = True) -> list[str]:
    # -ffast-math for vectorised exp and sums, but infinities kept (padding and forced rows are -inf / +inf); a
    # kernel whose results must equal torch's bit for bit (memory/quant.cpp) keeps IEEE arithmetic instead.
    math = ["-ffast-math", "-fno-finite-math-only"] if fast_math else ["-ffp-contract=off"]
    base = ["-O3", "-std=c++17", *math]
    return base + (["-march=native"] if platform.machine() in ("x86_64", "AMD64") else []) + openmp()


class Kernel:
    """One C++ source: ``library()`` builds it on first use (or returns None, with one warning, when it cannot)
    and declares ``signatures`` (name → (argtypes, restype)). ``fast_math=False``: IEEE arithmetic, for results
    that must equal torch's."""

    def __init__(self, source: Path, what: str, signatures: dict[str, tuple[list, type]], *, fast_math: bool = True):
        self.source, self.what, self.signatures, self.fast_math = source, what, signatures, fast_math
        self._lock = threading.Lock()
        self._lib: ctypes.CDLL | None = None
        self._failed: str | None = None

    def name(self) -> str:
        """The build's name: the source, the headers, the flags and the machine it is compiled for."""
        h = hashlib.sha256(self.source.read_bytes())
        for header in sorted(HEADERS.glob("*.h")):
            h.update(header.read_bytes())
        h.update(" ".join(flags(self.fast_math)).encode())
        h.update(platform.machine().encode())
        h.update(cpu_info("flags").encode())
        return f"zoomkv_{self.source.stem}_{h.hexdigest()[:12]}"

    def _build(self) -> ctypes.CDLL:
        from filelock import FileLock
        from torch.utils import cpp_extension

        name = self.name()
        folder = Path(cpp_extension._get_build_directory(name, verbose=False))
        # torch guards a build with a bare file (its "baton") that a killed process leaves behind, and every later
        # load then waits on it forever, silently. Each zoomkv build of this name first holds a flock the kernel
        # lets go of however the holder ends, so while it is held here no live build owns the baton: one found is
        # stale, and goes.
        with FileLock(str(folder / BUILD_LOCK)):
            with contextlib.suppress(FileNotFoundError):
                (folder / TORCH_BATON).unlink()
            path = cpp_extension.load(name=name, sources=[str(self.source)], extra_cflags=flags(self.fast_math),
                                      extra_ldflags=openmp(), extra_include_paths=[str(HEADERS)],
                                      build_directory=str(folder), is_python_module=False, verbose=False)
        lib = ctypes.CDLL(str(path))
        for fn, (args, res) in self.signatures.items():
            getattr(lib, fn).argtypes, getattr(lib, fn).restype = args, res
        return lib

    def library(self) -> ctypes.CDLL | None:
        if self._lib is not None or self._failed is not None:
            return self._lib
        with self._lock:
            if self._lib is None and self._failed is None:
                try:
                    self._lib = self._build()
                except Exception as e:  # no compiler, no ninja, a read-only cache: the torch path does the same work
                    msg = str(e).strip()
                    self._failed = f"{type(e).__name__}: {msg.splitlines()[-1] if msg else ''}"
                    warnings.warn(f"zoomkv: {self.what} could not be built ({self._failed}); the plain torch path "
                                  "runs instead, same results, slower (set ZOOMKV_NATIVE=0 to skip the build)",
                                  RuntimeWarning, stacklevel=3)
        return self._lib

    def usable(self, *tensors: torch.Tensor) -> bool:
        """Whether a call can take the kernel: enabled, CPU tensors, and the library built."""
        if not enabled() or not all(t.is_cpu for t in tensors):
            return False
        return self.library() is not None
