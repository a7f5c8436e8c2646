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
