"""Transport faults found when driven as an operator.

A real NeuronServer on 127.0.0.1; requests are written byte by byte on a raw socket where the
test needs to control when the body arrives.
"""
from __future__ import annotations

import asyncio
import json
import sqlite3
import time

import pytest
from bittensor import http_auth

from iota_subnet.protocol import Health, Hop, Outcome, encode
from iota_subnet.transport import NeuronClient, NeuronServer, SqliteNonceStore
from iota_subnet.utils.sqlite_file import CorruptStateError
from support.transport import Node, good, signed, wallets  # noqa: F401 (fixture)

pytestmark = pytest.mark.timeout(60)


def run(coro):
    return asyncio.run(coro)


async def _open(node: Node, path: str, headers: dict, length: int):
    """Send the request line and headers of a POST with ``Content-Length: length``; no body yet."""
    host, port = node.server.endpoint.split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}", f"Content-Length: {length}",
             "Content-Type: application/octet-stream", *[f"{k}: {v}" for k, v in headers.items()], "", ""]
    writer.write("\r\n".join(lines).encode())
    await writer.drain()
    return reader, writer


async def _response(reader: asyncio.StreamReader, timeout: float) -> tuple[int, dict]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
    status = int(head.split(b" ", 2)[1])
    length = next(int(l.split(b":", 1)[1]) for l in head.split(b"\r\n") if l.lower().startswith(b"content-length"))
    body = await asyncio.wait_for(reader.readexactly(length), timeout)
    return status, (json.loads(body) if status != 200 else {"bytes": len(body)})


def _hop_body() -> bytes:
    import torch
    return encode(Hop(data=torch.randn(4, 16, 8)))


def test_slow_upload_is_judged_fresh_when_it_started(wallets, tmp_path):
    """Item 10: a correctly signed body that trickles in for longer than the freshness window is
    accepted (freshness is judged when the headers arrived); a stale nonce and a clock ahead of ours
    are distinct refusals."""
    async def main():
        node = Node(wallets, tmp_path / "n.sqlite", max_age=2.0, allowed_skew=0.5)
        await node.server.start()
        try:
            body = _hop_body()
            assert len(body) > 2000
            headers = signed(wallets["client"], node, "/hop", body)
            reader, writer = await _open(node, "/hop", headers, len(body))
            t0 = time.monotonic()
            for i in range(0, len(body), 256):                  # ~3 s for the body: beyond max_age = 2 s
                writer.write(body[i:i + 256])
                await writer.drain()
                await asyncio.sleep(3.0 / (len(body) / 256))
            status, data = await _response(reader, 10)
            writer.close()
            assert time.monotonic() - t0 > 2.5
            assert status == 200, data
            assert node.received["hop"][0].data.shape == (4, 16, 8)

            stale = signed(wallets["client"], node, "/hop", body, nonce_ns=time.time_ns() - 3 * 10**9)
            reader, writer = await _open(node, "/hop", stale, len(body))
            status, data = await _response(reader, 5)          # refused before the body is sent
            writer.close()
            assert (status, data["outcome"]) == (401, Outcome.STALE_REQUEST.value)
            assert "sign again" in data["message"]
            ahead = signed(wallets["client"], node, "/hop", body, nonce_ns=time.time_ns() + 5 * 10**9)
            reader, writer = await _open(node, "/hop", ahead, len(body))
            status, data = await _response(reader, 5)
            writer.close()
            assert (status, data["outcome"]) == (401, Outcome.CLOCK_SKEW.value)
            assert "clock" in data["message"] and "ahead" in data["message"]
            async with NeuronClient(wallets["client"]) as c:
                await good(c, node)
        finally:
            await node.server.stop()
    run(main())


