"""A neuron behind a real NAT: a home namespace behind a router namespace that masquerades
(iptables), the relay on this side of the router's WAN. The home neuron opens no port anyone can
reach; callers reach it through the relay, signed end to end, and the doctor run inside the home
prints its verdict, "relay only", and the fix. Needs root, ``ip netns`` and ``iptables`` (installed
by ``make setup``); skipped with the reason otherwise. Three topologies: one router masquerading
port-preserving, one with ``--random-fully``, and a home behind two NATs (home -> inner router ->
WAN router -> this side, both masquerading).

Both ends' path records (:mod:`iota_subnet.transport.paths`, status.json ``paths``) say how each pair
talked: the caller reached the home "relayed" via the relay and a public peer "direct"; the home saw
the caller's request come "relayed" via the relay, and its own call out to the public peer went "direct"."""
from __future__ import annotations

import asyncio
import json
import os
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
#: the home's processes import this checkout's iota_subnet (not whichever one the venv installed)
HOME_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                                      os.environ.get("PYTHONPATH")]))}
RELAY_URI, HOME_URI, PUBLIC_URI = "//relay-nat-relay", "//relay-nat-home", "//relay-nat-public"


def _public_peer(host: str) -> NeuronServer:
    """A neuron anyone can dial (on this side of the NATs), serving ``/hop`` (echo times 2)."""
    server = NeuronServer(Keypair.create_from_uri(PUBLIC_URI), host, 0, None, None)

    async def hop(msg: Hop, ctx) -> Hop:
        return Hop(microbatch_id=msg.microbatch_id, data=msg.data * 2)
    server.add_route("/hop", hop, Hop)
    return server


async def _home_status(path: Path, caller: str, deadline_s: float = 10.0) -> dict:
    """The home's path record once it names ``caller`` (it is rewritten every 0.2 s)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        try:
            st = json.loads(path.read_text())
            if caller in st["paths"]:
                return st
        except (OSError, ValueError):
            pass
        await asyncio.sleep(0.1)
    raise AssertionError(f"the home's status never named the caller: {path.read_text() if path.exists() else 'none'}")


@pytest.mark.skipif(not OK, reason=WHY)
@pytest.mark.parametrize("random_fully,double_nat", [(False, False), (True, False), (False, True)],
                         ids=["masquerade", "random-fully", "double-nat"])
def test_a_home_neuron_behind_a_nat_is_reached_through_the_relay(tmp_path, random_fully, double_nat):
    with HomeRouter(random_fully=random_fully, double_nat=double_nat) as nat:
        async def main():
            relay_key = Keypair.create_from_uri(RELAY_URI)
            server = NeuronServer(relay_key, nat.public_ip, 0, None, None)
            relay = RelayHost(relay_key)
            relay.mount(server)
            for path, handler in PeerProbe(min_interval_s=0.0).handlers().items():
                server.add_public_get(path, handler)
            await server.start()
            public = _public_peer(nat.public_ip)
            await public.start()
            port_file = tmp_path / "home.port"
            status_file = Path(f"{port_file}.status.json")
            env_py = [sys.executable, str(HOME_SCRIPT)]
            home = subprocess.Popen(nat.exec_argv([*env_py, server.endpoint, RELAY_URI, HOME_URI, str(port_file),
                                                   public.endpoint, PUBLIC_URI]),
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=HOME_ENV)
            home_hk = Keypair.create_from_uri(HOME_URI).ss58_address
            public_hk = public.hotkey
            # the caller knows the home's relays as a validator does (its commitment's rl)
            caller = NeuronClient(Keypair.create_from_uri("//relay-nat-caller"),
                                  alternates=lambda hk: [server.endpoint] if hk == home_hk else [])
            try:
                deadline = time.monotonic() + 60
                while not port_file.exists() and home.poll() is None and time.monotonic() < deadline:
                    await asyncio.sleep(0.2)
                assert port_file.exists(), home.stdout.read() if home.poll() is not None else "no attach in 60 s"
                home_port = int(port_file.read_text())
                x = torch.randn(2, 4, 8)
                got = await caller.call(server.endpoint, home_hk, "/hop", Hop(microbatch_id="nat", data=x), Hop,
                                        timeout_s=10, retries=0)
                assert torch.equal(got.data, x * 2) and got.info == {"caller": caller.hotkey}
                got = await caller.call(public.endpoint, public_hk, "/hop", Hop(data=x), Hop, timeout_s=10, retries=0)
                assert torch.equal(got.data, x * 2)
                # the relay saw the home's connection come from the (outer) router's WAN address, not the home's
                attached = relay.status()["attached"][home_hk]
                assert attached["from"] == nat.wan.ns_ip and attached["requests"] == 1
                # the path records: the caller reached the home through the relay, the public peer directly
                mine = caller.paths.snapshot(caller.hotkey)
                assert (mine[home_hk]["out"]["kind"], mine[home_hk]["out"]["via"]) == ("relayed", server.endpoint)
                assert (mine[public_hk]["out"]["kind"], mine[public_hk]["out"]["via"]) == ("direct", None)
                # the home saw the caller come through its relay tunnel, and went out to the public peer directly
                theirs = (await _home_status(status_file, caller.hotkey))["paths"]
                assert (theirs[caller.hotkey]["in"]["kind"], theirs[caller.hotkey]["in"]["via"]) == \
                    ("relayed", server.endpoint)
                assert theirs[public_hk]["out"]["kind"] == "direct" and "in" not in theirs[public_hk]
                # the public peer saw the home's call arrive directly, from the (outer) router's WAN address
                assert public.paths.snapshot(public_hk)[home_hk]["in"]["kind"] == "direct"
                # and nothing on this side can open a connection to the home neuron: its public address
                # (the router's WAN) forwards no port (a client that knows no relay of the home's)
                async with NeuronClient(Keypair.create_from_uri("//relay-nat-dialler")) as dialler:
                    with pytest.raises(TransportError):
                        await dialler.call(f"{nat.wan.ns_ip}:{home_port}", home_hk, "/hop", Hop(data=x), Hop,
                                           timeout_s=3, retries=0)
                # the doctor inside the home: its verdict, relay only, with the fix
                out = await asyncio.to_thread(subprocess.run, nat.exec_argv([*env_py, server.endpoint, "--doctor"]),
                                              capture_output=True, text=True, timeout=60, env=HOME_ENV)
                lines = [l for l in out.stdout.splitlines() if "reachability" in l or "fix:" in l]
                print("\n".join(lines))
                assert any("relay only" in l for l in lines), out.stdout + out.stderr
                assert any("--relay auto" in l for l in lines), out.stdout
            finally:
                home.kill()
                home.wait()
                await caller.close()
                await public.stop()
                await server.stop()
        asyncio.run(main())
