"""Merges over signed HTTP on slow uplinks: progress is measured in bytes, not messages.

Three replicas, each with its own :class:`NeuronServer`, :class:`NeuronClient` and emulated uplink
(0.3 MB/s): one merge message (a shard of 512 KB) takes ~1.7 s to cross, longer than the progress
timeout (1 s). Bodies travel in pieces (:mod:`iota_subnet.transport.streaming`), the sender's client
and the receiver's server both report each piece to the merge engine (``on_progress``,
``on_body_bytes``), so no wait is cut while bytes move. Before, a body crossed the emulated link as
one block and nothing was seen for the whole transfer: every attempt ended "incomplete" and the
replicas merged alone (a ``tiny_merge`` localnet at 0.8 Mbit/s: every merge of every stage).
"""
from __future__ import annotations

import asyncio
import time

import pytest
import torch
from bittensor.sp_core import Keypair

from iota_subnet.config import MergeConfig
from iota_subnet.merge import MergeEngine, ModuleParams
from iota_subnet.merge.transport import HttpTransport
from iota_subnet.transport import NeuronClient, NeuronServer
from iota_subnet.transport.shaping import LinkSpec, UplinkShaper

from support.merge_routes import mount_merge_routes

pytestmark = pytest.mark.timeout(120)

UP_BPS = 2.4e6            # 0.3 MB/s per replica
P = 3 * 131072            # values: three shards of 512 KB (fp32)


async def _replicas(n: int, cfg: MergeConfig):
    keys = [Keypair.create_from_uri(f"//Progress{i}") for i in range(n)]
    endpoints: dict[str, str] = {}
    out = []
    for i, kp in enumerate(keys):
        shaper = UplinkShaper(LinkSpec(UP_BPS, 0.0))
        client = NeuronClient(kp, shaper=shaper)
        transport = HttpTransport(client, endpoints.get, timeout_s=cfg.phase_timeout_s + 5)
        torch.manual_seed(0)                 # the same start on every replica (the merge's anchor)
        m = torch.nn.Linear(P // 8, 8, bias=False)
        engine = MergeEngine(kp.ss58_address, cfg, ModuleParams(m), transport, run_id="progress", stage=0)
        with torch.no_grad():                # local training: replica-specific steps
            m.weight.add_(torch.randn(m.weight.shape, generator=torch.Generator().manual_seed(100 + i)) * 1e-2)
        server = NeuronServer(kp, host="127.0.0.1", shaper=shaper, max_body_bytes=8 << 20)

        mount_merge_routes(server, engine)
        await server.start()
        endpoints[kp.ss58_address] = server.endpoint
        out.append((engine, m, client, server, shaper))
    return out


def test_a_merge_whose_messages_outlast_the_progress_timeout_completes_over_http():
    cfg = MergeConfig(every_steps=1, join_timeout_s=5.0, phase_timeout_s=2.0, progress_timeout_s=1.0,
                      max_attempts=1, outer_lr=1.0, outer_momentum=0.0).validate()

    async def main():
        reps = await _replicas(3, cfg)
        try:
            engines = [r[0] for r in reps]
            before = [torch.cat([p.detach().reshape(-1) for p in r[1].parameters()]).clone() for r in reps]
            peers = [e.me for e in engines]
            t0 = time.monotonic()
            res = await asyncio.gather(*(e.merge(0, peers) for e in engines))
            return res, time.monotonic() - t0, before, reps
        finally:
            for r in reps:
                await r[3].stop()
                await r[2].close()
    res, wall, before, reps = asyncio.run(main())
    assert all(r.status == "merged" for r in res), [(r.status, r.reason) for r in res]
    after = [torch.cat([p.detach().reshape(-1) for p in r[1].parameters()]) for r in reps]
    assert all(torch.equal(after[0], a) for a in after[1:])                  # bit-identical
    assert torch.allclose(after[0], sum(before) / 3, atol=1e-6)              # plain averaging
    # each replica sent ~4/3 x 1.5 MB of slices and ~0.5 MB of means at 0.3 MB/s: several seconds,
    # every message longer than the progress timeout
    shard_s = 4 * P / 3 / (UP_BPS / 8)
    assert shard_s > 1.5 * cfg.progress_timeout_s
    assert wall > 2 * shard_s, wall
    assert all(r[4].payload_bytes > 4 * P for r in reps)
