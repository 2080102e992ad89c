"""Merging real MinerService replicas over signed HTTP on 127.0.0.1 (devnet chain): bit-identical
weights, a tampering reducer caught, a replica dying mid-merge, LATE refusals, and a joiner syncing
from several donors (one of which dies mid-transfer) then answering like its peers."""
from __future__ import annotations

import asyncio

import pytest
import torch

from iota_subnet.merge import outer_step
from iota_subnet.protocol import (Health, MergeEvidence, MergePayload, MergeAck, Outcome,
                                  ProtocolError,
                                  StateChunk, StateChunkRequest)
from iota_subnet.miner.parts import MinerParts
from iota_subnet.sim.adversary import TamperingMergeEngine
from iota_subnet.transport import NeuronClient
from support.merge_net import OVR, RUN, Net, flat, merge_epoch, train_locally  # noqa: F401

pytestmark = pytest.mark.timeout(120)


def test_merge_over_http_identical_tamper_kill_late(tmp_path, tmp_home):
    async def main():
        net = Net(tmp_path)
        # b's merge engine can be made to serve tampered means (set and cleared below)
        await net.start(3, parts={1: MinerParts(make_merge_engine=TamperingMergeEngine)})
        try:
            a, b, c = net.svcs
            assert all(s.merge.in_sync for s in net.svcs) or await asyncio.sleep(0.5) is None
            anchor = a.merge.anchor.clone()
            assert all(torch.equal(anchor, s.merge.anchor) for s in net.svcs)   # same seeded init
            for k, s in enumerate(net.svcs):
                train_locally(s, k)
            mean = sum(anchor - flat(s) for s in net.svcs) / 3
            ref, _ = outer_step(anchor, torch.zeros_like(anchor), mean, lr=0.7, mu=0.9)
            reps = await merge_epoch(net.svcs, 0)
            assert all(r.status == "merged" for r in reps), [(r.status, r.reason) for r in reps]
            ws = [flat(s) for s in net.svcs]
            assert all(torch.equal(ws[0], w) for w in ws[1:])                  # bit-identical after the merge
            assert torch.allclose(ws[0], ref, atol=1e-6)
            assert all(r.bytes_sent > 0 and r.bytes_received > 0 for r in reps)
            assert (tmp_path / "m0" / "stage1.merge.safetensors").exists()

            # a late contribution for epoch 0: typed, non-fatal 410 LATE
            async with NeuronClient(a.wallet) as cl:
                with pytest.raises(ProtocolError) as ei:
                    await cl.call(b.server.endpoint, b.hotkey, "/merge/contribute", MergePayload(
                        run_id=RUN, stage=1, epoch=0, plan_id="p", total_numel=a.merge.params.numel,
                        shard=torch.zeros(8)), MergeAck, retries=0)
                assert ei.value.outcome == Outcome.LATE and ei.value.status == 410
                # the validator may not take part in merges
            async with NeuronClient(net.val) as cl:
                with pytest.raises(ProtocolError) as ei:
                    await cl.call(b.server.endpoint, b.hotkey, "/state/chunk", StateChunkRequest(run_id=RUN, stage=1),
                                  StateChunk, retries=0)
                assert ei.value.outcome == Outcome.FORBIDDEN
            assert (await NeuronClient(net.val).call(b.server.endpoint, b.hotkey, "/health",
                                                     Health(run_id=RUN, stage=1), Health, retries=0)).ready

            # a reducer that publishes tampered means: detected, evidence names it, merge still correct
            b.merge.tamper = lambda s, m: m * 1.5
            for k, s in enumerate(net.svcs):
                train_locally(s, 10 + k)
            anchor1, mom1 = a.merge.anchor.clone(), a.merge.momentum.clone()
            mean = sum(anchor1 - flat(s) for s in net.svcs) / 3
            ref, _ = outer_step(anchor1, mom1, mean, lr=0.7, mu=0.9)
            reps = await merge_epoch(net.svcs, 1)
            b.merge.tamper = None
            assert all(r.applied for r in reps)
            for s in (a, c):
                assert torch.allclose(flat(s), ref, atol=1e-6)
            assert torch.equal(flat(a), flat(c)) and torch.equal(flat(a), flat(b))
            evidence = [ev for s in (a, c) for ev in s.merge.reports]
            assert evidence and all(ev["wrong"] == [b.hotkey] for ev in evidence)
            from iota_subnet.validator.merge_weights import penalised_from_evidence
            assert penalised_from_evidence(evidence) == {b.hotkey}
            assert a.status()["merge"]["mismatch_evidence"]

            # a replica killed mid-merge (after joining): the others exclude it and stay consistent
            before_c = flat(c).clone()

            async def die(plan, rep):
                await c.server.stop()
                c.server = None
                await asyncio.sleep(10)
            c.merge._allreduce = die
            for k, s in enumerate(net.svcs):
                train_locally(s, 20 + k)
            for s in (a, b, c):
                s.merging.start_merge(2)
            await asyncio.gather(a.merging.task, b.merging.task)
            ra, rb = a.merge.history[-1], b.merge.history[-1]
            assert ra.applied and rb.applied and c.hotkey in ra.missing
            assert torch.equal(flat(a), flat(b))
            assert not torch.equal(flat(a), before_c) and c.merge.merged_epoch == 1    # nothing half-applied
            c.merging.task.cancel()
        finally:
            await net.close()
    asyncio.run(main())


