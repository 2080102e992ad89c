"""HTTP server for a neuron: btauth/1-authenticated, typed, validated POST routes.

Every request goes through one middleware, in this order; steps 1-5 use only the headers, so a
caller that may not send the body is refused before any of it is read:

1. route lookup (``UNKNOWN_ROUTE`` 404 for unknown paths or non-POST methods);
2. concurrency bound (``BUSY`` 503 when ``max_inflight`` requests are already running); a
   ``Content-Length`` above the route's body limit is refused at once (413 ``BODY_TOO_LARGE``);
3. the btauth/1 headers: present (``MISSING_SIGNATURE``), well formed, bound to our hotkey
   (``WRONG_RECEIVER``), and fresh *when the request started* (its headers arrived): a nonce
   ahead of our clock by more than ``allowed_skew`` is ``CLOCK_SKEW``, one older than ``max_age``
   is ``STALE_REQUEST``; a nonce already accepted, in flight, or older than the nonce store is
   ``REPLAYED_NONCE``. A slow upload of a large body is therefore not refused as stale;
4. ``authorizer(claimed_hotkey, route)`` (sync or async), supplied by the neuron; it raises
   ``ProtocolError(UNREGISTERED_HOTKEY | FORBIDDEN)`` to refuse;
5. per-caller bound (``TOO_MANY_REQUESTS`` 429 when that hotkey already has
   ``max_inflight_per_caller`` requests in flight);
6. the body, read only up to the route's limit (``max_body_bytes``; a chunked body over it is 413
   ``BODY_TOO_LARGE``);
7. ``bittensor.http_auth.verify`` of the signature over the body (freshness judged at the time
   the request started) with a persistent nonce store; each ``AuthError`` maps to an
   :class:`Outcome` (see :data:`AUTH_OUTCOMES`);
8. :func:`iota_subnet.protocol.decode` against the route's message type and contract;
9. the handler ``handler(msg, ctx) -> Message`` (sync or async).

Success: 200, ``application/octet-stream``, the encoded response; the response is signed with
our hotkey (btauth/1 headers, method ``RESPONSE``, path ``<request path>#<request nonce>``,
receiver = the caller) so a client can check which hotkey produced it. Refusal: the outcome's
status with a JSON body ``{"outcome": "...", "message": "..."}``. An unexpected handler exception
gives 500 ``INTERNAL`` (traceback logged) and the server keeps serving.
"""
from __future__ import annotations

import asyncio
import errno
import hmac
import inspect
import os
import secrets
import socket
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Optional, Union

from aiohttp import web
from bittensor import http_auth
from loguru import logger

from ..protocol import Message, Outcome, ProtocolError, TensorContract, decode, encode, payload_nbytes
from .nonce_store import MemoryNonceStore, SqliteNonceStore
from .paths import path_book, relayed_via
from .shaping import DownlinkShaper, LinkDown, UplinkShaper, process_downlink, process_shaper, response_head_bytes
from .streaming import PIECE_BYTES, body_pieces
from iota_subnet.errors import UserError

#: bittensor.http_auth exception -> outcome.
AUTH_OUTCOMES: dict[type[http_auth.AuthError], Outcome] = {
    http_auth.MalformedAuth: Outcome.BAD_SIGNATURE,
    http_auth.WrongReceiver: Outcome.WRONG_RECEIVER,
    http_auth.StaleRequest: Outcome.STALE_REQUEST,
    http_auth.BadSignature: Outcome.BAD_SIGNATURE,
    http_auth.ReplayedRequest: Outcome.REPLAYED_NONCE,
}
#: Headers whose absence (or empty value) is MISSING_SIGNATURE rather than BAD_SIGNATURE.
_REQUIRED_AUTH_HEADERS = (http_auth.HEADER_VERSION, http_auth.HEADER_HOTKEY, http_auth.HEADER_NONCE,
                          http_auth.HEADER_SIGNATURE)
#: Bodies above this size are verified / decoded in a worker thread so the event loop stays free.
OFFLOAD_BYTES = 256 << 10

