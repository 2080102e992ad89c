"""Relays: a neuron that cannot be dialled (behind a home router's NAT) is reached through one that can.

A relay is end to end transparent. A caller sends its signed request (btauth/1, bound to the
receiver's hotkey) to the relay's address instead of the receiver's; the relay sees a receiver that
is not itself but a hotkey attached to it, and forwards the request whole (method, path, headers,
body) over the WebSocket the receiver keeps open to it. The receiver replays it against its own
:class:`~iota_subnet.transport.server.NeuronServer` on loopback, so every check runs as for a direct
request (receiver binding, signature over the body, nonce, route contract, body limit, authorizer),
and the signed response (bound to the caller's request nonce) goes back the same way. A relay
therefore can drop or delay traffic but cannot forge, alter or replay it unnoticed: an altered body
fails the receiver's signature check (``BAD_SIGNATURE``), a replayed request its nonce store
(``REPLAYED_NONCE``), a forged or altered response the caller's response check. A relay never holds
a key of the neurons it relays for.

Bodies stream (:mod:`iota_subnet.transport.relay_frames`): a request and its response each cross the
tunnel as a HEAD frame, DATA frames of at most ``frame_bytes`` and an END frame, with a per-transfer
window, so a body of any size up to the receiving route's own limit crosses with at most a window
of it held at either end, frames of concurrent transfers interleave (a large body does not hold up a
small one), and the receiver sees the bytes arrive as they cross. The relay sends the declared
``Content-Length`` ahead, so a body over the receiving route's limit is refused by the receiver's own
server at once (413 ``BODY_TOO_LARGE``, as for a direct request) and the rest of the upload is not
forwarded.

Progress credit (a merge reducer counts the bytes of a contribution still arriving as its sender's
progress, ``on_body_bytes``): the relay tells the tunnel the caller's address as it saw it, and the
tunnel passes it (with the relay's hotkey) to its own server with a per-process token
(:data:`~iota_subnet.transport.server.HEADER_RELAY_TOKEN`), so the server reports the relay's view
instead of 127.0.0.1. The relay is not trusted for it: a lying relay can claim that bytes come from
a peer's address and so keep a stalled peer looking alive until the reducer's backstop deadline; it
cannot make a forged body count as received (the signature over the whole body is checked as always)
nor blame anyone (only a verified body is evidence). It could as well drop the traffic.

Emulated links (:mod:`iota_subnet.transport.shaping`): on the relayed neuron the replay itself passes
its server's shaping, so the bytes relay -> home are charged to the home's downlink (each request,
once read) and home -> relay to its uplink (each response, in pieces), as for a direct request; the
tunnel adds no charge of its own (that would count them twice). On the relay, each frame is charged
to the relay server's downlink as it arrives (from the caller, from the home) and to its uplink as it
leaves (to the home, to the caller; :meth:`~iota_subnet.transport.shaping.UplinkShaper.release`, the
one-way delay overlapping between frames), the response's head as for any response.

:class:`RelayHost` (a part of a reachable neuron's server: :meth:`RelayHost.mount`)
    ``GET /relay/attach``: a WebSocket upgrade whose request is signed with btauth/1 (method GET,
    that path, empty body, receiver = the relay's hotkey), fresh and not replayed; ``authorize(hotkey)``
    decides who may attach (e.g. registered hotkeys). A second attach of the same hotkey replaces the
    first. Every request to an attached hotkey is forwarded; one to a hotkey that was attached but
    is not now has its connection dropped (the caller sees the receiver unreachable, not a refusal);
    any other goes the server's usual way (``WRONG_RECEIVER``). Bytes through the relay are capped
    per attached hotkey (``rate_bytes_per_s``, request and response bodies together, a token bucket
    with one second of burst, charged per frame). An answer whose HEAD is no HTTP response head
    (:func:`answer_head`) aborts that transfer (``bad_frames``, ``dropped_bad_head``; the caller's
    connection is dropped). :meth:`RelayHost.status`: who is relayed, requests, bytes, drops.

:class:`RelayTunnel` (a part of the neuron behind the NAT)
    keeps an outbound WebSocket to a relay (reattaching with backoff, 1-30 s), replays each
    forwarded request against ``local`` (its own server, ``127.0.0.1:port``) and sends back the answer.
"""
from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from typing import Any, AsyncIterable, AsyncIterator, Awaitable, Callable, Optional

