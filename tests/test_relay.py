"""Relays (iota_subnet/transport/relay.py): real NeuronServers on 127.0.0.1, real btauth/1 signing.

A "home" neuron serves on loopback only and is reached through a relay it attached to over an
outbound WebSocket; the caller signs for the home hotkey and dials the relay's address. Faulty
relays are subclasses of RelayHost over its public ``send``."""
from __future__ import annotations

import asyncio
import random
import time

import aiohttp
import pytest
import torch
from bittensor import http_auth
from bittensor.sp_core import Keypair

from iota_subnet.miner.merging import progress_credited
from iota_subnet.protocol import Hop, Outcome, ProtocolError, encode
from iota_subnet.transport import NeuronClient, NeuronServer, TransportError
from iota_subnet.sim.relay_faults import AlteringRelay, DroppingRelay, ReplayingRelay
from iota_subnet.transport.relay import RelayHost, RelayTunnel, TokenBucket
from iota_subnet.transport.server import HEADER_RELAY_HOTKEY, HEADER_RELAY_REMOTE, HEADER_RELAY_TOKEN
from iota_subnet.transport.shaping import DownlinkShaper, LinkSpec, UplinkShaper
from iota_subnet.transport.relay_frames import DATA, HEAD, head_frame, pack_frame, parse_head, unpack_frame

pytestmark = pytest.mark.timeout(60)


def kp(name: str) -> Keypair:
    return Keypair.create_from_uri(f"//relay-test-{name}")


class Home:
    """A neuron on loopback with one route, ``/hop``, that echoes and counts what it handled."""

    def __init__(self, **server_kw):
        self.key = kp("home")
        self.handled: list[str] = []
        self.got: dict[str, torch.Tensor] = {}
        self.via: list = []
        self.pieces: list[tuple[str, str, int, int]] = []     # on_body_bytes: (hotkey, remote, n, handled so far)
        self.server = NeuronServer(self.key, "127.0.0.1", 0, None, None, **server_kw)
        self.server.add_route("/hop", self.hop, Hop)
        self.server.add_route("/big", self.hop, Hop, max_body_bytes=8 << 20,
                              on_body_bytes=lambda hk, ip, n: self.pieces.append((hk, ip, n, len(self.handled))))
        self.server.add_route("/small", self.hop, Hop, max_body_bytes=1 << 20)

    async def hop(self, msg: Hop, ctx) -> Hop:
        self.handled.append(msg.microbatch_id)
        self.got[msg.microbatch_id] = msg.data
        self.via.append((ctx.remote, ctx.via_relay))
        return Hop(microbatch_id=msg.microbatch_id, data=msg.data * 2, info={"caller": ctx.caller_hotkey})


class Net:
    """A relay (``relay_cls``), a home neuron attached to it, a caller."""

    def __init__(self, relay_cls=RelayHost, home_kw=None, relay_server_kw=None, tunnel_kw=None, **relay_kw):
        self.home = Home(**(home_kw or {}))
        self.tunnel_kw = tunnel_kw or {}
        self.relay_key = kp("relay")
        self.relay_server = NeuronServer(self.relay_key, "127.0.0.1", 0, None, None, **(relay_server_kw or {}))
        self.relay = relay_cls(self.relay_key, **relay_kw)
        self.relay.mount(self.relay_server)
        self.caller = NeuronClient(kp("caller"))
        self.stop = asyncio.Event()
        self.tunnel = None
        self.task = None

    async def __aenter__(self):
        await self.home.server.start()
        await self.relay_server.start()
        self.tunnel = RelayTunnel(self.home.key, [(self.relay_server.endpoint, self.relay_key.ss58_address)],
                                  self.home.server.endpoint, **self.tunnel_kw)
        self.task = asyncio.create_task(self.tunnel.run(self.stop))
        await asyncio.wait_for(self.tunnel.attached.wait(), 10)
        for _ in range(100):                      # the relay registers the socket once it is prepared
            if self.relay.attached:
                break
            await asyncio.sleep(0.02)
        return self

    async def __aexit__(self, *exc):
        self.stop.set()
        await asyncio.wait_for(self.task, 10)
        await self.caller.close()
        await self.relay_server.stop()
        await self.home.server.stop()

    async def call(self, mb: str, data: torch.Tensor, timeout_s: float = 10.0, path: str = "/hop") -> Hop:
        return await self.caller.call(self.relay_server.endpoint, self.home.key.ss58_address, path,
                                      Hop(microbatch_id=mb, data=data), Hop, timeout_s=timeout_s, retries=0)