RESPONSE_METHOD = "RESPONSE"
HEADER_REQUEST_NONCE = "X-Iota-Request-Nonce"
#: Headers this neuron's own relay tunnel adds to a request it replays on loopback
#: (:mod:`iota_subnet.transport.relay`): the server's :attr:`NeuronServer.relay_token` (only the tunnel
#: of this process holds it; any other request carrying these headers has them ignored), the caller's
#: address as the relay saw it and the relay's hotkey. A relay forwards none of them from its callers.
HEADER_RELAY_TOKEN = "X-Iota-Relay-Token"
HEADER_RELAY_REMOTE = "X-Iota-Relay-Remote"
HEADER_RELAY_HOTKEY = "X-Iota-Relay-Hotkey"


_MSG_KEY = web.RequestKey("iota_msg", Message)


def response_sign_path(path: str, request_nonce: int | str) -> str:
    """The ``path`` a response signature covers: binds the response to one request."""
    return f"{path}#{request_nonce}"



class PortInUseError(UserError, OSError):
    """A server could not listen on its address (another process holds the port, or the address is
    not this machine's). The message names the fix."""


#: Seconds a stopping server lets requests in flight finish, then again while it cancels them (aiohttp
#: waits up to twice this; its default of 60 s let a peer's long request, an audit trace or a state
#: transfer, hold a neuron's shutdown past the 15 s that ``localnet`` and process managers wait before
#: SIGKILL). Peers retry cancelled hops.
SHUTDOWN_GRACE_S = 2.0


async def start_site(runner: web.AppRunner, host: str, port: int, what: str, flag: str) -> None:
    """Start ``runner`` on ``host:port``; on ``runner.cleanup()`` requests still running get at most
    twice :data:`SHUTDOWN_GRACE_S` seconds. Raises PortInUseError (naming ``what`` and the ``flag``
    that sets its port) instead of the bare OSError of a failed bind."""
    try:
        await web.TCPSite(runner, host, port, reuse_address=True, shutdown_timeout=SHUTDOWN_GRACE_S).start()
    except OSError as e:
        await runner.cleanup()
        why = "the port is in use (another process holds it)" if e.errno == errno.EADDRINUSE else str(e.strerror or e)
        raise PortInUseError(f"{what} cannot listen on {host}:{port}: {why}; stop that process or choose "
                             f"another {flag}") from None


@dataclass(frozen=True)
class RequestContext:
    """What a handler knows about the request besides the message."""

    caller_hotkey: str
    route: str
    nonce_ns: int
    #: the caller's address: the connection's peer, or for a request through this neuron's own relay
    #: tunnel the address the relay says it saw (the relay is not trusted: use it for progress only)
    remote: Optional[str]
    body_bytes: int
    received_at: float
    #: called once the response has been sent (its body handed to the network, through the emulated
    #: uplink when there is one), or the request failed: a handler that holds a resource for the
    #: whole transfer (a state-sync donor's slot) releases it here
    on_sent: list[Callable[[], Any]] = field(default_factory=list)
    #: the relay's hotkey when the request came through this neuron's relay tunnel, else None
    via_relay: Optional[str] = None


_CTX_KEY = web.RequestKey("iota_ctx", RequestContext)

Handler = Callable[[Message, RequestContext], Union[Message, Awaitable[Message]]]
Authorizer = Callable[[str, str], Union[None, Awaitable[None]]]
#: ``on_refused(caller_hotkey, request_headers, path, body, error)``: a request whose signature
#: verified was refused while decoding or by its handler (the body is exactly the signed one)
RefusalHook = Callable[[str, Any, str, bytes, ProtocolError], Any]
ContractFn = Union[Callable[[], Optional[TensorContract]], TensorContract, None]


@dataclass
class Route:
    path: str
    handler: Handler
    message_type: type[Message]
    contract_fn: ContractFn = None
    max_body_bytes: Optional[int] = None     #: this route's body limit (None: the server's)
    on_refused: Optional[RefusalHook] = None
    #: ``on_body_bytes(claimed_hotkey, remote_ip, n)`` as each piece of ``n`` body bytes arrives
    on_body_bytes: Optional[Callable[[str, str, int], None]] = None

    def contract(self) -> Optional[TensorContract]:
        if self.contract_fn is None or isinstance(self.contract_fn, TensorContract):
            return self.contract_fn
        return self.contract_fn()


def _set_nodelay(request: web.Request) -> None:
    transport = request.transport
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass


