"""``iota-subnet doctor``'s reachability verdict against a real peer probe on loopback: "reachable
directly" when the peer's dial-back connects, "relay only" (with both fixes: forward the port, or
--relay auto) when it does not. Bound to 127.0.0.2, the neuron's port is not where the peer dials
back (127.0.0.1, the address it sees), as a port behind a NAT is not."""
from __future__ import annotations

import asyncio
import socket

import pytest
from aiohttp import web

from iota_subnet.doctor.checks import FAIL, PASS, DoctorOptions, peer_checks
from iota_subnet.transport.probe import PeerProbe

pytestmark = pytest.mark.timeout(60)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


async def _verdict(host: str) -> dict:
    app = web.Application()
    for path, handler in PeerProbe(min_interval_s=0.0).handlers().items():
        app.router.add_get(path, handler)
    app.router.add_get("/metrics", lambda _r: web.Response(text=""))
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    peer = f"127.0.0.1:{runner.addresses[0][1]}"
    try:
        checks = await peer_checks(DoctorOptions(host=host, port=_free_port(host), peers=[peer],
                                                 bandwidth_bytes=1 << 16), [])
    finally:
        await runner.cleanup()
    return {c.name: c for c in checks}


def test_reachable_directly_and_relay_only():
    direct = asyncio.run(_verdict("127.0.0.1"))["reachability"]
    assert direct.status == PASS and direct.detail.startswith("reachable directly")
    try:
        behind = asyncio.run(_verdict("127.0.0.2"))["reachability"]
    except OSError as e:                      # no 127.0.0.2 on this machine's loopback
        pytest.skip(f"cannot bind 127.0.0.2: {e}")
    assert behind.status == FAIL and behind.detail.startswith("relay only")
    assert "--relay auto" in behind.fix and "forward TCP port" in behind.fix