def run(coro):
    return asyncio.run(coro)


def test_a_home_neuron_is_reached_through_the_relay_end_to_end_signed():
    async def main():
        async with Net() as net:
            x = torch.randn(2, 4, 8)
            got = await net.call("mb-1", x)
            assert torch.equal(got.data, x * 2) and got.microbatch_id == "mb-1"
            assert got.info == {"caller": net.caller.hotkey}      # the home saw the caller's own signature
            assert net.home.handled == ["mb-1"]
            st = net.relay.status()
            home = net.home.key.ss58_address
            assert list(st["attached"]) == [home] and st["attached"][home]["requests"] == 1
            assert st["attached"][home]["bytes"] > x.numel() * 4 * 2
            assert net.tunnel.status()["relay"] == net.relay_server.endpoint
            # a request for the relay's own hotkey is still the relay's: no such route there
            with pytest.raises(ProtocolError) as e:
                await net.caller.call(net.relay_server.endpoint, net.relay_key.ss58_address, "/hop",
                                      Hop(data=x), Hop, retries=0)
            assert e.value.outcome == Outcome.UNKNOWN_ROUTE
            # a hotkey never attached here: the relay's usual refusal, nothing forwarded
            with pytest.raises(ProtocolError) as e:
                await net.caller.call(net.relay_server.endpoint, kp("nobody").ss58_address, "/hop",
                                      Hop(data=x), Hop, retries=0)
            assert e.value.outcome == Outcome.UNKNOWN_ROUTE
            assert net.home.handled == ["mb-1"]
    run(main())


def test_a_relay_cannot_alter_or_replay_and_a_dropping_relay_looks_unreachable():
    async def main():
        x = torch.randn(2, 4, 8)
        async with Net(AlteringRelay) as net:
            with pytest.raises(ProtocolError) as e:
                await net.call("mb-a", x)
            assert e.value.outcome == Outcome.BAD_SIGNATURE       # refused by the home, not by the relay
            assert net.home.handled == []
        async with Net(ReplayingRelay) as net:
            got = await net.call("mb-r", x)
            assert torch.equal(got.data, x * 2)
            assert net.home.handled == ["mb-r"]                   # the replay never reached the handler
            status = net.relay.second.head["status"]
            assert status == 409 or net.home.server.outcomes.get(Outcome.REPLAYED_NONCE.value) == 1
            assert net.home.server.outcomes.get(Outcome.REPLAYED_NONCE.value) == 1
        async with Net(DroppingRelay, forward_timeout_s=1.0) as net:
            with pytest.raises(TransportError):                   # no answer: unreachable, not a refusal
                await net.call("mb-d", x, timeout_s=3.0)
            assert net.home.handled == []
            assert net.relay.status()["counts"].get("dropped_lost") == 1
    run(main())


def test_a_detached_home_is_unreachable_and_reattaches_to_the_next_relay():
    async def main():
        async with Net() as net:
            x = torch.randn(1, 4, 8)
            await net.call("before", x)
            second_key = kp("relay-2")
            second = NeuronServer(second_key, "127.0.0.1", 0, None, None)
            RelayHost(second_key).mount(second)
            await second.start()
            try:
                net.tunnel.relays.append((second.endpoint, second_key.ss58_address))
                net.tunnel.backoff_s = (0.2, 1.0)
                await net.relay_server.stop()                     # the first relay dies
                t0 = time.monotonic()
                while net.tunnel.status()["relay"] != second.endpoint and time.monotonic() - t0 < 15:
                    await asyncio.sleep(0.1)
                assert net.tunnel.status()["relay"] == second.endpoint
                got = await net.caller.call(second.endpoint, net.home.key.ss58_address, "/hop",
                                            Hop(microbatch_id="after", data=x), Hop, retries=0)
                assert torch.equal(got.data, x * 2) and net.home.handled == ["before", "after"]
            finally:
                await second.stop()
    run(main())


