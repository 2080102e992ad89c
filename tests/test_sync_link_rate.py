"""State sync at link rate: a joining MinerService fetches the merged state of stage 0 (``tiny`` with a
16k-token embedding: ~8.7 MB of anchor and momentum, 34 chunks of 256 KiB) from two donor replicas
over signed HTTP on 127.0.0.1, through an emulated downlink and a one-way delay of 50 ms each way.

Shaping only the joiner in a process that also runs the donors: every NeuronClient and NeuronServer
takes its own shapers (``shaper``, ``downlink``), so the test sets them on the live objects: the
joiner's merge client gets a 50 ms uplink (its requests) and the 2 MB/s downlink (the chunks it
reads), each donor's server a 50 ms uplink (its replies); the process link stays unshaped.

At 2 MB/s, with a window of requests in flight, the sync takes payload / downlink rate (within
1.25x). At 8 MB/s, where a chunk's round trip (100 ms) is longer than its transfer (33 ms), one
request per donor at a time (``window`` = number of donors, the behaviour before the window) leaves
the link idle most of the time; the window fetches the same state much faster. Run with ``-s`` to see the
figures (docs/BENCHMARKS.md, "State sync at link rate")."""
from __future__ import annotations

import asyncio
import time

import pytest
import torch

from iota_subnet.merge.sync import sync_state
from iota_subnet.transport.shaping import DownlinkShaper, LinkSpec, UplinkShaper
from support.merge_net import OVR, RUN, Net, merge_epoch, train_locally

pytestmark = pytest.mark.timeout(120)

DOWN_BPS = 16e6                 # the joiner's downlink: 2 MB/s
FAST_DOWN_BPS = 64e6            # 8 MB/s: the round trips dominate
DELAY_S = 0.05                  # one-way, on every request and every reply
CHUNK_NUMEL = 65536             # 256 KiB chunks


def test_joiner_syncs_at_its_downlink_rate_and_the_window_beats_one_request_per_donor(tmp_path, tmp_home):
    ovr = {**OVR, "model": {**OVR["model"], "vocab_size": 16384}, "data": {"seq_len": 16, "vocab_size": 16384},
           "merge": {**OVR["merge"], "sync_chunk_numel": CHUNK_NUMEL, "max_concurrent_transfers": 4}}

    async def main():
        net = Net(tmp_path, stage=0, ovr=ovr)
        await net.start(2)
        try:
            for k, s in enumerate(net.svcs):
                train_locally(s, k)
            assert all(r.applied for r in await merge_epoch(net.svcs, 0))
            d0, d1 = net.svcs
            joiner = await net.add()
            for s in net.svcs:
                s.view.last_refresh = 0
                await s.refresh()
            for _ in range(200):                      # its own catch-up (unshaped) first
                if joiner.merging.sync_task.done():
                    break
                await asyncio.sleep(0.1)
            assert joiner.merging.sync_task.done()
            for d in (d0, d1):
                d.server.shaper = UplinkShaper(LinkSpec(None, DELAY_S))
            client = joiner.merge.transport.client
            client.shaper = UplinkShaper(LinkSpec(None, DELAY_S))
            P = joiner.merge.params.numel
            payload = 8 * P                           # anchor and momentum, float32
            peers = joiner.view.stage_peers()
            assert sorted(peers) == sorted([d0.hotkey, d1.hotkey])

            async def timed(window, name, down_bps):
                client.downlink = down = DownlinkShaper(down_bps)
                t0 = time.perf_counter()
                a, m, man = await sync_state(peers, joiner.merge.transport, run_id=RUN, stage=0, param_numel=P,
                                             work_dir=tmp_path / name, window=window)
                wall = time.perf_counter() - t0
                assert torch.equal(a, d0.merge.anchor) and torch.equal(m, d0.merge.momentum)
                assert man["sync"]["bytes"] == payload and not man["sync"]["dropped"], man["sync"]
                return wall, down, man["sync"]

            windowed, down, st = await timed(net.cfg.merge.sync_window, "windowed", DOWN_BPS)
            if windowed > 1.25 * payload / (DOWN_BPS / 8):
                # the best of two: on a 2-core machine busy with other work the first try can lose a
                # second to the CPU (hashing, serialising), which is not the link's time
                again, down, st = await timed(net.cfg.merge.sync_window, "windowed_again", DOWN_BPS)
                print(f"\nstate sync at {DOWN_BPS / 1e6:g} Mbit/s took {windowed:.2f} s, again {again:.2f} s")
                windowed = min(windowed, again)
            fast, _, _ = await timed(net.cfg.merge.sync_window, "fast", FAST_DOWN_BPS)
            one_each, _, _ = await timed(2, "one_per_donor", FAST_DOWN_BPS)
            return P, payload, windowed, fast, one_each, down, st
        finally:
            await net.close()

    P, payload, windowed, fast, one_each, down, st = asyncio.run(main())
    ideal, fast_ideal = payload / (DOWN_BPS / 8), payload / (FAST_DOWN_BPS / 8)
    print(f"\nstate sync of {payload / 1e6:.2f} MB in {st['chunks']} chunks of {4 * CHUNK_NUMEL >> 10} KiB from "
          f"2 donors, downlink {DOWN_BPS / 1e6:g} Mbit/s, {DELAY_S * 1e3:g} ms each way: payload/rate {ideal:.2f} s; "
          f"window {st['window']}: {windowed:.2f} s ({windowed / ideal:.2f}x); downlink wire bytes {down.wire_bytes}; "
          f"at {FAST_DOWN_BPS / 1e6:g} Mbit/s (payload/rate {fast_ideal:.2f} s): window {st['window']} {fast:.2f} s "
          f"({fast / fast_ideal:.2f}x), one request per donor {one_each:.2f} s ({one_each / fast_ideal:.2f}x)")
    assert st["window"] == 8 and st["requests"] == st["chunks"] and st["busy"] == 0   # within the donors' caps
    assert windowed <= 1.25 * ideal, (windowed, ideal)
    assert windowed >= 0.95 * ideal                   # the downlink did shape it
    assert one_each >= 1.5 * fast, (one_each, fast)
