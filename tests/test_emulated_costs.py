"""MODELLED update store and checkpoint writes of emulated stages (iota_subnet.sim.emulated_costs): an
8b-shaped stage (meta device, nothing allocated) sleeps the device -> host copies and waits of the real
store with the host plan's bytes; checkpoints sleep their snapshot and write; the devnet's block time
is scaled by the time scale in an emulated localnet."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from iota_subnet.config import ConfigError
from iota_subnet.hardware import GIB, GPUS
from iota_subnet.host_plan import (DISK_WRITE_BYTES_PER_S, PCIE_D2H_BYTES_PER_S, SHA256_BYTES_PER_S, host_plan,
                                   update_store_bytes)
from iota_subnet.network.localnet_args import devnet_block_time
from iota_subnet.plan import plan_stage
from iota_subnet.sim.emulated import EmulatedStageWorker, Emulation
from iota_subnet.sim.emulated_costs import STORE_HASH_WORKERS, CheckpointModel, IoRates, UpdateStoreModel

from support.fake_time import FakeSleep

REPO = Path(__file__).resolve().parents[1]
SCALE = 2.0
K = 4


@pytest.fixture(scope="module")
def plan3(cfg8b):
    return plan_stage(cfg8b, 3, 80 * GIB)


def _worker(cfg, plan, c: Clock, audit_window: int = K) -> EmulatedStageWorker:
    return EmulatedStageWorker(cfg, 3, Emulation(GPUS["a100"], 0.5, SCALE), plan=plan, clock=c.clock, sleep=c,
                               audit_window=audit_window)


def _host_plan(cfg, w: EmulatedStageWorker):
    shapes = [tuple(p.shape) for p in w.module.parameters()]
    return host_plan(cfg, 3, w.plan.params, shapes, w.plan.train_flops_per_token, versions=K)


def test_inner_step_sleeps_the_update_stores_copies_with_the_host_plans_bytes(cfg8b, plan3):
    c = FakeSleep()
    w = _worker(cfg8b, plan3, c)
    P, hp = w.plan.params, _host_plan(cfg8b, w)
    assert P > 5e8                                           # the real 8b stage's size, on the meta device
    step_wall = w.timing.step_s * SCALE
    w.step()                                                 # first step: 28 P copied, nothing to wait for
    assert c.calls == [pytest.approx(28 * P / PCIE_D2H_BYTES_PER_S * SCALE), pytest.approx(step_wall)]
    st = w.modelled()["update_store"]
    assert st["d2h_bytes"] == 28 * P and st["settle_wait_s"] == 0
    # background: hashing (weights twice: rows and columns) on 2 threads, then the spill to disk
    bg = (28 + 8) * P / (SHA256_BYTES_PER_S * STORE_HASH_WORKERS) + 28 * P / DISK_WRITE_BYTES_PER_S
    assert st["background_s_last"] == pytest.approx(bg)
    assert st["host_bytes"] == st["last_step_host_bytes"] > 28 * P      # copies not spilled yet, + trees
    # the next step right away: begin waits for that background work (compute thread), then copies 16 P
    c.calls.clear()
    w.step()
    assert c.calls[0] == pytest.approx((bg + 16 * P / PCIE_D2H_BYTES_PER_S) * SCALE)     # one sleep: wait + copy
    assert w.modelled()["update_store"]["settle_wait_s"] == pytest.approx(bg)
    assert w.modelled()["update_store"]["last_d2h_bytes"] == hp.d2h_bytes_per_step == 16 * P
    # compute in between covers the background: no wait, and the copies are spilled (host: trees only)
    for _ in range(K):
        c.now += 1e4
        c.calls.clear()
        w.step()
        assert c.calls == [pytest.approx(16 * P / PCIE_D2H_BYTES_PER_S * SCALE), pytest.approx(step_wall)]
    c.now += 1e4
    st = w.modelled()["update_store"]
    trees = st["last_step_host_bytes"] - 16 * P
    assert st["host_bytes"] == trees and st["last_step_host_bytes"] == hp.update_store_bytes - 4 * P   # steady: 16 P
    assert st["d2h_bytes"] == (28 + 16 * (K + 1)) * P and st["steps"] == K + 2
    assert st["disk_bytes"] == update_store_bytes(P, K)["disk"]
    # weights replaced (a merge): the weights are copied again, 20 P: the plan's bound at the audit window
    w.weights_replaced()
    w.step()
    st = w.modelled()["update_store"]
    assert st["last_d2h_bytes"] == 20 * P and st["last_step_host_bytes"] == hp.update_store_bytes
    assert st["plan_host_bytes"] == hp.update_store_bytes and st["max_host_bytes"] >= hp.update_store_bytes
    json.dumps(w.modelled())                                  # status.json material


def test_a_skipped_step_commits_the_zero_gradient(cfg8b, plan3):
    """skip_to: the real store commits the last step jumped over (the zero gradient, 4 P; the state
    too when it is not the last step's copy: 16 P at the first, 8 P after a weights replacement)."""
    c = FakeSleep()
    w = _worker(cfg8b, plan3, c)
    P = w.plan.params
    w.skip_to(3)
    assert w.modelled()["update_store"]["last_d2h_bytes"] == 16 * P
    c.now += 1e4
    c.calls.clear()
    w.step()
    c.now += 1e4                                  # its background work is over: no wait
    w.skip_to(6)
    assert c.calls[-1] == pytest.approx(4 * P / PCIE_D2H_BYTES_PER_S * SCALE)
    assert w.modelled()["update_store"]["last_d2h_bytes"] == 4 * P
    c.now += 1e4
    w.weights_replaced()
    w.skip_to(9)
    assert w.modelled()["update_store"]["last_d2h_bytes"] == 8 * P and w.modelled()["update_store"]["steps"] == 4


def test_no_update_store_without_an_audit_window(cfg8b, plan3):
    c = FakeSleep()
    w = _worker(cfg8b, plan3, c, audit_window=0)
    w.step()
    assert c.calls == [pytest.approx(w.timing.step_s * SCALE)]
    assert "update_store" not in w.modelled() and not w.modelled()["checkpoints"]["update_store_on"]


def test_checkpoint_is_modelled_on_the_compute_and_writer_threads(cfg8b, plan3, tmp_path):
    c = FakeSleep()
    w = _worker(cfg8b, plan3, c)
    P = w.plan.params
    ck = w.io.checkpoints
    assert 12 * P < ck.file_bytes < 12 * P + (1 << 20)      # weights + moments (fp32), buffers, step counts
    write_s = ck.file_bytes / SHA256_BYTES_PER_S + ck.file_bytes / DISK_WRITE_BYTES_PER_S
    # before any step the store holds nothing: a host snapshot (12 P device -> host) on the compute thread
    snap = w.snapshot()
    assert c.calls == [pytest.approx(12 * P / PCIE_D2H_BYTES_PER_S * SCALE)] and not snap["modelled_from_update_store"]
    c.calls.clear()
    path = w.write_snapshot(snap, tmp_path / "stage3.safetensors")
    assert c.calls == [pytest.approx(write_s * SCALE)] and path.stat().st_size < 4096   # no GBs on disk
    # after a step: taken from the store's copies (nothing moved), written once they are sealed
    w.step()
    c.calls.clear()
    snap = w.snapshot()
    assert c.calls == [] and snap["modelled_from_update_store"]
    seal = w.io.store.sealed_at - c.now / SCALE
    assert seal > 0
    w.write_snapshot(snap, tmp_path / "stage3.safetensors")
    assert c.calls == [pytest.approx((seal + write_s) * SCALE)]
    st = w.modelled()["checkpoints"]
    assert st["writes"] == 2 and st["write_bytes"] == 2 * ck.file_bytes and st["snapshot_bytes"] == 12 * P
    assert st["write_s"] == pytest.approx(2 * write_s, rel=1e-6) and st["seal_wait_s"] == pytest.approx(seal, rel=1e-6)
    assert st["snapshots"] == 2 and st["snapshots_from_update_store"] == 1
    # the counters survive in the small JSON the emulated stage writes instead of a checkpoint
    w2 = _worker(cfg8b, plan3, FakeSleep())
    assert w2.load(tmp_path / "stage3.safetensors") and w2.inner_step == 1


def test_models_refuse_bad_settings():
    with pytest.raises(ValueError):
        UpdateStoreModel(10, [(2, 5)], keep_steps=0)
    with pytest.raises(ValueError):
        IoRates(pcie_bytes_per_s=0)
    m = CheckpointModel(10, 1, 0, from_store=False)
    assert m.snapshot(held=True) == pytest.approx(120 / PCIE_D2H_BYTES_PER_S)   # no store: a host snapshot


def test_devnet_block_time_is_scaled_by_the_time_scale_when_emulated():
    assert devnet_block_time(1.0, 4.0, emulated=True) == 4.0          # a tempo is a tempo of emulated time
    assert devnet_block_time(1.0, 4.0, emulated=False) == 1.0         # real compute: wall-clock blocks
    assert devnet_block_time(0.5, 1.0, emulated=True) == 0.5
    for bt, ts in ((0.0, 1.0), (1.0, 0.0), (float("nan"), 1.0)):
        with pytest.raises(ConfigError):
            devnet_block_time(bt, ts, emulated=True)
