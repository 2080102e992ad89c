"""A hostile relay against a relayed neuron's tunnel (iota_subnet/transport/relay.py, RelayTunnel): a
forwarded HEAD whose path is not an absolute path on the local server (``@host:port/x`` would turn the
replay URL ``http://127.0.0.1:port@host:port/x`` into a request to another host, carrying the local
server's relay token) is refused with an ABORT and reaches no other host."""
from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web
from bittensor.sp_core import Keypair

from iota_subnet.transport.relay import ATTACH_PATH, RelayTunnel
from iota_subnet.transport.relay_frames import ABORT, END, HEAD, head_frame, pack_frame, unpack_frame

pytestmark = pytest.mark.timeout(30)


async def _site(app: web.Application) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]


@pytest.mark.parametrize("path", ["@127.0.0.1:{evil}/x", ":{evil}@127.0.0.1:{evil}/x", "x", None, 7])
def test_a_relay_cannot_point_the_replay_at_another_host(path):
    async def main():
        hits: list[str] = []
        frames: list[tuple[int, int]] = []

        async def evil(request):
            hits.append(request.path)
            return web.Response(text="leaked")
        evil_app = web.Application()
        evil_app.router.add_route("*", "/{tail:.*}", evil)
        evil_runner, evil_port = await _site(evil_app)
        local_app = web.Application()
        local_app.router.add_route("*", "/{tail:.*}", lambda _r: web.Response(text="ok"))   # the neuron's own
        local_runner, local_port = await _site(local_app)

        async def attach(request):
            ws = web.WebSocketResponse()
            await ws.prepare(request)
            p = path.format(evil=evil_port) if isinstance(path, str) else path
            await ws.send_bytes(head_frame(1, {"method": "GET", "path": p, "headers": {}, "length": 0}))
            await ws.send_bytes(pack_frame(END, 1))
            async for msg in ws:
                kind, rid, _ = unpack_frame(msg.data)
                frames.append((kind, rid))
                if kind in (ABORT, END):
                    break
            return ws
        relay_app = web.Application()
        relay_app.router.add_get(ATTACH_PATH, attach)
        relay_runner, relay_port = await _site(relay_app)
        stop = asyncio.Event()
        tunnel = RelayTunnel(Keypair.create_from_uri("//hostile-home"),
                             [(f"127.0.0.1:{relay_port}", Keypair.create_from_uri("//hostile-relay").ss58_address)],
                             f"127.0.0.1:{local_port}", local_token="secret", backoff_s=(5.0, 5.0))
        task = asyncio.create_task(tunnel.run(stop))
        try:
            for _ in range(200):
                if any(k in (ABORT, END) for k, _ in frames):
                    break
                await asyncio.sleep(0.02)
        finally:
            stop.set()
            await asyncio.wait_for(task, 10)
            for r in (relay_runner, local_runner, evil_runner):
                await r.cleanup()
        return hits, frames
    hits, frames = asyncio.run(main())
    assert hits == []
    assert (ABORT, 1) in frames and (HEAD, 1) not in frames
