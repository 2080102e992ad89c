"""The validator's audit scheduler for the data plane: which hops and inner
steps to audit, when, and what the outcome means.

Inputs (nothing here waits for training, nor training for it)
    * every receipt this validator accepted (:meth:`AuditScheduler.on_receipt`): a training hop the
      miner claims, with the roots it is bound to (the wire tensors ``fin``/``fout``/``bin``/``bout``,
      the weights version ``wroot``, the tail's loss) and the miner's boot time (a new one announces
      a restart: :meth:`~.audit_policy.AuditPolicy.announce_restart`);
    * the update commitments of its receipt batches (:meth:`AuditScheduler.on_updates`);
    * training hop outcomes (:meth:`AuditScheduler.on_hop`: the "down" excuse of the policy).

Choice (blind)
    Audits are chosen only after the replies are in, with an OS-seeded RNG, at the moment the audit
    starts: for every miner not yet audited in the current tempo (``hops_per_tempo``), one of its
    receipts of the last ``fresh_s`` seconds that used one of the two latest weights versions it
    named, uniformly (those hops are still in its audit window of ``K >= 3`` versions);
    the direction follows the stage: the head's forward, every other stage's backward (which
    re-checks its forward too; a middle stage's backward whose weights changed after its forward
    leaves the forward output out). Update audits: ``updates_per_tempo`` per miner, of one of its two
    latest commitments (the miner keeps a few steps), whose weights roots must also be the ones its
    receipts named for the versions before and after the step.

Outcomes (:class:`~.audit_policy.AuditPolicy`)
    ``passed``, ``failed`` (the answer does not verify), ``refused`` (a typed refusal: ``LATE`` for
    a hop outside the window, ...), ``timeout`` (no answer in ``timeout_s``). Refusals and timeouts
    are failures unless the policy excuses them (down, restarted); to give a miner that restarted
    the chance to announce it (its first receipts after the restart carry its new boot time), an
    unanswered audit is settled only once a receipt from the miner arrived after it, or after
    ``settle_s`` seconds (then the "down" excuse may apply). A request of an audit that fails on the
    transport (a dropped connection, no answer in ``timeout_s``) is asked again after each of
    ``retry_delays_s`` (default 5 s, then 15 s), before it counts as unanswered: a link that drops for
    a few seconds must not make an honest miner's audit a failure (two unanswered audits flag a
    miner by default: :mod:`.audit_policy`), and a miner that drops every audit still fails after the last
    re-ask. A re-ask reveals nothing new: every request is sent again unchanged, the same audit id,
    seed and rows (the miner answers them again, :mod:`~iota_subnet.miner.hop_audit_routes`), so a
    dropped connection never buys a miner a second challenge; an audit gets no re-ask past
    ``max_audit_s`` from its start, and holds no audit slot while it waits. The miner's ``/health``
    is probed after every failed attempt (the "down" excuse: a miner paused or partitioned at the
    first attempt may be back by the last), and the policy judges an unanswered audit at the time its
    last request first went unanswered. A miner whose receipts show it
    took inner step k (its weights changed from version ``(k, m)`` to ``(k + 1, m)``) but whose
    commitment of step k never came within ``commit_grace_s`` gets an update audit counted
    ``refused``; one whose weights root stayed the same over :data:`STALE_STEPS` inner steps it
    claims, a ``failed`` one (the ``stale`` cheat: it claims steps it never took).

Costs (``scripts/bench_verification.py``, ``docs/hop-audit.md``): one hop audit is six signed
messages: ``tiny`` 0.25 MB (head forward) to 0.74 MB (middle backward); an update audit ~30 kB.
Validator CPU: 0.03-0.2 s a hop audit (checks on a worker thread).
"""
from __future__ import annotations

import asyncio
import contextvars
import math
import random
import time
import uuid
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from loguru import logger

from iota_subnet.audit import codec
from iota_subnet.audit.auditor import AuditFailure, HopAuditor
from iota_subnet.audit.challenge import SamplingParams
from iota_subnet.audit.check import Tolerances
from iota_subnet.audit.layout import BACKWARD, FORWARD, LayoutError, TraceLayout
from iota_subnet.config import RunConfig
from iota_subnet.protocol import (AuditOpening, AuditProjection, AuditTraceCommit, AuditTraceRequest, Health,
                                  ProtocolError, Ticket, UpdateCommit, encode)
from iota_subnet.protocol.receipt import Receipt
from iota_subnet.transport import TransportError

