"""The audit-outcome policy: unverifiable is a failure; a miner that was down
(its training hops failed too) or restarted (announced) is excused, within a stated bound; a
dodger that serves training but not audits is flagged; a churned honest miner is not."""
from __future__ import annotations

import pytest

from iota_subnet.validator.audit_policy import AuditPolicy, merge_quality

K = (4, "hk4")


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_wrong_answer_flags_at_once_and_is_never_excused():
    c = Clock()
    p = AuditPolicy(clock=c)
    p.note_hop(K, False, c.t)                  # even while "down"
    assert p.record(*K, 1, "update", "failed", detail="AdamW recomputed on 2 row(s) differs") == "failed"
    s = p.stats[K]
    assert s.flagged and s.failed == 1 and "update audit failed" in s.reasons[0]
    assert p.quality()[K][0] == 0.0 and K in p.flagged()


def test_dodger_serving_training_but_not_audits_is_flagged():
    c = Clock()
    p = AuditPolicy(clock=c)
    for i in range(3):
        c.t += 10
        p.note_hop(K, True, c.t)                # it trains fine
        out = p.record(*K, 1, "hop", "refused" if i % 2 else "timeout", detail="503")
        assert out in ("refused", "timed_out")
        if i == 0:
            assert not p.stats[K].flagged       # one lost answer is not a pattern
    s = p.stats[K]
    assert s.flagged and s.refused + s.timed_out == 3 and "unanswered" in s.reasons[0]


def test_down_miner_is_excused_within_the_bound():
    c = Clock()
    p = AuditPolicy(clock=c, min_excuses=3, max_excuse_fraction=0.5, excuse_window=20)
    # up and passing for a while
    for _ in range(4):
        c.t += 10
        p.note_hop(K, True, c.t)
        assert p.record(*K, 1, "update", "passed") == "passed"
    # down: its training hops time out too; audits of its earlier work time out -> excused
    c.t += 120
    outs = []
    for _ in range(3):
        c.t += 5
        p.note_hop(K, False, c.t)
        outs.append(p.record(*K, 1, "update", "timeout", work_at=c.t - 30))
    assert outs == ["excused"] * 3 and not p.stats[K].flagged
    # the bound: max(3, half of the last 20): after 4 passes, a 4th excuse (half of 8), not a 5th;
    # a miner that stays down keeps at most half its audits excused and is flagged
    c.t += 5
    p.note_hop(K, False, c.t)
    assert p.record(*K, 1, "update", "timeout") == "excused"
    c.t += 5
    p.note_hop(K, False, c.t)
    assert p.record(*K, 1, "update", "timeout") == "timed_out"
    assert "excuse bound" in p.stats[K].recent[-1]["why"] and not p.stats[K].flagged
    while not p.stats[K].flagged:
        c.t += 5
        p.note_hop(K, False, c.t)
        p.record(*K, 1, "update", "timeout")
    s = p.stats[K]
    assert s.timed_out == 2 and s.excused <= s.audits / 2 and "unanswered" in s.reasons[0]


def test_churned_honest_miner_restarts_are_excused_not_flagged():
    """Pauses and restarts on purpose (the churn issue): audits of work from before each announced
    restart are refused (LATE: the store is gone), and excused."""
    c = Clock()
    p = AuditPolicy(clock=c)
    flagged = []
    for cycle in range(4):
        for _ in range(5):                                   # works and passes
            c.t += 10
            p.note_hop(K, True, c.t)
            p.record(*K, 1, "update", "passed")
        work_at = c.t - 5
        c.t += 30                                            # paused; restarts and announces it
        assert p.announce_restart(K, c.t)
        c.t += 5
        p.note_hop(K, True, c.t)                             # serving again
        assert p.record(*K, 1, "update", "refused", work_at=work_at, detail="LATE") == "excused"
        flagged.append(p.stats[K].flagged)
    assert flagged == [False] * 4 and p.stats[K].excused == 4
    # work done after the restart is not covered: refusing it is a failure
    c.t += 10
    p.note_hop(K, True, c.t)
    assert p.record(*K, 1, "update", "refused", work_at=c.t - 2) == "refused"


def test_honest_miner_killed_twice_within_a_minute_is_excused_both_times():
    """The churn harness may kill the same miner twice in under a minute (a churn run flagged one
    when restarts had to be 60 s apart): both restarts excuse the audits of the work before them."""
    c = Clock()
    p = AuditPolicy(clock=c)
    for gap in (0.0, 25.0):
        c.t += gap
        work_at = c.t - 3
        c.t += 8                                             # killed; back 8 s later
        assert p.announce_restart(K, c.t)
        assert not p.announce_restart(K, c.t)                # the same boot, seen in a later receipt
        c.t += 2
        p.note_hop(K, True, c.t)
        assert p.record(*K, 1, "hop", "timeout", work_at=work_at) == "excused"
    assert not p.stats[K].flagged and p.stats[K].excused == 2
    with pytest.raises(ValueError):
        p.record(*K, 1, "update", "weird")


