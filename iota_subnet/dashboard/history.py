"""Bounded time series for the dashboard's plots, and an incremental reader of ``metrics.jsonl``."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Optional


class Series:
    """Points ``(x, y)`` in arrival order, at most ``max_points``: when full, every second point is
    dropped and only every ``stride``-th new point is kept from then on, so a days-long run keeps its
    whole shape at a bounded size (memory O(max_points)). The latest point is always shown."""

    def __init__(self, max_points: int = 1000):
        if max_points < 4:
            raise ValueError("max_points must be >= 4")
        self.max_points = int(max_points)
        self.points: list[tuple[float, float]] = []
        self.stride = 1
        self._seen = 0
        self._latest: Optional[tuple[float, float]] = None

    def add(self, x: float, y: Optional[float]) -> None:
        if y is None or y != y:        # None or NaN: nothing to plot
            return
        self._seen += 1
        self._latest = (float(x), float(y))
        if (self._seen - 1) % self.stride:
            return
        self.points.append((float(x), float(y)))
        if len(self.points) >= self.max_points:
            self.points = self.points[::2]
            self.stride *= 2

    def _shown(self) -> list[tuple[float, float]]:
        if self._latest is not None and (not self.points or self.points[-1] != self._latest):
            return self.points + [self._latest]
        return self.points

    def last(self) -> Optional[tuple[float, float]]:
        return self._latest

    def to_json(self) -> list[list[float]]:
        return [[x, y] for x, y in self._shown()]

    def __len__(self) -> int:
        return len(self._shown())


class JsonlTail:
    """Rows appended to a JSONL file since the last :meth:`read` (a file rewritten shorter, as on a
    resume, is read again from the start; a torn last line waits for its end)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.offset = 0
        self.reset = False      # True after a read that restarted from the top (the rows replace, not extend)

    def read(self) -> list[dict]:
        self.reset = False
        try:
            size = self.path.stat().st_size
        except OSError:
            return []
        if size < self.offset:
            self.offset, self.reset = 0, True
        if size == self.offset:
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read(size - self.offset)
        end = data.rfind(b"\n")
        if end < 0:
            return []
        self.offset += end + 1
        rows = []
        for line in data[:end].splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict):
                rows.append(row)
        return rows


def per_lane_loss(rows: Iterable[dict], series: dict[str, Series], max_points: int) -> None:
    """Add each ``metrics.jsonl`` row's ``(tokens, loss)`` to its lane's series (``lane`` 0 when absent).
    ``tokens`` is the row's cumulative trained tokens of this validator (``tokens``)."""
    for r in rows:
        lane = str(r.get("lane", 0))
        s = series.setdefault(lane, Series(max_points))
        s.add(float(r.get("tokens", 0)), r.get("loss"))