def test_the_per_peer_bandwidth_cap_holds_within_ten_percent():
    """The rate is measured once the bucket's burst is spent (from the end of the fourth call on): a
    warm-up that is slow on a loaded machine refills the bucket meanwhile, which the first calls spend."""
    async def main():
        rate = 2_000_000                                          # bytes/s, both directions together
        async with Net(rate_bytes_per_s=rate) as net:
            x = torch.randn(64, 4, 256)                           # 256 kB each way per call
            await net.call("warm", torch.randn(256, 4, 256))      # 1 MB each way: spends the 1 s of burst
            ends = []
            for i in range(12):
                await net.call(f"mb-{i}", x)
                ends.append(time.monotonic())
            took = ends[-1] - ends[3]
            moved = 8 * 2 * x.numel() * 4
            assert moved / took == pytest.approx(rate, rel=0.10), (moved / took, rate)
    run(main())


def test_attach_needs_a_fresh_signature_for_this_relay_and_the_authorizer():
    async def main():
        relay_key = kp("relay")
        server = NeuronServer(relay_key, "127.0.0.1", 0, None, None)
        allowed = kp("home").ss58_address
        RelayHost(relay_key, authorize=lambda hk: hk == allowed).mount(server)
        await server.start()
        url = f"http://{server.endpoint}/relay/attach"
        try:
            async with aiohttp.ClientSession() as s:
                async with s.get(url) as r:                                    # unsigned
                    assert r.status == 401
                other = http_auth.sign(kp("home"), method="GET", path="/relay/attach", body=b"",
                                       receiver_ss58=kp("elsewhere").ss58_address)
                async with s.get(url, headers=other) as r:                     # signed for another relay
                    assert r.status == 401
                stranger = http_auth.sign(kp("stranger"), method="GET", path="/relay/attach", body=b"",
                                          receiver_ss58=relay_key.ss58_address)
                async with s.get(url, headers=stranger) as r:                  # not allowed to attach
                    assert r.status == 403
                ok = http_auth.sign(kp("home"), method="GET", path="/relay/attach", body=b"",
                                    receiver_ss58=relay_key.ss58_address)
                async with s.ws_connect(url, headers=ok) as ws:
                    assert not ws.closed
                with pytest.raises(aiohttp.WSServerHandshakeError):            # the same signature again
                    async with s.ws_connect(url, headers=ok):
                        pass
        finally:
            await server.stop()
    run(main())


def test_frames_and_the_token_bucket():
    assert unpack_frame(pack_frame(DATA, 7, b"\x00\x01")) == (DATA, 7, b"\x00\x01")
    kind, rid, payload = unpack_frame(head_frame(9, {"path": "/hop"}))
    assert (kind, rid, parse_head(payload)) == (HEAD, 9, {"path": "/hop"})
    for bad in (b"", b"\x02\x00\x00", b"\x09\x00\x00\x00\x01"):
        with pytest.raises(ValueError):
            unpack_frame(bad)
    with pytest.raises(ValueError):
        parse_head(b"[]")
    clock = [0.0]
    bucket = TokenBucket(100.0, clock=lambda: clock[0])

    async def take():
        await bucket.take(100)                     # the burst
        t = asyncio.create_task(bucket.take(50))
        await asyncio.sleep(0.01)
        assert not t.done()                        # no credit until the clock moves
        clock[0] += 0.5
        await asyncio.wait_for(t, 2)
    asyncio.run(take())


