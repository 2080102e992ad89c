"""Merging real MinerService replicas over signed HTTP on 127.0.0.1 (devnet chain): bit-identical
weights, a tampering reducer caught, a replica dying mid-merge, LATE refusals, and a joiner syncing
from several donors (one of which dies mid-transfer) then answering like its peers."""
from __future__ import annotations

import asyncio

import pytest
import torch

from iota_subnet.chain import add_stake, create_devnet, open_chain
from iota_subnet.config import load_config
from iota_subnet.merge import outer_step
from iota_subnet.miner.service import MinerService
from iota_subnet.protocol import (Forward, ForwardResult, Health, MergeEvidence, MergePayload, MergeAck, Outcome,
                                  ProtocolError,
                                  StateChunk, StateChunkRequest)
from iota_subnet.transport import NeuronClient
from iota_subnet.wallets import create_wallet

pytestmark = pytest.mark.timeout(120)

RUN = "merge-run"
OVR = {"model": {"name": "tiny", "dim": 64, "n_layers": 3, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128,
                 "vocab_size": 256},
       "data": {"seq_len": 16, "vocab_size": 256},
       "pipeline": {"stages": 3, "compression_ratio": 4},
       "train": {"batch_size": 4, "micro_batch_size": 2},
       "merge": {"every_steps": 2, "join_timeout_s": 3.0, "phase_timeout_s": 3.0, "max_attempts": 2,
                 "outer_lr": 0.7, "outer_momentum": 0.9,
                 "sync_chunk_numel": 4096, "max_concurrent_transfers": 1}}


def flat(svc):
    return torch.cat([p.detach().reshape(-1) for p in svc.worker.module.parameters()])


class Net:
    def __init__(self, tmp, stage=1, ovr=OVR):
        self.tmp, self.stage = tmp, stage
        self.db = tmp / "chain.db"
        create_devnet(self.db, 9, tempo=50, block_time=0.5, weights_rate_limit=1, max_validators=1)
        self.cfg = load_config("configs/tiny.yaml", ovr)
        self.svcs: list[MinerService] = []

    async def start(self, n, adversary_last=None):
        self.chain = await open_chain("devnet", self.db)
        self.val = create_wallet("val", "default", self.tmp / "wallets")
        await self.chain.register(self.val, 9)
        add_stake(self.db, self.val.hotkey.ss58_address, self.val.coldkey.ss58_address, 100.0)
        for i in range(n):
            await self.add(adversary_last if i == n - 1 else None)

    async def add(self, adversary=None):
        i = len(self.svcs)
        w = create_wallet(f"m{i}", "default", self.tmp / "wallets")
        await self.chain.register(w, 9)
        svc = MinerService(self.cfg, w, self.chain, netuid=9, run_id=RUN, stage=self.stage, out_dir=self.tmp / f"m{i}",
                           host="127.0.0.1", external_ip="127.0.0.1", adversary=adversary, allow_data_fallback=True)
        await svc.start()
        self.svcs.append(svc)
        for s in self.svcs:
            await s.refresh(force=True) if s is svc else None
            s._last_refresh = 0
            await s.refresh()
        return svc

    async def close(self):
        for s in self.svcs:
            try:
                await s.stop()
            except Exception:  # noqa: BLE001 - already stopped
                pass
        await self.chain.close()


def train_locally(svc, k):
    """Stand-in for inner steps on different data: move every replica's weights differently (and
    count the tokens such steps would have trained: a replica weighs in a merge by its work)."""
    svc.worker.trained_tokens += 64
    g = torch.Generator().manual_seed(10 + k)
    with torch.no_grad():
        for p in svc.worker.module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 1e-3)


async def merge_epoch(svcs, epoch):
    """Merge ``epoch`` on every replica, as at the inner step that closes it ((epoch + 1) x H)."""
    for s in svcs:
        s.worker.inner_step = max(s.worker.inner_step, (epoch + 1) * s.cfg.merge.every_steps)
        s._start_merge(epoch)
    await asyncio.gather(*(s._merge_task for s in svcs))
    return [s.merge.history[-1] for s in svcs]


def test_merge_over_http_identical_tamper_kill_late(tmp_path, tmp_home):
    async def main():
        net = Net(tmp_path)
        await net.start(3)
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
                s._start_merge(2)
            await asyncio.gather(a._merge_task, b._merge_task)
            ra, rb = a.merge.history[-1], b.merge.history[-1]
            assert ra.applied and rb.applied and c.hotkey in ra.missing
            assert torch.equal(flat(a), flat(b))
            assert not torch.equal(flat(a), before_c) and c.merge.merged_epoch == 1    # nothing half-applied
            c._merge_task.cancel()
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
            orig = d1.donor.handle
            served = []

            async def dying(msg, caller="", **kw):
                r = await orig(msg, caller, **kw)
                if msg.snapshot_id:
                    served.append(1)
                    if len(served) == 1:
                        asyncio.get_running_loop().call_soon(lambda: asyncio.ensure_future(d1.server.stop()))
                return r
            d1.donor.handle = dying
            joiner = await net.add()
            for s in net.svcs:
                s._last_refresh = 0
                await s.refresh()
            # the joiner is not ready (validators do not route to it) until it has synced
            for _ in range(100):
                if joiner._sync_task.done():
                    break
                await asyncio.sleep(0.1)
            assert joiner._sync_task.done() and joiner._sync_task.exception() is None
            assert joiner.merge.in_sync and joiner.merge.merged_epoch == 0
            assert torch.equal(flat(joiner), flat(d0))
            assert joiner.worker.inner_step == 2                      # the step at which epoch 0 closed
            assert served, "the dying donor never served"
            # same outputs as its peers
            x = torch.randn(2, 16, 16)
            async with NeuronClient(net.val) as cl:
                outs = []
                for s in (d0, d2, joiner):
                    r = await cl.call(s.server.endpoint, s.hotkey, "/forward", Forward(
                        run_id=RUN, stage=1, microbatch_id="eval", activations=x, keep_for_backward=False),
                        ForwardResult, retries=0)
                    outs.append(r.activations)
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
                s._last_refresh = 0
                await s.refresh(force=True)
            w = weights_from_commitments(a._commitments, a._neurons, RUN, 1, [s.hotkey for s in net.svcs])
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
