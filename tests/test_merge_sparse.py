"""Compressed merges (``merge.quantization: topk``, SparseLoCo): the wire encodings, the error feedback,
a 3-replica merge against a single-process reference, and the bytes of the largest ``8b`` stage."""
from __future__ import annotations

import asyncio
import importlib.util
import math
from pathlib import Path

import pytest
import torch

from iota_subnet.config import ConfigError, MergeConfig, load_config
from iota_subnet.merge import MergeEngine, MergePlan, ModuleParams, epoch_seed, outer_step
from iota_subnet.merge import sparse
from iota_subnet.merge.outer import dequantize, quantize, rounded, rounding_bound, weighted_mean
from iota_subnet.merge.transport import InProcessTransport

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[1]
HK = [f"5Hotkey{i:02d}" for i in range(4)]
TOPK = sparse.topk_mode(32, 4096, 2)
MEAN = sparse.sparse_mode(4096)


def test_topk_roundtrip_keeps_the_largest_and_counts_its_bytes():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3 * 4096 + 1000, generator=g)                     # a ragged last block
    q, sc = quantize(x, TOPK)
    assert q.dtype == torch.int8 and sc.dtype == torch.float32 and sc.numel() == 2 * 4
    assert q.numel() + 4 * sc.numel() == sparse.wire_bytes(TOPK, x.numel())
    # 8-byte header, 32 positions x 12 bits and 32 codes x 2 bits per block, two float32 per block
    assert sparse.wire_bytes(TOPK, 4096) == 8 + 48 + 8 + 8
    y = dequantize(q, sc, TOPK)
    assert y.shape == x.shape
    for b in range(4):
        xb, yb = x[b * 4096:(b + 1) * 4096], y[b * 4096:(b + 1) * 4096]
        sel = yb != 0
        assert int(sel.sum()) == 32
        assert torch.equal(sel, xb.abs() >= xb.abs().topk(32).values[-1])      # the 32 largest magnitudes
        assert torch.equal(torch.sign(yb[sel]), torch.sign(xb[sel]))
        lo, hi = float(xb[sel].abs().min()), float(xb[sel].abs().max())
        assert bool(((yb[sel].abs() - xb[sel].abs()).abs() <= (hi - lo) / 2 * 0.5 + 1e-6).all())   # half a step
    assert torch.equal(rounded(x, TOPK)[0], y)
    assert len(q.numpy().tobytes()) < 0.02 * 4 * x.numel()          # under 2 % of fp32


def test_sparse_mean_layouts_decode_alike_and_bad_payloads_are_refused():
    g = torch.Generator().manual_seed(1)
    few = torch.zeros(8192)
    few[torch.randperm(8192, generator=g)[:150]] = torch.randn(150, generator=g)
    many = torch.randn(8192, generator=g)
    for x, layout in ((few, "S"), (many, "D")):
        q, sc = quantize(x, MEAN)
        assert chr(int(q.view(torch.uint8)[0])) == layout
        y = dequantize(q, sc, MEAN)
        ref = rounded(x, "int8", 4096)[0]                             # int8 with one scale per block of 4096
        assert torch.equal(y, ref)
        assert bool(((y - x).abs() <= rounding_bound(x, MEAN) * 1.001).all())
    q, sc = quantize(few, MEAN)
    assert q.numel() + 4 * sc.numel() < sparse.wire_bytes(MEAN, 8192, 150) + 8
    # refusals: truncated, wrong mode, positions not ascending, negative scale
    with pytest.raises(ValueError):
        dequantize(q[:-1], sc, MEAN)
    with pytest.raises(ValueError):
        dequantize(*quantize(few, TOPK), MEAN)
    qt, st = quantize(many, TOPK)
    with pytest.raises(ValueError):
        dequantize(qt, st, sparse.topk_mode(16, 4096, 2))
    bad = qt.clone()
    bad[8:14] = 0                                                    # first positions all 0: not ascending
    with pytest.raises(ValueError, match="ascending"):
        dequantize(bad, st, TOPK)
    with pytest.raises(ValueError):
        dequantize(qt, -st, TOPK)


