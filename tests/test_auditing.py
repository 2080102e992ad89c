"""The validator's audit scheduler alone (:mod:`iota_subnet.validator.auditing`): which hop it picks
(blind, recent, still in the window), the direction per stage, what receipts alone prove (missing
update commitments, weights that never change), how unanswered audits are settled (a restart
announced by the miner's next receipt excuses them), and that transport failures are timeouts and
typed refusals are refusals. The audits over real HTTP: tests/test_audit_wire.py."""
from __future__ import annotations

import asyncio
import json
import dataclasses
import random

import pytest

from iota_subnet.config import load_config
from iota_subnet.protocol import Health, Outcome, ProtocolError, Ticket, UpdateCommit
from iota_subnet.protocol.audit import UPDATE_KINDS
from iota_subnet.protocol.receipt import Receipt
from iota_subnet.transport import TransportError
from iota_subnet.validator.audit_policy import AuditPolicy
from iota_subnet.validator.auditing import AuditScheduler, AuditSchedulerOptions
from iota_subnet.validator.auditing.updates import STALE_STEPS
from iota_subnet.validator.routing import Replica
from iota_subnet.validator.update_audit import UpdateAuditor

from support.dataplane_net import OVR

HK = "5" + "a" * 47


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


class Refusing:
    """A verification client whose audit calls fail the way ``exc`` says; ``/health`` probes are
    answered (the miner is up: it dodges) unless ``reachable`` is False; counts bytes like the real one."""

    total_bytes = 0

    def __init__(self, exc, reachable: bool = True):
        self.exc, self.reachable = exc, reachable
        self.calls = 0
        self.probes = 0

    async def call(self, endpoint, hotkey, path, msg, typ, **kw):
        if path == "/health":
            self.probes += 1
            if self.reachable:
                return Health(run_id=msg.run_id, stage=msg.stage)
            raise TransportError(endpoint, "connection refused")
        self.calls += 1
        raise self.exc


def make(client=None, clock=None, stage=1, updates=True):
    cfg = load_config("configs/tiny.yaml", OVR)
    clock = clock or Clock()
    policy = AuditPolicy(clock=clock)
    rep = Replica(7, HK, "127.0.0.1:1", stage)
    sch = AuditScheduler(cfg, run_id="r", client=client or Refusing(TransportError("x", "down")), policy=policy,
                         rows=lambda t: None, lookup=lambda hk: rep if hk == HK else None,
                         update_auditor=UpdateAuditor(cfg, run_id="r") if updates else None,
                         options=AuditSchedulerOptions(retry_delays_s=(0.0, 0.0), rng=random.Random(0), clock=clock))
    return sch, rep, policy, clock


def ticket(step: int, index: int = 0) -> Ticket:
    return Ticket(run_id="r", validator="v", lane=0, step=step, index=index, microbatch_id=f"mb-{step}-{index}",
                  split="train", seed=0, start=0, rows=2, seq_len=32, width=16, wire_dtype="bf16", train=True,
                  micro_per_step=2, route=("a", HK, "c"))


def receipt(step: int, index: int = 0, *, stage: int = 1, ws=None, root: str = "", boot: float = 1.0, t: float = 0.0,
            backward=True, accumulated=True) -> Receipt:
    h = "1" * 64
    return Receipt(id=f"mb-{step}-{index}", lane=0, step=step, index=index, attempt=0, stage=stage, status="ok",
                   fin=h, fout=h, bin=h if backward else "", bout=h if backward else "", ws=step if ws is None else ws,
                   wm=0, wroot=root or f"{step:064x}", boot=boot, t=t, accumulated=accumulated)


def test_picks_a_recent_hop_of_the_two_latest_weights_versions():
    sch, rep, _, clock = make()
    for k in range(6):
        for i in range(2):
            sch.on_receipt(ticket(k, i), receipt(k, i), HK)
    picks = {sch.pick_hop(HK).receipt.ws for _ in range(50)}
    assert picks == {4, 5}
    clock.t += sch.fresh_s + 1            # nothing recent: nothing to audit (its window moved on)
    assert sch.pick_hop(HK) is None