class NeuronServer:
    """An aiohttp application serving signed, typed POST routes for one hotkey.

    ``wallet``: a ``bittensor.Wallet`` (its hotkey is loaded once) or a hotkey ``Keypair``.

    ``authorizer(caller_hotkey, route)``: ``None`` accepts every authenticated hotkey (tests only).
    ``nonce_store_path``: SQLite file for replay protection across restarts (``None``: in memory).
    ``shaper``: the emulated uplink every response passes (head + body), by default the process's
    (:func:`iota_subnet.transport.shaping.configure_process_link`; none unless ``--link`` is given).
    ``downlink``: the emulated downlink every request body passes once read (head + body), by
    default the process's (none unless ``--link UP/DOWN:DELAY`` is given).
    Register routes with :meth:`add_route` before :meth:`start`.
    """

    def __init__(self, wallet: Any, host: str = "0.0.0.0", port: int = 0, authorizer: Optional[Authorizer] = None,
                 nonce_store_path: Optional[str | os.PathLike] = None, max_body_bytes: int = 64 << 20, *,
                 max_age: float = http_auth.DEFAULT_MAX_AGE, allowed_skew: float = http_auth.DEFAULT_ALLOWED_SKEW,
                 max_inflight: Optional[int] = None, max_inflight_per_caller: Optional[int] = 16,
                 sign_responses: bool = True, shaper: Optional[UplinkShaper] = None,
                 downlink: Optional[DownlinkShaper] = None):
        self.wallet = wallet
        # Load the hotkey once: signing through the Wallet re-reads and parses the key file (~2 ms) every time.
        self._signer = getattr(wallet, "hotkey", wallet)
        self.hotkey: str = self._signer.ss58_address
        self.host = host
        self.port = port
        self.authorizer = authorizer
        self.max_body_bytes = int(max_body_bytes)
        self.max_age = max_age
        self.allowed_skew = allowed_skew
        self.max_inflight = max_inflight
        self.max_inflight_per_caller = max_inflight_per_caller
        self.sign_responses = sign_responses
        self.shaper = shaper if shaper is not None else process_shaper()
        self.downlink = downlink if downlink is not None else process_downlink()
        #: shared with this process's relay tunnels (:class:`~iota_subnet.transport.relay.RelayTunnel`):
        #: their replayed requests say which address the relay saw (:data:`HEADER_RELAY_TOKEN`)
        self.relay_token = secrets.token_hex(16)
        if nonce_store_path is None:
            logger.warning("NeuronServer without nonce_store_path: replay protection is lost on restart")
            self.nonce_store: Any = MemoryNonceStore(retention=max_age + allowed_skew + 5.0)
        else:
            self.nonce_store = SqliteNonceStore(nonce_store_path, max_age=max_age, allowed_skew=allowed_skew)
        if authorizer is None:
            logger.warning("NeuronServer without authorizer: every authenticated hotkey is accepted")
        self.routes: dict[str, Route] = {}
        self.public_gets: dict[str, Callable[[web.Request], Awaitable[web.StreamResponse]]] = {}
        #: a relay's forwarder (:meth:`set_forwarder`): requests signed for another hotkey it relays for
        self.forwarder: Optional[Callable[[web.Request], Awaitable[Optional[web.StreamResponse]]]] = None
        self.app = web.Application(middlewares=[self._middleware], client_max_size=self.max_body_bytes)
        self._runner: Optional[web.AppRunner] = None
        self._inflight = 0
        self._inflight_by: Counter[str] = Counter()          # claimed hotkey -> requests in flight
        self._pending_nonces: set[tuple[str, int]] = set()    # (hotkey, nonce) of requests in flight
        #: counters: requests per outcome, bytes in/out (bodies).
        self.outcomes: Counter[str] = Counter()
        self.bytes_received = 0
        self.bytes_sent = 0
        #: request line + header bytes received, status line + header bytes sent (approximate)
        self.header_bytes_received = 0
        self.header_bytes_sent = 0
        #: bytes (bodies + headers, both directions) per route
        self.route_bytes: Counter[str] = Counter()
        #: per caller whose signature verified, whether its requests came directly or through this
        #: process's relay tunnel (:mod:`.paths`)
        self.paths = path_book()

    # ------------------------------------------------------------------ routes
    def add_route(self, path: str, handler: Handler, message_type: type[Message], contract_fn: ContractFn = None,
                  *, max_body_bytes: Optional[int] = None, on_refused: Optional[RefusalHook] = None,
                  on_body_bytes: Optional[Callable[[str, str, int], None]] = None) -> None:
        """Serve POST ``path``: bodies decode to ``message_type`` checked against ``contract_fn``;
        ``max_body_bytes`` overrides the server's body limit for this route (merge payloads of a
        whole stage are far larger than an activation). ``on_refused`` (see :data:`RefusalHook`) is
        told of every authenticated request of this route refused by decoding or by the handler
        (a hop receiver keeps the signed body as evidence against its sender). ``on_body_bytes(hotkey,
        remote_ip, n)`` is told of each piece of the body as it arrives, before the signature over the
        whole body can be checked: the hotkey is the one the headers claim (bound to this receiver,
        fresh, not replayed, authorized) and ``remote_ip`` the connection's peer address (for a request
        through this neuron's own relay tunnel: the address the relay says it saw, see :meth:`relayed`;
        a lying relay can only misreport it, not forge the signature checked once the body is in), so it serves a
        progress timeout (a merge's reducer waiting for a slow sender; the receiver should credit only
        bytes from the claimed hotkey's own address), never blame."""
        if not path.startswith("/"):
            raise ValueError(f"route path must start with '/': {path!r}")
        if path in self.routes:
            raise ValueError(f"route {path} registered twice")
        if self._runner is not None:
            raise RuntimeError("add routes before start()")
        route = Route(path, handler, message_type, contract_fn, None if max_body_bytes is None else int(max_body_bytes),
                      on_refused, on_body_bytes)
        self.routes[path] = route

        async def _aiohttp_handler(request: web.Request) -> web.StreamResponse:
            return await self._run_handler(route, request)

        self.app.router.add_post(path, _aiohttp_handler)

    def add_public_get(self, path: str, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> None:
        """An unauthenticated GET route (Prometheus ``/metrics``); it must expose nothing secret."""
        if self._runner is not None:
            raise RuntimeError("add routes before start()")
        self.public_gets[path] = handler
        self.app.router.add_get(path, handler)

    def set_forwarder(self, forwarder: Callable[[web.Request], Awaitable[Optional[web.StreamResponse]]]) -> None:
        """Offer every request to ``forwarder`` first (a relay, :class:`~iota_subnet.transport.relay.RelayHost`):
        it answers those signed for a hotkey it relays for and returns None for the rest."""
        if self._runner is not None:
            raise RuntimeError("set the forwarder before start()")
        self.forwarder = forwarder

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> int:
        """Bind and serve; returns the bound port (useful with ``port=0``)."""
        if self._runner is not None:
            return self.port
        runner = web.AppRunner(self.app, access_log=None, handle_signals=False)
        await runner.setup()
        await start_site(runner, self.host, self.port, "this neuron's server", "--port")
        self._runner = runner
        addrs = runner.addresses
        if addrs:
            self.port = int(addrs[0][1])
        logger.info("NeuronServer {} listening on {}:{} ({} routes)", self.hotkey[:8], self.host, self.port,
                    len(self.routes))
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        close = getattr(self.nonce_store, "close", None)
        if close is not None:
            close()

    async def __aenter__(self) -> "NeuronServer":
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()

    @property
    def endpoint(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "", None) else self.host
        return f"{host}:{self.port}"

    # ------------------------------------------------------------------ request path
    def _refuse(self, err: ProtocolError, request: web.Request) -> web.Response:
        self.outcomes[err.outcome.value] += 1
        self.header_bytes_sent += 120
        level = "WARNING" if err.outcome in (Outcome.INTERNAL,) else "DEBUG"
        logger.log(level, "refused {} from {}: {} {}", request.path, request.remote, err.outcome.value, err.message)
        return web.json_response(err.to_json(), status=err.status)

    async def _read_body(self, request: web.Request, limit: int,
                         on_bytes: Optional[Callable[[int], None]] = None) -> bytes:
        declared = request.content_length
        if declared is not None and declared > limit:
            raise ProtocolError(Outcome.BODY_TOO_LARGE, f"Content-Length {declared} > limit {limit}")
        chunks: list[bytes] = []
        size = 0
        while True:
            chunk = await request.content.read(min(1 << 20, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                raise ProtocolError(Outcome.BODY_TOO_LARGE, f"body over the limit of {limit} bytes")
            if on_bytes is not None:
                on_bytes(len(chunk))
        return b"".join(chunks)

    def relayed(self, request: web.Request) -> Optional[tuple[str, str]]:
        """(caller address as the relay saw it, relay hotkey) of a request replayed by this process's
        own relay tunnel (it carries :attr:`relay_token`), else None."""
        token = request.headers.get(HEADER_RELAY_TOKEN)
        if not token or not hmac.compare_digest(token, self.relay_token):
            return None
        return request.headers.get(HEADER_RELAY_REMOTE, ""), request.headers.get(HEADER_RELAY_HOTKEY, "")

    def _claim(self, request: web.Request, started_ns: int) -> tuple[str, int]:
        """The claimed (hotkey, nonce) of a request, from its headers alone (no body needed yet).

        Checks presence, form, receiver binding, freshness against ``started_ns`` (when the
        headers arrived) and replay; raises :class:`ProtocolError` (see the module docstring)."""
        headers = request.headers
        for name in _REQUIRED_AUTH_HEADERS:
            if not headers.get(name):
                raise ProtocolError(Outcome.MISSING_SIGNATURE, f"missing {name}")
        if headers[http_auth.HEADER_VERSION] != http_auth.VERSION:
            raise ProtocolError(Outcome.BAD_SIGNATURE, f"unsupported {http_auth.HEADER_VERSION} "
                                                       f"(expected {http_auth.VERSION!r})")
        receiver = headers.get(http_auth.HEADER_RECEIVER)
        if receiver != self.hotkey:
            raise ProtocolError(Outcome.WRONG_RECEIVER, "request was signed for a different (or no) receiving hotkey")
        hotkey = headers[http_auth.HEADER_HOTKEY]
        try:
            nonce = int(headers[http_auth.HEADER_NONCE])
        except ValueError:
            raise ProtocolError(Outcome.BAD_SIGNATURE, f"{http_auth.HEADER_NONCE} is not a decimal integer") from None
        ahead_s, age_s = (nonce - started_ns) / 1e9, (started_ns - nonce) / 1e9
        if ahead_s > self.allowed_skew:
            raise ProtocolError(Outcome.CLOCK_SKEW, (
                f"signed {ahead_s:.1f} s in the future by our clock (at most {self.allowed_skew:g} s allowed): the "
                "caller's clock runs ahead; synchronise it (NTP)"))
        if age_s > self.max_age:
            raise ProtocolError(Outcome.STALE_REQUEST, (
                f"signed {age_s:.1f} s before the request reached us (freshness window {self.max_age:g} s): sign "
                "again and resend; if every request is this late, the caller's clock runs behind (sync NTP)"))
        key = (hotkey, nonce)
        if key in self._pending_nonces or self.nonce_store.seen(hotkey, nonce):
            raise ProtocolError(Outcome.REPLAYED_NONCE, "this nonce was already used by this hotkey, or predates "
                                                        "our replay store; sign the request again")
        return key

    def _verify(self, request: web.Request, body: bytes, started_ns: int) -> http_auth.Caller:
        """The signature over ``body``, freshness judged at ``started_ns``; stores the nonce."""
        try:
            return http_auth.verify(request.headers, body, method=request.method, path=request.raw_path,
                                    self_hotkey_ss58=self.hotkey, max_age=self.max_age,
                                    allowed_skew=self.allowed_skew, nonce_store=self.nonce_store, now_ns=started_ns)
        except http_auth.AuthError as e:
            outcome = next((o for cls, o in AUTH_OUTCOMES.items() if isinstance(e, cls)), Outcome.BAD_SIGNATURE)
            raise ProtocolError(outcome, str(e)) from None

    async def _authorize(self, hotkey: str, route: Route) -> None:
        if self.authorizer is not None:
            res = self.authorizer(hotkey, route.path)
            if inspect.isawaitable(res):
                await res

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                          ) -> web.StreamResponse:
        try:
            resp = await self._serve(request, handler)
            if self.shaper is not None:   # the emulated uplink: every response, refusals included
                body = resp.body if isinstance(resp, web.Response) and isinstance(resp.body, (bytes, bytearray)) else b""
                if len(body) > PIECE_BYTES:       # in pieces, as the link releases them: the caller sees progress
                    return await self._send_shaped(request, resp, bytes(body))
                try:
                    await self.shaper.transmit(len(body) + response_head_bytes(resp.status, resp.headers))
                except LinkDown:          # partitioned: the answer never leaves; the caller sees the connection drop
                    if request.transport is not None:
                        request.transport.abort()
                    return resp
            ctx = request.get(_CTX_KEY)
            if ctx is not None and ctx.on_sent and request.transport is not None and not request.transport.is_closing():
                await resp.prepare(request)       # send it now: the handler's resource covers the transfer
                await resp.write_eof()
            return resp
        finally:
            ctx = request.get(_CTX_KEY)
            for fn in (ctx.on_sent if ctx is not None else ()):
                try:
                    fn()
                except Exception:  # noqa: BLE001 - a release hook must not break the response
                    logger.exception("on_sent hook failed")

    async def _send_shaped(self, request: web.Request, resp: web.Response, body: bytes) -> web.StreamResponse:
        """Send ``resp`` (whose body is ``body``) through the emulated uplink in pieces
        (:func:`~iota_subnet.transport.streaming.body_pieces`)."""
        out = web.StreamResponse(status=resp.status, headers={k: v for k, v in resp.headers.items()
                                                               if k.lower() != "content-length"})
        out.content_length = len(body)
        pieces = body_pieces(body, self.shaper, response_head_bytes(resp.status, resp.headers))
        try:
            first = await pieces.__anext__()     # the head leaves with the first piece
            await out.prepare(request)
            await out.write(first)
            async for piece in pieces:
                await out.write(piece)
            await out.write_eof()
        except OSError:           # partitioned (LinkDown) or the caller went away: the connection drops
            if request.transport is not None:
                request.transport.abort()
        finally:
            await pieces.aclose()
        return out

    async def _serve(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                     ) -> web.StreamResponse:
        started_ns = time.time_ns()
        _set_nodelay(request)
        if request.method == "GET" and request.path in self.public_gets:
            return await self.public_gets[request.path](request)
        if self.forwarder is not None:
            relayed = await self.forwarder(request)
            if relayed is not None:
                return relayed
        route = self.routes.get(request.path)
        if route is None or request.method != "POST":
            return self._refuse(ProtocolError(Outcome.UNKNOWN_ROUTE, f"no route {request.method} {request.path}"),
                                request)
        if self.max_inflight is not None and self._inflight >= self.max_inflight:
            return self._refuse(ProtocolError(Outcome.BUSY, f"{self._inflight} requests in flight"), request)
        self._inflight += 1
        t0 = time.perf_counter()
        hdr = len(request.raw_path) + 16 + sum(len(k) + len(v) + 4 for k, v in request.raw_headers)
        self.header_bytes_received += hdr
        self.route_bytes[route.path] += hdr
        claim: Optional[tuple[str, int]] = None
        signed: Optional[tuple[str, bytes]] = None      # (caller, body) once the signature verified
        limit = route.max_body_bytes or self.max_body_bytes
        try:
            if request.content_length is not None and request.content_length > limit:
                raise ProtocolError(Outcome.BODY_TOO_LARGE, f"Content-Length {request.content_length} > limit {limit}")
            hotkey, nonce = self._claim(request, started_ns)
            await self._authorize(hotkey, route)
            cap = self.max_inflight_per_caller
            if cap is not None and self._inflight_by[hotkey] >= cap:
                raise ProtocolError(Outcome.TOO_MANY_REQUESTS, f"{self._inflight_by[hotkey]} requests of this hotkey "
                                                               f"are already in flight (at most {cap})")
            claim = (hotkey, nonce)
            self._pending_nonces.add(claim)
            self._inflight_by[hotkey] += 1
            relayed = self.relayed(request)
            on_bytes, remote = route.on_body_bytes, relayed[0] if relayed else str(request.remote or "")
            body = await self._read_body(request, limit,
                                         None if on_bytes is None else (lambda n: on_bytes(hotkey, remote, n)))
            if self.downlink is not None:   # the emulated downlink (freshness was judged when the head arrived)
                try:
                    await self.downlink.receive(len(body) + hdr)
                except LinkDown:            # partitioned: the answer cannot leave either (the connection drops)
                    raise ProtocolError(Outcome.NOT_READY, "emulated link partitioned") from None
            self.bytes_received += len(body)
            self.route_bytes[route.path] += len(body)
            big = len(body) > OFFLOAD_BYTES
            caller = (await asyncio.to_thread(self._verify, request, body, started_ns) if big
                      else self._verify(request, body, started_ns))
            signed = (caller.hotkey_ss58, body)
            contract = route.contract()
            if big:
                msg = await asyncio.to_thread(decode, body, route.message_type, contract, max_body_bytes=limit)
            else:
                msg = decode(body, route.message_type, contract, max_body_bytes=limit)
            request[_MSG_KEY] = msg
            request[_CTX_KEY] = RequestContext(caller_hotkey=caller.hotkey_ss58, route=route.path,
                                                 nonce_ns=caller.nonce_ns, remote=remote,
                                                 body_bytes=len(body), received_at=t0,
                                                 via_relay=relayed[1] if relayed else None)
            resp = await handler(request)
            self._record_path(request, caller.hotkey_ss58, hdr + len(body), resp)
            return resp
        except ProtocolError as e:
            if signed is not None:
                self._record_path(request, signed[0], hdr + len(signed[1]), None)
            if signed is not None and route.on_refused is not None:
                try:
                    route.on_refused(signed[0], request.headers, request.raw_path, signed[1], e)
                except Exception:  # noqa: BLE001 - a report hook must not change the answer
                    logger.exception("on_refused hook of {} failed", route.path)
            return self._refuse(e, request)
        except (asyncio.CancelledError, web.HTTPException):
            raise
        except Exception as e:  # noqa: BLE001 - any handler fault must not take the server down
            logger.exception("handler for {} failed", request.path)
            return self._refuse(ProtocolError(Outcome.INTERNAL, f"{type(e).__name__} in handler"), request)
        finally:
            self._inflight -= 1
            if claim is not None:
                self._pending_nonces.discard(claim)
                self._inflight_by[claim[0]] -= 1
                if self._inflight_by[claim[0]] <= 0:
                    del self._inflight_by[claim[0]]

    def _record_path(self, request: web.Request, caller: str, nbytes: int,
                     resp: Optional[web.StreamResponse]) -> None:
        """The path book's ``in`` record of a verified caller's request (``nbytes``: its head and body;
        the response's body is added when known)."""
        if isinstance(resp, web.Response) and isinstance(resp.body, (bytes, bytearray)):
            nbytes += len(resp.body)
        elif resp is not None:
            nbytes += resp.body_length
        self.paths.record(self.hotkey, caller, "in", relayed_via(request.headers), nbytes)

    async def _run_handler(self, route: Route, request: web.Request) -> web.StreamResponse:
        msg: Message = request[_MSG_KEY]
        ctx: RequestContext = request[_CTX_KEY]
        result = route.handler(msg, ctx)
        if inspect.isawaitable(result):
            result = await result
        if not isinstance(result, Message):
            raise TypeError(f"handler for {route.path} returned {type(result).__name__}, not a Message")
        body = encode(result) if payload_nbytes(result) <= OFFLOAD_BYTES else await asyncio.to_thread(encode, result)
        headers = {"Content-Type": "application/octet-stream"}
        if self.sign_responses:
            headers.update(http_auth.sign(self._signer, method=RESPONSE_METHOD,
                                          path=response_sign_path(request.raw_path, ctx.nonce_ns),
                                          body=body, receiver_ss58=ctx.caller_hotkey))
            headers[HEADER_REQUEST_NONCE] = str(ctx.nonce_ns)
        self.outcomes[Outcome.OK.value] += 1
        self.bytes_sent += len(body)
        hdr = 17 + 40 + sum(len(k) + len(v) + 4 for k, v in headers.items())
        self.header_bytes_sent += hdr
        self.route_bytes[route.path] += len(body) + hdr
        logger.trace("{} from {}: OK in {:.1f} ms", route.path, ctx.caller_hotkey[:8],
                     (time.perf_counter() - ctx.received_at) * 1e3)
        return web.Response(body=body, status=200, headers=headers)