def test_error_feedback_carries_the_residual():
    """beta = 1: what was sent over the merges plus what is left equals the sum of the deltas."""
    fb = sparse.ErrorFeedback(1.0)
    g = torch.Generator().manual_seed(2)
    total_delta, total_sent = torch.zeros(5000), torch.zeros(5000)
    for t in range(6):
        delta = torch.randn(5000, generator=g)
        acc = fb.accumulate(delta)
        sent = rounded(acc, TOPK)[0]
        fb.hold(acc, [(0, sent)])
        if t == 3:                                                   # a failed attempt changes nothing
            continue
        fb.commit()
        total_delta += delta
        total_sent += sent
    assert torch.allclose(total_sent + fb.state, total_delta, atol=1e-4)
    off = sparse.ErrorFeedback(None)
    d = torch.ones(3)
    assert off.accumulate(d) is d and (off.hold(d, []), off.state) == (None, None)
    fb.load(torch.ones(7), 5000)                                     # another size: start from zero
    assert fb.state is None


def test_topk_config_validation():
    cfg = load_config("configs/tiny.yaml", {"merge": {"quantization": "topk", "topk_density": 0.015625}})
    assert cfg.merge.scatter_quant == "topk-64-4096-2" and cfg.merge.gather_quant == "sparse-4096"
    assert MergeConfig(quantization="topk", gather_quantization="int8").gather_quant == "int8"
    assert MergeConfig(quantization="int8").scatter_quant == "int8"
    for bad, word in (({"topk_density": 0.0}, "topk_density"), ({"topk_bits": 3}, "topk_bits"),
                      ({"error_feedback": 1.5}, "error_feedback"), ({"topk_chunk": 40000}, "topk_chunk"),
                      ({"topk_chunk": 3000}, "multiple of merge.topk_chunk"),
                      ({"gather_quantization": "topk"}, "gather_quantization")):
        with pytest.raises(ConfigError, match=word):
            MergeConfig(quantization="topk", **bad).validate()


def _replicas(n, cfg, hidden=512):
    net = InProcessTransport()
    engines, mods = [], []
    for i in range(n):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(16, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, 8))
        e = MergeEngine(HK[i], cfg, ModuleParams(m), net.view(HK[i]), run_id="r", stage=1)
        net.register(HK[i], e.handle)
        engines.append(e)
        mods.append(m)
    return engines, mods


