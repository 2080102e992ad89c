"""Lane pacing: the validator keeps its lanes within one merge window of each other.

Replica ``r`` of every stage trains in lane ``r``, and the replicas of a stage merge when their inner
step crosses a multiple of ``merge.every_steps`` (H). Lanes that drift apart reach a boundary at
different times: the first waits ``merge.join_timeout_s`` for its peers, then merges alone, and the
stage's replicas train different models until the next boundary they meet at. Under churn,
unpaced lanes drift 30-40 steps apart and most merges run alone (88 of 145 in a ``tiny`` 3 x 3
chaos run: ``docs/BENCHMARKS.md``, "Churn").

:class:`LanePacer` holds back the lane step that closes a merge window (the step after which the
lane's replicas merge) until every other live lane has reached that step too: the replicas of a
stage then reach the boundary within about one lane step of each other, far inside the join
timeout. Steps inside a window are not held, so lanes drift at most one window apart. The slowest
live lane is never held, so pacing cannot deadlock; a lane that made no progress for ``stall_s``
seconds (its head is dead, the validator is re-routing) stops holding the others back until it
moves again, and no lane is held longer than ``max_hold_s`` at one step (a lane slowed by a slow or
failing miner then costs the others at most that per window, as the merge join's timeout does
without pacing). Tickets are what pace a lane: a head trains every ticket it holds, so the validator
neither issues nor follows a held step.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Callable, Optional

from loguru import logger


class LanePacer:
    """Per-lane next steps of one validator and the steps they hold back.

    ``every``: merge window in lane steps (``merge.every_steps``; 0: no pacing); lane step ``k``
    closes a window when ``(k + 1) % every == 0``. ``stall_s``: seconds without progress after which a
    lane no longer holds the others back; ``max_hold_s``: the longest a lane is held at one step.
    """

    def __init__(self, every: int, stall_s: float, max_hold_s: float = 60.0, clock: Callable[[], float] = time.monotonic):
        if every < 0 or stall_s <= 0 or max_hold_s <= 0:
            raise ValueError(f"lane pacing needs every >= 0, stall_s > 0 and max_hold_s > 0, got {every!r}, "
                             f"{stall_s!r}, {max_hold_s!r}")
        self.every, self.stall_s, self.max_hold_s, self.clock = int(every), float(stall_s), float(max_hold_s), clock
        self._released: set[tuple[int, int]] = set()    # (lane, step) held for max_hold_s: it goes
        self._next: dict[int, int] = {}          # lane -> the next lane step it will drive
        self._moved: dict[int, float] = {}       # lane -> when it last progressed (or was held)
        self._changed = asyncio.Event()
        #: seconds each lane spent held back, for status output
        self.held_s: dict[int, float] = {}

    def at(self, lane: int, next_step: int) -> None:
        """``lane`` will drive ``next_step`` next (it started there, or settled the step before)."""
        self._next[lane] = int(next_step)
        self._moved[lane] = self.clock()
        self._changed.set()

    def finish(self, lane: int) -> None:
        """``lane`` has no steps left to drive: it no longer holds the others back."""
        self._next.pop(lane, None)
        self._moved.pop(lane, None)
        self._changed.set()

    def slowest(self, lane: int) -> Optional[tuple[int, int]]:
        """(lane, next step) of the slowest live lane other than ``lane``, or None."""
        now = self.clock()
        live = [(k, l) for l, k in self._next.items() if l != lane and now - self._moved[l] < self.stall_s]
        if not live:
            return None
        k, l = min(live)
        return l, k

    def allows(self, lane: int, step: int) -> bool:
        """May ``lane`` start (be issued tickets for) lane step ``step`` now?"""
        if self.every <= 0 or (step + 1) % self.every or (lane, step) in self._released:
            return True
        slow = self.slowest(lane)
        return slow is None or slow[1] >= step

    async def wait(self, lane: int, step: int, stop: Optional[asyncio.Event] = None) -> float:
        """Until ``lane`` may start ``step`` (or ``stop`` is set). Returns the seconds waited."""
        t0 = self.clock()
        logged = False
        while not self.allows(lane, step) and not (stop is not None and stop.is_set()):
            if not logged:
                slow = self.slowest(lane)
                logger.info("lane {} holds step {} (it closes a merge window) until lane {} gets there (at step {}): "
                            "the replicas of each stage then reach the merge together", lane, step,
                            *(slow if slow else ("-", "-")))
                logged = True
            self._moved[lane] = self.clock()     # held, not stalled: it still holds back the lanes behind it
            if self.clock() - t0 >= self.max_hold_s:
                logger.warning("lane {} goes on to step {} after {:.0f} s held: the slowest lane is too slow to wait for "
                               "(its replicas will merge without it)", lane, step, self.clock() - t0)
                self._released.add((lane, step))
                if len(self._released) > 1024:
                    self._released.discard(min(self._released))
                break
            self._changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):      # re-check at least every second
                await asyncio.wait_for(self._changed.wait(), timeout=1.0)
        waited = self.clock() - t0
        if waited > 0:
            self.held_s[lane] = self.held_s.get(lane, 0.0) + waited
        return waited


class StallWatch:
    """Whether every lane a validator drives stalled between two scores updates (tempos), for the
    scoreboard's stall decay (:class:`~iota_subnet.validator.scoring.Scoreboard`).

    Stalled: the validator drives lanes that are not finished and no lane step completed since the
    previous update. Not stalled while some unfinished lane's next step opens a merge window (its
    replicas merge before they train it: the lane waits at their merge gate) and a lane step
    completed less than ``merge_allowance_s`` ago: a merge on a slow link pauses every lane for
    minutes (a ``tiny_merge`` stage at 0.8 Mbit/s: 190 s, dozens of localnet tempos), which is
    not a fault. ``every``: ``merge.every_steps`` (0: no merges); ``merge_allowance_s``: the longest
    a merge may pause a lane (the merge's deadlines at the declared uplink,
    :mod:`iota_subnet.merge.deadlines`; a run on slower links declares ``merge.assumed_uplink_bps``).
    """

    def __init__(self, every: int, merge_allowance_s: float, clock: Callable[[], float] = time.monotonic):
        self.every = max(0, int(every))
        self.merge_allowance_s = float(merge_allowance_s)
        self.clock = clock
        self.done_at_update: Optional[int] = None   # lane steps done at the previous update
        self.progress_at = clock()                  # when a lane step last completed (as updates saw it)
        self.paused = False                         # the last update fell in a merge's pause

    def merging(self, next_steps, total: Optional[int]) -> bool:
        """Some unfinished lane's next step is the first of a merge window."""
        return self.every > 0 and any(n > 0 and n % self.every == 0 and (total is None or n < total)
                                      for n in next_steps)

    def update(self, done: int, next_steps, total: Optional[int], driving: bool) -> bool:
        """One scores update: ``done`` lane steps completed so far, ``next_steps`` each lane's next
        step, ``total`` the run's steps (None: open-ended), ``driving`` whether this validator drives
        lanes. Returns whether every lane stalled since the previous update; :attr:`paused` says
        whether they waited for a merge instead."""
        now = self.clock()
        before, self.done_at_update = self.done_at_update, done
        self.paused = False
        if before is None or done > before:
            self.progress_at = now
            return False
        if not driving:
            return False
        self.paused = self.merging(next_steps, total) and now - self.progress_at < self.merge_allowance_s
        return not self.paused
