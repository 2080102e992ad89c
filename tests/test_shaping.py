"""Link emulation (iota_subnet.transport.shaping): parsing, the token bucket with a fake clock, and real
signed HTTP transfers between a NeuronClient and a NeuronServer on 127.0.0.1 through shaped uplinks."""
from __future__ import annotations

import asyncio
import time

import pytest
import torch
from bittensor.sp_core import Keypair

from iota_subnet.config import ConfigError
from iota_subnet.neuron_common import add_common_args
from iota_subnet.protocol import Health, Hop
from iota_subnet.transport import NeuronClient, NeuronServer
from iota_subnet.transport.shaping import (LINK_PROFILES, MSS, SEGMENT_OVERHEAD, DownlinkShaper, LinkSpec,
                                           UplinkShaper, configure_process_link, parse_link, process_downlink,
                                           process_shaper, request_head_bytes, segment_overhead)

pytestmark = pytest.mark.timeout(120)


# ------------------------------------------------------------------------------------ parsing
def test_parse_link():
    assert parse_link("100mbit:50ms") == LinkSpec(100e6, 0.05)
    assert parse_link("1gbit:10ms") == LinkSpec(1e9, 0.01)
    assert parse_link("20mbit:100ms").bytes_per_s == 2.5e6
    assert parse_link("2.5Mbit") == LinkSpec(2.5e6, 0.0)
    assert parse_link("800kbit:1.5s") == LinkSpec(800e3, 1.5)
    assert parse_link("1e6bit:250us") == LinkSpec(1e6, 250e-6)
    for text in ("loopback", "", None, "LOOPBACK"):
        assert parse_link(text).loopback
    for p in LINK_PROFILES:
        assert str(parse_link(p)) == p
    for bad in ("100mb:50ms", "fast", "100mbit:50", "100mbit:-5ms", "0mbit:5ms", "mbit:5ms", "100mbit:5min"):
        with pytest.raises(ConfigError, match="RATE:DELAY"):
            parse_link(bad)
    slow = parse_link("100mbit:50ms").scaled(4)
    assert slow == LinkSpec(25e6, 0.2)
    with pytest.raises(ConfigError):
        parse_link("1mbit").scaled(0)


def test_cli_flag_refuses_a_bad_link_with_exit_2(capsys):
    import argparse
    p = argparse.ArgumentParser()
    add_common_args(p)
    assert p.parse_args(["--link", "100mbit:50ms"]).link == LinkSpec(100e6, 0.05)
    assert p.parse_args([]).link.loopback
    with pytest.raises(SystemExit) as e:
        p.parse_args(["--link", "100 potatoes"])
    assert e.value.code == 2 and "RATE:DELAY" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        p.parse_args(["--time-scale", "0"])


# ------------------------------------------------------------------------------------ bucket, fake clock
class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    async def sleep(self, dt: float) -> None:
        self.now += dt


@pytest.mark.parametrize("nbytes", [1, 40_000, 1_000_000, 12_345_678])
def test_one_transfer_takes_bytes_over_rate_plus_delay(nbytes):
    clk = FakeClock()
    link = parse_link("100mbit:50ms")
    sh = UplinkShaper(link, burst_bytes=32 << 10, clock=clk, sleep=clk.sleep)
    asyncio.run(sh.transmit(nbytes))
    wire = nbytes + segment_overhead(nbytes)
    assert sh.wire_bytes == wire and sh.payload_bytes == nbytes and sh.messages == 1
    assert clk.now == pytest.approx(max(0, wire - (32 << 10)) / 12.5e6 + 0.05, abs=1e-9)
    assert clk.now == pytest.approx(link.transfer_s(wire, 32 << 10), abs=1e-9)


def test_back_to_back_transfers_queue_on_the_bucket():
    clk = FakeClock()
    sh = UplinkShaper(parse_link("8mbit:0ms"), burst_bytes=0, count_segments=False, clock=clk, sleep=clk.sleep)

    async def go():
        for _ in range(3):
            await sh.transmit(500_000)
    asyncio.run(go())
    assert clk.now == pytest.approx(1.5)        # 3 x 0.5 MB at 1 MB/s
    # the bucket refills while idle: after a pause, a burst-sized message leaves at once
    sh2 = UplinkShaper(parse_link("8mbit"), burst_bytes=100_000, count_segments=False, clock=clk, sleep=clk.sleep)
    t = clk.now
    asyncio.run(sh2.transmit(1_000_000))
    assert clk.now - t == pytest.approx(0.9)    # the first 100 kB were the burst
    clk.now += 10
    t = clk.now
    asyncio.run(sh2.transmit(100_000))
    assert clk.now == pytest.approx(t, abs=1e-9)


