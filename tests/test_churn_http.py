"""Churn over real signed HTTP on 127.0.0.1: a state-sync donor's cap covers the send (not only the
copy), a late joiner waits for its peers to see it and catches up instead of training from the
seeded initialisation, and a restarted replica uses its own merge-state file while its peer is
stopped."""
from __future__ import annotations

import asyncio
import time

import pytest
import torch

from iota_subnet.merge.sync import SnapshotDonor
from iota_subnet.miner.service import MinerService
from iota_subnet.protocol import Outcome, ProtocolError, StateChunk, StateChunkRequest
from iota_subnet.transport import NeuronClient, NeuronServer
from iota_subnet.transport.shaping import LinkSpec, UplinkShaper
from support.common import make_wallet

pytestmark = pytest.mark.timeout(180)


def test_donor_cap_covers_the_send_to_slow_joiners(tmp_home):
    """Issue 13: a donor capped at 2 concurrent transfers served six slow joiners at once (six 4 MB
    transfers): the cap covered only the in-memory copy, not the send."""
    P = 1 << 20
    donor = SnapshotDonor("r", 1, chunk_numel=1 << 20, max_concurrent=2)     # one chunk = 4 MiB
    donor.publish(torch.randn(P), torch.randn(P), merged_epoch=2, step=30)
    root = tmp_home / "wallets"
    dw = make_wallet(root, "donor")
    joiners = [make_wallet(root, f"joiner{i}") for i in range(6)]
    shaper = UplinkShaper(LinkSpec(rate_bps=80e6))      # 4 MiB leave in ~0.4 s
    sending = [0, 0]                                    # now, peak (responses over 1 MiB in the uplink)
    transmit = shaper.transmit

    async def counted(nbytes, on_bytes=None):
        big = nbytes > (1 << 20)
        sending[0] += big
        sending[1] = max(sending[1], sending[0])
        try:
            await transmit(nbytes, on_bytes)
        finally:
            sending[0] -= big
    shaper.transmit = counted

    async def main():
        server = NeuronServer(dw, "127.0.0.1", 0, None, None, shaper=shaper)

        async def chunk(msg, ctx):
            return await donor.handle(msg, ctx.caller_hotkey, on_sent=ctx.on_sent)
        server.add_route("/state/chunk", chunk, StateChunkRequest)
        await server.start()
        clients = [NeuronClient(w) for w in joiners]
        try:
            man = (await clients[0].call(server.endpoint, server.hotkey, "/state/chunk",
                                         StateChunkRequest(run_id="r", stage=1), StateChunk, retries=0)).manifest

            async def fetch(cl, i):
                try:
                    r = await cl.call(server.endpoint, server.hotkey, "/state/chunk", StateChunkRequest(
                        run_id="r", stage=1, snapshot_id=man["snapshot_id"], offset=(i % 2) * P, numel=P),
                        StateChunk, retries=0, timeout_s=60)
                    return r.data.numel()
                except ProtocolError as e:
                    return e.outcome
            return await asyncio.gather(*(fetch(cl, i) for i, cl in enumerate(clients)))
        finally:
            for cl in clients:
                await cl.close()
            await server.stop()
    res = asyncio.run(main())
    assert sending[1] <= 2, f"{sending[1]} state transfers in the uplink at once (cap 2); results {res}"
    assert res.count(P) >= 2 and res.count(Outcome.BUSY) == 6 - res.count(P)
    assert donor.peak_active <= 2 and donor.active == 0          # every slot released after its send


# ---------------------------------------------------------------------------------------- replicas
from support.merge_net import Net, flat, merge_epoch, train_locally          # noqa: E402


async def merged_pair(net) -> tuple[MinerService, MinerService, int]:
    """Two replicas of stage 1 that trained differently and merged epoch 0 together (both at step H)."""
    await net.start(2)
    a, b = net.svcs
    for k, s in enumerate(net.svcs):
        train_locally(s, k)
    assert all(r.applied for r in await merge_epoch(net.svcs, 0))
    return a, b, net.cfg.merge.every_steps


async def kill_and_restart(net, b: MinerService) -> MinerService:
    """``b`` killed (no shutdown checkpoint: what is on disk is all it has) and started again."""
    await b.server.stop()
    b.server = None
    b2 = MinerService(net.cfg, b.wallet, net.chain, b.opts)      # b restarted
    net.svcs[1] = b2
    await asyncio.wait_for(b2.start(), 30)
    return b2


async def wait_for(cond, timeout_s):
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout_s:
            return False
        await asyncio.sleep(0.1)
    return True


