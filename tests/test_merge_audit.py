"""Merge evidence verified, not counted, with real MinerService replicas over
signed HTTP on 127.0.0.1 (devnet chain), as in tests/test_merge_http.py.

* ``accuse``: two colluding replicas file matching forged evidence against an honest reducer. The
  old rule (two reporters suffice) would zero the honest reducer; the validator's own check
  (``/audit/merge``: the participants' signed slices and the reducer's signed mean, chunk by chunk
  with Merkle proofs) clears it and flags the two accusers.
* ``poison`` stays caught: the honest reporters' accusation is upheld, they are not penalised.
* Audits are never blocked by a running merge: ``/audit/update`` and ``/audit/merge`` answer while
  the merge gate is closed and the worker's lock is held (a validator's ``/state`` used to wait 30 s).
"""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from iota_subnet.merge.claims import (CONTRIBUTION, RESULT, MergeClaims, chunk_tree, co_result, co_signature, contributions_root,
                                      result_from_wire,
                                      sign_claim, statement, verify_claim, wire_contribution)
from iota_subnet.merge.plan import MergePlan
from iota_subnet.protocol import (MERGE_AUDIT_KEEP_EPOCHS, MergeAuditRequest, MergeAuditResponse, MergePayload, MergeResult, Outcome,
                                  ProtocolError, tensor_sha256)
from iota_subnet.transport import NeuronClient
from iota_subnet.validator.audit_policy import AuditPolicy
from iota_subnet.validator.merge_audit import MergeAuditor, record_verdicts
from iota_subnet.validator.merge_weights import MergeOversight, penalised_from_evidence
from iota_subnet.validator.routing import Replica
from iota_subnet.validator.scoring import Ledger, Scoreboard
from iota_subnet.validator.update_audit import UpdateAuditor
from support.merge_net import OVR, RUN, Net, merge_epoch, train_locally

pytestmark = pytest.mark.timeout(180)


def test_claims_sign_verify_and_incoming_checks():
    from bittensor.sp_core import Keypair
    a, b = Keypair.create_from_uri("//Alice"), Keypair.create_from_uri("//Bob")
    c = sign_claim({"t": CONTRIBUTION, "x": 1}, a)
    assert verify_claim(c, a.ss58_address, CONTRIBUTION)
    assert not verify_claim(c, b.ss58_address, CONTRIBUTION)            # another signer
    assert not verify_claim({**c, "x": 2}, a.ss58_address, CONTRIBUTION)  # altered after signing
    assert not verify_claim({**c, "sig": "zz"}, a.ss58_address, CONTRIBUTION)
    assert statement(c) == statement({k: v for k, v in c.items() if k != "sig"})
    # a reducer refuses a slice whose claim is missing, foreign, for other coordinates or another slice
    # (claims travel as their signature: the receiver rebuilds the statement from the slice it got)
    mine = MergeClaims(b, "r", 1, chunk=4)
    x = torch.arange(10, dtype=torch.float32)
    ok = sign_claim({"t": CONTRIBUTION, "run": "r", "stage": 1, "epoch": 0, "attempt": 0, "plan_id": "p", "shard": 0,
                     "offset": 0, "numel": 10, "sha256": tensor_sha256(x), "root": chunk_tree(x, 4).root.hex()}, a)
    msg = MergePayload(run_id="r", stage=1, epoch=0, attempt=0, plan_id="p", shard_index=0, offset=0, total_numel=10,
                       shard=x, info={"claim": wire_contribution(ok, whole=True)})
    assert set(msg.info["claim"]) == {"sig"}
    mine.on_contribution_in(a.ss58_address, msg, x)
    assert mine.received[(0, 0, "p", 0)][a.ss58_address] == ok          # the full signed claim, for audits
    for bad in ({}, {"claim": {}}, {"claim": {"sig": "zz"}}, {"claim": ok},
                {"claim": wire_contribution(sign_claim(dict(ok, by=None), b), whole=True)},
                {"claim": wire_contribution(sign_claim({**ok, "epoch": 1}, a), whole=True)},
                {"claim": wire_contribution(sign_claim({**ok, "sha256": "00" * 32}, a), whole=True)},
                {"claim": wire_contribution(sign_claim({**ok, "sha256": "00" * 32}, a), whole=False)}):
        with pytest.raises(ProtocolError) as ei:
            mine.on_contribution_in(a.ss58_address, MergePayload(**{**msg.__dict__, "info": bad}), x)
        assert ei.value.outcome == Outcome.FORBIDDEN
    # replayed onto another shard or epoch, or with other values: the rebuilt statement is not the signed one
    for kw, vals in (({"shard_index": 1}, x), ({"epoch": 2}, x), ({"plan_id": "q"}, x), ({}, x + 1)):
        with pytest.raises(ProtocolError) as ei:
            mine.on_contribution_in(a.ss58_address, MergePayload(**{**msg.__dict__, **kw, "shard": vals}), vals)
        assert ei.value.outcome == Outcome.FORBIDDEN
    # a chunk of a slice streamed in parts carries the slice's bounds and hashes with the signature
    part = MergePayload(**{**msg.__dict__, "shard": x[:4], "num_chunks": 3, "info": {"claim": wire_contribution(ok, whole=False)}})
    mine.on_contribution_in(a.ss58_address, part, x[:4])
    with pytest.raises(ProtocolError):               # ... and a chunk outside them is refused
        mine.on_contribution_in(a.ss58_address, MergePayload(**{**part.__dict__, "offset": 8}), torch.zeros(4))


