"""HTTP client for a neuron: signed POSTs of typed messages, retries, byte counters.

One ``aiohttp.ClientSession`` per client (keep-alive pool, TCP_NODELAY on every socket). Each
attempt is signed afresh (btauth/1 needs a fresh nonce per request). Retries, with exponential
backoff, happen only for connection errors, timeouts, 503 (``BUSY`` / ``NOT_READY``) and 429
(``TOO_MANY_REQUESTS``); any other 4xx
is raised at once as :class:`ProtocolError` carrying the server's outcome. Network failure after
the last retry raises :class:`TransportError`.

The response is checked like a request: its btauth/1 signature (method ``RESPONSE``, bound to the
request nonce, signed by ``receiver_hotkey``) when ``verify_responses`` is on, then
:func:`decode` against ``response_type`` and the optional ``response_contract`` (a miner's NaN
activations surface as ``ProtocolError(NON_FINITE)``).
"""
from __future__ import annotations

import asyncio
import json
import random
import socket
import time
from typing import Any, Callable, Optional, Sequence, TypeVar

import aiohttp
from bittensor import http_auth
from loguru import logger

from ..protocol import Message, Outcome, ProtocolError, TensorContract, decode, encode, payload_nbytes
from .paths import path_book
from .server import HEADER_REQUEST_NONCE, OFFLOAD_BYTES, RESPONSE_METHOD, response_sign_path
from .shaping import DownlinkShaper, UplinkShaper, process_downlink, process_shaper, request_head_bytes
from .streaming import PIECE_BYTES, body_pieces

M = TypeVar("M", bound=Message)


class TransportError(Exception):
    """The peer could not be reached or did not answer in time (after all retries)."""

    def __init__(self, endpoint: str, message: str, attempts: int = 1):
        self.endpoint = endpoint
        self.attempts = attempts
        super().__init__(f"{endpoint}: {message} (after {attempts} attempt{'s' if attempts != 1 else ''})")


def _nodelay_socket(addr_info: Any) -> socket.socket:
    family, type_, proto, _, _ = addr_info
    sock = socket.socket(family=family, type=type_, proto=proto)
    if family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _refusal_from(status: int, body: bytes) -> ProtocolError:
    try:
        data = json.loads(body.decode("utf-8"))
        return ProtocolError(Outcome(data["outcome"]), str(data.get("message", "")), status=status)
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        outcome = Outcome.BUSY if status == 503 else (Outcome.INTERNAL if status >= 500 else Outcome.MALFORMED)
        return ProtocolError(outcome, f"HTTP {status} without a refusal body", status=status)


#: seconds an endpoint that stayed unreachable is tried after a receiver's other relays
AVOID_S = 60.0
#: seconds a relay that has not answered lately gets before the receiver's next relay is tried
UNPROVEN_TIMEOUT_S = 5.0


class EndpointHealth:
    """What this process saw of endpoints that reach a receiver through relays: when each last
    stayed unreachable and last answered. One per process (:func:`endpoint_health`), shared by every
    client, so a relay that drops traffic is learnt once, not once per client."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.unreachable: dict[str, float] = {}
        self.answered: dict[str, float] = {}

    def order(self, endpoints: Sequence[str]) -> list[str]:
        """Recently failed ones last; among the others the one that answered last first."""
        now = self.clock()
        return sorted(endpoints, key=lambda ep: (now - self.unreachable.get(ep, -1e18) < AVOID_S,
                                                 -self.answered.get(ep, -1e18)))

    def proven(self, endpoint: str) -> bool:
        """It answered within the last AVOID_S seconds."""
        return self.clock() - self.answered.get(endpoint, -1e18) < AVOID_S

    def ok(self, endpoint: str) -> None:
        self.unreachable.pop(endpoint, None)
        self.answered[endpoint] = self.clock()

    def failed(self, endpoint: str) -> None:
        self.unreachable[endpoint] = self.clock()


_HEALTH = EndpointHealth()


def endpoint_health() -> EndpointHealth:
    """The process's :class:`EndpointHealth`."""
    return _HEALTH
#: refusals that, through a relay, mean the relay altered or replayed the request (or the answer): with
#: alternates the call goes on through the receiver's next relay
RELAY_TAMPERING = frozenset({Outcome.BAD_SIGNATURE, Outcome.REPLAYED_NONCE, Outcome.MALFORMED,
                             Outcome.WRONG_RECEIVER})


