"""The validator's control plane: it decides where micro-batches go; miners move the tensors.

Per lane step ``k`` this validator drives (``k % V == v`` with ``V`` coordinating validators), it
signs one :class:`~iota_subnet.protocol.ticket.Ticket` per micro-batch (route: the lane's miner of
every stage, alternates: other replicas by measured throughput) and sends them, a few steps ahead
(``lookahead``), to the lane's head miner in one ``/tickets`` request. The miners do the rest
(:mod:`iota_subnet.miner.dataplane`) and report receipts to this validator's ``/receipts``.

Bookkeeping from receipts
    A training micro-batch is done when every stage reported ``ok`` for it; its loss is the tail's.
    Neighbouring receipts must agree on what was handed over (sha256 of the wire tensors); a stage
    is credited verified work (:class:`~.scoring.Ledger`) only when its receipts agree with its
    neighbours'. A ``failed`` receipt, or no progress for ``stall_s``, makes the validator re-issue
    the micro-batch (same sample address, ``attempt + 1``, routed around the miners that failed);
    every stage still accumulates each ``(lane, step, index)`` once. A lane step is complete when all
    its micro-batches are.

Evaluation and CLASP probes are forward-only tickets (``train`` False, validation rows): the tail
reports the loss in its receipt.

Traffic: one ticket (about 0.7 kB) and one receipt per stage (about 0.5 kB) per micro-batch, in
batches; none of it scales with the model width.
"""
from __future__ import annotations

import asyncio
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Optional

from loguru import logger

from iota_subnet.config import RunConfig
from iota_subnet.model import bottleneck_dims
from iota_subnet.protocol import (Health, ProtocolError, ReceiptAck, ReceiptBatch, Ticket, TicketAck, TicketBatch)
from iota_subnet.protocol.receipt import MAX_RECEIPTS_PER_BATCH, Receipt, parse_receipt
from iota_subnet.transport import TransportError

from .hindrance import Hindrances
from .lanes import LaneStepResult, MicrobatchResult, sample_start, steps_of
from .pacing import LanePacer
from .routing import Replica, Router
from .scoring import Ledger


@dataclass
class Flight:
    """One issued ticket and what the miners reported about it."""

    ticket: Ticket
    issued: float
    receipts: dict[int, Receipt] = field(default_factory=dict)
    servers: dict[int, str] = field(default_factory=dict)      # stage -> hotkey that reported it
    arrived: dict[int, float] = field(default_factory=dict)    # stage -> when its receipt arrived (clock)
    failed: bool = False
    errors: list[str] = field(default_factory=list)
    unreachable: set[str] = field(default_factory=set)
    stale: bool = False
    done: bool = False
    credited: set[int] = field(default_factory=set)     # stages credited
    future: Optional[asyncio.Future] = None      # evaluation / probe: resolves to the loss

    @property
    def loss(self) -> Optional[float]:
        """The tail's loss, or the one it sent back with its gradient (in the first stage's receipt)."""
        for s in (self.ticket.n_stages - 1, 0):
            r = self.receipts.get(s)
            if r is not None and r.loss is not None:
                return r.loss
        return None


