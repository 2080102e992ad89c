"""The audit scheduler: rounds per tempo, audits run concurrently, re-asks and health probes.

See the package docstring (:mod:`iota_subnet.validator.auditing`). :class:`AuditScheduler` composes
its parts: :class:`~.inputs.AuditInputs`, :class:`~.hops.HopAudits`, :class:`~.updates.UpdateAudits`,
:class:`~.records.AuditBook`.
"""
from __future__ import annotations

import asyncio
import contextvars
import random
import time
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from loguru import logger

from iota_subnet.audit.challenge import SamplingParams
from iota_subnet.audit.check import Tolerances
from iota_subnet.audit.layout import TraceLayout
from iota_subnet.config import RunConfig
from iota_subnet.protocol import Health, ProtocolError, Ticket
from iota_subnet.transport import TransportError

from ..audit_policy import AuditPolicy
from ..deadlines import DeadlineRates
from ..routing import Replica
from ..update_audit import UpdateAuditor
from .hops import HopAudits
from .inputs import AuditInputs, _MinerView
from .records import AuditBook, AuditRecord, _count
from .updates import UpdateAudits

#: set in an audit's task while it holds one of the scheduler's ``concurrency`` slots (:meth:`AuditScheduler.round`)
_HOLDS_SLOT: contextvars.ContextVar[bool] = contextvars.ContextVar("holds_audit_slot", default=False)


@dataclass(frozen=True)
class AuditSchedulerOptions:
    """The settings of an :class:`AuditScheduler` (see the package docstring for what each bounds).

    ``sampling``: how much one hop audit opens; ``timeout_s``: the floor of a round's deadline
    (seconds); ``fresh_s``: receipts older than that (seconds) are not drawn; ``hops_per_tempo``,
    ``updates_per_tempo``: audits of each kind per miner and tempo; ``commit_grace_s``: seconds a
    step's update commitment may come after the receipts showed the step; ``settle_s``: seconds
    after which an unanswered audit is settled without a later receipt; ``concurrency``: miners
    audited at once; ``retry_delays_s``: seconds before each re-ask of a request that failed on the
    transport (per request: a hop audit's three rounds each have them; ``()``: none);
    ``max_audit_s``: no re-ask after that many seconds from the audit's start. ``rng``: where the
    draws come from (None: the OS CSPRNG); ``clock()``: unix seconds. ``totals``: the counters of
    this validator's earlier processes (:meth:`AuditScheduler.totals`, kept in its state), so that a
    restarted validator reports every audit of the run, not those since its start (None: from 0).
    ``target_rows(ticket)``: the ticket's rows with the targets the loss mask leaves untrained set to
    ``-100`` (None: the scheduler's ``rows``), the targets of a replayed tail hop
    (:mod:`iota_subnet.audit.replay`).
    """

    sampling: SamplingParams = SamplingParams()
    timeout_s: float = 30.0
    fresh_s: float = 10.0
    hops_per_tempo: int = 1
    updates_per_tempo: int = 1
    commit_grace_s: float = 10.0
    settle_s: float = 120.0
    concurrency: int = 4
    retry_delays_s: tuple[float, ...] = (5.0, 15.0)
    max_audit_s: float = 180.0
    rng: Optional[random.Random] = None
    clock: Callable[[], float] = time.time
    totals: Optional[dict] = None
    target_rows: Optional[Callable[[Ticket], torch.Tensor]] = None