def test_interleaved_chunks_share_the_link():
    """Two messages booked chunk by chunk in turn: each finishes after (about) both messages' bytes."""
    clk = FakeClock()
    sh = UplinkShaper(parse_link("8mbit"), burst_bytes=0, count_segments=False, clock=clk, sleep=clk.sleep)
    c = sh.chunk_bytes
    done = [sh._reserve(c), sh._reserve(c), sh._reserve(c), sh._reserve(c)]   # A1 B1 A2 B2 at t = 0
    assert done == pytest.approx([c / 1e6, 2 * c / 1e6, 3 * c / 1e6, 4 * c / 1e6])


def test_segment_and_head_overheads():
    assert segment_overhead(MSS) == SEGMENT_OVERHEAD and segment_overhead(MSS + 1) == 2 * SEGMENT_OVERHEAD
    assert segment_overhead(0) == 0
    h = request_head_bytes("POST", "/hop", {"X-Epistula-Signature": "0x" + "a" * 128, "Content-Type": "x"})
    assert 250 < h < 400


def test_process_shaper_is_shared_by_clients_and_servers():
    kp = Keypair.create_from_uri("//Alice")
    try:
        sh = configure_process_link(parse_link("100mbit:50ms"), time_scale=2.0)
        assert process_shaper() is sh and sh.link == LinkSpec(50e6, 0.1)
        a, b = NeuronClient(kp), NeuronClient(kp)
        srv = NeuronServer(kp, "127.0.0.1", 0)
        assert a.shaper is sh and b.shaper is sh and srv.shaper is sh
        own = UplinkShaper(parse_link("1gbit"))
        assert NeuronClient(kp, shaper=own).shaper is own
        assert configure_process_link(parse_link("loopback")) is None and NeuronClient(kp).shaper is None
    finally:
        configure_process_link(None)


