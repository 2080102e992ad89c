"""``metrics.jsonl`` (one JSON object per optimizer step) and ``summary.json`` writers.

Both the co-located trainer and the local network write the same fields per step:
``step`` (0-based), ``tokens`` (cumulative trained tokens), ``loss`` (nats/token), ``lr``,
``elapsed_s`` (seconds since the run started, across resumes).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

from iota_subnet.utils.atomic import atomic_write_json, atomic_write_text


class MetricsLog:
    """Append-only JSONL log that survives restarts: on resume, lines at or past ``resume_step``
    are dropped (they belong to steps that will be redone)."""

    def __init__(self, path: str | Path, resume_step: Optional[int] = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rows: list[dict] = []
        if self.path.exists() and resume_step is not None:
            for line in self.path.read_text().splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    break      # a torn last line from a kill: drop it and what follows
                if row.get("step", 0) < resume_step:
                    self.rows.append(row)
            atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in self.rows))
        else:
            atomic_write_text(self.path, "")
        self._f = open(self.path, "a", encoding="utf-8")

    def write(self, row: dict) -> None:
        self.rows.append(row)
        self._f.write(json.dumps(row) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()

    @property
    def last_elapsed_s(self) -> float:
        return float(self.rows[-1]["elapsed_s"]) if self.rows else 0.0

    def final_loss(self, window: int = 10) -> Optional[float]:
        """Mean loss of the last ``window`` steps (smooths the micro-batch noise of one step)."""
        losses = [r["loss"] for r in self.rows[-window:] if r.get("loss") is not None]
        return sum(losses) / len(losses) if losses else None


def write_summary(path: str | Path, summary: dict) -> None:
    atomic_write_json(path, summary)
