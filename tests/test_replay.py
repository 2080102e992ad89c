"""Catch-up by replay (iota_subnet.merge.replay) over the in-process merge transport (every message
through the wire codec): a replica some merges behind replays them from the donors' kept means and
ends bit-identical to its peers for about the gather's bytes per merge; a joiner that synced an older
snapshot (its donors merged on while it fetched) replays the rest; a lying donor, a missing merge or
a diverged state apply nothing."""
from __future__ import annotations

import asyncio

import pytest
import torch

from iota_subnet.config import MergeConfig, load_config
from iota_subnet.host_plan import REPLAY_MERGES
from iota_subnet.merge import MergeEngine, MergeEngineOptions, ModuleParams
from iota_subnet.merge.replay import ReplayError, replay_to_newest
from iota_subnet.merge.sync import REPLAY_KEEP, SnapshotDonor, sync_state
from iota_subnet.merge.transport import InProcessTransport
from iota_subnet.protocol import Outcome, ProtocolError, StateReplayRequest

pytestmark = pytest.mark.timeout(120)

HK = [f"5Replay{i:02d}" for i in range(4)]


def module():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))   # 3,152 values


class Node:
    """A replica: merge engine, snapshot donor (its ``/state/*`` routes) and a module it trains."""

    def __init__(self, net: InProcessTransport, i: int, cfg: MergeConfig, keep: int = REPLAY_KEEP):
        self.hk, self.i = HK[i], i
        self.mod = module()
        self.work = 0.0
        self.donor = SnapshotDonor("replay", 0, chunk_numel=512, max_concurrent=4, replay_keep=keep)
        self.engine = MergeEngine(self.hk, cfg, ModuleParams(self.mod), net.view(self.hk), run_id="replay", stage=0,
                                  options=MergeEngineOptions(work_fn=lambda: self.work, on_applied=self.applied))
        self.donor.publish(self.engine.anchor, self.engine.momentum, -1, 0)
        net.register(self.hk, self.handle)

    def applied(self, rep) -> None:
        self.donor.record(self.engine.last_applied)
        self.donor.publish(self.engine.anchor, self.engine.momentum, self.engine.merged_epoch, rep.epoch)

    async def handle(self, route, msg, caller):
        if route == "/state/chunk":
            return await self.donor.handle(msg, caller)
        if route == "/state/replay":
            return await self.donor.handle_replay(msg, caller)
        return await self.engine.handle(route, msg, caller)

    def train(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.mod.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 1e-2)
        self.work += 64


def cfg(**kw) -> MergeConfig:
    base = dict(every_steps=2, join_timeout_s=4.0, phase_timeout_s=3.0, max_attempts=2, quantization="int8",
                outer_lr=0.7, outer_momentum=0.9, chunk_numel=512)
    base.update(kw)
    return MergeConfig(**base)


def merge_all(nodes: list[Node], epoch: int) -> None:
    for n in nodes:
        n.train(100 * epoch + n.i)
    peers = [n.hk for n in nodes]

    async def run():
        return await asyncio.gather(*(n.engine.merge(epoch, peers) for n in nodes))
    reps = asyncio.run(run())
    assert [r.status for r in reps] == ["merged"] * len(nodes), [(r.status, r.reason) for r in reps]


def replay(net, peers, node, **kw):
    e = node.engine
    return asyncio.run(replay_to_newest(peers, net.view(node.hk), run_id="replay", stage=0, anchor=kw.pop("anchor", e.anchor),
                                        momentum=kw.pop("momentum", e.momentum), epoch=kw.pop("epoch", e.merged_epoch),
                                        lr=e.cfg.outer_lr, mu=e.cfg.outer_momentum, nesterov=e.cfg.nesterov,
                                        block=e.cfg.int8_block, **kw))


def test_a_replica_three_merges_behind_replays_them_bit_identical_for_the_gathers_bytes():
    net = InProcessTransport(timeout_s=5.0)
    a, b, c = (Node(net, i, cfg()) for i in range(3))
    merge_all([a, b, c], 0)
    for epoch in (1, 2, 3):                       # c is away
        merge_all([a, b], epoch)
    assert c.engine.merged_epoch == 0 and a.engine.merged_epoch == 3
    before = c.engine.anchor.clone()
    anchor, momentum, man = replay(net, [a.hk, b.hk], c)
    assert torch.equal(anchor, a.engine.anchor) and torch.equal(momentum, a.engine.momentum)
    assert torch.equal(c.engine.anchor, before)                  # nothing written in place
    P = a.engine.params.numel
    rp = man["replay"]
    assert man["merged_epoch"] == 3 and rp["merges"] == 3 and rp["from_epoch"] == 0
    # int8 values plus a float32 scale per 256: three merges' means, against 8 P for a snapshot
    chunks = len(a.donor.replay.merges[-1].chunks)          # one scale per 256 values of each chunk
    assert 3 * P * (1 + 4 / 256) <= rp["bytes"] <= 3 * (P * (1 + 4 / 256) + 4 * chunks)
    assert rp["bytes"] < 0.4 * 8 * P
    assert a.donor.status()["replay"]["epochs"] == [0, 1, 2, 3]


