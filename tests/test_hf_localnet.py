"""A transformers model family trained by a real local network (slow): a small untied Qwen2 (config
folder, scratch init, an 8,192-token tokenizer trained here on wikitext-2) reading a jsonl file through
``datasets``, 3 stages x 2 replicas as separate processes, merging every 5 inner steps. Asserted: the run
ends done, the loss falls, every miner is paid, hop audits run and nobody is flagged, every replica applied every merge;
``iota-subnet export`` gives a folder ``AutoModelForCausalLM`` loads without remote code whose loss on the
run's held-out rows is the network's evaluation's neighbourhood."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import yaml

from iota_subnet.config import load_config
from iota_subnet.data import build_dataset
from iota_subnet.network.localnet import LocalNet
from support.hf_run import WIKI, write_run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900),
              pytest.mark.skipif(not WIKI.exists(), reason=f"{WIKI} not present")]


def test_localnet_trains_a_qwen2_from_a_jsonl_dataset(tmp_path, tmp_home, monkeypatch):
    monkeypatch.setenv("IOTA_CACHE", str(tmp_path / "cache"))
    run = write_run(tmp_path, stages=3, seq_len=32, vocab_size=8192, layers=6, extra={"merge": {"every_steps": 5}})
    steps = 20
    net = LocalNet(stages=3, replicas=2, validators=1, config=str(run), data=None, steps=steps,
                   out=tmp_path / "ln", block_time=0.5, tempo=10, progress=False, timeout_s=600)
    summary = net.run()
    assert summary["ended"] == "done" and summary["steps_done"] == steps, summary
    assert summary["audits"]["flagged"] == [] and summary["audits"]["audits_failed"] == 0, summary["audits"]
    # hop audits run (replayed: iota_subnet/audit/replay.py), not only update audits
    assert (summary["audits"]["audits_per_miner_per_tempo_mean"] or 0) > 0, summary["audits"]
    assert all(m["weight"] > 0 for m in summary["miners"]), summary["miners"]
    assert summary["merge"]["merges_applied"] == 6 * (steps // 5) and summary["merge"]["mismatch_reports"] == 0
    assert summary["final_loss"] < 8.0 and summary["val_loss"] < 8.0, summary      # ln 8192 = 9.01 at the start
    written = yaml.safe_load((tmp_path / "ln" / "config.yaml").read_text())
    assert written["model"]["hf"] == str(tmp_path / "model")

    out = tmp_path / "exported"
    r = subprocess.run([sys.executable, "-m", "iota_subnet.cli", "export", "--run", str(tmp_path / "ln"), "--out",
                        str(out), "--merged"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(out))          # no trust_remote_code
    assert type(model).__name__ == "Qwen2ForCausalLM"
    cfg = load_config(tmp_path / "ln" / "config.yaml")
    _, ds = build_dataset(cfg.data, None, cache_dir=tmp_path / "cache")
    rows = ds.val_batch(0, 8)
    with torch.no_grad():
        logits = model(input_ids=rows[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1))
    assert loss.item() < 8.0 and abs(loss.item() - summary["val_loss"]) < 0.5, (loss.item(), summary["val_loss"])
