"""Emulated accelerators (iota_subnet.sim.emulated): timing from FLOPs, wire shapes and dtypes, the
memory bound from the plan, step accounting; the real StageWorker's busy time; an emulated miner over
signed HTTP."""
from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from pathlib import Path

import pytest
import torch

from iota_subnet.config import ConfigError, load_config
from iota_subnet.hardware import GIB, GPUS, parse_accelerator
from iota_subnet.sim.emulated import (Emulation, EmulatedStageWorker, EmulationError, InFlightLimitExceeded,
                                      emulated_parts)
from iota_subnet.miner.stage_worker import StageWorker, UnknownMicrobatch
from iota_subnet.sim.virtual_merge import VirtualMergeEngine
from iota_subnet.plan import plan_stage, stage_flops
from iota_subnet.protocol import Outcome, ProtocolError
from support.dataplane_net import P2PNet, run
from support.fake_time import FakeSleep

REPO = Path(__file__).resolve().parents[1]
T = 2048


@pytest.fixture(scope="module")
def plans8b(cfg8b):
    return {s: plan_stage(cfg8b, s, 80 * GIB) for s in (0, 3, 7)}


def _worker(cfg, stage, plan, sleeps, *, mfu=0.5, scale=1.0, gpu="a100"):
    return EmulatedStageWorker(cfg, stage, Emulation(GPUS[gpu], mfu, scale), plan=plan, clock=sleeps.clock,
                               sleep=sleeps)


def test_forward_and_backward_take_the_flops_time(cfg8b, plans8b):
    sl = FakeSleep()
    w = _worker(cfg8b, 3, plans8b[3], sl, scale=4.0)
    f = stage_flops(cfg8b.model, cfg8b.pipeline, T, 3)
    rate = 312e12 * 0.5
    x = torch.zeros(1, T, 64, dtype=torch.bfloat16)
    out = w.forward("a", x)
    assert out["activations"].shape == (1, T, 64) and out["activations"].dtype == torch.bfloat16
    assert out["emulated"] and torch.isfinite(out["activations"].float()).all()
    assert sl.calls[-1] == pytest.approx(4.0 * f.forward * T / rate)           # time scale x4
    assert 0.02 * 4 < sl.calls[-1] < 0.04 * 4                                  # ~26 ms for 4 blocks of 8b on A100
    g = w.backward("a", torch.zeros(1, T, 64, dtype=torch.bfloat16))
    assert g.shape == (1, T, 64) and g.dtype == torch.bfloat16
    # backward = 2 x forward + one recomputed forward of the blocks (8b.yaml checkpoints)
    assert sl.calls[-1] == pytest.approx(4.0 * (2 * f.forward + f.recompute(True)) * T / rate)
    assert w.busy_s == pytest.approx(sum(sl.calls)) and w.meta()["emulated_busy_s"] == pytest.approx(w.busy_s / 4, abs=1e-3)
    assert w.backwards == 1 and w.tokens == T and w.meta()["emulation"]["emulation"] is True