def _train(mods, epoch):
    for i, m in enumerate(mods):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(100 * epoch + i)
        for _ in range(3):
            loss = m(torch.randn(4, 16, generator=g)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()


async def _merge_all(engines, epoch):
    return await asyncio.gather(*(e.merge(epoch, [x.me for x in engines]) for e in engines))


def _flat(m):
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def test_topk_merge_is_bit_identical_and_equals_a_single_process_reference():
    """3 replicas, three epochs (the later ones carry the error feedback; in the third one replica
    has none, as a fresh joiner): every replica ends with the same bits, equal to the same algorithm
    run in one process over the plan's chunks. A synced state drops the feedback, a late replica's
    kept progress keeps it."""
    cfg = MergeConfig(every_steps=1, quantization="topk", chunk_numel=4096, join_timeout_s=2.0,
                      phase_timeout_s=2.0, outer_lr=1.0, outer_momentum=0.0).validate()
    engines, mods = _replicas(3, cfg)
    P = engines[0].params.numel
    anchor, mom = engines[0].anchor.clone(), torch.zeros(P)
    ref_fb = [sparse.ErrorFeedback(cfg.error_feedback) for _ in range(3)]
    for epoch in range(3):
        _train(mods, epoch)
        if epoch == 2:          # a replica without feedback (a fresh joiner's state) merges with the others
            engines[2].feedback.reset()
            ref_fb[2].reset()
        ws = {e.me: _flat(m) for e, m in zip(engines, mods)}
        reps = asyncio.run(_merge_all(engines, epoch))
        assert all(r.status == "merged" for r in reps), [r.reason for r in reps]
        parts = sorted(ws)
        plan = MergePlan.make(epoch, 0, epoch_seed("r", 1, epoch), parts, P, {p: 1.0 for p in parts},
                              chunk_numel=cfg.chunk_numel)
        sent = {}
        for p, fb in zip(parts, ref_fb):
            acc = fb.accumulate(anchor - ws[p])
            sent[p] = {(o, n): dequantize(*quantize(acc[o:o + n], cfg.scatter_quant), cfg.scatter_quant)
                       for s in range(plan.num_shards) for (o, n) in plan.chunks(s)}
            fb.hold(acc, [(o, x) for (o, _), x in sent[p].items()])
            fb.commit()
        new, new_mom = torch.empty(P), torch.empty(P)
        for (o, n) in sent[parts[0]]:
            mean = rounded(weighted_mean([(1.0, sent[p][(o, n)]) for p in parts]), cfg.gather_quant)[0]
            new[o:o + n], new_mom[o:o + n] = outer_step(anchor[o:o + n], mom[o:o + n], mean, lr=1.0, mu=0.0)
        anchor, mom = new, new_mom
        finals = [_flat(m) for m in mods]
        assert all(torch.equal(finals[0], w) for w in finals[1:])
        assert torch.equal(finals[0], anchor)
        for e, fb in zip(sorted(engines, key=lambda e: e.me), ref_fb):
            assert torch.equal(e.feedback.state, fb.state)
    e = engines[0]
    assert float(e.feedback.state.abs().max()) > 0                    # something kept for later merges
    e.set_state(e.anchor, e.momentum, e.merged_epoch, keep_progress=True)
    assert e.feedback.state is not None
    e.set_state(e.anchor, e.momentum, e.merged_epoch)
    assert e.feedback.state is None


def _bench_costs():
    spec = importlib.util.spec_from_file_location("bench_costs", ROOT / "scripts" / "bench_costs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("n", [2, 3])
def test_topk_merge_of_the_largest_8b_stage_fits_100_mb(n):
    """Bytes the busiest replica sends in one merge of the largest ``8b`` stage (scatter + the sparse
    means it serves, at worst N x k nonzeros per block), from the merge plan and the encoder's sizes,
    with the config's default density and bits."""
    from iota_subnet.plan import meta_stage, plan_stage
    from iota_subnet.hardware import GPUS
    bc = _bench_costs()
    cfg = load_config(str(ROOT / "configs" / "8b.yaml"))
    P = plan_stage(cfg, 0, GPUS["a100"].memory_bytes, module=meta_stage(cfg, 0)).params
    assert P > 1.5e9
    nbytes = bc.topk_merge_bytes(cfg.merge, n, P)
    assert nbytes <= 100e6, nbytes
    # the per-value cost behind it: 12-bit positions and 2-bit codes of 32 values per 4096
    assert sparse.bytes_per_value(sparse.topk_mode(cfg.merge.topk_k, 4096, 2)) == pytest.approx(64 / 4096, rel=1e-3)
    assert math.isclose(cfg.merge.topk_k, 32)


def test_the_error_feedback_is_saved_and_restored_with_the_merge_state(tmp_path, tmp_home):
    """A miner writes its error feedback into its merge-state file after a merge and reads it back on
    start (a fresh joiner, with no file, starts from zero)."""
    from iota_subnet.train.checkpoint import read_checkpoint
    from support.merge_net import OVR, Net, merge_epoch, train_locally

    async def main():
        net = Net(tmp_path, ovr={**OVR, "merge": {**OVR["merge"], "quantization": "topk"}})
        await net.start(2)
        try:
            for k, s in enumerate(net.svcs):
                train_locally(s, k)
            assert all(r.applied for r in await merge_epoch(net.svcs, 0))
            b = net.svcs[1]
            kept = b.merge.feedback.state.clone()
            assert float(kept.abs().max()) > 0
            await asyncio.get_running_loop().run_in_executor(None, b.merging.save_state)
            tensors, _ = read_checkpoint(b.merging.state_path)
            assert torch.equal(tensors["error_feedback"], kept)
            b.merge.feedback.reset()
            b.merging._load_state()
            assert torch.equal(b.merge.feedback.state, kept)
        finally:
            await net.close()
    asyncio.run(main())
