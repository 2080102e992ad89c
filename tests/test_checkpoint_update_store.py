"""Checkpoints written from the update store's copies (issue 28): the same file contents as a host
snapshot at the same step, no torn copy while later steps go on (the copies are pinned), and no new
12 P host copy."""
from __future__ import annotations

import asyncio
import re
import threading
import time
from types import SimpleNamespace

import torch

from iota_subnet.config import load_config
from iota_subnet.miner import StageWorker
from iota_subnet.miner.checkpoints import Checkpoints
from iota_subnet.miner.compute_thread import ComputeThread
from iota_subnet.miner.step_state import StepState
from iota_subnet.train.checkpoint import read_checkpoint, save_checkpoint
from iota_subnet.train.snapshot import StateSnapshot
from iota_subnet.utils.spill import SpillDir

SMALL = {"model": {"name": "tiny", "dim": 128, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 512,
                   "vocab_size": 256},
         "pipeline": {"stages": 3}, "data": {"seq_len": 16, "vocab_size": 256},
         "train": {"batch_size": 2, "micro_batch_size": 1}}


def _worker(tmp_path, keep: int, cls=StageWorker) -> StageWorker:
    cfg = load_config("configs/tiny.yaml", SMALL)
    return cls(cfg, 1, seed=1, audit_window=keep, audit_spill=SpillDir(tmp_path / "spill"))


def _train(w: StageWorker, steps: int) -> None:
    cfg = w.cfg
    for s in range(steps):
        for m in range(w.micro_per_step):
            x = torch.randn(cfg.train.micro_batch, cfg.data.seq_len, w.spec.in_width)
            out = w.forward(f"{w.inner_step}-{s}-{m}", x)["activations"]
            w.backward(f"{w.inner_step}-{s}-{m}", torch.randn_like(out))


def _checkpoints(tmp_path, w: StageWorker, compute: ComputeThread) -> Checkpoints:
    return Checkpoints(tmp_path / "ckpt", 1, compute=compute, view=SimpleNamespace(stage=w.stage), wallet=None,
                       updates=lambda: w.updates)


def _same_files(a, b) -> None:
    ta, ma = read_checkpoint(a)
    tb, mb = read_checkpoint(b)
    assert set(ta) == set(tb) and any(k.endswith("/exp_avg_sq") for k in ta) and any(k.endswith("/step") for k in ta)
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]), k
    assert ma["step"] == mb["step"]


def test_checkpoint_from_update_store_equals_snapshot(tmp_path):
    w = _worker(tmp_path, 2)
    compute = ComputeThread()
    ck = _checkpoints(tmp_path, w, compute)
    _train(w, 3)

    async def go():
        await ck.save(w, wait=True)
    asyncio.run(go())
    assert ck.last_source == "update store"
    w.save(tmp_path / "snap.safetensors")                  # StateSnapshot of the same state
    _same_files(ck.path, tmp_path / "snap.safetensors")
    assert read_checkpoint(ck.path)[1]["step"] == 3
    # today's loader restores the same weights, moments and steps
    w2 = _worker(tmp_path / "b", 2)
    assert w2.load(ck.path) and w2.inner_step == 3
    for (n, p), (_, q) in zip(w.module.named_parameters(), w2.module.named_parameters()):
        assert torch.equal(p, q), n
        s1, s2 = w.opt.state[p], w2.opt.state[q]
        assert set(s1) == set(s2) and all(torch.equal(s1[k], s2[k]) for k in s1)
    # weights replaced since the last step: no copies of this state -> a host snapshot
    with torch.no_grad(), w.lock:
        next(w.module.parameters()).add_(1.0)
    w.weights_replaced()
    asyncio.run(go())
    assert ck.last_source == "snapshot"
    ck.close()
    compute.shutdown()
    w.updates.close()


class _SlowWriter(StageWorker):
    """Its checkpoint writes wait for ``gate`` (the training steps in between go on)."""

    gate = threading.Event()

    def write_snapshot(self, snap, path):
        assert self.gate.wait(30)
        return super().write_snapshot(snap, path)


def test_steps_go_on_while_the_checkpoint_is_written(tmp_path):
    w = _worker(tmp_path, 1, _SlowWriter)
    compute = ComputeThread()
    ck = _checkpoints(tmp_path, w, compute)
    _train(w, 2)
    expect = StateSnapshot(w.module, w.opt, w.meta())
    save_checkpoint(tmp_path / "expect.safetensors", expect.module, expect.optimizer, expect.meta)
    spill = w.updates.spill

    async def go():
        await ck.save(w)                                   # pinned, write blocked on the gate
        w.updates.settle(10)
        held = set(spill.files)
        _train(w, 3)                                       # keep_steps = 1: the held step leaves the window
        w.updates.settle(10)
        assert held & set(spill.files), "pinned spill files were removed while the checkpoint is pending"
        _SlowWriter.gate.set()
        await ck.written()
        return held
    held = asyncio.run(go())
    assert ck.last_source == "update store" and w.inner_step == 5
    assert not held & set(spill.files)                     # unpinned after the write: cleaned up
    _same_files(ck.path, tmp_path / "expect.safetensors")  # the step-2 state, not a torn mix
    ck.close()
    compute.shutdown()
    w.updates.close()


def _rss_anon() -> int:
    return int(re.search(r"RssAnon:\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024


def test_checkpoint_from_update_store_copies_no_state(tmp_path):
    w = _worker(tmp_path, 2)
    _train(w, 2)
    P = w.module.param_count()
    with w.lock:
        held = w.updates.state_after(w.inner_step - 1, w.meta())
    assert isinstance(held, StepState) and held.wait(10)
    snap_bytes = StateSnapshot(w.module, w.opt, w.meta()).nbytes
    assert snap_bytes >= 12 * P and held.nbytes <= 0.01 * snap_bytes, (held.nbytes, snap_bytes)
    # every weight and moment it hands the writer is a view of the store's (spilled) copies
    with w.updates.hold(w.inner_step - 1) as copies:
        ptrs = {t.untyped_storage().data_ptr() for c in copies.values() for t in c.host.values()}
    tensors = list(held.module.state_dict().values()) + [
        v for st in held.optimizer.state.values() for k, v in st.items() if k != "step"]
    assert all(t.untyped_storage().data_ptr() in ptrs for t in tensors)
    # and writing it grows anonymous host memory by far less than one 12 P copy
    peak, stop = [0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], _rss_anon())
            time.sleep(0.0005)
    base = _rss_anon()
    t = threading.Thread(target=sample)
    t.start()
    w.write_snapshot(held, tmp_path / "c.safetensors")
    stop.set()
    t.join()
    held.release()
    assert peak[0] - base < 3 * P, (peak[0] - base, 12 * P)
    w.updates.close()
