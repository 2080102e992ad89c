"""A neuron behind a NAT, run inside a home namespace by tests/test_relay_nat.py:

    python tests/support/relay_home.py RELAY_IP:PORT RELAY_HOTKEY_URI HOME_URI PORT_FILE [PUBLIC_IP:PORT PUBLIC_URI]
    python tests/support/relay_home.py RELAY_IP:PORT --doctor

It serves ``/hop`` (echo: the data times 2) on 0.0.0.0, attaches to the relay over an outbound
WebSocket and writes its own port to PORT_FILE once attached. With a public peer it then calls that
peer's ``/hop`` once, directly (out through the NAT). Every 0.2 s it writes its path record
(:mod:`iota_subnet.transport.paths`, as in a neuron's status.json) to PORT_FILE + ``.status.json``.
With ``--doctor`` it instead prints ``iota-subnet doctor``'s reachability verdict for a port of its
own, asking the relay's peer probe.
"""
from __future__ import annotations

import asyncio
import json
import os
import sys

import torch
from bittensor.sp_core import Keypair

from iota_subnet.doctor.checks import DoctorOptions, peer_checks
from iota_subnet.protocol import Hop
from iota_subnet.transport import NeuronClient, NeuronServer
from iota_subnet.transport.paths import path_book
from iota_subnet.transport.relay import RelayTunnel


async def serve(relay: str, relay_uri: str, home_uri: str, port_file: str, public: str = "", public_uri: str = "") -> None:
    key = Keypair.create_from_uri(home_uri)

    async def hop(msg: Hop, ctx) -> Hop:
        return Hop(microbatch_id=msg.microbatch_id, data=msg.data * 2, info={"caller": ctx.caller_hotkey})
    server = NeuronServer(key, "0.0.0.0", 0, None, None)
    server.add_route("/hop", hop, Hop)
    await server.start()
    tunnel = RelayTunnel(key, [(relay, Keypair.create_from_uri(relay_uri).ss58_address)], f"127.0.0.1:{server.port}")
    stop = asyncio.Event()
    task = asyncio.create_task(tunnel.run(stop))
    await asyncio.wait_for(tunnel.attached.wait(), 20)
    if public:
        async with NeuronClient(key) as client:
            await client.call(public, Keypair.create_from_uri(public_uri).ss58_address, "/hop",
                              Hop(microbatch_id="from-home", data=torch.ones(1, 2, 4)), Hop, timeout_s=10)
    with open(port_file, "w") as f:
        f.write(str(server.port))
    while not task.done():
        tmp = f"{port_file}.status.tmp"
        with open(tmp, "w") as f:
            json.dump({"hotkey": key.ss58_address, "paths": path_book().snapshot(key.ss58_address)}, f)
        os.replace(tmp, f"{port_file}.status.json")
        await asyncio.sleep(0.2)
    await task


async def doctor(relay: str) -> None:
    checks = await peer_checks(DoctorOptions(host="0.0.0.0", port=18765, peers=[relay], bandwidth_bytes=1 << 16), [])
    for c in checks:
        print("\n".join(c.lines()), flush=True)


if __name__ == "__main__":
    if "--doctor" in sys.argv:
        asyncio.run(doctor(sys.argv[1]))
    else:
        asyncio.run(serve(*sys.argv[1:7]))