def test_late_joiner_refused_by_its_peers_waits_then_catches_up(tmp_path, tmp_home):
    """Issue 13: a replica joining a running stage was refused by its peers (they did not see its
    stage commitment yet), fell back to the run's seeded initialisation and reported ready at inner
    step 0 while the stage was at merged epoch 1. It must wait, then catch up."""
    async def main():
        net = Net(tmp_path)
        await net.start(2)
        try:
            for epoch in (0, 1):
                for k, s in enumerate(net.svcs):
                    train_locally(s, 10 * epoch + k)
                assert all(r.applied for r in await merge_epoch(net.svcs, epoch))
            a, b = net.svcs
            # under churn the epoch labels run ahead of the lanes' steps (a replica relabels to a peer's
            # later epoch): the donors say which inner step their state is at, and the joiner starts there
            for s in (a, b):
                s.merging.donor.publish(s.merge.anchor, s.merge.momentum, s.merge.merged_epoch, 3)
            refresh = {s: s.view.refresh for s in (a, b)}

            async def stale_view(force=False):          # the peers' chain view predates the joiner
                return None
            for s in (a, b):
                s.view.refresh = stale_view
            joiner = await net.add()
            await asyncio.sleep(3.0)
            refused_ready = joiner.merge.in_sync
            refused_epoch = joiner.merge.merged_epoch
            for s in (a, b):
                s.view.refresh = refresh[s]
                s.view.last_refresh = 0
                await s.refresh()
            synced = await wait_for(lambda: joiner.merging.sync_task.done(), 30)
            return refused_ready, refused_epoch, synced, joiner, a
        finally:
            await net.close()
    refused_ready, refused_epoch, synced, joiner, a = asyncio.run(main())
    assert not refused_ready and refused_epoch == -1      # not ready (validators route around it) while refused
    assert synced and joiner.merging.sync_task.exception() is None
    assert joiner.merge.in_sync and joiner.merge.merged_epoch == 1
    assert torch.equal(flat(joiner), flat(a))
    assert joiner.worker.inner_step == 3        # the donors' step, not (merged epoch + 1) x H = 4


def test_restarted_replica_uses_its_merge_state_while_its_peer_is_stopped(tmp_path, tmp_home):
    """Issue 13: a restarted replica whose peer was stalled waited 2 x 30 s on it, then came up from
    the seeded initialisation although its own merge-state file held the merged weights."""
    async def main():
        net = Net(tmp_path)
        await net.start(2)
        resumed = asyncio.Event()
        try:
            a, b = net.svcs
            for k, s in enumerate(net.svcs):
                train_locally(s, k)
            assert all(r.applied for r in await merge_epoch(net.svcs, 0))
            merged = flat(a).clone()
            # b is killed (no shutdown checkpoint: its merge-state file is all it has) ...
            await b.server.stop()
            b.server = None
            assert not b.checkpoints.path.exists() and b.merging.state_path.exists()

            authorize = a.server.authorizer

            async def stopped(hotkey, route):           # ... and a is SIGSTOPped: it answers only after SIGCONT
                await resumed.wait()
                return await authorize(hotkey, route)
            a.server.authorizer = stopped
            t0 = time.monotonic()
            b2 = MinerService(net.cfg, b.wallet, net.chain, b.opts)      # b restarted
            net.svcs[1] = b2
            await asyncio.wait_for(b2.start(), 30)
            ok = await wait_for(lambda: b2.merging.sync_task.done(), 30)
            return merged, b2, ok, time.monotonic() - t0
        finally:
            resumed.set()
            await net.close()
    merged, b2, ok, wall = asyncio.run(main())
    assert ok and wall < 20, wall
    assert b2.merge.in_sync and b2.merge.merged_epoch == 0
    assert torch.equal(flat(b2), merged) and torch.equal(b2.merge.anchor, merged)


