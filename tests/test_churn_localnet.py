"""Churn in a real local network (slow): 3 stages x 3 replicas as separate processes on a devnet,
merging every 4 inner steps, while the chaos harness injects at least 5 events of every kind (kill,
pause, leave, join, partition, slow, validator-kill) and never leaves a stage below 2 live replicas.
Asserted: training goes on and the run ends cleanly (stopped after the chaos window and a settling
time: the summary is written, every process stopped), no sample trained twice; the replicas of each stage that applied the
stage's last merge hold bit-identical merged weights (at least 2 per stage); no merge mismatch was
reported; no miner was flagged as a cheater (every fault was injected, none was cheating)."""
from __future__ import annotations

import json
import threading
import time
from collections import Counter

import pytest
import yaml

from iota_subnet.sim.chaos import CHAOS_KINDS, ChaosSpec
from iota_subnet.network.localnet import LocalNet
from support.localnet import SMALL_CFG
from iota_subnet.train.checkpoint import read_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

CFG = {**SMALL_CFG, "merge": {"every_steps": 4, "join_timeout_s": 10.0, "phase_timeout_s": 10.0}}
RATES = {"kill": 1.4, "pause": 1.4, "partition": 1.4, "slow": 1.4, "validator-kill": 1.2, "join": 1.2, "leave": 1.0}
WINDOW_S = 480.0          # every scheduled event falls in the first 8 minutes of training
SETTLE_S = 60.0           # then the network runs undisturbed (restarted miners catch up, a merge or two)


def pick_seed() -> int:
    """The first seed whose schedule has, in the window, at least 7 events of every kind and 9 validator
    kills and leaves (some are skipped: the validator is still down, or every stage is at 2 live
    replicas), at most 10 joins and at least as many as leaves, and at most one leave more than the
    joins before it (so a leave rarely finds every stage at 2 live replicas)."""
    for seed in range(10_000):
        sched = ChaosSpec(rates=RATES, seed=seed).schedule(WINDOW_S)
        counts = Counter(k for _, k in sched)
        if not all(counts[k] >= 7 for k in CHAOS_KINDS) or counts["join"] > 10:    # at most ~12 miners at once
            continue
        if counts["validator-kill"] < 9 or counts["leave"] < 9 or counts["join"] < counts["leave"]:
            continue                            # some are skipped: the validator is down, or a stage is at 2
        joins = leaves = 0
        ok = True
        for _, k in sched:
            joins += k == "join"
            leaves += k == "leave"
            ok &= leaves <= joins + 1
        if ok:
            return seed
    raise AssertionError("no seed fits")


def test_localnet_trains_through_churn(tmp_path, tmp_home, wikitext_path, monkeypatch):
    monkeypatch.setenv("IOTA_CACHE", str(tmp_path / "cache"))
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(CFG))
    seed = pick_seed()
    chaos = ",".join(f"{k}={v}/min" for k, v in RATES.items()) + f",seed={seed},min_live=2"
    out = tmp_path / "ln"
    net = LocalNet(stages=3, replicas=3, validators=1, config=str(cfg), data=str(wikitext_path), steps=10_000,
                   out=out, block_time=0.5, tempo=10, progress=False, timeout_s=840, chaos=chaos,
                   chaos_duration_s=WINDOW_S, extra_miner_args=["--hop-timeout", "8"],
                   extra_validator_args=["--hop-timeout", "8", "--stall", "8"])
    result: dict = {}
    th = threading.Thread(target=lambda: result.update(summary=net.run()), daemon=True)
    th.start()
    # training time starts when the injector does (the chaos clock); stop after the window and the settling
    t_end = None
    while th.is_alive():
        time.sleep(2.0)
        if t_end is None and net.chaos is not None:
            t_end = time.monotonic() + WINDOW_S + SETTLE_S
        if t_end is not None and time.monotonic() > t_end:
            net.request_stop()
            break
    th.join(timeout=180)
    assert "summary" in result, "the local network did not finish"
    summary = result["summary"]
    ch = summary["chaos"]
    assert all(ch["events_by_kind"].get(k, 0) >= 5 for k in CHAOS_KINDS), (ch["events_by_kind"], ch["skipped_by_kind"])
    # never below 2 live replicas: an event that would have done so was skipped instead
    rows = [json.loads(l) for l in (out / "chaos.jsonl").read_text().splitlines()]
    assert all("2 live replica" in r["why"] for r in rows if r["event"] == "skip" and r["kind"] != "validator-kill")
    assert summary["merge"]["mismatch_reports"] == 0, summary["merge"]
    assert summary["merge"]["merges_applied"] > 0
    # replicas of a stage that applied its last merge: bit-identical
    for s in range(3):
        states = []
        for d in sorted((out / "miners").glob(f"miner-s{s}-r*")):
            p = d / f"stage{s}.merge.safetensors"
            if p.exists():
                tensors, meta = read_checkpoint(p)
                states.append((int(meta["merged_epoch"]), tensors["anchor"], d.name))
        last = max(e for e, _, _ in states)
        at_last = [(a, n) for e, a, n in states if e == last]
        assert len(at_last) >= 2, f"stage {s}: only {[n for _, n in at_last]} at merged epoch {last}"
        assert all(a.equal(at_last[0][0]) for a, _ in at_last[1:]), f"stage {s}: replicas differ at epoch {last}"
    assert ch["samples_repeated"] == 0, ch
    assert summary["final_loss"] is not None and summary["final_loss"] < 6.0     # ln 512 = 6.24 at the start