def test_joiner_syncs_from_peers_despite_dying_donor(tmp_path, tmp_home):
    async def main():
        net = Net(tmp_path)
        await net.start(3)
        try:
            for k, s in enumerate(net.svcs):
                train_locally(s, k)
            reps = await merge_epoch(net.svcs, 0)
            assert all(r.applied for r in reps)
            d0, d1, d2 = net.svcs
            # donor d1 dies after serving its first chunk
            orig = d1.merging.donor.handle
            served = []

            async def dying(msg, caller="", **kw):
                r = await orig(msg, caller, **kw)
                if msg.snapshot_id:
                    served.append(1)
                    if len(served) == 1:
                        asyncio.get_running_loop().call_soon(lambda: asyncio.ensure_future(d1.server.stop()))
                return r
            d1.merging.donor.handle = dying
            joiner = await net.add()
            for s in net.svcs:
                s.view.last_refresh = 0
                await s.refresh()
            # the joiner is not ready (validators do not route to it) until it has synced
            for _ in range(100):
                if joiner.merging.sync_task.done():
                    break
                await asyncio.sleep(0.1)
            assert joiner.merging.sync_task.done() and joiner.merging.sync_task.exception() is None
            assert joiner.merge.in_sync and joiner.merge.merged_epoch == 0
            assert torch.equal(flat(joiner), flat(d0))
            assert joiner.worker.inner_step == 2                      # the step at which epoch 0 closed
            assert served, "the dying donor never served"
            # same outputs as its peers (an evaluation forward on each one's compute thread)
            x = torch.randn(2, 16, 16)
            outs = [(await s.compute.run(s.worker.forward, "eval", x, train=False))["activations"]
                    for s in (d0, d2, joiner)]
            assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[2])
        finally:
            await net.close()
    asyncio.run(main())