def test_caller_is_authorized_from_headers_before_the_body_is_read(wallets, tmp_path):
    """Item 11: an unregistered hotkey, or one without the right for the route, is refused as soon
    as its headers arrive (the server never waits for its body)."""
    async def main():
        node = Node(wallets, tmp_path / "n.sqlite")
        await node.server.start()
        try:
            length = 200_000                                     # within the limit, never sent
            for who, path, status, outcome in (("stranger", "/hop", 403, Outcome.UNREGISTERED_HOTKEY),
                                               ("limited", "/merge", 403, Outcome.FORBIDDEN)):
                headers = signed(wallets[who], node, path, b"\0" * length)
                reader, writer = await _open(node, path, headers, length)
                writer.write(b"\0" * 100)
                await writer.drain()
                got, data = await _response(reader, 3)          # the old server read the body first: timeout
                writer.close()
                assert (got, data["outcome"]) == (status, outcome.value), who
            assert node.server.bytes_received == 0
        finally:
            await node.server.stop()
    run(main())


def test_in_flight_requests_are_capped_per_caller(wallets, tmp_path):
    """Item 11: one hotkey cannot hold more than ``max_inflight_per_caller`` uploads open; others
    are still served, and the caller is served again once its uploads end."""
    async def main():
        node = Node(wallets, tmp_path / "n.sqlite", max_inflight_per_caller=2)
        await node.server.start()
        try:
            body = _hop_body()
            held = []
            for _ in range(2):
                h = signed(wallets["client"], node, "/hop", body)
                held.append((await _open(node, "/hop", h, len(body)), body))
            await asyncio.sleep(0.3)
            h = signed(wallets["client"], node, "/hop", body)
            reader, writer = await _open(node, "/hop", h, len(body))
            status, data = await _response(reader, 3)
            writer.close()
            assert (status, data["outcome"]) == (429, Outcome.TOO_MANY_REQUESTS.value)
            async with NeuronClient(wallets["limited"]) as other:     # another caller is not affected
                await other.call(node.server.endpoint, node.server.hotkey, "/health", Health(), Health)
            for (reader, writer), b in held:                           # the held uploads complete
                writer.write(b)
                await writer.drain()
                status, _ = await _response(reader, 5)
                writer.close()
                assert status == 200
            async with NeuronClient(wallets["client"]) as c:
                await good(c, node)
        finally:
            await node.server.stop()
    run(main())


def test_corrupt_nonce_store_is_refused_and_a_fresh_one_refuses_older_nonces(wallets, tmp_path):
    """Item 14: a corrupt nonces.sqlite gives a clear error naming the recovery (never a raw
    sqlite3 traceback) and is left untouched; a store created afresh refuses every request signed
    before it existed, so losing the old store lets no replay through."""
    path = tmp_path / "nonces.sqlite"
    junk = b"this is not an sqlite file" * 100
    path.write_bytes(junk)
    with pytest.raises(CorruptStateError) as e:
        SqliteNonceStore(path)
    assert str(path) in str(e.value) and "move it aside" in str(e.value)
    assert path.read_bytes() == junk
    # a real database with a damaged page
    damaged = tmp_path / "damaged.sqlite"
    s = SqliteNonceStore(damaged)
    for i in range(3000):
        s.check_and_store(f"hk{i}", time.time_ns())
    s.close()
    raw = bytearray(damaged.read_bytes())
    for off in range(4096 * 3, 4096 * 3 + 200):
        raw[off] ^= 0xFF
    damaged.write_bytes(bytes(raw))
    with pytest.raises(CorruptStateError):
        SqliteNonceStore(damaged)

    async def main():
        body = _hop_body()
        fresh_path = tmp_path / "fresh.sqlite"
        probe = NeuronServer(wallets["server"], "127.0.0.1", 0, None, None)      # only to sign for its hotkey
        signed_before = http_auth.sign(wallets["client"], method="POST", path="/hop", body=body,
                                       receiver_ss58=probe.hotkey)
        await asyncio.sleep(0.05)
        node = Node(wallets, fresh_path)
        await node.server.start()
        try:
            reader, writer = await _open(node, "/hop", signed_before, len(body))
            status, data = await _response(reader, 5)
            writer.close()
            assert (status, data["outcome"]) == (401, Outcome.REPLAYED_NONCE.value)
            async with NeuronClient(wallets["client"]) as c:
                await good(c, node)
        finally:
            await node.server.stop()
    run(main())
    db = sqlite3.connect(tmp_path / "fresh.sqlite")
    assert db.execute("SELECT value FROM meta WHERE key='created_ns'").fetchone()
    db.close()