class AuditScheduler(AuditInputs, HopAudits, UpdateAudits, AuditBook):
    """Chooses and runs the audits of one validator (see the package docstring, :mod:`iota_subnet.validator.auditing`).

    ``client``: the validator's verification client (:class:`~iota_subnet.transport.NeuronClient`;
    its byte counters are the verification traffic); ``policy``: where outcomes go; ``rows(ticket)``:
    the token rows ``[B, T + 1]`` of a ticket's sample address (head tokens, tail targets);
    ``lookup(hotkey)``: the miner's :class:`Replica` (uid, endpoint, stage) or None;
    ``options.target_rows``: the targets of a replayed tail hop (see :class:`AuditSchedulerOptions`);
    ``update_auditor``: None turns update audits off; ``options``: :class:`AuditSchedulerOptions`
    (its settings are kept as attributes of the same names).
    """

    def __init__(self, cfg: RunConfig, *, run_id: str, client: Any, policy: AuditPolicy,
                 rows: Callable[[Ticket], torch.Tensor], lookup: Callable[[str], Optional[Replica]],
                 update_auditor: Optional[UpdateAuditor] = None,
                 options: AuditSchedulerOptions = AuditSchedulerOptions()):
        o = options
        self.cfg, self.run_id, self.client, self.policy = cfg, run_id, client, policy
        self.rows, self.lookup, self.update_auditor = rows, lookup, update_auditor
        self.target_rows = o.target_rows or rows
        self.sampling = o.sampling.validate()
        self.timeout_s, self.fresh_s = float(o.timeout_s), float(o.fresh_s)
        #: round deadlines from the work asked (``timeout_s`` is their floor): :mod:`..deadlines`
        self.deadlines = DeadlineRates(floor_s=self.timeout_s)
        self.hops_per_tempo, self.updates_per_tempo = int(o.hops_per_tempo), int(o.updates_per_tempo)
        self.commit_grace_s, self.settle_s = float(o.commit_grace_s), float(o.settle_s)
        self.concurrency = max(1, int(o.concurrency))
        #: seconds to wait before each re-ask of an audit request that failed on the transport
        self.retry_delays_s = tuple(max(0.0, float(d)) for d in o.retry_delays_s)
        self.max_audit_s = float(o.max_audit_s)
        #: seconds a miner has to answer the health probe after an unanswered audit (see _probe_health)
        self.probe_timeout_s = 5.0
        #: unanswered audits waiting to be settled: (record, work_at, policy time, finished), unix s
        self.unsettled: list[tuple[AuditRecord, Optional[float], float, float]] = []
        self.rng = o.rng or random.SystemRandom()   # the OS CSPRNG: draws a miner cannot predict
        self.clock = o.clock
        self.tol = Tolerances.for_precision(cfg.train.precision)
        self.micro_per_step = cfg.train.batch_size // cfg.train.micro_batch
        self.n_stages = cfg.pipeline.stages
        self.miners: dict[str, _MinerView] = defaultdict(_MinerView)
        #: (tempo, kind, hotkey) -> audits run
        self.done: dict[tuple[int, str, str], int] = defaultdict(int)
        self.records: deque[AuditRecord] = deque(maxlen=512)
        t = o.totals if isinstance(o.totals, dict) else {}
        self.audits = _count(t.get("audits"))
        self.failed = _count(t.get("failed"))
        self.bytes = _count(t.get("bytes"))
        self.cpu_s = float(_count(t.get("cpu_s"), float))
        #: re-asks made; audits answered after at least one re-ask
        self.reasked = _count(t.get("reasked"))
        self.reasked_answered = _count(t.get("reasked_answered"))
        self._layouts: dict[tuple, TraceLayout] = {}
        #: (hotkey, kind) -> its audit of that kind still running (see :meth:`round`)
        self._inflight: dict[tuple[str, str], asyncio.Task] = {}
        self._sem = asyncio.Semaphore(self.concurrency)
    # ---- rounds ----------------------------------------------------------------------------------
    async def round(self, tempo: int, wait_s: Optional[float] = None) -> list[AuditRecord]:
        """Run the audits due in ``tempo``: each miner's update and hop audit at once, up to
        ``concurrency`` audits at once (each mostly waits for the audited miner). Returns the
        records finished by the time it returns. ``wait_s``: wait at most that long (seconds; None:
        until all are done); audits still running go on in the background, and a miner gets no new
        audit of a kind while one of that kind is in flight: a miner that lets its audits time out
        delays only those, not its other audits nor anyone else's."""
        out: list[AuditRecord] = self.settle()
        for key in [k for k, t in self._inflight.items() if t.done()]:
            out += self._collect(self._inflight.pop(key))
        hotkeys = list(self.miners)
        self.rng.shuffle(hotkeys)
        sem = self._sem

        async def limited(fn, rep) -> list[AuditRecord]:
            async with sem:
                _HOLDS_SLOT.set(True)        # this task's context: a re-ask frees the slot while it waits
                r = await fn(rep, tempo)
            return [] if r is None else [r]
        started: dict[tuple[str, str], asyncio.Task] = {}
        for hk in hotkeys:
            rep = self.lookup(hk)
            if rep is None:
                continue
            out += [r for r in self._missing_commitments(rep, tempo) if r is not None]
            due = []
            if self.update_auditor is not None and self.done.get((tempo, "update", hk), 0) < self.updates_per_tempo:
                due.append(("update", self.audit_update))
            if self.done.get((tempo, "hop", hk), 0) < self.hops_per_tempo:
                due.append(("hop", self.audit_hop))
            for kind, fn in due:
                if (hk, kind) not in self._inflight:
                    started[(hk, kind)] = asyncio.create_task(limited(fn, rep))
        self._inflight.update(started)
        if started:
            await asyncio.wait(list(started.values()), timeout=wait_s)
        for key in [k for k in started if started[k].done()]:
            out += self._collect(self._inflight.pop(key))
        return out

    @staticmethod
    def _collect(task: "asyncio.Task") -> list[AuditRecord]:
        if task.cancelled():
            return []
        e = task.exception()
        if e is not None:
            logger.warning("an audit failed to run: {}: {}", type(e).__name__, e)
            return []
        return task.result()

    async def close(self) -> None:
        """Cancel the audits still in flight."""
        for t in self._inflight.values():
            t.cancel()
        await asyncio.gather(*self._inflight.values(), return_exceptions=True)
        self._inflight.clear()

    # ---- re-asks and health probes -------------------------------------------------------------
    def _count_reasks(self, rec: AuditRecord) -> None:
        if rec.reasks and rec.raw != "timeout":
            self.reasked_answered += 1

    def _unanswered(self, rec: AuditRecord) -> None:
        if rec.unanswered_since is None:
            rec.unanswered_since = self.clock()

    async def _reask(self, rep: Replica, rec: AuditRecord, what: str, why: str, delays: deque) -> bool:
        """A request of ``rep``'s audit ``rec`` went unanswered: probe ``/health`` (noted if unreachable
        now: it may be back by the last re-ask), then wait the next of ``delays`` (consumed; the audit
        slot is free meanwhile). False when no re-ask is left (none in ``delays``, or past ``max_audit_s``)."""
        self._unanswered(rec)
        await self._probe_health(rep)
        if not delays or time.monotonic() + delays[0] - rec.started > self.max_audit_s:
            return False
        delay = delays.popleft()
        self.reasked += 1
        rec.reasks += 1
        logger.info("{} audit of uid {}: {} unanswered ({}); asking again in {:.0f} s ({} re-ask(s) left)",
                    rec.kind, rep.uid, what, why[:160], delay, len(delays))
        held = _HOLDS_SLOT.get()
        if held:
            self._sem.release()
        try:
            await asyncio.sleep(delay)
        finally:
            if held:
                await self._sem.acquire()
        return True

    async def _probe_health(self, rep: Replica) -> None:
        """An audit of ``rep`` went unanswered: is the miner unreachable altogether? A ``/health``
        probe that goes unanswered too is noted (:meth:`AuditPolicy.note_unreachable`): an honest
        fault (partitioned, paused, dying), excused within the policy's bound. A miner that answers
        the probe but not the audit is dodging it."""
        try:
            await self.client.call(rep.endpoint, rep.hotkey, "/health", Health(run_id=self.run_id, stage=rep.stage),
                                   Health, timeout_s=self.probe_timeout_s, retries=0)
        except (ProtocolError, TransportError, asyncio.TimeoutError):
            self.policy.note_unreachable(rep.key, self.clock())