# ------------------------------------------------------------------------------------ real HTTP
def _activations(nbytes: int) -> torch.Tensor:
    return torch.zeros(nbytes // (4 * 64 * 16), 64, 16)     # fp32 [n, 64, 16]


class Pair:
    """A server (its own uplink) and a client (its own uplink) on 127.0.0.1."""

    def __init__(self, client_link: str, server_link: str, reply_bytes: int = 0):
        self.ck, self.sk = Keypair.create_from_uri("//Alice"), Keypair.create_from_uri("//Bob")
        self.client_shaper = UplinkShaper(parse_link(client_link))
        self.server_shaper = UplinkShaper(parse_link(server_link))
        self.server = NeuronServer(self.sk, "127.0.0.1", 0, shaper=self.server_shaper)
        self.reply_bytes = reply_bytes
        self.server.add_route("/take", self.take, Hop)

    async def take(self, msg: Hop, ctx):
        if self.reply_bytes:
            return Hop(run_id="r", data=_activations(self.reply_bytes))
        return Health(run_id="r", stats={"n": float(msg.data.numel())})

    async def send(self, client: NeuronClient, nbytes: int) -> float:
        t0 = time.perf_counter()
        await client.call(self.server.endpoint, self.sk.ss58_address, "/take",
                          Hop(run_id="r", data=_activations(nbytes)),
                          Hop if self.reply_bytes else Health, timeout_s=60, retries=0)
        return time.perf_counter() - t0


async def _timed(client_link: str, server_link: str, nbytes: int, concurrent: int = 1, reply_bytes: int = 0):
    pair = Pair(client_link, server_link, reply_bytes)
    await pair.server.start()
    try:
        async with NeuronClient(pair.ck, shaper=pair.client_shaper) as c:
            await pair.send(c, 4096)                                  # warm the connection pool
            base = await pair.send(c, 4096)
            t0 = time.perf_counter()
            times = await asyncio.gather(*(pair.send(c, nbytes) for _ in range(concurrent)))
            return time.perf_counter() - t0, times, base, pair
    finally:
        await pair.server.stop()


def test_http_transfer_takes_n_over_r_plus_delay():
    """1 MB at 16 Mbit/s (2 MB/s) + 50 ms: ~0.55 s; the reply (small, unshaped server) adds ~nothing."""
    n = 1 << 20
    wall, _, _, pair = asyncio.run(_timed("16mbit:50ms", "loopback", n))
    sent = pair.client_shaper.wire_bytes
    expected = n / 2e6 + 0.05
    assert pair.client_shaper.messages == 3 and sent > 3 * n // 3
    assert 0.9 * expected <= wall <= 1.6 * expected + 0.2, (wall, expected)
    # the same transfer on loopback is far quicker
    fast, _, _, _ = asyncio.run(_timed("loopback", "loopback", n))
    assert fast < 0.5 * wall


def test_concurrent_transfers_share_the_uplink():
    """Three 0.5 MB requests at once through one 16 Mbit/s uplink: ~0.75 s for all, not 0.25 s each."""
    n = 1 << 19
    wall, times, _, _ = asyncio.run(_timed("16mbit:20ms", "loopback", n, concurrent=3))
    expected = 3 * n / 2e6 + 0.02
    assert 0.9 * expected <= wall <= 1.6 * expected + 0.2, (wall, expected)
    assert max(times) >= 0.9 * expected and min(times) >= 0.5 * n / 2e6   # each waited on the others


def test_server_responses_pass_the_server_uplink():
    """A 1 MB reply from a server on an 8 Mbit/s uplink takes ~1 s; its small request does not."""
    n = 1 << 20
    wall, _, _, pair = asyncio.run(_timed("loopback", "8mbit:30ms", 4096, reply_bytes=n))
    expected = n / 1e6 + 0.03
    assert 0.9 * expected <= wall <= 1.6 * expected + 0.2, (wall, expected)
    assert pair.server_shaper.wire_bytes > 3 * n       # warm-up replies were 1 MB each too


# ------------------------------------------------------------------------------------ downlink
def test_asymmetric_profiles_parse_and_a_single_rate_shapes_the_uplink_only():
    up_down = parse_link("20mbit/100mbit:100ms")
    assert up_down == LinkSpec(20e6, 0.1, 100e6) and str(up_down) == "20mbit/100mbit:100ms"
    assert parse_link(str(up_down)) == up_down and up_down.scaled(2) == LinkSpec(10e6, 0.2, 50e6)
    assert parse_link("1gbit/2.5mbit") == LinkSpec(1e9, 0.0, 2.5e6) and not parse_link("1gbit/2.5mbit").loopback
    for bad in ("20mbit/:1ms", "/1mbit", "1mbit/0mbit:1ms", "1mbit/2mbit/3mbit", "1mbit/2ms"):
        with pytest.raises(ConfigError, match="UP/DOWN:DELAY"):
            parse_link(bad)
    kp = Keypair.create_from_uri("//Alice")
    try:
        for p in LINK_PROFILES:                                  # the existing profiles: no downlink
            configure_process_link(parse_link(p))
            assert process_downlink() is None and NeuronClient(kp).downlink is None
        sh = configure_process_link(parse_link("20mbit/100mbit:100ms"), time_scale=2.0)
        down = process_downlink()
        assert isinstance(down, DownlinkShaper) and down.link == LinkSpec(50e6, 0.0)
        assert sh.link.rate_bps == 10e6 and sh.link.delay_s == 0.2
        assert NeuronClient(kp).downlink is down and NeuronServer(kp, "127.0.0.1", 0).downlink is down
    finally:
        configure_process_link(None)
    assert process_downlink() is None


def test_downlink_charges_what_a_process_receives_responses_and_requests():
    """A client on a 16 Mbit/s (2 MB/s) downlink receives a 1 MB reply of an unshaped server in
    ~0.5 s; a server on a 16 Mbit/s downlink takes ~0.5 s to receive a 1 MB request; the small
    messages the other way cost ~nothing."""
    n = 1 << 20

    async def run(client_down, server_down, request_bytes, reply_bytes):
        pair = Pair("loopback", "loopback", reply_bytes)
        pair.server.downlink = server_down
        await pair.server.start()
        try:
            async with NeuronClient(pair.ck, downlink=client_down) as c:
                await pair.send(c, 4096)                          # warm the connection pool
                return await pair.send(c, request_bytes)
        finally:
            await pair.server.stop()
    down = DownlinkShaper(16e6)
    wall = asyncio.run(run(down, None, 4096, n))
    expected = n / 2e6
    assert 0.9 * expected <= wall <= 1.6 * expected + 0.2, (wall, expected)
    assert down.messages == 2 and down.wire_bytes > 2 * n
    down = DownlinkShaper(16e6)
    wall = asyncio.run(run(None, down, n, 0))
    assert 0.9 * expected <= wall <= 1.6 * expected + 0.2, (wall, expected)
    assert down.messages == 2 and n < down.wire_bytes < 1.2 * n


# ------------------------------------------------------------------------------------ fault injection
def test_link_control_partitions_slows_and_heals(tmp_path):
    from iota_subnet.transport.shaping import CONTROL_POLL_S, LinkDown
    clk = FakeClock()
    ctl = tmp_path / "link-control.json"
    sh = UplinkShaper(parse_link("8mbit:10ms"), burst_bytes=0, count_segments=False, control_path=ctl, clock=clk,
                      sleep=clk.sleep)
    asyncio.run(sh.transmit(1_000_000))                      # no file: healthy
    assert clk.now == pytest.approx(1.01)
    ctl.write_text('{"slow": 4}')
    clk.now += CONTROL_POLL_S
    t = clk.now
    asyncio.run(sh.transmit(1_000_000))
    assert clk.now - t == pytest.approx(4.04) and sh.slow == 4
    ctl.write_text('{"down": true}')
    clk.now += CONTROL_POLL_S
    with pytest.raises(LinkDown):
        asyncio.run(sh.transmit(10))
    assert isinstance(LinkDown(), OSError) and sh.refused == 1 and sh.stats()["down"]
    ctl.write_text("{}")
    clk.now += CONTROL_POLL_S
    t = clk.now
    asyncio.run(sh.transmit(1_000_000))
    assert clk.now - t == pytest.approx(1.01) and not sh.down
    ctl.write_text("not json")                                # a broken file heals, with a warning
    clk.now += CONTROL_POLL_S
    asyncio.run(sh.transmit(10))
    assert not sh.down and sh.slow == 1.0


def test_partitioned_neurons_fail_fast_over_http(tmp_path):
    """A partitioned client's requests fail with TransportError; a partitioned server drops the
    connection instead of answering; after healing both work again."""
    from iota_subnet.transport import TransportError
    from iota_subnet.transport.shaping import CONTROL_POLL_S

    async def go():
        ck, sk = Keypair.create_from_uri("//Alice"), Keypair.create_from_uri("//Bob")
        cctl, sctl = tmp_path / "client.json", tmp_path / "server.json"
        server = NeuronServer(sk, "127.0.0.1", 0, shaper=UplinkShaper(parse_link("loopback"), control_path=sctl))

        async def take(msg, ctx):
            return Health(run_id="r")
        server.add_route("/take", take, Hop)
        await server.start()
        msg = Hop(run_id="r", data=_activations(4096 * 4))
        try:
            async with NeuronClient(ck, shaper=UplinkShaper(parse_link("loopback"), control_path=cctl)) as c:
                await c.call(server.endpoint, sk.ss58_address, "/take", msg, Health, timeout_s=10, retries=0)
                for ctl in (cctl, sctl):
                    ctl.write_text('{"down": true}')
                    await asyncio.sleep(CONTROL_POLL_S + 0.05)
                    t0 = time.perf_counter()
                    with pytest.raises(TransportError):
                        await c.call(server.endpoint, sk.ss58_address, "/take", msg, Health, timeout_s=10,
                                     retries=1, backoff_s=0.05)
                    assert time.perf_counter() - t0 < 5            # fails fast, no timeout
                    ctl.write_text("{}")
                await asyncio.sleep(CONTROL_POLL_S + 0.05)
                await c.call(server.endpoint, sk.ss58_address, "/take", msg, Health, timeout_s=10, retries=0)
        finally:
            await server.stop()
    asyncio.run(go())


def test_localnet_children_get_their_link_flags(tmp_path):
    """Every localnet neuron is started with --link, --time-scale and its own --link-control file (the
    chaos harness's partition / slow), every validator with the localnet's --wire-dtype (none given:
    the validator's default, bf16), and the neurons' parsers accept them."""
    from iota_subnet.entry.miner import build_parser as miner_parser
    from iota_subnet.network.localnet import LocalNet
    from iota_subnet.entry.validator import build_parser as validator_parser
    from iota_subnet.network.localnet_summary import wire_dtype_used
    net = LocalNet(stages=2, replicas=1, validators=2, config="configs/tiny.yaml", data="x.txt", steps=2,
                   out=tmp_path / "ln", link="20mbit:100ms", time_scale=2.0, wire_dtype="fp8")
    net.miner_wallets = {(s, 0): None for s in range(2)}
    net.val_wallets = [None, None]
    net._make_children()
    assert sorted(c.kind for c in net.children) == ["miner", "miner", "validator", "validator"]
    for c in net.children:
        argv = c.argv[3:]                                   # after: python -m module
        a = (miner_parser() if c.kind == "miner" else validator_parser()).parse_args(argv)
        assert a.link == LinkSpec(20e6, 0.1) and a.time_scale == 2.0
        assert a.link_control == str(c.out / "link-control.json")
        if c.kind == "validator":
            assert a.wire_dtype == "fp8" and " --wire-dtype fp8 " in f" {' '.join(argv)} "
        else:
            assert "--wire-dtype" not in argv               # the tickets carry it to the miners
    plain = LocalNet(stages=2, replicas=1, validators=1, config="configs/tiny.yaml", data="x.txt", steps=2,
                     out=tmp_path / "plain")
    plain.miner_wallets, plain.val_wallets = {(s, 0): None for s in range(2)}, [None]
    plain._make_children()
    (v,) = [c for c in plain.children if c.kind == "validator"]
    assert "--wire-dtype" not in v.argv and validator_parser().parse_args(v.argv[3:]).wire_dtype == "bf16"
    with pytest.raises(ConfigError, match="--wire-dtype 'fp4' is not one of fp32, bf16, int8, fp8"):
        LocalNet(stages=2, replicas=1, validators=1, config="configs/tiny.yaml", data="x.txt", steps=2,
                 out=tmp_path / "bad", wire_dtype="fp4")
    # the summary reports the dtype the validators' status.json say they used
    assert wire_dtype_used([{"wire_dtype": "fp8"}, {"wire_dtype": "fp8"}], "fp8") == "fp8"
    assert wire_dtype_used([{"wire_dtype": "bf16"}], None) == "bf16"
    assert wire_dtype_used([{}], "int8") == "int8" and wire_dtype_used([], None) is None


def test_a_slow_event_slows_a_miners_compute_even_on_an_unshaped_link(tmp_path, tmp_home):
    """Chaos ``slow`` on a localnet (loopback, no ``--link``): the link has nothing to slow, so the
    miner's compute thread stays busy ``factor`` times as long (it was a no-op counted as an event)."""
    import time

    from iota_subnet.config import load_config
    from iota_subnet.miner.options import MinerOptions
    from iota_subnet.miner.service import MinerService
    from iota_subnet.transport.shaping import CONTROL_POLL_S, compute_slowdown, configure_process_link
    from iota_subnet.wallets import create_wallet
    ctl = tmp_path / "link-control.json"
    configure_process_link(parse_link("loopback"), control_path=ctl)
    try:
        m = MinerService(load_config("configs/tiny.yaml"), create_wallet("m", "default", tmp_path / "w"), None,
                         MinerOptions(netuid=9, run_id="slow", stage=0, out_dir=tmp_path / "m"))

        async def busy(seconds):
            t0 = time.perf_counter()
            await m.compute.run(time.sleep, seconds)
            return time.perf_counter() - t0
        assert compute_slowdown() == 1.0
        ctl.write_text('{"slow": 3}')
        time.sleep(CONTROL_POLL_S)
        assert compute_slowdown() == 3.0
        assert asyncio.run(busy(0.1)) >= 0.3                          # 0.1 s of work, 3 x as long
        ctl.write_text("{}")
        time.sleep(CONTROL_POLL_S)
        assert compute_slowdown() == 1.0                              # healed: no sleep added
    finally:
        configure_process_link(None)
