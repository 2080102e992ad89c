#!/usr/bin/env python
"""Link emulator vs kernel: signed HTTP throughput through ``--link`` shaping and through ``tc tbf``.

For each rate, the same client sends ``--requests`` signed POSTs of ``--mb`` MB each (one after the
other) to a NeuronServer in a child process:

* ``kernel``: the server runs in a network namespace on a veth pair shaped by ``tc tbf`` at the rate
  (:class:`iota_subnet.sim.netns.NetnsLink`; needs root), the client is not shaped;
* ``emulator``: the server runs on 127.0.0.1 and the client's uplink is an
  :class:`~iota_subnet.transport.shaping.UplinkShaper` at the same rate and burst.

Goodput = request body bytes / seconds. Both count the same overheads in the rate (HTTP head, TCP/IP
and Ethernet headers per segment), so the ratio emulator / kernel should be close to 1. Delay is not
compared (the kernel here has no netem).

Usage::

    sudo python scripts/bench_link.py --rates 20mbit,100mbit --mb 4 --requests 5 [--json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from bittensor.sp_core import Keypair  # noqa: E402

from iota_subnet.sim.netns import NetnsLink, netns_available  # noqa: E402
from iota_subnet.protocol import Health, Hop, encode  # noqa: E402
from iota_subnet.transport import NeuronClient, NeuronServer  # noqa: E402
from iota_subnet.transport.shaping import UplinkShaper, parse_link  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SERVER_URI, CLIENT_URI = "//IotaLinkBenchServer", "//IotaLinkBenchClient"
BURST = 32 << 10


def _payload(nbytes: int) -> torch.Tensor:
    return torch.zeros(max(1, nbytes // (4 * 1024)), 1024)            # fp32 [n, 1024]


async def _serve(host: str) -> None:
    server = NeuronServer(Keypair.create_from_uri(SERVER_URI), host, 0, max_body_bytes=256 << 20)

    async def take(msg: Hop, ctx) -> Health:
        return Health(run_id="bench", stats={"numel": float(msg.data.numel())})
    server.add_route("/take", take, Hop)
    port = await server.start()
    print(f"PORT {port}", flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)                 # until the parent closes stdin
    await server.stop()


def _start_server(argv_prefix: list[str], host: str) -> tuple[subprocess.Popen, int]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([*argv_prefix, sys.executable, str(Path(__file__).resolve()), "--serve", host],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)
    line = proc.stdout.readline()
    if not line.startswith("PORT "):
        proc.kill()
        raise RuntimeError(f"bench server did not start (got {line!r})")
    return proc, int(line.split()[1])


async def _send(endpoint: str, nbytes: int, requests: int, shaper: Optional[UplinkShaper]) -> float:
    server_hk = Keypair.create_from_uri(SERVER_URI).ss58_address
    async with NeuronClient(Keypair.create_from_uri(CLIENT_URI), shaper=shaper, verify_responses=True) as c:
        msg = Hop(run_id="bench", data=_payload(nbytes))
        await c.call(endpoint, server_hk, "/take", Hop(run_id="bench", data=_payload(4096)), Health,
                     timeout_s=120)                                  # connect, warm up
        t0 = time.perf_counter()
        for _ in range(requests):
            await c.call(endpoint, server_hk, "/take", msg, Health, timeout_s=300, retries=0)
        return time.perf_counter() - t0


def measure(mode: str, rate: str, nbytes: int, requests: int) -> dict:
    """Goodput (body bits/s) of ``requests`` POSTs of ``nbytes`` through ``mode`` = kernel | emulator."""
    link = parse_link(rate)
    body = len(encode(Hop(run_id="bench", data=_payload(nbytes))))
    if mode == "kernel":
        with NetnsLink(link.rate_bps, burst_bytes=BURST) as ns:
            proc, port = _start_server(["ip", "netns", "exec", ns.ns], ns.ns_ip)
            try:
                secs = asyncio.run(_send(f"{ns.ns_ip}:{port}", nbytes, requests, None))
            finally:
                proc.stdin.close()
                proc.wait(30)
    elif mode == "emulator":
        proc, port = _start_server([], "127.0.0.1")
        try:
            secs = asyncio.run(_send(f"127.0.0.1:{port}", nbytes, requests, UplinkShaper(link, burst_bytes=BURST)))
        finally:
            proc.stdin.close()
            proc.wait(30)
    else:
        raise ValueError(f"mode {mode!r}")
    return {"mode": mode, "rate": rate, "rate_bps": link.rate_bps, "body_bytes": body, "requests": requests,
            "seconds": secs, "goodput_bps": 8 * body * requests / secs,
            "goodput_share_of_rate": 8 * body * requests / secs / link.rate_bps}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    p.add_argument("--rates", default="20mbit,100mbit")
    p.add_argument("--mb", type=float, default=4.0, help="MB per request")
    p.add_argument("--requests", type=int, default=5)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if a.serve:
        asyncio.run(_serve(a.serve))
        return 0
    ok, why = netns_available()
    if not ok:
        print(f"kernel comparison not available: {why}", file=sys.stderr)
        return 2
    for rate in [r.strip() for r in a.rates.split(",") if r.strip()]:
        k = measure("kernel", rate, int(a.mb * 1e6), a.requests)
        e = measure("emulator", rate, int(a.mb * 1e6), a.requests)
        row = {"rate": rate, "mb_per_request": a.mb, "requests": a.requests,
               "kernel_goodput_mbit": k["goodput_bps"] / 1e6, "emulator_goodput_mbit": e["goodput_bps"] / 1e6,
               "emulator_over_kernel": e["goodput_bps"] / k["goodput_bps"],
               "kernel_share_of_rate": k["goodput_share_of_rate"], "emulator_share_of_rate": e["goodput_share_of_rate"]}
        print(json.dumps(row) if a.json else "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                                       for k, v in row.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