def test_direction_follows_the_stage():
    sch, *_ = make()
    assert sch.direction(0, receipt(0, stage=0)) == "forward"
    assert sch.direction(1, receipt(0)) == "backward"
    assert sch.direction(1, receipt(0, backward=False)) == "forward"
    assert sch.direction(2, receipt(0, stage=2)) == "backward"


@pytest.mark.parametrize("exc,raw", [(TransportError("m", "connection refused"), "timeout"),
                                     (asyncio.TimeoutError(), "timeout"),
                                     (ProtocolError(Outcome.LATE, "not in the window"), "refused")])
def test_unanswered_audits_count_once_the_miner_reports_again(exc, raw):
    client = Refusing(exc)
    sch, rep, policy, clock = make(client, updates=False)
    sch.on_receipt(ticket(3), receipt(3, t=clock.t), HK)
    rec = asyncio.run(sch.audit_hop(rep, 0))
    assert rec.raw == raw and rec.final == "" and not policy.stats      # waits for the miner's next receipt
    # a transport failure is asked again (twice here) before it counts; a typed refusal is an answer
    assert (client.calls, rec.reasks) == ((3, 2) if raw == "timeout" else (1, 0))
    clock.t += 1
    sch.on_receipt(ticket(4), receipt(4, t=clock.t), HK)                # same process (boot), after the audit
    assert rec.final == ("timed_out" if raw == "timeout" else "refused")
    rec2 = asyncio.run(sch.audit_hop(rep, 1))
    clock.t += 1
    sch.on_receipt(ticket(5), receipt(5, t=clock.t), HK)
    assert rec2.final == rec.final and policy.flagged() == {rep.key}      # two unanswered: flagged


def test_a_restart_announced_after_the_audit_excuses_it():
    sch, rep, policy, clock = make(Refusing(ProtocolError(Outcome.LATE, "gone")), updates=False)
    sch.on_receipt(ticket(3), receipt(3, t=clock.t, boot=900.0), HK)        # work at 1000
    clock.t += 5
    rec = asyncio.run(sch.audit_hop(rep, 0))                                   # audit at 1005: LATE
    clock.t += 5                          # the new process's first receipt: it restarted at 1003
    sch.on_receipt(ticket(0), receipt(0, t=clock.t, boot=1003.0), HK)
    assert rec.final == "excused" and not policy.flagged()


def test_an_unanswered_audit_of_a_miner_unreachable_altogether_is_excused_as_down():
    """After a timed-out audit the scheduler probes ``/health``: unanswered too means the miner is down
    (partitioned, paused, dying), an honest fault; answered means it dodged the audit (above)."""
    client = Refusing(TransportError("x", "down"), reachable=False)
    sch, rep, policy, clock = make(client, updates=False)
    recs = []
    for k in range(2):
        sch.on_receipt(ticket(3 + k), receipt(3 + k, t=clock.t), HK)
        recs.append(asyncio.run(sch.audit_hop(rep, k)))
        clock.t += sch.settle_s + 1
        asyncio.run(sch.round(k + 1))
    # probed after each of its 3 attempts
    assert [r.final for r in recs] == ["excused", "excused"] and client.probes == 6 and not policy.flagged()
    assert "unreachable" in policy.stats[rep.key].recent[-1]["why"]


def test_a_miner_unreachable_at_the_first_ask_and_back_by_the_last_is_excused():
    """A miner paused or partitioned when its audit is first asked may answer health probes again by
    the last re-ask (yet have lost the audit: a dropped trace, a restart that has not announced itself):
    the probe after the first failed attempt found it down, which excuses the audit; a miner that
    answered every probe dodged (:func:`test_unanswered_audits_count_once_the_miner_reports_again`)."""
    class BackLater(Refusing):
        async def call(self, endpoint, hotkey, path, msg, typ, **kw):
            if path == "/health":
                self.reachable = self.probes >= 1          # the first probe goes unanswered
            return await super().call(endpoint, hotkey, path, msg, typ, **kw)
    client = BackLater(TransportError("x", "ServerDisconnectedError"))
    sch, rep, policy, clock = make(client, updates=False)
    sch.on_receipt(ticket(3), receipt(3, t=clock.t), HK)
    rec = asyncio.run(sch.audit_hop(rep, 0))
    clock.t += sch.settle_s + 1
    asyncio.run(sch.round(1))
    assert (rec.raw, rec.final, client.probes) == ("timeout", "excused", 3) and not policy.flagged()