import aiohttp
from aiohttp import web
from bittensor import http_auth
from loguru import logger

from .paths import tunnel_headers
from .relay_frames import ABORT, FRAME_BYTES, HEAD, MAX_MSG_BYTES, FrameLink, chunks_of, parse_head, unpack_frame
from .server import HEADER_RELAY_HOTKEY, HEADER_RELAY_REMOTE, HEADER_RELAY_TOKEN

ATTACH_PATH = "/relay/attach"
#: request headers a relay forwards (btauth/1 and the body's type); everything else stays behind
FORWARDED = tuple(h.lower() for h in (http_auth.HEADER_VERSION, http_auth.HEADER_HOTKEY, http_auth.HEADER_NONCE,
                                      http_auth.HEADER_SIGNATURE, http_auth.HEADER_RECEIVER, http_auth.HEADER_CRYPTO,
                                      "Content-Type"))


def _forwarded(headers: Any) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() in FORWARDED}


class BadAnswerHead(ValueError):
    """A relayed neuron answered a forwarded request with a HEAD that is no HTTP response head."""


def answer_head(payload: bytes) -> dict:
    """A relayed answer's HEAD (module :mod:`.relay_frames`: ``status`` an int in 100..599, ``headers``
    an object of strings without line breaks, ``length`` a non-negative int or null); raises
    :class:`BadAnswerHead` (a ``ValueError``) naming what is wrong."""
    try:
        head = parse_head(payload)
    except ValueError as e:                       # json.JSONDecodeError is a ValueError
        raise BadAnswerHead(f"answer head is not a JSON object: {e}") from None
    status, headers, length = head.get("status"), head.get("headers", {}), head.get("length")
    if type(status) is not int or not 100 <= status <= 599:
        raise BadAnswerHead(f"answer status {status!r} is not an HTTP status")
    if headers is None:
        headers = {}
    if not isinstance(headers, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and k and not any(c in k + v for c in "\r\n\0")
            for k, v in headers.items()):
        raise BadAnswerHead("answer headers are not an object of single-line strings")
    if length is not None and (type(length) is not int or length < 0):
        raise BadAnswerHead(f"answer length {length!r} is not a byte count")
    return {**head, "headers": headers}


class TokenBucket:
    """``rate`` bytes per second with ``burst`` bytes of credit; :meth:`take` waits until ``n`` bytes
    may pass (a request over the burst passes once the bucket is full, then runs it into debt)."""

    def __init__(self, rate: float, burst: Optional[float] = None, clock: Callable[[], float] = time.monotonic):
        self.rate = float(rate)
        self.burst = float(burst if burst is not None else rate)
        self.clock = clock
        self.level = self.burst
        self.at = clock()

    async def take(self, n: int) -> None:
        while True:
            now = self.clock()
            self.level = min(self.burst, self.level + (now - self.at) * self.rate)
            self.at = now
            if self.level >= min(n, self.burst):
                self.level -= n
                return
            await asyncio.sleep((min(n, self.burst) - self.level) / self.rate)


class Relayed:
    """A relayed answer: ``head`` (``status``, ``headers``, ``length``) and its body, read piece by
    piece by iterating (or whole: :meth:`read`); :meth:`aclose` ends the transfer (idempotent)."""

    def __init__(self, head: dict, body: AsyncIterable[bytes], close: Optional[Callable[[], Awaitable[None]]] = None):
        self.head = head
        self.body = body
        self._close = close

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self.body.__aiter__()

    async def read(self) -> bytes:
        try:
            return b"".join([c async for c in self.body])
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        close, self._close = self._close, None
        if close is not None:
            await close()


