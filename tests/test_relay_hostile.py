"""A hostile relay against a relayed neuron's tunnel (iota_subnet/transport/relay.py, RelayTunnel): a
forwarded HEAD whose path is not an absolute path on the local server (``@host:port/x`` would turn the
replay URL ``http://127.0.0.1:port@host:port/x`` into a request to another host, carrying the local
server's relay token) is refused with an ABORT and reaches no other host; a HEAD whose headers are not
an object is still replayed (without them) and answered. And a hostile home against a real RelayHost
(iota_subnet/transport/relay.py): an answer HEAD that is no HTTP response head (headers not an object,
values not strings, status not an int) aborts that transfer only: the caller's connection is dropped
(the relay's usual 502), ``bad_frames`` counts it, and the next transfer on the socket is answered."""
from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web
from bittensor import http_auth
from bittensor.sp_core import Keypair

from iota_subnet.transport import NeuronServer
from iota_subnet.transport.relay import ATTACH_PATH, RelayHost, RelayTunnel
from iota_subnet.transport.relay_frames import ABORT, END, HEAD, head_frame, pack_frame, unpack_frame
from support.sites import serve_get, start_site

pytestmark = pytest.mark.timeout(30)


async def _tunnel_against(attach, local_port: int, done, **tunnel_kw) -> RelayTunnel:
    """Run a real RelayTunnel against a fake relay whose attach handler is ``attach`` until ``done()``
    (polled every 20 ms, at most 5 s); returns the tunnel (its counts)."""
    relay_runner, relay_port = await serve_get(ATTACH_PATH, attach)
    stop = asyncio.Event()
    tunnel = RelayTunnel(Keypair.create_from_uri("//hostile-home"),
                         [(f"127.0.0.1:{relay_port}", Keypair.create_from_uri("//hostile-relay").ss58_address)],
                         f"127.0.0.1:{local_port}", backoff_s=(5.0, 5.0), **tunnel_kw)
    task = asyncio.create_task(tunnel.run(stop))
    try:
        for _ in range(250):
            if done():
                break
            await asyncio.sleep(0.02)
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        await relay_runner.cleanup()
    return tunnel


async def _hostile_head(head: dict) -> tuple[list[str], list[tuple[int, int]]]:
    """A fake relay sends ``head`` (``{evil}`` in its path: another server's port) and END as transfer 1
    to a real RelayTunnel; returns the paths the other server served and the frames the tunnel sent back."""
    hits: list[str] = []
    frames: list[tuple[int, int]] = []

    async def evil(request):
        hits.append(request.path)
        return web.Response(text="leaked")
    evil_app = web.Application()
    evil_app.router.add_route("*", "/{tail:.*}", evil)
    evil_runner, evil_port = await start_site(evil_app)
    local_app = web.Application()                                     # the relayed neuron's own server
    local_app.router.add_route("*", "/{tail:.*}", lambda _r: web.Response(text="ok"))
    local_runner, local_port = await start_site(local_app)

    async def attach(request):
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        p = head["path"]
        await ws.send_bytes(head_frame(1, {**head, "path": p.format(evil=evil_port) if isinstance(p, str) else p}))
        await ws.send_bytes(pack_frame(END, 1))
        async for msg in ws:
            kind, rid, _ = unpack_frame(msg.data)
            frames.append((kind, rid))
            if kind in (ABORT, END):
                break
        return ws
    try:
        await _tunnel_against(attach, local_port, lambda: any(k in (ABORT, END) for k, _ in frames),
                              local_token="secret")
    finally:
        for r in (local_runner, evil_runner):
            await r.cleanup()
    return hits, frames


@pytest.mark.parametrize("path", ["@127.0.0.1:{evil}/x", ":{evil}@127.0.0.1:{evil}/x", "x", None, 7])
def test_a_relay_cannot_point_the_replay_at_another_host(path):
    hits, frames = asyncio.run(_hostile_head({"method": "GET", "path": path, "headers": {}, "length": 0}))
    assert hits == []
    assert (ABORT, 1) in frames and (HEAD, 1) not in frames


def test_a_head_whose_headers_are_not_an_object_is_still_answered():
    hits, frames = asyncio.run(_hostile_head({"method": "GET", "path": "/x", "headers": ["junk"], "length": 0}))
    assert hits == [] and (HEAD, 1) in frames and (END, 1) in frames