@pytest.mark.parametrize("bad", [DroppingRelay, AlteringRelay], ids=["drops", "alters"])
def test_a_caller_goes_around_a_bad_relay_and_avoids_it_afterwards(bad):
    """The home is attached to two relays; the first drops or alters everything. A caller with the
    home's relays as alternates is answered through the second, and its next call goes there first."""
    async def main():
        async with Net(bad, forward_timeout_s=1.0) as net:
            good_key = kp("relay-good")
            good = NeuronServer(good_key, "127.0.0.1", 0, None, None)
            RelayHost(good_key).mount(good)
            await good.start()
            stop = asyncio.Event()
            second = RelayTunnel(net.home.key, [(good.endpoint, good_key.ss58_address)], net.home.server.endpoint)
            task = asyncio.create_task(second.run(stop))
            caller = NeuronClient(kp("caller-2"), alternates=lambda hk: [net.relay_server.endpoint, good.endpoint])
            try:
                await asyncio.wait_for(second.attached.wait(), 10)
                await asyncio.sleep(0.1)
                x = torch.randn(1, 4, 8)
                home = net.home.key.ss58_address
                got = await caller.call(net.relay_server.endpoint, home, "/hop", Hop(microbatch_id="a", data=x), Hop,
                                        timeout_s=5, retries=0)
                assert torch.equal(got.data, x * 2) and net.home.handled == ["a"]
                assert net.relay_server.endpoint in caller.health.unreachable
                t0 = time.monotonic()
                await caller.call(net.relay_server.endpoint, home, "/hop", Hop(microbatch_id="b", data=x), Hop,
                                  timeout_s=5, retries=0)
                assert time.monotonic() - t0 < 0.9                # straight to the good relay
                assert net.home.handled == ["a", "b"]
                if bad is DroppingRelay:
                    assert net.relay.status()["counts"]["dropped_lost"] == 1
                else:                                             # the home refused the altered one
                    assert net.home.server.outcomes.get(Outcome.BAD_SIGNATURE.value) == 1
            finally:
                stop.set()
                await asyncio.wait_for(task, 10)
                await caller.close()
                await good.stop()
    run(main())


def test_both_ends_record_whether_a_pair_went_directly_or_through_the_relay():
    """The path book (iota_subnet/transport/paths.py): the caller records "relayed" via the relay when
    it dialled one of the home's relays (its alternates), "direct" when it dialled the home's own
    address; the home records the same per caller (relayed: its tunnel replayed the request)."""
    async def main():
        async with Net() as net:
            home, relay_ep = net.home.key.ss58_address, net.relay_server.endpoint
            caller = NeuronClient(kp("caller-paths"), alternates=lambda hk: [relay_ep] if hk == home else [])
            try:
                x = torch.randn(1, 4, 8)
                await caller.call(net.home.server.endpoint, home, "/hop", Hop(microbatch_id="d", data=x), Hop,
                                  timeout_s=5, retries=0)
                out = caller.paths.snapshot(caller.hotkey)[home]["out"]
                assert out["kind"] == "direct" and out["via"] is None and out["requests"] == 1
                await caller.call(relay_ep, home, "/hop", Hop(microbatch_id="r", data=x), Hop, timeout_s=5, retries=0)
                out = caller.paths.snapshot(caller.hotkey)[home]["out"]
                assert (out["kind"], out["via"], out["requests"]) == ("relayed", relay_ep, 2)
                assert out["by_kind"]["direct"]["requests"] == 1 and out["by_kind"]["relayed"]["requests"] == 1
                assert out["bytes"] > 2 * x.numel() * 4 * 2 and out["last"] > 0
                seen = net.home.server.paths.snapshot(home)[caller.hotkey]["in"]
                assert (seen["kind"], seen["via"], seen["requests"]) == ("relayed", relay_ep, 2)
                assert seen["by_kind"]["direct"]["requests"] == 1
                assert "hole-punched" not in out["by_kind"]             # never recorded: no hole punching here
            finally:
                await caller.close()
    run(main())