def test_result_claims_travel_as_signatures_and_co_signatures_verify():
    """A result claim travels as its signature and two roots; the gatherer rebuilds the statement from the
    result and the plan. A co-reducer's signature rides with the result only when it signed the same."""
    from bittensor.sp_core import Keypair
    keys = [Keypair.create_from_uri(f"//r{i}") for i in range(3)]
    hks = [k.ss58_address for k in keys]
    plan = MergePlan.make(0, 0, b"s" * 32, hks, 30)
    s = 0
    off, n = plan.bounds[s]
    served = torch.arange(n, dtype=torch.float32)
    res = {}
    for k in keys[:2]:
        r = MergeResult(run_id="r", stage=1, epoch=0, attempt=0, plan_id=plan.plan_id, shard_index=s, status="ok",
                        contributions_root=contributions_root(list(plan.participants), [1.0] * 3, ["cd" * 32] * 3),
                        mean_sha256=tensor_sha256(served))
        MergeClaims(k, "r", 1).on_result(r, served, off, plan.chunk_numel, contributors=list(plan.participants),
                                         weights=[1.0] * 3, contribution_sha256=["cd" * 32] * 3)
        assert set(r.info["claim"]) == {"sig", "claims_root", "mean_root"}
        full = result_from_wire(r, k.ss58_address, plan)
        assert verify_claim(full, k.ss58_address, RESULT) and (full["offset"], full["numel"], full["n"]) == (off, n, 3)
        res[k.ss58_address] = r
    a, b = hks[:2]
    sig = co_signature(res[a], res[b], b, plan)
    assert sig is not None
    carried = MergeResult(**{**res[a].__dict__, "info": {**res[a].info, "co": sig}})
    got = co_result(carried, b, plan)
    assert got is not None and verify_claim(result_from_wire(got, b, plan), b, RESULT)
    assert co_result(carried, hks[2], plan) is None                      # not that replica's signature
    assert co_result(MergeResult(**{**carried.__dict__, "mean_sha256": "ee" * 32}), b, plan) is None   # other mean
    other = MergeResult(**{**res[b].__dict__, "mean_sha256": "ee" * 32})
    assert co_signature(res[a], other, b, plan) is None                  # disagrees: no co-signature
    assert result_from_wire(MergeResult(**{**res[a].__dict__, "plan_id": "x"}), a, plan) is None


