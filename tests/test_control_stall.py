"""The validator's control plane when a lane's head is behind the step it follows (found in the churn
benchmark, 2026-12-02): with one validator, every step before the followed one is this validator's
own and complete, so a head still on an earlier step is stuck (it merged, was paused, or lost its
part of a step to a reroute), not waiting for another validator's turn. The old code waited the
turn timeout (120 s) without re-issuing anything, again and again: lane steps of 100-130 s.

A real :class:`ControlPlane`, :class:`Router` and :class:`Ledger`; the head is a scripted client that
queues tickets, reports an inner step, and never sends a receipt."""
from __future__ import annotations

import asyncio
import time

import pytest

from support.control import StuckHead, control

pytestmark = pytest.mark.timeout(120)


def test_a_lone_validator_reissues_at_once_when_the_head_is_stuck_behind_its_own_steps():
    head = StuckHead(head_step=1)
    cp = control(head)

    async def main():
        t0 = time.monotonic()
        res = await asyncio.wait_for(cp.run_lane_step(0, 3), timeout=30.0)
        return res, time.monotonic() - t0
    res, took = asyncio.run(main())
    attempts = sorted({(t.index, t.attempt) for ts, _ in head.batches for t in ts})
    assert attempts == [(m, a) for m in range(2) for a in range(4)]       # every attempt, not one in 60 s
    reissued = [base for ts, base in head.batches if ts[0].attempt > 0]
    assert len(reissued) == 6 and all(base == {"0": 3} for base in reissued)   # each: steps < 3 are done
    assert took < 30.0 and not any(r.ok for r in res.microbatches)


def test_with_two_validators_a_head_on_the_others_step_is_waited_for():
    """Validator 0 of 2 follows its step 4; the head is on step 3 (validator 1's): that is a turn, not a
    stall, so nothing is re-issued before the turn timeout."""
    head = StuckHead(head_step=3)
    cp = control(head, validator_index=0, n_validators=2)

    async def main():
        task = asyncio.create_task(cp.run_lane_step(0, 4))
        await asyncio.sleep(4.0)                 # 8 stall timeouts
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    asyncio.run(main())
    assert sorted({t.attempt for ts, _ in head.batches for t in ts}) == [0]


def test_a_resumed_validator_counts_only_steps_it_may_have_ticketed_as_trained_and_the_rest_as_skipped():
    """Resumed at lane step 10 (its previous process issued tickets up to 8 steps ahead), the head is at
    inner step 30 (it synced to a later state): steps 10-17 were trained with the old tickets (counted,
    receipts lost), steps 18-29 were never issued, so never trained in this lane: reported lost, and the
    run's accounting counts their samples skipped (the old code counted all of them trained)."""
    head = StuckHead(head_step=30)
    cp = control(head)
    got: list = []
    stop = asyncio.Event()

    def on_step(res, next_step):
        got.append(res)
        if res.step == 29:
            stop.set()

    asyncio.run(asyncio.wait_for(cp.run_lane(0, 10, 150, on_step=on_step, stop=stop), timeout=30.0))
    assert [r.step for r in got] == list(range(10, 30))
    assert all(r.ok_count == 2 and r.microbatches[0].phase == "trained while away" for r in got[:8])
    assert all(r.ok_count == 0 and r.microbatches[0].phase.startswith("skipped") for r in got[8:])
    assert not head.batches                                          # nothing was issued for those steps
