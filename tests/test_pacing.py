"""Lane pacing: the validator keeps its lanes within one merge window of each other, so the
replicas of a stage reach their merge boundaries together instead of merging alone.

First :class:`LanePacer` alone on a scripted clock, then a whole in-process p2p network (real miners
on 127.0.0.1, a real validator) in which one lane's stage-1 miner computes slowly, then the control
plane's start-up with a scripted head."""
from __future__ import annotations

import asyncio
import contextlib
from types import SimpleNamespace

import pytest

from bittensor.sp_core import Keypair

from iota_subnet.config import load_config
from iota_subnet.validator.control import ControlOptions, ControlPlane
from iota_subnet.validator.pacing import LanePacer
from iota_subnet.validator.routing import Replica, Router
from iota_subnet.validator.scoring import Ledger
from support.dataplane_net import OVR, P2PNet, run
from support.control import Clock, StuckHead

pytestmark = pytest.mark.timeout(300)


def test_the_step_closing_a_merge_window_waits_for_every_live_lane():
    clock = Clock()
    p = LanePacer(every=10, stall_s=60.0, clock=clock)
    p.at(0, 5)
    p.at(1, 12)
    p.at(2, 7)
    assert p.allows(1, 18) and not p.allows(1, 19)        # 19 closes the window [10, 20): wait for lane 0
    assert all(p.allows(2, k) for k in range(7, 9)) and not p.allows(2, 9)
    assert not p.allows(0, 9)                              # a ticket ahead for 9: lane 2 is not there yet
    p.at(0, 9)
    p.at(2, 9)
    assert p.allows(0, 9) and p.allows(2, 9)               # both there: the slowest lanes are never held
    assert not p.allows(1, 19)
    clock.t += 61.0                                        # lanes 0 and 2 stall (dead heads, re-routing)
    p.at(1, 19)
    assert p.allows(1, 19)                                 # stalled lanes no longer hold it back
    p.at(0, 10)                                            # lane 0 moves again: it holds the others again
    assert not p.allows(1, 29)
    p.finish(0)
    p.finish(2)
    assert p.allows(1, 29)                                 # finished lanes hold nothing back
    assert LanePacer(every=0, stall_s=60.0).allows(0, 9)


def test_a_held_lane_waits_as_long_as_the_slow_one_is_live_and_goes_when_it_gets_there():
    async def main():
        p = LanePacer(every=4, stall_s=0.5)
        p.at(0, 0)
        p.at(1, 3)
        held = asyncio.create_task(p.wait(1, 3))
        for _ in range(6):                       # lane 0 is live (a slow step, receipts coming in) ...
            await asyncio.sleep(0.2)
            p.at(0, 2)
        assert not held.done()                   # ... so lane 1 is held for longer than stall_s
        p.at(0, 3)
        waited = await asyncio.wait_for(held, 5.0)
        return waited, p.held_s[1]
    waited, held_s = asyncio.run(main())
    assert 1.0 < waited < 4.0 and held_s == waited


def test_no_lane_is_held_longer_than_max_hold_s_however_live_the_slow_one():
    """A lane member slow enough (or slowed on purpose) to finish each step just inside the stall time
    would otherwise set the pace of every lane; held for max_hold_s, a lane goes on (and merges without
    the slow one, as it did before pacing after the merge join's timeout)."""
    async def main():
        p = LanePacer(every=4, stall_s=60.0, max_hold_s=1.0)
        p.at(0, 0)
        p.at(1, 3)
        held = asyncio.create_task(p.wait(1, 3))
        for _ in range(15):
            await asyncio.sleep(0.2)
            p.at(0, 0)                           # live all along, never gets there
            if held.done():
                break
        return held.done(), await asyncio.wait_for(held, 5.0), p.allows(1, 3), p.allows(1, 7)
    done, waited, now, later = asyncio.run(main())
    assert done and 1.0 <= waited < 2.5
    assert now and not later                     # released for that step only