async def _verify(net, mo: MergeOversight, collect: bool = True):
    """The validator's merge round, as the validator's MergeRounds.round runs it (``collect=False``: only
    the reports ``mo`` already holds)."""
    reps = [Replica(s.uid, s.hotkey, s.server.endpoint, s.stage) for s in net.svcs]
    eps = {s.hotkey: s.server.endpoint for s in net.svcs}
    numel = net.svcs[0].merge.params.numel
    async with NeuronClient(net.val) as cl:
        if collect:
            await mo.collect(cl, reps)

        async def fetch(hk, req):
            return await cl.call(eps[hk], hk, "/audit/merge", req, MergeAuditResponse, retries=0, timeout_s=20)
        auditor = MergeAuditor(RUN, lambda stage: numel, sample_chunks=2, gather_quant=net.cfg.merge.gather_quant,
                               int8_block=net.cfg.merge.int8_block)
        verdicts = await mo.verify(auditor, fetch, limit=20)
        bytes_ = cl.bytes_sent + cl.bytes_received
    return verdicts, bytes_


def _scores(net, policy):
    led = Ledger([1.0])
    for s in net.svcs:
        led.record(s.uid, s.hotkey, 0).work = 100.0            # equal verified work
    board = Scoreboard()
    board.update(led, policy.quality())
    return board.weights([1.0], {s.uid: s.hotkey for s in net.svcs})


def _ovr(quant: str) -> dict:
    """The merge nets' config with ``merge.quantization`` (the gather follows it: ``same``)."""
    return {**OVR, "merge": {**OVR["merge"], "quantization": quant}}


async def _accusers_net(tmp_path, quant: str = "none"):
    """One honest replica and two colluding accusers (``accuse``) of one stage."""
    net = Net(tmp_path, ovr=_ovr(quant))
    await net.start(1)
    x = await net.add("accuse")
    y = await net.add("accuse")
    x.merge.accuser.accomplices |= {y.hotkey}
    y.merge.accuser.accomplices |= {x.hotkey}
    return net, net.svcs[0], x, y


@pytest.mark.parametrize("quant", ["none", "int8", "topk"])
def test_forged_accusations_are_checked_and_the_accusers_penalised(tmp_path, tmp_home, quant):
    """With ``int8`` the honest reducer's mean is rounded to the int8 gather: the validator's check
    allows that rounding (and only that) and still clears it."""
    async def main():
        net, honest, x, y = await _accusers_net(tmp_path, quant)
        try:
            for k, s in enumerate(net.svcs):
                train_locally(s, k)
            reps = await merge_epoch(net.svcs, 0)
            assert all(r.applied for r in reps), [(r.status, r.reason) for r in reps]
            assert len(x.merge.accuser.forged) == 1 and len(y.merge.accuser.forged) == 1
            fx, fy = x.merge.accuser.forged[0], y.merge.accuser.forged[0]
            assert fx["wrong"] == fy["wrong"] == [honest.hotkey]                  # matching forged evidence
            assert fx["recomputed_sha256"] == fy["recomputed_sha256"]
            # the old rule (two reporters) would have penalised the honest reducer
            assert penalised_from_evidence([fx, fy], min_reporters=2) == {honest.hotkey}
            mo = MergeOversight(RUN)
            verdicts, nbytes = await _verify(net, mo)
            assert sorted(v.outcome for v in verdicts) == ["false", "false"], [(v.outcome, v.detail) for v in verdicts]
            assert {hk for v in verdicts for hk in v.penalise} == {x.hotkey, y.hotkey}
            assert all(v.chunks_checked > 0 and 0 < v.bytes < 2_000_000 for v in verdicts)
            policy = AuditPolicy()
            record_verdicts(policy, verdicts, {s.hotkey: (s.uid, s.stage) for s in net.svcs})
            assert {k[1] for k in policy.flagged()} == {x.hotkey, y.hotkey}
            w = _scores(net, policy)
            assert w == {honest.uid: pytest.approx(1.0)}                          # the honest reducer keeps its weight
            assert mo.accusations() == []                                        # decided, not retried
            # a report that misquotes or drops the accused's signed claim is false at once
            bogus = {**fx, "reporter": y.hotkey, "claimed_sha256": {honest.hotkey: "00" * 32}}
            v = await MergeAuditor(RUN, lambda s: 1).verify(bogus, honest.hotkey, None)
            assert v.outcome == "false" and "misquotes" in v.detail
            v = await MergeAuditor(RUN, lambda s: 1).verify({**fx, "results": {}}, honest.hotkey, None)
            assert v.outcome == "false" and "no result claim" in v.detail
        finally:
            await net.close()
    asyncio.run(main())