def test_large_bodies_stream_in_many_frames_bit_identical_and_interleave():
    """A 2 MB request and its 2 MB answer cross in 64 KiB frames (each over one frame, as a body over
    the old 64 MB message cap would be); a small call overtakes a large one; the relay's and the home's
    emulated links are charged; a body over the receiving route's limit is 413 BODY_TOO_LARGE."""
    async def main():
        relay_links = {"shaper": UplinkShaper(LinkSpec(8e9, 0.0)), "downlink": DownlinkShaper(8e9)}
        home_links = {"shaper": UplinkShaper(LinkSpec(8e9, 0.0)), "downlink": DownlinkShaper(8e9)}
        async with Net(frame_bytes=64 << 10, rate_bytes_per_s=4_000_000, relay_server_kw=relay_links,
                       home_kw=home_links, tunnel_kw={"local_token": None, "frame_bytes": 64 << 10}) as net:
            x = torch.randn(512, 1024)                              # 2 MiB
            nbytes = x.numel() * 4
            got = await net.call("big", x, timeout_s=30, path="/big")
            assert torch.equal(net.home.got["big"], x) and torch.equal(got.data, x * 2)
            st = net.relay.status()["attached"][net.home.key.ss58_address]
            assert st["frames"] >= 2 * nbytes // (64 << 10)         # both bodies, frame by frame
            assert st["bytes"] >= 2 * nbytes
            # the relay's links: each body arrived (downlink) and left (uplink) through the relay
            assert relay_links["downlink"].payload_bytes >= 2 * nbytes
            assert relay_links["shaper"].payload_bytes >= 2 * nbytes
            # the home's links are charged by its own server's replay: the request in, the answer out
            assert home_links["downlink"].payload_bytes >= nbytes and home_links["shaper"].payload_bytes >= nbytes
            # interleaving: with 4 MB/s through the relay a 2 MiB call takes about a second each way;
            # a small call started alongside is answered long before it
            big = asyncio.create_task(net.call("big-2", x, timeout_s=30, path="/big"))
            await asyncio.sleep(0.2)
            t0 = time.monotonic()
            await net.call("small", torch.randn(2, 4, 8))
            small_s = time.monotonic() - t0
            assert not big.done() and small_s < 0.5, small_s
            assert torch.equal((await big).data, x * 2)
            with pytest.raises(ProtocolError) as e:                 # over /small's 1 MiB limit
                await net.call("too-big", x, timeout_s=30, path="/small")
            assert e.value.outcome == Outcome.BODY_TOO_LARGE and "too-big" not in net.home.handled
    run(main())


def test_a_relayed_sender_gets_progress_credit_with_the_address_the_relay_saw():
    """The caller dials the relay from 127.0.0.2: the home's route sees each piece of the body as it
    streams, with the caller's hotkey and 127.0.0.2 (not the tunnel's 127.0.0.1), and the relay's
    hotkey in the context. The relay headers of anyone but the home's own tunnel are ignored."""
    async def main():
        async with Net(frame_bytes=64 << 10) as net:
            net.tunnel.local_token = net.home.server.relay_token
            caller = kp("caller-far")
            x = torch.randn(256, 1024)                              # 1 MiB
            body = encode(Hop(microbatch_id="far", data=x))
            home = net.home.key.ss58_address
            headers = {"Content-Type": "application/octet-stream",
                       **http_auth.sign(caller, method="POST", path="/big", body=body, receiver_ss58=home)}
            conn = aiohttp.TCPConnector(local_addr=("127.0.0.2", 0))
            async with aiohttp.ClientSession(connector=conn) as s:
                async with s.post(f"http://{net.relay_server.endpoint}/big", data=body, headers=headers) as r:
                    assert r.status == 200, await r.text()
            pieces = net.home.pieces
            assert len(pieces) >= 2 and sum(p[2] for p in pieces) == len(body)
            assert {(hk, ip) for hk, ip, _, _ in pieces} == {(caller.ss58_address, "127.0.0.2")}
            assert all(done == 0 for *_, done in pieces)            # counted while the body streamed in
            assert net.home.via[-1] == ("127.0.0.2", net.relay_key.ss58_address)
            # a request that claims to come through the tunnel without its token: the real address
            forged = {**http_auth.sign(caller, method="POST", path="/big", body=body, receiver_ss58=home),
                      HEADER_RELAY_TOKEN: "0" * 32, HEADER_RELAY_REMOTE: "10.9.9.9",
                      HEADER_RELAY_HOTKEY: net.relay_key.ss58_address}
            net.home.pieces.clear()
            async with aiohttp.ClientSession() as s:
                async with s.post(f"http://{net.home.server.endpoint}/big", data=body, headers=forged) as r:
                    assert r.status == 200
            assert {ip for _, ip, _, _ in net.home.pieces} == {"127.0.0.1"} and net.home.via[-1] == ("127.0.0.1", None)
    run(main())


def test_progress_credit_rule():
    assert progress_credited("1.2.3.4", "1.2.3.4:8091")
    assert not progress_credited("5.6.7.8", "1.2.3.4:8091")
    assert progress_credited("9.9.9.9", "9.9.9.9:9000", ("9.9.9.9:9000", "8.8.8.8:9000"))   # behind relays
    assert progress_credited("8.8.8.8", "9.9.9.9:9000", ("9.9.9.9:9000", "8.8.8.8:9000"))
    assert not progress_credited("7.7.7.7", "9.9.9.9:9000", ("9.9.9.9:9000",))
    assert not progress_credited("", None, ())
