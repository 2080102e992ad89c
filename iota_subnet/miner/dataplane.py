"""A miner's side of the data plane: micro-batches arrive from (and go to) other miners, not the validator.

Flow of one training micro-batch through S stages (see :mod:`iota_subnet.protocol.ticket`)::

    validator --tickets--> head: reads token rows [B, T] by the ticket's sample address, forward
    head --Hop(forward, bf16 [B, T, b])--> stage 1 --> ... --> tail: reads targets, loss, backward
    tail --Hop(backward, dL/dz)--> stage S-2 --> ... --> head: backward, done
    every stage --receipts (hashes of what it received and sent, loss, timing)--> validator

Schedule (per stage, one compute thread)
    Backward work first, then forwards in (step, index) order: 1F1B priority, so activations held
    for pending backwards are freed as early as possible. The head admits the forwards of its lane
    step ``k`` (at most ``max_in_flight`` waiting for their backward) only once it has taken inner
    step ``k - 1``: a flush per lane step, so every stage updates exactly as the co-located trainer
    does (GPipe / 1F1B with flush; Narayanan et al. 2021, "Efficient large-scale language model
    training on GPU clusters", section 2.2). Many micro-batches are in flight; nothing waits for the
    validator: tickets for the next steps are already at the head.

Exactly-once accumulation
    Each stage accumulates the gradient of every ``(lane, step, index)`` at most once: a repeated
    hop (same micro-batch id and direction) is acknowledged ``duplicate`` and ignored, a re-issued
    micro-batch (higher ``attempt``) replaces a pending older attempt or, when the older one was
    already accumulated, runs without accumulating. A stage takes its inner step when every index
    of the lane step has been accumulated (:class:`StepTracker`).

Who trains on what
    Only the route's own miner of a stage (``ticket.route[stage]``) trains on a micro-batch. An
    alternate that takes a hop for a failed miner computes the forward and the input gradient only
    (no weight gradients, no inner step): a replica never runs ahead of its own lane. A lane member
    that receives step ``k`` while it is still at an earlier step (it was away) skips to ``k``.

Failures
    A forward that no candidate of the next stage accepts aborts the micro-batch: an ``abort`` hop
    travels back along the path (every stage drops its cached forward and releases its claim) and a
    ``failed`` receipt names the unreachable miners; the validator re-issues the micro-batch. A
    backward that cannot reach the previous stage is reported the same way.

Everything here runs on the miner's event loop except the ``compute`` calls (the stage's compute
thread) and the transfers (``send``, concurrent with compute).
"""
from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Optional, Protocol

import torch
from loguru import logger

from iota_subnet.audit.commit import wire_root
from iota_subnet.protocol import Hop, HopAck, ProtocolError, Ticket, from_wire, to_wire

from .hop_store import HopStore, wire_pair, wire_values

#: Hop ids remembered for de-duplication (a retried hop must not be applied twice).
SEEN_HOPS = 20_000
#: Seconds a stand-in head's forward without its backward holds the lane's later steps (see
#: :meth:`DataPlane._alternate_may_start`); after that the backward is taken as lost (a miner down the
#: route died without an abort, or another validator re-issued it elsewhere and has not said so yet).
STAND_IN_HOLD_S = 60.0
#: Wire tensors above this many bytes are committed (hashed) on a worker thread.
OFFLOAD_BYTES = 256 << 10


async def commit_wire(data: torch.Tensor, scales: Optional[torch.Tensor] = None) -> str:
    """The receipt's name for a wire tensor: :func:`iota_subnet.audit.commit.wire_root` of its token rows
    (int8: with their scales), hex. Off the event loop and the compute thread when large."""
    t = data if scales is None else (data, scales)
    if data.numel() * data.element_size() > OFFLOAD_BYTES:
        return (await asyncio.to_thread(wire_root, t)).hex()
    return wire_root(t).hex()


