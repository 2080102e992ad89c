"""Virtual merge payloads (:mod:`iota_subnet.sim.virtual_merge`) against the real path on ``tiny``.

Two (three) replicas of ``tiny``'s stage 1 (2,369,280 parameters) merge over signed HTTP on 127.0.0.1,
each with its own emulated uplink and downlink (:class:`UplinkShaper`, :class:`DownlinkShaper`, which
count the wire bytes of every request and response); then as many emulated replicas merge proxies of 1/16 of the stage (:class:`ProxyStage`) whose
messages charge the shapers the bytes they stand for (sender's uplink, responder's uplink, both
downlinks). The bytes the shapers counted agree within 2 % (up- and downlinks),
every virtual replica ends ``merged`` with the same proxy weights, and the phase deadline follows the
virtual bytes.
"""
from __future__ import annotations

import asyncio
import time

import pytest
import torch
from bittensor.sp_core import Keypair

from iota_subnet.config import MergeConfig, load_config
from iota_subnet.hardware import parse_accelerator
from iota_subnet.merge import MergeEngine, MergePlan, ModuleParams
from iota_subnet.merge.deadlines import phase_deadline_s, scatter_bytes
from iota_subnet.merge.transport import HttpTransport
from iota_subnet.model import make_stage
from iota_subnet.sim.emulated import Emulation, emulated_parts
from iota_subnet.sim.virtual_merge import ProxyStage, VirtualMergeEngine, VirtualPayload
from iota_subnet.transport import NeuronClient, NeuronServer
from iota_subnet.transport.shaping import DownlinkShaper, LinkSpec, UplinkShaper

from support.dataplane_net import P2PNet, run
from support.merge_routes import mount_merge_routes

pytestmark = pytest.mark.timeout(60)

RATE_BPS = 2e9                      # 250 MB/s: shaped (bytes counted, progress reported), but fast
K = 16


def merge_cfg() -> MergeConfig:
    return MergeConfig(every_steps=1, join_timeout_s=5.0, phase_timeout_s=5.0, progress_timeout_s=3.0,
                       max_attempts=1, outer_lr=1.0, outer_momentum=0.0, quantization="int8",
                       chunk_numel=1 << 18).validate()


async def _replicas(tag: str, modules, make_engine, train, rate_bps=RATE_BPS):
    endpoints: dict[str, str] = {}
    out = []
    for i, m in enumerate(modules):
        kp = Keypair.create_from_uri(f"//Virtual{tag}{i}")
        shaper = UplinkShaper(LinkSpec(rate_bps[i] if isinstance(rate_bps, list) else rate_bps, 0.0))
        down = DownlinkShaper(RATE_BPS)
        client = NeuronClient(kp, shaper=shaper, downlink=down)
        transport = HttpTransport(client, endpoints.get, timeout_s=10.0)
        engine = make_engine(kp.ss58_address, ModuleParams(m), transport)
        train(i, m)                         # local training after the anchor: replica-specific steps
        server = NeuronServer(kp, host="127.0.0.1", shaper=shaper, downlink=down, max_body_bytes=8 << 20)

        mount_merge_routes(server, engine)
        await server.start()
        endpoints[kp.ss58_address] = server.endpoint
        out.append((engine, m, client, server, shaper, down))
    return out


async def _merge(tag: str, modules, make_engine, train, rate_bps=RATE_BPS):
    reps = await _replicas(tag, modules, make_engine, train, rate_bps)
    try:
        engines = [r[0] for r in reps]
        peers = [e.me for e in engines]
        t0 = time.monotonic()
        res = await asyncio.gather(*(e.merge(0, peers) for e in engines))
        return res, time.monotonic() - t0, reps
    finally:
        for r in reps:
            await r[3].stop()
            await r[2].close()


def flat(m) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