def test_a_replica_that_jumps_over_a_merge_boundary_merges_at_the_next_one_with_its_peer(tmp_path, tmp_home):
    """Issue 13 (CI, 2026-12-02): a SIGKILLed miner resumed behind its lane and jumped to the lane's step
    over a boundary whose epoch its peer had merged without it. It proposed a merge at once, labelled
    a later epoch (labels never repeat), and paused its lane 26-30 s for a peer not there yet; the
    peer's own lane then waited at its boundary for this one: no reroute, both lanes stalled."""
    async def main():
        net = Net(tmp_path)
        try:
            a, b, H = await merged_pair(net)                                         # both at step H
            history = len(b.merge.history)
            # b resumed at step H while its lane is at 2H + 3: the data plane jumps it there
            assert b.worker.skip_to(2 * H + 3) == H + 3
            b.merging.maybe_merge()
            proposed = not b.merging.task.done() or b.merge.ready_epoch != -1 or len(b.merge.history) != history
            # a reaches that boundary afterwards: b says the epoch is closed, so a does not wait for it
            a.worker.inner_step = 2 * H
            t0 = time.monotonic()
            a.merging.maybe_merge()
            await a.merging.task
            a_wall = time.monotonic() - t0
            a_report = a.merge.history[-1]
            # both train on to the next boundary: one merge, together
            nxt = ((2 * H + 3) // H + 1) * H
            for k, s in enumerate(net.svcs):
                train_locally(s, 10 + k)
                s.worker.inner_step = nxt
                s.merging.maybe_merge()
            await asyncio.gather(*(s.merging.task for s in net.svcs))
            return proposed, [s.merge.history[-1] for s in net.svcs], a, b, a_report, a_wall
        finally:
            await net.close()
    proposed, reports, a, b, a_report, a_wall = asyncio.run(main())
    assert not proposed
    assert (a_report.epoch, a_report.status) == (1, "alone") and "closed epoch 2" in a_report.reason, a_report
    assert a_wall < a.cfg.merge.join_timeout_s / 2, a_wall
    assert [r.status for r in reports] == ["merged", "merged"], [(r.epoch, r.status, r.reason, r.participants, r.wall_s) for r in reports]
    assert all(len(r.participants) == 2 for r in reports)
    assert a.merge.merged_epoch == b.merge.merged_epoch and torch.equal(flat(a), flat(b))


@pytest.mark.parametrize("at_boundary", [False, True])
def test_a_restarted_replica_whose_checkpoint_is_older_than_its_merge_resumes_the_merged_weights(
        tmp_path, tmp_home, at_boundary):
    """Issue 13 (chaos run, 2026-12-02): a replica killed at step 23 resumed its step-10 checkpoint
    beside the merged state of step 20; its catch-up found it "current" (merged epoch 3, like its
    peers), so it trained on weights 10 steps stale and its lane's loss went from 6.7 back to 8.0.
    ``at_boundary``: the checkpoint was due at the boundary step itself, taken while the lane waited
    at the merge gate, before the merge applied (same inner step as the merge state)."""
    async def main():
        net = Net(tmp_path)
        try:
            a, b, H = await merged_pair(net)                                         # both at step H
            if not at_boundary:
                await b.checkpoint(wait=True)                                        # b's checkpoint: step H
            old = flat(b).clone()
            for k, s in enumerate(net.svcs):
                train_locally(s, 10 + k)
            if at_boundary:
                b.worker.inner_step = 2 * H
                await b.checkpoint(wait=True)                                        # step 2H, before the merge
                old = flat(b).clone()
            assert all(r.applied for r in await merge_epoch(net.svcs, 1))          # merged at 2H
            merged, step = flat(b).clone(), b.worker.inner_step
            b2 = await kill_and_restart(net, b)
            return old, merged, step, b2
        finally:
            await net.close()
    old, merged, step, b2 = asyncio.run(main())
    assert b2.checkpoints.resumed and not torch.equal(old, merged)
    assert torch.equal(flat(b2), merged) and b2.worker.inner_step == step
    assert b2.merge.merged_epoch == 1


def test_a_replica_that_jumps_onto_a_merge_boundary_merges_there_with_its_peer(tmp_path, tmp_home):
    """Issue 13 (chaos run, 2026-12-02): a lane member that missed the last inner step of a window
    (its link was slowed, an alternate served the hop) jumped from step H - 1 to the boundary H and did
    not merge ("jumped ... over the merge boundary"): its peer merged alone, and at the next boundary
    it found the peer ahead and pulled, losing its work of two windows. Landing on the boundary, it
    merges with the peer, weighing in with the steps it trained."""
    async def main():
        net = Net(tmp_path)
        try:
            a, b, H = await merged_pair(net)                                         # both at step H
            for k, s in enumerate(net.svcs):
                train_locally(s, 10 + k)
            a.worker.inner_step = 2 * H
            b.worker.inner_step = 2 * H - 1
            assert b.worker.skip_to(2 * H) == 1                                     # it missed step 2H - 1
            before = [s.merging.task for s in net.svcs]
            for s in net.svcs:
                s.merging.maybe_merge()
            assert [s.merging.task is not t for s, t in zip(net.svcs, before)] == [True, True], \
                "b did not propose the merge of the boundary it landed on"
            await asyncio.gather(*(s.merging.task for s in net.svcs))
            return [s.merge.history[-1] for s in net.svcs], a, b
        finally:
            await net.close()
    reports, a, b = asyncio.run(main())
    assert [(r.epoch, r.status, len(r.participants)) for r in reports] == [(1, "merged", 2)] * 2, \
        [(r.epoch, r.status, r.reason, r.participants) for r in reports]
    assert a.merge.merged_epoch == b.merge.merged_epoch == 1 and torch.equal(flat(a), flat(b))


def test_a_checkpoint_newer_than_the_last_merge_is_resumed_not_the_older_merged_weights(tmp_path, tmp_home):
    """Chaos run (2026-12-02): every checkpoint also rewrote the merge-state file, with the inner step of
    the checkpoint as the merge's step; a replica killed after its checkpoint at step 20, whose last
    merge applied at step 5, resumed the merged weights of step 5 ("its checkpoint is older than its
    merge state") and lost 15 steps of training. The merge state names the step its merge applied at."""
    async def main():
        net = Net(tmp_path)
        try:
            a, b, H = await merged_pair(net)                                         # merged at step H
            merged = flat(b).clone()
            train_locally(b, 20)
            b.worker.inner_step = H + 3
            await b.checkpoint(wait=True)                                            # step H + 3
            trained = flat(b).clone()
            b2 = await kill_and_restart(net, b)
            return merged, trained, flat(b2).clone(), b2.worker.inner_step, b2.merge.merged_epoch, H
        finally:
            await net.close()
    merged, trained, resumed, step, epoch, H = asyncio.run(main())
    assert not torch.equal(trained, merged)
    assert torch.equal(resumed, trained), "resumed the older merged weights instead of its checkpoint"
    assert step == H + 3 and epoch == 0
