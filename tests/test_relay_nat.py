"""A neuron behind a real NAT: a home namespace behind a router namespace that masquerades
(iptables), the relay on this side of the router's WAN. The home neuron opens no port anyone can
reach; callers reach it through the relay, signed end to end, and the doctor run inside the home
says "relay only". Needs root, ``ip netns`` and ``iptables`` (installed by ``make setup``); skipped
with the reason otherwise. Both masquerade kinds: port-preserving and ``--random-fully``."""
from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from bittensor.sp_core import Keypair

from iota_subnet.protocol import Hop
from iota_subnet.sim.netns import HomeRouter, nat_available
from iota_subnet.transport import NeuronClient, NeuronServer, TransportError
from iota_subnet.transport.probe import PeerProbe
from iota_subnet.transport.relay import RelayHost

pytestmark = pytest.mark.timeout(120)

OK, WHY = nat_available()
HOME_SCRIPT = Path(__file__).parent / "support" / "relay_home.py"
RELAY_URI, HOME_URI = "//relay-nat-relay", "//relay-nat-home"


@pytest.mark.skipif(not OK, reason=WHY)
@pytest.mark.parametrize("random_fully", [False, True], ids=["masquerade", "random-fully"])
def test_a_home_neuron_behind_a_nat_is_reached_through_the_relay(tmp_path, random_fully):
    with HomeRouter(random_fully=random_fully) as nat:
        async def main():
            relay_key = Keypair.create_from_uri(RELAY_URI)
            server = NeuronServer(relay_key, nat.public_ip, 0, None, None)
            relay = RelayHost(relay_key)
            relay.mount(server)
            for path, handler in PeerProbe(min_interval_s=0.0).handlers().items():
                server.add_public_get(path, handler)
            await server.start()
            port_file = tmp_path / "home.port"
            env_py = [sys.executable, str(HOME_SCRIPT)]
            home = subprocess.Popen(nat.exec_argv([*env_py, server.endpoint, RELAY_URI, HOME_URI, str(port_file)]),
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            caller = NeuronClient(Keypair.create_from_uri("//relay-nat-caller"))
            try:
                deadline = time.monotonic() + 60
                while not port_file.exists() and home.poll() is None and time.monotonic() < deadline:
                    await asyncio.sleep(0.2)
                assert port_file.exists(), home.stdout.read() if home.poll() is not None else "no attach in 60 s"
                home_port = int(port_file.read_text())
                home_hk = Keypair.create_from_uri(HOME_URI).ss58_address
                x = torch.randn(2, 4, 8)
                got = await caller.call(server.endpoint, home_hk, "/hop", Hop(microbatch_id="nat", data=x), Hop,
                                        timeout_s=10, retries=0)
                assert torch.equal(got.data, x * 2) and got.info == {"caller": caller.hotkey}
                # the relay saw the home's connection come from the router's WAN address, not the home's
                attached = relay.status()["attached"][home_hk]
                assert attached["from"] == nat.wan.ns_ip and attached["requests"] == 1
                # and nothing on this side can open a connection to the home neuron: its public address
                # (the router's WAN) forwards no port
                with pytest.raises(TransportError):
                    await caller.call(f"{nat.wan.ns_ip}:{home_port}", home_hk, "/hop", Hop(data=x), Hop,
                                      timeout_s=3, retries=0)
                # the doctor inside the home: relay only, with the fix
                out = await asyncio.to_thread(subprocess.run, nat.exec_argv([*env_py, server.endpoint, "--doctor"]),
                                              capture_output=True, text=True, timeout=60)
                lines = [l for l in out.stdout.splitlines() if "reachability" in l or "fix:" in l]
                assert any("relay only" in l for l in lines), out.stdout + out.stderr
                assert any("--relay auto" in l for l in lines), out.stdout
            finally:
                home.kill()
                home.wait()
                await caller.close()
                await server.stop()
        asyncio.run(main())
