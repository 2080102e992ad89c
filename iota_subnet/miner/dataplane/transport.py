"""What a miner's data plane needs from the network, and its two implementations.

:class:`DataPlaneTransport` (the interface, one per miner: ``me`` is its hotkey)
    outbound ``send_hop(hotkey, Hop) -> HopAck`` to another miner, ``post_receipts(validator,
    ReceiptBatch) -> ReceiptAck`` and ``post_refusal(validator, RefusalReport) -> RefusalAck`` to a
    validator; inbound ``serve(routes, server)``: the node's routes (``/tickets``, ``/hop``, as
    :class:`~iota_subnet.transport.server.Route`) are delivered the requests addressed to ``me``.
    A refused request raises :class:`~iota_subnet.protocol.ProtocolError` (its ``outcome``), an
    unreachable peer ``TransportError``.

:class:`HttpDataPlaneTransport`
    signed HTTP (btauth/1) through two :class:`~iota_subnet.transport.NeuronClient` (hops to miners,
    receipts and refusal reports to validators); peers resolved from hotkey to ``ip:port`` by
    ``endpoint_of`` (the metagraph, re-read once through ``refresh`` for a hotkey without an
    endpoint); routes mounted on the miner's :class:`~iota_subnet.transport.NeuronServer`.

:class:`InProcessDataPlaneTransport`
    a registry ``hotkey -> routes`` for nodes in one process (tests; an
    :class:`~iota_subnet.transport.inprocess.InProcessNetwork`, shared with validators' in-process
    control transports); :meth:`~InProcessDataPlaneTransport.view`
    gives the transport of one hotkey (the caller identity a signature would give). Every request
    and reply is encoded and decoded with the wire codec, the request against its route's tensor
    contract, and handled by the same route handler as over HTTP, so a request is refused in
    process exactly as over HTTP (same :class:`~iota_subnet.protocol.Outcome`); a handler fault is
    ``INTERNAL`` as the HTTP server answers it. There are no signatures: the routes' refusal hooks
    (evidence of a signed body) are not called. ``kill(hotkey)`` makes a peer unreachable.
"""
from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable, Iterable, Optional, Protocol, Sequence

from iota_subnet.protocol import Hop, HopAck, Message, ReceiptAck, ReceiptBatch
from iota_subnet.protocol.refusal import RefusalAck, RefusalReport
from iota_subnet.transport import NeuronClient, TransportError
from iota_subnet.transport.inprocess import InProcessNetwork
from iota_subnet.transport.server import Route

#: Receipt batches and refusal reports: how long a validator may take to answer (s).
RECEIPT_TIMEOUT_S = 15.0
REFUSAL_TIMEOUT_S = 30.0


class DataPlaneTransport(Protocol):
    me: str

    async def send_hop(self, hotkey: str, hop: Hop) -> HopAck: ...

    async def post_receipts(self, validator: str, batch: ReceiptBatch) -> ReceiptAck: ...

    async def post_refusal(self, validator: str, report: RefusalReport) -> RefusalAck: ...

    def serve(self, routes: Iterable[Route], server: Any = None) -> None: ...

    def status(self) -> dict: ...

    async def close(self) -> None: ...


