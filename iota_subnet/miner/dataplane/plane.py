"""One stage's data-plane scheduler: inbound tickets and hops, the compute loop, lifecycle, status.

See the package docstring (:mod:`iota_subnet.miner.dataplane`) for the flow of a micro-batch, the
schedule (1F1B priority, a flush per lane step) and exactly-once accumulation. :class:`DataPlane`
composes its parts: :class:`~.admission.HeadAdmission`, :class:`~.compute.StageCompute`,
:class:`~.outbound.HopSending`, :class:`~.receipts.ReceiptBatching`.
"""
from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections import OrderedDict, defaultdict
from typing import Any, Awaitable, Callable, Optional

from loguru import logger

from iota_subnet.protocol import Hop, HopAck, Ticket
from iota_subnet.utils.supervise import Supervisor

from .admission import HeadAdmission
from .compute import StageCompute
from .handover import LaneHandover
from .options import DataPlaneParts, DataPlaneTunables
from .outbound import HopSending
from .receipts import ReceiptBatching
from .tracking import Pending, StepTracker, _Task

#: Hop ids remembered for de-duplication (a retried hop must not be applied twice).
SEEN_HOPS = 20_000


class DataPlane(HeadAdmission, StageCompute, LaneHandover, HopSending, ReceiptBatching):
    """One stage's data-plane scheduler (see the package docstring, :mod:`iota_subnet.miner.dataplane`).

    ``worker``: a :class:`~iota_subnet.miner.stage_worker.StageWorker` (``auto_step`` is turned off once
    data-plane traffic arrives);
    ``me``: this miner's hotkey; ``compute(fn)``: awaitable that runs ``fn`` on the compute thread;
    ``send(hotkey, hop) -> HopAck``: delivers a hop (raises ProtocolError / TransportError);
    ``post_receipts(validator, receipts)``: delivers a receipt batch (raises on failure);
    ``parts``: :class:`~.options.DataPlaneParts` (token rows, audit window, supervisor, lane handover);
    ``tunables``: :class:`~.options.DataPlaneTunables` (in-flight window, receipt interval, senders,
    clock, boot time). Their fields are kept as attributes (``rows``, ``hops``, ``sup``, ``take_lane``,
    ``max_in_flight``, ``receipt_interval_s``, ``n_senders``, ``clock``, ``boot``).
    """

    def __init__(self, worker: Any, *, me: str, n_stages: int, compute: Callable[[Callable[[], Any]], Awaitable[Any]],
                 send: Callable[[str, Hop], Awaitable[HopAck]],
                 post_receipts: Callable[[str, list[dict]], Awaitable[None]],
                 parts: DataPlaneParts = DataPlaneParts(), tunables: DataPlaneTunables = DataPlaneTunables()):
        self.worker, self.me = worker, me
        self.take_lane = parts.take_lane
        self._parked: list[_Task] = []          # forwards of a lane being taken (:mod:`.handover`)
        self._taking: Optional[asyncio.Task] = None
        self.stage, self.n_stages = int(worker.stage), int(n_stages)
        self.is_head, self.is_tail = self.stage == 0, self.stage == self.n_stages - 1
        self.compute, self.send, self.post_receipts, self.rows = compute, send, post_receipts, parts.rows
        self.max_in_flight = max(1, int(tunables.max_in_flight))
        self.receipt_interval_s = float(tunables.receipt_interval_s)
        self.clock = tunables.clock
        self.hops = parts.hops
        self.boot = float(tunables.boot if tunables.boot is not None else time.time())
        self.steps = StepTracker()
        self.tickets: dict[tuple[int, int, int], Ticket] = {}       # head: queued, not yet admitted
        #: head: per lane, the first step its validators have not seen complete (skip limit when behind)
        self.base_steps: dict[int, int] = {}
        self.pending: dict[str, Pending] = {}                       # mb id -> forward awaiting backward
        self.seen: "OrderedDict[tuple[str, str], float]" = OrderedDict()
        self._fwd: list[_Task] = []
        self._bwd: list[_Task] = []
        self._seq = itertools.count()
        self._wake = asyncio.Event()
        self._receipts: dict[str, list[dict]] = defaultdict(list)
        self._tasks: set[asyncio.Task] = set()
        #: outbound hops: a priority queue (backward and abort before forward, then by step and index)
        #: drained by ``senders`` concurrent transfers, so gradients never wait behind a step's forwards
        #: on the uplink and the uplink is never shared by more transfers than it needs
        self._out: list[tuple] = []
        self._out_ready = asyncio.Event()
        self.n_senders = max(1, int(tunables.senders))
        self.sup = parts.supervisor if parts.supervisor is not None else Supervisor(f"stage {self.stage} data plane")
        #: the supervised loops of this data plane: name -> factory (started by :meth:`start`)
        self.loops: dict[str, Callable[[], Awaitable[None]]] = {
            "dataplane": self._run, "receipts": self._flush_loop,
            **{f"sender{i}": self._send_loop for i in range(self.n_senders)}}
        self._stopping = False
        #: counters (status, metrics, benchmarks): seconds of compute, hops in/out, wire bytes
        self.busy_s = 0.0
        self.counts: dict[str, int] = defaultdict(int)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start :attr:`loops` under the supervisor (an exception restarts a loop, logged)."""
        for name, factory in self.loops.items():
            self.sup.spawn(name, factory)

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        self._out_ready.set()
        tasks = list(self._tasks)
        for t in tasks:
            if not t.done():
                t.cancel()
        await self.sup.stop(names=self.loops)
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.flush_receipts()

    # ------------------------------------------------------------------ inbound (after auth + ticket checks)
    def accept_tickets(self, tickets: list[Ticket], base_steps: Optional[dict[int, int]] = None
                       ) -> tuple[int, list[dict]]:
        """Queue tickets at the head. Returns (accepted, refused ``{microbatch_id, outcome, message}``).
        A ticket already queued or started (same micro-batch id) is accepted again without effect; one
        for a queued (lane, step, index) replaces it when it is a later attempt, or the same attempt
        issued later by the same validator (after its restart), else it is refused ``DUPLICATE``.
        ``base_steps``: lane -> first step the validator has not seen complete (see :class:`TicketBatch`)."""
        self.worker.auto_step = False           # this stage now steps when a lane step is complete
        for lane, k in (base_steps or {}).items():
            self.base_steps[lane] = max(self.base_steps.get(lane, 0), int(k))
        accepted, refused = 0, []
        for t in tickets:
            if (t.microbatch_id, "ticket") in self.seen:
                accepted += 1
                continue
            old = self.tickets.get(t.key) if t.train else None
            # a queued (not started) ticket gives way to a higher attempt, or to the same attempt issued
            # later by the same validator: it restarted and does not know what its previous process
            # queued here (refused DUPLICATE, it would lose 10-20 s per look-ahead step, and the
            # queued ticket's receipts would go to a process that no longer exists)
            newer = old is not None and (t.attempt > old.attempt or (
                t.attempt == old.attempt and t.validator == old.validator and t.issued_at > old.issued_at))
            if old is not None and not newer:
                refused.append({"microbatch_id": t.microbatch_id, "outcome": "DUPLICATE",
                                "message": f"(lane, step, index) {t.key} already queued as {old.microbatch_id}"})
                continue
            self._remember((t.microbatch_id, "ticket"))
            if t.train:
                self._supersede_pending(t)
            self._fit_cache_ttl(t)
            self.tickets[t.key if t.train else (t.lane, -2, next(self._seq))] = t
            accepted += 1
        for lane, base in self.base_steps.items():
            self._drop_completed_stand_in(lane, base)
        self.counts["tickets"] += accepted
        self._wake.set()
        return accepted, refused

    def _supersede_pending(self, t: Ticket) -> None:
        """A re-issued ticket (higher attempt for the same lane, step and index) replaces the forward
        of an older attempt still waiting here for its backward: the validator gave that attempt up
        (its backward may never come, e.g. a miner down the route died), and its window slot and stored
        activations are freed now rather than at the old ticket's deadline."""
        for mb, p in list(self.pending.items()):
            o = p.ticket
            if o.train and o.key == t.key and o.validator == t.validator and o.attempt < t.attempt:
                self.pending.pop(mb, None)
                self.worker.drop(self._key(o))
                self.steps.release(o)
                self.counts["superseded"] += 1

    def _fit_cache_ttl(self, t: Ticket) -> None:
        """The data plane drops a stored forward when its ticket's deadline passes (:meth:`_expire`);
        the activation cache's own TTL (a backstop for forwards nobody tracks) must not evict it
        earlier: a full lane step in flight over slow links can wait minutes for its backward."""
        life = t.deadline - self.clock()
        if life > self.worker.cache.ttl_s:
            self.worker.cache.ttl_s = float(life)

    def accept_hop(self, hop: Hop, ticket: Ticket, in_sha: str) -> HopAck:
        """Queue a hop from a neighbour (``in_sha``: :func:`commit_wire` of its data). A hop already
        seen is acknowledged ``duplicate`` and ignored."""
        self.worker.auto_step = False
        key = (ticket.microbatch_id, hop.direction)
        if key in self.seen:
            self.counts["duplicates"] += 1
            return HopAck(run_id=ticket.run_id, stage=self.stage, microbatch_id=ticket.microbatch_id,
                          status="duplicate")
        self._remember(key)
        now = self.clock()
        if hop.direction == "forward":
            self._fit_cache_ttl(ticket)
        if hop.direction == "abort":
            self._on_abort(ticket, hop.reason)
        else:
            prio = (0,) if hop.direction == "backward" else (1, ticket.step, ticket.index, ticket.attempt)
            task = _Task(prio, next(self._seq), hop.direction, ticket, list(hop.path), hop.data, hop.scales, in_sha,
                         loss=float(hop.info["loss"]) if "loss" in hop.info else None, received=now)
            heapq.heappush(self._bwd if hop.direction == "backward" else self._fwd, task)
            self._wake.set()
        self.counts[f"hops_in_{hop.direction}"] += 1
        return HopAck(run_id=ticket.run_id, stage=self.stage, microbatch_id=ticket.microbatch_id, status="accepted")

    def _remember(self, key: tuple[str, str]) -> None:
        self.seen[key] = self.clock()
        while len(self.seen) > SEEN_HOPS:
            self.seen.popitem(last=False)

    # ------------------------------------------------------------------ scheduling (the compute loop)
    def _next(self) -> Optional[_Task]:
        if self._bwd:
            return heapq.heappop(self._bwd)
        if self._fwd:
            return heapq.heappop(self._fwd)
        return self._admit() if self.is_head else None

    async def _run(self) -> None:
        while not self._stopping:
            task = self._next()
            if task is None:
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout=1.0)
                except asyncio.TimeoutError:
                    self._expire()
                continue
            try:
                if task.kind == "forward":
                    await self._forward(task)
                elif task.kind == "step":           # a partial inner step (see _settle_before)
                    await self._step(task.ticket.lane, self.worker.inner_step)
                else:
                    await self._backward(task)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - one bad micro-batch must not stop the stage
                logger.exception(f"stage {self.stage}: {task.kind} of {task.ticket.microbatch_id} failed")
                self._fail(task.ticket, task.path, f"{type(e).__name__}: {e}", abort=task.kind == "forward")

    def _expire(self) -> None:
        """Drop forwards whose ticket deadline passed without a backward (their claims too)."""
        now = self.clock()
        for mb, p in list(self.pending.items()):
            if p.ticket.deadline < now:
                self.pending.pop(mb, None)
                self.worker.drop(self._key(p.ticket))
                self.steps.release(p.ticket)
                self.counts["expired"] += 1
        for k, t in list(self.tickets.items()):
            if t.deadline < now:
                self.tickets.pop(k)
                self._receipt(t, status="expired", error="ticket deadline passed before it was started")

    @staticmethod
    def _key(t: Ticket) -> str:
        return f"{t.validator}:{t.microbatch_id}"

    # ------------------------------------------------------------------ status
    def status(self) -> dict:
        return {"queued_tickets": len(self.tickets), "pending_backwards": len(self.pending),
                "parked_for_lane": len(self._parked),
                "queued_forwards": len(self._fwd), "queued_backwards": len(self._bwd),
                "busy_s": round(self.busy_s, 3), "counts": dict(self.counts)}
