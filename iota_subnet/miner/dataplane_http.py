"""The data plane's routes on a miner: the ``/tickets`` and ``/hop`` routes, hop delivery to other
miners and receipt delivery to validators (the scheduling itself is :mod:`.dataplane`), through a
data-plane transport (:mod:`.dataplane.transport`: signed HTTP on the miner's server, or in process).

Routes (signed POSTs, btauth/1)
    ``/tickets``  TicketBatch -> TicketAck   a validator with a permit, to a stage-0 miner
    ``/hop``      Hop -> HopAck              miners named on the hop's ticket (see :mod:`.tickets`)

A refused hop or ticket gets a typed 4xx (``BAD_TICKET``, ``TICKET_EXPIRED``, ``NOT_ON_ROUTE``,
``BAD_SHAPE``, ``BAD_DTYPE``, ...) and nothing is computed; the miner keeps serving. A hop whose
data does not match the root its sender committed (``info["root"]``) is ``HASH_MISMATCH``. A hop
refused for a fault its signed bytes prove goes to the ticket's validator as evidence against its
sender (:mod:`.refusals`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Mapping, Optional, Sequence

from iota_subnet.protocol import (HOP_DIRECTIONS, Hop, HopAck, Outcome, ProtocolError, ReceiptBatch,
                                  Ticket, TicketAck, TicketBatch, hop_contract)
from iota_subnet.protocol.messages import MAX_UPDATES_PER_BATCH
from iota_subnet.protocol.wire import WIRE_TORCH_DTYPES, check_scales
from iota_subnet.transport.server import Route
from iota_subnet.utils.supervise import Supervisor

from .dataplane import DataPlane, DataPlaneParts, DataPlaneTunables, RowSource, commit_wire
from .dataplane.transport import DataPlaneTransport, HttpDataPlaneTransport
from .hop_store import HopStore
from .refusals import RefusalReporter
from .tickets import TicketChecker, TicketShape

#: Tickets accepted in one /tickets request.
MAX_TICKETS_PER_BATCH = 4096


@dataclass(frozen=True)
class NodeLinks:
    """What a :class:`DataPlaneNode` calls on the miner service that owns it.

    ``neurons()``: hotkey -> metagraph neuron; ``endpoint_of(hotkey)``: ``"ip:port"`` or None;
    ``refresh()``: re-read the metagraph now (an unknown hotkey may have just registered);
    ``gate()``: awaited before each compute (a running replica merge; None: none);
    ``after_compute()``: called after each (starts merges that are due; None: none);
    ``take_lane(ticket)``: gives this replica a lane's weights before it trains in a lane it did not
    train (:mod:`iota_subnet.miner.dataplane.handover`; None: no handover);
    ``relays_of(hotkey)``: the relays a peer that cannot be dialled publishes (tried when its axon
    does not answer; None: none).
    """

    neurons: Callable[[], Mapping[str, Any]]
    endpoint_of: Callable[[str], Optional[str]]
    refresh: Callable[[], Awaitable[None]]
    gate: Optional[Callable[[], Awaitable[None]]] = None
    after_compute: Optional[Callable[[], None]] = None
    take_lane: Optional[Callable[[Ticket], Awaitable[str]]] = None
    relays_of: Optional[Callable[[str], Sequence[str]]] = None


@dataclass(frozen=True)
class NodeParts:
    """The optional parts of a :class:`DataPlaneNode` (every field optional).

    ``rows``: the head's and tail's token source. ``hops``: the audit window (receipts name weights
    version roots). ``updates``: the stage's :class:`~iota_subnet.miner.update_store.UpdateStore`, whose
    commitments travel to every validator with the next receipt batch. ``supervisor``: runs and
    restarts the data plane's loops (see :class:`~iota_subnet.miner.dataplane.DataPlane`).
    ``transport``: how hops, receipts and refusal reports travel and how the routes are served (None:
    signed HTTP through ``endpoint_of`` with the tunables' ``hop_timeout_s``,
    :class:`~.dataplane.transport.HttpDataPlaneTransport`).
    """

    rows: Optional[RowSource] = None
    hops: Optional[HopStore] = None
    updates: Optional[Any] = None
    supervisor: Optional[Supervisor] = None
    transport: Optional[DataPlaneTransport] = None


class DataPlaneNode:
    """One miner's data plane behind its :class:`~iota_subnet.transport.NeuronServer` (or in process).

    ``worker``: the stage's :class:`~iota_subnet.miner.stage_worker.StageWorker`; ``wallet``: this
    miner's (its hotkey signs hops and receipts); ``shape``: what this run's tickets must match
    (:class:`~.tickets.TicketShape`); ``stage``: the stage served; ``compute(fn)``: run ``fn`` on the
    stage's compute thread. ``links``: :class:`NodeLinks` (metagraph, endpoints, merge gate, lane
    handover); ``parts``: :class:`NodeParts` (token rows, audit window, update store, supervisor,
    transport); ``tunables``: :class:`~.dataplane.DataPlaneTunables` (in-flight window, hop timeout,
    receipt interval, boot time).
    """

    def __init__(self, worker: Any, wallet: Any, *, shape: TicketShape, stage: int,
                 compute: Callable[[Callable[[], Any]], Awaitable[Any]], links: NodeLinks,
                 parts: NodeParts = NodeParts(), tunables: DataPlaneTunables = DataPlaneTunables()):
        self.wallet, self.shape, self.run_id, self.stage = wallet, shape, shape.run_id, stage
        self.me: str = wallet.hotkey.ss58_address
        self.width, self.max_rows = shape.width, shape.max_rows
        self.refresh = links.refresh
        self._compute, self._gate, self._after = compute, links.gate, links.after_compute
        self.checker = TicketChecker(shape, stage=stage, me=self.me, neurons=links.neurons)
        self.transport: DataPlaneTransport = parts.transport if parts.transport is not None else \
            HttpDataPlaneTransport(wallet, links.endpoint_of, links.refresh, tunables.hop_timeout_s,
                                   alternates=links.relays_of)
        #: hops this miner refused for a provable fault go to their ticket's validator as evidence
        self.refusals = RefusalReporter(run_id=shape.run_id, post=self.transport.post_refusal)
        self.plane = DataPlane(worker, me=self.me, n_stages=shape.n_stages, compute=self.compute,
                               send=self._send, post_receipts=self._post_receipts,
                               parts=DataPlaneParts(rows=parts.rows, hops=parts.hops, supervisor=parts.supervisor,
                                                    take_lane=links.take_lane),
                               tunables=tunables)
        self.updates = parts.updates
        #: update commitments taken from the store (newest last) and, per validator, how many it was sent
        self._commits: list[dict] = []
        self._commits_base = 0                   # commitments dropped from the front of _commits
        self._commits_sent: dict[str, int] = {}

    def routes(self) -> list[Route]:
        """The routes this node answers (requests checked against their contract, then handled)."""
        T, b = self.shape.seq_len, self.width
        return [Route("/hop", self._hop_route, Hop, hop_contract(seq_len=T, width=b, max_batch=self.max_rows),
                      on_refused=self.refusals.on_refused),
                Route("/tickets", self._tickets_route, TicketBatch, None)]

    def mount(self, server: Any = None) -> None:
        """Serve :meth:`routes` through the transport (on ``server``, the miner's NeuronServer, for HTTP)."""
        self.transport.serve(self.routes(), server)

    def start(self) -> None:
        self.plane.start()

    async def stop(self) -> None:
        await self.plane.stop()
        await self.refusals.close()
        await self.transport.close()

    async def compute(self, fn: Callable[[], Any]) -> Any:
        if self._gate is not None:
            await self._gate()
        out = await self._compute(fn)
        if self._after is not None:
            self._after()
        return out

    # ---------------------------------------------------------------- inbound
    async def _check(self, raw: Any, sender: str, direction: str) -> Ticket:
        try:
            return self.checker.check(raw, sender=sender, direction=direction)
        except ProtocolError as e:
            if e.outcome != Outcome.BAD_TICKET:
                raise
            await self.refresh()          # a validator or miner that registered a moment ago
            return self.checker.check(raw, sender=sender, direction=direction)

    async def _tickets_route(self, msg: TicketBatch, ctx) -> TicketAck:
        if msg.run_id != self.run_id:
            raise ProtocolError(Outcome.FORBIDDEN, f"this miner trains run {self.run_id!r}, not {msg.run_id!r}")
        if self.stage != 0:
            raise ProtocolError(Outcome.NOT_ON_ROUTE, f"tickets go to a stage-0 miner; this one serves stage {self.stage}")
        if len(msg.tickets) > MAX_TICKETS_PER_BATCH:
            raise ProtocolError(Outcome.BODY_TOO_LARGE, f"{len(msg.tickets)} tickets > {MAX_TICKETS_PER_BATCH} per request")
        ok, refused = [], []
        for raw in msg.tickets:
            try:
                ok.append(await self._check(raw, ctx.caller_hotkey, "ticket"))
            except ProtocolError as e:
                mb = raw.get("microbatch_id", "") if isinstance(raw, dict) else ""
                refused.append({"microbatch_id": str(mb)[:160], "outcome": e.outcome.value, "message": e.message[:200]})
        if refused and not ok:
            first = refused[0]
            raise ProtocolError(Outcome(first["outcome"]), first["message"])
        base = {}
        for k, v in msg.base_steps.items():
            if not (isinstance(k, str) and k.isdigit() and type(v) is int and v >= 0):
                raise ProtocolError(Outcome.MALFORMED, "base_steps maps lane numbers to steps >= 0")
            base[int(k)] = v
        accepted, dup = self.plane.accept_tickets(ok, base)
        return TicketAck(run_id=self.run_id, stage=0, accepted=accepted, refused=refused + dup)

    async def _hop_route(self, msg: Hop, ctx) -> HopAck:
        if msg.direction not in HOP_DIRECTIONS:
            raise ProtocolError(Outcome.MALFORMED, f"hop direction {msg.direction!r} not one of {HOP_DIRECTIONS}")
        if msg.stage != self.stage:
            raise ProtocolError(Outcome.NOT_ON_ROUTE, f"this miner serves stage {self.stage}, not {msg.stage}")
        t = await self._check(msg.ticket, ctx.caller_hotkey, msg.direction)
        expect_path = self.stage if msg.direction == "forward" else self.stage + 1
        if len(msg.path) != expect_path or any(not isinstance(h, str) for h in msg.path) \
                or (msg.direction == "forward" and self.stage > 0 and msg.path[-1] != ctx.caller_hotkey) \
                or (msg.direction != "forward" and msg.path[-1] != self.me):
            raise ProtocolError(Outcome.NOT_ON_ROUTE, f"hop path of {len(msg.path)} hotkeys does not lead here")
        if msg.direction != "abort":
            if msg.data is None:
                raise ProtocolError(Outcome.MALFORMED, f"a {msg.direction} hop carries data")
            want = (t.rows, t.seq_len, t.width)
            if tuple(msg.data.shape) != want:
                raise ProtocolError(Outcome.BAD_SHAPE, f"hop data {list(msg.data.shape)}; the ticket says {list(want)}")
            if msg.data.dtype != WIRE_TORCH_DTYPES[t.wire_dtype]:
                raise ProtocolError(Outcome.BAD_DTYPE, f"hop data is {str(msg.data.dtype).removeprefix('torch.')}; "
                                                       f"the ticket says {t.wire_dtype}")
            try:
                check_scales(msg.data, msg.scales)      # int8 / fp8 with per-row scales, and only they
            except ValueError as e:
                raise ProtocolError(Outcome.MALFORMED, f"hop data: {e}") from None
            if msg.direction == "forward" and self.stage == 0:
                raise ProtocolError(Outcome.NOT_ON_ROUTE, "stage 0 reads its own token rows; it takes no forward hop")
        root = await commit_wire(msg.data, msg.scales) if msg.data is not None else ""
        claimed = msg.info.get("root")
        if claimed is not None and claimed != root:
            raise ProtocolError(Outcome.HASH_MISMATCH, "hop data does not match the root its sender committed")
        return self.plane.accept_hop(msg, t, root)

    # ---------------------------------------------------------------- outbound
    async def _send(self, hotkey: str, hop: Hop) -> HopAck:
        return await self.transport.send_hop(hotkey, hop)

    def _updates_for(self, validator: str) -> tuple[list[dict], int]:
        """Update commitments ``validator`` has not been sent yet (the last :data:`MAX_UPDATES_PER_BATCH`),
        and the count to record once they are delivered."""
        if self.updates is not None:
            self._commits.extend(c.to_dict() for c in self.updates.take_commitments())
            drop = max(0, len(self._commits) - MAX_UPDATES_PER_BATCH)
            if drop:
                del self._commits[:drop]
                self._commits_base += drop
        end = self._commits_base + len(self._commits)
        start = max(self._commits_sent.get(validator, 0), self._commits_base)
        return self._commits[start - self._commits_base:], end

    async def _post_receipts(self, validator: str, receipts: list[dict]) -> None:
        updates, upto = self._updates_for(validator)
        await self.transport.post_receipts(validator, ReceiptBatch(run_id=self.run_id, stage=self.stage,
                                                                   receipts=receipts, updates=updates))
        self._commits_sent[validator] = upto

    def status(self) -> dict:
        d = self.plane.status()
        d.update(self.transport.status())
        d["refusals_reported"] = dict(self.refusals.counts)
        return d
