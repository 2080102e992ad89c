"""A neuron's state folder belongs to one run; a new run sets the old run's state aside.

``<out>/run.json`` names the run (id and epoch) whose state the folder holds. When a neuron starts
for another run, :func:`hand_over` moves the old run's files to ``<out>/previous/<run>-e<epoch>-<time>/``
(nothing is deleted) and records the new run, so the new run starts clean (no checkpoint or
accounting of another run is loaded) and the old one can still be inspected or restored.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Iterable, Optional

from loguru import logger

from .atomic import atomic_write_json

RUN_FILE = "run.json"


def _safe(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)[:80] or "run"


def hand_over(out: str | Path, run_id: str, run_epoch: int, patterns: Iterable[str]) -> Optional[Path]:
    """Record that ``out`` now holds run (``run_id``, ``run_epoch``). If it held another run, move the
    files matching ``patterns`` (globs relative to ``out``) aside first; returns their new folder.
    A folder without ``run.json`` (older versions) is adopted by the current run."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    marker = out / RUN_FILE
    want = {"run_id": str(run_id), "run_epoch": int(run_epoch)}
    old = None
    if marker.exists():
        try:
            old = json.loads(marker.read_text())
        except (OSError, ValueError):
            old = None
    moved_to = None
    if isinstance(old, dict) and {k: old.get(k) for k in want} != want:
        moved_to = out / "previous" / f"{_safe(str(old.get('run_id')))}-e{old.get('run_epoch')}-{int(time.time())}"
        files = sorted({p for pat in patterns for p in out.glob(pat) if p.is_file()})
        if files:
            moved_to.mkdir(parents=True, exist_ok=True)
            for p in files:
                p.replace(moved_to / p.name)
            logger.info(f"{out} held run {old.get('run_id')!r} epoch {old.get('run_epoch')}; its state "
                        f"({len(files)} files) moved to {moved_to} for run {run_id!r} epoch {run_epoch}")
        else:
            moved_to = None
    if old != want:
        atomic_write_json(marker, want)
    return moved_to
