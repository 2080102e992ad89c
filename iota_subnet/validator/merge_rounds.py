"""The validator's side of replica merges: collecting the replicas' merge mismatch evidence, checking
every accusation (:class:`~.merge_audit.MergeAuditor`), deciding and publishing each replica's
weight in its stage's merge (:class:`~.merge_weights.MergeOversight`), and how long a merge may
pause the lanes before a tempo without lane steps counts as stalled."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from loguru import logger

from iota_subnet.chain import ChainError
from iota_subnet.merge.deadlines import phase_deadline_s
from iota_subnet.model import make_stage
from iota_subnet.protocol import MergeAuditResponse

from .audit_policy import AuditPolicy
from .merge_audit import MergeAuditor, record_verdicts
from .merge_weights import MergeOversight
from .options import MergeOptions


class MergeRounds:
    """Merge oversight of one validator of run ``run_id``; :meth:`open` with the run config turns it on
    when the run merges replicas. :attr:`weights`: the merge weights last decided (uid -> weight),
    part of the validator's commitment."""

    def __init__(self, opts: MergeOptions, run_id: str):
        self.opts = opts
        self.run_id = run_id
        self.cfg: Any = None
        self.oversight: Optional[MergeOversight] = None   # when the run merges replicas (see open)
        self.auditor: Optional[MergeAuditor] = None       # checks merge accusations, likewise
        self.weights: dict[int, float] = {}
        self._numel: dict[int, int] = {}

    def open(self, cfg: Any) -> None:
        """The run config is known: with merging on, collect evidence and check accusations."""
        self.cfg = cfg
        if cfg.merge.enabled:
            self.oversight = MergeOversight(self.run_id)
            self.auditor = MergeAuditor(self.run_id, self.stage_numel, gather_quant=cfg.merge.gather_quant,
                                        int8_block=cfg.merge.int8_block)

    def stage_numel(self, stage: int) -> int:
        """Parameters of ``stage`` (counted once, on the meta device)."""
        n = self._numel.get(stage)
        if n is None:
            with torch.device("meta"):
                n = self._numel[stage] = sum(p.numel() for p in make_stage(self.cfg.model, self.cfg.pipeline, stage,
                                                                           init=False).parameters())
        return n

    def allowance_s(self) -> float:
        """The longest a merge may pause the lanes before a tempo without lane steps counts as stalled:
        ``merge.max_attempts`` x (its join timeout plus the deadline of a scatter and a gather of the
        largest stage in fp32 at the declared uplink, ``merge.assumed_uplink_bps``;
        :mod:`iota_subnet.merge.deadlines`). Not the floor rate a moving merge may go down to: that
        would excuse lanes held at a merge boundary for hours."""
        mc = self.cfg.merge
        if not mc.enabled:
            return 0.0
        largest = max(self.stage_numel(s) for s in range(self.cfg.pipeline.stages))
        return mc.max_attempts * (mc.join_timeout_s + phase_deadline_s(mc, 2 * 4 * largest))

    async def round(self, client: Any, router: Any, ledger: Any, audits: AuditPolicy) -> None:
        """With merging on: collect the replicas' merge mismatch evidence over ``client`` and check every
        accusation (this validator recomputes the disputed shard from the participants' signed
        slices); the verdicts go to ``audits``: a reducer proven wrong, or an accuser whose evidence
        does not hold, is flagged (weight 0, merge weight 0)."""
        mo = self.oversight
        if mo is None or router is None:
            return
        live = router.live_replicas()
        new = await mo.collect(client, live)
        if new:
            logger.info("merge evidence: {} new report(s) from the replicas", new)
        who = {hk: (uid, rec.stage) for (uid, hk), rec in ledger.records.items()}
        who.update({r.hotkey: (r.uid, r.stage) for r in live})
        endpoints = {r.hotkey: r.endpoint for r in live}

        async def fetch(hotkey: str, req):
            ep = endpoints.get(hotkey)
            if ep is None:
                raise ConnectionError(f"no endpoint for {hotkey[:10]}")
            return await client.call(ep, hotkey, "/audit/merge", req, MergeAuditResponse,
                                     timeout_s=self.opts.hop_timeout_s, retries=1)
        verdicts = await mo.verify(self.auditor, fetch)
        for v in verdicts:
            logger.log("WARNING" if v.penalise else "INFO", "merge accusation by {} against {}: {} ({})",
                       v.reporter[:10], v.accused[:10], v.outcome, v.detail)
        record_verdicts(audits, verdicts, who)

    async def publish(self, ledger: Any, current: dict[int, str], flagged: set, publisher: Any,
                      advert: Callable[[], str]) -> None:
        """Publish each replica's weight in its stage's merge (in the commitment ``advert()`` encodes,
        through ``publisher``), when it changed; ``flagged``: (uid, hotkey) of miners flagged as cheaters."""
        mo = self.oversight
        if mo is None:
            return
        uids = [uid for (uid, hk) in ledger.records if current.get(uid) == hk]
        cheaters = {uid for uid, hk in flagged if current.get(uid) == hk}
        decided = mo.decided(uids, cheaters)
        if decided == self.weights:
            return
        self.weights = decided
        publisher.set_commitment(advert())
        try:
            await publisher.sync()
            logger.info("merge weights published: {}", decided)
        except ChainError as e:
            logger.warning("merge weights not published yet: {}", e)