from .deadlines import DeadlineRates, hop_round_work, update_audit_work
from .audit_policy import AuditPolicy
from .routing import Replica
from .update_audit import HTTP_HEADER_BYTES, SUPERSEDED, UpdateAuditor

#: Hop candidates kept per miner (the most recent receipts).
MAX_CANDIDATES = 64
#: Consecutive inner steps with an unchanged weights root that count as "no update applied".
STALE_STEPS = 3
#: Weights versions a miner must keep for audits, counted back from the newest one it has named: a
#: ``LATE`` refusal for an older hop (or inner step) is within its rights, not a failure (the
#: validator's view lags the miner's: it is judged when the audit is settled).
REQUIRED_VERSIONS = 3


@dataclass
class HopCandidate:
    """A training hop a miner reported: its ticket, its receipt, when the receipt arrived."""

    ticket: Ticket
    receipt: Receipt
    hotkey: str
    received: float


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


@dataclass
class _MinerView:
    key: Optional[tuple[int, str]] = None      # (uid, hotkey) when last looked up
    boot: float = 0.0
    latest: tuple[int, int] = (-1, -1)          # newest weights version its current process named
    candidates: deque = field(default_factory=lambda: deque(maxlen=MAX_CANDIDATES))
    commits: deque = field(default_factory=lambda: deque(maxlen=8))
    #: (step, merges) -> skipped, of every commitment received (the newest 1024)
    committed: dict = field(default_factory=dict)
    audited_commits: set = field(default_factory=set)
    #: weights version -> (root hex, first seen)
    roots: dict = field(default_factory=dict)
    checked_steps: set = field(default_factory=set)
    #: lane step -> indices of its micro-batches it reported accumulating (the route's own miner);
    #: ``trained``: the steps it reported accumulating every micro-batch of
    backwards: dict = field(default_factory=dict)
    trained: set = field(default_factory=set)


#: set in an audit's task while it holds one of the scheduler's ``concurrency`` slots (:meth:`AuditScheduler.round`)
_HOLDS_SLOT: contextvars.ContextVar[bool] = contextvars.ContextVar("holds_audit_slot", default=False)


