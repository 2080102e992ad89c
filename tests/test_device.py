"""Device correctness on a CPU-only machine: every path that touches a stage's tensors (hashing, the
wire codec, the merge engine, state sync, the stage worker, checkpoints, verification replay) runs
with the stage on a second device, and any operator that mixes that device with host tensors fails
as it would on CUDA.

The second device is :class:`shadow_device.ShadowDevice` (see its docstring for why not
``FakeTensorMode``): tensors that report the ``meta`` device and hold real values, with CUDA's
rules (same device per operator, explicit copies only, no ``.numpy()``). ``scripts/gpu_check.sh``
runs this file again on a real GPU with ``IOTA_TEST_DEVICE=cuda``.
"""
from __future__ import annotations

import asyncio
import os

import pytest
import torch

from iota_subnet.config import MergeConfig
from iota_subnet.merge import MergeEngine, ModuleParams, outer_step
from iota_subnet.merge.sync import SnapshotDonor, sync_state
from iota_subnet.merge.transport import InProcessTransport
from iota_subnet.protocol import MergePayload, decode, encode, tensor_sha256
from shadow_device import MIXES, ShadowDevice, on_shadow

pytestmark = pytest.mark.timeout(120)

HK = [f"5Device{i:02d}" for i in range(4)]
#: On a GPU host ``IOTA_TEST_DEVICE=cuda`` runs the same tests on the real device.
REAL_DEVICE = os.environ.get("IOTA_TEST_DEVICE", "")


class _Device:
    """The device the tests put stages on: the shadow accelerator here, a real one on a GPU host."""

    def __init__(self):
        self.mode = None if REAL_DEVICE else ShadowDevice()
        self.device = torch.device(REAL_DEVICE) if REAL_DEVICE else self.mode.device

    def __enter__(self):
        if self.mode is not None:
            self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        if self.mode is not None:
            self.mode.__exit__(*exc)

    def run(self, make):
        """``asyncio.run(make())`` with worker threads (asyncio.to_thread) that see the device too."""
        async def main():
            if self.mode is not None:
                asyncio.get_running_loop().set_default_executor(self.mode.executor())
            return await make()
        return asyncio.run(main())

    def on_device(self, t: torch.Tensor) -> bool:
        return on_shadow(t) if self.mode is not None else t.device.type == self.device.type


@pytest.fixture
def dev():
    MIXES.clear()
    with _Device() as d:
        yield d


def _mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))


def _flat_host(m: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().to("cpu").reshape(-1) for p in m.parameters()])


# ------------------------------------------------------------------------------------------- hashing, codec
def test_tensor_sha256_and_codec_take_device_tensors(dev):
    host = torch.randn(1000, 3)
    x = host.to(dev.device)
    assert dev.on_device(x)
    assert tensor_sha256(x) == tensor_sha256(host)                  # same bytes, same digest
    assert tensor_sha256(x.t()) == tensor_sha256(host.t().contiguous())   # non-contiguous views too
    msg = MergePayload(epoch=1, total_numel=12, shard=torch.arange(12.0).to(dev.device))
    back = decode(encode(msg), MergePayload)
    assert not dev.on_device(back.shard) and torch.equal(back.shard, torch.arange(12.0))


# ------------------------------------------------------------------------------------------- merging
def _replicas_on_device(dev, n: int, cfg: MergeConfig, steps: int = 2):
    net = InProcessTransport()
    engines, mods = [], []
    for i in range(n):
        m = _mlp(0).to(dev.device)                      # same init everywhere, stage on the device
        e = MergeEngine(HK[i], cfg, ModuleParams(m), net.view(HK[i]), run_id="r", stage=1)
        net.register(HK[i], e.handle)
        engines.append(e)
        mods.append(m)
    for i, m in enumerate(mods):                        # local training on the device, different data
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(100 + i)
        for _ in range(steps):
            x = torch.randn(4, 16, generator=g).to(dev.device)
            loss = m(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return net, engines, mods


@pytest.mark.parametrize("quant", ["none", "int8"])
def test_merge_with_stages_on_a_device(dev, quant):
    """Today's failure: ``_reduce`` mixed this replica's device slice with decoded host slices."""
    cfg = MergeConfig(every_steps=1, quantization=quant, chunk_numel=256, join_timeout_s=5, phase_timeout_s=5)
    net, engines, mods = _replicas_on_device(dev, 3, cfg)
    anchor = engines[0].anchor.to("cpu")
    deltas = [anchor - _flat_host(m) for m in mods]
    reps = dev.run(lambda: asyncio.gather(*(e.merge(0, HK[:3]) for e in engines)))
    assert all(r.applied for r in reps), [(r.status, r.reason) for r in reps]
    assert not MIXES, MIXES
    ws = [_flat_host(m) for m in mods]
    assert all(torch.equal(ws[0], w) for w in ws[1:])
    assert all(p.device.type == dev.device.type for m in mods for p in m.parameters())   # weights stay on the device
    assert not any(dev.on_device(t) for e in engines for t in (e.anchor, e.momentum))    # merge state on the host
    if quant == "none":
        ref, _ = outer_step(anchor, torch.zeros_like(anchor), sum(deltas) / 3, lr=0.7, mu=0.9)
        assert torch.allclose(ws[0], ref, atol=1e-6)


def test_state_sync_from_device_tensors(dev, tmp_path):
    """Today's failure: the donor hashed its anchor with ``.numpy()`` on the device tensor."""
    P = 3000
    anchor, momentum = torch.randn(P).to(dev.device), torch.randn(P).to(dev.device)
    net = InProcessTransport()
    donors = []
    for hk in HK[:2]:
        d = SnapshotDonor("r", 1, chunk_numel=512)
        d.publish(anchor, momentum, merged_epoch=4, step=50)

        async def handle(route, msg, caller, d=d):
            return await d.handle(msg, caller)
        net.register(hk, handle)
        donors.append(d)
    a, m, man = dev.run(lambda: sync_state(HK[:2], net.view(HK[2]), run_id="r", stage=1, param_numel=P,
                                           work_dir=tmp_path))
    assert man["merged_epoch"] == 4 and not MIXES
    assert torch.equal(a, anchor.to("cpu")) and torch.equal(m, momentum.to("cpu"))
    # the engine adopts a state given as device tensors and keeps it on the host
    mod = _mlp(0).to(dev.device)
    e = MergeEngine(HK[0], MergeConfig(every_steps=1), ModuleParams(mod), None)
    n = e.params.numel
    e.set_state(anchor[:n], momentum[:n], 4)
    assert not dev.on_device(e.anchor) and torch.equal(_flat_host(mod), anchor[:n].to("cpu"))
