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

Parts: flights (:mod:`.flights`), ticket issue (:mod:`.tickets`), receipt matching and credit
(:mod:`.receipts`), health probes (:mod:`.health`), following a lane step with its re-issues
(:mod:`.lane_steps`); what they share (:mod:`.control_context`). This module drives the lanes
(look-ahead, pacing, resuming) and the forward-only traffic.
"""
from __future__ import annotations

import asyncio
import math
from typing import Any, Awaitable, Callable, Optional

from loguru import logger

from iota_subnet.config import RunConfig
from iota_subnet.data.packing import IGNORE_INDEX
from iota_subnet.protocol import ReceiptAck, ReceiptBatch
from iota_subnet.transport.server import Route

from .blame import BlameBook
from .control_context import ControlContext, ControlCounters, ControlOptions
from .control_routes import control_routes
from .control_transport import ControlTransport, HttpControlTransport
from .flights import Flight, FlightBook
from .health import HealthProbe
from .hindrance import Hindrances
from .lane_steps import LaneStepper
from .lanes import LaneStepResult, steps_of
from .pacing import LanePacer
from .receipts import ReceiptMatcher
from .routing import Replica, Router
from .scoring import Ledger
from .tickets import TicketIssuer

__all__ = ["ControlCounters", "ControlOptions", "ControlPlane", "Flight"]


def _counter(name: str) -> property:
    return property(lambda self: getattr(self.counters, name), lambda self, v: setattr(self.counters, name, v),
                    doc=f"``{name}`` of the plane's :class:`~.control_context.ControlCounters`")


class ControlPlane:
    """Drives lanes through tickets and receipts. ``client``: a :class:`~iota_subnet.transport.NeuronClient`
    (tickets, health probes over signed HTTP: :class:`~.control_transport.HttpControlTransport`), or
    ``transport``: a :class:`~.control_transport.ControlTransport` (exactly one; ValueError otherwise);
    ``keypair``: the validator's wallet (signs tickets); ``dataset``: only its
    ``n_val_rows`` is used (the miners read the rows themselves); ``opts``: :class:`ControlOptions`.

    Driving interface: :meth:`run`, :meth:`evaluate`, :meth:`clasp_round`, :meth:`probe`, and the
    counters ``tokens``, ``reroutes``, ``failures``, ``microbatches_ok``, ``microbatches_failed``.

    Its parts: :class:`~.flights.FlightBook` (``book``), :class:`~.tickets.TicketIssuer` (``tickets``),
    :class:`~.receipts.ReceiptMatcher` (``receipts``), :class:`~.health.HealthProbe` (``health``),
    :class:`~.lane_steps.LaneStepper` (``steps``) and :class:`~.pacing.LanePacer` (``pacer``: the step
    closing a merge window of ``pace_every`` steps waits until every live lane is there, at most twice
    ``merge.join_timeout_s``).
    """

    tokens = _counter("tokens")
    reroutes = _counter("reroutes")
    failures = _counter("failures")
    microbatches_ok = _counter("microbatches_ok")
    microbatches_failed = _counter("microbatches_failed")
    receipts_seen = _counter("receipts_seen")
    receipts_refused = _counter("receipts_refused")
    hash_mismatches = _counter("hash_mismatches")
    tickets_sent = _counter("tickets_sent")

    def __init__(self, cfg: RunConfig, *, router: Router, keypair: Any, dataset: Any, ledger: Ledger,
                 opts: ControlOptions, client: Any = None, transport: Optional[ControlTransport] = None):
        if (client is None) == (transport is None):
            raise ValueError("a control plane needs exactly one of client (HTTP) and transport")
        self.cfg, self.router, self.client, self.dataset, self.ledger = cfg, router, client, dataset, ledger
        #: tickets and health probes out (receipts and refusal reports in: :meth:`routes`)
        self.transport: ControlTransport = transport if transport is not None else HttpControlTransport(
            client, router, getattr(keypair, "hotkey", keypair).ss58_address)
        self.opts = o = opts.resolved(cfg)
        self.run_id, self.n_lanes, self.clock = o.run_id, o.n_lanes, o.clock
        #: miners held back by another miner's fault (:mod:`.hindrance`), taken by each scoring update
        self.hindrances = Hindrances(o.clock)
        self.book = FlightBook(o.clock)
        self.ctx = ControlContext(cfg, o, router, self.transport, ledger, self.hindrances, self.book)
        self.counters = self.ctx.counters
        self.n_stages, self.mb, self.micro_per_step = self.ctx.n_stages, self.ctx.mb, self.ctx.micro_per_step
        self.tickets = TicketIssuer(self.ctx, keypair)
        self.hotkey = self.tickets.hotkey
        #: proven refusals (:class:`~.blame.BlameBook`): their senders are charged (``opts.on_flag``)
        self.blame = BlameBook(self, flag=o.on_flag)
        self.receipts = ReceiptMatcher(self.ctx, self.blame)
        self.health = HealthProbe(self.ctx)
        self.steps = LaneStepper(self.ctx, self.tickets, self.health)
        #: holds the step closing a merge window until every live lane is there (replicas merge together)
        self.pacer = LanePacer(cfg.merge.every_steps if o.pace_every is None else o.pace_every, o.pace_stall_s,
                               max_hold_s=2 * cfg.merge.join_timeout_s)

    @property
    def flights(self) -> dict[str, Flight]:
        """Micro-batch id -> its flight (:class:`~.flights.FlightBook`)."""
        return self.book.flights

    @property
    def lookahead(self) -> int:
        """Lane steps whose tickets are at the head before they are needed."""
        return self.opts.lookahead

    def routes(self) -> list[Route]:
        """This plane's ``/receipts`` and ``/refusals`` (:func:`.control_routes.control_routes`), for
        ``transport.serve`` where no validator service mounts them (in process)."""
        return control_routes(self.run_id, lambda: self)

    def on_receipts(self, batch: ReceiptBatch, caller: str) -> ReceiptAck:
        """A miner's receipt batch (``caller``: its hotkey, authenticated):
        :meth:`.receipts.ReceiptMatcher.on_receipts`."""
        return self.receipts.on_receipts(batch, caller)

    def take_blocked(self) -> dict[tuple[int, str], float]:
        """Miners blocked by another miner's fault since the last call: key -> since when (``clock``
        seconds), for :meth:`~.scoring.Scoreboard.update` (:mod:`.hindrance`)."""
        return self.hindrances.take({hk: r.key for hk, r in self.ctx.by_hotkey().items()})

    def sample_start(self, lane: int, step: int, m: int) -> int:
        return self.tickets.sample_start(lane, step, m)

    def stall_timeout(self) -> float:
        return self.steps.stall_timeout()

    async def probe(self, timeout_s: float = 5.0) -> int:
        """``/health`` of every failed replica whose cooldown has run out. Returns how many came back."""
        return await self.health.probe(timeout_s)

    async def wait_and_probe(self, max_wait_s: float) -> None:
        await self.health.wait_and_probe(max_wait_s)

    # ---------------------------------------------------------------- lanes
    async def run_lane_step(self, lane: int, step: int, stop: Optional[asyncio.Event] = None) -> LaneStepResult:
        """Issue (if needed) and follow lane step ``step`` to completion:
        :meth:`.lane_steps.LaneStepper.run_lane_step`."""
        return await self.steps.run_lane_step(lane, step, stop)

    async def run_lane(self, lane: int, start_step: int, total_steps: int,
                       on_step: Optional[Callable[[LaneStepResult, int], Awaitable[None] | None]] = None,
                       stop: Optional[asyncio.Event] = None) -> int:
        """Drive this validator's lane steps of ``lane`` in ``[start_step, total_steps)``; tickets for the
        next ``lookahead`` of them are at the head before they are needed. Returns the next step to drive."""
        o = self.opts
        todo = steps_of(o.validator_index, o.n_validators, start_step, total_steps)
        self.steps.ticketed_before[lane] = start_step + o.lookahead     # a resumed lane may be at step 0 still
        i = 0
        next_step = todo[0] if todo else max(start_step, total_steps)
        # resuming: the head may have trained past our last committed step with tickets we issued ahead
        cur = await self.health.head_step(lane) if todo else None
        if cur is not None and cur > todo[0]:
            past = [k for k in todo if k < cur]
            away = [k for k in past if k < self.steps.ticketed_before[lane]]
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
                    out = on_step(self.steps.trained_while_away(lane, k) if k in away else self.steps.skipped(lane, k),
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
                await self.tickets.issue_step(lane, k, ahead)
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
                settled = await self.steps.completed_elsewhere(lane, k)
                res = settled or res
            if res.ok_count == 0 and settled is None:
                if stop is not None and stop.is_set():
                    break
                logger.warning("lane {} step {}: no micro-batch completed; retrying", lane, k)
                self.tickets.unmark(lane, k)
                await self.wait_and_probe(self.opts.empty_step_wait_s)
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
            tickets.append(self.tickets.ticket(lane, -1, i, start=start, split="val", train=False, route=route))
        await self.tickets.deliver(tickets)
        futs = [self.flights[t.microbatch_id].future for t in tickets if t.microbatch_id in self.flights]
        if futs:
            await asyncio.wait(futs, timeout=timeout_s)
        out = []
        for t in tickets:
            fl = self.flights.pop(t.microbatch_id, None)
            loss = fl.loss if fl is not None and fl.done else None
            out.append(loss if loss is not None and math.isfinite(loss) else None)
        return out

    def _eval_weight(self, index: int) -> int:
        """Trained targets of held-out micro-batch ``index``: the tail's loss is their mean, so the
        evaluation weighs it by them (a loss-masked dataset), else 1 (every micro-batch has ``mb x T``)."""
        if not getattr(self.dataset, "has_loss_mask", False):
            return 1
        return int((self.dataset.target_batch("val", 0, index * self.mb, self.mb)[:, 1:] != IGNORE_INDEX).sum())

    async def evaluate(self, n_batches: Optional[int] = None, lane: int = 0) -> Optional[float]:
        """Validation loss (nats per trained target) over ``n_batches`` micro-batches of held-out rows
        through ``lane``: the tail's per-micro-batch means weighted by their trained targets
        (:meth:`_eval_weight`), i.e. the mean over every target, as ``iota-subnet eval`` computes it on
        an export; without a loss mask the plain mean of the micro-batches' losses."""
        n = self.cfg.train.eval_batches if n_batches is None else int(n_batches)
        losses: dict[int, float] = {}
        for attempt in range(3):
            await (self.wait_and_probe(self.opts.empty_step_wait_s * 2) if attempt else self.probe())
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
            got = await self._forward_only([(lane, path)] * len(todo), [i * self.mb for i in todo],
                                            self.opts.eval_timeout_s)
            losses.update({i: l for i, l in zip(todo, got) if l is not None})
            if len(losses) == n:
                break
        if len(losses) < n:
            logger.warning("evaluation: {} of {} micro-batches completed", len(losses), n)
        if not losses:
            return None
        weights = {i: self._eval_weight(i) for i in losses}
        total = sum(weights.values())
        if total <= 0:          # no trained target in the rows read (a mask that marks none)
            return sum(losses.values()) / len(losses)
        return sum(losses[i] * weights[i] for i in losses) / total

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

