"""Scores end to end: the validator process (devnet chain, 3 x 2 MinerServices on the miner-to-miner
data plane, one a noisy-update adversary in the middle stage) sets weights from verified, audited
work; the JSON endpoint and ``iota-subnet scores`` explain the adversary's zero; unit properties of
the Scoreboard."""
from __future__ import annotations

import asyncio
import json
import math
import socket

import aiohttp
import pytest

from iota_subnet.cli import main as cli_main
from iota_subnet.validator.scoring import Ledger, Scoreboard, balanced_weights
from support.dataplane_net import NETUID, P2PNet, run

pytestmark = pytest.mark.timeout(400)
ADV = (1, 1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_validator_scores_adversary_zero_and_explained(tmp_home, tmp_path, wikitext_path, cache_dir, capsys):
    port = free_port()
    out = tmp_path / "vali0"

    async def main():
        net = P2PNet(tmp_path, wikitext_path, cache_dir)
        await net.start(adversaries={ADV: "noisy-update"})
        try:
            adv = net.miners[ADV].uid
            vali = net.validator(steps=14, audit_interval_s=0.5, hop_timeout_s=4, audit_timeout_s=4,
                                 clasp_interval_s=1.0, port=port)
            seen: list[dict] = []

            async def poll():
                async with aiohttp.ClientSession() as http:
                    while True:
                        await asyncio.sleep(0.5)
                        try:
                            async with http.get(f"http://127.0.0.1:{port}/scores") as resp:
                                seen.append(await resp.json())
                        except aiohttp.ClientError:
                            pass

            poller = asyncio.create_task(poll())
            assert await vali.run() == 0
            poller.cancel()
            assert any(d.get("miners") for d in seen), "the /scores endpoint never answered with scores"
            wmap = dict(dict(await net.chain.weights(NETUID))[0])
            honest = sum(v for u, v in wmap.items() if u != adv)
            assert wmap.get(adv, 0.0) == 0.0 and honest >= 0.95 * sum(wmap.values()), (adv, wmap)
            st = net.status()
            flagged = [m["uid"] for m in st["scores"] if (m["audits"] or {}).get("flagged")]
            assert flagged == [adv]
            return adv
        finally:
            await net.close()

    adv = run(main(), timeout=380)
    capsys.readouterr()
    assert cli_main(["scores", "--validator-state", str(out), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    row = next(m for m in d["miners"] if m["uid"] == adv)
    assert row["weight"] == 0.0 and row["quality"] == 0.0 and row["audits"]["failed"] >= 1
    assert any("update audit failed" in w for w in row["why"]), row["why"]
    assert all(m["weight"] > 0 for m in d["miners"] if m["uid"] != adv)
    assert cli_main(["scores", "--validator-state", str(out)]) == 0
    table = capsys.readouterr().out
    assert f"\n{adv:>4} " in table and "flagged by audits" in table
    assert cli_main(["scores", "--validator-state", str(tmp_path / "nowhere")]) == 2


def _ledger(works: dict) -> Ledger:
    led = Ledger([0.25, 0.5, 0.25])
    for (uid, stage), w in works.items():
        rec = led.record(uid, f"hk{uid}", stage)
        rec.work = w
    return led


def test_scoreboard_rates_penalty_decay_nonfinite():
    led = _ledger({(1, 0): 100.0, (2, 0): 100.0, (3, 1): 100.0, (4, 2): 100.0})
    current = {u: f"hk{u}" for u in range(1, 5)}
    sb = Scoreboard()
    sb.update(led)
    assert sb.entries[(1, "hk1")].score == 100.0 and sb.entries[(1, "hk1")].rate == 100.0
    w = sb.weights(led.shares, current)
    assert abs(w[1] - 0.125) < 1e-12 and abs(w[3] - 0.5) < 1e-12     # stage budgets follow compute shares
    # penalty never raises a score: the same update with quality < 1 gives a lower or equal score
    for q in (0.0, 0.3, 1.0):
        a = Scoreboard.from_dict(sb.to_dict())
        a.update(_ledger({(1, 0): 200.0, (2, 0): 200.0, (3, 1): 200.0, (4, 2): 200.0}), {(1, "hk1"): (q, ["x"])})
        assert a.entries[(1, "hk1")].score <= a.entries[(2, "hk2")].score
        assert a.entries[(1, "hk1")].score == pytest.approx(q * 100.0)
    # a caught miner's share goes to its stage's honest replica
    a = Scoreboard.from_dict(sb.to_dict())
    a.update(_ledger({(1, 0): 200.0, (2, 0): 200.0, (3, 1): 200.0, (4, 2): 200.0}), {(1, "hk1"): (0.0, ["x"])})
    w = a.weights(led.shares, current)
    assert 1 not in w and w[2] == pytest.approx(0.25) and sum(w.values()) == pytest.approx(1.0)
    # a factor above 1 is clipped
    a = Scoreboard.from_dict(sb.to_dict())
    a.update(_ledger({(1, 0): 200.0, (2, 0): 200.0}), {(1, "hk1"): (5.0, [])})
    assert a.entries[(1, "hk1")].score == a.entries[(2, "hk2")].score
    # no new work anywhere: the rate stays, the grace tempos are free, then everyone decays alike
    d = Scoreboard.from_dict(sb.to_dict())
    for t in range(d.grace):
        d.update(led)
    assert d.entries[(1, "hk1")].score == 100.0 and not d.stale()
    d.update(led)
    assert d.entries[(1, "hk1")].score == 50.0 and d.entries[(1, "hk1")].stale
    assert any("stale" in x for x in d.entries[(1, "hk1")].why)
    # non-finite work or quality -> 0, and never NaN weights
    n = Scoreboard.from_dict(sb.to_dict())
    n.update(_ledger({(1, 0): math.nan, (2, 0): math.inf, (3, 1): 200.0, (4, 2): 200.0}), {(3, "hk3"): (math.nan, [])})
    assert n.entries[(3, "hk3")].score == 0.0
    assert all(math.isfinite(v) for v in n.weights(led.shares, current).values())
    # a board saved by the older exponential-average code still loads
    old = {"alpha": 0.5, "entries": [{"uid": 1, "hotkey": "hk1", "stage": 0, "score": 3.0, "last_work": 9.0,
                                      "new_work": 1.0, "quality": 1.0, "weight": 0.5, "updates": 4, "why": []}]}
    assert Scoreboard.from_dict(old).entries[(1, "hk1")].last_work == 9.0
    # a re-registered uid (other hotkey) earns nothing
    assert 1 not in balanced_weights({(1, "old"): 5.0, (2, "hk2"): 5.0}, {(1, "old"): 0, (2, "hk2"): 0},
                                     [1.0], {1: "new", 2: "hk2"})
