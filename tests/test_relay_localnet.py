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
import signal
import threading
import time

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


def _home_run(tmp_path, monkeypatch, wikitext_path, **kw):
    monkeypatch.setenv("IOTA_CACHE", str(tmp_path / "cache"))
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(CFG))
    return LocalNet(stages=3, replicas=2, validators=1, config=str(cfg), data=str(wikitext_path), steps=16,
                    out=tmp_path / "ln", block_time=0.5, tempo=10, progress=False, timeout_s=420,
                    home_replicas=1, relays=2, **kw)


def _check_paid_and_unflagged(s: dict) -> None:
    assert s["ended"] == "done", s["ended"]
    worked = [m for m in s["miners"] if m["work"] > 0]
    assert len(worked) == 6 and all(m["incentive"] > 0 for m in worked), [(m["name"], m["incentive"]) for m in worked]


@pytest.mark.slow          # about 1 min each on 2 cores
@pytest.mark.parametrize("fault", ["drop", "alter"])
def test_home_miners_go_around_a_bad_relay(tmp_path, tmp_home, wikitext_path, monkeypatch, fault):
    """Two standalone relays, relay 0 (every home miner's axon) misbehaves: the run trains to the end
    through relay 1, every miner is paid, nobody is flagged, and relay 0's fault did happen. (A
    replaying relay needs no way around: the first answer is right and the replay is refused,
    tests/test_relay.py.)"""
    s = _home_run(tmp_path, monkeypatch, wikitext_path, relay_fault=fault).run()
    _check_paid_and_unflagged(s)
    v = json.loads((tmp_path / "ln" / "validators" / "validator0" / "status.json").read_text())
    assert v["barred"] == [], v["barred"]
    bad, good = {r["name"]: r for r in s["relays"]}["relay0"], {r["name"]: r for r in s["relays"]}["relay1"]
    assert bad["counts"].get({"drop": "fault_dropped", "alter": "fault_altered"}[fault], 0) > 0
    homes = [m for m in s["miners"] if m["name"].endswith("-r1")]
    assert all(good["relayed"][m["hotkey"]]["requests"] > 0 for m in homes), good["relayed"]


@pytest.mark.slow
def test_home_miners_outlive_a_killed_relay(tmp_path, tmp_home, wikitext_path, monkeypatch):
    """Relay 0 is killed (SIGKILL) once training runs; the home miners' callers reach them through
    relay 1 (no republication on chain) and the run ends with every miner paid."""
    net = _home_run(tmp_path, monkeypatch, wikitext_path)
    result: dict = {}
    th = threading.Thread(target=lambda: result.update(summary=net.run()), daemon=True)
    th.start()
    vstatus = tmp_path / "ln" / "validators" / "validator0" / "status.json"
    deadline = time.monotonic() + 300
    killed = None
    while time.monotonic() < deadline and th.is_alive() and killed is None:
        time.sleep(0.5)
        try:
            done = sum(json.loads(vstatus.read_text()).get("steps_done", {}).values())
        except (OSError, ValueError):
            continue
        if done >= 6:
            relay0 = next(c for c in net.children if c.name == "relay0")
            relay0.proc.send_signal(signal.SIGKILL)
            killed = time.monotonic()
    assert killed is not None, "training never reached 6 lane steps"
    th.join(420)
    assert not th.is_alive()
    s = result["summary"]
    _check_paid_and_unflagged(s)
    axons = _axons(tmp_path / "ln" / "chain.db")
    relay0_ep = f"127.0.0.1:{net.relay_ports[0]}"
    assert all(axons[m["hotkey"]] == relay0_ep for m in s["miners"] if m["name"].endswith("-r1"))   # never republished
