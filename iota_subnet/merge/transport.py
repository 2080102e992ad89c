"""Peer transports for :class:`~iota_subnet.merge.engine.MergeEngine`.

* :class:`InProcessTransport`: engines in one process (tests, ``scripts/bench_merge.py``). Every
  message is encoded and decoded with the wire codec (safetensors + JSON, the same validation as
  over HTTP), so the byte counts are the exact body sizes HTTP would carry (headers excluded).
  ``kill(hotkey)`` makes a peer unreachable; ``stall(hotkey)`` makes it accept calls and never
  answer (a SIGSTOPped process): callers give up after ``timeout_s``, as an HTTP client would
  (a stalled peer moves no byte); ``delay`` adds latency; ``shape(hotkey, uplink)`` sends a
  replica's requests and replies through its own emulated uplink
  (:class:`~iota_subnet.transport.shaping.UplinkShaper`). Bytes are reported as they cross a shaped
  link, piece by piece, to both ends' ``on_progress(peer, nbytes)`` (a view's attribute, set by the
  engine: :mod:`.deadlines`). Per replica (as caller and as callee), ``sent`` / ``received`` count
  whole bodies and ``sent_dense`` / ``received_dense`` the tensor bytes in them; the difference is
  the metadata (JSON header, safetensors framing); ``meta_by_type`` / ``count_by_type``: metadata
  bytes and bodies per message type, over every replica.
* :class:`HttpTransport`: signed HTTP through :class:`~iota_subnet.transport.NeuronClient`; peers
  resolved from hotkey to ``ip:port`` by ``resolve(hotkey)``.
"""
from __future__ import annotations

import asyncio
from typing import Any, Callable, Optional

from iota_subnet.protocol import Message, ProtocolError, decode, encode, merge_payload_contract, payload_nbytes

from .deadlines import FLOOR_RATE_BPS

MERGE_ROUTES = ("/merge/join", "/merge/contribute", "/merge/result", "/merge/contribution")


class PeerUnreachable(ConnectionError):
    """The peer is not there (killed, or never registered with the in-process transport)."""


class InProcessTransport:
    """A registry of handlers ``hotkey -> async handle(route, msg, caller) -> Message``; each engine
    gets a :meth:`view` bound to its own hotkey (the caller identity, as a signature would give)."""

    def __init__(self, delay_s: float = 0.0, timeout_s: float = 30.0):
        self.handlers: dict[str, Callable[..., Any]] = {}
        self.dead: set[str] = set()
        self.stalled: set[str] = set()
        self.timeout_s = float(timeout_s)
        self.delay_s = delay_s
        self.sent: dict[str, int] = {}
        self.received: dict[str, int] = {}
        self.sent_dense: dict[str, int] = {}     # tensor bytes of those bodies
        self.received_dense: dict[str, int] = {}
        self.max_body = 0                    # largest message body seen (bytes)
        self.meta_by_type: dict[str, int] = {}   # message type -> metadata bytes of its bodies, all replicas
        self.count_by_type: dict[str, int] = {}  # message type -> bodies
        self.uplinks: dict[str, Any] = {}    # hotkey -> UplinkShaper
        self.views: dict[str, "_View"] = {}

    def counts(self, hotkey: str) -> dict[str, int]:
        """Bytes ``hotkey`` sent and received (requests and replies): ``sent``/``received`` whole
        bodies, ``*_dense`` their tensor bytes, ``*_meta`` the rest (metadata)."""
        out = {"sent": self.sent.get(hotkey, 0), "received": self.received.get(hotkey, 0),
               "sent_dense": self.sent_dense.get(hotkey, 0), "received_dense": self.received_dense.get(hotkey, 0)}
        out["sent_meta"] = out["sent"] - out["sent_dense"]
        out["received_meta"] = out["received"] - out["received_dense"]
        return out

    def shape(self, hotkey: str, uplink: Any) -> None:
        """Send ``hotkey``'s requests and replies through ``uplink`` (an UplinkShaper; None: unshaped)."""
        if uplink is None:
            self.uplinks.pop(hotkey, None)
        else:
            self.uplinks[hotkey] = uplink

    def _progress(self, a: str, b: str, nbytes: int) -> None:
        for x, y in ((a, b), (b, a)):
            v = self.views.get(x)
            if v is not None and v.on_progress is not None:
                v.on_progress(y, nbytes)

    async def _cross(self, src: str, dst: str, nbytes: int) -> None:
        up = self.uplinks.get(src)
        if up is not None:
            await up.transmit(nbytes, lambda n: self._progress(src, dst, n))

    def register(self, hotkey: str, handler: Callable[..., Any]) -> None:
        self.handlers[hotkey] = handler
        self.dead.discard(hotkey)

    def kill(self, hotkey: str) -> None:
        self.dead.add(hotkey)

    def stall(self, hotkey: str, stalled: bool = True) -> None:
        """``hotkey`` stops answering (True) or answers again (False)."""
        (self.stalled.add if stalled else self.stalled.discard)(hotkey)

    def view(self, me: str) -> "_View":
        v = self.views.get(me)
        if v is None:
            v = self.views[me] = _View(self, me)
        return v

    async def _call(self, me: str, peer: str, route: str, msg: Message, rtype: type) -> tuple[Any, int, int]:
        if me in self.dead:
            raise PeerUnreachable(f"{me[:10]} is dead")
        h = self.handlers.get(peer)
        if h is None or peer in self.dead:
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            raise PeerUnreachable(f"{peer[:10]} unreachable")
        body = encode(msg)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if peer in self.stalled:
            t0 = asyncio.get_running_loop().time()
            while peer in self.stalled and asyncio.get_running_loop().time() - t0 < self.timeout_s:
                await asyncio.sleep(0.05)
            if peer in self.stalled:
                raise PeerUnreachable(f"{peer[:10]} did not answer in {self.timeout_s:.1f} s")
        await self._cross(me, peer, len(body))
        req = decode(body, type(msg), merge_payload_contract(max_numel=1 << 31) if route == "/merge/contribute" else None)
        reply = await h(route, req, me)
        if peer in self.dead:
            raise PeerUnreachable(f"{peer[:10]} died while answering")
        rbody = encode(reply)
        await self._cross(peer, me, len(rbody))
        if peer in self.dead:
            raise PeerUnreachable(f"{peer[:10]} died while answering")
        self.max_body = max(self.max_body, len(body), len(rbody))
        for k, n in ((me, len(body)), (peer, len(rbody))):
            self.sent[k] = self.sent.get(k, 0) + n
        for k, n in ((peer, len(body)), (me, len(rbody))):
            self.received[k] = self.received.get(k, 0) + n
        dq, dr = payload_nbytes(msg), payload_nbytes(reply)
        for m, size, dense in ((msg, len(body), dq), (reply, len(rbody), dr)):
            self.meta_by_type[m.TYPE] = self.meta_by_type.get(m.TYPE, 0) + size - dense
            self.count_by_type[m.TYPE] = self.count_by_type.get(m.TYPE, 0) + 1
        for k, n in ((me, dq), (peer, dr)):
            self.sent_dense[k] = self.sent_dense.get(k, 0) + n
        for k, n in ((peer, dq), (me, dr)):
            self.received_dense[k] = self.received_dense.get(k, 0) + n
        return decode(rbody, rtype), len(body), len(rbody)