@pytest.mark.parametrize("quant", ["none", "int8", "topk"])
def test_poisoning_reducer_accusation_upheld(tmp_path, tmp_home, quant):
    async def main():
        net = Net(tmp_path, ovr=_ovr(quant))
        await net.start(3, adversary_last="poison")
        try:
            a, b, p = net.svcs
            for k, s in enumerate(net.svcs):
                train_locally(s, k)
            reps = await merge_epoch(net.svcs, 0)
            assert all(r.applied for r in reps)
            mo = MergeOversight(RUN)
            verdicts, _ = await _verify(net, mo)
            assert verdicts and all(v.outcome == "upheld" and v.accused == p.hotkey for v in verdicts), \
                [(v.outcome, v.accused[:8], v.detail) for v in verdicts]
            assert {hk for v in verdicts for hk in v.penalise} == {p.hotkey}
            policy = AuditPolicy()
            record_verdicts(policy, verdicts, {s.hotkey: (s.uid, s.stage) for s in net.svcs})
            assert {k[1] for k in policy.flagged()} == {p.hotkey}
            assert mo.proven_wrong == {p.hotkey} and mo.accusations() == []       # the rest are moot
            w = _scores(net, policy)
            assert set(w) == {a.uid, b.uid} and sum(w.values()) == pytest.approx(1.0)
            # the poisoner's signed claim describes what it served: a validator's own chunk check shows it
            ev = next(e for s in (a, b) for e in s.merge.reports)
            claim = ev["results"][p.hotkey]["claim"]
            assert verify_claim(claim, p.hotkey, RESULT)
        finally:
            await net.close()
    asyncio.run(main())


def test_accusations_outside_the_kept_epochs_expire(tmp_path, tmp_home):
    """A validator's backlog is not the replicas' fault: once the stage is MERGE_AUDIT_KEEP_EPOCHS
    epochs past a report, the participants' LATE refusals about it are not counted (the accusation
    ends ``expired``, nobody's audit record changes); a newer one is still decided."""
    async def main():
        net, honest, x, y = await _accusers_net(tmp_path)
        try:
            for epoch in range(MERGE_AUDIT_KEEP_EPOCHS + 1):
                for k, s in enumerate(net.svcs):
                    train_locally(s, k + 3 * epoch)
                await merge_epoch(net.svcs, epoch)
            assert honest.merge.merged_epoch == MERGE_AUDIT_KEEP_EPOCHS
            mo = MergeOversight(RUN)
            reps = [Replica(s.uid, s.hotkey, s.server.endpoint, s.stage) for s in net.svcs]
            async with NeuronClient(net.val) as cl:
                await mo.collect(cl, reps)
            assert mo.stage_epoch(honest.stage) == MERGE_AUDIT_KEEP_EPOCHS
            reports = dict(mo.reports)
            mo.reports = {k: ev for k, ev in reports.items() if ev["epoch"] == 0}     # the backlog only
            assert mo.reports and all(honest.hotkey in ev["wrong"] for ev in mo.reports.values())
            verdicts, _ = await _verify(net, mo, collect=False)
            assert verdicts and all(v.outcome == "expired" and not v.silent and not v.penalise for v in verdicts), \
                [(v.outcome, v.detail, v.silent) for v in verdicts]
            policy = AuditPolicy()
            record_verdicts(policy, verdicts, {s.hotkey: (s.uid, s.stage) for s in net.svcs})
            assert policy.flagged() == set() and mo.accusations() == []        # not counted, not retried
            # the newest forged accusation is still checked: the accusers are the ones penalised
            mo.reports = {k: ev for k, ev in reports.items() if ev["epoch"] == MERGE_AUDIT_KEEP_EPOCHS}
            verdicts, _ = await _verify(net, mo, collect=False)
            assert verdicts and all(v.outcome == "false" for v in verdicts), [(v.outcome, v.detail) for v in verdicts]
        finally:
            await net.close()
    asyncio.run(main())


