"""Relays: a neuron that cannot be dialled (behind a home router's NAT) is reached through one that can.

A relay is end to end transparent. A caller sends its signed request (btauth/1, bound to the
receiver's hotkey) to the relay's address instead of the receiver's; the relay sees a receiver that
is not itself but a hotkey attached to it, and forwards the request whole (method, path, headers,
body) over the WebSocket the receiver keeps open to it. The receiver replays it against its own
:class:`~iota_subnet.transport.server.NeuronServer` on loopback, so every check runs as for a direct
request (receiver binding, signature over the body, nonce, route contract, authorizer), and the
signed response (bound to the caller's request nonce) goes back the same way. A relay therefore can
drop or delay traffic but cannot forge, alter or replay it unnoticed: an altered body fails the
receiver's signature check (``BAD_SIGNATURE``), a replayed request its nonce store
(``REPLAYED_NONCE``), a forged or altered response the caller's response check. A relay never holds
a key of the neurons it relays for.

:class:`RelayHost` (a part of a reachable neuron's server: :meth:`RelayHost.mount`)
    ``GET /relay/attach``: a WebSocket upgrade whose request is signed with btauth/1 (method GET,
    that path, empty body, receiver = the relay's hotkey), fresh and not replayed; ``authorize(hotkey)``
    decides who may attach (e.g. registered hotkeys). A second attach of the same hotkey replaces the
    first. Every request to an attached hotkey is forwarded; one to a hotkey that was attached but
    is not now has its connection dropped (the caller sees the receiver unreachable, not a refusal);
    any other goes the server's usual way (``WRONG_RECEIVER``). Bytes through the relay are capped
    per attached hotkey (``rate_bytes_per_s``, request and response bodies together, a token bucket
    with one second of burst). :meth:`RelayHost.status`: who is relayed, requests, bytes, drops.

:class:`RelayTunnel` (a part of the neuron behind the NAT)
    keeps an outbound WebSocket to a relay (reattaching with backoff, 1-30 s), replays each
    forwarded request against ``local`` (its own server, ``127.0.0.1:port``) and sends back the answer.

Frames (binary WebSocket messages): a 4-byte big-endian header length, a JSON header, the body.
Request header ``{"id", "method", "path", "headers"}``; response ``{"id", "status", "headers"}``.
A request and its response each travel as one message (up to ``max_body_bytes``): a relayed transfer
is not streamed piece by piece, so a merge payload larger than that cannot be relayed.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import struct
import time
from collections import Counter
from typing import Any, Callable, Optional

import aiohttp
from aiohttp import web
from bittensor import http_auth
from loguru import logger

from .paths import tunnel_headers

ATTACH_PATH = "/relay/attach"
#: request headers a relay forwards (btauth/1 and the body's type); everything else stays behind
FORWARDED = tuple(h.lower() for h in (http_auth.HEADER_VERSION, http_auth.HEADER_HOTKEY, http_auth.HEADER_NONCE,
                                      http_auth.HEADER_SIGNATURE, http_auth.HEADER_RECEIVER, http_auth.HEADER_CRYPTO,
                                      "Content-Type"))


def pack_frame(header: dict, body: bytes = b"") -> bytes:
    """One frame: 4-byte big-endian header length, the JSON header, the body."""
    h = json.dumps(header, separators=(",", ":")).encode()
    return struct.pack(">I", len(h)) + h + body


def unpack_frame(data: bytes) -> tuple[dict, bytes]:
    """(header, body) of a frame; raises ``ValueError`` on a malformed one."""
    if len(data) < 4:
        raise ValueError("frame shorter than its length prefix")
    n = struct.unpack(">I", data[:4])[0]
    if 4 + n > len(data):
        raise ValueError("frame header runs past the frame")
    header = json.loads(data[4:4 + n])
    if not isinstance(header, dict) or not isinstance(header.get("id"), int):
        raise ValueError("frame header is not an object with an integer id")
    return header, data[4 + n:]


def _forwarded(headers: Any) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() in FORWARDED}


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


class _Attached:
    """One attached hotkey on a relay: its socket, requests in flight, its bandwidth bucket, counters."""

    def __init__(self, hotkey: str, ws: web.WebSocketResponse, bucket: Optional[TokenBucket], remote: str):
        self.hotkey, self.ws, self.bucket, self.remote = hotkey, ws, bucket, remote
        self.pending: dict[int, asyncio.Future] = {}
        self.send_lock = asyncio.Lock()
        self.since = time.time()


class RelayHost:
    """The relay side (module docstring). ``keypair``: the relay neuron's hotkey (a ``Keypair`` or a
    wallet); ``authorize(hotkey)``: may this hotkey attach (raise or return False to refuse; None:
    anyone signed); ``rate_bytes_per_s``: the per-hotkey cap (None: none); ``max_body_bytes``: the
    largest request or response relayed; ``forward_timeout_s``: how long a forwarded request waits
    for its answer before its connection is dropped."""

    def __init__(self, keypair: Any, *, authorize: Optional[Callable[[str], Any]] = None,
                 rate_bytes_per_s: Optional[float] = None, max_body_bytes: int = 64 << 20,
                 forward_timeout_s: float = 600.0):
        self.hotkey: str = getattr(keypair, "hotkey", keypair).ss58_address
        self.authorize = authorize
        self.rate_bytes_per_s = rate_bytes_per_s
        self.max_body_bytes = int(max_body_bytes)
        self.forward_timeout_s = float(forward_timeout_s)
        self.attached: dict[str, _Attached] = {}
        self.known: set[str] = set()              # every hotkey ever attached here
        self.nonces = http_auth.InMemoryNonceStore(retention=60.0)
        self.counts: Counter[str] = Counter()
        self.bytes_by: Counter[str] = Counter()   # hotkey -> bytes relayed (both directions)
        self.requests_by: Counter[str] = Counter()
        self._ids = itertools.count(1)

    def mount(self, server: Any) -> None:
        """Serve ``GET /relay/attach`` and forward on ``server`` (a NeuronServer, before its start)."""
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
        ws = web.WebSocketResponse(max_msg_size=self.max_body_bytes + (1 << 16), heartbeat=20.0)
        await ws.prepare(request)
        bucket = TokenBucket(self.rate_bytes_per_s) if self.rate_bytes_per_s else None
        old = self.attached.get(hotkey)
        me = _Attached(hotkey, ws, bucket, str(request.remote))
        self.attached[hotkey] = me
        self.known.add(hotkey)
        if old is not None:
            await old.ws.close()
        self.counts["attached"] += 1
        logger.info("relay: {} attached from {}", hotkey[:10], request.remote)
        try:
            async for msg in ws:
                if msg.type != aiohttp.WSMsgType.BINARY:
                    continue
                try:
                    header, body = unpack_frame(msg.data)
                except ValueError as e:
                    self.counts["bad_frames"] += 1
                    logger.debug("relay: bad frame from {}: {}", hotkey[:10], e)
                    continue
                fut = me.pending.pop(header["id"], None)
                if fut is not None and not fut.done():
                    fut.set_result((header, body))
        finally:
            if self.attached.get(hotkey) is me:
                del self.attached[hotkey]
            for fut in me.pending.values():
                if not fut.done():
                    fut.set_exception(ConnectionResetError("the relayed neuron detached"))
            logger.info("relay: {} detached", hotkey[:10])
        return ws

    # ---------------------------------------------------------------- forward
    async def forward(self, request: web.Request) -> Optional[web.StreamResponse]:
        """Forward ``request`` when its btauth receiver is attached here; None when it is not for a
        relayed hotkey (the server serves it itself)."""
        receiver = request.headers.get(http_auth.HEADER_RECEIVER)
        if not receiver or receiver == self.hotkey or receiver not in self.known:
            return None
        peer = self.attached.get(receiver)
        if peer is None:
            return self._drop(request, "unattached")
        if request.content_length is not None and request.content_length > self.max_body_bytes:
            return self._drop(request, "too_large")
        body = await request.read()
        if peer.bucket is not None:
            await peer.bucket.take(len(body))
        try:
            header, out = await asyncio.wait_for(
                self.send(peer, {"method": request.method, "path": request.raw_path,
                                 "headers": _forwarded(request.headers)}, body), self.forward_timeout_s)
        except (ConnectionError, RuntimeError, asyncio.TimeoutError, aiohttp.ClientError):
            return self._drop(request, "lost")
        if peer.bucket is not None:
            await peer.bucket.take(len(out))
        self.requests_by[receiver] += 1
        self.bytes_by[receiver] += len(body) + len(out)
        self.counts["forwarded"] += 1
        headers = {k: v for k, v in (header.get("headers") or {}).items() if k.lower() != "content-length"}
        return web.Response(status=int(header.get("status", 502)), body=out, headers=headers)

    async def send(self, peer: _Attached, header: dict, body: bytes) -> tuple[dict, bytes]:
        """Send one request (``header``: method, path, headers) over ``peer``'s socket and wait for
        its answer: (response header, response body). Raises ``ConnectionError`` when the peer
        detaches first."""
        rid = next(self._ids)
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        peer.pending[rid] = fut
        try:
            async with peer.send_lock:
                await peer.ws.send_bytes(pack_frame({**header, "id": rid}, body))
            return await fut
        finally:
            peer.pending.pop(rid, None)

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
                                  "bytes": self.bytes_by[hk], "in_flight": len(a.pending)}
                             for hk, a in self.attached.items()},
                # every hotkey relayed here since start, attached now or not
                "relayed": {hk: {"requests": self.requests_by[hk], "bytes": self.bytes_by[hk]} for hk in sorted(self.known)},
                "counts": dict(self.counts)}


class RelayTunnel:
    """The side of a neuron that cannot be dialled (module docstring). ``keypair``: its hotkey;
    ``relays``: ``[(endpoint "ip:port", relay hotkey)]`` tried in turn; ``local``: its own server's
    ``ip:port`` (loopback). :meth:`run` keeps one attached until ``stop`` is set."""

    def __init__(self, keypair: Any, relays: list[tuple[str, str]], local: str, *,
                 max_body_bytes: int = 64 << 20, backoff_s: tuple[float, float] = (1.0, 30.0)):
        if not relays:
            raise ValueError("a relay tunnel needs at least one relay (endpoint, hotkey)")
        self.signer = getattr(keypair, "hotkey", keypair)
        self.relays = list(relays)
        self.local = local
        self.max_body_bytes = int(max_body_bytes)
        self.backoff_s = backoff_s
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
                                      max_msg_size=self.max_body_bytes + (1 << 16)) as ws:
            self.current = endpoint
            self.attached.set()
            self.counts["attached"] += 1
            logger.info("relay tunnel: attached to {} ({})", endpoint, relay_hotkey[:10])
            lock = asyncio.Lock()
            tasks: set[asyncio.Task] = set()
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
                    if msg.type != aiohttp.WSMsgType.BINARY:
                        continue
                    t = asyncio.create_task(self._answer(session, ws, lock, msg.data))
                    tasks.add(t)
                    t.add_done_callback(tasks.discard)
            finally:
                stopper.cancel()
                for t in tasks:
                    t.cancel()

    async def _answer(self, session: aiohttp.ClientSession, ws: Any, lock: asyncio.Lock, data: bytes) -> None:
        """Replay one forwarded request against the local server and send its answer back."""
        try:
            header, body = unpack_frame(data)
        except ValueError as e:
            self.counts["bad_frames"] += 1
            logger.debug("relay tunnel: bad frame: {}", e)
            return
        try:
            async with session.request(str(header.get("method", "POST")), f"http://{self.local}{header.get('path', '/')}",
                                       data=body, headers={**_forwarded(header.get("headers") or {}),
                                                         **tunnel_headers(self.current)}) as resp:
                out = await resp.read()
                reply = pack_frame({"id": header["id"], "status": resp.status,
                                    "headers": {k: v for k, v in resp.headers.items()
                                                if k.lower() in FORWARDED or k.lower().startswith("x-")}}, out)
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
            self.counts["local_failures"] += 1
            logger.warning("relay tunnel: the local server did not answer {}: {}", header.get("path"), e)
            return
        self.counts["answered"] += 1
        async with lock:
            await ws.send_bytes(reply)

    def status(self) -> dict:
        return {"relay": self.current, "relays": [e for e, _ in self.relays], "counts": dict(self.counts),
                "last_error": self.last_error}