class _View:
    def __init__(self, net: InProcessTransport, me: str):
        self.net, self.me = net, me
        self.on_progress: Optional[Callable[[str, int], None]] = None

    async def call(self, peer: str, route: str, msg: Message, response_type: type) -> tuple[Any, int, int]:
        return await self.net._call(self.me, peer, route, msg, response_type)


class HttpTransport:
    """Signed HTTP calls to peers. ``client``: a :class:`~iota_subnet.transport.NeuronClient`;
    ``resolve(hotkey) -> "ip:port" | None``. Refusals arrive as ProtocolError; an unknown or
    unreachable peer raises :class:`PeerUnreachable` / ``TransportError``.

    Bytes are reported as they move, piece by piece, to ``on_progress(peer, nbytes)`` (set by the
    engine: :mod:`.deadlines`), which cuts a call only when no byte of it moved for its progress
    timeout; the receiving end sees the same pieces arrive (``NeuronServer.add_route(...,
    on_body_bytes=...)``). So the HTTP timeout of a call is only a backstop against a link slower
    than :data:`~iota_subnet.merge.deadlines.FLOOR_RATE_BPS`: ``timeout_s`` plus its bytes (the request body, and ``reply_bytes``
    more for the routes whose reply carries a chunk: ``/merge/result``, ``/merge/contribution``) at
    that rate. Without ``on_progress`` the bytes are charged at ``bytes_per_s`` (the declared
    uplink, bytes/s; None: ``timeout_s`` only), twice."""

    def __init__(self, client: Any, resolve: Callable[[str], Optional[str]], timeout_s: float = 30.0, *,
                 bytes_per_s: Optional[float] = None, reply_bytes: int = 0):
        self.client, self.resolve, self.timeout_s = client, resolve, timeout_s
        self.bytes_per_s, self.reply_bytes = bytes_per_s, int(reply_bytes)
        self.on_progress: Optional[Callable[[str, int], None]] = None

    def call_timeout_s(self, route: str, body_bytes: int) -> float:
        n = body_bytes + (self.reply_bytes if route in ("/merge/result", "/merge/contribution") else 0)
        if self.on_progress is not None:
            return self.timeout_s + 8.0 * n / FLOOR_RATE_BPS
        if not self.bytes_per_s:
            return self.timeout_s
        return self.timeout_s + 2.0 * n / self.bytes_per_s

    async def call(self, peer: str, route: str, msg: Message, response_type: type) -> tuple[Any, int, int]:
        ep = self.resolve(peer)
        if not ep:
            raise PeerUnreachable(f"no endpoint for {peer[:10]}")
        body = encode(msg) if payload_nbytes(msg) < (256 << 10) else await asyncio.to_thread(encode, msg)
        cb = self.on_progress
        reply = await self.client.call_raw(ep, peer, route, body, response_type,
                                           timeout_s=self.call_timeout_s(route, len(body)), retries=1, backoff_s=0.1,
                                           on_progress=None if cb is None else (lambda n: cb(peer, n)))
        # received: tensor bytes of the reply (+ its small JSON header, not counted)
        return reply, len(body), payload_nbytes(reply)


__all__ = ["HttpTransport", "InProcessTransport", "MERGE_ROUTES", "PeerUnreachable", "ProtocolError"]
