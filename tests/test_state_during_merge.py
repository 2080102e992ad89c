"""A replica in the middle of a merge answers ``/state`` from its kept state without waiting for the
merge (merge.overlap off, the default): within 1 s plus the transfer of a tiny stage's weights, and
the weights it names by (step, merges) are the ones it holds."""
from __future__ import annotations

import asyncio
import time

import pytest
import torch

from iota_subnet.merge import MergeEngine
from iota_subnet.miner.parts import MinerParts
from iota_subnet.protocol import StateRequest, StateResponse
from iota_subnet.transport import NeuronClient
from support.merge_net import RUN, Net, flat

pytestmark = pytest.mark.timeout(120)


class HeldMergeEngine(MergeEngine):
    """A merge engine whose merges wait for :attr:`release` before they start (a slow merge)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.release = asyncio.Event()
        self.started = asyncio.Event()

    async def merge(self, epoch, peers):
        self.started.set()
        await self.release.wait()
        return await super().merge(epoch, peers)


def test_state_is_served_during_a_merge_without_waiting(tmp_path, tmp_home):
    async def main():
        net = Net(tmp_path)
        await net.start(2, parts={0: MinerParts(make_merge_engine=HeldMergeEngine)})
        try:
            a, b = net.svcs
            assert not a.cfg.merge.overlap
            a.worker.inner_step = a.cfg.merge.every_steps
            a.merging.start_merge(0)
            await asyncio.wait_for(a.merge.started.wait(), 10)
            assert not a.merging.task.done()                 # the merge is running (held)
            async with NeuronClient(b.wallet) as cl:
                t0 = time.monotonic()
                resp = await cl.call(a.server.endpoint, a.hotkey, "/state", StateRequest(run_id=RUN, stage=1),
                                     StateResponse, timeout_s=30, retries=0)
                took = time.monotonic() - t0
            assert not a.merging.task.done()                 # answered while the merge still runs
            assert took < 1.0 + 1.0, took                   # 1 s plus the transfer of ~0.1 MB on loopback
            assert resp.state_meta["step"] == a.worker.inner_step and resp.state_meta["merges"] == a.worker.merges
            got = torch.cat([resp.tensors[k].reshape(-1) for k in a.worker.module.state_dict()])
            assert torch.equal(got, torch.cat([v.reshape(-1) for v in a.worker.module.state_dict().values()]))
            assert got.numel() == flat(a).numel()
        finally:
            a.merge.release.set()
            await net.close()

    asyncio.run(main())
