"""What the validator's control plane (:mod:`.control`) needs from the network, and its two
implementations. The algorithms (routes, flights, receipts, blame) never see which one they run on.

:class:`ControlTransport` (the interface; ``me`` is the validator's hotkey)
    outbound ``send_tickets(hotkey, TicketBatch) -> TicketAck`` to a lane's head miner and
    ``health(hotkey, Health, timeout_s) -> Health`` of a miner; inbound ``serve(routes, server)``:
    the control plane's routes (``/receipts``, ``/refusals``, :func:`.control_routes.control_routes`,
    as :class:`~iota_subnet.transport.server.Route`) are delivered the requests addressed to ``me``.
    A refused request raises :class:`~iota_subnet.protocol.ProtocolError` (its ``outcome``), an
    unreachable miner ``TransportError``.

:class:`HttpControlTransport`
    signed HTTP (btauth/1) through a :class:`~iota_subnet.transport.NeuronClient`; a miner's
    ``ip:port`` is its replica's endpoint in the router (:class:`~.routing.Router`, from the
    metagraph); routes mounted on the validator's :class:`~iota_subnet.transport.NeuronServer`.

:class:`InProcessControlTransport`
    the validator ``me`` on an :class:`~iota_subnet.transport.inprocess.InProcessNetwork` (tests): the
    same registry the miners' :class:`~iota_subnet.miner.dataplane.transport.InProcessDataPlaneTransport`
    is, so tickets reach the heads' real ``/tickets`` route and the miners' receipts and refusal
    reports reach this validator's real route handlers, through the wire codec, without HTTP.
"""
from __future__ import annotations

from typing import Any, Iterable, Protocol

from iota_subnet.protocol import Health, TicketAck, TicketBatch
from iota_subnet.transport import TransportError
from iota_subnet.transport.inprocess import InProcessNetwork
from iota_subnet.transport.server import Route

from .routing import Router

#: One ``/tickets`` request: timeout (s) and retries (HTTP).
TICKETS_TIMEOUT_S = 30.0
TICKETS_RETRIES = 2


class ControlTransport(Protocol):
    me: str

    async def send_tickets(self, hotkey: str, batch: TicketBatch) -> TicketAck: ...

    async def health(self, hotkey: str, msg: Health, timeout_s: float) -> Health: ...

    def serve(self, routes: Iterable[Route], server: Any = None) -> None: ...


class HttpControlTransport:
    """``client``: a :class:`~iota_subnet.transport.NeuronClient` (signs as the validator; or any
    object with its ``call``); ``router``: where a miner's endpoint is looked up (its live replicas);
    ``me``: the validator's hotkey."""

    def __init__(self, client: Any, router: Router, me: str):
        self.client, self.router, self.me = client, router, me

    def endpoint(self, hotkey: str) -> str:
        """``hotkey``'s ``ip:port`` (its replica in the router); TransportError when it has none."""
        for r in self.router.live_replicas():
            if r.hotkey == hotkey:
                return r.endpoint
        raise TransportError(hotkey[:10], "not a replica in the router")

    async def send_tickets(self, hotkey: str, batch: TicketBatch) -> TicketAck:
        return await self.client.call(self.endpoint(hotkey), hotkey, "/tickets", batch, TicketAck,
                                      timeout_s=TICKETS_TIMEOUT_S, retries=TICKETS_RETRIES)

    async def health(self, hotkey: str, msg: Health, timeout_s: float) -> Health:
        return await self.client.call(self.endpoint(hotkey), hotkey, "/health", msg, Health, timeout_s=timeout_s,
                                      retries=0)

    def serve(self, routes: Iterable[Route], server: Any = None) -> None:
        """Mount ``routes`` on ``server`` (a :class:`~iota_subnet.transport.NeuronServer`)."""
        for r in routes:
            server.add_route(r.path, r.handler, r.message_type, r.contract_fn, max_body_bytes=r.max_body_bytes,
                             on_refused=r.on_refused)


class InProcessControlTransport:
    """The validator ``me`` on ``net`` (no timeouts: an in-process call either answers or raises)."""

    def __init__(self, net: InProcessNetwork, me: str):
        self.net, self.me = net, me

    async def send_tickets(self, hotkey: str, batch: TicketBatch) -> TicketAck:
        return await self.net.call(self.me, hotkey, "/tickets", batch, TicketAck)

    async def health(self, hotkey: str, msg: Health, timeout_s: float) -> Health:
        return await self.net.call(self.me, hotkey, "/health", msg, Health)

    def serve(self, routes: Iterable[Route], server: Any = None) -> None:
        """Answer ``routes`` as ``me`` (``server`` is not used)."""
        self.net.register(self.me, routes)


__all__ = ["ControlTransport", "HttpControlTransport", "InProcessControlTransport"]
