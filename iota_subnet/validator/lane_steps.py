"""Following one lane step to its end: re-issue of failed and stalled micro-batches, turns of other
validators, and the accounting of steps the head went past (the control plane, :mod:`.control`).

A ``failed`` receipt, or no progress for :meth:`LaneStepper.stall_timeout`, makes the validator
re-issue the micro-batch (same sample address, ``attempt + 1``, routed around the miners that failed),
at most ``max_attempts`` times; every stage still accumulates each ``(lane, step, index)`` once. A head
still on an earlier lane step of another validator is waited for (``turn_timeout_s``), then this
validator drives those steps itself. A lane step the head went past without any receipt reaching this
validator was trained with tickets issued before a restart (counted, not credited) or skipped (lost).
"""
from __future__ import annotations

import asyncio
import time
from typing import Optional

from loguru import logger

from .control_context import ControlContext
from .flights import Flight
from .health import HealthProbe
from .lanes import LaneStepResult, MicrobatchResult, steps_of
from .tickets import TicketIssuer


class LaneStepper:
    """Drives single lane steps through ``tickets`` (issue) and ``health`` (probes, the head's step).
    Keeps the mean lane-step time (stall detection adapts to it) and, per lane, the first step a
    previous process of this validator cannot have issued tickets for."""

    #: lane steps whose flights are kept after completion (receipts arrive in batches, a little late)
    KEEP_STEPS = 4

    def __init__(self, ctx: ControlContext, tickets: TicketIssuer, health: HealthProbe):
        self.ctx, self.tickets, self.health = ctx, tickets, health
        #: mean seconds per lane step (exponential, weight 0.2), None before the first one
        self.step_time: Optional[float] = None
        #: per lane, the first step a previous process of this validator cannot have issued tickets for
        #: (it issued at most ``lookahead`` steps beyond where it stopped): a head past an earlier step
        #: may have trained it with those tickets; past a later one it skipped it
        self.ticketed_before: dict[int, int] = {}

    def stall_timeout(self) -> float:
        """Seconds without any receipt for a lane step before its unfinished micro-batches are re-issued:
        5 x the mean lane-step time per coordinating validator, at least ``min_stall_s``, at most ``stall_s``."""
        o = self.ctx.opts
        if self.step_time is None:
            return o.stall_s
        return max(o.min_stall_s, min(o.stall_s, 5.0 * self.step_time * o.n_validators))

    async def _reissue(self, fl: Flight, tries: int) -> bool:
        """Re-issue ``fl``'s micro-batch (``tries``: re-issues of it so far in this lane step)."""
        c, t = self.ctx, fl.ticket
        if tries + 1 >= c.opts.max_attempts:
            return False
        wait = c.opts.reissue_backoff_s * 2 ** t.attempt - (c.clock() - fl.issued)
        if wait > 0:
            await asyncio.sleep(wait)
        route = self.tickets.route(t.lane, set(fl.unreachable))
        if route is None:
            return False
        new = self.tickets.ticket(t.lane, t.step, t.index, start=t.start, split=t.split, train=t.train,
                                  attempt=t.attempt + 1, route=route)
        logger.info("lane {} step {} mb {}: re-issued as attempt {} ({})", t.lane, t.step, t.index, new.attempt,
                    "; ".join(fl.errors)[:200])
        await self.tickets.deliver([new])
        return True

    def others_steps(self, first: int, upto: int) -> list[int]:
        """The lane steps in ``[first, upto)`` other coordinating validators drive."""
        o = self.ctx.opts
        mine = set(steps_of(o.validator_index, o.n_validators, first, upto))
        return [k for k in range(first, upto) if k not in mine]

    async def _take_over(self, lane: int, first: int, upto: int) -> None:
        """Another validator stopped driving its steps of ``lane`` (the head has waited at step ``first``
        for ``turn_timeout_s``): issue its steps ``first .. upto - 1`` so the lane goes on."""
        theirs = self.others_steps(first, upto)
        if theirs:
            logger.warning("lane {}: the head waited {:.0f} s at step {}; driving steps {} of the other validators",
                           lane, self.ctx.opts.turn_timeout_s, first, theirs)
        for k in theirs:
            await self.tickets.issue_step(lane, k)

    async def run_lane_step(self, lane: int, step: int, stop: Optional[asyncio.Event] = None) -> LaneStepResult:
        """Issue (if needed) and follow lane step ``step`` to completion; re-issues failed or stalled
        micro-batches (at most ``max_attempts`` each). Returns what happened to each micro-batch."""
        c, book = self.ctx, self.ctx.book
        t0 = time.perf_counter()
        ev = book.event(lane)
        while not await self.tickets.issue_step(lane, step):
            await self.health.wait_and_probe(c.opts.empty_step_wait_s)
            if stop is not None and stop.is_set():
                return LaneStepResult(lane, step, [], time.perf_counter() - t0)
        self.tickets.lane_step[lane] = step
        last_progress, progress_mark = c.clock(), -1
        gave_up: set[int] = set()
        tries: dict[int, int] = {}
        while True:
            state = [book.index_state(lane, step, m) for m in range(c.micro_per_step)]
            mark = sum(len(f.receipts) for m in range(c.micro_per_step) for f in book.of(lane, step, m))
            if mark != progress_mark:
                progress_mark, last_progress = mark, c.clock()
            if all(st == "done" or m in gave_up for m, st in enumerate(state)):
                break
            if stop is not None and stop.is_set():
                break
            for m, st in enumerate(state):
                if st != "failed" or m in gave_up:
                    continue
                latest = book.of(lane, step, m)[-1]
                tries[m] = tries.get(m, 0) + 1
                if not await self._reissue(latest, tries[m] - 1):
                    gave_up.add(m)
                    logger.warning("lane {} step {} mb {}: given up after {} attempts: {}", lane, step, m,
                                   latest.ticket.attempt + 1, "; ".join(latest.errors)[:300])
            if c.clock() - last_progress > self.stall_timeout():
                cur = await self.health.head_step(lane)
                # the head is still on earlier steps of other validators: wait for their turn (not for
                # steps of this validator's own, which are complete: then the head is stuck, and only
                # re-issuing, with the steps done named in the tickets, moves it on)
                theirs = cur is not None and cur < step and bool(self.others_steps(cur, step))
                if theirs and c.clock() - last_progress >= c.opts.turn_timeout_s:
                    await self._take_over(lane, cur, step)
                    last_progress = c.clock()
                elif not theirs:
                    for m, st in enumerate(state):
                        if st == "running":
                            f = book.of(lane, step, m)[-1]
                            book.fail(f.ticket.microbatch_id, f"no progress for {self.stall_timeout():.1f} s")
                        elif st == "waiting":      # the head went past it, yet no attempt's receipts came
                            gave_up.add(m)
                    last_progress = c.clock()
                    await self.health.probe()
            ev.clear()
            try:
                await asyncio.wait_for(ev.wait(), timeout=1.0)
            except asyncio.TimeoutError:
                pass
        elapsed = time.perf_counter() - t0
        self.step_time = elapsed if self.step_time is None else 0.8 * self.step_time + 0.2 * elapsed
        return self._result(lane, step, elapsed)

    def _result(self, lane: int, step: int, elapsed: float) -> LaneStepResult:
        c, book = self.ctx, self.ctx.book
        mbs = []
        for m in range(c.micro_per_step):
            fls = book.of(lane, step, m)
            fl = next((f for f in fls if f.done), fls[-1] if fls else None)
            res = MicrobatchResult(lane, step, m, fl.ticket.microbatch_id if fl else "", True, c.mb_tokens)
            if fl is not None:
                away = not fl.done and book.index_state(lane, step, m) == "waiting"
                res.ok = fl.done or away        # waiting: the head went past it, trained under an earlier ticket
                res.loss = fl.loss if fl.done else None
                res.phase = "done" if fl.done else "trained while away" if away else "failed"
                res.attempts = fl.ticket.attempt + 1
                res.pathway = [{"stage": s, "uid": None, "hotkey": fl.server_of(s)} for s in range(c.n_stages)]
                reps = c.by_hotkey()
                for p in res.pathway:
                    rep = reps.get(p["hotkey"])
                    p["uid"] = rep.uid if rep is not None else None
                res.failures = [{"error": e} for e in fl.errors]
                res.reroutes = sum(1 for p, hk, tr in zip(res.pathway, fl.ticket.route, fl.ticket.trains or [True] * 99)
                                   if p["hotkey"] != hk or not tr)
                res.latency_s = (max((r.t for r in fl.receipts.values()), default=fl.issued) - fl.issued)
                res.head_step = fl.receipts[0].inner_step if 0 in fl.receipts else None
            if res.ok:
                c.counters.microbatches_ok += 1
                c.counters.tokens += res.tokens
            else:
                c.counters.microbatches_failed += 1
            mbs.append(res)
        book.forget(lane, step - self.KEEP_STEPS)     # late receipts of recent steps still credit
        return LaneStepResult(lane, step, mbs, elapsed)

    # ---------------------------------------------------------------- steps the head went past
    def trained_while_away(self, lane: int, step: int) -> LaneStepResult:
        """Lane step ``step`` trained by the miners with tickets this validator issued before it
        restarted: their receipts are lost, so it is counted (every micro-batch trained once), not credited."""
        c = self.ctx
        mbs = [MicrobatchResult(lane, step, m, "", True, c.mb_tokens, ok=True, phase="trained while away")
               for m in range(c.micro_per_step)]
        return LaneStepResult(lane, step, mbs, 0.0)

    def skipped(self, lane: int, step: int) -> LaneStepResult:
        """Lane step ``step`` that the lane's head went past without training it in this lane (it synced
        or skipped to a later inner step before any ticket of it arrived): its rows were never trained
        here, so its micro-batches are reported lost (the run's accounting counts its samples skipped)."""
        c = self.ctx
        mbs = [MicrobatchResult(lane, step, m, "", True, c.mb_tokens, ok=False,
                                phase="skipped: the head went past it") for m in range(c.micro_per_step)]
        return LaneStepResult(lane, step, mbs, 0.0)

    async def completed_elsewhere(self, lane: int, step: int) -> Optional[LaneStepResult]:
        """A lane step none of whose micro-batches completed under this validator's tickets while the
        lane's head is past it: the head completed it with the tickets this validator sent before a
        restart (the ones for the steps it looked ahead), which it still held. Without this the lane
        would re-issue that step for ever: every new ticket is answered ``stale``."""
        c = self.ctx
        cur = await self.health.head_step(lane)
        if cur is None or cur <= step:
            return None
        flights = [f for m in range(c.micro_per_step) for f in c.book.of(lane, step, m)]
        if step >= self.ticketed_before.get(lane, 0) and flights and all(f.stale for f in flights):
            logger.warning("lane {} step {}: its first-stage miner is at inner step {} and answered every ticket of "
                           "it stale: the step was skipped in this lane (reported as lost)", lane, step, cur)
            return self.skipped(lane, step)
        logger.warning("lane {} step {}: its first-stage miner is at inner step {}: the step was trained with tickets "
                       "issued before this validator restarted (receipts lost: counted, not credited)", lane, step, cur)
        return self.trained_while_away(lane, step)
