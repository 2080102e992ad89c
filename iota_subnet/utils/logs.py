"""Console logging for the command-line entry points (loguru)."""
from __future__ import annotations

import sys

from loguru import logger


def _stderr(message: str) -> None:
    sys.stderr.write(message)


def log_to_stderr(level: str = "INFO", fmt: str = "<green>{time:HH:mm:ss}</green> <level>{level: <7}</level> {message}") -> int:
    """Replace loguru's handlers with one writing to the process's *current* ``sys.stderr`` (looked
    up at each record, not when the handler is added: an entry point run inside a process that swaps
    ``sys.stderr``, e.g. pytest's capture, keeps logging after the stream it started with is closed).
    Returns the handler id."""
    logger.remove()
    return logger.add(_stderr, level=level, format=fmt, colorize=sys.stderr.isatty())
