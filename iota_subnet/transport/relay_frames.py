"""The relay tunnel's wire: bodies of any size in fixed-size frames, several transfers interleaved on one
WebSocket, each with its own flow-control window (as HTTP/2 streams, RFC 9113 section 5.2).

A frame is one binary WebSocket message: a 1-byte kind, a 4-byte big-endian transfer id, a payload.

* ``HEAD``: the transfer's JSON header (a request: ``method``, ``path``, ``headers``, ``length`` (the
  declared body length, or null), ``remote`` (the caller's address as the relay saw it); a response:
  ``status``, ``headers``, ``length``); always the transfer's first frame in its direction;
* ``DATA``: at most ``frame_bytes`` (<= :data:`MAX_FRAME_BYTES`) bytes of the body;
* ``END``: the body is complete;
* ``ABORT``: the transfer is cancelled (payload: the reason, UTF-8); the other end stops sending and
  fails what it is reading;
* ``CREDIT``: the receiver consumed this many more bytes (payload: 4-byte big-endian count).

Flow control: a sender has at most :data:`WINDOW_BYTES` of a transfer's body sent and not yet credited;
the receiver credits bytes once its consumer has taken them (in batches of a quarter window), so a
slow reader holds at most one window of one transfer in memory and never stalls the other transfers
on the socket. A peer that sends past the window has the transfer aborted.
"""
from __future__ import annotations

import asyncio
import json
import struct
from typing import Any, AsyncIterable, AsyncIterator, Awaitable, Callable, Optional

HEAD, DATA, END, ABORT, CREDIT = 1, 2, 3, 4, 5
KINDS = (HEAD, DATA, END, ABORT, CREDIT)
#: the largest DATA payload a peer may send (the socket's ``max_msg_size`` allows it plus a header)
MAX_FRAME_BYTES = 1 << 20
#: the default DATA payload: 256 KiB
FRAME_BYTES = 256 << 10
#: bytes of one transfer's body a sender may have in flight before the receiver credits them
WINDOW_BYTES = 4 << 20
#: ``max_msg_size`` of a tunnel socket: a full frame plus a HEAD's headers
MAX_MSG_BYTES = MAX_FRAME_BYTES + (64 << 10)
_PREFIX = struct.Struct(">BI")


def pack_frame(kind: int, rid: int, payload: bytes = b"") -> bytes:
    """One frame (module docstring)."""
    return _PREFIX.pack(kind, rid) + payload


def unpack_frame(data: bytes) -> tuple[int, int, bytes]:
    """(kind, transfer id, payload); raises ``ValueError`` on a frame too short or of unknown kind."""
    if len(data) < _PREFIX.size:
        raise ValueError("frame shorter than its prefix")
    kind, rid = _PREFIX.unpack_from(data)
    if kind not in KINDS:
        raise ValueError(f"unknown frame kind {kind}")
    return kind, rid, bytes(data[_PREFIX.size:])


def head_frame(rid: int, header: dict) -> bytes:
    return pack_frame(HEAD, rid, json.dumps(header, separators=(",", ":")).encode())


def parse_head(payload: bytes) -> dict:
    """A HEAD's header; raises ``ValueError`` unless it is a JSON object."""
    header = json.loads(payload)
    if not isinstance(header, dict):
        raise ValueError("frame header is not an object")
    return header


async def chunks_of(data: bytes) -> AsyncIterator[bytes]:
    """``data`` as a one-chunk body (an empty body yields nothing)."""
    if data:
        yield data


class BodyIn:
    """A body arriving in frames: what the other end sent and this end's consumer has not taken yet
    (at most one window). Iterate :meth:`chunks`; it raises ``ConnectionResetError`` when the transfer
    is aborted or the socket closes, ``asyncio.TimeoutError`` after ``idle_s`` without a frame."""

    def __init__(self, link: "FrameLink", rid: int, idle_s: Optional[float] = None):
        self.link, self.rid, self.idle_s = link, rid, idle_s
        self.queue: asyncio.Queue = asyncio.Queue()       # bytes | None (the end) | an exception
        self.buffered = 0
        self.received = 0
        self.ungranted = 0
        self.done = False

    def feed(self, data: bytes) -> bool:
        """Queue a DATA payload; False when the sender overran the window (the caller aborts)."""
        self.buffered += len(data)
        self.received += len(data)
        if self.buffered > WINDOW_BYTES + MAX_FRAME_BYTES:
            return False
        self.queue.put_nowait(data)
        return True

    def end(self) -> None:
        self.queue.put_nowait(None)

    def fail(self, exc: BaseException) -> None:
        self.queue.put_nowait(exc)

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body's pieces as they arrive; each taken piece is credited back to the sender."""
        while True:
            if self.ungranted >= WINDOW_BYTES // 4 or (self.ungranted and self.queue.empty()):
                n, self.ungranted = self.ungranted, 0
                await self.link.grant(self.rid, n)
            item = await asyncio.wait_for(self.queue.get(), self.idle_s)
            if item is None:
                self.done = True
                return
            if isinstance(item, BaseException):
                raise item
            self.buffered -= len(item)
            yield item
            self.ungranted += len(item)