class RowSource(Protocol):
    """Token rows by sample address: ``rows(split, seed, start, n)`` -> int64 ``[n, seq_len + 1]``."""

    def __call__(self, split: str, seed: int, start: int, n: int) -> torch.Tensor: ...


@dataclass
class Pending:
    """A forward this stage did and whose backward it still expects."""

    ticket: Ticket
    path: list[str]                 # hotkeys of stages 0 .. this one
    accumulate: bool
    fwd_in: str = ""
    fwd_out: str = ""
    sent_to: str = ""
    unreachable: list[str] = field(default_factory=list)    # next-stage miners tried first, that failed
    started: float = 0.0
    compute_s: float = 0.0
    weights: tuple[int, int] = (0, 0)
    bweights: tuple[int, int] = (-1, -1)        # the backward's weights version when it differs


@dataclass(order=True)
class _Task:
    priority: tuple
    seq: int
    kind: str = field(compare=False)                  # forward | backward | step (head: see _settle_before)
    ticket: Ticket = field(compare=False)
    path: list[str] = field(compare=False)
    data: Optional[torch.Tensor] = field(compare=False, default=None)
    scales: Optional[torch.Tensor] = field(compare=False, default=None)
    in_sha: str = field(compare=False, default="")
    loss: Optional[float] = field(compare=False, default=None)
    received: float = field(compare=False, default=0.0)


class StepTracker:
    """Which indices of a lane step this stage has claimed (forward done, backward pending) and
    accumulated. Keys: ``(lane, step)``; values: ``index -> (microbatch id, attempt)`` / a set."""

    def __init__(self) -> None:
        self.claims: dict[tuple[int, int], dict[int, tuple[str, int]]] = defaultdict(dict)
        self.done: dict[tuple[int, int], set[int]] = defaultdict(set)

    def claim(self, t: Ticket) -> tuple[bool, Optional[str]]:
        """Claim ``t``'s index for accumulation. Returns (claimed, superseded micro-batch id)."""
        ls = (t.lane, t.step)
        if t.index in self.done[ls]:
            return False, None
        prev = self.claims[ls].get(t.index)
        if prev is not None and t.attempt <= prev[1]:
            return False, None
        self.claims[ls][t.index] = (t.microbatch_id, t.attempt)
        return True, prev[0] if prev is not None else None

    def release(self, t: Ticket) -> None:
        ls = (t.lane, t.step)
        if self.claims[ls].get(t.index, ("", -1))[0] == t.microbatch_id:
            del self.claims[ls][t.index]

    def complete(self, t: Ticket) -> bool:
        """The claimed index is accumulated. Returns True when the whole lane step is."""
        ls = (t.lane, t.step)
        self.claims[ls].pop(t.index, None)
        self.done[ls].add(t.index)
        return len(self.done[ls]) >= t.micro_per_step

    def busy(self, lane: int, step: int) -> bool:
        return bool(self.claims.get((lane, step))) or bool(self.done.get((lane, step)))

    def forget(self, lane: int, step: int) -> None:
        self.claims.pop((lane, step), None)
        self.done.pop((lane, step), None)


