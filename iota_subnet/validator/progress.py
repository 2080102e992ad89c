"""The validator's lane progress: steps done and next per lane, tokens, losses, ``metrics.jsonl``,
the evaluation's outcome, and whether the lanes stalled between two scores updates."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Optional

from iota_subnet.utils.atomic import atomic_write_text

from .lanes import LaneStepResult
from .pacing import StallWatch
from .state import ValidatorState


class MetricsWriter:
    """``metrics.jsonl``: one row per completed lane step; on resume keeps only committed steps."""

    def __init__(self, path: Path, next_steps: dict[int, int]):
        self.path = path
        rows: list[str] = []
        if path.exists() and next_steps:
            for line in path.read_text().splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    break
                if row.get("step", 0) < next_steps.get(row.get("lane"), 0):
                    rows.append(json.dumps(row))
        atomic_write_text(path, "".join(r + "\n" for r in rows))
        self._f = open(path, "a", encoding="utf-8")

    def write(self, row: dict) -> None:
        self._f.write(json.dumps(row) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()


class LaneProgress:
    """Per-lane progress of the lanes this validator drives (lane -> value dicts), read from and
    committed to the state with each lane step; ``metrics_path``: where ``metrics.jsonl`` goes."""

    def __init__(self, metrics_path: Path):
        self.metrics_path = metrics_path
        self.metrics: Optional[MetricsWriter] = None
        self.next_steps: dict[int, int] = {}
        self.steps_done: dict[int, int] = {}
        self.lane_loss: dict[int, Optional[float]] = {}
        self.lane_tokens: dict[int, int] = {}
        self.tokens_at_start = 0
        self.started = time.time()
        self.elapsed_offset = 0.0
        self.val_loss: Optional[float] = None
        self.done_block: Optional[int] = None
        self.train_s: Optional[float] = None
        self.done = False
        #: whether every lane stalled between two scores updates (a merge's pause excepted; set at start)
        self.stall: Optional[StallWatch] = None

    def resume(self, state: ValidatorState, n_lanes: int) -> None:
        """Progress of ``n_lanes`` lanes as the state holds it; ``metrics.jsonl`` keeps its committed rows."""
        progress = state.lane_progress()
        self.next_steps = {l: progress.get(l, {}).get("next_step", 0) for l in range(n_lanes)}
        self.steps_done = {l: progress.get(l, {}).get("steps_done", 0) for l in range(n_lanes)}
        self.lane_tokens = {l: progress.get(l, {}).get("tokens", 0) for l in range(n_lanes)}
        self.lane_loss = {l: progress.get(l, {}).get("last_loss") for l in range(n_lanes)}
        self.tokens_at_start = sum(self.lane_tokens.values())
        self.metrics = MetricsWriter(self.metrics_path, self.next_steps)
        self.elapsed_offset = float(state.get_meta("elapsed_s", "0") or 0)

    def record(self, res: LaneStepResult, next_step: int, **row: Any) -> None:
        """A lane step committed to the state; its metrics row gets ``row`` (lr, validators) too."""
        self.next_steps[res.lane] = next_step
        self.steps_done[res.lane] = self.steps_done.get(res.lane, 0) + 1
        self.lane_loss[res.lane] = res.loss
        self.lane_tokens[res.lane] = self.lane_tokens.get(res.lane, 0) + res.tokens
        if res.loss is None:
            return     # a step trained while this validator was away: no loss or tokens of its own to record
        self.metrics.write({"step": res.step, "lane": res.lane, "tokens": sum(self.lane_tokens.values()),
                            "lane_tokens": self.lane_tokens[res.lane], "loss": res.loss, "lr": row["lr"],
                            "validators": row["validators"],
                            "elapsed_s": round(self.elapsed_s(), 3), "reroutes": res.reroutes,
                            "failures": res.failures, "microbatches_ok": res.ok_count})

    def elapsed_s(self) -> float:
        return self.elapsed_offset + time.time() - self.started

    def lanes_stalled(self, steps: Optional[int], driving: bool) -> bool:
        """This validator drives lanes that are not finished (``driving``: it has a control plane), and
        none completed a step since the last update (a merge's pause excepted: :class:`~.pacing.StallWatch`)."""
        driving = driving and any(steps is None or n < steps for n in self.next_steps.values())
        if self.stall is None:
            return False
        return self.stall.update(sum(self.steps_done.values()), list(self.next_steps.values()), steps, driving)

    @property
    def paused(self) -> bool:
        """A merge pauses the lanes (:attr:`.pacing.StallWatch.paused`)."""
        return self.stall is not None and self.stall.paused

    def unrouted(self, router: Any, steps: Optional[int], stages: int) -> set:
        """Miners of lanes this validator has finished driving (no work for them by its own choice);
        none in an open-ended run (``steps`` None)."""
        if router is None or steps is None:
            return set()
        out = set()
        for lane, nxt in self.next_steps.items():
            if nxt >= steps:
                for stage in range(stages):
                    r = router.lane_member(lane, stage)
                    if r is not None:
                        out.add(r.key)
        return out

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
