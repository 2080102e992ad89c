"""Scores end to end: the validator process (devnet chain, 3 x 3 in-process miners, one a lazy
adversary in the middle stage) sets weights from verified, checked work; the JSON endpoint and
``iota-subnet scores`` explain the adversary's zero; unit properties of the Scoreboard."""
from __future__ import annotations

import asyncio
import json
import math
import socket

import aiohttp
import pytest

from iota_subnet.devnet import add_stake, create_devnet, open_devnet
from iota_subnet.cli import main as cli_main
from iota_subnet.config import load_config
from iota_subnet.validator.scoring import Ledger, Scoreboard, balanced_weights
from iota_subnet.validator.service import ValidatorOptions, ValidatorService
from test_adversaries import ADV_REPLICA, ADV_STAGE, Miner
from support.common import OVR, PatternData, make_wallet

pytestmark = pytest.mark.timeout(150)
NETUID = 9


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_validator_scores_adversary_zero_and_explained(tmp_home, tmp_path, capsys):
    cfg = load_config("configs/tiny.yaml", OVR)
    root = tmp_home / "wallets"
    wallets = {"vali": make_wallet(root, "vali"), **{f"m{i}": make_wallet(root, f"m{i}") for i in range(9)}}
    db = create_devnet(tmp_path / "chain.db", NETUID, tempo=5, block_time=0.1, weights_rate_limit=1,
                       immunity_period=0)
    out = tmp_path / "vali"
    port = free_port()
    opts = ValidatorOptions(network="devnet", chain_db=str(db), netuid=NETUID, steps=8, out=str(out), run_id="run1",
                            sync_interval_s=0.5, status_interval_s=0.2, weights_check_s=0.3, hop_timeout_s=10,
                            exit_when_done=True, wait_miners_s=30, check_rate=0.5, clasp_interval_s=0.3,
                            port=port, host="127.0.0.1", data_plane="relay")

    async def main():
        chain = await open_devnet(db)
        miners = []
        try:
            await chain.register(wallets["vali"], NETUID)
            add_stake(db, wallets["vali"].hotkey.ss58_address, wallets["vali"].coldkeypub.ss58_address, 100.0,
                      netuid=NETUID)
            for r in range(3):
                for s in range(3):
                    w = wallets[f"m{len(miners)}"]
                    m = Miner(cfg, s, w, "lazy" if (s, r) == (ADV_STAGE, ADV_REPLICA) else None)
                    await m.server.start()
                    reg = await chain.register(w, NETUID)
                    m.uid = reg.uid
                    await chain.serve(w, NETUID, "127.0.0.1", m.server.port)
                    await chain.publish(w, NETUID, json.dumps({"v": 1, "run": "run1", "stage": s}))
                    miners.append(m)
            adv = next(m.uid for m in miners if m.adversary is not None)
            svc = ValidatorService(opts, wallet=wallets["vali"], chain=chain, cfg=cfg, dataset=PatternData(256, 16))
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
            assert await asyncio.wait_for(svc.run(), 120) == 0
            poller.cancel()
            assert any(d.get("miners") for d in seen), "the /scores endpoint never answered with scores"
            weights = dict(await chain.weights(NETUID))[0]
            wmap = dict(weights)
            honest = sum(v for u, v in wmap.items() if u != adv)
            assert wmap.get(adv, 0.0) == 0.0 and honest >= 0.95 * sum(wmap.values()), (adv, wmap)
            st = json.loads((out / "status.json").read_text())
            flagged = [m["uid"] for m in st["scores"] if (m["checks"] or {}).get("flagged")]
            assert flagged == [adv]
            return adv
        finally:
            for m in miners:
                await m.server.stop()
            await chain.close()

    adv = asyncio.run(main())
    capsys.readouterr()
    assert cli_main(["scores", "--validator-state", str(out), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    row = next(m for m in d["miners"] if m["uid"] == adv)
    assert row["weight"] == 0.0 and row["quality"] == 0.0 and row["checks"]["failed"] >= 1
    assert any("spot check" in w and "rel err" in w for w in row["why"]), row["why"]
    assert all(m["weight"] > 0 for m in d["miners"] if m["uid"] != adv)
    assert cli_main(["scores", "--validator-state", str(out)]) == 0
    table = capsys.readouterr().out
    assert f"\n{adv:>4} " in table and "flagged by spot checks" in table
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
