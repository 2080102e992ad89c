"""Bodies sent in pieces, so the receiving end sees bytes arrive while a large message is on the wire.

A merge chunk of 4M values is 4-16 MB: 40-160 s on a 0.8 Mbit/s uplink. Sent as one block (through
the emulated uplink: the whole transfer time first, then the bytes at once), the receiver sees no
byte until the end, and a timeout that watches for progress (:mod:`iota_subnet.merge.deadlines`)
cannot tell a slow link from a stalled peer. :func:`body_pieces` yields a body in pieces of
:data:`PIECE_BYTES` as the link releases them: the emulated uplink's token bucket
(:meth:`~iota_subnet.transport.shaping.UplinkShaper.transmit` with its byte callback), or at once
on a real socket, where aiohttp's writer waits for the socket to drain after each piece. Either way
``on_progress(n)`` is called after each piece of ``n`` body bytes has been handed on, and the peer
reading the body sees it arrive piece by piece, as TCP delivers it.
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable, Optional

from .shaping import UplinkShaper

#: bytes per piece: 64 KiB (0.66 s at 0.8 Mbit/s, 5 ms at 100 Mbit/s)
PIECE_BYTES = 64 << 10


async def body_pieces(body: bytes, shaper: Optional[UplinkShaper] = None, head_bytes: int = 0,
                      on_progress: Optional[Callable[[int], None]] = None,
                      piece_bytes: int = PIECE_BYTES) -> AsyncIterator[bytes]:
    """Yield ``body`` in pieces of at most ``piece_bytes``; with ``shaper``, the bytes the emulated
    uplink has released so far, as it releases them (the HTTP head, ``head_bytes``, goes first; the
    one-way delay is waited after the last piece), so several transfers sharing one uplink each
    show progress every few release chunks. Raises :class:`~iota_subnet.transport.shaping.LinkDown` when
    the emulated link is partitioned."""
    view = memoryview(body)
    n = len(body)
    if shaper is None:
        for off in range(0, n, piece_bytes):
            yield bytes(view[off:off + piece_bytes])
            if on_progress is not None:
                on_progress(min(piece_bytes, n - off))
        return
    total = head_bytes + n
    wire_total = max(1, shaper.wire_size(total))
    released = 0
    more = asyncio.Event()

    def on_bytes(k: int) -> None:
        nonlocal released
        released += k
        more.set()

    sending = asyncio.ensure_future(shaper.transmit(total, on_bytes))
    sent = 0
    try:
        while sent < n:
            avail = min(n, released * total // wire_total - head_bytes)
            if sending.done():
                sending.result()             # raises LinkDown; else every byte has been released
                avail = n
            if avail > sent:                # what the link released so far (its release chunk: 16 KiB or 5 ms)
                k = min(piece_bytes, avail - sent)
                yield bytes(view[sent:sent + k])
                sent += k
                if on_progress is not None:
                    on_progress(k)
                continue
            more.clear()
            waiter = asyncio.ensure_future(more.wait())
            try:
                await asyncio.wait([sending, waiter], return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiter.cancel()
        await sending                       # the one-way delay of the last byte
    finally:
        if not sending.done():
            sending.cancel()
