"""Virtual state sync (:mod:`iota_subnet.sim.virtual_sync`, the joiner's side through
:class:`~iota_subnet.sim.virtual_merge.VirtualTransport`) against the real sync on ``tiny``.

Two donors of ``tiny``'s stage 1 merged state (2,369,280 parameters: anchor and momentum, 18.95 MB of
float32, 73 chunks of 256 KiB) serve a joiner over signed HTTP on 127.0.0.1. Each donor's server has
its own uplink (50 ms one way, rate not shaped: the joiner's downlink is the bottleneck, as in
tests/test_sync_link_rate.py), the joiner a 50 ms uplink and an 80 Mbit/s downlink (the bytes counted
do not depend on the rate; at a rate the real sync's CPU work, hashing and copying 19 MB on a busy
host, is not always off the critical path, so only the virtual sync is timed). Then the same
with :class:`VirtualSnapshotDonor` donors of a proxy 1/16 of the stage and the joiner's transport
wrapped in a :class:`VirtualTransport`, at a 40 Mbit/s downlink: as many chunks (of 16 KiB), and the bytes counted by the
donors' uplinks and the joiner's downlink within 2 % of the real sync's; the virtual sync takes
virtual payload / downlink within 1.25x.
"""
from __future__ import annotations

import asyncio
import time

import pytest
import torch
from bittensor.sp_core import Keypair

from iota_subnet.config import load_config
from iota_subnet.merge.sync import SnapshotDonor, sync_state
from iota_subnet.merge.transport import HttpTransport
from iota_subnet.model import make_stage
from iota_subnet.protocol import StateChunkRequest
from iota_subnet.sim.virtual_merge import VirtualPayload, VirtualTransport
from iota_subnet.sim.virtual_sync import VirtualSnapshotDonor, make_virtual_snapshot_donor
from iota_subnet.transport import NeuronClient, NeuronServer
from iota_subnet.transport.shaping import DownlinkShaper, LinkSpec, UplinkShaper

pytestmark = pytest.mark.timeout(60)

DOWN_BPS = 80e6                 # the joiner's downlink in the real sync: 10 MB/s
VIRT_DOWN_BPS = 40e6            # in the virtual sync (timed: no real CPU work of 19 MB in the way): 5 MB/s
DELAY_S = 0.05
CHUNK_NUMEL = 65536             # the real sync's chunks: 256 KiB
K = 16


async def _sync(tag: str, P: int, make_donor, virtual: VirtualPayload | None, tmp_path, down_bps: float) -> dict:
    g = torch.Generator().manual_seed(0)
    anchor, momentum = torch.randn(P, generator=g), torch.randn(P, generator=g)
    servers, eps, donors = [], {}, []
    for j in range(2):
        kp = Keypair.create_from_uri(f"//Sync{tag}{j}")
        up = UplinkShaper(LinkSpec(None, DELAY_S))
        donor = make_donor(up)
        donor.publish(anchor, momentum, merged_epoch=3, step=30)
        srv = NeuronServer(kp, "127.0.0.1", 0, shaper=up)

        async def chunk(msg, ctx, donor=donor):
            return await donor.handle(msg, ctx.caller_hotkey, on_sent=ctx.on_sent)
        srv.add_route("/state/chunk", chunk, StateChunkRequest)
        await srv.start()
        servers.append(srv)
        donors.append((donor, up))
        eps[srv.hotkey] = srv.endpoint
    down = DownlinkShaper(down_bps)
    client = NeuronClient(Keypair.create_from_uri(f"//Joiner{tag}"), shaper=UplinkShaper(LinkSpec(None, DELAY_S)),
                          downlink=down)
    transport = HttpTransport(client, eps.get, timeout_s=30)
    if virtual is not None:
        transport = VirtualTransport(transport, virtual, downlink=down)
    try:
        t0 = time.perf_counter()
        a, m, man = await sync_state(list(eps), transport, run_id="vsync", stage=1, param_numel=P,
                                     work_dir=tmp_path / tag, window=8)
        wall = time.perf_counter() - t0
        assert torch.equal(a, anchor) and torch.equal(m, momentum)
        return {"wall": wall, "sync": man["sync"], "up": sum(u.wire_bytes for _, u in donors),
                "down": down.wire_bytes, "donors": [d for d, _ in donors]}
    finally:
        for s in servers:
            await s.stop()
        await client.close()