def _why(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _thread_timed(fn: Callable, *args) -> tuple[Any, float]:
    t0 = time.thread_time()
    out = fn(*args)
    return out, time.thread_time() - t0


def _count(v: Any, kind: type = int) -> float:
    """A kept counter: a non-negative finite number of ``kind``, else 0 (an unreadable state entry)."""
    try:
        x = kind(v)
        return x if math.isfinite(x) and x >= 0 else 0
    except (TypeError, ValueError, OverflowError):      # int(inf), float of a 400-digit integer
        return 0


class AuditScheduler:
    """Chooses and runs the audits of one validator (see the module docstring).

    ``client``: the validator's verification client (:class:`~iota_subnet.transport.NeuronClient`;
    its byte counters are the verification traffic); ``policy``: where outcomes go; ``rows(ticket)``:
    the token rows ``[B, T + 1]`` of a ticket's sample address (head tokens, tail targets);
    ``lookup(hotkey)``: the miner's :class:`Replica` (uid, endpoint, stage) or None;
    ``update_auditor``: None turns update audits off; ``concurrency``: miners audited at once;
    ``retry_delays_s``: seconds before each re-ask of a request that failed on the transport (per
    request: a hop audit's three rounds each have them; ``()``: none); ``max_audit_s``: no re-ask
    after that many seconds from the audit's start.
    ``totals``: the counters of this validator's earlier processes (:meth:`totals`, kept in its
    state), so that a restarted validator reports every audit of the run, not those since its start.
    """

    def __init__(self, cfg: RunConfig, *, run_id: str, client: Any, policy: AuditPolicy,
                 rows: Callable[[Ticket], torch.Tensor], lookup: Callable[[str], Optional[Replica]],
                 update_auditor: Optional[UpdateAuditor] = None, sampling: SamplingParams = SamplingParams(),
                 timeout_s: float = 30.0, fresh_s: float = 10.0, hops_per_tempo: int = 1, updates_per_tempo: int = 1,
                 commit_grace_s: float = 10.0, settle_s: float = 120.0, concurrency: int = 4,
                 retry_delays_s: tuple[float, ...] = (5.0, 15.0), max_audit_s: float = 180.0,
                 rng: Optional[random.Random] = None,
                 totals: Optional[dict] = None, clock: Callable[[], float] = time.time):
        self.cfg, self.run_id, self.client, self.policy = cfg, run_id, client, policy
        self.rows, self.lookup, self.update_auditor = rows, lookup, update_auditor
        self.sampling = sampling.validate()
        self.timeout_s, self.fresh_s = float(timeout_s), float(fresh_s)
        #: round deadlines from the work asked (``timeout_s`` is their floor): :mod:`.deadlines`
        self.deadlines = DeadlineRates(floor_s=self.timeout_s)
        self.hops_per_tempo, self.updates_per_tempo = int(hops_per_tempo), int(updates_per_tempo)
        self.commit_grace_s, self.settle_s = float(commit_grace_s), float(settle_s)
        self.concurrency = max(1, int(concurrency))
        #: seconds to wait before each re-ask of an audit request that failed on the transport
        self.retry_delays_s = tuple(max(0.0, float(d)) for d in retry_delays_s)
        self.max_audit_s = float(max_audit_s)
        #: seconds a miner has to answer the health probe after an unanswered audit (see _probe_health)
        self.probe_timeout_s = 5.0
        #: unanswered audits waiting to be settled: (record, work_at, policy time, finished), unix s
        self.unsettled: list[tuple[AuditRecord, Optional[float], float, float]] = []
        self.rng = rng or random.SystemRandom()   # the OS CSPRNG: draws a miner cannot predict
        self.clock = clock
        self.tol = Tolerances.for_precision(cfg.train.precision)
        self.micro_per_step = cfg.train.batch_size // cfg.train.micro_batch
        self.n_stages = cfg.pipeline.stages
        self.miners: dict[str, _MinerView] = defaultdict(_MinerView)
        #: (tempo, kind, hotkey) -> audits run
        self.done: dict[tuple[int, str, str], int] = defaultdict(int)
        self.records: deque[AuditRecord] = deque(maxlen=512)
        t = totals if isinstance(totals, dict) else {}
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

    # ---- inputs ----------------------------------------------------------------------------------
    def on_receipt(self, ticket: Ticket, receipt: Receipt, hotkey: str) -> None:
        """An accepted receipt of ``hotkey`` about ``ticket``."""
        view = self.miners[hotkey]
        now = self.clock()
        rep = self.lookup(hotkey)
        if rep is not None:
            view.key = rep.key
        if receipt.boot > view.boot:
            # a restarted miner may not be routable yet (new endpoint): its uid is the one it had
            if view.boot > 0 and view.key is not None and self.policy.announce_restart(view.key, receipt.boot):
                logger.info("uid {} restarted (boot {:.0f}): audits of its earlier work are excused", view.key[0],
                            receipt.boot)
            view.boot = receipt.boot
            view.latest = (-1, -1)
            # the new process resumed from a checkpoint and names versions (step, merges) again, with
            # other weights: the roots its old process named no longer bind it (an honest post-restart
            # update commitment checked against them would fail)
            view.roots.clear()
            view.checked_steps.clear()
        if receipt.boot >= view.boot:
            view.latest = max(view.latest, (receipt.ws, receipt.wm), (receipt.bws, receipt.bwm))
        if any(u[0].hotkey == hotkey for u in self.unsettled):
            self.settle(hotkey=hotkey, after=receipt.t)
        for ks, km, root in ((receipt.ws, receipt.wm, receipt.wroot), (receipt.bws, receipt.bwm, receipt.bwroot)):
            if root and ks >= 0 and (ks, km) not in view.roots:
                view.roots[(ks, km)] = (root, now)
                if len(view.roots) > 256:
                    del view.roots[min(view.roots)]
        if receipt.status == "ok" and ticket.train:
            view.candidates.append(HopCandidate(ticket, receipt, hotkey, now))
            # ``accumulated``, not merely a backward: a member that jumped to its lane's next step still
            # computes the late micro-batches of the step it left, without accumulating them (counting those
            # would flag an honest miner on its backwards of steps it left incomplete)
            if receipt.accumulated and receipt.stage < ticket.n_stages and ticket.is_member(receipt.stage, hotkey):
                done = view.backwards.setdefault(receipt.step, set())
                done.add(receipt.index)
                if len(done) >= ticket.micro_per_step:
                    view.trained.add(receipt.step)
                if len(view.backwards) > 1024:
                    del view.backwards[min(view.backwards)]
                if len(view.trained) > 1024:
                    view.trained.discard(min(view.trained))

    def on_updates(self, hotkey: str, commits: list[dict]) -> int:
        """Update commitments from ``hotkey``'s receipt batch. Returns how many were well formed."""
        view = self.miners[hotkey]
        n = 0
        for raw in commits:
            try:
                c = UpdateCommit.from_dict(raw)
            except ProtocolError:
                continue
            view.commits.append((c, self.clock()))
            view.committed[(c.step, c.merges)] = c.skipped
            if len(view.committed) > 1024:
                del view.committed[min(view.committed)]
            n += 1
        return n

    def on_hop(self, key: tuple[int, str], ok: bool, at: Optional[float] = None) -> None:
        """A training hop of miner ``key`` succeeded or failed, as known at ``at`` (unix s; the arrival
        of the miner's own receipt; default now): the policy's "down" excuse and its contradiction."""
        self.policy.note_hop(key, ok, at)

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

    def pick_hop(self, hotkey: str) -> Optional[HopCandidate]:
        """One of the miner's recent hops, drawn now (blind): received in the last ``fresh_s`` seconds
        and computed with one of the two latest weights versions its receipts named (a miner keeps
        at least three: ``--audit-window``, default 4), by its current process (work from before a
        restart is gone with its audit window: auditing it would only spend the excuses)."""
        now = self.clock()
        view = self.miners[hotkey]
        cands = [c for c in view.candidates if now - c.received <= self.fresh_s and c.receipt.boot >= view.boot]
        latest = sorted({(c.receipt.ws, c.receipt.wm) for c in cands})[-2:]
        fresh = [c for c in cands if (c.receipt.ws, c.receipt.wm) in latest]
        return self.rng.choice(fresh) if fresh else None

    def direction(self, stage: int, r: Receipt) -> str:
        if stage == 0:
            return FORWARD
        if stage == self.n_stages - 1:
            return BACKWARD
        if r.bws >= 0 and not r.bwroot:
            # the backward ran on other weights than the forward (an inner step or a merge landed in
            # between) and that version's root is not named: only the forward can be replayed
            return FORWARD
        return BACKWARD if (r.bin and r.bout) else FORWARD

    def _layout(self, stage: int, t: Ticket, direction: str) -> TraceLayout:
        key = (stage, t.rows, t.seq_len, direction, t.wire_dtype)
        lay = self._layouts.get(key)
        if lay is None:
            lay = self._layouts[key] = TraceLayout.build(self.cfg.model, self.cfg.pipeline, stage, batch=t.rows,
                                                         seq=t.seq_len, direction=direction,
                                                         micro_per_step=self.micro_per_step, wire_format=t.wire_dtype)
        return lay

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
        self.unsettled = keep
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

    # ---- hop audits ------------------------------------------------------------------------------
    def hop_auditor(self, c: HopCandidate, direction: str) -> tuple[HopAuditor, AuditTraceRequest]:
        """The validator's session for candidate ``c``; raises ValueError / LayoutError when its
        receipt does not name what the audit needs."""
        t, r = c.ticket, c.receipt
        stage = r.stage
        lay = self._layout(stage, t, direction)
        other = direction == BACKWARD and r.bws >= 0         # the backward used other weights than the forward
        wroot = r.bwroot if other else r.wroot
        version = (r.bws, r.bwm) if other else (r.ws, r.wm)
        if not wroot:
            raise ValueError("its receipt names no weights version root for the weights it used (no audit window)")
        names = {"wire.x": r.fin, "wire.z": r.fout, "wire.dz": r.bin, "wire.dx": r.bout}
        if direction == FORWARD:
            names = {k: v for k, v in names.items() if k in ("wire.x", "wire.z")}
        if other:
            names.pop("wire.z", None)        # the forward used other weights than the backward audited
        roots = {k: bytes.fromhex(v) for k, v in names.items() if k in lay.wire and v}
        tokens = targets = None
        if stage == 0 or stage == self.n_stages - 1:
            rows = self.rows(t)
            tokens, targets = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
        aud = HopAuditor(lay, weights_root=bytes.fromhex(wroot), wire_roots=roots, tol=self.tol,
                         sampling=self.sampling, rng=self.rng, tokens=tokens if stage == 0 else None,
                         targets=targets if stage == self.n_stages - 1 else None,
                         loss=r.loss if stage == self.n_stages - 1 else None)
        req = AuditTraceRequest(run_id=self.run_id, stage=stage, microbatch_id=t.microbatch_id,
                                inner_step=version[0], audit_id=uuid.uuid4().hex, direction=lay.direction,
                                weights_step=version[0], weights_merges=version[1], weights_root=wroot)
        return aud, req

    async def audit_hop(self, rep: Replica, tempo: int, candidate: Optional[HopCandidate] = None
                        ) -> Optional[AuditRecord]:
        """Audit one of ``rep``'s recent hops (or ``candidate``). None when it has none to audit."""
        c = candidate or self.pick_hop(rep.hotkey)
        if c is None:
            return None
        direction = self.direction(rep.stage, c.receipt)
        r = c.receipt
        version = (r.bws, r.bwm) if direction == BACKWARD and r.bws >= 0 else (r.ws, r.wm)
        rec = AuditRecord("hop", rep.uid, rep.hotkey, rep.stage, "passed", direction=direction, tempo=tempo,
                          version=version)
        try:
            aud, req = self.hop_auditor(c, direction)
        except (ValueError, LayoutError) as e:
            rec.raw, rec.detail = "refused", f"unauditable hop {c.ticket.microbatch_id[:40]}: {e}"
            return self._finish(rec, c.receipt.t)
        rec.started = t0 = time.monotonic()
        sizes: list[int] = []
        try:
            rec.raw, rec.detail, rec.cpu_s = await self._hop_rounds(rep, aud, req, sizes, rec)
        except ProtocolError as e:
            rec.raw, rec.detail, rec.code = "refused", f"{e.outcome.value}: {e.message}"[:200], e.outcome.value
        except (TransportError, asyncio.TimeoutError) as e:       # health probed by _reask
            rec.raw, rec.detail = "timeout", f"{type(e).__name__}: {e}"[:200]
        except AuditFailure as e:
            rec.raw, rec.detail = "failed", str(e)[:200]
        self._count_reasks(rec)
        rec.bytes = sum(sizes) + HTTP_HEADER_BYTES * len(sizes)
        rec.wall_s = time.monotonic() - t0
        rec.detail = f"{c.ticket.microbatch_id[:32]}: {rec.detail}"
        return self._finish(rec, c.receipt.t)

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

    async def _hop_rounds(self, rep: Replica, aud: HopAuditor, req: AuditTraceRequest, sizes: list[int],
                          rec: AuditRecord) -> tuple[str, str, float]:
        """The three rounds; ``sizes`` gets the encoded body size of every message sent and received.
        A request that fails on the transport is sent again unchanged after each of ``retry_delays_s``
        (:meth:`_reask`)."""
        lay = aud.layout
        kw = dict(timeout_s=self.deadlines.deadline_s(*hop_round_work(self.cfg, rep.stage, lay.direction)), retries=0)

        async def call(ep, hk, path, msg, typ, **kw2):
            delays = deque(self.retry_delays_s)
            while True:
                sizes.append(len(encode(msg)))
                try:
                    resp = await self.client.call(ep, hk, path, msg, typ, **kw2)
                    break
                except (TransportError, asyncio.TimeoutError) as e:
                    if not await self._reask(rep, rec, path, _why(e), delays):
                        raise
            rec.unanswered_since = None
            sizes.append(len(await asyncio.to_thread(encode, resp)))
            return resp
        commit = await call(rep.endpoint, rep.hotkey, "/audit/trace", req, AuditTraceCommit,
                            response_contract=codec.commit_contract(lay), **kw)
        seed, cpu = _thread_timed(aud.on_commit, *codec.read_commit(commit))
        proj = await call(rep.endpoint, rep.hotkey, "/audit/project", codec.project_request(req, seed, aud.blocks),
                          AuditProjection, response_contract=codec.projection_contract(aud.round2), **kw)
        rows, c2 = await asyncio.to_thread(_thread_timed, aud.on_projection, *codec.read_projection(proj, aud.round2))
        oreq = codec.open_request(req, rows, aud.whole)
        opening = await call(rep.endpoint, rep.hotkey, "/audit/open", oreq, AuditOpening,
                             response_contract=codec.opening_contract(lay, rows, weights_dtype=aud.weights_dtype,
                                                                      whole=aud.whole), **kw)
        verdict, c3 = await asyncio.to_thread(_thread_timed, aud.check, codec.read_opening(opening, lay, rows, aud.whole))
        cpu += c2 + c3
        if verdict.ok:
            return "passed", f"{verdict.checks} checks", cpu
        return "failed", verdict.reason, cpu

    # ---- update audits ---------------------------------------------------------------------------
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

    # ---- figures ---------------------------------------------------------------------------------
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
