"""A neuron behind a NAT, run inside a home namespace by tests/test_relay_nat.py:

    python tests/support/relay_home.py RELAY_IP:PORT RELAY_HOTKEY_URI HOME_URI PORT_FILE [--doctor]

It serves ``/hop`` (echo: the data times 2) on 0.0.0.0, attaches to the relay over an outbound
WebSocket and writes its own port to PORT_FILE once attached. With ``--doctor`` it instead prints
``iota-subnet doctor``'s reachability verdict for a port of its own, asking the relay's peer probe.
"""
from __future__ import annotations

import asyncio
import sys

from bittensor.sp_core import Keypair

from iota_subnet.doctor.checks import DoctorOptions, peer_checks
from iota_subnet.protocol import Hop
from iota_subnet.transport import NeuronServer
from iota_subnet.transport.relay import RelayTunnel


async def serve(relay: str, relay_uri: str, home_uri: str, port_file: str) -> None:
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
    with open(port_file, "w") as f:
        f.write(str(server.port))
    await task


async def doctor(relay: str) -> None:
    checks = await peer_checks(DoctorOptions(host="0.0.0.0", port=18765, peers=[relay], bandwidth_bytes=1 << 16), [])
    for c in checks:
        print("\n".join(c.lines()), flush=True)


if __name__ == "__main__":
    if "--doctor" in sys.argv:
        asyncio.run(doctor(sys.argv[1]))
    else:
        asyncio.run(serve(*sys.argv[1:5]))
