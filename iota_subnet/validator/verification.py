"""The validator's audits: the :class:`~.audit_policy.AuditPolicy` (outcomes of update audits, hop
audits and merge checks, and the flags scoring reads) and, while lanes are driven, the
:class:`~.auditing.AuditScheduler` that audits every miner ``audits_per_tempo`` times per tempo over
the verification client. Flags and audit counters persist in the validator's state."""
from __future__ import annotations

import json
from typing import Any, Optional

from loguru import logger

from .audit_policy import AuditPolicy
from .auditing import AuditScheduler, AuditSchedulerOptions
from .options import AuditOptions
from .state import ValidatorState
from .update_audit import UpdateAuditor


class Verification:
    """Audit outcomes (:attr:`audits`) and the audit scheduler (:attr:`auditing`, None when audits are
    off or no lanes are driven yet) of one validator of run ``run_id``."""

    def __init__(self, opts: AuditOptions, run_id: str):
        self.opts = opts
        self.run_id = run_id
        #: outcomes of audits (update audits, hop audits, merge checks) and their excuses
        self.audits = AuditPolicy()
        self.auditing: Optional[AuditScheduler] = None
        self.loaded = False   # audit records read from the state (see load)

    def open_scheduler(self, cfg: Any, dataset: Any, router: Any, client: Any, state: ValidatorState) -> None:
        """The audit scheduler: receipts in, audits over the verification ``client``, outcomes into
        :attr:`audits` (the policy that scoring reads); its counters go on from the ``state``'s."""
        def rows(t):
            return dataset.split_batch(t.split, t.seed, t.start, t.rows)

        def target_rows(t):
            # the tail trains on targets the loss mask (data.hf.mask_field) marks ignored (-100): so does its replay
            return dataset.target_batch(t.split, t.seed, t.start, t.rows)

        def lookup(hotkey: str):
            # a miner the router holds as failed (cooling down) is not audited: it is away, not dodging
            return next((r for r in router.live_replicas() if r.hotkey == hotkey and router.is_available(r)), None)
        o = self.opts
        options = AuditSchedulerOptions(timeout_s=o.audit_timeout_s, hops_per_tempo=o.audits_per_tempo,
                                        updates_per_tempo=o.audits_per_tempo, retry_delays_s=o.audit_retry_s,
                                        totals=self._load_totals(state), target_rows=target_rows)
        self.auditing = AuditScheduler(cfg, run_id=self.run_id, client=client, policy=self.audits, rows=rows,
                                       lookup=lookup,
                                       update_auditor=UpdateAuditor(cfg, run_id=self.run_id,
                                                                    total_steps=cfg.train.total_steps),
                                       options=options)

    async def round(self, block: int, tempo: int) -> None:
        """One audit round: the miners still due in the tempo of ``block``."""
        if self.auditing is None:
            return
        await self.auditing.round(block // max(1, tempo), wait_s=self.opts.audit_interval_s)

    def load(self, state: ValidatorState) -> None:
        """The audit records (flags included) of this validator's earlier processes."""
        self.loaded = True
        raw = state.get_meta("audits")
        if raw:
            self.audits.load_dict(json.loads(raw))

    @staticmethod
    def _load_totals(state: ValidatorState) -> dict:
        """The audit counters of this validator's earlier processes ({} when none or unreadable)."""
        try:
            raw = json.loads(state.get_meta("audit_totals") or "{}")
        except ValueError:
            logger.warning("validator state: unreadable audit totals; counting audits from 0")
            return {}
        return raw if isinstance(raw, dict) else {}

    def save_flags(self, state: ValidatorState) -> None:
        """Save the audit records (flags included), once they were loaded (a start-up that failed
        before :meth:`load` must not overwrite them with empty ones)."""
        if self.loaded:
            state.set_meta("audits", json.dumps(self.audits.to_dict()))

    def save_totals(self, state: ValidatorState) -> None:
        if self.auditing is not None:
            state.set_meta("audit_totals", json.dumps(self.auditing.totals()))

    async def close(self, forget: bool = False) -> None:
        """Stop the audit scheduler; ``forget``: drop it too (a restarted lane driving opens a new one;
        otherwise its records and counters stay readable)."""
        if self.auditing is not None:
            await self.auditing.close()
            if forget:
                self.auditing = None
