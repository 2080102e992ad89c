"""Merging inside a real local network (slow): 3 stages x 3 replicas as separate processes on a
devnet, replicas merging every 5 inner steps over signed HTTP while the validator trains, checks
and scores them. Asserted: every replica applied every merge, the replicas of each stage end with
bit-identical merged weights (anchor) at the same merge epoch, no mismatch was reported, nobody
was flagged (every miner has weight), training progressed."""
from __future__ import annotations


import pytest
import yaml

from iota_subnet.network.localnet import LocalNet
from support.localnet import SMALL_CFG
from iota_subnet.train.checkpoint import read_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

CFG = {**SMALL_CFG, "merge": {"every_steps": 5}}


def test_localnet_merging_3x3(tmp_path, tmp_home, wikitext_path, monkeypatch):
    monkeypatch.setenv("IOTA_CACHE", str(tmp_path / "cache"))
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(CFG))
    steps = 30
    net = LocalNet(stages=3, replicas=3, validators=1, config=str(cfg), data=str(wikitext_path), steps=steps,
                   out=tmp_path / "ln", block_time=0.5, tempo=10, progress=False, timeout_s=600)
    summary = net.run()
    epochs = steps // 5
    assert summary["merge"]["merges_applied"] == 9 * epochs, summary["merge"]
    assert summary["merge"]["mismatch_reports"] == 0
    for s in range(3):
        states = [read_checkpoint(tmp_path / "ln" / "miners" / f"miner-s{s}-r{r}" / f"stage{s}.merge.safetensors")
                  for r in range(3)]
        assert {int(m["merged_epoch"]) for _, m in states} == {epochs - 1}
        a0 = states[0][0]["anchor"]
        assert all(st[0]["anchor"].equal(a0) for st in states[1:]), f"stage {s}: replicas differ after merging"
    assert all(m["weight"] > 0 for m in summary["miners"]), summary["miners"]
    assert summary["val_loss"] is not None and summary["val_loss"] < 6.0     # ln 512 = 6.24 at the start