class ControlPlane:
    """Drives lanes through tickets and receipts. ``client``: a :class:`~iota_subnet.transport.NeuronClient`
    (tickets, health probes); ``keypair``: the validator's wallet (signs tickets); ``dataset``: only its
    ``n_val_rows`` is used (the miners read the rows themselves).

    Driving interface: :meth:`run`, :meth:`evaluate`, :meth:`clasp_round`, :meth:`probe`, and the
    counters ``tokens``, ``reroutes``, ``failures``, ``microbatches_ok``, ``microbatches_failed``.

    ``pace_every``: the merge window the lanes are paced by (default ``merge.every_steps``; 0: no
    pacing): the step closing a window waits until every live lane is there, at most twice
    ``merge.join_timeout_s``; ``pace_stall_s``: seconds without progress after which a lane no longer
    holds the others back (:mod:`~.pacing`).
    """

    #: lane steps whose flights are kept after completion (receipts arrive in batches, a little late)
    KEEP_STEPS = 4

    def __init__(self, cfg: RunConfig, *, run_id: str, router: Router, client: Any, keypair: Any, dataset: Any,
                 ledger: Ledger, n_lanes: int, validator_index: int = 0, n_validators: int = 1,
                 seed: Optional[int] = None, tag: str = "", lookahead: int = 8, ticket_ttl_s: float = 600.0,
                 stall_s: float = 30.0, min_stall_s: float = 3.0, max_attempts: int = 6, wire_dtype: str = "bf16", n_alternates: int = 2,
                 empty_step_wait_s: float = 1.0, turn_timeout_s: float = 120.0, eval_timeout_s: float = 120.0,
                 pace_every: Optional[int] = None, pace_stall_s: float = 120.0,
                 clock: Callable[[], float] = time.time,
                 on_receipt: Optional[Callable[[Ticket, Receipt, str], None]] = None,
                 on_hop: Optional[Callable[[tuple[int, str], bool, Optional[float]], None]] = None):
        self.cfg, self.run_id, self.router, self.client = cfg, run_id, router, client
        self.keypair = getattr(keypair, "hotkey", keypair)
        self.hotkey: str = self.keypair.ss58_address
        self.dataset, self.ledger = dataset, ledger
        self.n_stages = cfg.pipeline.stages
        self.n_lanes = int(n_lanes)
        self.validator_index, self.n_validators = int(validator_index), max(1, int(n_validators))
        self.seed = cfg.train.seed if seed is None else int(seed)
        self.tag = tag or uuid.uuid4().hex[:6]
        self.lookahead, self.ticket_ttl_s, self.stall_s = max(1, int(lookahead)), float(ticket_ttl_s), float(stall_s)
        self.max_attempts, self.wire_dtype, self.n_alternates = int(max_attempts), wire_dtype, int(n_alternates)
        self.empty_step_wait_s, self.turn_timeout_s, self.eval_timeout_s = empty_step_wait_s, turn_timeout_s, eval_timeout_s
        self.clock = clock
        #: observers (the audit scheduler): every accepted receipt (ticket, receipt, reporter's hotkey),
        #: and every training hop outcome per miner ((uid, hotkey), ok)
        self.on_receipt, self.on_hop = on_receipt, on_hop
        #: proven refusals (:class:`~.blame.BlameBook`): who refused a micro-batch's hop is not unreachable
        self.blame: Optional[Any] = None
        #: miners held back by another miner's fault (:mod:`.hindrance`), taken by each scoring update
        self.hindrances = Hindrances(clock)
        self.mb = cfg.train.micro_batch
        self.micro_per_step = cfg.train.batch_size // self.mb
        self.width = bottleneck_dims(cfg.model, cfg.pipeline)[0]
        #: micro-batch id -> flight; (lane, step, index) -> its attempts' ids, oldest first
        self.flights: dict[str, Flight] = {}
        self.attempts: dict[tuple[int, int, int], list[str]] = {}
        #: per lane, the step being followed now (tickets tell heads that earlier steps are complete)
        self._lane_step: dict[int, int] = {}
        #: per lane, the first step a previous process of this validator cannot have issued tickets for
        #: (it issued at most ``lookahead`` steps beyond where it stopped): a head past an earlier step
        #: may have trained it with those tickets; past a later one it skipped it
        self._ticketed_before: dict[int, int] = {}
        self.reissue_backoff_s = 0.5
        #: stall detection adapts to the pace of the lanes: no progress for 5 x the mean lane-step time
        #: (at least ``min_stall_s``, at most ``stall_s``) re-issues what is missing
        self.min_stall_s = float(min_stall_s)
        self._step_time: Optional[float] = None
        self._issued_steps: dict[int, set[int]] = {}
        self._lane_events: dict[int, asyncio.Event] = {}
        #: holds the step closing a merge window until every live lane is there (replicas merge together)
        self.pacer = LanePacer(cfg.merge.every_steps if pace_every is None else pace_every, pace_stall_s,
                               max_hold_s=2 * cfg.merge.join_timeout_s)
        self._probe_lock = asyncio.Lock()
        self.tokens = 0
        self.reroutes = 0
        self.failures = 0
        self.microbatches_ok = 0
        self.microbatches_failed = 0
        self.receipts_seen = 0
        self.receipts_refused = 0
        self.hash_mismatches = 0
        self.tickets_sent = 0

    # ---------------------------------------------------------------- routes
    def _by_hotkey(self) -> dict[str, Replica]:
        return {r.hotkey: r for r in self.router.live_replicas()}

    def _alternates(self, stage: int, exclude: set[str]) -> list[str]:
        cands = [r for r in self.router.replicas.get(stage, [])
                 if r.hotkey not in exclude and self.router.is_available(r)]
        cands.sort(key=lambda r: -self.router.throughput(r))
        return [r.hotkey for r in cands[:self.n_alternates]]

    def _route(self, lane: int, avoid: set[str] = frozenset()) -> Optional[tuple[list[str], list[bool], list[list[str]]]]:
        """(route, trains, alternates) for a micro-batch of ``lane``, or None when a stage has nobody."""
        route, trains, alts = [], [], []
        for s in range(self.n_stages):
            member = self.router.lane_member(lane, s)
            ok = member is not None and member.hotkey not in avoid and self.router.is_available(member)
            r = member if ok else self.router.choose(s, exclude=[x.key for x in self.router.replicas.get(s, [])
                                                                  if x.hotkey in avoid])
            if r is None:
                return None
            route.append(r.hotkey)
            trains.append(bool(ok))
            alts.append(self._alternates(s, {r.hotkey, *avoid}))
        return route, trains, alts

    def _ticket(self, lane: int, step: int, index: int, *, start: int, split: str, train: bool, attempt: int = 0,
                route: Optional[tuple[list[str], list[bool], list[list[str]]]] = None, ahead: int = 0) -> Ticket:
        """A signed ticket; ``ahead``: lane steps before this one that are still to train (a ticket
        issued ``ahead`` steps early lives ``ticket_ttl_s`` longer per step, so the lookahead never
        issues tickets that expire in the head's queue on slow pipelines)."""
        route = route or self._route(lane)
        now = self.clock()
        mb_id = f"{self.tag}-l{lane}-k{step}-m{index}-a{attempt}-{uuid.uuid4().hex[:6]}"
        t = Ticket(run_id=self.run_id, validator=self.hotkey, lane=lane, step=step, index=index, microbatch_id=mb_id,
                   split=split, seed=self.seed, start=start, rows=self.mb, seq_len=self.cfg.data.seq_len,
                   width=self.width, wire_dtype=self.wire_dtype, train=train, micro_per_step=self.micro_per_step,
                   route=tuple(route[0]), trains=tuple(route[1]), alternates=tuple(tuple(a) for a in route[2]),
                   attempt=attempt, issued_at=now, deadline=now + self.ticket_ttl_s * (1 + max(0, ahead)))
        return t.signed(self.keypair)

    async def _deliver(self, tickets: list[Ticket]) -> int:
        """Send tickets to their head miners (grouped). Returns how many were accepted."""
        by_head: dict[str, list[Ticket]] = {}
        for t in tickets:
            by_head.setdefault(t.route[0], []).append(t)
        accepted = 0
        reps = self._by_hotkey()
        for head, ts in by_head.items():
            r = reps.get(head)
            if r is None:
                for t in ts:
                    self._flight_failed(t.microbatch_id, f"head {head[:10]} is gone")
                continue
            for t in ts:
                self.flights[t.microbatch_id] = Flight(t, self.clock(),
                                                       future=None if t.train else asyncio.get_running_loop().create_future())
                if t.train:
                    self.attempts.setdefault(t.key, []).append(t.microbatch_id)
            try:
                base = {str(l): max(0, k - self.n_validators + 1) for l, k in self._lane_step.items()
                        if any(t.lane == l for t in ts)}
                ack = await self.client.call(r.endpoint, r.hotkey, "/tickets",
                                             TicketBatch(run_id=self.run_id, stage=0, tickets=[t.to_json() for t in ts],
                                                         base_steps=base),
                                             TicketAck, timeout_s=30.0, retries=2)
            except (ProtocolError, TransportError) as e:
                self.router.record_failure(r, f"{type(e).__name__}: {e}")
                self.ledger.fail(r.uid, r.hotkey, 0)
                self.failures += 1
                self.hindrances.charged(r.hotkey)
                for t in ts:
                    self.hindrances.note(t.route, [r.hotkey], self.flights[t.microbatch_id].issued, proven=True)
                if self.on_hop is not None:
                    self.on_hop(r.key, False, None)
                logger.warning("tickets to head {} failed: {}", r.short(), e)
                for t in ts:
                    self._flight_failed(t.microbatch_id, f"tickets refused by {r.short()}: {e}", unreachable=[r.hotkey])
                continue
            self.tickets_sent += len(ts)
            accepted += ack.accepted
            for ref in ack.refused:
                self._flight_failed(str(ref.get("microbatch_id", "")), f"head refused: {ref.get('outcome')} "
                                                                       f"{ref.get('message', '')}")
        return accepted

    # ---------------------------------------------------------------- receipts
    def on_receipts(self, batch: ReceiptBatch, caller: str) -> ReceiptAck:
        """Handle a miner's receipt batch (``caller``: its hotkey, authenticated). Receipts about tickets
        this validator did not issue, or for a stage the caller did not serve, are ignored."""
        accepted = 0
        touched: set[int] = set()
        for raw in batch.receipts[:MAX_RECEIPTS_PER_BATCH]:
            r = parse_receipt(raw)
            fl = self.flights.get(r.id) if r is not None else None
            if r is None or fl is None or not 0 <= r.stage < fl.ticket.n_stages \
                    or caller not in fl.ticket.candidates(r.stage) or r.stage in fl.receipts:
                self.receipts_refused += 1
                continue
            accepted += 1
            fl.receipts[r.stage] = r
            fl.servers[r.stage] = caller
            fl.arrived[r.stage] = self.clock()
            if self.on_receipt is not None:
                self.on_receipt(fl.ticket, r, caller)
            touched.add(fl.ticket.lane)
            if r.status == "ok":
                self._note_unreachable(r)
                self._maybe_done(fl)
            elif r.status == "stale":
                fl.stale = True        # the head is past this step: an earlier attempt completed it
            else:
                self._on_failure(fl, r)
        self.receipts_seen += accepted
        for lane in touched:
            ev = self._lane_events.get(lane)
            if ev is not None:
                ev.set()
        return ReceiptAck(run_id=self.run_id, accepted=accepted)

    def _note_unreachable(self, r: Receipt) -> None:
        """Miners a stage could not reach (it may have used an alternate): cooldown, probe, count. A
        miner that proved it refused the micro-batch's hop (:mod:`.blame`) is not charged."""
        reps = self._by_hotkey()
        excused = self.blame.refusers(r.id) if self.blame is not None else set()
        fl = self.flights.get(r.id)
        for hk in r.unreachable:
            rep = reps.get(hk)
            if rep is not None and hk not in excused:
                self.router.record_failure(rep, r.error or f"unreachable from stage {r.stage}")
                self.ledger.fail(rep.uid, rep.hotkey, rep.stage)
                self.failures += 1
                self.hindrances.charged(hk)
                if fl is not None:      # the route's other miners waited on it (a claim until probed)
                    self.hindrances.note(fl.ticket.route, [hk], fl.issued)
                if self.on_hop is not None:
                    self.on_hop(rep.key, False, None)

    def _on_failure(self, fl: Flight, r: Receipt) -> None:
        self._note_unreachable(r)
        self._flight_failed(fl.ticket.microbatch_id, f"stage {r.stage}: {r.status}: {r.error}",
                            unreachable=list(r.unreachable))

    def _flight_failed(self, mb_id: str, error: str, unreachable: Optional[list[str]] = None) -> None:
        fl = self.flights.get(mb_id)
        if fl is None or fl.done:
            return
        fl.failed = True
        fl.errors.append(error[:300])
        fl.unreachable.update(unreachable or ())
        if fl.future is not None and not fl.future.done():
            fl.future.set_result(None)
        ev = self._lane_events.get(fl.ticket.lane)
        if ev is not None:
            ev.set()

    def take_blocked(self) -> dict[tuple[int, str], float]:
        """Miners blocked by another miner's fault since the last call: key -> since when (``clock``
        seconds), for :meth:`~.scoring.Scoreboard.update` (:mod:`.hindrance`)."""
        reps = self._by_hotkey()
        return self.hindrances.take({hk: r.key for hk, r in reps.items()})

    def _maybe_done(self, fl: Flight) -> None:
        """A training micro-batch is done when the first stage reports its backward (the end of the
        chain: every later stage has done its part); evaluation when the last stage reports the loss.
        Stages are credited as their neighbours' receipts arrive (:meth:`_credit`)."""
        t = fl.ticket
        last = t.n_stages - 1
        if not t.train:
            if last in fl.receipts:
                fl.done = True
                if fl.future is not None and not fl.future.done():
                    fl.future.set_result(fl.loss)
            return
        head = fl.receipts.get(0)
        if head is not None and head.status == "ok" and not fl.done:
            fl.done = True
        self._credit(fl)

    def _credit(self, fl: Flight) -> None:
        """Verified work: a stage is credited once its receipt and its neighbours' are in and agree on
        what was handed over (sha256 of the wire tensors, who sent to whom). A stage whose neighbour
        never reports (it died) stays unverified and unpaid for that micro-batch."""
        t, rs = fl.ticket, fl.receipts
        reps = self._by_hotkey()
        for s, r in rs.items():
            if s in fl.credited or r.status != "ok":
                continue
            nbrs = [n for n in (s - 1, s + 1) if 0 <= n < t.n_stages]
            if not all(n in rs for n in nbrs):
                continue
            fl.credited.add(s)
            ok = True
            for a_s in (s - 1, s):
                if a_s < 0 or a_s + 1 >= t.n_stages:
                    continue
                a, b = rs[a_s], rs[a_s + 1]
                if a.fout != b.fin or a.bin != b.bout or a.next != fl.servers[a_s + 1] or b.prev != fl.servers[a_s]:
                    ok = False
                    if a_s == s:      # report each disagreeing pair once
                        self.hash_mismatches += 1
                        logger.warning("micro-batch {}: stages {} and {} disagree on what they exchanged (forward "
                                       "{} / {}, backward {} / {}, {} -> {})", t.microbatch_id, a_s, a_s + 1,
                                       a.fout[:8], b.fin[:8], b.bout[:8], a.bin[:8], a.next[:8], b.prev[:8])
            hk = self._server_of(fl, s)
            rep = reps.get(hk)
            if rep is None or not ok:
                continue
            self.ledger.forward_ok(rep.uid, rep.hotkey, s)
            self.ledger.credit(rep.uid, rep.hotkey, s, t.tokens)
            self.hindrances.worked(hk, fl.arrived.get(s, self.clock()))
            if self.on_hop is not None:
                # when its own receipt arrived, not now: a neighbour's receipt that completes the credit
                # may come while this miner is partitioned, and read as "it served a hop just then"
                self.on_hop(rep.key, True, fl.arrived.get(s))
            if hk != t.route[s] or (t.trains and not t.trains[s]):
                self.ledger.reroute(rep.uid, rep.hotkey, s)
                self.reroutes += 1
            self.router.record_success(rep, t.tokens, max(r.compute_s, 1e-3))

    @staticmethod
    def _server_of(fl: Flight, stage: int) -> str:
        """Who served ``stage``: the hotkey that reported it (the route's miner when none did)."""
        return fl.servers.get(stage, fl.ticket.route[stage])

    # ---------------------------------------------------------------- lanes
    def sample_start(self, lane: int, step: int, m: int) -> int:
        return sample_start(lane, step, m, self.n_lanes, self.cfg.train.batch_size, self.mb)

    async def _issue_step(self, lane: int, step: int, ahead: int = 0) -> bool:
        """Tickets for every micro-batch of lane step ``step`` (once), ``ahead`` steps before it is the
        lane's current one. False when no route exists now."""
        issued = self._issued_steps.setdefault(lane, set())
        if step in issued:
            return True
        route = self._route(lane)
        if route is None:
            return False
        tickets = [self._ticket(lane, step, m, start=self.sample_start(lane, step, m), split="train", train=True,
                                route=route, attempt=len(self.attempts.get((lane, step, m), [])), ahead=ahead)
                   for m in range(self.micro_per_step)]
        issued.add(step)
        await self._deliver(tickets)
        return True

    async def _reissue(self, fl: Flight, tries: int) -> bool:
        """Re-issue ``fl``'s micro-batch (``tries``: re-issues of it so far in this lane step)."""
        t = fl.ticket
        if tries + 1 >= self.max_attempts:
            return False
        wait = self.reissue_backoff_s * 2 ** t.attempt - (self.clock() - fl.issued)
        if wait > 0:
            await asyncio.sleep(wait)
        route = self._route(t.lane, set(fl.unreachable))
        if route is None:
            return False
        new = self._ticket(t.lane, t.step, t.index, start=t.start, split=t.split, train=t.train,
                           attempt=t.attempt + 1, route=route)
        logger.info("lane {} step {} mb {}: re-issued as attempt {} ({})", t.lane, t.step, t.index, new.attempt,
                    "; ".join(fl.errors)[:200])
        await self._deliver([new])
        return True

    def _others_steps(self, first: int, upto: int) -> list[int]:
        """The lane steps in ``[first, upto)`` other coordinating validators drive."""
        mine = set(steps_of(self.validator_index, self.n_validators, first, upto))
        return [k for k in range(first, upto) if k not in mine]

    async def _take_over(self, lane: int, first: int, upto: int) -> None:
        """Another validator stopped driving its steps of ``lane`` (the head has waited at step ``first``
        for ``turn_timeout_s``): issue its steps ``first .. upto - 1`` so the lane goes on."""
        theirs = self._others_steps(first, upto)
        if theirs:
            logger.warning("lane {}: the head waited {:.0f} s at step {}; driving steps {} of the other validators",
                           lane, self.turn_timeout_s, first, theirs)
        for k in theirs:
            await self._issue_step(lane, k)

    async def _head_step(self, lane: int) -> Optional[int]:
        head = self.router.lane_member(lane, 0)
        if head is None or not self.router.is_available(head):
            return None
        try:
            h = await self.client.call(head.endpoint, head.hotkey, "/health", Health(run_id=self.run_id, stage=0),
                                       Health, timeout_s=5.0, retries=0)
            return int(h.inner_step)
        except (ProtocolError, TransportError):
            return None

    async def run_lane_step(self, lane: int, step: int, stop: Optional[asyncio.Event] = None) -> LaneStepResult:
        """Issue (if needed) and follow lane step ``step`` to completion; re-issues failed or stalled
        micro-batches (at most ``max_attempts`` each). Returns what happened to each micro-batch."""
        t0 = time.perf_counter()
        ev = self._lane_events.setdefault(lane, asyncio.Event())
        while not await self._issue_step(lane, step):
            await self.wait_and_probe(self.empty_step_wait_s)
            if stop is not None and stop.is_set():
                return LaneStepResult(lane, step, [], time.perf_counter() - t0)
        self._lane_step[lane] = step
        last_progress, progress_mark = self.clock(), -1
        gave_up: set[int] = set()
        tries: dict[int, int] = {}
        while True:
            state = [self._index_state(lane, step, m) for m in range(self.micro_per_step)]
            mark = sum(len(f.receipts) for m in range(self.micro_per_step) for f in self._flights_of(lane, step, m))
            if mark != progress_mark:
                progress_mark, last_progress = mark, self.clock()
            if all(st == "done" or m in gave_up for m, st in enumerate(state)):
                break
            if stop is not None and stop.is_set():
                break
            for m, st in enumerate(state):
                if st != "failed" or m in gave_up:
                    continue
                latest = self._flights_of(lane, step, m)[-1]
                tries[m] = tries.get(m, 0) + 1
                if not await self._reissue(latest, tries[m] - 1):
                    gave_up.add(m)
                    logger.warning("lane {} step {} mb {}: given up after {} attempts: {}", lane, step, m,
                                   latest.ticket.attempt + 1, "; ".join(latest.errors)[:300])
            if self.clock() - last_progress > self.stall_timeout():
                cur = await self._head_step(lane)
                # the head is still on earlier steps of other validators: wait for their turn (not for
                # steps of this validator's own, which are complete: then the head is stuck, and only
                # re-issuing, with the steps done named in the tickets, moves it on)
                theirs = cur is not None and cur < step and bool(self._others_steps(cur, step))
                if theirs and self.clock() - last_progress >= self.turn_timeout_s:
                    await self._take_over(lane, cur, step)
                    last_progress = self.clock()
                elif not theirs:
                    for m, st in enumerate(state):
                        if st == "running":
                            f = self._flights_of(lane, step, m)[-1]
                            self._flight_failed(f.ticket.microbatch_id,
                                                f"no progress for {self.stall_timeout():.1f} s")
                        elif st == "waiting":      # the head went past it, yet no attempt's receipts came
                            gave_up.add(m)
                    last_progress = self.clock()
                    await self.probe()
            ev.clear()
            try:
                await asyncio.wait_for(ev.wait(), timeout=1.0)
            except asyncio.TimeoutError:
                pass
        elapsed = time.perf_counter() - t0
        self._step_time = elapsed if self._step_time is None else 0.8 * self._step_time + 0.2 * elapsed
        return self._result(lane, step, elapsed)

    def stall_timeout(self) -> float:
        """Seconds without any receipt for a lane step before its unfinished micro-batches are re-issued."""
        if self._step_time is None:
            return self.stall_s
        return max(self.min_stall_s, min(self.stall_s, 5.0 * self._step_time * self.n_validators))

    def _flights_of(self, lane: int, step: int, m: int) -> list[Flight]:
        return [self.flights[i] for i in self.attempts.get((lane, step, m), []) if i in self.flights]

    def _index_state(self, lane: int, step: int, m: int) -> str:
        """``done`` (some attempt completed), ``failed`` (the latest failed: re-issue), ``running``, or
        ``waiting`` (only stale attempts: an earlier one's receipts are still on their way)."""
        fls = self._flights_of(lane, step, m)
        if any(f.done for f in fls):
            return "done"
        if not fls:
            return "failed"
        latest = fls[-1]
        if latest.stale:
            return "waiting"
        return "failed" if latest.failed else "running"

    def _result(self, lane: int, step: int, elapsed: float) -> LaneStepResult:
        mbs = []
        for m in range(self.micro_per_step):
            fls = self._flights_of(lane, step, m)
            fl = next((f for f in fls if f.done), fls[-1] if fls else None)
            res = MicrobatchResult(lane, step, m, fl.ticket.microbatch_id if fl else "", True,
                                   self.mb * self.cfg.data.seq_len)
            if fl is not None:
                away = not fl.done and self._index_state(lane, step, m) == "waiting"
                res.ok = fl.done or away        # waiting: the head went past it, trained under an earlier ticket
                res.loss = fl.loss if fl.done else None
                res.phase = "done" if fl.done else "trained while away" if away else "failed"
                res.attempts = fl.ticket.attempt + 1
                res.pathway = [{"stage": s, "uid": None, "hotkey": self._server_of(fl, s)} for s in range(self.n_stages)]
                reps = self._by_hotkey()
                for p in res.pathway:
                    rep = reps.get(p["hotkey"])
                    p["uid"] = rep.uid if rep is not None else None
                res.failures = [{"error": e} for e in fl.errors]
                res.reroutes = sum(1 for p, hk, tr in zip(res.pathway, fl.ticket.route, fl.ticket.trains or [True] * 99)
                                   if p["hotkey"] != hk or not tr)
                res.latency_s = (max((r.t for r in fl.receipts.values()), default=fl.issued) - fl.issued)
                res.head_step = fl.receipts[0].inner_step if 0 in fl.receipts else None
            if res.ok:
                self.microbatches_ok += 1
                self.tokens += res.tokens
            else:
                self.microbatches_failed += 1
            mbs.append(res)
        self._forget(lane, step - self.KEEP_STEPS)     # late receipts of recent steps still credit
        return LaneStepResult(lane, step, mbs, elapsed)

    def _forget(self, lane: int, step: int) -> None:
        for key in [k for k in self.attempts if k[0] == lane and k[1] <= step]:
            del self.attempts[key]
        for mb_id in [k for k, f in self.flights.items() if f.ticket.lane == lane and 0 <= f.ticket.step <= step]:
            del self.flights[mb_id]

    async def run_lane(self, lane: int, start_step: int, total_steps: int,
                       on_step: Optional[Callable[[LaneStepResult, int], Awaitable[None] | None]] = None,
                       stop: Optional[asyncio.Event] = None) -> int:
        """Drive this validator's lane steps of ``lane`` in ``[start_step, total_steps)``; tickets for the
        next ``lookahead`` of them are at the head before they are needed. Returns the next step to drive."""
        todo = steps_of(self.validator_index, self.n_validators, start_step, total_steps)
        self._ticketed_before[lane] = start_step + self.lookahead     # a resumed lane may be at step 0 still
        i = 0
        next_step = todo[0] if todo else max(start_step, total_steps)
        # resuming: the head may have trained past our last committed step with tickets we issued ahead
        cur = await self._head_step(lane) if todo else None
        if cur is not None and cur > todo[0]:
            past = [k for k in todo if k < cur]
            away = [k for k in past if k < self._ticketed_before[lane]]
            if away:
                logger.warning("lane {}: its first-stage miner is at inner step {}; steps {}..{} were trained while "
                               "this validator was away (their receipts are lost: counted, not credited)", lane, cur,
                               away[0], away[-1])
            if len(away) < len(past):
                logger.warning("lane {}: its first-stage miner is at inner step {}, past steps {}..{} that this "
                               "validator never issued: they were skipped (reported as lost)", lane, cur,
                               past[len(away)], past[-1])
            for k in past:
                i += 1
                next_step = todo[i] if i < len(todo) else total_steps
                if on_step is not None:
                    out = on_step(self._trained_while_away(lane, k) if k in away else self._skipped(lane, k),
                                  next_step)
                    if asyncio.iscoroutine(out):
                        await out
        self.pacer.at(lane, next_step)
        try:
            return await self._drive_lane(lane, todo, i, next_step, total_steps, on_step, stop)
        finally:
            self.pacer.finish(lane)

    async def _drive_lane(self, lane: int, todo: list[int], i: int, next_step: int, total_steps: int,
                          on_step: Optional[Callable[[LaneStepResult, int], Awaitable[None] | None]],
                          stop: Optional[asyncio.Event]) -> int:
        while i < len(todo):
            if stop is not None and stop.is_set():
                break
            await self.probe()
            for ahead, k in enumerate(todo[i:i + self.lookahead]):
                if not self.pacer.allows(lane, k):
                    break       # a head trains every ticket it holds: a held step gets none yet
                await self._issue_step(lane, k, ahead)
            k = todo[i]
            if not self.pacer.allows(lane, k):
                await self.pacer.wait(lane, k, stop)
                continue
            res = await self.run_lane_step(lane, k, stop)
            if stop is not None and stop.is_set() and res.ok_count < len(res.microbatches):
                # stopped inside the step: not counted now; on resume the head says whether it finished it
                logger.info("lane {} step {}: stopped with {} / {} micro-batches done; resumes there", lane, k,
                            res.ok_count, len(res.microbatches))
                break
            settled = None      # the head is past this step: trained with earlier tickets, or skipped
            if res.ok_count == 0 and not (stop is not None and stop.is_set()):
                settled = await self._completed_elsewhere(lane, k)
                res = settled or res
            if res.ok_count == 0 and settled is None:
                if stop is not None and stop.is_set():
                    break
                logger.warning("lane {} step {}: no micro-batch completed; retrying", lane, k)
                self._issued_steps.get(lane, set()).discard(k)
                await self.wait_and_probe(self.empty_step_wait_s)
                continue
            i += 1
            next_step = todo[i] if i < len(todo) else total_steps
            self.pacer.at(lane, next_step)
            if on_step is not None:
                out = on_step(res, next_step)
                if asyncio.iscoroutine(out):
                    await out
            logger.info("lane {} step {} loss {} ({} / {} micro-batches, {} reroutes) in {:.2f} s", lane, k,
                        f"{res.loss:.4f}" if res.loss is not None else "-", res.ok_count, len(res.microbatches),
                        res.reroutes, res.elapsed_s)
        return next_step

    def _trained_while_away(self, lane: int, step: int) -> LaneStepResult:
        """Lane step ``step`` trained by the miners with tickets this validator issued before it
        restarted: their receipts are lost, so it is counted (every micro-batch trained once), not credited."""
        mbs = [MicrobatchResult(lane, step, m, "", True, self.mb * self.cfg.data.seq_len, ok=True,
                                phase="trained while away") for m in range(self.micro_per_step)]
        return LaneStepResult(lane, step, mbs, 0.0)

    def _skipped(self, lane: int, step: int) -> LaneStepResult:
        """Lane step ``step`` that the lane's head went past without training it in this lane (it synced
        or skipped to a later inner step before any ticket of it arrived): its rows were never trained
        here, so its micro-batches are reported lost (the run's accounting counts its samples skipped)."""
        mbs = [MicrobatchResult(lane, step, m, "", True, self.mb * self.cfg.data.seq_len, ok=False,
                                phase="skipped: the head went past it") for m in range(self.micro_per_step)]
        return LaneStepResult(lane, step, mbs, 0.0)

    async def _completed_elsewhere(self, lane: int, step: int) -> Optional[LaneStepResult]:
        """A lane step none of whose micro-batches completed under this validator's tickets while the
        lane's head is past it: the head completed it with the tickets this validator sent before a
        restart (the ones for the steps it looked ahead), which it still held. Without this the lane
        would re-issue that step for ever: every new ticket is answered ``stale``."""
        cur = await self._head_step(lane)
        if cur is None or cur <= step:
            return None
        flights = [f for m in range(self.micro_per_step) for f in self._flights_of(lane, step, m)]
        if step >= self._ticketed_before.get(lane, 0) and flights and all(f.stale for f in flights):
            logger.warning("lane {} step {}: its first-stage miner is at inner step {} and answered every ticket of "
                           "it stale: the step was skipped in this lane (reported as lost)", lane, step, cur)
            return self._skipped(lane, step)
        logger.warning("lane {} step {}: its first-stage miner is at inner step {}: the step was trained with tickets "
                       "issued before this validator restarted (receipts lost: counted, not credited)", lane, step, cur)
        return self._trained_while_away(lane, step)

    async def run(self, start_steps: dict[int, int], total_steps: int,
                  on_step: Optional[Callable[[LaneStepResult, int], Awaitable[None] | None]] = None,
                  stop: Optional[asyncio.Event] = None) -> dict[int, int]:
        lanes = list(range(self.n_lanes))
        for l in lanes:          # every lane bounds the others from the start (not once it got going)
            self.pacer.at(l, start_steps.get(l, 0))
        nxt = await asyncio.gather(*(self.run_lane(l, start_steps.get(l, 0), total_steps, on_step, stop)
                                     for l in lanes))
        return dict(zip(lanes, nxt))

    # ---------------------------------------------------------------- forward-only traffic
    async def _forward_only(self, routes: list[tuple[int, list[Replica]]], starts: list[int], timeout_s: float
                            ) -> list[Optional[float]]:
        """Evaluation / probe tickets (validation rows, no training) along explicit routes; the tail's losses
        (None where it did not complete in time)."""
        tickets = []
        for i, ((lane, path), start) in enumerate(zip(routes, starts)):
            route = ([r.hotkey for r in path], [False] * len(path), [[] for _ in path])
            tickets.append(self._ticket(lane, -1, i, start=start, split="val", train=False, route=route))
        await self._deliver(tickets)
        futs = [self.flights[t.microbatch_id].future for t in tickets if t.microbatch_id in self.flights]
        if futs:
            await asyncio.wait(futs, timeout=timeout_s)
        out = []
        for t in tickets:
            fl = self.flights.pop(t.microbatch_id, None)
            loss = fl.loss if fl is not None and fl.done else None
            out.append(loss if loss is not None and math.isfinite(loss) else None)
        return out

    async def evaluate(self, n_batches: Optional[int] = None, lane: int = 0) -> Optional[float]:
        """Mean validation loss over ``n_batches`` micro-batches of held-out rows through ``lane``."""
        n = self.cfg.train.eval_batches if n_batches is None else int(n_batches)
        losses: dict[int, float] = {}
        for attempt in range(3):
            await (self.wait_and_probe(self.empty_step_wait_s * 2) if attempt else self.probe())
            todo = [i for i in range(n) if i not in losses]
            path = []
            for s in range(self.n_stages):
                m = self.router.lane_member(lane, s)
                r = m if m is not None and self.router.is_available(m) else self.router.choose(s)
                if r is None:
                    break
                path.append(r)
            if len(path) < self.n_stages:
                continue
            got = await self._forward_only([(lane, path)] * len(todo), [i * self.mb for i in todo], self.eval_timeout_s)
            losses.update({i: l for i, l in zip(todo, got) if l is not None})
            if len(losses) == n:
                break
        if len(losses) < n:
            logger.warning("evaluation: {} of {} micro-batches completed", len(losses), n)
        return sum(losses.values()) / len(losses) if losses else None

    async def clasp_round(self, round_id: int, paths: int, rng, batch_index: Optional[int] = None) -> list[dict]:
        """One CLASP probe round (:mod:`.clasp`): one held-out micro-batch through ``paths`` random pathways."""
        from .clasp import choose_pathway
        by_stage = {s: [r for r in self.router.live_replicas() if r.stage == s and self.router.is_available(r)]
                    for s in range(self.n_stages)}
        n_val = max(1, int(getattr(self.dataset, "n_val_rows", 0) or 64))
        idx = rng.randrange(max(1, n_val - self.mb)) if batch_index is None else int(batch_index)
        routes = []
        for _ in range(max(2, int(paths))):
            p = choose_pathway(by_stage, rng)
            if p is not None:
                routes.append((0, p))
        if not routes:
            return []
        losses = await self._forward_only(routes, [idx] * len(routes), timeout_s=60.0)
        return [{"round": int(round_id), "loss": l, "pathway": [{"stage": r.stage, "uid": r.uid, "hotkey": r.hotkey}
                                                                 for r in path]}
                for (_, path), l in zip(routes, losses) if l is not None]

    # ---------------------------------------------------------------- health
    async def probe(self, timeout_s: float = 5.0) -> int:
        """``/health`` of every failed replica whose cooldown has run out. Returns how many came back."""
        async with self._probe_lock:
            due = self.router.probe_due()
            if not due:
                return 0

            async def one(r: Replica) -> bool:
                try:
                    h = await self.client.call(r.endpoint, r.hotkey, "/health", Health(run_id=self.run_id, stage=r.stage),
                                               Health, timeout_s=timeout_s, retries=0)
                    if not h.ready:
                        raise ProtocolError("NOT_READY", "syncing")
                except (ProtocolError, TransportError) as e:
                    self.router.probe_failed(r, f"{type(e).__name__}: {e}")
                    self.hindrances.down(r.hotkey)
                    return False
                self.router.mark_healthy(r)
                self.hindrances.up(r.hotkey)
                logger.info("{} is healthy again", r.short())
                return True

            return sum(await asyncio.gather(*(one(r) for r in due)))

    async def wait_and_probe(self, max_wait_s: float) -> None:
        wait = self.router.next_probe_in()
        await asyncio.sleep(min(max_wait_s, wait if wait is not None else max_wait_s))
        await self.probe()