def test_restarting_before_every_audit_is_flagged_at_the_excuse_bound():
    """A dodger that announces a new boot before each audit it refuses gets at most the excuse
    bound (3, or half of the last 20) excused; the rest are refusals and flag it."""
    c = Clock()
    p = AuditPolicy(clock=c)
    outs = []
    while not p.stats.get(K) or not p.stats[K].flagged:
        work_at = c.t
        c.t += 10
        assert p.announce_restart(K, c.t - 1)
        p.note_hop(K, True, c.t)                             # it trains fine
        outs.append(p.record(*K, 1, "hop", "refused", work_at=work_at, detail="LATE"))
        assert len(outs) < 10
    assert outs == ["excused"] * 3 + ["refused"] * 2
    assert "unanswered" in p.stats[K].reasons[0]


def test_quality_merge_and_persistence():
    c = Clock()
    p = AuditPolicy(clock=c)
    p.record(1, "a", 0, "update", "passed")
    p.record(2, "b", 0, "merge", "failed", detail="served a wrong mean")
    q = merge_quality(p.quality(), {(1, "a"): (0.5, ["clasp"])})
    assert q[(1, "a")] == (0.5, ["clasp"]) and q[(2, "b")][0] == 0.0
    p2 = AuditPolicy(clock=c)
    p2.load_dict(p.to_dict())
    assert p2.flagged() == {(2, "b")} and p2.summary((1, "a"))["passed"] == 1
    assert p2.summary((2, "b"))["by_kind"] == {"merge": 1}


def test_killed_miner_audits_before_its_restart_are_excused():
    """A killed process times out on audits (its hops succeeded seconds earlier, so it does not look
    down yet); the restart it announces a minute later excuses them; one that never restarts is not."""
    c = Clock()
    p = AuditPolicy(clock=c)
    p.note_hop(K, True, c.t)
    c.t += 2
    p.note_hop(K, True, c.t)
    at = c.t + 1
    assert p.announce_restart(K, at + 50)
    assert p.record(*K, 1, "hop", "timeout", at=at, detail="connection refused") == "excused"
    other = (5, "hk5")
    p.note_hop(other, True, c.t)
    assert p.record(*other, 1, "hop", "timeout", at=at, detail="connection refused") == "timed_out"


def test_a_miner_unreachable_at_its_audit_is_down_one_that_answers_health_but_not_audits_is_not():
    """Found in the churn benchmark (2026-12-02): partitions of 5-15 s fell between a miner's training
    hops, so nothing showed it down; its unanswered audits counted, 2 of 10 flagged it, and a flagged
    replica merges with weight 0: 6 of 20 honest miners were flagged and the stages stopped merging.
    The validator now probes ``/health`` after an unanswered audit: unreachable too is down."""
    c = Clock()
    p = AuditPolicy(clock=c, down_window_s=60.0, probe_contradict_s=5.0)
    for _ in range(3):
        c.t += 10
        p.note_hop(K, True, c.t)                # trained fine just before each fault
        assert p.record(*K, 1, "hop", "passed") == "passed"
    for _ in range(2):                          # partitioned at two audits: the probe after each fails too
        c.t += 10
        p.note_unreachable(K, c.t)
        assert p.record(*K, 1, "hop", "timeout") == "excused"
    s = p.stats[K]
    assert not s.flagged and s.excused == 2 and "unreachable" in s.recent[-1]["why"]
    # the dodger: its health probe is answered (nothing noted), its audits are not
    D = (5, "hk5")
    for i in range(2):
        c.t += 10
        p.note_hop(D, True, c.t)
        assert p.record(*D, 1, "hop", "timeout") == "timed_out"
    assert p.stats[D].flagged


def test_an_unanswered_probe_contradicted_by_training_is_not_an_excuse():
    """A miner that drops the validator's probes while it serves training hops at that very time is not
    unreachable: no excuse. Receipts that arrive only after the probe failed are the burst a healed
    partition releases (churn benchmark, 2026-12-02: an honest miner was flagged for them)."""
    c = Clock()
    p = AuditPolicy(clock=c, probe_contradict_s=5.0)
    for _ in range(2):
        c.t += 10
        for dt in (-4.0, -1.5, 2.0):             # its receipts keep arriving around the failed probe
            p.note_hop(K, True, c.t + dt)
        p.note_unreachable(K, c.t)
        assert p.record(*K, 1, "hop", "timeout") == "timed_out"
    assert p.stats[K].flagged
    H = (6, "hk6")                               # partitioned: nothing arrives until it heals, 2 s later
    for _ in range(2):
        c.t += 10
        p.note_hop(H, True, c.t - 12.0)          # before the partition (the audit waited 10 s, the probe 2)
        p.note_unreachable(H, c.t)
        p.note_hop(H, True, c.t + 2.0)           # the burst of held-back receipts once it heals
        assert p.record(*H, 1, "hop", "timeout") == "excused"
    assert not p.stats[H].flagged
