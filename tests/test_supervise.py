"""The task supervisor: a failing task is logged, restarted with backoff and shown in status; one that
fails on every start makes the owner unhealthy within ``unhealthy_after`` failures; a task that returns
is done; cancellation is not a failure. Faults are injected through the public ``wrap`` seam."""
from __future__ import annotations

import asyncio

import pytest
from loguru import logger

from iota_subnet.utils.supervise import Supervisor
from support.faults import FaultySupervisor

pytestmark = pytest.mark.timeout(60)


def test_a_task_that_raises_once_is_logged_restarted_and_counted():
    lines: list[str] = []
    sink = logger.add(lines.append, level="ERROR")

    async def main():
        sup = FaultySupervisor("miner", base_backoff_s=0.01, fail_times=1)
        ran = asyncio.Event()

        async def loop():
            ran.set()
            await asyncio.sleep(3600)

        sup.spawn("receipts", loop)
        await asyncio.wait_for(ran.wait(), 5)
        st = sup.status()["receipts"]
        await sup.stop()
        return st, sup.healthy, sup.status()["receipts"]["state"]

    try:
        st, healthy, final = asyncio.run(main())
    finally:
        logger.remove(sink)
    assert st["state"] == "running" and st["restarts"] == 1 and st["failures"] == 1
    assert st["last_error"] == "RuntimeError: injected fault 1 in receipts"
    assert healthy and final == "stopped"
    text = "".join(lines)
    assert "task 'receipts' failed" in text and "Traceback" in text and "injected fault 1" in text


def test_a_task_failing_on_every_start_makes_the_owner_unhealthy_within_five_failures():
    async def main():
        sup = FaultySupervisor("validator", base_backoff_s=0.001, max_backoff_s=0.002, unhealthy_after=5,
                               fail_times=10 ** 9)

        async def never():
            await asyncio.sleep(3600)

        sup.spawn("weights", never)
        seen_healthy = []
        for _ in range(2000):
            await asyncio.sleep(0.001)
            seen_healthy.append((sup.status()["weights"]["failures"], sup.healthy))
            if sup.status()["weights"]["failures"] >= 7:
                break
        failing = sup.failing()
        await sup.stop()
        return seen_healthy, failing

    seen, failing = asyncio.run(main())
    assert failing == ["weights"]
    assert all(h for f, h in seen if f < 5)          # healthy before the 5th failure
    assert not any(h for f, h in seen if f >= 5)     # unhealthy from the 5th on
    assert max(f for f, _ in seen) >= 7              # and still retried


def test_a_task_that_returns_is_done_and_a_stable_run_resets_the_count():
    async def main():
        sup = FaultySupervisor("miner", base_backoff_s=0.001, unhealthy_after=2, stable_after_s=0.05, fail_times=2)

        async def short():
            return None

        sup.spawn("sync", short)
        await asyncio.wait_for(sup.tasks["sync"], 5)
        done = sup.status()["sync"]
        sup2 = FaultySupervisor("miner", base_backoff_s=0.001, unhealthy_after=2, stable_after_s=0.05, fail_times=2)
        started = asyncio.Event()

        async def long():
            started.set()
            await asyncio.sleep(3600)

        sup2.spawn("merge", long)
        await asyncio.wait_for(started.wait(), 5)
        unhealthy_at_start = not sup2.healthy
        await asyncio.sleep(0.1)
        healthy_later = sup2.healthy
        await sup2.stop()
        return done, unhealthy_at_start, healthy_later

    done, unhealthy_at_start, healthy_later = asyncio.run(main())
    assert done["state"] == "done" and done["restarts"] == 2 and done["consecutive_failures"] == 0
    assert unhealthy_at_start and healthy_later


def test_spawning_a_running_name_twice_is_refused():
    async def main():
        sup = Supervisor("miner")

        async def loop():
            await asyncio.sleep(3600)

        sup.spawn("x", loop)
        with pytest.raises(ValueError, match="already running"):
            sup.spawn("x", loop)
        await sup.stop()

    asyncio.run(main())


def test_stop_by_name_leaves_the_others_running_and_a_task_in_backoff_stops_cleanly():
    async def main():
        sup = FaultySupervisor("miner", base_backoff_s=30.0, max_backoff_s=30.0, fail_times=1, only={"sender0"})

        async def loop():
            await asyncio.sleep(3600)

        for n in ("dataplane", "sender0", "chain"):
            sup.spawn(n, loop)
        await asyncio.sleep(0.05)
        in_backoff = sup.status()["sender0"]["state"]
        await sup.stop(names=["dataplane", "sender0"])
        states = {n: r["state"] for n, r in sup.status().items()}
        await sup.stop()
        return in_backoff, states, sup.status()["chain"]["state"]

    in_backoff, states, chain = asyncio.run(main())
    assert in_backoff == "backoff"
    assert states == {"dataplane": "stopped", "sender0": "stopped", "chain": "running"}
    assert chain == "stopped"
