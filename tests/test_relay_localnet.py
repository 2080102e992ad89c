"""Home miners in a local network of real processes: one replica of every stage is reached only
through the validator's relay (``localnet --home-replicas 1``: those miners start with ``--relay
auto``, the validator with ``--relay-host``). They train, merge, are audited and paid like the others,
and status shows who relays for whom.

This runs on loopback: the home miners' own ports are reachable, but nobody is told them (their
axon on chain is the relay's address); a test with real NATs needs network namespaces and iptables.
"""
from __future__ import annotations

import asyncio
import json

import pytest
import yaml

from iota_subnet.devnet import open_devnet
from iota_subnet.network.localnet import NETUID, LocalNet

pytestmark = pytest.mark.timeout(600)

CFG = {"model": {"name": "tiny", "dim": 64, "n_layers": 3, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128,
                 "vocab_size": 512},
       "pipeline": {"stages": 3, "compression_ratio": 4},
       "data": {"vocab_size": 512, "seq_len": 32},
       "train": {"batch_size": 8, "micro_batch_size": 4, "lr": 1.0e-2, "warmup_steps": 2, "eval_batches": 2},
       "merge": {"every_steps": 4}}


def _axons(db) -> dict[str, str]:
    async def go():
        chain = await open_devnet(db)
        try:
            mg = await chain.metagraph(NETUID)
            return {n.hotkey: n.axon for n in mg.neurons}
        finally:
            await chain.close()
    return asyncio.run(go())


@pytest.mark.slow          # about 1-2 min on 2 cores: `make test-slow` (CI runs it)
def test_home_miners_train_merge_and_are_paid_through_the_validators_relay(tmp_path, tmp_home, wikitext_path,
                                                                          monkeypatch):
    monkeypatch.setenv("IOTA_CACHE", str(tmp_path / "cache"))
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(CFG))
    s = LocalNet(stages=3, replicas=2, validators=1, config=str(cfg), data=str(wikitext_path), steps=16,
                 out=tmp_path / "ln", block_time=0.5, tempo=10, progress=False, timeout_s=400,
                 home_replicas=1).run()
    assert s["ended"] == "done", s["ended"]
    by_name = {m["name"]: m for m in s["miners"]}
    val = s["validators_detail"][0]
    relay = val["relay"]
    assert relay is not None
    axons = _axons(tmp_path / "ln" / "chain.db")
    relay_ep = axons[val["hotkey"]]
    for st in range(3):
        home, public = by_name[f"miner-s{st}-r1"], by_name[f"miner-s{st}-r0"]
        # the home miner publishes the relay's address; its twin its own
        assert axons[home["hotkey"]] == relay_ep and axons[public["hotkey"]] != relay_ep
        assert public["relay"] is None
        assert [r["endpoint"] for r in home["relay"]["relays"]] == [relay_ep]
        assert home["relay"]["counts"].get("answered", 0) > 0          # requests came in through the tunnel
        # the relay's own account of the same miner
        assert relay["relayed"][home["hotkey"]]["requests"] > 0 and public["hotkey"] not in relay["relayed"]
        # trained, merged and paid like its twin
        assert home["work"] > 0 and home["incentive"] > 0 and public["incentive"] > 0
        assert home["merge"]["merges"] >= 1 and home["merge"]["last"]["status"] == "merged", home["merge"]
    status = json.loads((tmp_path / "ln" / "validators" / "validator0" / "status.json").read_text())
    assert set(status["relayed"]) == {by_name[f"miner-s{st}-r1"]["hotkey"] for st in range(3)}