def test_unanswered_audits_settle_after_a_while_without_receipts():
    sch, rep, policy, clock = make(updates=False)
    sch.on_receipt(ticket(3), receipt(3, t=clock.t), HK)
    rec = asyncio.run(sch.audit_hop(rep, 0))
    clock.t += sch.settle_s + 1
    asyncio.run(sch.round(1))
    assert rec.final == "timed_out"


def test_receipts_prove_missing_commitments_and_weights_that_never_change():
    sch, rep, policy, clock = make()
    for k in range(3):                     # weights change at every step; no commitment ever comes
        sch.on_receipt(ticket(k), receipt(k), HK)
    clock.t += sch.commit_grace_s + 1
    out = asyncio.run(sch.round(0))
    assert [(r.kind, r.raw) for r in out] == [("update", "refused")] and "no update commitment" in out[0].detail
    sch, rep, policy, clock = make()
    for k in range(STALE_STEPS + 1):       # a root that stays the same over the steps it claims
        sch.on_receipt(ticket(k), receipt(k, root="2" * 64), HK)
    clock.t += sch.commit_grace_s + 1
    out = asyncio.run(sch.round(0))
    assert [(r.kind, r.raw, r.final) for r in out] == [("update", "failed", "failed")], [vars(r) for r in out]
    assert policy.flagged() == {rep.key}


def _skipped_commit(step: int):
    return UpdateCommit(step=step, merges=0, adam_step=step, lr=0.0, grad_norm=0.0, clip_coef=0.0, skipped=True,
                        roots={k: "2" * 64 for k in UPDATE_KINDS}, at=0.0).to_dict()


@pytest.mark.parametrize("trained", [0, 1, STALE_STEPS])
def test_updates_called_skipped_excuse_unchanged_weights_only_for_steps_it_did_not_train(trained):
    """An honest lane member that jumps to its lane's step commits the jumped-over step as skipped
    (weights unchanged); under churn a lane can skip one step at a time, so its weights root stays
    the same over several inner steps it names (as an alternate, in an evaluation, or with a step it
    had begun and left: the late micro-batches of that step are computed, not accumulated). A
    ``stale`` miner that trains every micro-batch and calls each update skipped looked the same (a
    gap noted on 2026-12-02): the receipts say which steps it accumulated whole. One such step is
    allowed (a non-finite gradient)."""
    sch, rep, policy, clock = make()
    for k in range(STALE_STEPS + 1):
        whole = k >= STALE_STEPS - trained              # the last `trained` skipped steps: both micro-batches
        sch.on_receipt(ticket(k), receipt(k, root="2" * 64), HK)                  # micro-batch 0, accumulated
        if k % 2:                                       # 1: accumulated, or computed after it left the step
            sch.on_receipt(ticket(k, 1), receipt(k, 1, root="2" * 64, accumulated=whole), HK)
        else:                                           # ... or accumulated, or served as an alternate
            alt = dataclasses.replace(ticket(k, 1), trains=() if whole else (True, False, True))
            sch.on_receipt(alt, receipt(k, 1, root="2" * 64), HK)
    assert sch.on_updates(HK, [_skipped_commit(k) for k in range(STALE_STEPS)]) == STALE_STEPS
    clock.t += sch.commit_grace_s + 1
    out = asyncio.run(sch.round(0))
    if trained <= 1:
        assert out == [] and policy.flagged() == set(), [vars(r) for r in out]
    else:
        assert [(r.kind, r.raw) for r in out] == [("update", "failed")], [vars(r) for r in out]
        assert "skipped, yet it reported training" in out[0].detail
        assert policy.flagged() == {rep.key}


