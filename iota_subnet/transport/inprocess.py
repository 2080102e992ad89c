"""Neurons in one process without HTTP: a registry ``hotkey -> routes`` that delivers a request to the
same route handler a :class:`~iota_subnet.transport.server.NeuronServer` would call.

:class:`InProcessNetwork` is what both roles' in-process transports sit on (the miners' data plane,
:class:`~iota_subnet.miner.dataplane.transport.InProcessDataPlaneTransport`; the validator's control
plane, :class:`~iota_subnet.validator.control_transport.InProcessControlTransport`), so miners and
validators registered on one network reach each other's real routes. Every request and reply is
encoded and decoded with the wire codec (the request against its route's tensor contract and body
limit), so a request is refused in process exactly as over HTTP (same
:class:`~iota_subnet.protocol.Outcome`); a handler fault is ``INTERNAL`` as the HTTP server answers
it. There are no signatures: the caller's hotkey is the one it called as, and the routes' refusal
hooks (evidence of a signed body) are not called. ``kill(hotkey)`` makes a peer unreachable
(``TransportError``).
"""
from __future__ import annotations

import asyncio
import inspect
import time
from typing import Any, Iterable

from iota_subnet.protocol import Message, Outcome, ProtocolError, decode, encode

from .client import TransportError
from .server import RequestContext, Route


class InProcessNetwork:
    """Nodes in one process: ``register(hotkey, routes)``, then :meth:`call` between hotkeys.
    ``sent`` / ``received``: body bytes per hotkey (requests and replies)."""

    def __init__(self) -> None:
        self.routes: dict[str, dict[str, Route]] = {}
        self.dead: set[str] = set()
        self.sent: dict[str, int] = {}
        self.received: dict[str, int] = {}

    def register(self, hotkey: str, routes: Iterable[Route]) -> None:
        """``hotkey`` answers ``routes`` (added to those it already answers)."""
        table = self.routes.setdefault(hotkey, {})
        for r in routes:
            table[r.path] = r
        self.dead.discard(hotkey)

    def kill(self, hotkey: str) -> None:
        """``hotkey`` no longer answers (and cannot call): TransportError."""
        self.dead.add(hotkey)

    def _count(self, table: dict[str, int], hotkey: str, n: int) -> None:
        table[hotkey] = table.get(hotkey, 0) + n

    async def call(self, me: str, peer: str, path: str, msg: Message, response_type: type) -> Any:
        """``msg`` from ``me`` to ``peer``'s route ``path``; its decoded reply. Raises ProtocolError as
        the route refuses it (``UNKNOWN_ROUTE`` for a route ``peer`` does not serve), TransportError
        when either end is dead or ``peer`` never registered."""
        if me in self.dead:
            raise TransportError(peer[:10], f"the caller {me[:10]} is dead")
        table = self.routes.get(peer)
        if table is None or peer in self.dead:
            raise TransportError(peer[:10], "unreachable (not registered in process, or killed)")
        route = table.get(path)
        if route is None:
            raise ProtocolError(Outcome.UNKNOWN_ROUTE, f"no route POST {path}")
        body = encode(msg)
        self._count(self.sent, me, len(body))
        self._count(self.received, peer, len(body))
        kw = {} if route.max_body_bytes is None else {"max_body_bytes": route.max_body_bytes}
        req = decode(body, route.message_type, route.contract(), **kw)
        ctx = RequestContext(caller_hotkey=me, route=path, nonce_ns=time.time_ns(), remote=None, body_bytes=len(body),
                             received_at=time.time())
        try:
            reply = route.handler(req, ctx)
            if inspect.isawaitable(reply):
                reply = await reply
        except (ProtocolError, asyncio.CancelledError):
            raise
        except Exception as e:  # noqa: BLE001 - as the HTTP server answers a handler fault
            raise ProtocolError(Outcome.INTERNAL, f"{type(e).__name__} in handler") from e
        finally:
            for cb in ctx.on_sent:
                cb()
        if peer in self.dead:
            raise TransportError(peer[:10], "died while answering")
        rbody = encode(reply)
        self._count(self.sent, peer, len(rbody))
        self._count(self.received, me, len(rbody))
        return decode(rbody, response_type)


__all__ = ["InProcessNetwork"]