class NeuronClient:
    """Calls other neurons' :class:`~iota_subnet.transport.server.NeuronServer` routes.

    ``wallet``: a ``bittensor.Wallet`` (its hotkey is loaded once) or a hotkey ``Keypair``.

    Counters (bodies only, all attempts): ``bytes_sent``, ``bytes_received``, ``requests``,
    ``retries``, ``failures``. Use ``async with NeuronClient(wallet) as c`` or call :meth:`close`.

    ``shaper``: the emulated uplink every request passes (head + body), by default the process's
    (:func:`iota_subnet.transport.shaping.configure_process_link`; none unless ``--link`` is given).
    ``downlink``: the emulated downlink every response passes once read (head + body), by default the
    process's (none unless ``--link UP/DOWN:DELAY`` is given).

    ``on_request(route, bytes_sent, bytes_received, seconds, outcome)``: called after every attempt
    (``outcome``: ``OK``, the refusal's outcome name, or ``TRANSPORT_ERROR``); the metrics hook
    (:meth:`iota_subnet.telemetry.NeuronMetrics.observe_hop`).

    ``alternates(hotkey)``: other endpoints that reach ``hotkey`` (the relays a neuron behind a NAT
    publishes, :mod:`iota_subnet.transport.relay`); a call whose endpoint stays unreachable after its
    retries is sent once to each in turn, and for :data:`AVOID_S` after that the endpoint that failed
    is tried last (a relay that drops traffic is avoided); the one that answered last is tried first,
    and one that has not answered lately gets :data:`UNPROVEN_TIMEOUT_S` while another is left. With
    alternates an endpoint is not retried: the next one is. What answers is shared by the process's
    clients (:func:`endpoint_health`). None: no alternates.

    Every call that got an answer is recorded in the process's path book (:mod:`.paths`) under this
    client's hotkey: ``"relayed"`` via the endpoint when it is one of ``alternates(receiver)``,
    ``"direct"`` otherwise.
    """

    def __init__(self, wallet: Any, *, max_connections: int = 64, keepalive_timeout: float = 60.0,
                 verify_responses: bool = True, max_response_bytes: Optional[int] = 256 << 20,
                 shaper: Optional[UplinkShaper] = None, downlink: Optional[DownlinkShaper] = None,
                 on_request: Optional[Callable[[str, int, int, float, str], None]] = None,
                 alternates: Optional[Callable[[str], Sequence[str]]] = None):
        self.wallet = wallet
        self.alternates = alternates
        #: which of a receiver's endpoints answer (with alternates; shared by the process's clients)
        self.health = endpoint_health()
        #: per receiver, the path each call took (direct or through which relay; :mod:`.paths`)
        self.paths = path_book()
        # Load the hotkey once: signing through the Wallet re-reads and parses the key file (~2 ms) every time.
        self._signer = getattr(wallet, "hotkey", wallet)
        self.hotkey: str = self._signer.ss58_address
        self.max_connections = max_connections
        self.keepalive_timeout = keepalive_timeout
        self.verify_responses = verify_responses
        self.max_response_bytes = max_response_bytes
        self.shaper = shaper if shaper is not None else process_shaper()
        self.downlink = downlink if downlink is not None else process_downlink()
        self._session: Optional[aiohttp.ClientSession] = None
        self._response_nonces = http_auth.InMemoryNonceStore(retention=60.0)
        self.bytes_sent = 0
        self.bytes_received = 0
        #: HTTP request line + header bytes sent / status line + header bytes received (approximate)
        self.header_bytes_sent = 0
        self.header_bytes_received = 0
        #: path -> bodies and headers, both directions (what :attr:`total_bytes` sums, by endpoint path)
        self.bytes_by_path: dict[str, int] = {}
        self.requests = 0
        self.retries = 0
        self.failures = 0
        self.on_request = on_request

    def _observe(self, path: str, sent: int, received: int, t0: float, outcome: str) -> None:
        if self.on_request is not None:
            self.on_request(path, sent, received, time.perf_counter() - t0, outcome)

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=self.max_connections, keepalive_timeout=self.keepalive_timeout,
                                             socket_factory=_nodelay_socket)
            self._session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> "NeuronClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    def stats(self) -> dict[str, int]:
        return {"bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received,
                "header_bytes_sent": self.header_bytes_sent, "header_bytes_received": self.header_bytes_received,
                "requests": self.requests, "retries": self.retries, "failures": self.failures}

    @property
    def total_bytes(self) -> int:
        """Bodies and headers, both directions."""
        return self.bytes_sent + self.bytes_received + self.header_bytes_sent + self.header_bytes_received

    async def call(self, endpoint: str, receiver_hotkey: str, path: str, msg: Message, response_type: type[M],
                   timeout_s: float = 30.0, retries: int = 2, backoff_s: float = 0.2, *,
                   response_contract: Optional[TensorContract] = None) -> M:
        """POST ``msg`` to ``http://{endpoint}{path}`` signed for ``receiver_hotkey``; return the decoded reply."""
        body = encode(msg) if payload_nbytes(msg) <= OFFLOAD_BYTES else await asyncio.to_thread(encode, msg)
        return await self.call_raw(endpoint, receiver_hotkey, path, body, response_type, timeout_s, retries,
                                   backoff_s, response_contract=response_contract)

    async def call_raw(self, endpoint: str, receiver_hotkey: str, path: str, body: bytes, response_type: type[M],
                       timeout_s: float = 30.0, retries: int = 2, backoff_s: float = 0.2, *,
                       response_contract: Optional[TensorContract] = None,
                       on_progress: Optional[Callable[[int], None]] = None) -> M:
        """:meth:`call` with an already-encoded body. ``on_progress(n)``: called as ``n`` more bytes of
        the request body have been sent and of the response body received (a body over
        :data:`~iota_subnet.transport.streaming.PIECE_BYTES` then goes out in pieces,
        :func:`~iota_subnet.transport.streaming.body_pieces`; so does every large body through an
        emulated uplink, whose receiver sees it arrive as over a real link)."""
        alts = [a for a in (self.alternates(receiver_hotkey) if self.alternates is not None else ()) if a != endpoint]
        if not alts:
            return await self._call_endpoint(endpoint, receiver_hotkey, path, body, response_type, timeout_s, retries,
                                             backoff_s, response_contract, on_progress)
        health = self.health
        order = health.order([endpoint, *alts])
        last: Optional[BaseException] = None
        for i, ep in enumerate(order):        # one attempt each: the next relay rather than the same again
            # a relay that has not answered lately gets a short try while another one is left to try
            t = timeout_s if i + 1 == len(order) or health.proven(ep) else min(timeout_s, UNPROVEN_TIMEOUT_S)
            try:
                reply = await self._call_endpoint(ep, receiver_hotkey, path, body, response_type, t,
                                                  0, backoff_s, response_contract, on_progress)
                health.ok(ep)
                return reply
            except (TransportError, ProtocolError) as e:
                if isinstance(e, ProtocolError) and e.outcome not in RELAY_TAMPERING:
                    raise                 # the receiver's own refusal: the same through any relay
                health.failed(ep)
                logger.debug("{}{} for {}: {}; trying the next of its relays if any", ep, path,
                             receiver_hotkey[:10], e)
                last = e
        raise last

    async def _call_endpoint(self, endpoint: str, receiver_hotkey: str, path: str, body: bytes,
                             response_type: type[M], timeout_s: float, retries: int, backoff_s: float,
                             response_contract: Optional[TensorContract],
                             on_progress: Optional[Callable[[int], None]]) -> M:
        session = self._get_session()
        url = f"http://{endpoint}{path}"
        attempts = max(1, int(retries) + 1)
        last: Optional[BaseException] = None
        for attempt in range(attempts):
            if attempt:
                self.retries += 1
                delay = backoff_s * (2 ** (attempt - 1)) * (1.0 + 0.1 * random.random())
                await asyncio.sleep(delay)
            headers = http_auth.sign(self._signer, method="POST", path=path, body=body, receiver_ss58=receiver_hotkey)
            headers["Content-Type"] = "application/octet-stream"
            self.requests += 1
            t0 = time.perf_counter()
            try:
                left = timeout_s
                payload: Any = body
                if len(body) > PIECE_BYTES and (self.shaper is not None or on_progress is not None):
                    payload = body_pieces(body, self.shaper, request_head_bytes("POST", path, headers), on_progress)
                    headers["Content-Length"] = str(len(body))
                elif self.shaper is not None:   # the emulated uplink, inside the request's deadline
                    await asyncio.wait_for(self.shaper.transmit(len(body) + request_head_bytes("POST", path, headers)),
                                           timeout_s)
                    left = max(1e-3, timeout_s - (time.perf_counter() - t0))
                    # signed as it goes on the wire (a socket would send the head then), not when it was queued
                    headers = http_auth.sign(self._signer, method="POST", path=path, body=body,
                                             receiver_ss58=receiver_hotkey)
                    headers["Content-Type"] = "application/octet-stream"
                timeout = aiohttp.ClientTimeout(total=left)
                async with session.post(url, data=payload, headers=headers, timeout=timeout) as resp:
                    head_at_ns = time.time_ns()      # a response's freshness is judged when its head arrived
                    self.bytes_sent += len(body)
                    # request line, Host, Content-Length and our headers; the response's status line and headers
                    head_out = len(url) + 64 + sum(len(k) + len(v) + 4 for k, v in headers.items())
                    head_in = 17 + sum(len(k) + len(v) + 4 for k, v in resp.raw_headers)
                    self.header_bytes_sent += head_out
                    self.header_bytes_received += head_in
                    data = await self._read(resp, on_progress)
                    if self.downlink is not None:   # the emulated downlink, inside the request's deadline
                        await asyncio.wait_for(self.downlink.receive(len(data) + head_in),
                                               max(1e-3, timeout_s - (time.perf_counter() - t0)))
                    self.bytes_received += len(data)
                    self.bytes_by_path[path] = self.bytes_by_path.get(path, 0) + len(body) + head_out + head_in + len(data)
                    self.paths.record(self.hotkey, receiver_hotkey, "out", self._relay_of(receiver_hotkey, endpoint),
                                      len(body) + head_out + head_in + len(data))
                    if resp.status == 200:
                        if self.verify_responses:
                            self._verify_response(resp, data, path, receiver_hotkey, headers, head_at_ns)
                        if len(data) > OFFLOAD_BYTES:
                            reply = await asyncio.to_thread(decode, data, response_type, response_contract)
                        else:
                            reply = decode(data, response_type, response_contract)
                        self._observe(path, len(body), len(data), t0, "OK")
                        return reply
                    err = _refusal_from(resp.status, data)
                    self._observe(path, len(body), len(data), t0, err.outcome.value)
                    if resp.status in (503, 429) and attempt + 1 < attempts:   # busy / caller cap
                        logger.debug("{}{}: {} (attempt {}/{}), retrying", endpoint, path, err.outcome.value,
                                     attempt + 1, attempts)
                        last = err
                        continue
                    self.failures += 1
                    raise err
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                last = e
                self._observe(path, len(body), 0, t0, "TRANSPORT_ERROR")
                logger.debug("{}{}: {} after {:.0f} ms (attempt {}/{})", endpoint, path, type(e).__name__,
                             (time.perf_counter() - t0) * 1e3, attempt + 1, attempts)
        self.failures += 1
        if isinstance(last, ProtocolError):
            raise last
        what = "timed out" if isinstance(last, asyncio.TimeoutError) else f"{type(last).__name__}: {last}"
        raise TransportError(endpoint, what, attempts) from last

    def _relay_of(self, receiver_hotkey: str, endpoint: str) -> Optional[str]:
        """``endpoint`` when it is one of the receiver's relays (its alternates), else None (direct)."""
        if self.alternates is not None and endpoint in self.alternates(receiver_hotkey):
            return endpoint
        return None

    async def _read(self, resp: aiohttp.ClientResponse, on_progress: Optional[Callable[[int], None]] = None) -> bytes:
        limit = self.max_response_bytes
        if limit is None and on_progress is None:
            return await resp.read()
        if limit is not None and resp.content_length is not None and resp.content_length > limit:
            raise ProtocolError(Outcome.BODY_TOO_LARGE, f"response of {resp.content_length} bytes > limit {limit}")
        chunks, size = [], 0
        async for chunk in resp.content.iter_chunked(1 << 20):
            size += len(chunk)
            if limit is not None and size > limit:
                raise ProtocolError(Outcome.BODY_TOO_LARGE, f"response over the limit of {limit} bytes")
            chunks.append(chunk)
            if on_progress is not None:
                on_progress(len(chunk))
        return b"".join(chunks)

    def _verify_response(self, resp: aiohttp.ClientResponse, data: bytes, path: str, receiver_hotkey: str,
                         request_headers: dict[str, str], head_at_ns: Optional[int] = None) -> None:
        nonce = request_headers[http_auth.HEADER_NONCE]
        if resp.headers.get(HEADER_REQUEST_NONCE) != nonce:
            raise ProtocolError(Outcome.BAD_SIGNATURE, "response is not bound to this request")
        try:
            caller = http_auth.verify(resp.headers, data, method=RESPONSE_METHOD, path=response_sign_path(path, nonce),
                                      self_hotkey_ss58=self.hotkey, nonce_store=self._response_nonces,
                                      max_age=30.0, allowed_skew=10.0, now_ns=head_at_ns)
        except http_auth.AuthError as e:
            raise ProtocolError(Outcome.BAD_SIGNATURE, f"response signature: {e}") from None
        if caller.hotkey_ss58 != receiver_hotkey:
            raise ProtocolError(Outcome.BAD_SIGNATURE, "response signed by another hotkey")