def test_merge_of_a_stage_larger_than_an_activation_body(tmp_path, tmp_home):
    """Stage 0 with a 16k-token embedding: each replica's slice (~2 MB) is larger than the body limit
    of an activation route (~1.2 MB); the merge routes have their own limit, so the merge completes."""
    ovr = {**OVR, "model": {**OVR["model"], "vocab_size": 16384}, "data": {"seq_len": 16, "vocab_size": 16384}}

    async def main():
        net = Net(tmp_path, stage=0, ovr=ovr)
        await net.start(2)
        try:
            a, b = net.svcs
            P = a.merge.params.numel
            assert 4 * P // 2 > a.server.max_body_bytes          # a slice would not fit an activation body
            for k, s in enumerate(net.svcs):
                train_locally(s, k)
            reps = await merge_epoch(net.svcs, 0)
            assert all(r.status == "merged" for r in reps), [(r.status, r.reason) for r in reps]
            assert torch.equal(flat(a), flat(b))
            assert all(r.bytes_sent >= 4 * P // 2 for r in reps)
        finally:
            await net.close()
    asyncio.run(main())


def test_poisoning_reducer_caught_and_excluded(tmp_path, tmp_home):
    """``--adversary poison`` (a reducer serving poisoned means): the honest replicas still merge
    correctly, both report it with evidence, the validator's MergeOversight (over signed HTTP)
    penalises only it after checking the accusation itself, publishes merge weight 0 for it, and the
    next merge runs without it."""
    from iota_subnet.protocol import MergeAuditResponse
    from iota_subnet.validator.merge_audit import MergeAuditor
    from iota_subnet.validator.merge_weights import MergeOversight, weights_from_commitments
    from iota_subnet.validator.routing import Replica

    async def main():
        net = Net(tmp_path)
        await net.start(3, adversary_last="poison")
        try:
            a, b, p = net.svcs
            anchor = a.merge.anchor.clone()
            for k, s in enumerate(net.svcs):
                train_locally(s, k)
            mean = sum(anchor - flat(s) for s in net.svcs) / 3
            ref, _ = outer_step(anchor, torch.zeros_like(anchor), mean, lr=0.7, mu=0.9)
            reps = await merge_epoch(net.svcs, 0)
            assert all(r.applied for r in reps), [(r.status, r.reason) for r in reps]
            for s in (a, b):                                   # honest replicas: correct despite the poison
                assert torch.allclose(flat(s), ref, atol=1e-6)
            assert torch.equal(flat(a), flat(b))

            mo = MergeOversight(RUN)
            reps_ = [Replica(s.uid, s.hotkey, s.server.endpoint, 1) for s in net.svcs]
            eps = {s.hotkey: s.server.endpoint for s in net.svcs}
            async with NeuronClient(net.val) as cl:
                assert await mo.collect(cl, reps_) > 0

                async def fetch(hk, req):
                    return await cl.call(eps[hk], hk, "/audit/merge", req, MergeAuditResponse, retries=0)
                verdicts = await mo.verify(MergeAuditor(RUN, lambda stage: a.merge.params.numel), fetch)
            assert verdicts and {hk for v in verdicts for hk in v.penalise} == {p.hotkey}, verdicts
            assert all(v.outcome == "upheld" and "wrong merge result" in v.penalise[p.hotkey] for v in verdicts)
            # a miner may not read evidence (validators only)
            async with NeuronClient(a.wallet) as cl:
                with pytest.raises(ProtocolError) as ei:
                    await cl.call(b.server.endpoint, b.hotkey, "/evidence", MergeEvidence(run_id=RUN, stage=1),
                                  MergeEvidence, retries=0)
                assert ei.value.outcome == Outcome.FORBIDDEN
            # merge weights: the poisoner 0, published on chain; the replicas read it
            raw = mo.commitment([s.uid for s in net.svcs], cheaters={p.uid})
            assert raw is not None and mo.commitment([s.uid for s in net.svcs], cheaters={p.uid}) is None
            await net.chain.publish(net.val, 9, raw)
            for s in net.svcs:
                s.view.last_refresh = 0
                await s.refresh(force=True)
            w = weights_from_commitments(a.view.commitments, a.view.neurons, RUN, 1, [s.hotkey for s in net.svcs])
            assert w == {a.hotkey: 1.0, b.hotkey: 1.0, p.hotkey: 0.0}
            for k, s in enumerate(net.svcs):
                train_locally(s, 10 + k)
            reps = await merge_epoch(net.svcs, 1)
            assert reps[0].applied and reps[1].applied and reps[0].participants == sorted([a.hotkey, b.hotkey])
            assert reps[2].status == "abandoned" and "weight 0" in reps[2].reason
            assert not reps[0].mismatches and not reps[1].mismatches
        finally:
            await net.close()
    asyncio.run(main())


def test_status_names_the_chunks_no_donor_has(tmp_path, tmp_home):
    """A state sync that cannot get some chunks from any donor logged which; the miner's status.json
    only showed it out of sync. merge.sync in status.json names them (and says when the sync is done)."""
    import json

    async def main():
        net = Net(tmp_path)
        await net.start(2)
        try:
            a, b = net.svcs
            cn = a.merging.donor.chunk_numel
            real = a.merging.donor.handle

            async def refusing(msg, caller="", on_sent=None):
                if msg.snapshot_id and msg.offset // cn in (1, 3):
                    raise ProtocolError(Outcome.BUSY, "chunk not available")
                return await real(msg, caller, on_sent)
            a.merging.donor.handle = refusing
            task = asyncio.create_task(b.merging.pull_merged_state())
            st = {}
            for _ in range(100):
                await asyncio.sleep(0.1)
                st = json.loads((tmp_path / "m1" / "status.json").read_text())
                if (st["merge"].get("sync") or {}).get("missing_chunks"):
                    break
            sync = st["merge"]["sync"]
            assert sync["missing_chunks"] == [1, 3] and sync["state"] == "syncing", sync
            a.merging.donor.handle = real                         # the donor can serve them again: the next try syncs
            assert await asyncio.wait_for(task, 30)
            assert b.status()["merge"]["sync"]["state"] == "synced"
            assert b.status()["merge"]["sync"]["missing_chunks"] == []
        finally:
            await net.close()
    asyncio.run(main())
