"""Update audits: a miner's inner step checked against its commitment, and the commitments its receipts show missing.

A part of :class:`~iota_subnet.validator.auditing.scheduler.AuditScheduler`. One of a miner's two
latest update commitments is audited (:class:`~iota_subnet.validator.update_audit.UpdateAuditor`)
once its weights roots are the ones its receipts named; the receipts alone show an inner step with
no commitment (``refused``) and a weights root unchanged over :data:`STALE_STEPS` claimed steps
(``failed``: the ``stale`` cheat).
"""
from __future__ import annotations

import time
from collections import deque
from typing import Optional

from iota_subnet.protocol import UpdateCommit

from ..deadlines import update_audit_work
from ..routing import Replica
from .records import AuditRecord

#: Consecutive inner steps with an unchanged weights root that count as "no update applied".
STALE_STEPS = 3


class UpdateAudits:
    """Update audits of :class:`~iota_subnet.validator.auditing.scheduler.AuditScheduler` (see the module docstring)."""

    def pick_commit(self, hotkey: str) -> Optional[UpdateCommit]:
        view = self.miners[hotkey]
        recent = [c for c, _ in list(view.commits)[-2:]
                  if (c.step, c.merges) not in view.audited_commits and c.at >= view.boot]
        return self.rng.choice(recent) if recent else None

    def _bound(self, hotkey: str, commit: UpdateCommit) -> str:
        """Why ``commit``'s weights roots are not the ones the miner's receipts named ("" when they are)."""
        roots = self.miners[hotkey].roots
        for kind, v in (("w0", (commit.step, commit.merges)), ("w1", (commit.step + 1, commit.merges))):
            named = roots.get(v)
            if named is not None and named[0] != commit.roots[kind]:
                return (f"update commitment of step {commit.step}: {kind} root {commit.roots[kind][:12]} is not the "
                        f"weights version {list(v)} its receipts named ({named[0][:12]})")
        return ""

    async def audit_update(self, rep: Replica, tempo: int) -> Optional[AuditRecord]:
        commit = self.pick_commit(rep.hotkey)
        if commit is None:
            return None
        self.miners[rep.hotkey].audited_commits.add((commit.step, commit.merges))
        rec = AuditRecord("update", rep.uid, rep.hotkey, rep.stage, "passed", tempo=tempo,
                          version=(commit.step + 1, commit.merges))
        wrong = self._bound(rep.hotkey, commit)
        if wrong:
            rec.raw, rec.detail = "failed", wrong
            return self._finish(rec, commit.at or None)
        delays, sent = deque(self.retry_delays_s), 0
        rec.started = time.monotonic()
        req = self.update_auditor.plan(rep.stage, commit)
        sizes = {p.name: p.row_numel for p in self.update_auditor.layout(rep.stage)}
        deadline = self.deadlines.deadline_s(*update_audit_work([sizes.get(str(n), 0) for n, _ in req.rows]))
        while True:      # the same request again after a transport failure: same rows, nothing new revealed
            res = await self.update_auditor.audit(self.client, rep.endpoint, rep.hotkey, rep.stage, commit,
                                                  timeout_s=deadline, req=req)
            if res.outcome != "timeout" or not await self._reask(rep, rec, f"step {commit.step}", res.detail, delays):
                break
            sent += res.bytes
        if res.outcome != "timeout":
            rec.unanswered_since = None
        rec.cpu_s = res.cpu_s
        rec.raw, rec.detail = res.outcome, f"step {commit.step}: {res.detail}"
        rec.wall_s = time.monotonic() - rec.started
        self._count_reasks(rec)
        rec.code = res.detail.split(":", 1)[0] if res.outcome == "refused" else ""
        rec.bytes = res.bytes + sent
        return self._finish(rec, commit.at or None)

    def _missing_commitments(self, rep: Replica, tempo: int) -> list[AuditRecord]:
        """What the miner's receipts show of its inner steps, without asking it (at most one record
        per tempo):

        * its weights changed from version ``(k, m)`` to ``(k + 1, m)`` (an inner step), the later one
          first seen over ``commit_grace_s`` ago, and no commitment of step k came: a ``refused``
          update audit;
        * its weights root stayed the same over ``STALE_STEPS`` consecutive inner steps it claims (no
          optimizer update applied: the ``stale`` cheat; an honest miner's weights change at every
          inner step but one skipped for a non-finite gradient, which its commitment says, or a
          lone catch-up to its lane's step): a ``failed`` update audit. Commitments marked skipped
          excuse such a run only for steps it did not report training whole: a jump to its lane's
          step skips steps it never saw or had only begun (their micro-batches are dropped), while a
          miner that trains every micro-batch of its steps and calls every update skipped is the
          ``stale`` cheat with an alibi (one such step is allowed: a non-finite gradient).
        """
        if self.update_auditor is None or self.done.get((tempo, "update-missing", rep.hotkey)):
            return []
        view = self.miners[rep.hotkey]
        now = self.clock()
        have = view.committed
        for (k, m), (root, seen) in sorted(view.roots.items()):
            if (k, m) in view.checked_steps or (k - 1, m) not in view.roots:
                continue
            run = [view.roots.get((k - i, m), ("", 0))[0] for i in range(STALE_STEPS + 1)]
            if now - seen < (min(2.0, self.commit_grace_s) if len(set(run)) == 1 else self.commit_grace_s):
                continue
            view.checked_steps.add((k, m))
            rec = None
            skipped = [have[(k - i - 1, m)] for i in range(STALE_STEPS) if (k - i - 1, m) in have]
            alibi = sorted(k - i - 1 for i in range(STALE_STEPS) if have.get((k - i - 1, m))
                           and k - i - 1 in view.trained)
            if len(set(run)) == 1 and (not all(skipped or [False]) or len(alibi) > 1):
                why = (f"; its commitments call the updates of inner steps {alibi} skipped, yet it reported "
                       f"training their micro-batches" if len(alibi) > 1 and all(skipped) else "")
                rec = AuditRecord("update", rep.uid, rep.hotkey, rep.stage, "failed",
                                  detail=f"its weights root stayed {root[:12]} over inner steps {k - STALE_STEPS}.."
                                         f"{k} it claims (no optimizer update applied){why}", tempo=tempo)
            elif root != view.roots[(k - 1, m)][0] and (k - 1, m) not in have \
                    and (k - 1, m) not in view.audited_commits:
                rec = AuditRecord("update", rep.uid, rep.hotkey, rep.stage, "refused",
                                  detail=f"no update commitment of inner step {k - 1} (its weights changed from "
                                         f"version {[k - 1, m]} to {[k, m]})", tempo=tempo)
            if rec is not None:
                self.done[(tempo, "update-missing", rep.hotkey)] += 1
                return [self._finish(rec, seen)]
        return []