@pytest.mark.parametrize("n", [2, 3])
def test_a_virtual_merge_charges_the_links_within_2_percent_of_a_real_merge_on_tiny(n):
    run = load_config("configs/tiny.yaml")
    cfg = merge_cfg()
    stages = [make_stage(run.model, run.pipeline, 1, seed=0) for _ in range(n)]

    @torch.no_grad()
    def train(i, m):
        g = torch.Generator().manual_seed(100 + i)
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 1e-2)
    P = sum(p.numel() for p in stages[0].parameters())
    real, real_wall, real_reps = asyncio.run(_merge("real", stages, lambda me, params, t: MergeEngine(
        me, cfg, params, t, run_id="virtual", stage=1), train))
    assert [r.status for r in real] == ["merged"] * n, [(r.status, r.reason) for r in real]

    payload = VirtualPayload(P, K)
    proxies = [ProxyStage(payload, seed=7) for _ in range(n)]
    assert torch.equal(flat(proxies[0]), flat(proxies[1]))             # the same start on every replica
    virt, virt_wall, virt_reps = asyncio.run(_merge("virt", proxies, lambda me, params, t: VirtualMergeEngine(
        me, cfg, params, t, run_id="virtual", stage=1), lambda i, m: m.drift(1, tag=i, size=1e-2)))
    assert [r.status for r in virt] == ["merged"] * n, [(r.status, r.reason) for r in virt]
    assert all(torch.equal(flat(proxies[0]), flat(x)) for x in proxies[1:])     # the proxy merged for real

    real_wire = sum(r[4].wire_bytes for r in real_reps)
    virt_wire = sum(r[4].wire_bytes for r in virt_reps)
    real_msgs = sum(r[4].messages for r in real_reps)
    charges = sum(r[0].charges + r[0].transport.charges for r in virt_reps)
    virt_http = sum(r[4].messages for r in virt_reps) - charges
    ratio = virt_wire / real_wire
    print(f"\n{n} replicas: real merge: {real_wire:,} wire bytes, {real_msgs} shaped sends, {real_wall:.2f} s; virtual (k={K}, "
          f"{payload.proxy_numel:,} proxy values): {virt_wire:,} wire bytes ({ratio:.4f} x), {virt_wall:.2f} s")
    assert abs(ratio - 1) < 0.02, ratio
    # the downlinks (every request a server reads, every reply a client reads) too
    down_ratio = sum(r[5].wire_bytes for r in virt_reps) / sum(r[5].wire_bytes for r in real_reps)
    print(f"downlinks: virtual / real {down_ratio:.4f}")
    assert abs(down_ratio - 1) < 0.02, down_ratio
    # as many HTTP messages as the real merge (plus one virtual charge per message holding tensors)
    assert virt_http == real_msgs and charges > 0
    assert sum(r.bytes_sent for r in virt) == pytest.approx(sum(r.bytes_sent for r in real), rel=0.02)

    # the phase deadline follows the virtual bytes: k x the proxy's scatter, about the real stage's
    e_real, e_virt = real_reps[0][0], virt_reps[0][0]
    parts = sorted(e.me for e, *_ in virt_reps)
    plan_v = MergePlan.make(0, 0, b"s" * 32, parts, payload.proxy_numel, chunk_numel=e_virt.cfg.chunk_numel)
    plan_r = MergePlan.make(0, 0, b"s" * 32, parts, P, chunk_numel=cfg.chunk_numel)
    assert e_virt.cfg.chunk_numel == cfg.chunk_numel // K
    assert e_virt.phase_bytes(plan_v) == pytest.approx(e_real.phase_bytes(plan_r), rel=1e-3)
    assert e_virt.phase_bytes(plan_v) == pytest.approx(scatter_bytes(n, P, "int8"), rel=1e-3)
    assert phase_deadline_s(e_virt.cfg, e_virt.phase_bytes(plan_v), True) > 10 * phase_deadline_s(
        e_virt.cfg, scatter_bytes(n, payload.proxy_numel, "int8"), True) / K