class _Attached:
    """One attached hotkey on a relay: its socket and frame link, answers awaited, its bucket, counters."""

    def __init__(self, hotkey: str, ws: web.WebSocketResponse, link: FrameLink, bucket: Optional[TokenBucket],
                 remote: str):
        self.hotkey, self.ws, self.link, self.bucket, self.remote = hotkey, ws, link, bucket, remote
        self.pending: dict[int, asyncio.Future] = {}          # transfer id -> its answer's head
        self.since = time.time()


class RelayHost:
    """The relay side (module docstring). ``keypair``: the relay neuron's hotkey (a ``Keypair`` or a
    wallet); ``authorize(hotkey)``: may this hotkey attach (raise or return False to refuse; None:
    anyone signed); ``rate_bytes_per_s``: the per-hotkey cap (None: none); ``max_body_bytes``: the
    relay's own cap on a relayed request body (None: only the receiving route's limit);
    ``forward_timeout_s``: how long a forwarded transfer may make no progress (no answer, no frame
    moving) before its connection is dropped; ``frame_bytes``: the DATA frames it sends."""

    def __init__(self, keypair: Any, *, authorize: Optional[Callable[[str], Any]] = None,
                 rate_bytes_per_s: Optional[float] = None, max_body_bytes: Optional[int] = None,
                 forward_timeout_s: float = 600.0, frame_bytes: int = FRAME_BYTES):
        self.hotkey: str = getattr(keypair, "hotkey", keypair).ss58_address
        self.authorize = authorize
        self.rate_bytes_per_s = rate_bytes_per_s
        self.max_body_bytes = None if max_body_bytes is None else int(max_body_bytes)
        self.forward_timeout_s = float(forward_timeout_s)
        self.frame_bytes = int(frame_bytes)
        self.attached: dict[str, _Attached] = {}
        self.known: set[str] = set()              # every hotkey ever attached here
        self.nonces = http_auth.InMemoryNonceStore(retention=60.0)
        self.counts: Counter[str] = Counter()
        self.bytes_by: Counter[str] = Counter()   # hotkey -> bytes relayed (both directions)
        self.requests_by: Counter[str] = Counter()
        self._ids = itertools.count(1)
        self.server: Any = None                   # the NeuronServer mounted on: its emulated links

    def mount(self, server: Any) -> None:
        """Serve ``GET /relay/attach`` and forward on ``server`` (a NeuronServer, before its start)."""
        self.server = server
        server.add_public_get(ATTACH_PATH, self.attach)
        server.set_forwarder(self.forward)
        server.app.on_shutdown.append(self.close)

    async def close(self, *_: Any) -> None:
        """Close every attached socket (the server shuts down): the relayed neurons reattach elsewhere."""
        for a in list(self.attached.values()):
            await a.ws.close(code=aiohttp.WSCloseCode.GOING_AWAY, message=b"relay shutting down")

    # ---------------------------------------------------------------- attach
    async def attach(self, request: web.Request) -> web.StreamResponse:
        """The WebSocket of a neuron that cannot be dialled; lives until it closes."""
        try:
            caller = http_auth.verify(request.headers, b"", method="GET", path=ATTACH_PATH,
                                      self_hotkey_ss58=self.hotkey, nonce_store=self.nonces)
        except http_auth.AuthError as e:
            self.counts["attach_refused"] += 1
            return web.json_response({"outcome": "BAD_SIGNATURE", "message": f"relay attach: {e}"}, status=401)
        hotkey = caller.hotkey_ss58
        if self.authorize is not None:
            try:
                ok = self.authorize(hotkey)
                if asyncio.iscoroutine(ok):
                    ok = await ok
            except Exception as e:  # noqa: BLE001 - the authorizer's refusal, whatever its type
                ok, why = False, str(e)
            else:
                why = "not allowed to attach"
            if ok is False:
                self.counts["attach_refused"] += 1
                return web.json_response({"outcome": "FORBIDDEN", "message": f"relay attach: {why}"}, status=403)
        ws = web.WebSocketResponse(max_msg_size=MAX_MSG_BYTES, heartbeat=20.0)
        await ws.prepare(request)
        bucket = TokenBucket(self.rate_bytes_per_s) if self.rate_bytes_per_s else None
        old = self.attached.get(hotkey)
        me = _Attached(hotkey, ws, FrameLink(ws, self.frame_bytes, self.forward_timeout_s), bucket,
                       str(request.remote))
        self.attached[hotkey] = me
        self.known.add(hotkey)
        if old is not None:
            await old.ws.close()
        self.counts["attached"] += 1
        logger.info("relay: {} attached from {}", hotkey[:10], request.remote)
        try:
            async for msg in ws:
                if msg.type == aiohttp.WSMsgType.BINARY:
                    await self._on_frame(me, msg.data)
        finally:
            if self.attached.get(hotkey) is me:
                del self.attached[hotkey]
            gone = ConnectionResetError("the relayed neuron detached")
            me.link.fail_all(gone)
            for fut in me.pending.values():
                if not fut.done():
                    fut.set_exception(gone)
            logger.info("relay: {} detached", hotkey[:10])
        return ws

    async def _on_frame(self, me: _Attached, data: bytes) -> None:
        try:
            kind, rid, payload = unpack_frame(data)
            if kind == HEAD:
                fut = me.pending.get(rid)
                if fut is not None and not fut.done():
                    try:
                        fut.set_result(answer_head(payload))
                    except BadAnswerHead as e:    # its transfer fails: send() aborts it, forward() drops
                        fut.set_exception(e)
                        raise
                return
        except ValueError as e:
            self.counts["bad_frames"] += 1
            logger.debug("relay: bad frame from {}: {}", me.hotkey[:10], e)
            return
        why = me.link.dispatch(kind, rid, payload)
        if why is not None:
            self.counts["bad_frames"] += 1
            await me.link.abort(rid, why)

    # ---------------------------------------------------------------- forward
    async def _charge(self, peer: _Attached, n: int) -> None:
        """One frame of ``n`` bytes through the relay: the peer's bucket, then the relay's emulated
        downlink (it arrived) and uplink (it leaves)."""
        if peer.bucket is not None:
            await peer.bucket.take(n)
        down, up = getattr(self.server, "downlink", None), getattr(self.server, "shaper", None)
        if down is not None:
            await down.receive(n)
        if up is not None:
            await up.release(n)

    async def forward(self, request: web.Request) -> Optional[web.StreamResponse]:
        """Forward ``request`` when its btauth receiver is attached here; None when it is not for a
        relayed hotkey (the server serves it itself)."""
        receiver = request.headers.get(http_auth.HEADER_RECEIVER)
        if not receiver or receiver == self.hotkey or receiver not in self.known:
            return None
        peer = self.attached.get(receiver)
        if peer is None:
            return self._drop(request, "unattached")
        declared = request.content_length
        if self.max_body_bytes is not None and declared is not None and declared > self.max_body_bytes:
            return self._drop(request, "too_large")
        head = {"method": request.method, "path": request.raw_path, "headers": _forwarded(request.headers),
                "length": declared, "remote": str(request.remote or "")}
        moved = [0]

        async def charged(n: int) -> None:
            await self._charge(peer, n)
            self.bytes_by[receiver] += n
            moved[0] += n
        body = self._capped(request.content.iter_chunked(self.frame_bytes))
        answer: Optional[Relayed] = None
        out: Optional[web.StreamResponse] = None
        try:
            answer = await self._progressing(asyncio.ensure_future(self.send(peer, head, body, charged)), moved)
            h = answer.head
            out = web.StreamResponse(status=h["status"], headers={
                k: v for k, v in h["headers"].items() if k.lower() != "content-length"})
            if isinstance(h.get("length"), int):
                out.content_length = h["length"]
            await out.prepare(request)
            self.requests_by[receiver] += 1           # answered (its body follows)
            self.counts["forwarded"] += 1
            async for chunk in answer:
                await charged(len(chunk))
                await out.write(chunk)
            await out.write_eof()
        except BadAnswerHead as e:                   # counted in bad_frames as it came in
            logger.info("relay: {} answered with a malformed head ({}); transfer aborted", receiver[:10], e)
            return self._drop(request, "bad_head")
        except (ConnectionError, RuntimeError, OSError, asyncio.TimeoutError, aiohttp.ClientError, ValueError):
            if out is None:
                return self._drop(request, "lost")
            self.counts["dropped_lost"] += 1         # the answer broke off midway: the caller sees it cut
            if request.transport is not None:
                request.transport.abort()
            return out
        finally:
            if answer is not None:
                await answer.aclose()
        return out

    async def _progressing(self, sending: asyncio.Future, moved: list[int]) -> Relayed:
        """``sending``'s result, waited for as long as its bytes move: cancelled and
        ``asyncio.TimeoutError`` after ``forward_timeout_s`` without a byte moved."""
        seen = 0
        try:
            while True:
                done, _ = await asyncio.wait({sending}, timeout=self.forward_timeout_s)
                if done:
                    return sending.result()
                if moved[0] == seen:
                    raise asyncio.TimeoutError(f"no progress in {self.forward_timeout_s:g} s")
                seen = moved[0]
        finally:
            if not sending.done():
                sending.cancel()

    async def _capped(self, chunks: AsyncIterable[bytes]) -> AsyncIterator[bytes]:
        size = 0
        async for c in chunks:
            size += len(c)
            if self.max_body_bytes is not None and size > self.max_body_bytes:
                raise ConnectionResetError(f"relayed body over the relay's cap of {self.max_body_bytes} bytes")
            yield c

    async def send(self, peer: _Attached, header: dict, body: AsyncIterable[bytes],
                   on_frame: Optional[Callable[[int], Awaitable[None]]] = None) -> Relayed:
        """Open a transfer on ``peer``'s socket: the request's HEAD (``header``: method, path, headers,
        length, remote), its ``body`` in DATA frames (sent alongside, each after ``on_frame(n)``), END.
        Returns the answer once its head is in; its body streams (an answer that comes first, such as
        a 413, ends the upload). Raises ``ConnectionError`` when the peer detaches or aborts,
        ``asyncio.TimeoutError`` after ``forward_timeout_s`` with neither an answer nor a frame sent."""
        rid = next(self._ids)
        link = peer.link
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        peer.pending[rid] = fut
        inbound = link.open_in(rid)
        link.open_out(rid)
        uploaded = asyncio.Event()
        frames = [0]

        async def counted(n: int) -> None:
            if on_frame is not None:
                await on_frame(n)
            frames[0] += 1

        async def upload() -> None:
            await link.send_head(rid, header)
            await link.send_body(rid, body, counted)
            uploaded.set()
        task = asyncio.ensure_future(upload())

        async def close() -> None:
            task.cancel()
            peer.pending.pop(rid, None)
            if not (uploaded.is_set() and inbound.done):
                await link.abort(rid, "the relay ended the transfer")
            link.close_transfer(rid)
        try:
            sent = -1
            while not fut.done():
                if task.done():
                    if not task.cancelled() and task.exception() is not None:
                        raise task.exception()
                    await asyncio.wait_for(asyncio.shield(fut), self.forward_timeout_s)   # uploaded: the answer
                    break
                if frames[0] == sent:
                    raise asyncio.TimeoutError(f"no answer nor progress in {self.forward_timeout_s:g} s")
                sent = frames[0]
                await asyncio.wait({fut, task}, timeout=self.forward_timeout_s, return_when=asyncio.FIRST_COMPLETED)
            return Relayed(fut.result(), inbound.chunks(), close)
        except BaseException:
            await close()
            raise

    def _drop(self, request: web.Request, why: str) -> web.Response:
        """The caller sees the relayed neuron unreachable (its connection dropped), never a refusal."""
        self.counts[f"dropped_{why}"] += 1
        if request.transport is not None:
            request.transport.abort()
        return web.Response(status=502)

    def status(self) -> dict:
        """Who is relayed here and what it cost (JSON-ready)."""
        return {"hotkey": self.hotkey, "rate_bytes_per_s": self.rate_bytes_per_s,
                "attached": {hk: {"since": a.since, "from": a.remote, "requests": self.requests_by[hk],
                                  "bytes": self.bytes_by[hk], "in_flight": len(a.pending),
                                  "frames": a.link.frames_sent + a.link.frames_received}
                             for hk, a in self.attached.items()},
                # every hotkey relayed here since start, attached now or not
                "relayed": {hk: {"requests": self.requests_by[hk], "bytes": self.bytes_by[hk]} for hk in sorted(self.known)},
                "counts": dict(self.counts)}


