"""``--relay`` of a miner (iota_subnet/miner/relaying.py): which relays a spec names, and the clear
errors for one that names none."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace as NS

import pytest

from iota_subnet.miner.relaying import MinerRelays, RelayConfigError
from iota_subnet.protocol.commitment import MINER, VALIDATOR, RunCommitment


class View:
    """A chain view with two validators hosting relays and one miner (the shape ChainView reads)."""

    def __init__(self, hosts: bool = True):
        self.hotkey, self.run_id = "me", "run"
        self.neurons = {"v1": NS(uid=1, validator_permit=True, axon="10.0.0.1:8092"),
                        "v2": NS(uid=2, validator_permit=True, axon="10.0.0.2:8092"),
                        "m": NS(uid=3, validator_permit=False, axon="10.0.0.3:8091")}
        rh = RunCommitment("run", VALIDATOR, relay_host=hosts).encode()
        self.commitments = {"v1": rh, "v2": rh, "m": RunCommitment("run", MINER, stage=0).encode()}
        self.refreshes = 0

    def endpoint_of(self, hk):
        return self.neurons[hk].axon if hk in self.neurons else None

    def relay_hosts(self):
        return [(self.endpoint_of(hk), hk) for hk in ("v1", "v2")
                if RunCommitment.decode(self.commitments[hk]).relay_host]

    async def refresh(self, force=False):
        self.refreshes += 1


def test_specs_name_relays_and_the_first_is_the_axon():
    r = MinerRelays(("auto",), View(), keypair=None)
    assert asyncio.run(r.resolve()) == [("10.0.0.1:8092", "v1"), ("10.0.0.2:8092", "v2")]
    assert r.axon() == ("10.0.0.1", 8092) and r.endpoints() == ("10.0.0.1:8092", "10.0.0.2:8092")
    r = MinerRelays(("10.0.0.3:8091", "5Hk@203.0.113.5:9000"), View(), keypair=None)
    assert asyncio.run(r.resolve()) == [("10.0.0.3:8091", "m"), ("203.0.113.5:9000", "5Hk")]
    assert MinerRelays((), View(), keypair=None).status() is None


def test_a_spec_that_names_no_relay_is_a_clear_error():
    with pytest.raises(RelayConfigError, match="no neuron serves that address"):
        asyncio.run(MinerRelays(("10.9.9.9:1",), View(), keypair=None).resolve())
    with pytest.raises(RelayConfigError, match="not ip:port"):
        asyncio.run(MinerRelays(("5Hk@nowhere",), View(), keypair=None).resolve())
    view = View(hosts=False)
    with pytest.raises(RelayConfigError, match="no neuron of this run hosts a relay"):
        asyncio.run(MinerRelays(("auto",), view, keypair=None).resolve(wait_s=0.0))
