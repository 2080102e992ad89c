#!/usr/bin/env python
"""State sync over emulated links: a joiner fetches a stage's merged state from donors, with a window
of chunk requests in flight and with one request per donor at a time (the behaviour before the window).

Donors are :class:`~iota_subnet.merge.sync.SnapshotDonor` behind their own NeuronServer on 127.0.0.1,
each with its own uplink (``--donor-link``; ``:DELAY`` such as ``:50ms``: the delay only, the rate
not shaped); the joiner is a NeuronClient with its own uplink and
downlink (``--joiner-link``, ``UP/DOWN:DELAY``), all in this process (per-instance shapers, the
process link stays unshaped). The snapshot is ``--mb`` MB of float32 in chunks of ``--chunk-numel``
values; donors serve ``--max-concurrent`` chunks at once. Each row prints the wall time, payload /
downlink rate, and the time scaled to ``--scale-gb`` GB (an ``8b`` head stage: anchor and momentum,
~12.9 GB): wall x scale-gb / mb (the fixed describe round trip is small next to either).

The emulated downlink is store-and-forward (:mod:`iota_subnet.transport.shaping`): with donors whose
uplinks are shaped too, a chunk pays both transfer times, which real (cut-through) links do not; the
default donor link therefore shapes the delay only, so the joiner's downlink is the one bottleneck
(donors on faster uplinks than the joiner's downlink).

``--time-scale K`` runs every link K times slower (rate / K, delay x K) so the host's CPU (hashing,
signing, copying chunks, shared with the donors in this process) stays off the critical path;
times are reported in emulated time (wall / K), as with ``localnet --time-scale``.

``--merge-every-s I`` (emulated seconds): the donors merge every ``I`` seconds while the joiner
syncs (a seeded int8 mean applied by the outer step, kept for replay and published, as a merge's
``on_applied`` does). The joiner syncs the snapshot it started on (the donors keep serving it), then
replays the merges applied meanwhile (:mod:`iota_subnet.merge.replay`, ``/state/replay``) until it
holds the donors' newest state. The row gives the time to that state beside the model
``S / (1 - r / I)`` (``S``: snapshot / downlink, ``r``: one merge's int8 mean / downlink). With the
default ``--mb 64`` and ``I = 1.47`` the ratios are an ``8b`` stage 0's at ``H = 10`` on 100 Mbit/s
(``S / I = 3.5``, ``r / I = 0.44``).

Usage::

    python scripts/bench_sync.py [--mb 64] [--donors 1,2] [--joiner-link 100mbit/100mbit:50ms] \
        [--donor-link :50ms] [--chunk-numel 1048576] [--window 8] [--time-scale 4] [--json]
        [--merge-every-s 1.47]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from bittensor.sp_core import Keypair  # noqa: E402

from iota_subnet.merge.outer import quantize  # noqa: E402
from iota_subnet.merge.replay import AppliedMerge, apply_merges, replay_to_newest  # noqa: E402
from iota_subnet.merge.sync import SnapshotDonor, sync_state  # noqa: E402
from iota_subnet.merge.transport import HttpTransport  # noqa: E402
from iota_subnet.protocol import StateChunkRequest, StateReplayRequest  # noqa: E402
from iota_subnet.transport import NeuronClient, NeuronServer  # noqa: E402
from iota_subnet.transport.shaping import DownlinkShaper, LinkSpec, UplinkShaper, parse_link  # noqa: E402


async def run(args, n_donors: int, window: int) -> dict:
    P = int(args.mb * 1e6) // 8                       # anchor and momentum: 2P float32
    g = torch.Generator().manual_seed(0)
    anchor, momentum = torch.randn(P, generator=g), torch.randn(P, generator=g)
    k = args.time_scale
    jl = parse_link(args.joiner_link).scaled(k)
    dl = (LinkSpec(None, parse_link("1bit" + args.donor_link).delay_s) if args.donor_link.startswith(":")
          else parse_link(args.donor_link)).scaled(k)
    servers, eps, donors = [], {}, []
    for j in range(n_donors):
        kp = Keypair.create_from_uri(f"//Donor{j}")
        donor = SnapshotDonor("bench", 1, chunk_numel=args.chunk_numel, max_concurrent=args.max_concurrent)
        donor.publish(anchor, momentum, merged_epoch=3, step=30)
        await donor.manifest()                        # hashed before the clock starts, as after a merge
        srv = NeuronServer(kp, "127.0.0.1", 0, shaper=UplinkShaper(dl))

        async def chunk(msg, ctx, donor=donor):
            return await donor.handle(msg, ctx.caller_hotkey, on_sent=ctx.on_sent)
        async def replay(msg, ctx, donor=donor):
            return await donor.handle_replay(msg, ctx.caller_hotkey, on_sent=ctx.on_sent)
        srv.add_route("/state/chunk", chunk, StateChunkRequest)
        srv.add_route("/state/replay", replay, StateReplayRequest)
        donors.append(donor)
        await srv.start()
        servers.append(srv)
        eps[srv.hotkey] = srv.endpoint
    down = DownlinkShaper(jl.down_rate_bps) if jl.down_rate_bps else None
    client = NeuronClient(Keypair.create_from_uri("//Joiner"), shaper=UplinkShaper(jl), downlink=down)
    state = {"epoch": 3, "anchor": anchor, "momentum": momentum}

    async def merge_every(interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s * k)
            e = state["epoch"] + 1
            gm = torch.Generator().manual_seed(e)
            chunks = []
            for off in range(0, P, args.chunk_numel):
                q, sc = quantize(torch.randn(min(args.chunk_numel, P - off), generator=gm) * 1e-3, "int8")
                chunks.append((off, "int8", q, sc))
            am = AppliedMerge(state["epoch"], e, 256, chunks)
            a2, m2 = await asyncio.to_thread(apply_merges, state["anchor"], state["momentum"], [am], lr=0.7,
                                             mu=0.9, nesterov=True)
            state.update(epoch=e, anchor=a2, momentum=m2)
            for d in donors:
                d.record(am)
                d.publish(a2, m2, merged_epoch=e, step=10 * (e + 1))
    merging = asyncio.ensure_future(merge_every(args.merge_every_s)) if args.merge_every_s else None
    extra: dict = {}
    try:
        with tempfile.TemporaryDirectory() as wd:
            transport = HttpTransport(client, eps.get, timeout_s=120)
            t0 = time.perf_counter()
            a, m, man = await sync_state(list(eps), transport, run_id="bench",
                                         stage=1, param_numel=P, work_dir=wd, window=window)
            wall = (time.perf_counter() - t0) / k      # emulated seconds
            if merging is not None:
                snap_epoch = man["merged_epoch"]
                a, m, newest = await replay_to_newest(list(eps), transport, run_id="bench", stage=1, anchor=a,
                                                      momentum=m, epoch=snap_epoch, lr=0.7, mu=0.9, nesterov=True,
                                                      block=256, window=window)
                in_sync = (time.perf_counter() - t0) / k
                merging.cancel()
                rate_b = (jl.down_rate_bps or dl.rate_bps) * k / 8
                S, r = 8 * P / rate_b, P * (1 + 4 / 256) / rate_b
                extra = {"merge_every_s": args.merge_every_s, "snapshot_epoch": snap_epoch,
                         "in_sync_epoch": newest["merged_epoch"], "replayed_merges": newest["replay"]["merges"],
                         "replay_rounds": newest["replay"]["rounds"], "replay_mb": newest["replay"]["bytes"] / 1e6,
                         "in_sync_s": round(in_sync, 2),
                         "model_s": round(S / (1 - r / args.merge_every_s), 2) if r < args.merge_every_s else None,
                         "retained_chunks_served": sum(d.served_retained for d in donors)}
                assert torch.equal(a, state["anchor"]) or newest["merged_epoch"] < state["epoch"]
            else:
                assert torch.equal(a, anchor) and torch.equal(m, momentum)
    finally:
        if merging is not None:
            merging.cancel()
        await client.close()
        for s in servers:
            await s.stop()
    rate = (jl.down_rate_bps or dl.rate_bps) * k / 8
    payload = 8 * P
    return {"donors": n_donors, "window": window, "chunks": man["sync"]["chunks"], "payload_mb": payload / 1e6,
            "wall_s": round(wall, 2), "payload_over_rate_s": round(payload / rate, 2),
            "x_ideal": round(wall / (payload / rate), 3),
            f"scaled_to_{args.scale_gb:g}gb_min": round(wall * args.scale_gb * 1e9 / payload / 60, 1),
            "busy": man["sync"]["busy"], **extra}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=float, default=64.0, help="snapshot size (anchor + momentum), MB")
    ap.add_argument("--donors", default="1,2", help="comma-separated donor counts")
    ap.add_argument("--joiner-link", default="100mbit/100mbit:50ms")
    ap.add_argument("--donor-link", default=":50ms", help="RATE:DELAY, or :DELAY for the delay only")
    ap.add_argument("--chunk-numel", type=int, default=1 << 20, help="values per chunk (merge.sync_chunk_numel)")
    ap.add_argument("--max-concurrent", type=int, default=2, help="merge.max_concurrent_transfers of each donor")
    ap.add_argument("--window", type=int, default=8, help="merge.sync_window of the joiner")
    ap.add_argument("--time-scale", type=float, default=4.0, help="run links this many times slower")
    ap.add_argument("--scale-gb", type=float, default=12.9, help="extrapolate to this many GB")
    ap.add_argument("--merge-every-s", type=float, default=0.0,
                    help="donors merge every this many emulated seconds while the joiner syncs (0: never)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = []
    for n in (int(x) for x in args.donors.split(",")):
        for window, what in ((n, "one request per donor"), (args.window, f"window {args.window}")):
            r = asyncio.run(run(args, n, window))
            r["mode"] = what
            rows.append(r)
            if not args.json:
                print(f"{n} donor(s), {what:22s}: {r['wall_s']:6.2f} s (emulated) for {r['payload_mb']:.0f} MB "
                      f"({r['chunks']} chunks; payload/rate {r['payload_over_rate_s']:.2f} s, x{r['x_ideal']:.2f}); "
                      f"at {args.scale_gb:g} GB: {r[f'scaled_to_{args.scale_gb:g}gb_min']} min", flush=True)
    if args.json:
        print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