def test_a_virtual_sync_charges_donors_and_joiner_within_2_percent_of_a_real_sync_on_tiny(tmp_path):
    run = load_config("configs/tiny.yaml")
    P = sum(p.numel() for p in make_stage(run.model, run.pipeline, 1, seed=0).parameters())
    payload = VirtualPayload(P, K)
    real = asyncio.run(_sync("real", P, lambda up: SnapshotDonor("vsync", 1, CHUNK_NUMEL, 4), None, tmp_path, DOWN_BPS))
    virt = asyncio.run(_sync("virt", payload.proxy_numel, lambda up: VirtualSnapshotDonor(
        "vsync", 1, payload, CHUNK_NUMEL // K, 4, uplink=up), payload, tmp_path, VIRT_DOWN_BPS))
    up_ratio, down_ratio = virt["up"] / real["up"], virt["down"] / real["down"]
    ideal = 8 * payload.virtual_numel / (VIRT_DOWN_BPS / 8)
    print(f"\nreal sync: {real['sync']['chunks']} chunks, donors' uplinks {real['up']:,} B, joiner's downlink "
          f"{real['down']:,} B, {real['wall']:.2f} s; virtual (k={K}): {virt['sync']['chunks']} chunks, "
          f"uplinks {virt['up']:,} B ({up_ratio:.4f} x), downlink {virt['down']:,} B ({down_ratio:.4f} x), "
          f"{virt['wall']:.2f} s (virtual payload / downlink {ideal:.2f} s: {virt['wall'] / ideal:.2f} x)")
    assert virt["sync"]["chunks"] == real["sync"]["chunks"] and virt["sync"]["requests"] == real["sync"]["requests"]
    assert abs(up_ratio - 1) < 0.02 and abs(down_ratio - 1) < 0.02, (up_ratio, down_ratio)
    assert sum(d.charges for d in virt["donors"]) == virt["sync"]["chunks"]
    assert sum(d.virtual_sent for d in virt["donors"]) == (K - 1) * 8 * payload.proxy_numel
    assert 0.95 * ideal <= virt["wall"] <= 1.25 * ideal, (virt["wall"], ideal)


def test_the_emulated_donor_factory_takes_the_engines_scale_and_uplink():
    class Engine:
        payload = VirtualPayload(1 << 20, 8)
        uplink = UplinkShaper(LinkSpec(None, 0.0))
    d = make_virtual_snapshot_donor(Engine(), "r", 2, 1024, 3)
    assert (d.payload, d.uplink, d.chunk_numel, d.max_concurrent, d.stage) == (Engine.payload, Engine.uplink, 1024, 3, 2)
    with pytest.raises(ValueError, match="virtual merge engine"):
        make_virtual_snapshot_donor(object(), "r", 2, 1024, 3)


def test_a_chunk_is_charged_once_also_when_the_donor_re_dispatches_a_replaced_snapshot():
    """:meth:`SnapshotDonor.handle` calls ``self.handle`` again when the snapshot was replaced while it
    hashed; republished with the same values (same snapshot id) the chunk is served, and charged once."""
    payload = VirtualPayload(4096, 4)
    up = UplinkShaper(LinkSpec(None, 0.0))
    d = VirtualSnapshotDonor("r", 0, payload, 256, 2, uplink=up)
    a, m = torch.arange(1024, dtype=torch.float32), torch.zeros(1024)

    async def main():
        d.publish(a, m, 1, 10)
        sid = (await d.manifest())["snapshot_id"]
        d.publish(a, m, 1, 10)                      # the same state again: hashed anew, same id
        task = asyncio.ensure_future(d.handle(StateChunkRequest(run_id="r", stage=0, snapshot_id=sid, offset=0,
                                                                numel=256)))
        await asyncio.sleep(0)
        d.publish(a.clone(), m.clone(), 1, 10)      # replaced while hashing: the donor re-dispatches
        return await task
    reply = asyncio.run(main())
    assert reply.data.numel() == 256 and d.served_chunks == 1
    assert d.charges == 1 and d.virtual_sent == 3 * 4 * 256 and up.payload_bytes == 3 * 4 * 256
