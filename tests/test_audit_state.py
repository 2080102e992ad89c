"""Audit state that fits: spilled update-store copies still open, a real tiny stage's memory growth
over steady steps stays under the plan's update-store bound (+15 %), the 8b head stage's host peak
fits 96 GB, the prover runs on the worker's device, deadlines grow with the work."""
from __future__ import annotations

import gc
import re

import torch

from iota_subnet.config import load_config
from iota_subnet.host_plan import update_store_bytes
from iota_subnet.miner import StageWorker
from iota_subnet.miner.hop_audit_routes import HopAuditRoutes
from iota_subnet.miner.hop_store import HopStore
from iota_subnet.utils.spill import SpillDir
from iota_subnet.validator.deadlines import DeadlineRates, hop_round_work, update_audit_work

BIG = {"model": {"name": "tiny", "dim": 256, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 1024,
                 "vocab_size": 256},
       "pipeline": {"stages": 3}, "data": {"seq_len": 16, "vocab_size": 256}, "train": {"batch_size": 2, "micro_batch_size": 1}}


def _rss() -> int:
    return int(re.search(r"VmRSS:\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024


def _train(w: StageWorker, cfg, steps: int, peak: list[int]) -> None:
    width = w.spec.in_width
    for s in range(steps):
        for m in range(w.micro_per_step):
            x = torch.randn(cfg.train.micro_batch, cfg.data.seq_len, width)
            out = w.forward(f"{s}-{m}", x)["activations"]
            w.backward(f"{s}-{m}", torch.randn_like(out))
            peak[0] = max(peak[0], _rss())
        w.updates.settle()
        peak[0] = max(peak[0], _rss())


def test_spilled_update_store_bounded_and_matches_plan(tmp_path):
    cfg = load_config("configs/tiny.yaml", BIG)
    w = StageWorker(cfg, 1, seed=1, audit_window=3, audit_spill=SpillDir(tmp_path / "spill"))
    P = w.module.param_count()
    gc.collect()
    peak = [0]
    _train(w, cfg, 1, peak)                 # the first step: its copies (28 P) land and leave
    gc.collect()
    base = _rss()                           # live state, activations, allocator pools in place
    peak = [base]
    _train(w, cfg, 4, peak)
    st = w.updates
    assert st.nbytes == 0 and st.disk_bytes > 0   # every kept copy is on disk
    bound = update_store_bytes(P, 3)["host"]
    assert st.last_copy_bytes == bound            # 16 bytes per parameter per steady step
    grown = peak[0] - base
    assert grown <= 1.15 * bound, (grown, bound)
    # openings read the spilled copies: the recomputation still checks
    step = st.steps()[-1]
    rec = st.commitment(step, 5.0)
    resp = st.open(step, rec.merges, [[st.names[0], 0]], [])
    assert resp.rows and all(torch.isfinite(t).all() for t in resp.rows.values())


def test_prover_runs_on_the_worker_device(tmp_path):
    cfg = load_config("configs/tiny.yaml")
    routes = HopAuditRoutes(HopStore(2), cfg, run_id="r", stage=0, device="cpu")
    assert routes.device == torch.device("cpu")

    class Hop:
        def inputs(self, direction):
            return object()

    class Lay:
        direction = "forward"
    assert routes.prover(Lay(), object(), Hop()).device == torch.device("cpu")


def test_deadlines_grow_with_work():
    r = DeadlineRates(floor_s=10.0, flops_per_s=1e9, bytes_per_s=1e6)
    assert r.deadline_s(0, 0) == 10.0
    assert r.deadline_s(2e9, 0) == 12.0 and r.deadline_s(0, 3e6) == 13.0
    tiny = load_config("configs/tiny.yaml")
    big = load_config("configs/tiny.yaml", BIG)
    f_small, b_small = hop_round_work(tiny, 1, "forward")
    f_back, _ = hop_round_work(tiny, 1, "backward")
    f_other, b_other = hop_round_work(big, 1, "forward")
    assert f_back == 3 * f_small
    d = DeadlineRates()
    assert d.deadline_s(f_back, b_small) > d.deadline_s(f_small, b_small) > d.floor_s
    more, less = sorted([(f_small, b_small), (f_other, b_other)], reverse=True)
    if more[0] >= less[0] and more[1] >= less[1]:
        assert d.deadline_s(*more) > d.deadline_s(*less)
    assert d.deadline_s(*update_audit_work([4096] * 8)) > d.deadline_s(*update_audit_work([256]))


def test_8b_head_stage_host_peak_fits_96_gb():
    from iota_subnet.plan import plan_stage
    cfg = load_config("configs/8b.yaml")
    p = plan_stage(cfg, 0, 80 << 30)
    h = p.host
    assert h["peak_bytes"] <= 96e9 and h["d2h_bytes_per_step"] == 16 * p.params
    assert h["audit_window_versions"] >= 2 and h["audit_window_s"] > 0
    for k in ("update_store_bytes", "hop_store_bytes", "merge_steady_bytes", "merge_transient_bytes",
              "merge_audit_bytes", "checkpoint_snapshot_bytes", "sync_donor_bytes"):
        assert k in h
