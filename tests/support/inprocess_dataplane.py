"""Miners' data planes in one process, on the in-process data-plane transport
(:class:`~iota_subnet.miner.dataplane.transport.InProcessDataPlaneTransport`): a real
:class:`~iota_subnet.miner.dataplane_http.DataPlaneNode` whose hops and receipts go through the wire
codec and its peers' real route handlers (ticket check, hop contract, typed refusals), without HTTP,
plus the small peers a hop-level test needs around it (a next stage that records the hops it takes,
a validator that records receipts)."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, Awaitable, Callable, Mapping, Optional

from bittensor.sp_core import Keypair

from iota_subnet.miner.dataplane import DataPlaneTunables, RowSource
from iota_subnet.miner.dataplane.transport import InProcessDataPlaneTransport
from iota_subnet.miner.hop_store import HopStore
from iota_subnet.miner.dataplane_http import DataPlaneNode, NodeLinks, NodeParts
from iota_subnet.miner.tickets import TicketShape
from iota_subnet.config import bottleneck_dims
from iota_subnet.protocol import Hop, HopAck, ReceiptAck, ReceiptBatch, Ticket
from iota_subnet.transport.server import Route


def keypair(name: str) -> Keypair:
    """A hotkey derived from ``name`` (the same for the same name)."""
    return Keypair.create_from_uri(f"//{name}")


def neurons(validators, miners) -> dict[str, Any]:
    """A metagraph view ``hotkey -> neuron`` (``validator_permit``) of these hotkeys."""
    out = {hk: SimpleNamespace(validator_permit=True) for hk in validators}
    out.update({hk: SimpleNamespace(validator_permit=False) for hk in miners})
    return out


async def _nothing() -> None:
    return None


def inprocess_node(net: InProcessDataPlaneTransport, worker: Any, key: Keypair, cfg: Any, *, run_id: str,
                   stage: int, metagraph: Mapping[str, Any], rows: Optional[RowSource] = None,
                   take_lane: Optional[Callable[[Ticket], Awaitable[str]]] = None,
                   tunables: DataPlaneTunables = DataPlaneTunables(), hops: Optional[HopStore] = None) -> DataPlaneNode:
    """A DataPlaneNode of ``key`` for ``stage`` on ``net`` (its routes served there), reading ``rows``
    (head and tail), handing lanes over with ``take_lane`` (None: no handover), paced by ``tunables``,
    keeping its training hops in ``hops`` (the audit window; None: none). Not started."""
    b, _ = bottleneck_dims(cfg.model, cfg.pipeline)
    node = DataPlaneNode(worker, SimpleNamespace(hotkey=key),
                         shape=TicketShape.of_run(cfg, run_id=run_id, width=b, max_rows=cfg.train.micro_batch),
                         stage=stage, compute=lambda fn: asyncio.to_thread(fn),
                         links=NodeLinks(neurons=lambda: metagraph, endpoint_of=lambda hk: None, refresh=_nothing,
                                         take_lane=take_lane),
                         parts=NodeParts(rows=rows, hops=hops, transport=net.view(key.ss58_address)), tunables=tunables)
    node.mount()
    return node


class HopRecorder:
    """A next (or previous) stage as a node sees it: takes every hop (after the wire codec), answers
    none by itself; :meth:`send_back` sends a hop from it through ``net`` (the receiver's real checks)."""

    def __init__(self, net: InProcessDataPlaneTransport, hotkey: str, on_hop: Optional[Callable[[Hop], None]] = None):
        self.net, self.hotkey = net, hotkey
        self.forwards: list[Hop] = []
        self.hops: list[Hop] = []
        self.on_hop = on_hop
        net.register(hotkey, [Route("/hop", self._take, Hop, None)])

    async def _take(self, hop: Hop, ctx) -> HopAck:
        self.hops.append(hop)
        if hop.direction == "forward":
            self.forwards.append(hop)
        if self.on_hop is not None:
            self.on_hop(hop)
        return HopAck(run_id=hop.run_id, stage=hop.stage, microbatch_id=hop.microbatch_id, status="accepted")

    async def send_back(self, to: str, hop: Hop) -> HopAck:
        return await self.net.view(self.hotkey).send_hop(to, hop)


class ReceiptInbox:
    """A validator's ``/receipts`` route on ``net``: ``receipts`` collects every receipt (dicts)."""

    def __init__(self, net: InProcessDataPlaneTransport, hotkey: str):
        self.receipts: list[dict] = []
        net.register(hotkey, [Route("/receipts", self._take, ReceiptBatch, None)])

    async def _take(self, batch: ReceiptBatch, ctx) -> ReceiptAck:
        self.receipts.extend(batch.receipts)
        return ReceiptAck(accepted=len(batch.receipts))