class DataPlane:
    """One stage's data-plane scheduler (see the module docstring).

    ``worker``: a :class:`~iota_subnet.miner.stage_worker.StageWorker` (``auto_step`` is turned off once
    data-plane traffic arrives);
    ``me``: this miner's hotkey; ``compute(fn)``: awaitable that runs ``fn`` on the compute thread;
    ``send(hotkey, hop) -> HopAck``: delivers a hop (raises ProtocolError / TransportError);
    ``post_receipts(validator, receipts)``: delivers a receipt batch (raises on failure);
    ``rows``: the head's and tail's token source; ``max_in_flight``: forwards the head keeps waiting
    for their backward (bounds stored activations: about ``max_in_flight`` x the stage's activation
    bytes per micro-batch at the head, fewer further down). ``hops``: the audit window
    (:class:`~iota_subnet.miner.hop_store.HopStore`): every training hop is recorded there and
    receipts name the root of the weights version each used (None: no hop audits, ``wroot`` empty).
    ``boot``: unix time this process started (in every receipt: a restart announces itself).
    """

    def __init__(self, worker: Any, *, me: str, n_stages: int, compute: Callable[[Callable[[], Any]], Awaitable[Any]],
                 send: Callable[[str, Hop], Awaitable[HopAck]],
                 post_receipts: Callable[[str, list[dict]], Awaitable[None]], rows: Optional[RowSource] = None,
                 max_in_flight: int = 8, receipt_interval_s: float = 0.5, wire_dtype: Optional[str] = None,
                 senders: int = 2, clock: Callable[[], float] = time.time, hops: Optional[HopStore] = None,
                 boot: Optional[float] = None):
        self.worker, self.me = worker, me
        self.stage, self.n_stages = int(worker.stage), int(n_stages)
        self.is_head, self.is_tail = self.stage == 0, self.stage == self.n_stages - 1
        self.compute, self.send, self.post_receipts, self.rows = compute, send, post_receipts, rows
        self.max_in_flight = max(1, int(max_in_flight))
        self.receipt_interval_s = float(receipt_interval_s)
        self.clock = clock
        self.hops = hops
        self.boot = float(boot if boot is not None else time.time())
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
        self.n_senders = max(1, int(senders))
        self._senders: list[asyncio.Task] = []
        self._runner: Optional[asyncio.Task] = None
        self._flusher: Optional[asyncio.Task] = None
        self._stopping = False
        #: counters (status, metrics, benchmarks): seconds of compute, hops in/out, wire bytes
        self.busy_s = 0.0
        self.counts: dict[str, int] = defaultdict(int)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._runner = asyncio.create_task(self._run(), name="dataplane")
        self._flusher = asyncio.create_task(self._flush_loop(), name="receipts")
        self._senders = [asyncio.create_task(self._send_loop(), name=f"sender{i}") for i in range(self.n_senders)]

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        self._out_ready.set()
        tasks = [t for t in (self._runner, self._flusher, *self._senders, *self._tasks) if t is not None]
        for t in tasks:
            if not t.done():
                t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.flush_receipts()

    def _queue_send(self, prio: tuple, coro_fn: Callable[[], Awaitable[None]]) -> None:
        heapq.heappush(self._out, (prio, next(self._seq), coro_fn))
        self._out_ready.set()

    async def _send_loop(self) -> None:
        while not self._stopping:
            if not self._out:
                self._out_ready.clear()
                await self._out_ready.wait()
                continue
            _, _, fn = heapq.heappop(self._out)
            try:
                await fn()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a send reports its own failures; never stop the sender
                logger.exception(f"stage {self.stage}: a send failed unexpectedly")

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

    # ------------------------------------------------------------------ scheduling
    def _admit(self) -> Optional[_Task]:
        """Head: the next ticket to start, if the window and the step flush allow one."""
        if not self.tickets:
            return None
        w = self.worker
        in_flight = sum(1 for p in self.pending.values() if p.ticket.train)
        members = sorted(k for k, t in self.tickets.items() if t.train and t.is_member(0, self.me))
        if members:
            lane, step, _ = members[0]
            if step < w.inner_step and not self.steps.busy(lane, step):
                for k in [k for k in members if k[1] < w.inner_step]:          # stale: already stepped past
                    t = self.tickets.pop(k)
                    self._receipt(t, status="stale", error=f"head already at inner step {w.inner_step}")
                return self._admit()
            base = min(step, self.base_steps.get(lane, 0))
            if base > w.inner_step:
                if self._settle_before(lane, base):
                    return _Task((0,), next(self._seq), "step", self.tickets[members[0]], [])
                if not any(self.steps.busy(lane, s) for s in range(w.inner_step, base)):
                    skipped = w.skip_to(base)      # restarted behind the lane: its validator says < base is done
                    logger.warning(f"stage 0: lane {lane} has completed steps before {base}; this head was at "
                                   f"{base - skipped}: skipped {skipped} inner step(s)")
            if step == w.inner_step and in_flight < self.max_in_flight:
                return self._task_from_ticket(self.tickets.pop(members[0]))
        open_steps: Optional[dict[int, int]] = None
        for k in sorted(k for k, t in self.tickets.items() if not (t.train and t.is_member(0, self.me))):
            t = self.tickets[k]
            if not t.train:
                return self._task_from_ticket(self.tickets.pop(k))
            if in_flight < self.max_in_flight:
                open_steps = self._stand_in_open_steps() if open_steps is None else open_steps
                if self._alternate_may_start(t, open_steps):
                    return self._task_from_ticket(self.tickets.pop(k))
        return None

    def _drop_completed_stand_in(self, lane: int, base: int) -> None:
        """Head standing in for ``lane``'s own first-stage miner: its tickets and forwards of steps the
        validator has seen complete (``< base``) went through another head; drop them (a ``stale``
        receipt for each ticket) so that they neither run again nor hold window slots."""
        for k, t in list(self.tickets.items()):
            if t.train and t.lane == lane and t.step < base and not t.is_member(0, self.me):
                self.tickets.pop(k)
                self._receipt(t, status="stale", error=f"lane {lane} completed steps before {base} elsewhere")
        self._settle_pending(lambda p: p.ticket.train and p.ticket.lane == lane and p.ticket.step < base
                             and not p.accumulate)

    def _settle_pending(self, completed: Callable[[Pending], bool]) -> list[Ticket]:
        """Drop the forwards waiting here for a backward that will not come (their micro-batches
        completed elsewhere): window slots, stored activations, step claims. Returns their tickets."""
        out = []
        for mb, p in list(self.pending.items()):
            if completed(p):
                self.pending.pop(mb, None)
                self.worker.drop(self._key(p.ticket))
                self.steps.release(p.ticket)
                self.counts["settled"] += 1
                out.append(p.ticket)
        return out

    def _stand_in_open_steps(self) -> dict[int, int]:
        """Per lane, the lowest step at or above the validator's base that is still queued here or
        whose forward (started within ``STAND_IN_HOLD_S``) waits for its backward: a stand-in head
        may start no later step of that lane (see :meth:`_alternate_may_start`)."""
        held_since = self.clock() - STAND_IN_HOLD_S
        low: dict[int, int] = {}
        for o, recent in itertools.chain(((o, True) for o in self.tickets.values()),
                                         ((p.ticket, p.started >= held_since) for p in self.pending.values())):
            if o.train and recent and o.step >= self.base_steps.get(o.lane, 0):
                low[o.lane] = min(low.get(o.lane, o.step), o.step)
        return low

    def _alternate_may_start(self, t: Ticket, open_steps: dict[int, int]) -> bool:
        """Head standing in for a lane's own first-stage miner (it does not train on ``t``, the lane
        members of later stages do): start lane step ``k`` only once this head's forwards of the
        lane's earlier steps have come back, as the lane's own head does (a flush per lane step).
        Steps the validator has seen complete (``base_steps``) do not hold it. Without this a stand-in
        head would run every look-ahead ticket at once: the later stages' lane members would receive
        step k + 4 while step k is in flight, skip their inner steps to it and lose the micro-batches
        of the steps between."""
        return t.step <= self.base_steps.get(t.lane, 0) or t.step <= open_steps.get(t.lane, t.step)

    def _settle_before(self, lane: int, base: int) -> bool:
        """Head, behind its lane: the lane's validator has seen every step before ``base`` complete. It
        counts a micro-batch done on the head's receipt, which a head sends after its backward, so the
        forwards this head still holds for those steps are attempts completed through another head
        (a reroute after a failure here): their backward will not come, and waiting for it stalled the
        lane until the tickets' deadline. They are dropped (window slots, stored activations). What
        this head did accumulate of its current inner step, micro-batches counted done through it,
        is applied rather than thrown away: returns True when that partial inner step is due (the
        caller runs it; the next admission skips the rest of the way to ``base``)."""
        w = self.worker
        for o in self._settle_pending(lambda p: p.ticket.train and p.ticket.lane == lane and p.ticket.step < base):
            logger.info(f"stage 0: lane {lane} step {o.step} completed through another head; dropped "
                        f"{o.microbatch_id} (its backward will not come here)")
        done = self.steps.done.get((lane, w.inner_step))
        if done and not self.steps.claims.get((lane, w.inner_step)):
            logger.warning(f"stage 0: lane {lane} has completed steps before {base}; this head accumulated "
                           f"{len(done)} of step {w.inner_step}'s micro-batches (the rest went through other "
                           f"heads): applying them as its inner step {w.inner_step}")
            return True
        return False

    def _task_from_ticket(self, t: Ticket) -> _Task:
        return _Task((1, t.step, t.index, t.attempt), next(self._seq), "forward", t, [], received=self.clock())

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

    # ------------------------------------------------------------------ compute
    @staticmethod
    def _key(t: Ticket) -> str:
        return f"{t.validator}:{t.microbatch_id}"

    def _accumulates(self, t: Ticket) -> bool:
        """Claim ``t`` for accumulation when this miner is the route's own miner of its stage."""
        w = self.worker
        if not t.train or not t.is_member(self.stage, self.me) or t.step < w.inner_step:
            return False
        if t.step > w.inner_step:
            if any(self.steps.busy(t.lane, s) for s in range(w.inner_step, t.step)):
                logger.warning(f"stage {self.stage}: lane {t.lane} step {t.step} arrived while step "
                               f"{w.inner_step} is incomplete here; its missing micro-batches are lost")
                for s in range(w.inner_step, t.step):
                    self.steps.forget(t.lane, s)
            skipped = w.skip_to(t.step)
            logger.warning(f"stage {self.stage}: skipped {skipped} inner step(s) to lane {t.lane} step {t.step}")
        ok, superseded = self.steps.claim(t)
        if superseded is not None:
            old = self.pending.pop(superseded, None)
            if old is not None:
                self.worker.drop(self._key(old.ticket))
        return ok

    async def _forward(self, task: _Task) -> None:
        t, w = task.ticket, self.worker
        accumulate = self._accumulates(t)
        targets = None
        t0 = time.perf_counter()
        if self.is_head or self.is_tail:
            rows = self.rows(t.split, t.seed, t.start, t.rows)            # [B, T + 1]
            if rows.shape != (t.rows, t.seq_len + 1):
                raise ValueError(f"data gives rows {tuple(rows.shape)} for ticket shape {(t.rows, t.seq_len + 1)}")
            targets = rows[:, 1:].contiguous() if self.is_tail else None
            x = rows[:, :-1].contiguous() if self.is_head else None
        if not self.is_head:
            x = from_wire(task.data, task.scales)

        def run():
            with w.lock:            # the weights version the audit window names is the one the hop uses
                if self.hops is not None and t.train:
                    self.hops.observe(w)
                out = w.forward(self._key(t), x, targets, train=t.train, accumulate=accumulate)
            wire = None
            if not self.is_tail:
                wire = to_wire(out["activations"], t.wire_dtype)
            elif t.train and out.get("grad") is not None:
                wire = to_wire(out["grad"], t.wire_dtype)
            return out, wire
        out, wire = await self.compute(run)
        dt = time.perf_counter() - t0
        self.busy_s += dt
        self.counts["forwards"] += 1
        path = task.path + [self.me]
        weights = (int(out.get("weights_step", w.inner_step)), int(out.get("weights_merges", w.merges)))
        if self.hops is not None and t.train:
            self._record_forward(t, x, targets, task, wire, weights)
        if self.is_tail:
            loss = float(out["loss"])
            if not t.train:
                self._receipt(t, fin=task.in_sha, loss=loss, compute_s=dt, weights=weights, prev=path[-2:-1])
                return
            stepped = accumulate and self.steps.complete(t)
            receipt = dict(fin=task.in_sha, loss=loss, compute_s=dt, weights=weights, accumulated=accumulate,
                           prev=path[-2:-1])
            if stepped:
                await self._step(t.lane, t.step)
            if wire is not None:
                self._queue_send((0,), lambda: self._send_backward(t, path[:-1], wire, loss, receipt))
            else:
                self._receipt(t, **receipt)
            return
        pend = Pending(t, path, accumulate, fwd_in=task.in_sha, started=task.received, compute_s=dt, weights=weights)
        if t.train:
            self.pending[t.microbatch_id] = pend
        self._queue_send((1, t.step, t.index, t.attempt), lambda: self._send_forward(t, path, wire, pend))

    async def _backward(self, task: _Task) -> None:
        t, w = task.ticket, self.worker
        pend = self.pending.pop(t.microbatch_id, None)
        if pend is None:
            self.counts["unknown_backward"] += 1
            self._receipt(t, status="failed", error="backward for a micro-batch this stage no longer holds")
            return
        grad = from_wire(task.data, task.scales)
        if pend.accumulate and t.step != w.inner_step:
            # the stage moved on while this micro-batch was away (it was paused, or skipped to a later
            # step): its gradient belongs to a step already taken or abandoned, so it is not applied
            pend.accumulate = False
            self.steps.release(t)
            self.counts["stale_backwards"] += 1
        t0 = time.perf_counter()

        def run():
            with w.lock:
                if self.hops is not None:
                    self.hops.observe(w)
                g = w.backward(self._key(t), grad, accumulate=pend.accumulate)
                used = (int(w.last_weights_step), int(w.last_weights_merges))
            return (None if g is None else to_wire(g, t.wire_dtype)), used
        wire, used = await self.compute(run)
        if used != pend.weights:
            pend.bweights = used
        if self.hops is not None and not self.is_head:
            self.hops.record_backward(t.microbatch_id, grad=wire_values(task.data, task.scales),
                                      version=used, wire={"wire.dz": wire_pair(task.data, task.scales),
                                                          **({"wire.dx": wire_pair(*wire)} if wire is not None else {})})
        dt = time.perf_counter() - t0
        self.busy_s += dt
        self.counts["backwards"] += 1
        stepped = pend.accumulate and self.steps.complete(t)
        receipt = dict(fin=pend.fwd_in, fout=pend.fwd_out, bin=task.in_sha, loss=task.loss,
                       compute_s=pend.compute_s + dt, weights=pend.weights, bweights=pend.bweights,
                       accumulated=pend.accumulate,
                       prev=pend.path[-2:-1], next_=pend.sent_to, unreachable=pend.unreachable)
        if stepped:
            await self._step(t.lane, t.step)
        if wire is not None:
            self._queue_send((0,), lambda: self._send_backward(t, pend.path[:-1], wire, task.loss, receipt))
        else:
            self._receipt(t, **receipt)
            self._wake.set()            # the head: a window slot is free

    def _record_forward(self, t: Ticket, x: torch.Tensor, targets: Optional[torch.Tensor], task: _Task, wire,
                        weights: tuple[int, int]) -> None:
        """Keep a training forward for audits: its inputs as the stage used them and its wire tensors
        (``wire.x`` received, ``wire.z`` sent; the tail's ``wire.dx``): references, not copies."""
        tensors = {}
        if not self.is_head:
            tensors["wire.x"] = wire_pair(task.data, task.scales)
            x = wire_values(task.data, task.scales)
        if wire is not None:
            tensors["wire.dx" if self.is_tail else "wire.z"] = wire_pair(*wire)
        self.hops.record_forward(t.microbatch_id, wire_format=t.wire_dtype, x=x, version=weights, targets=targets,
                                 wire=tensors)

    async def _step(self, lane: int, step: int) -> None:
        """Every index of lane step ``step`` is accumulated here (or the lane completed the rest
        elsewhere, see :meth:`_settle_before`): take the inner step."""
        w = self.worker
        t0 = time.perf_counter()
        await self.compute(w.step)
        self.busy_s += time.perf_counter() - t0
        self.steps.forget(lane, step)
        self.counts["steps"] += 1
        logger.debug(f"stage {self.stage}: lane {lane} step {step} done -> inner step {w.inner_step}")
        self._wake.set()

    # ------------------------------------------------------------------ outbound
    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _hop(self, t: Ticket, stage: int, direction: str, path: list[str], wire, loss: Optional[float] = None,
             reason: str = "") -> Hop:
        data, scales = (wire if wire is not None else (None, None))
        info = {"loss": loss} if loss is not None else {}
        return Hop(run_id=t.run_id, stage=stage, microbatch_id=t.microbatch_id, inner_step=self.worker.inner_step,
                   ticket=t.to_json(), direction=direction, path=list(path), reason=reason, data=data,
                   scales=scales, info=info)

    async def _send_forward(self, t: Ticket, path: list[str], wire, pend: Pending) -> None:
        nxt, errors, failed = self.stage + 1, [], []
        sha = await commit_wire(*wire)
        for cand in t.candidates(nxt):
            if cand == self.me:
                continue
            try:
                await self.send(cand, self._hop(t, nxt, "forward", path, wire))
            except (ProtocolError, Exception) as e:  # noqa: BLE001 - transport or refusal: try the next one
                if isinstance(e, asyncio.CancelledError):
                    raise
                errors.append(f"{cand[:10]}: {type(e).__name__}: {str(e)[:120]}")
                failed.append(cand)
                self.counts["send_failures"] += 1
                continue
            pend.sent_to, pend.fwd_out = cand, sha
            pend.unreachable = failed
            self.counts["hops_out_forward"] += 1
            return
        self._fail(t, path, "no miner of stage {} took the forward: {}".format(nxt, "; ".join(errors) or "none named"),
                   abort=True, unreachable=failed)

    async def _send_backward(self, t: Ticket, path: list[str], wire, loss: Optional[float], receipt: dict) -> None:
        """Send the input gradient to the stage before; then the receipt of this stage's work (with the
        digest of what was sent), or a ``failed`` one naming the unreachable miner."""
        prev = path[-1]
        try:
            sha = await commit_wire(*wire)
            await self.send(prev, self._hop(t, self.stage - 1, "backward", path, wire, loss=loss))
            self.counts["hops_out_backward"] += 1
            self._receipt(t, bout=sha, **receipt)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001
            self.counts["send_failures"] += 1
            self._receipt(t, status="failed", error=f"backward to {prev[:10]} failed: {type(e).__name__}: {str(e)[:160]}",
                          unreachable=[prev])

    def _fail(self, t: Ticket, path: list[str], error: str, *, abort: bool, unreachable: Optional[list[str]] = None
              ) -> None:
        """This stage cannot go on with ``t``: forget it here, tell the stages before (abort) and the validator."""
        self.pending.pop(t.microbatch_id, None)
        self.worker.drop(self._key(t))
        self.steps.release(t)
        logger.warning(f"stage {self.stage}: micro-batch {t.microbatch_id} failed: {error}")
        self._receipt(t, status="failed", error=error, unreachable=unreachable or [])
        back = path[:-1] if path and path[-1] == self.me else path
        if abort and self.stage > 0 and back:
            self._spawn(self._send_abort(t, back, error))
        self._wake.set()

    async def _send_abort(self, t: Ticket, path: list[str], reason: str) -> None:
        try:
            await self.send(path[-1], self._hop(t, self.stage - 1, "abort", path, None, reason=reason[:200]))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - best effort: the stage before expires it at the deadline
            logger.debug(f"abort of {t.microbatch_id} to {path[-1][:10]} failed: {e}")

    def _on_abort(self, t: Ticket, reason: str) -> None:
        p = self.pending.pop(t.microbatch_id, None)
        self.worker.drop(self._key(t))
        self.steps.release(t)
        self.counts["aborted"] += 1
        if p is not None and self.stage > 0:
            self._spawn(self._send_abort(t, p.path[:-1], reason))
        self._wake.set()

    # ------------------------------------------------------------------ receipts
    def _receipt(self, t: Ticket, *, status: str = "ok", fin: str = "", fout: str = "", bin: str = "",
                 bout: str = "", loss: Optional[float] = None, compute_s: float = 0.0,
                 weights: tuple[int, int] = (-1, -1), bweights: tuple[int, int] = (-1, -1), accumulated: bool = False,
                 prev: Optional[list] = None, next_: str = "", error: str = "",
                 unreachable: Optional[list[str]] = None) -> None:
        r = {"id": t.microbatch_id, "lane": t.lane, "step": t.step, "index": t.index, "attempt": t.attempt,
             "stage": self.stage, "status": status, "fin": fin, "fout": fout, "bin": bin, "bout": bout,
             "loss": loss, "compute_s": round(compute_s, 6), "ws": weights[0], "wm": weights[1],
             "bws": bweights[0], "bwm": bweights[1], "boot": round(self.boot, 3),
             "accumulated": bool(accumulated), "prev": prev[0] if prev else "", "next": next_,
             "inner_step": int(self.worker.inner_step), "t": round(self.clock(), 3), "error": error[:300],
             "unreachable": list(unreachable or [])[:8]}
        self._receipts[t.validator].append(r)
        self.counts[f"receipts_{status}"] += 1
        if status != "ok" or len(self._receipts[t.validator]) >= 256:
            self._spawn(self.flush_receipts(t.validator))

    async def _flush_loop(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self.receipt_interval_s)
            self._expire()
            await self.flush_receipts()

    async def _name_versions(self, batch: list[dict]) -> None:
        """Fill in the weights version roots (``wroot``, ``bwroot``) of receipts about to be sent
        (waiting for their hashing, off the compute thread). A version no longer kept stays ``""``."""
        if self.hops is None:
            return
        roots: dict[tuple[int, int], str] = {}
        for r in batch:
            for ks, km, field_ in (("ws", "wm", "wroot"), ("bws", "bwm", "bwroot")):
                v = (int(r[ks]), int(r[km]))
                if r.get(field_) or v[0] < 0 or r["status"] != "ok":
                    continue
                if v not in roots:
                    try:
                        roots[v] = await self.hops.root(v)
                    except Exception as e:  # noqa: BLE001 - a failed hash leaves the hop unauditable
                        logger.warning(f"stage {self.stage}: weights version {v} could not be committed: {e}")
                        roots[v] = ""
                r[field_] = roots[v]

    async def flush_receipts(self, validator: Optional[str] = None) -> None:
        for v in [validator] if validator else list(self._receipts):
            batch = self._receipts.pop(v, [])
            if not batch:
                continue
            try:
                await self._name_versions(batch)
                await self.post_receipts(v, batch)
                self.counts["receipt_batches"] += 1
            except asyncio.CancelledError:
                self._receipts[v][:0] = batch
                raise
            except Exception as e:  # noqa: BLE001 - keep them for the next flush (bounded)
                self._receipts[v][:0] = batch[-4096:]
                logger.debug(f"receipts to {v[:10]} not delivered: {type(e).__name__}: {e}")

    # ------------------------------------------------------------------ status
    def status(self) -> dict:
        return {"queued_tickets": len(self.tickets), "pending_backwards": len(self.pending),
                "queued_forwards": len(self._fwd), "queued_backwards": len(self._bwd),
                "busy_s": round(self.busy_s, 3), "counts": dict(self.counts)}