def test_lanes_of_a_network_with_one_slow_miner_stay_within_a_merge_window_and_merge_together(
        tmp_home, tmp_path, wikitext_path, cache_dir):
    """Lane 1's stage-1 miner takes 0.15 s more per compute (about 0.7 s more per lane step). Unpaced,
    lane 0 reached each merge boundary about 3 s before lane 1; its replicas waited the join timeout
    (2 s here), then merged alone, and the stage's replicas trained apart."""
    H, steps = 4, 8

    async def main():
        net = P2PNet(tmp_path, wikitext_path, cache_dir, replicas=2,
                     overrides={"merge": {"every_steps": H, "join_timeout_s": 2.0}})
        await net.start()
        plane = net.miners[(1, 1)].node.plane
        fast_compute = plane.compute

        async def slow_compute(fn, *a, **kw):
            out = await fast_compute(fn, *a, **kw)
            await asyncio.sleep(0.15)
            return out
        plane.compute = slow_compute
        try:
            vali = net.validator(steps=steps, stall_s=10.0)
            task = asyncio.create_task(vali.run())
            gaps = []
            while not task.done():
                nxt = dict(vali.driver.pacer._next) if vali.driver is not None else {}
                if len(nxt) == 2:
                    gaps.append(abs(nxt[0] - nxt[1]))
                await asyncio.sleep(0.02)
            assert task.result() == 0
            reports = {(s, r): [h for h in m.merge.history] for (s, r), m in net.miners.items()}
            return gaps, reports, net.status()
        finally:
            await net.close()

    gaps, reports, st = run(main(), timeout=280)
    assert st["done"] and st["steps_done"] == {"0": steps, "1": steps}, st
    assert gaps and max(gaps) <= H, max(gaps)                # never more than one merge window apart
    for key, hist in reports.items():
        applied = [h for h in hist if h.applied]
        assert len(applied) == steps // H, (key, [(h.epoch, h.status, h.reason) for h in hist])
        assert all(len(h.participants) == 2 for h in applied), key
    assert st["lane_held_s"].get("0", 0.0) > 0.0, st["lane_held_s"]     # the fast lane was held back


def test_a_lane_started_first_does_not_ticket_past_a_lane_not_started_yet():
    """A restarted validator starts its lanes one after the other; the first one used to see no other
    lane and ticketed its look-ahead through the merge window's last step (chaos run, 2026-12-02:
    after validator restarts, lanes reached a merge boundary up to two minutes apart)."""
    cfg = load_config("configs/tiny.yaml", {**OVR, "merge": {"every_steps": 5}})
    router = Router(cfg.pipeline.stages)
    router.update({s: [Replica(uid=10 * s + r, hotkey=Keypair.create_from_uri(f"//m{s}{r}").ss58_address,
                               endpoint=f"127.0.0.1:{9000 + 10 * s + r}", stage=s) for r in range(2)]
                   for s in range(cfg.pipeline.stages)})
    head = StuckHead(head_step=0)
    cp = ControlPlane(cfg, router=router, client=head, keypair=Keypair.create_from_uri("//vali"),
                      dataset=SimpleNamespace(n_val_rows=8), ledger=Ledger([1.0] * 6),
                      opts=ControlOptions(run_id="pace", n_lanes=2, stall_s=60.0))

    async def main():
        with contextlib.suppress(asyncio.TimeoutError):      # the scripted head never completes a step
            await asyncio.wait_for(cp.run({0: 2, 1: 0}, total_steps=20), timeout=1.0)
    asyncio.run(main())
    ticketed = {(t.lane, t.step) for ts, _ in head.batches for t in ts}
    assert {(0, 2), (0, 3), (1, 0), (1, 3)} <= ticketed
    assert (0, 4) not in ticketed and (1, 4) not in ticketed     # 4 closes the window: lane 1 is at 0
