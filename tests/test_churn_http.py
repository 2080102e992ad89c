"""Churn over real signed HTTP on 127.0.0.1: a state-sync donor's cap covers the send (not only the
copy), a late joiner waits for its peers to see it and catches up instead of training from the
seeded initialisation, and a restarted replica uses its own merge-state file while its peer is
stopped."""
from __future__ import annotations

import asyncio
import time

import pytest
import torch

from iota_subnet.merge.sync import SnapshotDonor
from iota_subnet.protocol import Outcome, ProtocolError, StateChunk, StateChunkRequest
from iota_subnet.transport import NeuronClient, NeuronServer
from iota_subnet.transport.shaping import LinkSpec, UplinkShaper
from test_validator_driver import make_wallet

pytestmark = pytest.mark.timeout(180)


def test_donor_cap_covers_the_send_to_slow_joiners(tmp_home):
    """Issue 13: a donor capped at 2 concurrent transfers served six slow joiners at once (six 4 MB
    transfers): the cap covered only the in-memory copy, not the send."""
    P = 1 << 20
    donor = SnapshotDonor("r", 1, chunk_numel=1 << 20, max_concurrent=2)     # one chunk = 4 MiB
    donor.publish(torch.randn(P), torch.randn(P), merged_epoch=2, step=30)
    root = tmp_home / "wallets"
    dw = make_wallet(root, "donor")
    joiners = [make_wallet(root, f"joiner{i}") for i in range(6)]
    shaper = UplinkShaper(LinkSpec(rate_bps=80e6))      # 4 MiB leave in ~0.4 s
    sending = [0, 0]                                    # now, peak (responses over 1 MiB in the uplink)
    transmit = shaper.transmit

    async def counted(nbytes):
        big = nbytes > (1 << 20)
        sending[0] += big
        sending[1] = max(sending[1], sending[0])
        try:
            await transmit(nbytes)
        finally:
            sending[0] -= big
    shaper.transmit = counted

    async def main():
        server = NeuronServer(dw, "127.0.0.1", 0, None, None, shaper=shaper)

        async def chunk(msg, ctx):
            return await donor.handle(msg, ctx.caller_hotkey, on_sent=ctx.on_sent)
        server.add_route("/state/chunk", chunk, StateChunkRequest)
        await server.start()
        clients = [NeuronClient(w) for w in joiners]
        try:
            man = (await clients[0].call(server.endpoint, server.hotkey, "/state/chunk",
                                         StateChunkRequest(run_id="r", stage=1), StateChunk, retries=0)).manifest

            async def fetch(cl, i):
                try:
                    r = await cl.call(server.endpoint, server.hotkey, "/state/chunk", StateChunkRequest(
                        run_id="r", stage=1, snapshot_id=man["snapshot_id"], offset=(i % 2) * P, numel=P),
                        StateChunk, retries=0, timeout_s=60)
                    return r.data.numel()
                except ProtocolError as e:
                    return e.outcome
            return await asyncio.gather(*(fetch(cl, i) for i, cl in enumerate(clients)))
        finally:
            for cl in clients:
                await cl.close()
            await server.stop()
    res = asyncio.run(main())
    assert sending[1] <= 2, f"{sending[1]} state transfers in the uplink at once (cap 2); results {res}"
    assert res.count(P) >= 2 and res.count(Outcome.BUSY) == 6 - res.count(P)
    assert donor.peak_active <= 2 and donor.active == 0          # every slot released after its send
