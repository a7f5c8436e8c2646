"""GPU kernels in Triton, each beside the torch code it replaces (the reference its tests hold it to).

A decode step on a GPU must never wait for the host (DESIGN.md, "Cheaper than what it replaces"): the recall
reads pinned host memory from a device kernel (``gather_rows``), and sekv's key codes are scored where they
sit (``score_codes``), and a recall buffer's plan of which rows it keeps and which it reads is made there
(``plan_swaps``). A kernel is used where ``usable`` says so: Triton is installed, ``ZOOMKV_TRITON`` is not
``0``, and the tensors are on a CUDA device, or anywhere under ``TRITON_INTERPRET=1`` (how the CPU tests run
them). Everywhere else the caller takes its torch path, which computes the same function.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable
from typing import Any

import torch


@functools.cache
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Triton's interpreter runs kernels on CPU tensors with numpy (``TRITON_INTERPRET=1``): CPU tests."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def enabled() -> bool:
    return os.environ.get("ZOOMKV_TRITON", "1") != "0" and triton_installed()


def usable(*tensors: torch.Tensor) -> bool:
    """Whether a kernel runs on these tensors: every one on CUDA or in pinned host memory, one of them on CUDA
    (or, under the interpreter, on the CPU)."""
    if not enabled():
        return False
    if interpreting():
        return all(t.device.type == "cpu" for t in tensors)
    return any(t.is_cuda for t in tensors) and all(t.is_cuda or t.is_pinned() for t in tensors)


class _Launches:
    """Kernels launched so far in this process, and how many are running now (the ops a kernel runs under the
    interpreter are its own, not the caller's: ``zoomkv.memory.sync_audit`` leaves them out)."""

    count = 0
    running = 0


def launch(make: Callable[[bool], Any], grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """Launch the kernel ``make(interpreting())`` builds on ``grid``, counted (``launches``): on a GPU one launch
    each, what a decode step bound by its launches is made of."""
    _Launches.count += 1
    _Launches.running += 1
    try:
        make(interpreting())[grid](*args, **kwargs)
    finally:
        _Launches.running -= 1


def launches() -> int:
    """Kernels launched so far in this process."""
    return _Launches.count


def launch_running() -> bool:
    """Whether a kernel is running now (under the interpreter, on the CPU: its ops are its own)."""
    return _Launches.running > 0