def test_work_from_before_a_restart_is_not_picked():
    """Its audit window is gone with the old process: auditing it would only spend the excuse budget."""
    sch, rep, policy, clock = make(updates=False)
    for k in range(2):
        sch.on_receipt(ticket(k), receipt(k, t=clock.t, boot=900.0), HK)
    clock.t += 1
    sch.on_receipt(ticket(1, 1), receipt(1, 1, t=clock.t, boot=clock.t - 0.5), HK)     # the new process
    assert {sch.pick_hop(HK).receipt.boot for _ in range(30)} == {clock.t - 0.5}


def test_a_restarted_process_is_bound_by_the_roots_it_names_not_by_its_old_process():
    """After a restart the miner resumes from its checkpoint and names versions (step, merges) again,
    with other weights: its update commitment is checked against the roots the new process named
    (before, the old process's root for the same version failed it); a commitment that differs from
    the new process's roots still fails."""
    from iota_subnet.protocol import UpdateCommit
    sch, rep, policy, clock = make()
    for k in range(4):                                          # the old process: versions 0..3
        sch.on_receipt(ticket(k), receipt(k, t=clock.t, boot=900.0, root=f"{k:063x}a"), HK)
    clock.t += 5
    for k in (2, 3):                                            # resumed at step 2: versions 2, 3 again
        sch.on_receipt(ticket(k, 1), receipt(k, 1, t=clock.t, boot=clock.t - 1, root=f"{k:063x}b"), HK)

    def commit(w0: str, w1: str) -> UpdateCommit:
        return UpdateCommit(step=2, merges=0, adam_step=3, lr=1e-3, grad_norm=1.0, clip_coef=1.0, skipped=False,
                            roots={"w0": w0, "w1": w1}, at=clock.t)
    assert sch._bound(HK, commit(f"{2:063x}b", f"{3:063x}b")) == ""
    assert "is not the weights version [3, 0]" in sch._bound(HK, commit(f"{2:063x}b", f"{3:063x}a"))


def test_an_audit_waiting_to_ask_again_holds_no_audit_slot():
    """With one audit slot, a miner whose audits keep dropping (waiting 1 s before each re-ask) does
    not hold up another miner's audit: the slot is free while it waits."""
    hk2 = "5" + "b" * 47

    class OneDrops(Refusing):
        async def call(self, endpoint, hotkey, path, msg, typ, **kw):
            if path != "/health" and hotkey == hk2:
                raise ProtocolError(Outcome.LATE, "gone")            # answered at once
            return await super().call(endpoint, hotkey, path, msg, typ, **kw)
    class InOrder(random.Random):            # uid 7's audit takes the slot first
        def shuffle(self, x):
            pass
    cfg = load_config("configs/tiny.yaml", OVR)
    clock = Clock()
    reps = {HK: Replica(7, HK, "127.0.0.1:1", 1), hk2: Replica(8, hk2, "127.0.0.1:2", 1)}

    async def main():
        sch = AuditScheduler(cfg, run_id="r", client=OneDrops(TransportError("x", "dropped")),
                             policy=AuditPolicy(clock=clock), rows=lambda t: None, lookup=reps.get,
                             options=AuditSchedulerOptions(concurrency=1, retry_delays_s=(1.0, 1.0), rng=InOrder(1),
                                                           clock=clock))
        for hk in reps:
            sch.on_receipt(ticket(3), receipt(3, t=clock.t), hk)
        out = await sch.round(0, wait_s=0.5)
        assert [r.uid for r in out] == [8] and (HK, "hop") in sch._inflight      # uid 7 still waits
        await sch.close()
    asyncio.run(main())


