"""What audit outcomes mean for a miner: unverifiable is a failure, honest
faults are excused within a bound.

Every audit a validator runs (hop replays, update audits, merge-slice checks) ends in a raw
outcome: ``passed``, ``failed`` (the answer does not verify: wrong values, proofs that do not match
the commitment, a commitment other than the one received), ``refused`` (a typed refusal, e.g.
``LATE`` for work outside the miner's audit window) or ``timeout`` (no answer). :meth:`AuditPolicy.record`
turns it into the outcome that counts:

* ``failed`` stays ``failed``: it is never excused (an honest miner answers what it committed to);
* ``refused`` / ``timeout`` are **excused** when an honest fault explains them, else they count
  as ``refused`` / ``timed_out`` (failures: "unverifiable is a failure", never "no snapshot"):

  - *down*: the miner was also missing its training hops: at least one of its training hops
    failed (timeout, refusal, unreachable) and none succeeded within ``down_window_s`` seconds
    of the audit (:meth:`AuditPolicy.note_hop` feeds that record); or it was unreachable
    altogether: a health probe sent right after the unanswered audit went unanswered too
    (:meth:`AuditPolicy.note_unreachable`), and no receipt of a training hop of it arrived in the
    ``probe_contradict_s`` before that probe failed (a partitioned, paused or dying miner; under
    churn a partition often falls between two of its training hops, which alone did not show it;
    its receipts held back by the partition arrive in a burst once it heals, after the probe, and
    do not contradict it). A miner that serves training or health probes but not audits is not down;
  - *restart*: the audited work is from before a restart the miner announced
    (:meth:`AuditPolicy.announce_restart`: its first receipts after a restart carry a new boot
    time; what its audit store held is gone), or the audit went unanswered shortly (120 s) before
    one (a killed process). Work done after the announced restart is not covered. An update audit
    answered by the new process for its own, later commitment of the audited step reaches the policy
    as ``refused`` only when such a restart lies between the two commitments; else it is ``failed``
    (:data:`~iota_subnet.validator.update_audit.SUPERSEDED`).

* **Bound on excuses**: among a miner's last ``excuse_window`` audits at most
  ``max(min_excuses, max_excuse_fraction x n)`` may be excused (default: 3, or half of the last 20
  once there are more); an excuse beyond the bound counts as the failure it would have been. The
  bound is the only limit on restarts: a miner that announces a "restart" before every audit gets
  at most that share excused, the rest count as refusals and flag it; an honest miner killed twice
  within a minute (the churn harness does it) is excused both times.

Flags (used by scoring: quality 0, and by explanations): a miner is flagged at its first
``failed`` audit (provably wrong; the tolerances sit far above honest error), or when its
unexcused refusals and timeouts among its last ``window`` audits reach ``unanswered_threshold``
(default 2 of the last 10: one lost answer on a bad link is not cheating, a pattern is). Flags stay
with the hotkey (a re-registered uid starts clean).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Mapping, Optional

Key = tuple[int, str]

RAW_OUTCOMES = ("passed", "failed", "refused", "timeout")
#: What :meth:`AuditPolicy.record` returns.
OUTCOMES = ("passed", "failed", "refused", "timed_out", "excused")


@dataclass
class AuditStats:
    """Per miner (uid, hotkey): counts of each final outcome, flag and reasons, recent events."""

    uid: int
    hotkey: str
    stage: int
    passed: int = 0
    failed: int = 0
    refused: int = 0
    timed_out: int = 0
    excused: int = 0
    flagged: bool = False
    reasons: list[str] = field(default_factory=list)
    by_kind: dict[str, int] = field(default_factory=dict)       # audits per kind (update, hop, merge)
    recent: list[dict] = field(default_factory=list)           # last outcomes, newest last

    @property
    def audits(self) -> int:
        return self.passed + self.failed + self.refused + self.timed_out + self.excused

    def to_dict(self) -> dict:
        return asdict(self)

    def flag(self, reason: str) -> None:
        self.flagged = True
        if reason not in self.reasons:
            self.reasons.append(reason)
            del self.reasons[:-8]


class AuditPolicy:
    """Records audit outcomes per miner and applies the excuse rules (see the module docstring)."""

    def __init__(self, *, window: int = 10, unanswered_threshold: int = 2, excuse_window: int = 20,
                 max_excuse_fraction: float = 0.5, min_excuses: int = 3, down_window_s: float = 60.0,
                 probe_contradict_s: float = 5.0, clock=time.time):
        self.window = max(1, int(window))
        self.unanswered_threshold = max(1, int(unanswered_threshold))
        self.excuse_window = max(1, int(excuse_window))
        self.max_excuse_fraction = min(1.0, max(0.0, float(max_excuse_fraction)))
        self.min_excuses = max(0, int(min_excuses))
        self.down_window_s = float(down_window_s)
        self.probe_contradict_s = float(probe_contradict_s)
        self.clock = clock
        self.stats: dict[Key, AuditStats] = {}
        self._hops: dict[Key, deque] = {}           # (time, ok) of training hops
        self._restarts: dict[Key, list[float]] = {}  # announced restart times, accepted
        self._unreachable: dict[Key, deque] = {}    # times of health probes it did not answer
        self._last: dict[Key, deque] = {}           # final outcomes of the last audits

    # ---- inputs besides audits ------------------------------------------------------------------
    def stat(self, uid: int, hotkey: str, stage: int) -> AuditStats:
        key = (int(uid), str(hotkey))
        s = self.stats.get(key)
        if s is None:
            s = self.stats[key] = AuditStats(int(uid), str(hotkey), int(stage))
        s.stage = int(stage)
        return s

    def note_hop(self, key: Key, ok: bool, at: Optional[float] = None) -> None:
        """A training hop of the miner ``key`` succeeded (``ok``) or failed at ``at`` (unix s)."""
        d = self._hops.setdefault((int(key[0]), str(key[1])), deque(maxlen=256))
        d.append((self.clock() if at is None else float(at), bool(ok)))

    def note_unreachable(self, key: Key, at: Optional[float] = None) -> None:
        """A health probe of miner ``key`` sent at ``at`` (unix s), right after an unanswered audit,
        went unanswered too."""
        d = self._unreachable.setdefault((int(key[0]), str(key[1])), deque(maxlen=64))
        d.append(self.clock() if at is None else float(at))

    def was_unreachable(self, key: Key, at: float) -> bool:
        """A health probe within ``down_window_s`` after the audit at ``at`` went unanswered, and no
        receipt of a successful training hop of the miner arrived in the ``probe_contradict_s``
        before that probe failed (or within 0.5 s after: clocks of one process, a margin for the order
        of events)."""
        served = [t for t, ok in self._hops.get(key, ()) if ok]
        return any(at - 1.0 <= p <= at + self.down_window_s
                   and not any(p - self.probe_contradict_s <= t <= p + 0.5 for t in served)
                   for p in self._unreachable.get(key, ()))

    def announce_restart(self, key: Key, at: float) -> bool:
        """The miner announced it restarted at ``at`` (unix s). Returns True when this is a restart
        not seen before (later than the last one recorded), False for one already known or older."""
        key = (int(key[0]), str(key[1]))
        rs = self._restarts.setdefault(key, [])
        if rs and float(at) <= rs[-1]:
            return False
        rs.append(float(at))
        del rs[:-16]
        return True

    def was_down(self, key: Key, at: float) -> bool:
        """Training hops failed and none succeeded within ``down_window_s`` of ``at``."""
        hops = [(t, ok) for t, ok in self._hops.get(key, ()) if abs(t - at) <= self.down_window_s]
        return bool(hops) and not any(ok for _, ok in hops)

    def restarted_since(self, key: Key, work_at: float, audit_at: float) -> bool:
        """An accepted restart between the audited work (``work_at``) and the audit (``audit_at``)."""
        return any(work_at < r <= audit_at for r in self._restarts.get(key, ()))

    def restarted_soon_after(self, key: Key, audit_at: float, within_s: float = 120.0) -> bool:
        """An accepted restart within ``within_s`` after the audit: its process was dead or dying
        when the audit went unanswered (a killed miner's audits time out before it comes back)."""
        return any(audit_at < r <= audit_at + within_s for r in self._restarts.get(key, ()))

    # ---- audits -------------------------------------------------------------------------------
    def _excuse_budget_left(self, key: Key) -> bool:
        last = list(self._last.get(key, ()))[-(self.excuse_window - 1):] if self.excuse_window > 1 else []
        used = sum(1 for o in last if o == "excused")
        return used + 1 <= max(self.min_excuses, self.max_excuse_fraction * (len(last) + 1))

    def record(self, uid: int, hotkey: str, stage: int, kind: str, raw: str, *, work_at: Optional[float] = None,
               at: Optional[float] = None, detail: str = "") -> str:
        """Record one audit of miner (uid, hotkey) of ``stage``: ``kind`` (``update``, ``hop``,
        ``merge``...), ``raw`` outcome (:data:`RAW_OUTCOMES`), ``work_at``: when the audited work was
        done (default: the audit time), ``at``: the audit time. Returns the final outcome
        (:data:`OUTCOMES`) and updates flags."""
        if raw not in RAW_OUTCOMES:
            raise ValueError(f"audit outcome {raw!r} is not one of {RAW_OUTCOMES}")
        s = self.stat(uid, hotkey, stage)
        key = (s.uid, s.hotkey)
        at = self.clock() if at is None else float(at)
        work_at = at if work_at is None else float(work_at)
        final, why = raw, ""
        if raw in ("refused", "timeout"):
            final = "refused" if raw == "refused" else "timed_out"
            reason = ("down (its training hops failed too)" if self.was_down(key, at) else
                      "down (unreachable: it did not answer a health probe either)"
                      if self.was_unreachable(key, at) else
                      "work from before its announced restart" if self.restarted_since(key, work_at, at) else
                      "down (it announced a restart right after)" if self.restarted_soon_after(key, at) else "")
            if reason:
                if self._excuse_budget_left(key):
                    final, why = "excused", reason
                else:
                    why = f"{reason}, but over the excuse bound (max({self.min_excuses}, " \
                          f"{self.max_excuse_fraction:.0%}) of the last {self.excuse_window} audits)"
        setattr(s, final, getattr(s, final) + 1)
        s.by_kind[kind] = s.by_kind.get(kind, 0) + 1
        last = self._last.setdefault(key, deque(maxlen=max(self.window, self.excuse_window)))
        last.append(final)
        s.recent.append({"kind": kind, "raw": raw, "outcome": final, "at": at, "why": why, "detail": detail[:160]})
        del s.recent[:-20]
        if final == "failed":
            s.flag(f"{kind} audit failed: {detail[:160]}")
        elif final in ("refused", "timed_out"):
            recent = list(last)[-self.window:]
            n = sum(1 for o in recent if o in ("refused", "timed_out"))
            if n >= self.unanswered_threshold:
                s.flag(f"{n} of its last {len(recent)} audits unanswered (refused or timed out, not excused)")
        return final

    # ---- outputs ------------------------------------------------------------------------------
    def flagged(self) -> set[Key]:
        return {k for k, s in self.stats.items() if s.flagged}

    def quality(self) -> dict[Key, tuple[float, list[str]]]:
        """Quality factors for :meth:`~iota_subnet.validator.scoring.Scoreboard.update`: 0 for
        flagged miners (with the reasons), 1 for the others that were audited."""
        return {k: ((0.0, [f"audit: {r}" for r in s.reasons]) if s.flagged else (1.0, []))
                for k, s in self.stats.items()}

    def summary(self, key: Key) -> Optional[dict]:
        s = self.stats.get(key)
        if s is None:
            return None
        return {k: getattr(s, k) for k in ("passed", "failed", "refused", "timed_out", "excused", "flagged")} | {
            "audits": s.audits, "by_kind": dict(s.by_kind)}

    def to_dict(self) -> dict:
        return {"stats": [s.to_dict() for s in self.stats.values()],
                "restarts": {f"{u}|{h}": v for (u, h), v in self._restarts.items()},
                "last": {f"{u}|{h}": list(v) for (u, h), v in self._last.items()}}

    def load_dict(self, d: Mapping) -> None:
        for row in d.get("stats", []):
            s = AuditStats(**row)
            self.stats[(s.uid, s.hotkey)] = s
        for k, v in (d.get("restarts") or {}).items():
            u, h = k.split("|", 1)
            self._restarts[(int(u), h)] = [float(x) for x in v]
        for k, v in (d.get("last") or {}).items():
            u, h = k.split("|", 1)
            self._last[(int(u), h)] = deque(v, maxlen=max(self.window, self.excuse_window))


def merge_quality(*factors: Mapping[Key, tuple[float, list[str]]]) -> dict[Key, tuple[float, list[str]]]:
    """Multiply quality factors (and join their reasons) from several sources."""
    out: dict[Key, tuple[float, list[str]]] = {}
    for f in factors:
        for k, (q, why) in f.items():
            q0, w0 = out.get(k, (1.0, []))
            out[k] = (q0 * q, w0 + list(why))
    return out