def test_audits_answer_while_a_merge_runs(tmp_path, tmp_home):
    """Tried: a validator's /state request to a replica running a merge waited the full 30 s. The
    audit routes answer from stored copies: merge gate closed and worker lock held, they still answer."""
    async def main():
        net = Net(tmp_path, audit_window=2)       # its miners keep update audits
        await net.start(2)
        a, b = net.svcs
        try:
            for k, s in enumerate(net.svcs):
                train_locally(s, k)
            reps = await merge_epoch(net.svcs, 0)
            assert all(r.applied for r in reps)
            # a few real inner steps on a (its update store commits them)
            w = a.worker
            g = torch.Generator().manual_seed(0)
            for m in range(2 * w.micro_per_step):
                out = w.forward(f"v:{m}", torch.randn(2, 16, w.spec.in_width, generator=g))
                w.backward(f"v:{m}", torch.randn(out["activations"].shape, generator=g) * 1e-2)
            commit = w.updates.commitment(w.updates.steps()[-1], timeout_s=10)
            plan_key = next(iter(a.merging.claims.contributions))
            # a merge "runs": gate closed, the worker's lock held by another thread
            a.merging.gate_open.clear()
            release = threading.Event()
            holder = threading.Thread(target=lambda: (w.lock.acquire(), release.wait(30), w.lock.release()))
            holder.start()
            try:
                async with NeuronClient(net.val) as cl:
                    t0 = time.monotonic()
                    res = await UpdateAuditor(net.cfg, run_id=RUN, total_steps=a.total_steps).audit(
                        cl, a.server.endpoint, a.hotkey, a.stage, commit, timeout_s=10)
                    assert res.outcome == "passed", res
                    got = await cl.call(a.server.endpoint, a.hotkey, "/audit/merge", MergeAuditRequest(
                        run_id=RUN, stage=a.stage, epoch=plan_key[0], attempt=plan_key[1], plan_id=plan_key[2],
                        shard_index=plan_key[3], what="contribution", chunks=[0]), MergeAuditResponse, retries=0,
                        timeout_s=10)
                    took = time.monotonic() - t0
                    assert "0" in got.chunks and took < 8.0, took
                    # validators only: a replica may not open another's audit routes
                async with NeuronClient(b.wallet) as cl:
                    with pytest.raises(ProtocolError) as ei:
                        await cl.call(a.server.endpoint, a.hotkey, "/audit/merge", MergeAuditRequest(
                            run_id=RUN, stage=a.stage), MergeAuditResponse, retries=0)
                    assert ei.value.outcome == Outcome.FORBIDDEN
            finally:
                release.set()
                holder.join()
                a.merging.gate_open.set()
        finally:
            await net.close()
    asyncio.run(main())


def test_the_audit_rounds_the_recomputed_mean_as_an_honest_reducer_does():
    """int8 gather: an honest reducer's mean, rounded per block of the shard, agrees exactly; a mean
    shifted on the small values of a chunk whose largest value is 1.0 (0.0039 on values of 1e-4, 39
    times their size: inside half an int8 step of the chunk's largest value, the tolerance of a
    bound over the whole chunk) differs."""
    from iota_subnet.merge.claims import CHUNK_NUMEL
    from iota_subnet.merge.outer import rounded
    ref = torch.full((CHUNK_NUMEL,), 1e-4)
    ref[0] = 1.0
    auditor = MergeAuditor(RUN, lambda s: CHUNK_NUMEL, gather_quant="int8", int8_block=256)
    honest = rounded(ref, "int8", 256)[0]
    cheat = honest.clone()
    cheat[256:] += 0.0039                   # blocks without the large value: their own scales are tiny
    assert not auditor.differs(ref, honest)
    assert auditor.differs(ref, cheat)
    assert not MergeAuditor(RUN, lambda s: 1).differs(ref, ref.clone())     # fp32 gather: as before
