"""Churn at the merge level, over the in-process transport (every message through the wire codec):
a restarted replica whose inner steps lag finds a common epoch with its peer again; a stopped
(SIGSTOP-like) replica costs one epoch, not every later one, and pulls when it is back; state sync
backs off, names the missing chunks and takes a later snapshot."""
from __future__ import annotations

import asyncio
import time

import pytest
import torch

from iota_subnet.config import MergeConfig
from iota_subnet.merge import MergeEngine, MergeEngineOptions, ModuleParams
from iota_subnet.merge.sync import SnapshotDonor, SyncError, sync_state
from iota_subnet.merge.transport import InProcessTransport
from iota_subnet.protocol import Outcome, ProtocolError

pytestmark = pytest.mark.timeout(120)

HK = [f"5Churn{i:02d}" for i in range(6)]


def module(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))


def flat(m):
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def train_step(m, seed):
    """One 'inner step' on replica-specific data."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 1e-3)


class Replica:
    """A replica's merge engine plus its lane: ``step_s`` seconds per inner step, a merge (its lane
    paused, as without ``merge.overlap``) every ``H`` inner steps, proposed at epoch ``step // H - 1``
    as the miner does."""

    def __init__(self, net, i, cfg, H=2, step_s=0.05):
        self.hk, self.H, self.step_s = HK[i], H, step_s
        self.mod = module()
        self.work = 0.0
        self.engine = MergeEngine(self.hk, cfg, ModuleParams(self.mod), net.view(self.hk), run_id="churn", stage=0,
                                  options=MergeEngineOptions(work_fn=lambda: self.work, step_fn=lambda: self.step))
        net.register(self.hk, self.engine.handle)
        self.step = 0
        self.reports = []

    async def run(self, steps, peers, salt=0):
        for _ in range(steps):
            await asyncio.sleep(self.step_s)
            self.step += 1
            train_step(self.mod, 1000 * salt + 7 * self.step + HK.index(self.hk))
            self.work += 64
            if self.step % self.H == 0:
                self.reports.append(await self.engine.merge(self.step // self.H - 1, peers))


def trained_pair(join_timeout_s: float, seed: int) -> tuple[InProcessTransport, "Replica", "Replica", list[str]]:
    """Two replicas (H = 2) over an in-process transport, each with one window of its own work."""
    cfg = MergeConfig(every_steps=2, join_timeout_s=join_timeout_s, phase_timeout_s=2.0, max_attempts=2)
    net = InProcessTransport(timeout_s=3.0)
    a, b = Replica(net, 0, cfg), Replica(net, 1, cfg)
    for i, r in enumerate((a, b)):
        train_step(r.mod, seed + i)
        r.work = 64.0
    return net, a, b, [a.hk, b.hk]


def test_restarted_replica_whose_steps_lag_merges_again():
    """Issue 13: one replica killed mid-epoch and restarted (its lane resumes steps behind) while the
    other ran on: both used to merge "alone" every epoch from then on and drift apart."""
    cfg = MergeConfig(every_steps=2, join_timeout_s=1.5, phase_timeout_s=2.0, max_attempts=2)
    net = InProcessTransport(timeout_s=3.0)
    a, b = Replica(net, 0, cfg), Replica(net, 1, cfg)
    peers = [a.hk, b.hk]

    async def main():
        await asyncio.gather(a.run(5, peers), b.run(5, peers))     # epochs 0 and 1 merged together
        assert [r.status for r in a.reports] == ["merged", "merged"], [(r.status, r.reason) for r in a.reports]
        net.kill(b.hk)                                             # killed at step 5, mid-epoch
        await a.run(9, peers)                                      # the other runs on, alone (steps 6..14)
        assert {r.status for r in a.reports[2:]} == {"alone"}
        # restart: its merge-state file holds epoch 1; its lane resumes at step 5, 9 steps behind
        saved = b.engine
        b2 = Replica(net, 1, cfg)
        b2.engine.set_state(saved.anchor, saved.momentum, saved.merged_epoch)
        b2.step, b2.work = 5, saved._work_total()
        await asyncio.gather(a.run(16, peers, salt=1), b2.run(16, peers, salt=1))
        return b2

    b2 = asyncio.run(main())
    after = a.reports[7:]
    together = [r for r in after if r.status == "merged" and len(r.participants) == 2]
    assert len(together) >= 4, [(r.epoch, r.status, r.reason) for r in after]
    assert all(len(r.participants) == 2 for r in b2.reports if r.status == "merged")
    # the last merge both applied: the same epoch, the same merged weights
    assert a.engine.merged_epoch == b2.engine.merged_epoch
    assert torch.equal(a.engine.anchor, b2.engine.anchor)


def test_a_replica_late_to_an_epoch_its_peer_closed_goes_on_and_meets_it_at_the_next_boundary():
    """Issue 13 (chaos run, 2026-12-02): a replica reached a boundary after its peer had given up
    waiting and merged alone. It moved to the peer's *next* label at once and waited there, its lane
    paused, for a peer a whole merge window away (30-40 s per boundary with 17 s inner steps), then
    went alone again, one label ahead of its peers' steps. Now it does not wait: it goes on alone and
    its next merge is labelled above the closed epoch, where the two meet."""
    net, a, b, peers = trained_pair(4.0, 10)

    async def main():
        first = await a.engine.merge(0, peers)                   # b's lane is late: a waits, then goes on
        t0 = time.monotonic()
        late = await b.engine.merge(0, peers)                    # b reaches the boundary afterwards
        late_wall = time.monotonic() - t0
        for i, r in enumerate((a, b)):
            train_step(r.mod, 20 + i)
            r.work += 64.0
        nxt = await asyncio.gather(a.engine.merge(1, peers), b.engine.merge(1, peers))
        return first, late, late_wall, nxt

    first, late, late_wall, nxt = asyncio.run(main())
    assert (first.epoch, first.status) == (0, "alone")
    assert (late.epoch, late.status) == (0, "alone"), (late.epoch, late.status, late.reason)
    assert "closed epoch 0" in late.reason and b.engine.label_floor == 1
    assert late_wall < a.engine.cfg.join_timeout_s / 2, late_wall        # it did not wait for a peer a window away
    assert [(r.epoch, r.status, len(r.participants)) for r in nxt] == [(1, "merged", 2)] * 2, \
        [(r.epoch, r.status, r.reason) for r in nxt]
    assert torch.equal(a.engine.anchor, b.engine.anchor)


def test_a_replica_whose_peer_closed_later_epochs_labels_its_next_merge_above_them():
    """The peer went on alone through epochs 0 and 1 while this replica was away; arriving at epoch 0
    it goes on alone, and its next merge (proposed at epoch 1 by its inner steps, and before the
    peer is ready) is labelled 2, where it waits for the peer and they merge. Labelled 1, it found the
    peer had closed 1, went on alone at once, and the peer then waited at 2 for nobody."""
    net, a, b, peers = trained_pair(4.0, 30)

    async def main():
        net.kill(b.hk)
        assert [(await a.engine.merge(e, peers)).status for e in (0, 1)] == ["alone", "alone"]
        net.dead.discard(b.hk)                                      # back
        late = await b.engine.merge(0, peers)
        for i, r in enumerate((a, b)):
            train_step(r.mod, 40 + i)
            r.work += 64.0
        first = asyncio.create_task(b.engine.merge(1, peers))       # b's lane reaches the boundary first
        await asyncio.sleep(0.5)
        second = await a.engine.merge(2, peers)
        return late, await first, second

    late, rb, ra = asyncio.run(main())
    assert (late.epoch, late.status) == (0, "alone") and b.engine.label_floor == 2, (late.epoch, late.reason)
    assert [(r.epoch, r.status, len(r.participants)) for r in (rb, ra)] == [(2, "merged", 2)] * 2, \
        [(r.epoch, r.status, r.reason) for r in (rb, ra)]


def test_a_suspect_peer_one_step_from_the_boundary_is_waited_for_and_one_far_behind_is_not():
    """Chaos run (2026-12-02): a replica once found gone stays suspect until it takes part in a merge,
    and a suspect was waited for only a quarter of the join timeout; lanes paced by the validator reach
    a boundary up to a step apart (10-17 s on 2 cores), so such a replica's peers went on alone at
    every later boundary, and it never merged again (pairs of "alone" 2-9 s apart in the logs). A
    suspect that says it is one inner step from the boundary is waited for; a spare far behind is not."""
    net, a, b, peers = trained_pair(8.0, 60)   # grace 2 s
    a.step, b.step = 2, 1                                        # b's lane runs the window's last step
    a.engine.liveness.suspect([b.hk], "unreachable at a merge join")

    async def main():
        first = asyncio.create_task(a.engine.merge(0, peers))
        await asyncio.sleep(3.5)                                 # past the suspects' grace
        b.step = 2
        return await merged_then_alone_with_a_spare(a, b, peers, first, (4, 2))    # now b is a spare, far behind

    merged_pair_then_alone(*asyncio.run(main()), a.engine.cfg.join_timeout_s)


async def merged_then_alone_with_a_spare(a, b, peers, first, steps):
    """``b`` merges epoch 0 with ``a`` (whose merge is the task ``first``); then ``b`` sits at
    ``steps[1]``, not advancing, suspect to ``a`` at ``steps[0]``, and ``a`` merges epoch 1.
    Returns both epoch-0 reports, the epoch-1 report and its wall time (s)."""
    rb = await b.engine.merge(0, peers)
    ra = await first
    a.step, b.step = steps
    a.engine.liveness.suspect([b.hk], "not ready by the join deadline")
    t0 = time.monotonic()
    alone = await a.engine.merge(1, peers)
    return ra, rb, alone, time.monotonic() - t0


def merged_pair_then_alone(ra, rb, alone, wall, join_timeout_s):
    assert [(r.epoch, r.status, len(r.participants)) for r in (ra, rb)] == [(0, "merged", 2)] * 2, \
        [(r.epoch, r.status, r.reason) for r in (ra, rb)]
    assert alone.status == "alone" and wall < join_timeout_s / 2, (alone.status, wall)


def test_stalled_replica_costs_one_epoch_then_is_late_and_pulls():
    """Issue 13: a replica SIGSTOPped mid-merge; every later epoch still waited ~31 s at the boundary
    for it. Now only the epoch it stalled in waits; later epochs probe it briefly and go ahead; when it
    comes back it finds a later merged epoch and is late (it pulls)."""
    cfg = MergeConfig(every_steps=1, join_timeout_s=20.0, phase_timeout_s=2.0, max_attempts=2)
    net = InProcessTransport(timeout_s=12.0)          # the HTTP client gives up after its timeout
    reps = [Replica(net, i, cfg) for i in range(4)]
    for i, r in enumerate(reps):
        train_step(r.mod, 50 + i)
        r.work = 64.0
    peers = [r.hk for r in reps]
    victim = reps[3]

    async def stop_mid_merge(plan, rep):              # joined, then the process is stopped
        net.stall(victim.hk)
        await asyncio.sleep(3600)
    victim.engine._allreduce = stop_mid_merge

    async def main():
        vt = asyncio.create_task(victim.engine.merge(0, peers))
        t0 = time.monotonic()
        first = await asyncio.gather(*(r.engine.merge(0, peers) for r in reps[:3]))
        walls = [time.monotonic() - t0]
        for epoch in (1, 2, 3):
            for i, r in enumerate(reps[:3]):
                train_step(r.mod, 100 * epoch + i)
                r.work += 64
            t0 = time.monotonic()
            res = await asyncio.gather(*(r.engine.merge(epoch, peers) for r in reps[:3]))
            walls.append(time.monotonic() - t0)
            assert all(x.status == "merged" and victim.hk not in x.participants for x in res), \
                [(x.status, x.reason) for x in res]
        vt.cancel()
        # SIGCONT: it answers again and reaches its next boundary with the merged state of epoch -1
        net.stall(victim.hk, False)
        victim.engine._allreduce = MergeEngine._allreduce.__get__(victim.engine)
        late = await victim.engine.merge(1, peers)
        return first, walls, late

    first, walls, late = asyncio.run(main())
    assert all(x.status == "merged" for x in first), [(x.status, x.reason) for x in first]
    assert all(w < 6.0 for w in walls[1:]), walls          # later epochs do not wait for the stopped peer (>= 12 s)
    assert late.status == "late"
    ws = [flat(r.mod) for r in reps[:3]]
    assert all(torch.equal(ws[0], w) for w in ws[1:])
    assert reps[0].engine.status()["suspect_peers"] == {victim.hk: "missing from a merge attempt"}


class DonorNet:
    """Donors of one stage behind an in-process call table; ``refuse(chunk)`` makes every donor answer
    BUSY for that chunk of the current snapshot (a chunk it cannot serve now); requests are counted."""

    def __init__(self, n, P, chunk_numel=64, retain_s=60.0):
        self.donors = {HK[i]: SnapshotDonor("churn", 0, chunk_numel=chunk_numel, max_concurrent=4, retain_s=retain_s)
                       for i in range(n)}
        self.P, self.cn = P, chunk_numel
        self.refused: set[tuple[str, int]] = set()       # (snapshot id, chunk)
        self.requests: dict[int, int] = {}
        self.on_request = None

    def publish(self, epoch):
        g = torch.Generator().manual_seed(epoch)
        a, m = torch.randn(self.P, generator=g), torch.randn(self.P, generator=g)
        for d in self.donors.values():
            d.publish(a, m, epoch, step=2 * (epoch + 1))
        return a, m

    async def call(self, peer, route, msg, rtype):
        d = self.donors[peer]
        if msg.snapshot_id:
            i = msg.offset // self.cn
            self.requests[i] = self.requests.get(i, 0) + 1
            if self.on_request is not None:
                self.on_request(msg)
            man = await d.manifest()
            if (man["snapshot_id"], i) in self.refused and msg.snapshot_id == man["snapshot_id"]:
                raise ProtocolError(Outcome.BUSY, f"chunk {i} not available")
        return await d.handle(msg, "joiner"), 0, 0


def test_state_sync_backs_off_names_missing_chunks_and_takes_a_later_snapshot(tmp_path):
    """Issue 13: with one chunk missing on every donor a joiner sent 1,206 requests for it to one
    donor in 191 s and never applied the state."""
    P = 1000                                   # 2P = 2000 values: 32 chunks of 64
    net = DonorNet(2, P)
    net.publish(1)
    sid = asyncio.run(next(iter(net.donors.values())).manifest())["snapshot_id"]
    net.refused.add((sid, 5))
    t0 = time.monotonic()
    with pytest.raises(SyncError) as ei:
        asyncio.run(sync_state(list(net.donors), net, run_id="churn", stage=0, param_numel=P, work_dir=tmp_path,
                               busy_retry_s=0.05, seed=1))
    assert ei.value.missing == [5] and "chunks [5]" in str(ei.value)
    assert net.requests[5] <= 2 * 3, net.requests[5]         # each donor asked 3 times, with backoff
    assert time.monotonic() - t0 < 10
    assert len(list(tmp_path.rglob("chunk*.bin"))) == 31     # the verified chunks stay for a resume
    # the stage merges again: the later snapshot is complete and is taken
    a, m = net.publish(2)
    anchor, momentum, man = asyncio.run(sync_state(list(net.donors), net, run_id="churn", stage=0, param_numel=P,
                                                   work_dir=tmp_path, busy_retry_s=0.05, seed=1))
    assert man["merged_epoch"] == 2 and torch.equal(anchor, a) and torch.equal(momentum, m)


def test_state_sync_follows_donors_to_their_newer_snapshot(tmp_path):
    """A merge applied on the donors while a joiner fetches, donors that keep no replaced snapshot
    (``retain_s`` 0): they answer LATE for the old snapshot; the joiner describes again and fetches
    the new one (it used to drop every donor and fail)."""
    P = 1000
    net = DonorNet(2, P, retain_s=0.0)
    net.publish(1)
    seen = []

    def merge_midway(msg):
        seen.append(msg.snapshot_id)
        if len(seen) == 6:
            net.publish(2)
    net.on_request = merge_midway
    anchor, momentum, man = asyncio.run(sync_state(list(net.donors), net, run_id="churn", stage=0, param_numel=P,
                                                   work_dir=tmp_path, busy_retry_s=0.05, seed=1))
    a, m = net.publish(2)
    assert man["merged_epoch"] == 2 and torch.equal(anchor, a) and torch.equal(momentum, m)
    assert len(set(seen)) == 2


def test_a_sync_longer_than_the_merge_interval_finishes_on_the_snapshot_it_started(tmp_path):
    """Donors merge every few chunks of a joiner's sync (a sync slower than the stage's merge interval,
    as at ``8b`` on 100 Mbit/s): without kept snapshots every replacement sends the joiner back and
    three of them fail the sync; with them it finishes the snapshot it started, and each donor keeps
    one replaced snapshot, dropped once nobody fetches it for ``retain_s``."""
    P = 1000                                   # 32 chunks of 64 values

    def run(retain_s):
        net = DonorNet(2, P, retain_s=retain_s)
        first = net.publish(1)
        epoch = [1]
        count = [0]

        def merge_often(msg):
            count[0] += 1
            if count[0] % 4 == 0:              # a merge every 4 chunk requests
                epoch[0] += 1
                net.publish(epoch[0])
        net.on_request = merge_often
        return net, first, asyncio.run(sync_state(list(net.donors), net, run_id="churn", stage=0, param_numel=P,
                                                  work_dir=tmp_path / str(retain_s), busy_retry_s=0.01, seed=1))
    with pytest.raises(SyncError, match="replaced 3 times"):
        run(0.0)
    net, (a, m), (anchor, momentum, man) = run(60.0)
    assert man["merged_epoch"] == 1 and torch.equal(anchor, a) and torch.equal(momentum, m)
    assert man["sync"]["dropped"] == [] and man["sync"]["chunks"] == 32
    donors = list(net.donors.values())
    assert sum(d.served_retained for d in donors) >= 32 - 4
    assert all(d.status()["retained_snapshot_id"] == man["snapshot_id"] for d in donors)
    assert all(d.retained_bytes == 8 * P for d in donors)
    # nobody fetches it any more: dropped at the next publish after retain_s
    for d in donors:
        d.retain_s = 0.05
    time.sleep(0.06)
    net.publish(99)
    assert all(d.retained is None and d.status()["retained_bytes"] == 0 for d in donors)


def test_a_suspect_peer_steps_behind_whose_lane_advances_is_waited_for_and_a_still_one_is_not():
    """Chaos run at 832facd: lanes can reach a merge boundary more than a step apart (a validator
    restart, a reroute); the first replica gave up on its (suspect) peer after the grace, and the
    peer, arriving seconds later, found the epoch closed and merged alone too (18 of 41 "alone"
    merges were the second of such a pair). A suspect at most half a window behind (here 3 steps)
    whose inner step advances while it is waited for is training toward the boundary: it is waited
    for. One that does not advance is not."""
    cfg = MergeConfig(every_steps=6, join_timeout_s=8.0, phase_timeout_s=2.0, max_attempts=2)   # grace 2 s
    net = InProcessTransport(timeout_s=3.0)
    a, b = Replica(net, 0, cfg, H=6), Replica(net, 1, cfg, H=6)
    for i, r in enumerate((a, b)):
        train_step(r.mod, 70 + i)
        r.work = 64.0
    peers = [a.hk, b.hk]
    a.step, b.step = 6, 3                                        # b's lane is three steps from the boundary
    a.engine.liveness.suspect([b.hk], "unreachable at a merge join")

    async def main():
        first = asyncio.create_task(a.engine.merge(0, peers))
        for _ in range(3):                                       # one step every 1.5 s: past the 2 s grace
            await asyncio.sleep(1.5)
            b.step += 1
        return await merged_then_alone_with_a_spare(a, b, peers, first, (12, 10))  # 2 behind, not advancing

    merged_pair_then_alone(*asyncio.run(main()), cfg.join_timeout_s)


def test_a_replica_late_at_the_boundary_pulls_keeps_its_progress_and_merges_the_same_epoch():
    """Chaos run at 4fbca7f: a replica that missed a merge (partitioned) was one merged epoch behind
    at every later boundary. Each time it found its peers ahead, pulled their merged state (dropping
    its window's work) while they merged without it: stage 2 merged with 2 of 3 replicas for the
    whole run. Now its peers wait for a replica at their boundary while it pulls; it keeps its
    progress since its old anchor on top of the pulled state and joins the same epoch."""
    cfg = MergeConfig(every_steps=2, join_timeout_s=8.0, phase_timeout_s=2.0, max_attempts=2)
    net = InProcessTransport(timeout_s=3.0)
    reps = [Replica(net, i, cfg) for i in range(3)]
    a, b, c = reps
    for i, r in enumerate(reps):
        train_step(r.mod, 90 + i)
        r.work, r.step = 64.0, 2
    peers = [r.hk for r in reps]

    async def main():
        first = await asyncio.gather(a.engine.merge(0, [a.hk, b.hk]), b.engine.merge(0, [a.hk, b.hk]))
        assert [x.status for x in first] == ["merged", "merged"]       # c was away: still at merged epoch -1
        for i, r in enumerate(reps):                                   # the next window, all at step 4
            train_step(r.mod, 190 + i)
            r.work, r.step = r.work + 64, 4
        own = flat(c.mod) - c.engine.anchor                            # c's progress since its anchor

        async def late_then_again():
            late = await c.engine.merge(1, peers)
            assert late.status == "late", (late.status, late.reason)
            c.engine.in_sync = False                                   # the miner's state sync (a while)
            await asyncio.sleep(0.5)
            c.engine.set_state(a.engine.anchor, a.engine.momentum, a.engine.merged_epoch, keep_progress=True)
            assert torch.allclose(flat(c.mod) - a.engine.anchor, own, atol=1e-6)
            c.engine.in_sync = True
            return await c.engine.merge(1, peers)
        return await asyncio.gather(a.engine.merge(1, peers), b.engine.merge(1, peers), late_then_again())

    res = asyncio.run(main())
    assert all(x.status == "merged" and len(x.participants) == 3 for x in res), \
        [(x.status, x.participants, x.reason) for x in res]
    ws = [flat(r.mod) for r in reps]
    assert all(torch.equal(ws[0], w) for w in ws[1:])