class HttpDataPlaneTransport:
    """``wallet``: signs every request; ``endpoint_of(hotkey)``: ``"ip:port"`` or None;
    ``refresh()``: re-read the metagraph now; ``hop_timeout_s``: one hop's HTTP timeout (s);
    ``alternates(hotkey)``: the relays of a peer that cannot be dialled (None: none)."""

    def __init__(self, wallet: Any, endpoint_of: Callable[[str], Optional[str]],
                 refresh: Callable[[], Awaitable[None]], hop_timeout_s: float = 30.0, *,
                 alternates: Optional[Callable[[str], Sequence[str]]] = None):
        self.me: str = wallet.hotkey.ss58_address
        self.endpoint_of, self.refresh, self.hop_timeout_s = endpoint_of, refresh, hop_timeout_s
        #: hops to other miners (data plane bytes) and receipts to validators (control plane bytes)
        self.hop_client = NeuronClient(wallet, alternates=alternates)
        self.receipt_client = NeuronClient(wallet, alternates=alternates)

    async def endpoint(self, hotkey: str) -> str:
        """``hotkey``'s ``ip:port``; raises TransportError when it serves none on the metagraph."""
        ep = self.endpoint_of(hotkey)
        for wait in (0.0, 1.1):            # a peer that served its axon a moment ago: re-read the metagraph
            if ep is not None:
                break
            await asyncio.sleep(wait)
            await self.refresh()
            ep = self.endpoint_of(hotkey)
        if ep is None:
            raise TransportError(hotkey[:10], "no served endpoint on the metagraph")
        return ep

    async def send_hop(self, hotkey: str, hop: Hop) -> HopAck:
        return await self.hop_client.call(await self.endpoint(hotkey), hotkey, "/hop", hop, HopAck,
                                          timeout_s=self.hop_timeout_s, retries=2, backoff_s=0.2)

    async def post_receipts(self, validator: str, batch: ReceiptBatch) -> ReceiptAck:
        return await self.receipt_client.call(await self.endpoint(validator), validator, "/receipts", batch, ReceiptAck,
                                              timeout_s=RECEIPT_TIMEOUT_S, retries=1)

    async def post_refusal(self, validator: str, report: RefusalReport) -> RefusalAck:
        return await self.receipt_client.call(await self.endpoint(validator), validator, "/refusals", report,
                                              RefusalAck, timeout_s=REFUSAL_TIMEOUT_S, retries=1)

    def serve(self, routes: Iterable[Route], server: Any = None) -> None:
        """Mount ``routes`` on ``server`` (a :class:`~iota_subnet.transport.NeuronServer`)."""
        for r in routes:
            server.add_route(r.path, r.handler, r.message_type, r.contract_fn, max_body_bytes=r.max_body_bytes,
                             on_refused=r.on_refused)

    def status(self) -> dict:
        return {"hop_client": self.hop_client.stats(), "receipt_client": self.receipt_client.stats()}

    async def close(self) -> None:
        await self.hop_client.close()
        await self.receipt_client.close()


class InProcessDataPlaneTransport(InProcessNetwork):
    """Nodes in one process (an :class:`~iota_subnet.transport.inprocess.InProcessNetwork`):
    ``register(hotkey, routes)`` (or a view's :meth:`_View.serve`), then calls between the views.
    ``sent`` / ``received``: body bytes per hotkey (requests and replies). A validator's in-process
    control transport on the same network reaches the miners' ``/tickets`` and answers their receipts."""

    def __init__(self) -> None:
        super().__init__()
        self.views: dict[str, "_View"] = {}

    def view(self, me: str) -> "_View":
        """The transport of the node ``me``."""
        v = self.views.get(me)
        if v is None:
            v = self.views[me] = _View(self, me)
        return v


class _View:
    """One node's :class:`DataPlaneTransport` on an :class:`InProcessDataPlaneTransport`."""

    def __init__(self, net: InProcessDataPlaneTransport, me: str):
        self.net, self.me = net, me

    async def call(self, peer: str, path: str, msg: Message, response_type: type) -> Any:
        """Any route of ``peer`` (a validator's ``/tickets`` to a head, a test's own request)."""
        return await self.net.call(self.me, peer, path, msg, response_type)

    async def send_hop(self, hotkey: str, hop: Hop) -> HopAck:
        return await self.call(hotkey, "/hop", hop, HopAck)

    async def post_receipts(self, validator: str, batch: ReceiptBatch) -> ReceiptAck:
        return await self.call(validator, "/receipts", batch, ReceiptAck)

    async def post_refusal(self, validator: str, report: RefusalReport) -> RefusalAck:
        return await self.call(validator, "/refusals", report, RefusalAck)

    def serve(self, routes: Iterable[Route], server: Any = None) -> None:
        """Answer ``routes`` as ``me`` (``server`` is not used)."""
        self.net.register(self.me, routes)

    def status(self) -> dict:
        return {"in_process": {"sent": self.net.sent.get(self.me, 0), "received": self.net.received.get(self.me, 0)}}

    async def close(self) -> None:
        return None


__all__ = ["DataPlaneTransport", "HttpDataPlaneTransport", "InProcessDataPlaneTransport"]