class _Credit:
    """A sender's window for one transfer."""

    def __init__(self) -> None:
        self.avail = WINDOW_BYTES
        self.more = asyncio.Event()
        self.failed: Optional[BaseException] = None

    def add(self, n: int) -> None:
        self.avail += n
        self.more.set()

    def fail(self, exc: BaseException) -> None:
        self.failed = exc
        self.more.set()

    async def take(self, n: int, idle_s: Optional[float]) -> None:
        while self.avail < n:
            if self.failed is not None:
                raise self.failed
            self.more.clear()
            await asyncio.wait_for(self.more.wait(), idle_s)
        if self.failed is not None:
            raise self.failed
        self.avail -= n


class FrameLink:
    """One tunnel socket, either end (module docstring): sends frames one at a time (so transfers
    interleave frame by frame), keeps the bodies arriving (:class:`BodyIn`) and the windows of the
    bodies being sent. ``ws``: an aiohttp WebSocket (client or server side)."""

    def __init__(self, ws: Any, frame_bytes: int = FRAME_BYTES, idle_s: Optional[float] = None):
        if not 0 < int(frame_bytes) <= MAX_FRAME_BYTES:
            raise ValueError(f"frame_bytes {frame_bytes} must be in 1..{MAX_FRAME_BYTES}")
        self.ws = ws
        self.frame_bytes = int(frame_bytes)
        self.idle_s = idle_s
        self.lock = asyncio.Lock()
        self.inbound: dict[int, BodyIn] = {}
        self.outbound: dict[int, _Credit] = {}
        #: DATA frames and their payload bytes sent / received on this socket
        self.frames_sent = 0
        self.frames_received = 0

    async def send(self, kind: int, rid: int, payload: bytes = b"") -> None:
        async with self.lock:
            await self.ws.send_bytes(pack_frame(kind, rid, payload))

    async def send_head(self, rid: int, header: dict) -> None:
        async with self.lock:
            await self.ws.send_bytes(head_frame(rid, header))

    async def grant(self, rid: int, n: int) -> None:
        if rid in self.inbound and not self.ws.closed:
            await self.send(CREDIT, rid, struct.pack(">I", n))

    def open_in(self, rid: int) -> BodyIn:
        body = self.inbound[rid] = BodyIn(self, rid, self.idle_s)
        return body

    def open_out(self, rid: int) -> None:
        self.outbound[rid] = _Credit()

    def close_transfer(self, rid: int) -> None:
        self.inbound.pop(rid, None)
        self.outbound.pop(rid, None)

    async def abort(self, rid: int, why: str) -> None:
        """Cancel transfer ``rid`` here and tell the other end (if the socket is still open)."""
        self.fail_transfer(rid, ConnectionResetError(why))
        self.close_transfer(rid)
        if not self.ws.closed:
            try:
                await self.send(ABORT, rid, why.encode()[:200])
            except (ConnectionError, RuntimeError):
                pass

    def fail_transfer(self, rid: int, exc: BaseException) -> None:
        if rid in self.inbound:
            self.inbound[rid].fail(exc)
        if rid in self.outbound:
            self.outbound[rid].fail(exc)

    def fail_all(self, exc: BaseException) -> None:
        for rid in list(self.inbound) + list(self.outbound):
            self.fail_transfer(rid, exc)

    async def send_body(self, rid: int, chunks: AsyncIterable[bytes],
                        on_frame: Optional[Callable[[int], Awaitable[None]]] = None) -> int:
        """Send ``chunks`` as DATA frames of at most ``frame_bytes``, each once the window allows it and
        ``on_frame(n)`` (a bandwidth cap, an emulated link) has returned, then END. Returns the body's
        bytes. Raises ``ConnectionResetError`` when the transfer is aborted, ``asyncio.TimeoutError``
        when the window stays shut for ``idle_s``."""
        credit = self.outbound[rid]
        total, fb = 0, self.frame_bytes
        async for chunk in chunks:
            view = memoryview(chunk)
            for off in range(0, len(chunk), fb):
                piece = bytes(view[off:off + fb])
                await credit.take(len(piece), self.idle_s)
                if on_frame is not None:
                    await on_frame(len(piece))
                await self.send(DATA, rid, piece)
                self.frames_sent += 1
                total += len(piece)
        await self.send(END, rid)
        return total

    def dispatch(self, kind: int, rid: int, payload: bytes) -> Optional[str]:
        """Handle a DATA, END, ABORT or CREDIT frame; returns a reason to abort ``rid`` (a window
        overrun, a malformed credit) or None. Frames of transfers no longer open are ignored."""
        if kind == DATA:
            body = self.inbound.get(rid)
            if body is not None:
                self.frames_received += 1
                if not body.feed(payload):
                    return "the sender overran its window"
        elif kind == END:
            body = self.inbound.get(rid)
            if body is not None:
                body.end()
        elif kind == ABORT:
            self.fail_transfer(rid, ConnectionResetError(f"transfer aborted by the other end: "
                                                         f"{payload.decode(errors='replace')}"))
        elif kind == CREDIT:
            if len(payload) != 4:
                return "malformed credit"
            credit = self.outbound.get(rid)
            if credit is not None:
                credit.add(struct.unpack(">I", payload)[0])
        return None
