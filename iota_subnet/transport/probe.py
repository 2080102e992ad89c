"""Peer probes (used by ``iota-subnet doctor``): two unauthenticated GET routes every neuron serves, and
their clients.

* ``GET /ops/reach?port=P``: the serving neuron opens a TCP connection back to the *caller's*
  address (as it sees it) on port ``P`` and answers ``{"reachable": bool, "address": "ip:port",
  "error": ...}``. Only the caller's own address is ever dialled (no scanning of third parties), at
  most once per ``min_interval_s`` per caller address.
* ``GET /ops/bandwidth?bytes=N``: ``N`` bytes (at most :data:`MAX_BANDWIDTH_BYTES`) of random data,
  to time a download; also at most once per ``min_interval_s`` per caller.

Refusals are 400 (bad parameter) or 429 (too soon) with a JSON ``{"error": ...}`` body.
"""
from __future__ import annotations

import asyncio
import os
import time
from typing import Optional

import aiohttp
from aiohttp import web

MAX_BANDWIDTH_BYTES = 8 << 20


class PeerProbe:
    """The server side: ``handlers()`` gives ``{path: handler}`` for ``NeuronServer.add_public_get``
    or ``app.router.add_get``."""

    def __init__(self, min_interval_s: float = 2.0, connect_timeout_s: float = 3.0):
        self.min_interval_s = min_interval_s
        self.connect_timeout_s = connect_timeout_s
        self._last: dict[tuple[str, str], float] = {}
        self._payload = os.urandom(MAX_BANDWIDTH_BYTES)

    def handlers(self) -> dict:
        return {"/ops/reach": self.reach, "/ops/bandwidth": self.bandwidth}

    def _too_soon(self, kind: str, remote: Optional[str]) -> bool:
        now = time.monotonic()
        key = (kind, remote or "?")
        if now - self._last.get(key, -1e9) < self.min_interval_s:
            return True
        self._last[key] = now
        if len(self._last) > 4096:
            self._last = {k: t for k, t in self._last.items() if now - t < self.min_interval_s}
        return False

    async def reach(self, request: web.Request) -> web.Response:
        try:
            port = int(request.query.get("port", ""))
            if not 1 <= port <= 65535:
                raise ValueError
        except ValueError:
            return web.json_response({"error": "port must be 1-65535"}, status=400)
        if self._too_soon("reach", request.remote):
            return web.json_response({"error": f"at most one probe per {self.min_interval_s:.0f} s"}, status=429)
        host = request.remote or ""
        addr = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            _, w = await asyncio.wait_for(asyncio.open_connection(host, port), timeout=self.connect_timeout_s)
            w.close()
            return web.json_response({"reachable": True, "address": addr})
        except (OSError, asyncio.TimeoutError) as e:
            return web.json_response({"reachable": False, "address": addr,
                                      "error": "timed out" if isinstance(e, asyncio.TimeoutError) else str(e)})

    async def bandwidth(self, request: web.Request) -> web.Response:
        try:
            n = int(request.query.get("bytes", str(1 << 20)))
            if not 1 <= n <= MAX_BANDWIDTH_BYTES:
                raise ValueError
        except ValueError:
            return web.json_response({"error": f"bytes must be 1-{MAX_BANDWIDTH_BYTES}"}, status=400)
        if self._too_soon("bandwidth", request.remote):
            return web.json_response({"error": f"at most one download per {self.min_interval_s:.0f} s"}, status=429)
        return web.Response(body=self._payload[:n], content_type="application/octet-stream")


async def ask_reach(peer: str, port: int, timeout_s: float = 10.0) -> dict:
    """Ask ``peer`` (``host:port``) to dial us back on ``port``. Raises aiohttp / timeout errors."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as s:
        async with s.get(f"http://{peer}/ops/reach", params={"port": str(port)}) as r:
            body = await r.json(content_type=None)
            if r.status != 200:
                raise RuntimeError(f"{peer} refused: HTTP {r.status} {body.get('error', '')}")
            return body


async def measure_bandwidth(peer: str, nbytes: int = 4 << 20, timeout_s: float = 60.0) -> dict:
    """Round-trip time (``/ops/reach`` is not used: a 1-byte download) and download throughput
    from ``peer``: ``{"rtt_ms", "bytes", "seconds", "mbit_s"}``."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as s:
        t0 = time.perf_counter()
        async with s.get(f"http://{peer}/metrics") as r:
            await r.read()
        rtt = time.perf_counter() - t0
        t0 = time.perf_counter()
        async with s.get(f"http://{peer}/ops/bandwidth", params={"bytes": str(nbytes)}) as r:
            if r.status != 200:
                raise RuntimeError(f"{peer} refused: HTTP {r.status}")
            n = 0
            async for chunk in r.content.iter_chunked(1 << 16):
                n += len(chunk)
        dt = max(1e-6, time.perf_counter() - t0)
    return {"rtt_ms": rtt * 1e3, "bytes": n, "seconds": dt, "mbit_s": n * 8 / dt / 1e6}