def test_an_unanswered_audit_is_judged_when_its_last_request_first_went_unanswered():
    """A hop audit can run for minutes (three rounds, each asked up to three times). Its policy time is
    when the request that finally failed first went unanswered, not its end (the probe that found
    the miner down then lies outside the policy's window) nor its start (rounds 1-2 may have taken
    a minute); it is settled from its end."""
    from iota_subnet.validator.auditing.records import AuditRecord
    sch, rep, policy, clock = make(updates=False)
    lost_at = clock.t + 70                      # rounds 1-2 answered; round 3 first lost at +70 s
    policy.note_unreachable(rep.key, lost_at + 3)          # the probe right after: down
    clock.t += 200                              # the last re-ask failed too, at +200 s
    rec = AuditRecord("hop", rep.uid, HK, rep.stage, "timeout", tempo=0, unanswered_since=lost_at)
    sch._finish(rec, lost_at - 80)
    assert rec.final == "" and not sch.settle()             # settled from its end: not yet
    clock.t += sch.settle_s + 1
    assert sch.settle() == [rec] and rec.final == "excused" and "unreachable" in policy.stats[rep.key].recent[-1]["why"]


def test_an_update_audit_is_asked_again_with_the_same_rows_and_a_dropper_still_fails():
    """An update audit whose connection dropped is sent again unchanged (new rows would be a second
    challenge); one dropped every time is unanswered, and the miner, answering health probes, dodges."""
    class Drops(Refusing):
        def __init__(self, answer_at: int):
            super().__init__(TransportError("m", "ServerDisconnectedError"))
            self.answer_at, self.asked = answer_at, []

        async def call(self, endpoint, hotkey, path, msg, typ, **kw):
            if path == "/audit/update":
                self.asked.append(msg)
                if len(self.asked) == self.answer_at:
                    raise ProtocolError(Outcome.LATE, "that step is gone")
            return await super().call(endpoint, hotkey, path, msg, typ, **kw)
    for answer_at, raw in ((2, "refused"), (0, "timeout")):
        client = Drops(answer_at)
        sch, rep, policy, clock = make(client)
        sch.on_updates(HK, [_skipped_commit(4)])
        rec = asyncio.run(sch.audit_update(rep, 0))
        assert rec.raw == raw and len(client.asked) == (2 if answer_at else 3)
        assert all(m == client.asked[0] for m in client.asked)          # the same rows every time
        assert client.probes == len(client.asked) - (raw == "refused")        # after each failed attempt


@pytest.mark.parametrize("boot", ["restart-between", "restart-before", "same-process", "no-receipt"])
def test_an_update_audit_answered_by_the_process_that_redid_the_step_is_excused_only_after_a_restart(boot):
    """Churn run of 2026-12-03 (chaos seed 1): uid 1 was killed right after committing inner step 0;
    the validator asked its update audit again until the new process, which had started from the
    seeded weights and done step 0 again, answered with its own commitment of step 0. That failed,
    and flagged, an honest miner. A later commitment of the audited step now waits to be settled:
    a restart announced by the miner's next receipt, between the two commitments, excuses it (work
    from before the restart); a restart from before the commitment, none, or no receipt at all
    until it is settled: it fails, as any answer for another commitment does."""
    from iota_subnet.protocol import UpdateAuditResponse
    old = UpdateCommit(step=0, merges=0, adam_step=1, lr=1e-3, grad_norm=1.0, clip_coef=1.0, skipped=False,
                       roots={k: "0" * 64 for k in UPDATE_KINDS}, at=999.0)
    redone = dataclasses.replace(old, roots={k: "3" * 64 for k in UPDATE_KINDS}, at=1003.0)

    class NewProcess(Refusing):
        async def call(self, endpoint, hotkey, path, msg, typ, **kw):
            if path == "/audit/update":
                return UpdateAuditResponse(commit=redone.to_dict())
            return await super().call(endpoint, hotkey, path, msg, typ, **kw)
    sch, rep, policy, clock = make(NewProcess(TransportError("x", "down")))
    sch.on_receipt(ticket(0), receipt(0, t=clock.t, boot=900.0), HK)          # the old process, at 1000
    assert sch.on_updates(HK, [old.to_dict()]) == 1
    clock.t += 5
    rec = asyncio.run(sch.audit_update(rep, 0))
    assert (rec.raw, rec.code, rec.final) == ("refused", "SUPERSEDED", ""), vars(rec)
    clock.t += 1
    if boot == "no-receipt":                      # settled when settle_s has passed
        clock.t += sch.settle_s + 1
        assert sch.settle() == [rec]
    else:                                         # its next receipt: a process started at 1002 or 950, or the old one
        sch.on_receipt(ticket(1), receipt(1, t=clock.t, boot={"restart-between": 1002.0, "restart-before": 950.0,
                                                              "same-process": 900.0}[boot]), HK)
    if boot == "restart-between":
        assert rec.final == "excused" and not policy.flagged()
        assert "restart" in policy.stats[rep.key].recent[-1]["why"]
    else:
        assert (rec.raw, rec.final) == ("failed", "failed") and policy.flagged() == {rep.key}
        assert rec.detail.endswith("no restart announced between the two")