def test_a_joiner_that_synced_an_older_snapshot_replays_the_merges_applied_meanwhile(tmp_path):
    net = InProcessTransport(timeout_s=5.0)
    a, b = Node(net, 0, cfg()), Node(net, 1, cfg())
    merge_all([a, b], 0)
    merge_all([a, b], 1)
    fresh = Node(net, 2, cfg())

    async def sync_while_merging():
        started = asyncio.Event()
        inner = net.view(fresh.hk)

        class Slow:                                 # a slow downlink: the donors merge twice meanwhile
            chunks = 0

            async def call(self, peer, route, msg, rtype):
                if getattr(msg, "snapshot_id", ""):
                    Slow.chunks += 1
                    if Slow.chunks == 3:
                        started.set()
                await asyncio.sleep(0.02)
                return await inner.call(peer, route, msg, rtype)

        async def merges():
            await started.wait()
            for epoch in (2, 3):
                for n in (a, b):
                    n.train(100 * epoch + n.i)
                await asyncio.gather(a.engine.merge(epoch, [a.hk, b.hk]), b.engine.merge(epoch, [a.hk, b.hk]))
        got, _ = await asyncio.gather(sync_state([a.hk, b.hk], Slow(), run_id="replay", stage=0,
                                                 param_numel=a.engine.params.numel, work_dir=tmp_path, window=2),
                                      merges())
        return got
    anchor, momentum, man = asyncio.run(sync_while_merging())
    assert man["merged_epoch"] == 1 and a.engine.merged_epoch == 3      # the snapshot it started on
    assert a.donor.served_retained + b.donor.served_retained > 0
    anchor, momentum, man = replay(net, [a.hk, b.hk], fresh, anchor=anchor, momentum=momentum, epoch=1)
    assert man["merged_epoch"] == 3 and man["replay"]["merges"] == 2
    assert torch.equal(anchor, a.engine.anchor) and torch.equal(momentum, b.engine.momentum)


def test_a_lying_donor_a_missing_merge_or_a_diverged_state_apply_nothing():
    net = InProcessTransport(timeout_s=5.0)
    a, b, c = (Node(net, i, cfg(), keep=2) for i in range(3))
    merge_all([a, b, c], 0)
    merge_all([a, b], 1)
    peers = [a.hk, b.hk]
    # a diverged state (c's anchor is not the stage's epoch-0 state): the check refuses it
    with pytest.raises(ReplayError, match="does not match"):
        replay(net, peers, c, anchor=c.engine.anchor + 1e-3)
    # both donors serve altered means: the result does not match their snapshot hash
    inner = net.handlers[a.hk], net.handlers[b.hk]

    def lying(h):
        async def handle(route, msg, caller):
            r = await h(route, msg, caller)
            if route == "/state/replay" and r.mean is not None:
                r.mean = r.mean.clone()
                r.mean[0] = r.mean[0] // 2 + 1
            return r
        return handle
    net.register(a.hk, lying(inner[0]))
    net.register(b.hk, lying(inner[1]))
    with pytest.raises(ReplayError, match="does not match"):
        replay(net, peers, c)
    net.register(a.hk, inner[0])
    net.register(b.hk, inner[1])
    # honest again: the same replay works
    anchor, momentum, _ = replay(net, peers, c)
    assert torch.equal(anchor, a.engine.anchor)
    # donors keep 2 merges: 3 behind is a snapshot's job
    merge_all([a, b], 2)
    merge_all([a, b], 3)
    with pytest.raises(ReplayError, match="no peer keeps the merges after epoch 0"):
        replay(net, peers, c)


def test_the_host_plan_counts_the_kept_merges_and_a_replaced_snapshot():
    assert REPLAY_MERGES == REPLAY_KEEP
    from iota_subnet.plan import plan_stage
    c8 = load_config("configs/8b.yaml")
    p = plan_stage(c8, 0, 80 << 30)
    P = p.params
    gq = c8.merge.gather_quant
    bpv = {"none": 4.0, "bf16": 2.0}.get(gq, 1 + 4 / c8.merge.int8_block)
    assert p.host["sync_donor_bytes"] == 8 * P + int(REPLAY_MERGES * bpv * P)
    assert p.host["peak_bytes"] <= 96e9


def test_a_bad_replay_request_is_refused_with_its_reason():
    net = InProcessTransport(timeout_s=5.0)
    a, b = Node(net, 0, cfg()), Node(net, 1, cfg())
    merge_all([a, b], 0)

    def ask(**kw):
        return asyncio.run(a.donor.handle_replay(StateReplayRequest(run_id="replay", stage=0, **kw)))
    with pytest.raises(ProtocolError) as e:
        ask(epoch=7, chunk=0)
    assert e.value.outcome == Outcome.LATE and "not kept" in str(e.value)
    with pytest.raises(ProtocolError) as e:
        ask(epoch=0, chunk=10 ** 6)
    assert e.value.outcome == Outcome.BAD_SHAPE
    assert ask(epoch=0, chunk=0).mean is not None and a.donor.replay.active == 0