def test_a_virtual_message_longer_than_the_progress_timeout_is_not_cut():
    """Replica 0 on a 2.4 Mbit/s uplink (the declared uplink), replica 1 on a fast one: one real int8
    chunk of 2^17 values (133 kB) takes 0.44 s from replica 0, longer than the 0.3 s progress
    timeout, and its virtual bytes are seen by replica 1 only when the whole message arrives (no real
    byte crosses while they are charged; replica 1's own sends are over by then). Both virtual engines
    size their watch for LINK_STREAMS such messages at the declared uplink, so both merge (with the
    run's 0.3 s watch, both abandoned the attempt: "incomplete")."""
    cfg = MergeConfig(every_steps=1, join_timeout_s=5.0, phase_timeout_s=2.0, progress_timeout_s=0.3, max_attempts=1,
                      outer_lr=1.0, outer_momentum=0.0, quantization="int8", chunk_numel=1 << 17,
                      assumed_uplink_bps=2.4e6).validate()
    payload = VirtualPayload(1 << 19, K)
    proxies = [ProxyStage(payload, seed=3) for _ in range(2)]
    res, wall, reps = asyncio.run(_merge("slow", proxies, lambda me, params, t: VirtualMergeEngine(
        me, cfg, params, t, run_id="virtual", stage=1), lambda i, m: m.drift(1, tag=i, size=1e-2),
        rate_bps=[2.4e6, RATE_BPS]))
    assert [r.status for r in res] == ["merged", "merged"], [(r.status, r.reason) for r in res]
    assert all(torch.equal(flat(proxies[0]), flat(x)) for x in proxies[1:])
    for e, *_ in reps:
        assert e.cfg.progress_timeout_s >= 2 * 131_072 * 1.016 / 0.3e6 > cfg.progress_timeout_s
    assert wall >= (1 << 19) * 1.0 / 0.3e6                 # the uplinks carried the real bytes: a scatter's worth


def test_the_virtual_scale_keeps_the_proxy_small_and_the_chunks_valid_at_8b():
    run = load_config("configs/8b.yaml")
    mc = run.merge
    p = VirtualPayload.for_stage(1_616_031_744, mc)
    assert p.proxy_numel <= 1 << 20 and p.virtual_numel - p.true_numel < p.scale
    vc = p.merge_config(mc, link_bytes_per_s=100e6 / 8)
    assert vc.chunk_numel * p.scale == mc.chunk_numel and vc.validate()
    # one real int8 chunk message (4.2 MB) at 100 Mbit/s: the per-message progress watch allows it
    assert vc.progress_timeout_s >= 2 * 4.2e6 / (100e6 / 8)
    with pytest.raises(ValueError):
        VirtualPayload(0, 4)


def test_emulated_miners_merge_their_stage_with_virtual_payloads(tmp_home, tmp_path, wikitext_path, cache_dir):
    """3 x 2 emulated miners behind the real data plane and validator, merging every 2 inner steps:
    every replica applies its merges with its stage's other replica over signed HTTP, on a proxy of at
    most 4,096 values whose messages stand for the stage's real bytes (counted in its merge reports;
    the links are not shaped here: the first test checks the charges)."""
    steps, H = 4, 2

    async def main():
        net = P2PNet(tmp_path, wikitext_path, cache_dir,
                     overrides={"merge": {"every_steps": H, "join_timeout_s": 5.0, "quantization": "int8"}})
        emu = Emulation(parse_accelerator("2e12", 4.0), 0.5, 1.0, max_proxy=4096)
        await net.start(parts=emulated_parts(emu))
        try:
            vali = net.validator(steps=steps)
            assert await vali.run() == 0
            return net.status(), {k: (m.merge.history, m.merge.status(), m.worker.merge_module)
                                  for k, m in net.miners.items()}
        finally:
            await net.close()
    st, merges = run(main(), timeout=120)
    assert st["done"] and st["steps_done"] == {"0": steps, "1": steps}, st
    for key, (hist, status, proxy) in merges.items():
        applied = [h for h in hist if h.applied]
        assert len(applied) == steps // H and all(len(h.participants) == 2 for h in applied), \
            (key, [(h.epoch, h.status, h.reason) for h in hist])
        v = status["virtual"]
        assert v["scale"] > 1 and v["proxy_numel"] <= 4096 and v["proxy_numel"] == proxy.flat.numel()
        assert v["virtual_sent"] > 0, (key, v)      # (no link shaped here: nothing charged, bytes counted)
        # int8, 2 replicas: a scatter sends about the stage's true parameter count in bytes, not the proxy's
        assert all(h.bytes_sent >= v["true_numel"] for h in applied), [h.bytes_sent for h in applied]
    for s in range(3):      # the stage's replicas hold the same merged proxy
        assert torch.equal(merges[(s, 0)][2].flat.detach(), merges[(s, 1)][2].flat.detach())
