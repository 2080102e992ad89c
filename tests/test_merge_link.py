"""Merges that fit the link: phase deadlines follow the payload's bytes and the declared uplink, and a
wait is cut only when no byte moved for ``merge.progress_timeout_s`` (:mod:`iota_subnet.merge.deadlines`).

In process (every message through the wire codec), each replica's requests and replies through its
own emulated uplink (``InProcessTransport.shape``), which reports bytes as they leave, piece by piece."""
from __future__ import annotations

import asyncio
import time

import pytest
import torch

from iota_subnet.config import MergeConfig
from iota_subnet.merge import MergeEngine, ModuleParams
from iota_subnet.merge.deadlines import phase_deadline_s, scatter_bytes
from iota_subnet.merge.transport import InProcessTransport
from iota_subnet.transport.shaping import LinkSpec, UplinkShaper

pytestmark = pytest.mark.timeout(120)

HK = [f"5Link{i:02d}" for i in range(20)]
UP_BPS = 2.4e6                  # 0.3 MB/s per replica


def replicas(n, cfg, module_fn, *, uplink_bps=None, timeout_s=30.0):
    net = InProcessTransport(timeout_s=timeout_s)
    engines, mods = [], []
    for i in range(n):
        torch.manual_seed(0)
        m = module_fn()
        e = MergeEngine(HK[i], cfg, ModuleParams(m), net.view(HK[i]), run_id="link", stage=0)
        g = torch.Generator().manual_seed(100 + i)         # local training: replica-specific steps
        with torch.no_grad():
            for p in m.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 1e-2)
        net.register(HK[i], e.handle)
        if uplink_bps:
            net.shape(HK[i], UplinkShaper(LinkSpec(uplink_bps, 0.0)))
        engines.append(e)
        mods.append(m)
    return net, engines, mods


def flat(m):
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def big():
    return torch.nn.Linear(1000, 600)           # 600,600 values: a 2.4 MB fp32 scatter per replica at N = 2


def test_a_scatter_longer_than_the_phase_timeout_merges_when_its_bytes_keep_moving():
    """2 replicas, 0.3 MB/s uplinks, a scatter of 2.4 MB per replica (~8 s) against a 4 s phase
    timeout; one chunk per shard, so no message completes for ~8 s while the progress timeout is 2 s:
    only bytes show the transfer is alive. The declared uplink is 1 Tbit/s, far above the link: the
    deadline of the older rule (``phase_timeout_s + 2 x bytes / declared rate``, the fixed 4 s of
    before) ended both alone; with bytes reported as they move the deadline is at the floor rate
    (64 kbit/s) and a transfer that keeps moving is never cut, so they merge."""
    cfg = MergeConfig(every_steps=1, join_timeout_s=4.0, phase_timeout_s=4.0, progress_timeout_s=2.0, max_attempts=2,
                      assumed_uplink_bps=1e12)

    async def run(cfg):
        net, engines, mods = replicas(2, cfg, big, uplink_bps=UP_BPS)
        t0 = time.monotonic()
        reps = await asyncio.gather(*(e.merge(0, HK[:2]) for e in engines))
        return reps, time.monotonic() - t0, mods, engines

    reps, wall, mods, engines = asyncio.run(run(cfg))
    assert [r.status for r in reps] == ["merged", "merged"], [(r.status, r.reason) for r in reps]
    assert all(r.attempts == 1 for r in reps)
    assert torch.equal(flat(mods[0]), flat(mods[1]))
    P = engines[0].params.numel
    sb = scatter_bytes(2, P, "none")
    print(f"\nscatter {sb / 1e6:.2f} MB per replica at {UP_BPS / 8e6:.2f} MB/s ({sb / (UP_BPS / 8):.1f} s); "
          f"older deadline {phase_deadline_s(cfg, sb):.1f} s, now {phase_deadline_s(cfg, sb, True):.0f} s: "
          f"merged in {wall:.1f} s")
    assert phase_deadline_s(cfg, sb) < sb / (UP_BPS / 8) < phase_deadline_s(cfg, sb, True)
    assert wall >= 0.9 * sb / (UP_BPS / 8)            # the uplink did shape it


def small():
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))


def test_a_peer_stalled_mid_merge_costs_at_most_one_progress_timeout():
    """A replica stops answering (SIGSTOP) right after it joined and planned: its peers give up on it
    after one progress timeout (2 s here, against a 30 s transport timeout and a 20 s phase timeout),
    not at a phase or transport deadline, and the merge goes on without it."""
    pt = 2.0
    cfg = MergeConfig(every_steps=1, join_timeout_s=20.0, phase_timeout_s=20.0, progress_timeout_s=pt, max_attempts=2)
    net, engines, mods = replicas(4, cfg, small, timeout_s=30.0)
    victim = engines[3]
    orig = victim._reduce

    async def stop_then_reduce(sess, s):          # joined and planned, then the process is stopped
        net.stall(victim.me)
        await asyncio.sleep(3600)
        await orig(sess, s)
    victim._reduce = stop_then_reduce

    async def main():
        t0 = time.monotonic()
        vt = asyncio.create_task(victim.merge(0, HK[:4]))
        res = await asyncio.gather(*(e.merge(0, HK[:4]) for e in engines[:3]))
        wall = time.monotonic() - t0
        vt.cancel()
        return res, wall

    res, wall = asyncio.run(main())
    print(f"\nstalled peer mid-merge: survivors {[(r.status, r.attempts) for r in res]} in {wall:.2f} s "
          f"(progress timeout {pt} s)")
    assert all(r.status == "merged" and victim.me not in r.participants for r in res), \
        [(r.status, r.reason) for r in res]
    assert wall <= 4.0 + pt, wall
    ws = [flat(m) for m in mods[:3]]
    assert all(torch.equal(ws[0], w) for w in ws[1:])


def test_a_trickle_is_not_progress_but_the_floor_rate_is():
    """Bytes inside a message count as progress once half of what the floor rate (64 kbit/s) moves in a
    progress timeout has moved; a whole message always counts."""
    from iota_subnet.merge.deadlines import LinkProgress
    t = [0.0]
    link = LinkProgress(clock=lambda: t[0], min_bytes=40_000)
    for t[0] in (1.0, 5.0, 9.0):
        link.moving("p", 1)                  # a byte now and then
    t[0] = 10.0
    assert link.idle_s(["p"], 0.0) == 10.0
    link.moving("p", 39_997)                 # 40 kB in all: progress
    assert link.idle_s(["p"], 0.0) == 0.0
    t[0] = 12.0
    link.note("p", 300)                      # a whole (small) message
    assert link.idle_s(["p"], 0.0) == 0.0 and link.partial["p"] == 0