def test_head_and_tail_shapes(cfg8b, plans8b):
    sl = FakeSleep()
    head = _worker(cfg8b, 0, plans8b[0], sl)
    out = head.forward("h", torch.zeros(1, T, dtype=torch.int64))
    assert out["activations"].shape == (1, T, 64)
    assert head.backward("h", torch.zeros(1, T, 64)) is None
    tail = _worker(cfg8b, 7, plans8b[7], sl)
    res = tail.forward("t", torch.zeros(1, T, 64, dtype=torch.bfloat16), torch.zeros(1, T, dtype=torch.int64))
    f = stage_flops(cfg8b.model, cfg8b.pipeline, T, 7)
    assert res["loss"] == pytest.approx(math.log(128256)) and res["grad"].shape == (1, T, 64)
    assert sl.calls[-1] == pytest.approx((3 * f.forward + f.recompute(True)) * T / 156e12)  # forward + backward at once
    assert tail.backwards == 1 and len(tail.cache) == 0
    ev = tail.forward("e", torch.zeros(1, T, 64), torch.zeros(1, T, dtype=torch.int64), train=False)
    assert set(ev) >= {"loss"} and "grad" not in ev and sl.calls[-1] == pytest.approx(f.forward * T / 156e12)
    with pytest.raises(ValueError, match="targets"):
        tail.forward("t2", torch.zeros(1, T, 64))
    with pytest.raises(ValueError, match="2048-token"):
        head.forward("short", torch.zeros(1, 100, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"\[B, T, 64\]"):
        _worker(cfg8b, 3, plans8b[3], sl).forward("w", torch.zeros(1, T, 65))


def test_in_flight_bound_from_the_plan(cfg8b, plans8b):
    sl = FakeSleep()
    small = dataclasses.replace(plans8b[3], microbatches_in_flight_max=3)
    w = _worker(cfg8b, 3, small, sl)
    x = torch.zeros(1, T, 64)
    for i in range(3):
        w.forward(f"m{i}", x)
    n = len(sl.calls)
    with pytest.raises(InFlightLimitExceeded) as e:
        w.forward("m3", x)
    assert isinstance(e.value, ProtocolError) and e.value.outcome == Outcome.BUSY and e.value.status == 503
    assert len(sl.calls) == n and w.refused == 1                    # refused before any compute
    assert w.cache.stats()["bytes"] == 3 * small.activation_bytes_per_microbatch
    w.backward("m0", x)
    w.forward("m3", x)                                              # memory freed by the backward
    with pytest.raises(UnknownMicrobatch):
        w.backward("never", x)
    with pytest.raises(ValueError, match="gradient shape"):
        w.backward("m1", torch.zeros(2, T, 64))
    assert "m1" in w.cache                                          # a bad gradient loses nothing


def test_the_real_plan_bounds_in_flight(cfg8b):
    """8b stage 3 on an A100 with checkpointing: the plan's bound (~280), and without it ~15."""
    w = EmulatedStageWorker(cfg8b, 3, Emulation(GPUS["a100"]), sleep=lambda s: None)
    assert w.cache.max_entries == w.plan.microbatches_in_flight_max > 100
    no_ckpt = dataclasses.replace(cfg8b, train=dataclasses.replace(cfg8b.train, activation_checkpointing=False))
    w2 = EmulatedStageWorker(no_ckpt, 3, Emulation(GPUS["a100"]), sleep=lambda s: None)
    assert 8 <= w2.cache.max_entries < 30


def test_a_stage_that_does_not_fit_is_refused(cfg8b):
    with pytest.raises(ConfigError, match="(?s)does not fit the emulated RTX-4090.*NO.*more stages"):
        EmulatedStageWorker(cfg8b, 0, Emulation(parse_accelerator("4090")))      # a 1.6B-param stage in 24 GiB


def test_inner_steps_and_recompute(cfg8b, plans8b):
    sl = FakeSleep()
    small = dataclasses.replace(cfg8b, train=dataclasses.replace(cfg8b.train, batch_size=2, micro_batch_size=1))
    w = _worker(small, 3, plans8b[3], sl)
    x = torch.zeros(1, T, 64)
    for mb in ("a", "b", "c"):
        w.forward(mb, x)
    w.backward("a", x)
    w.backward("b", x)                       # 2 micro-batches = one inner step
    assert w.inner_step == 1 and w.version == 1
    assert sl.calls[-1] == pytest.approx(plans8b[3].params * 28 / GPUS["a100"].memory_bandwidth)
    n = sl.calls[-2]                         # the backward of b
    w.backward("c", x)                       # forwarded before the step: recomputed
    assert w.recomputes == 1 and sl.calls[-1] > n
    assert w.last_weights_step == 1


def test_state_and_resume(cfg8b, plans8b, tmp_path):
    sl = FakeSleep()
    w = _worker(cfg8b, 3, plans8b[3], sl)
    w.inner_step, w.tokens = 7, 1234
    p = w.save(tmp_path / "stage3.safetensors")
    assert p.exists() and '"emulation": true' in p.read_text()
    w2 = _worker(cfg8b, 3, plans8b[3], sl)
    assert w2.load(tmp_path / "stage3.safetensors") and w2.inner_step == 7 and w2.tokens == 1234
    assert _worker(cfg8b, 3, plans8b[3], sl).load(tmp_path / "none.safetensors")    # nothing to fetch from peers
    with pytest.raises(EmulationError):
        w.state_bytes()
    assert w.module.param_count() == plans8b[3].params and next(w.module.parameters()).device.type == "meta"


def test_real_stage_worker_counts_busy_time():
    cfg = load_config("configs/tiny.yaml")
    w = StageWorker(cfg, 1)
    assert w.busy_s == 0
    t0 = time.perf_counter()
    w.forward("m", torch.randn(4, 256, 32))
    w.backward("m", torch.randn(4, 256, 32))
    wall = time.perf_counter() - t0
    assert 0 < w.busy_s <= wall and w.meta()["busy_s"] > 0
    busy = w.busy_s
    w.step()
    assert w.busy_s > busy


# ------------------------------------------------------------------------------------ over HTTP
def test_emulated_miner_over_signed_http(tmp_home):
    """A MinerService with --emulate-gpu serves over signed HTTP; its stage's forward and backward (on
    its compute thread, as the data plane runs them) come back in the emulated shapes (bf16), and its
    status says it is emulation."""
    from iota_subnet.devnet import add_stake, create_devnet, open_devnet
    from iota_subnet.miner.options import MinerOptions, ServeOptions
    from iota_subnet.miner.service import MinerService
    from iota_subnet.protocol import Health
    from iota_subnet.transport import NeuronClient
    from iota_subnet.wallets import create_wallet
    import json

    cfg = load_config("configs/tiny.yaml", {"data": {"seq_len": 64}, "train": {"batch_size": 4, "micro_batch_size": 2}})

    async def go():
        db = tmp_home / "chain.db"
        create_devnet(db, 9, tempo=50, block_time=0.5, weights_rate_limit=1, max_validators=1)
        val = create_wallet("val", "default", tmp_home / "w")
        mw = create_wallet("miner", "default", tmp_home / "w")
        chain = await open_devnet(db)
        await chain.register(val, 9)
        add_stake(db, val.hotkey.ss58_address, val.coldkey.ss58_address, 100.0)
        await chain.register(mw, 9)
        svc = MinerService(cfg, mw, chain, MinerOptions(netuid=9, run_id="r", stage=1, out_dir=tmp_home / "m",
                                                        serve=ServeOptions(host="127.0.0.1")),
                           parts=emulated_parts(Emulation(parse_accelerator("1e12", 4.0), 0.5, 1.0)))
        port = await svc.start()
        try:
            ep, hk = f"127.0.0.1:{port}", mw.hotkey.ss58_address
            async with NeuronClient(val) as c:
                h = await c.call(ep, hk, "/health", Health(run_id="r", stage=1), Health)
                assert h.ready and h.stats["stage"] == 1
            res = await svc.compute.run(svc.worker.forward, "m", torch.randn(2, 64, 32))
            assert res["activations"].shape == (2, 64, 32) and res["activations"].dtype == torch.bfloat16
            grad = await svc.compute.run(svc.worker.backward, "m", torch.randn(2, 64, 32))
            assert grad.shape == (2, 64, 32)
            assert svc.worker.emulated and svc.worker.busy_s > 0
            svc.write_status()
            st = json.loads((tmp_home / "m" / "status.json").read_text())
            assert st["emulation"]["emulation"] is True and st["busy_s"] > 0 and st["cache"]["emulated"]
            # it merges: a virtual merge engine over a proxy of the stage (iota_subnet.sim.virtual_merge)
            assert isinstance(svc.merge, VirtualMergeEngine)
            P = svc.worker.module.param_count()
            v = st["merge"]["virtual"]
            assert v["true_numel"] == P and v["proxy_numel"] * v["scale"] >= P and v["proxy_numel"] <= 1 << 20
            assert svc.merge.params.numel == v["proxy_numel"] and st["merge"]["merged_epoch"] == -1
            before = svc.worker.merge_module.flat.detach().clone()
            await svc.compute.run(svc.worker.step)
            assert not torch.equal(before, svc.worker.merge_module.flat.detach())     # a non-zero pseudo-gradient
            # the modelled update store (the miner's audit window) and checkpoints are in status.json
            assert st["modelled"]["update_store"]["keep_steps"] == svc.audit_window > 0
            assert st["modelled"]["checkpoints"]["file_bytes"] >= 12 * svc.worker.plan.params
        finally:
            await svc.stop()
            await chain.close()
    asyncio.run(go())


def test_served_without_training_costs_an_input_gradient_only(cfg8b, plans8b):
    """A micro-batch a replica serves for another lane (accumulate=False): the backward computes the
    input gradient only (1 x forward + recomputation, not 2 x), and nothing counts towards a step."""
    sl = FakeSleep()
    w = _worker(cfg8b, 3, plans8b[3], sl)
    f = stage_flops(cfg8b.model, cfg8b.pipeline, T, 3)
    x = torch.zeros(1, T, 64)
    w.forward("f", x, accumulate=False)
    g = w.backward("f", x)
    assert g.shape == (1, T, 64) and w.backwards == 0 and w.pending == 0 and w.tokens == T
    assert sl.calls[-1] == pytest.approx((f.forward + f.recompute(True)) * T / 156e12)
    tail = _worker(cfg8b, 7, plans8b[7], sl)
    ft = stage_flops(cfg8b.model, cfg8b.pipeline, T, 7)
    res = tail.forward("t", x, torch.zeros(1, T, dtype=torch.int64), accumulate=False)
    assert "grad" in res and tail.pending == 0
    assert sl.calls[-1] == pytest.approx((2 * ft.forward + ft.recompute(True)) * T / 156e12)


def test_data_plane_hooks(cfg8b, plans8b):
    sl = FakeSleep()
    small = dataclasses.replace(cfg8b, train=dataclasses.replace(cfg8b.train, batch_size=2, micro_batch_size=1))
    w = _worker(small, 3, plans8b[3], sl)
    w.auto_step = False                          # the data plane steps when the lane step is complete
    x = torch.zeros(1, T, 64)
    for mb in ("a", "b", "c"):
        w.forward(mb, x)
    w.backward("a", x)
    w.backward("b", x)
    assert w.inner_step == 0 and w.pending == 2
    w.step()
    assert w.inner_step == 1 and w.pending == 0
    assert w.drop("c") and not w.drop("c") and len(w.cache) == 0
    assert w.skip_to(5) == 4 and w.inner_step == 5 and w.skip_to(3) == 0


def test_emulated_miners_run_the_p2p_data_plane(tmp_home, tmp_path, wikitext_path, cache_dir):
    """3 x 2 emulated miners (a 2 TFLOP/s, 4 GiB device) behind the real data plane and validator:
    the lanes finish their steps, the loss is ln(vocab) (nothing learns), busy time is counted, and
    every miner's status says it is emulation."""

    async def main():
        net = P2PNet(tmp_path, wikitext_path, cache_dir)
        emu = Emulation(parse_accelerator("2e12", 4.0), 0.5, 1.0)
        await net.start(parts=emulated_parts(emu))
        try:
            assert all(m.worker.emulated for m in net.miners.values())
            vali = net.validator(steps=2)
            assert await vali.run() == 0
            st = net.status()
            assert st["done"] and st["steps_done"] == {"0": 2, "1": 2}, st
            assert st["val_loss"] == pytest.approx(math.log(512), abs=1e-4)
            for m in net.miners.values():
                assert m.worker.inner_step == 2 and m.worker.busy_s > 0
                assert m.status()["emulation"]["emulation"] is True
        finally:
            await net.close()
    run(main())


def test_same_interface_as_the_real_stage_worker():
    """Every public method of StageWorker the miner and the data plane call exists on the emulated
    worker with the same parameters (this fails when StageWorker's interface changes alone)."""
    import inspect
    for name in ("forward", "backward", "step", "drop", "skip_to", "weights_replaced", "meta", "save", "load",
                 "state_bytes", "snapshot", "write_snapshot"):
        real = inspect.signature(getattr(StageWorker, name))
        emu = inspect.signature(getattr(EmulatedStageWorker, name))
        assert list(real.parameters) == list(emu.parameters), name
        for p in real.parameters:
            assert real.parameters[p].default == emu.parameters[p].default, (name, p)
            assert real.parameters[p].kind == emu.parameters[p].kind, (name, p)
    cfg = load_config("configs/tiny.yaml")
    real = StageWorker(cfg, 1)
    emu = EmulatedStageWorker(cfg, 1, Emulation(parse_accelerator("1e12", 4.0)), sleep=lambda s: None)
    for attr in ("spec", "cache", "lock", "inner_step", "version", "merges", "pending", "forwards", "backwards",
                 "tokens", "trained_tokens", "busy_s", "auto_step", "micro_per_step", "precision", "last_weights_step",
                 "last_weights_merges", "module", "merge_module", "lane", "opt"):
        assert hasattr(real, attr) and hasattr(emu, attr), attr
    for key in ("entries", "bytes", "max_bytes", "ttl_s", "evictions"):
        assert key in real.cache.stats() and key in emu.cache.stats()


def test_backward_may_refuse_to_accumulate(cfg8b, plans8b):
    sl = FakeSleep()
    w = _worker(cfg8b, 3, plans8b[3], sl)
    f = stage_flops(cfg8b.model, cfg8b.pipeline, T, 3)
    x = torch.zeros(1, T, 64)
    w.forward("s", x)
    w.backward("s", x, accumulate=False)           # the stage moved past this micro-batch's step
    assert w.pending == 0 and w.backwards == 0
    assert sl.calls[-1] == pytest.approx((f.forward + f.recompute(True)) * T / 156e12)
