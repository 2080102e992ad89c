"""Audit outcomes: the record of each audit, settling unanswered ones, the counters kept across restarts.

A part of :class:`~iota_subnet.validator.auditing.scheduler.AuditScheduler`: a finished audit goes
to the policy (:class:`~iota_subnet.validator.audit_policy.AuditPolicy`) at once, or, refused or
unanswered, once a later receipt of the miner arrived or ``settle_s`` passed
(:meth:`AuditBook.settle`); :meth:`AuditBook.totals` are the counters a restarted validator
starts from.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Optional

from loguru import logger

from ..update_audit import SUPERSEDED

#: Weights versions a miner must keep for audits, counted back from the newest one it has named: a
#: ``LATE`` refusal for an older hop (or inner step) is within its rights, not a failure (the
#: validator's view lags the miner's: it is judged when the audit is settled).
REQUIRED_VERSIONS = 3


@dataclass
class AuditRecord:
    """One audit: ``kind`` (``hop`` | ``update``), ``raw`` outcome, ``final`` (after the policy),
    ``bytes``: the encoded messages plus 1 kB of headers each (the verification client's counters
    give the exact total), ``cpu_s`` validator CPU for the checks.
    ``final`` is ``""`` while an unanswered audit waits to be settled."""

    kind: str
    uid: int
    hotkey: str
    stage: int
    raw: str
    final: str = ""
    detail: str = ""
    direction: str = ""
    bytes: int = 0
    cpu_s: float = 0.0
    wall_s: float = 0.0
    tempo: int = 0
    version: Optional[tuple[int, int]] = None      # the weights version the audited work used / produced
    code: str = ""                                  # a refusal's outcome (e.g. LATE)
    reasks: int = 0                                 # requests asked again after a transport failure
    started: float = 0.0                            # time.monotonic() at its start
    #: when its last request first went unanswered (unix s; None: answered): the policy's audit time
    unanswered_since: Optional[float] = None


def _count(v: Any, kind: type = int) -> float:
    """A kept counter: a non-negative finite number of ``kind``, else 0 (an unreadable state entry)."""
    try:
        x = kind(v)
        return x if math.isfinite(x) and x >= 0 else 0
    except (TypeError, ValueError, OverflowError):      # int(inf), float of a 400-digit integer
        return 0


class AuditBook:
    """Outcomes and counters of :class:`~iota_subnet.validator.auditing.scheduler.AuditScheduler`
    (see the module docstring)."""

    def _finish(self, rec: AuditRecord, work_at: Optional[float]) -> AuditRecord:
        """``rec`` is done. A refused or unanswered one waits to be settled (:meth:`settle`, from now);
        the policy judges an unanswered one at the time its last request first went unanswered."""
        now = self.clock()
        at = rec.unanswered_since if rec.raw == "timeout" and rec.unanswered_since is not None else now
        self.done[(rec.tempo, rec.kind, rec.hotkey)] += 1
        if rec.raw in ("refused", "timeout") and self.settle_s > 0:
            self.unsettled.append((rec, work_at, at, now))
            return rec
        return self._record(rec, work_at, at)

    def settle(self, *, hotkey: Optional[str] = None, after: Optional[float] = None) -> list[AuditRecord]:
        """Record the unanswered audits of ``hotkey`` made before ``after`` (a receipt's time), and
        everyone's older than ``settle_s``."""
        now = self.clock()
        out, keep = [], []
        for rec, work_at, at, finished in self.unsettled:
            if (hotkey == rec.hotkey and after is not None and after > finished) or now - finished > self.settle_s:
                out.append(self._record(rec, work_at, at))
            else:
                keep.append((rec, work_at, at, finished))
        self.unsettled[:] = keep
        return out

    def _record(self, rec: AuditRecord, work_at: Optional[float], at: float) -> AuditRecord:
        latest = self.miners[rec.hotkey].latest
        if rec.raw == "refused" and rec.code == "LATE" and rec.version is not None \
                and (rec.version[1] < latest[1] or rec.version[0] <= latest[0] - REQUIRED_VERSIONS):
            rec.final = "outside window"      # it may drop that version by now: not counted, audit again
            self.done[(rec.tempo, rec.kind, rec.hotkey)] -= 1
            self.records.append(rec)
            logger.info("{} audit of uid {}: version {} is outside the window it must keep (newest named {}); "
                        "not counted", rec.kind, rec.uid, list(rec.version), list(latest))
            return rec
        if rec.code == SUPERSEDED and not self.policy.restarted_since((rec.uid, rec.hotkey), work_at or at, at):
            # two commitments of one step and no restart between them: the answer does not verify
            rec.raw, rec.detail = "failed", f"{rec.detail}; no restart announced between the two"
        rec.final = self.policy.record(rec.uid, rec.hotkey, rec.stage, rec.kind, rec.raw, work_at=work_at, at=at,
                                       detail=rec.detail)
        self.records.append(rec)
        self.audits += 1
        if rec.final not in ("passed", "excused"):
            self.failed += 1
        self.bytes += rec.bytes
        self.cpu_s += rec.cpu_s
        level = "INFO" if rec.final in ("passed", "excused") else "WARNING"
        logger.log(level, "{} audit of uid {} (stage {}{}): {} -> {} {}", rec.kind, rec.uid, rec.stage,
                   f", {rec.direction}" if rec.direction else "", rec.raw, rec.final, rec.detail[:160])
        return rec

    def per_tempo(self, kind: str = "hop") -> dict[int, dict[str, int]]:
        """tempo -> hotkey -> audits of ``kind`` run in it."""
        out: dict[int, dict[str, int]] = defaultdict(dict)
        for (tempo, k, hk), n in self.done.items():
            if k == kind:
                out[tempo][hk] = n
        return dict(out)

    def totals(self) -> dict:
        """The counters to keep across restarts (``totals`` of the next process)."""
        return {"audits": self.audits, "failed": self.failed, "bytes": self.bytes, "cpu_s": round(self.cpu_s, 3),
                "reasked": self.reasked, "reasked_answered": self.reasked_answered}

    def status(self) -> dict:
        return {"audits": self.audits, "failed": self.failed, "bytes": self.bytes, "cpu_s": round(self.cpu_s, 3),
                "reasked": self.reasked, "reasked_answered": self.reasked_answered,
                "recent": [vars(r) for r in list(self.records)[-8:]]}