def test_heads_without_bodies_are_bounded_in_number_and_time():
    """Five heads whose bodies never come (length 10, no DATA, no END) to a tunnel that runs at most 2
    transfers and waits 0.5 s for a frame: heads 3-5 are aborted at once, heads 1-2 once idle."""
    async def main():
        frames: list[tuple[int, int, float]] = []
        local_app = web.Application()
        local_app.router.add_route("*", "/{tail:.*}", lambda _r: web.Response(text="ok"))
        local_runner, local_port = await start_site(local_app)

        async def attach(request):
            ws = web.WebSocketResponse()
            await ws.prepare(request)
            for rid in range(1, 6):
                await ws.send_bytes(head_frame(rid, {"method": "POST", "path": "/x", "headers": {}, "length": 10}))
            t0 = asyncio.get_running_loop().time()
            async for msg in ws:
                kind, rid, _ = unpack_frame(msg.data)
                frames.append((kind, rid, asyncio.get_running_loop().time() - t0))
                if sum(k == ABORT for k, _, _ in frames) == 5:
                    break
            return ws
        try:
            tunnel = await _tunnel_against(attach, local_port, lambda: sum(k == ABORT for k, _, _ in frames) == 5,
                                           idle_s=0.5, max_transfers=2)
        finally:
            await local_runner.cleanup()
        aborts = {rid: t for k, rid, t in frames if k == ABORT}
        assert sorted(aborts) == [1, 2, 3, 4, 5], frames
        assert all(aborts[r] < 0.4 for r in (3, 4, 5)), aborts          # refused at once
        assert all(0.4 <= aborts[r] < 5.0 for r in (1, 2)), aborts      # aborted once idle
        assert tunnel.counts["bad_frames"] == 3
    asyncio.run(main())


async def _home_answering(bad: dict) -> tuple[list[object], list[tuple[int, int]], dict]:
    """A fake home attached to a real RelayHost (on a NeuronServer) answers its first forwarded transfer
    with the HEAD ``bad`` and its second with a well-formed 418; returns what a caller saw for the two
    (status or exception type), the frames the home got back after its answers, and the relay's counts."""
    home, relay_key = Keypair.create_from_uri("//hostile-home-2"), Keypair.create_from_uri("//hostile-relay-2")
    server = NeuronServer(relay_key, "127.0.0.1", 0, None, None)
    relay = RelayHost(relay_key)
    relay.mount(server)
    await server.start()
    after: list[tuple[int, int]] = []
    answered: list[int] = []

    async def fake_home(ws):
        async for msg in ws:
            kind, rid, _ = unpack_frame(msg.data)
            if answered:
                after.append((kind, rid))
            if kind == END and rid not in answered:
                await ws.send_bytes(head_frame(rid, bad if not answered else
                                               {"status": 418, "headers": {"X-Teapot": "yes"}, "length": 0}))
                await ws.send_bytes(pack_frame(END, rid))
                answered.append(rid)
    seen: list[object] = []
    try:
        async with aiohttp.ClientSession() as session:
            headers = http_auth.sign(home, method="GET", path=ATTACH_PATH, receiver_ss58=relay_key.ss58_address)
            async with session.ws_connect(f"http://{server.endpoint}{ATTACH_PATH}", headers=headers) as ws:
                homing = asyncio.create_task(fake_home(ws))
                for _ in range(100):
                    if relay.attached:
                        break
                    await asyncio.sleep(0.02)
                for _ in range(2):
                    signed = http_auth.sign(Keypair.create_from_uri("//hostile-caller"), method="POST", path="/hop",
                                            body=b"x", receiver_ss58=home.ss58_address)
                    try:
                        async with session.post(f"http://{server.endpoint}/hop", data=b"x", headers=signed,
                                                timeout=aiohttp.ClientTimeout(total=5)) as resp:
                            seen.append(resp.status)
                    except aiohttp.ClientError as e:
                        seen.append(type(e))
                await asyncio.sleep(0.1)
                homing.cancel()
    finally:
        await server.stop()
    return seen, after, dict(relay.counts)


@pytest.mark.parametrize("bad", [
    {"status": 200, "headers": ["junk"], "length": 0},
    {"status": 200, "headers": {"X-A": 7}, "length": 0},
    {"status": "200", "headers": {}, "length": 0},
    {"status": 200, "headers": {"X-A": "a\r\nSet-Cookie: x"}, "length": 0},
    {"status": 200, "headers": {}, "length": "12"},
])
def test_a_home_answering_with_a_malformed_head_has_that_transfer_dropped(bad):
    seen, after, counts = asyncio.run(_home_answering(bad))
    assert seen[0] is not None and not isinstance(seen[0], int), seen       # dropped, no 500 from a traceback
    assert seen[1] == 418, seen                                             # the socket still serves
    assert counts.get("bad_frames") == 1 and counts.get("dropped_bad_head") == 1, counts
    assert counts.get("forwarded") == 1, counts
    assert (ABORT, 1) in after, after                                       # the home was told