class RelayTunnel:
    """The side of a neuron that cannot be dialled (module docstring). ``keypair``: its hotkey;
    ``relays``: ``[(endpoint "ip:port", relay hotkey)]`` tried in turn; ``local``: its own server's
    ``ip:port`` (loopback); ``local_token``: that server's
    :attr:`~iota_subnet.transport.server.NeuronServer.relay_token` (None: the server sees relayed
    requests come from 127.0.0.1, not from the address the relay saw); ``frame_bytes``: the DATA frames
    it sends. :meth:`run` keeps one attached until ``stop`` is set.

    A relay is untrusted, so what one can hold here is bounded: a forwarded transfer that moves no frame
    (a head without its body, a window never reopened) for ``idle_s`` seconds is aborted, and at most
    ``max_transfers`` run at once (a head beyond them is aborted at once): at most ``max_transfers``
    bodies of one window each (4 MiB, :mod:`.relay_frames`) are buffered."""

    def __init__(self, keypair: Any, relays: list[tuple[str, str]], local: str, *,
                 local_token: Optional[str] = None, frame_bytes: int = FRAME_BYTES,
                 backoff_s: tuple[float, float] = (1.0, 30.0), idle_s: float = 600.0, max_transfers: int = 256):
        if not relays:
            raise ValueError("a relay tunnel needs at least one relay (endpoint, hotkey)")
        self.signer = getattr(keypair, "hotkey", keypair)
        self.relays = list(relays)
        self.local = local
        self.local_token = local_token
        self.frame_bytes = int(frame_bytes)
        self.backoff_s = backoff_s
        self.idle_s, self.max_transfers = float(idle_s), int(max_transfers)
        self.current: Optional[str] = None        # the relay endpoint attached now
        self.attached = asyncio.Event()
        self.counts: Counter[str] = Counter()
        self.last_error = ""

    async def run(self, stop: asyncio.Event) -> None:
        """Attach, serve, reattach: the next relay in turn after ``backoff_s[0]``; once a whole round
        of relays failed, the wait doubles per failure up to ``backoff_s[1]``."""
        i, failures = 0, 0
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
            while not stop.is_set():
                endpoint, hotkey = self.relays[i % len(self.relays)]
                attached_before = self.counts["attached"]
                try:
                    await self._serve(session, endpoint, hotkey, stop)
                except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
                    self.last_error = f"{endpoint}: {type(e).__name__}: {e}"
                    self.counts["attach_failures"] += 1
                    logger.warning("relay tunnel: {} ({}); trying the next relay", self.last_error, hotkey[:10])
                finally:
                    self.current = None
                    self.attached.clear()
                failures = 0 if self.counts["attached"] > attached_before else failures + 1
                i += 1
                base, cap = self.backoff_s
                over = failures - len(self.relays)
                delay = base if over < 0 else min(cap, base * 2 ** (over + 1))
                try:
                    await asyncio.wait_for(stop.wait(), timeout=delay)
                except asyncio.TimeoutError:
                    pass

    async def _serve(self, session: aiohttp.ClientSession, endpoint: str, relay_hotkey: str,
                     stop: asyncio.Event) -> None:
        headers = http_auth.sign(self.signer, method="GET", path=ATTACH_PATH, body=b"", receiver_ss58=relay_hotkey)
        async with session.ws_connect(f"http://{endpoint}{ATTACH_PATH}", headers=headers, heartbeat=20.0,
                                      max_msg_size=MAX_MSG_BYTES) as ws:
            self.current = endpoint
            self.attached.set()
            self.counts["attached"] += 1
            logger.info("relay tunnel: attached to {} ({})", endpoint, relay_hotkey[:10])
            link = FrameLink(ws, self.frame_bytes, self.idle_s)
            tasks: dict[int, asyncio.Task] = {}
            stopper = asyncio.ensure_future(stop.wait())
            try:
                while True:
                    recv = asyncio.ensure_future(ws.receive())
                    done, _ = await asyncio.wait({recv, stopper}, return_when=asyncio.FIRST_COMPLETED)
                    if stopper in done:
                        recv.cancel()
                        return
                    msg = recv.result()
                    if msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.ERROR):
                        raise ConnectionResetError(f"the relay closed the tunnel ({msg.type.name})")
                    if msg.type == aiohttp.WSMsgType.BINARY:
                        await self._on_frame(session, link, relay_hotkey, tasks, msg.data)
            finally:
                stopper.cancel()
                link.fail_all(ConnectionResetError("the tunnel closed"))
                for t in tasks.values():
                    t.cancel()

    async def _on_frame(self, session: aiohttp.ClientSession, link: FrameLink, relay_hotkey: str,
                        tasks: dict[int, asyncio.Task], data: bytes) -> None:
        try:
            kind, rid, payload = unpack_frame(data)
            if kind == HEAD:
                header = parse_head(payload)
                if rid in link.inbound:
                    raise ValueError(f"a second head for transfer {rid}")
                if len(tasks) >= self.max_transfers:
                    self.counts["bad_frames"] += 1
                    await link.abort(rid, f"{len(tasks)} transfers already in flight (at most {self.max_transfers})")
                    return
                body = link.open_in(rid)
                link.open_out(rid)
                t = tasks[rid] = asyncio.create_task(self._answer(session, link, rid, header, body, relay_hotkey))
                t.add_done_callback(lambda _t, r=rid: (tasks.pop(r, None), link.close_transfer(r)))
                return
        except ValueError as e:
            self.counts["bad_frames"] += 1
            logger.debug("relay tunnel: bad frame: {}", e)
            return
        why = link.dispatch(kind, rid, payload)
        if why is not None:
            self.counts["bad_frames"] += 1
            await link.abort(rid, why)
        if kind == ABORT and rid in tasks:
            tasks[rid].cancel()

    async def _answer(self, session: aiohttp.ClientSession, link: FrameLink, rid: int, header: dict,
                      body: Any, relay_hotkey: str) -> None:
        """Replay one forwarded request against the local server as its body arrives, and stream the
        answer back."""
        raw = header.get("headers")
        headers = _forwarded(raw if isinstance(raw, dict) else {})
        length = header.get("length")
        if isinstance(length, int) and length >= 0:
            headers["Content-Length"] = str(length)
        if self.local_token:
            headers.update({HEADER_RELAY_TOKEN: self.local_token, HEADER_RELAY_REMOTE: str(header.get("remote", "")),
                            HEADER_RELAY_HOTKEY: relay_hotkey})
        headers.update(tunnel_headers(self.current))
        data: Any = body.chunks() if length != 0 else b""
        path = header.get("path", "/")
        try:
            if not isinstance(path, str) or not path.startswith("/"):     # "@host/x" would reach another host
                raise ValueError(f"the relay forwarded a path that is not absolute: {path!r}")
            if length == 0:
                async for _ in body.chunks():     # the END of an empty body
                    pass
            async with session.request(str(header.get("method", "POST")), f"http://{self.local}{path}",
                                       data=data, headers=headers) as resp:
                await link.send_head(rid, {"status": resp.status, "length": resp.content_length,
                                           "headers": {k: v for k, v in resp.headers.items()
                                                       if k.lower() in FORWARDED or k.lower().startswith("x-")}})
                await link.send_body(rid, resp.content.iter_chunked(self.frame_bytes))
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError) as e:
            self.counts["local_failures"] += 1
            logger.warning("relay tunnel: the local server did not answer {!r}: {}", path, e)
            await link.abort(rid, "the relayed neuron's server did not answer")
            return
        self.counts["answered"] += 1

    def status(self) -> dict:
        return {"relay": self.current, "relays": [e for e, _ in self.relays], "counts": dict(self.counts),
                "last_error": self.last_error}
