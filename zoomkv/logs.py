"""What the command line says about its work: ``logging`` under the ``zoomkv`` logger, on stderr.

stdout carries what a command produces (the eval's summary, a table, JSON, generated text, a list); every
line about the work (loading, stages, where a file went, notes and warnings) is a log record on stderr,
written through ``tqdm.write`` so it never lands on a progress bar's line. Levels: INFO by default,
``--quiet`` warnings only (and no progress bars), ``-v`` adds DEBUG. A program that uses zoomkv as a
library configures ``logging`` its own way; nothing is shown until it does (or calls ``show_on_console``).
"""

from __future__ import annotations

import logging
import sys

from tqdm.auto import tqdm

LOGGER_NAME = "zoomkv"


class TqdmHandler(logging.Handler):
    """Each record as one line above the progress bars, on the ``sys.stderr`` of the moment (so a test's
    captured stream sees it)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # logging's contract: a failing handler reports, never raises
            self.handleError(record)


class PlainFormatter(logging.Formatter):
    """The message alone; a warning or an error says so first."""

    def format(self, record: logging.LogRecord) -> str:
        message = super().format(record)
        return message if record.levelno < logging.WARNING else f"{record.levelname.lower()}: {message}"


def verbosity(quiet: bool = False, verbose: bool = False) -> int:
    """-1 warnings only, 0 INFO, 1 DEBUG (``-v`` wins over ``--quiet`` when both are given)."""
    return 1 if verbose else -1 if quiet else 0


def show_on_console(level: int = 0) -> logging.Logger:
    """Show zoomkv's log on stderr at ``level`` (``verbosity``). Called again it only changes the level."""
    logger = logging.getLogger(LOGGER_NAME)
    if not any(isinstance(h, TqdmHandler) for h in logger.handlers):
        handler = TqdmHandler()
        handler.setFormatter(PlainFormatter("%(message)s"))
        logger.addHandler(handler)
        logger.propagate = False  # this logger's console handler: no second copy through the root logger
    logger.setLevel({-1: logging.WARNING, 0: logging.INFO}.get(level, logging.DEBUG))
    return logger


def progress_shown() -> bool:
    """Progress bars are INFO: hidden under ``--quiet``."""
    return logging.getLogger(LOGGER_NAME).isEnabledFor(logging.INFO)


def human_bytes(n: float) -> str:
    """``n`` bytes as a log line says them: ``512 bytes``, ``3.2 GB`` (powers of 1024)."""
    units = ("bytes", "KB", "MB", "GB", "TB", "PB")
    i = 0
    while n >= 1024 and i < len(units) - 1:
        n, i = n / 1024, i + 1
    return f"{n:.0f} bytes" if i == 0 else f"{n:.1f} {units[i]}"