def test_a_late_refusal_outside_the_required_window_is_not_counted():
    """LATE for a version the miner may have dropped by the time it answered (its later receipts name
    versions >= REQUIRED_VERSIONS newer) is within its rights; inside that window it counts."""
    from iota_subnet.validator.auditing.records import REQUIRED_VERSIONS
    sch, rep, policy, clock = make(Refusing(ProtocolError(Outcome.LATE, "gone")), updates=False)
    sch.on_receipt(ticket(3), receipt(3, t=clock.t), HK)
    rec = asyncio.run(sch.audit_hop(rep, 0))
    clock.t += 1
    sch.on_receipt(ticket(3 + REQUIRED_VERSIONS), receipt(3 + REQUIRED_VERSIONS, t=clock.t), HK)
    assert rec.final == "outside window" and not policy.stats
    rec2 = asyncio.run(sch.audit_hop(rep, 0))          # audited again in the same tempo: the newest hop
    assert rec2.version == (3 + REQUIRED_VERSIONS, 0)
    clock.t += 1
    sch.on_receipt(ticket(4 + REQUIRED_VERSIONS), receipt(4 + REQUIRED_VERSIONS, t=clock.t), HK)
    assert rec2.final == "refused"


def test_a_restarted_validator_counts_the_audits_of_its_earlier_processes():
    """Chaos run at 832facd: the validator was restarted 27 s before the end and the run's summary said
    5 audits (those of its last process). The counters are kept in the validator's state and handed
    to the next process's scheduler; an unreadable entry counts from 0."""
    sch, rep, policy, clock = make(Refusing(TransportError("x", "down")), updates=False)
    sch.on_receipt(ticket(3), receipt(3, t=clock.t), HK)
    asyncio.run(sch.audit_hop(rep, 0))
    clock.t += 1
    sch.on_receipt(ticket(4), receipt(4, t=clock.t), HK)                # settles it: one audit counted
    kept = json.loads(json.dumps(sch.totals()))                          # through the state's JSON
    assert kept["audits"] == 1 and kept["reasked"] == 2          # the dropped audit was asked twice more
    cfg = load_config("configs/tiny.yaml", OVR)
    again = AuditScheduler(cfg, run_id="r", client=None, policy=policy, rows=lambda t: None,
                           lookup=lambda hk: None, options=AuditSchedulerOptions(totals=kept))
    assert again.status()["audits"] == 1 and again.totals() == kept
    for bad in ({"audits": "many", "failed": -3, "bytes": float("nan")}, ["not", "a", "dict"], None,
                {"audits": float("inf"), "failed": 10 ** 400, "cpu_s": "1e999"}):
        fresh = AuditScheduler(cfg, run_id="r", client=None, policy=policy, rows=lambda t: None,
                               lookup=lambda hk: None, options=AuditSchedulerOptions(totals=bad))
        assert fresh.totals() == {"audits": 0, "failed": 0, "bytes": 0, "cpu_s": 0.0, "reasked": 0,
                                  "reasked_answered": 0}
