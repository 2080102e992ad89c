"""Merging replicas with no network: the plan, the outer step, quantization, and the all-reduce
state machine over the in-process transport (every message still goes through the wire codec)."""
from __future__ import annotations

import asyncio

import pytest
import torch

from iota_subnet.config import ConfigError, MergeConfig, load_config
from iota_subnet.merge import (MergeEngine, MergeEngineOptions, MergePlan, ModuleParams, dequantize, epoch_seed,
                               outer_step, quantize)
from iota_subnet.merge.outer import rounding_bound
from iota_subnet.merge.transport import InProcessTransport
from iota_subnet.protocol import MergePayload, Outcome, ProtocolError, tensor_sha256
from iota_subnet.sim.adversary import TamperingMergeEngine

pytestmark = pytest.mark.timeout(60)

HK = [f"5Hotkey{i:02d}" for i in range(8)]


def make_replicas(n, cfg, *, seed=0, tamper=None, steps=3, transport=None, hidden=32, options=None):
    net = transport or InProcessTransport()
    engines, mods = [], []
    for i in range(n):
        torch.manual_seed(seed)                         # same init on every replica (as StageWorker)
        m = torch.nn.Sequential(torch.nn.Linear(16, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, 8))
        mods.append(m)
        if tamper and tamper[0] == i:       # a reducer serving tamper(shard, mean) (the cheater suite's engine)
            e = TamperingMergeEngine(HK[i], cfg, ModuleParams(m), net.view(HK[i]), run_id="r", stage=1,
                                     tamper=tamper[1])
        else:
            e = MergeEngine(HK[i], cfg, ModuleParams(m), net.view(HK[i]), run_id="r", stage=1,
                            options=(options or {}).get(i, MergeEngineOptions()))
        net.register(HK[i], e.handle)
        engines.append(e)
    # local training: different data per replica
    for i, m in enumerate(mods):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(100 + i)
        for _ in range(steps):
            x = torch.randn(4, 16, generator=g)
            loss = m(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return net, engines, mods


def flat(m):
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


async def merge_all(engines, epoch, alive=None):
    peers = [e.me for e in engines]
    idx = range(len(engines)) if alive is None else alive
    return await asyncio.gather(*(engines[i].merge(epoch, peers) for i in idx))


FAST = dict(join_timeout_s=2.0, phase_timeout_s=2.0, max_attempts=2, outer_lr=0.7, outer_momentum=0.9)


# ---------------------------------------------------------------------------------------------- plan
def test_plan_is_deterministic_and_balanced():
    seed = epoch_seed("run", 1, 7)
    for n in (2, 3, 4, 8):
        parts = HK[:n]
        p1 = MergePlan.make(7, 0, seed, parts, 1000)
        p2 = MergePlan.make(7, 0, seed, list(reversed(parts)), 1000)
        assert p1 == p2                                          # no coordinator: same plan everywhere
        assert p1.num_shards == n and sum(sz for _, sz in p1.bounds) == 1000
        assert all(a != b for a, b in p1.reducers)                 # two distinct reducers per shard
        assert all(len(p1.shards_of(h)) == 2 for h in parts)       # each replica reduces 2 shards
        assert p1.bounds[0][0] == 0 and all(p1.bounds[i][0] + p1.bounds[i][1] == p1.bounds[i + 1][0]
                                            for i in range(n - 1))
    a = MergePlan.make(7, 0, seed, HK[:4], 1000)
    b = MergePlan.make(8, 0, epoch_seed("run", 1, 8), HK[:4], 1000)
    c = MergePlan.make(7, 1, seed, HK[:3], 1000)                  # one excluded: its shards reassigned
    assert a.plan_id != b.plan_id and a.plan_id != c.plan_id
    assert HK[3] not in {r for pair in c.reducers for r in pair}
    with pytest.raises(ValueError):
        MergePlan.make(7, 0, seed, [], 10)
    # a participant that did no work weighs 0 (it still reduces and gathers); all 0 or negative: refused
    assert MergePlan.make(7, 0, seed, HK[:2], 10, {HK[0]: 0.0}).weight(HK[0]) == 0.0
    for bad in ({HK[0]: 0.0, HK[1]: 0.0}, {HK[0]: -1.0}, {HK[0]: float("nan")}):
        with pytest.raises(ValueError):
            MergePlan.make(7, 0, seed, HK[:2], 10, bad)
    # chunks: consecutive, at most chunk_numel values, covering each shard; chunk size is part of the plan
    pc = MergePlan.make(7, 0, seed, HK[:3], 1000, chunk_numel=128)
    for s, (off, n) in enumerate(pc.bounds):
        ch = pc.chunks(s)
        assert ch[0][0] == off and sum(k for _, k in ch) == n and all(k <= 128 for _, k in ch)
        assert all(ch[i][0] + ch[i][1] == ch[i + 1][0] for i in range(len(ch) - 1))
    assert pc.plan_id != MergePlan.make(7, 0, seed, HK[:3], 1000, chunk_numel=256).plan_id
    # bytes per replica do not grow with the number of replicas (bounded by 3P)
    e2 = MergePlan.make(0, 0, seed, HK[:2], 10**6).expected_bytes()["sent"]
    e8 = MergePlan.make(0, 0, seed, HK[:8], 10**6).expected_bytes()["sent"]
    assert e8 < 3 * 4 * 10**6 and e2 <= e8


def test_outer_step_is_torch_nesterov_sgd():
    torch.manual_seed(0)
    anchor, delta, mom = torch.randn(100), torch.randn(100), torch.randn(100)
    p = torch.nn.Parameter(anchor.clone())
    opt = torch.optim.SGD([p], lr=0.7, momentum=0.9, nesterov=True)
    opt.state[p]["momentum_buffer"] = mom.clone()
    p.grad = delta.clone()
    opt.step()
    new, m = outer_step(anchor, mom, delta, lr=0.7, mu=0.9)
    assert torch.allclose(new, p.detach(), atol=1e-6) and torch.allclose(m, opt.state[p]["momentum_buffer"])
    # lr 1, no momentum: the plain average of the replicas' weights
    new, _ = outer_step(anchor, torch.zeros(100), delta, lr=1.0, mu=0.0)
    assert torch.allclose(new, anchor - delta)


def test_quantization_roundtrip():
    x = torch.randn(1000) * 3
    q, s = quantize(x, "none")
    assert s is None and torch.equal(dequantize(q, s, "none"), x)
    q, s = quantize(x, "bf16")
    assert q.dtype == torch.bfloat16 and (dequantize(q, s, "bf16") - x).abs().max() < 0.05
    q, s = quantize(x, "int8", 256)
    assert q.dtype == torch.int8 and s.numel() == 4
    err = (dequantize(q, s, "int8", 256) - x).abs().max()
    assert err <= x.abs().max() / 127 * 0.51
    with pytest.raises(ValueError):
        dequantize(q, s[:2], "int8", 256)
    with pytest.raises(ValueError):
        quantize(x, "fp8")


def test_merge_config_validation():
    cfg = load_config("configs/tiny.yaml", {"merge": {"every_steps": 5, "outer_lr": 0.5, "quantization": "int8"}})
    assert cfg.merge.enabled and cfg.merge.outer_lr == 0.5
    for bad, word in (({"quantization": "fp4"}, "quantization"), ({"outer_momentum": 1.0}, "outer_momentum"),
                      ({"every_steps": -1}, "every_steps"), ({"bogus": 1}, "unknown key")):
        with pytest.raises(ConfigError, match=word):
            load_config("configs/tiny.yaml", {"merge": bad})


# ---------------------------------------------------------------------------------------------- all-reduce
@pytest.mark.parametrize("n,quant", [(2, "none"), (3, "none"), (5, "none"), (3, "int8"), (4, "bf16")])
def test_merge_bit_identical_and_correct(n, quant):
    cfg = MergeConfig(every_steps=1, quantization=quant, **FAST)
    net, engines, mods = make_replicas(n, cfg)
    anchor = engines[0].anchor.clone()
    deltas = [anchor - flat(m) for m in mods]
    reps = asyncio.run(merge_all(engines, 0))
    assert all(r.status == "merged" for r in reps), [r.reason for r in reps]
    ws = [flat(m) for m in mods]
    assert all(torch.equal(ws[0], w) for w in ws[1:])             # bit-identical
    assert len({e.anchor.numpy().tobytes() for e in engines}) == 1
    assert len({tensor_sha256(e.momentum) for e in engines}) == 1
    if quant == "none":
        mean = sum(deltas) / n
        ref, _ = outer_step(anchor, torch.zeros_like(anchor), mean, lr=0.7, mu=0.9)
        assert torch.allclose(ws[0], ref, atol=1e-6)
    # bytes reported, and bounded by ~3P x 4 bytes (+ headers) whatever n
    P = anchor.numel()
    assert all(0 < r.bytes_sent < 3 * 4 * P + 20_000 for r in reps)
    # a second epoch continues from the merged anchor; a contribution for epoch 0 is now LATE
    reps = asyncio.run(merge_all(engines, 1))
    assert all(r.applied for r in reps)
    with pytest.raises(ProtocolError) as ei:
        engines[0]._on_contribute(MergePayload(epoch=0, plan_id="x", total_numel=P, shard=torch.zeros(3)), HK[1])
    assert ei.value.outcome == Outcome.LATE and ei.value.status == 410


# bytes sent per replica at N = 3 (MergePlan.expected_bytes): int8 scatter 4/3 x 1.016 P, gather 1/3 P x
# 4 (fp32), 2 (bf16) or 1.016 (int8): ratios 0.63 and 0.75 to the fp32 gather (no gather at N = 2: both
# replicas reduce every shard)
@pytest.mark.parametrize("gq,max_ratio", [("int8", 0.66), ("bf16", 0.78)])
def test_quantized_gather_rounds_the_mean_once_and_sends_fewer_bytes(gq, max_ratio):
    """``merge.gather_quantization``: reducers round the mean to the gather's encoding before the outer
    step and send it encoded; replicas stay bit-identical, the result is within the rounding bound of
    the fp32 gather's, and (int8 scatter in both) the bytes sent fall (int8 gather: ~1.02 B per value
    instead of 4)."""
    res = {}
    for g in ("none", gq):
        cfg = MergeConfig(every_steps=1, quantization="int8", gather_quantization=g, **FAST)
        assert cfg.validate().gather_quant == g
        net, engines, mods = make_replicas(3, cfg, hidden=4096)     # 102k values: bytes beyond the headers
        anchor = engines[0].anchor.clone()
        reps = asyncio.run(merge_all(engines, 0))
        assert all(r.status == "merged" for r in reps), [r.reason for r in reps]
        ws = [flat(m) for m in mods]
        assert all(torch.equal(ws[0], w) for w in ws[1:])
        res[g] = (anchor, ws[0], sum(r.bytes_sent for r in reps))
    anchor, w_none, b_none = res["none"]
    _, w_q, b_q = res[gq]
    step = 0.7 * (1 + 0.9)                   # Nesterov from zero momentum: anchor - lr (1 + mu) mean
    mean = (anchor - w_none) / step
    if gq == "int8":        # int8 blocks start at each shard's start: bound by the absmax of any block around a value
        near = torch.nn.functional.max_pool1d(mean.abs()[None, None], 511, stride=1, padding=255)[0, 0]
        bound = step * near / 254 * 1.001 + 1e-6
    else:
        bound = step * rounding_bound(mean, gq) * 1.001 + 1e-6
    diff = (w_q - w_none).abs()
    assert bool((diff <= bound).all()) and float(diff.max()) > 0, float((diff - bound).max())
    assert b_q < max_ratio * b_none, (b_q, b_none)
    assert MergeConfig(gather_quantization="same", quantization="bf16").gather_quant == "bf16"
    with pytest.raises(ConfigError, match="gather_quantization"):
        MergeConfig(gather_quantization="fp4").validate()


def test_tampered_shard_detected_and_merge_correct():
    cfg = MergeConfig(every_steps=1, **FAST)
    evil = 1

    def tamper(s, mean):
        return mean + 0.01

    net, engines, mods = make_replicas(4, cfg, tamper=(evil, tamper))
    anchor = engines[0].anchor.clone()
    mean = sum(anchor - flat(m) for m in mods) / 4
    ref, _ = outer_step(anchor, torch.zeros_like(anchor), mean, lr=0.7, mu=0.9)
    reps = asyncio.run(merge_all(engines, 0))
    assert all(r.applied for r in reps)
    for i, m in enumerate(mods):
        assert torch.allclose(flat(m), ref, atol=1e-6)
    ws = [flat(m) for m in mods]
    assert all(torch.equal(ws[0], w) for w in ws[1:])
    reports = [ev for e in engines for ev in e.reports]
    assert reports, "the mismatch was not reported"
    assert all(ev["wrong"] == [HK[evil]] for ev in reports)
    assert all(set(ev["reducers"]) >= {HK[evil]} and ev["recomputed_sha256"] for ev in reports)


def test_replica_killed_mid_merge_leaves_others_consistent():
    cfg = MergeConfig(every_steps=1, **FAST)
    net, engines, mods = make_replicas(4, cfg)
    victim = 2
    before = flat(mods[victim]).clone()
    orig = engines[victim]._reduce

    async def dying_reduce(sess, s):       # dies after joining, before reducing its shards
        net.kill(HK[victim])
        raise asyncio.CancelledError()
    engines[victim]._reduce = dying_reduce

    async def run():
        peers = [e.me for e in engines]
        alive = [0, 1, 3]
        tasks = [asyncio.create_task(engines[i].merge(0, peers)) for i in alive]
        vt = asyncio.create_task(engines[victim].merge(0, peers))
        res = await asyncio.gather(*tasks)
        try:
            await vt
        except asyncio.CancelledError:
            pass
        return res
    reps = asyncio.run(run())
    engines[victim]._reduce = orig
    assert all(r.status == "merged" for r in reps), [(r.status, r.reason) for r in reps]
    assert all(r.attempts == 2 and HK[victim] in r.missing for r in reps)   # excluded, shards reassigned
    ws = [flat(mods[i]) for i in (0, 1, 3)]
    assert all(torch.equal(ws[0], w) for w in ws[1:])
    assert torch.equal(flat(mods[victim]), before)                 # nothing half-applied on the victim
    assert engines[0].merged_epoch == 0 and engines[victim].merged_epoch == -1


def test_merge_abandoned_when_it_cannot_complete():
    cfg = MergeConfig(every_steps=1, join_timeout_s=0.5, phase_timeout_s=0.5, max_attempts=1, outer_lr=0.7,
                      outer_momentum=0.9)
    net, engines, mods = make_replicas(3, cfg)
    before = [flat(m).clone() for m in mods]

    async def never(sess, s):
        await asyncio.sleep(1.5)
    engines[2]._reduce = never                                     # a reducer that never answers in time
    reps = asyncio.run(merge_all(engines, 0))
    assert all(r.status == "abandoned" for r in reps)
    for m, b in zip(mods, before):
        assert torch.equal(flat(m), b)                              # no half-applied merge
    assert all(e.merged_epoch == -1 for e in engines)
    # retried next epoch: everyone healthy again, the next merge applies
    engines[2]._reduce = MergeEngine._reduce.__get__(engines[2])
    assert all(r.applied for r in asyncio.run(merge_all(engines, 1)))
    assert torch.equal(flat(mods[0]), flat(mods[2]))


def test_alone_and_late():
    cfg = MergeConfig(every_steps=1, **FAST)
    net, engines, mods = make_replicas(3, cfg)
    reps = asyncio.run(merge_all(engines[:2], 0))                  # replica 2 not at the boundary yet
    # engines[:2] only know each other as peers in this call
    assert all(r.applied for r in reps)
    late = asyncio.run(engines[2].merge(0, [e.me for e in engines]))
    assert late.status == "late"                                   # pulls the merged weights instead



def test_merge_oversight_counts_only_served_evidence_from_other_replicas():
    from iota_subnet.validator.merge_weights import MergeOversight, decode_commitment

    def ev(reporter, wrong, shard=0, run="r", stage=1):
        return {"reporter": reporter, "wrong": wrong, "run_id": run, "stage": stage, "epoch": 3, "attempt": 0,
                "plan_id": "p", "shard": shard, "claimed_sha256": {wrong[0]: "bad", "h": "good"},
                "recomputed_sha256": "good"}
    mo = MergeOversight("r")
    assert mo.add("A", 1, [ev("A", ["X"])]) == 1
    assert mo.add("A", 1, [ev("A", ["X"])]) == 0                     # duplicate
    assert mo.add("B", 1, [ev("A", ["Y"]), ev("B", ["Y"], run="other"), ev("B", ["Y"], stage=2)]) == 0  # forged / foreign
    assert mo.add("X", 1, [ev("X", ["X"], shard=1)]) == 1           # self-accusation: kept, not an accusation
    assert mo.add("B", 1, [ev("B", ["X"])]) == 1
    # accusations wait for the validator's own check (MergeAuditor): none is decided by counting
    pending = mo.accusations()
    assert sorted((e["reporter"], hk) for _, e, hk in pending) == [("A", "X"), ("B", "X")]

    class Unreachable:
        async def verify(self, ev, hk, fetch):
            from iota_subnet.validator.merge_audit import Verdict
            return Verdict(ev["reporter"], hk, "unresolved", "nobody answered")
    for _ in range(3):                                                  # unresolved: retried up to max_tries
        assert len(asyncio.run(mo.verify(Unreachable(), None))) == 2
    assert mo.accusations() == [] and mo.verdicts == {}
    # merge weights: cheaters 0 (only those entries), unchanged -> None
    raw = mo.commitment([1, 2, 3, 4], cheaters={2})
    assert decode_commitment(raw, "r") == {2: 0.0}
    assert mo.commitment([1, 2, 3, 4], cheaters={2}) is None
    assert decode_commitment(mo.commitment([1, 2, 3, 4], cheaters={2, 4}), "r") == {2: 0.0, 4: 0.0}


def test_plan_mismatch_from_a_late_weights_view_is_retried_not_excluded():
    """Replica 0 reads new merge weights (replica 2 excluded) one attempt before replicas 1 and 2 do:
    attempt 0 builds different plans on either side and fails; the peers are not treated as
    missing, every replica re-reads its view (``before_attempt``) and attempt 1 merges 0 and 1."""
    cfg = MergeConfig(every_steps=1, **FAST)
    net, engines, mods = make_replicas(3, cfg)
    views = {0: 1, 1: 0, 2: 0}                       # attempt from which each replica sees the new weights
    attempt = {i: -1 for i in range(3)}

    def mk(i):
        def before():
            attempt[i] += 1

        def weights(parts):
            new = attempt[i] >= views[i]
            return {p: (0.0 if (new and p == HK[2]) else 1.0) for p in parts}
        return before, weights
    for i, e in enumerate(engines):
        e.before_attempt, e.weights_fn = mk(i)
    views[0] = 0                                      # replica 0 sees the new weights at once
    views[1] = views[2] = 1                           # the others one attempt later
    reps = asyncio.run(merge_all(engines, 0))
    assert reps[0].applied and reps[1].applied, [(r.status, r.reason) for r in reps]
    assert reps[0].attempts == 2 and reps[0].participants == [HK[0], HK[1]]
    assert HK[1] not in reps[0].missing and HK[0] not in reps[1].missing
    assert reps[2].status == "abandoned" and "weight 0" in reps[2].reason
    assert torch.equal(flat(mods[0]), flat(mods[1])) and not torch.equal(flat(mods[0]), flat(mods[2]))
    assert engines[0].merged_epoch == 0 and engines[2].merged_epoch == -1


# ---------------------------------------------------------------------------------------------- work, overlap, chunks
def _engines_with_work(n, cfg, works):
    net = InProcessTransport()
    engines, mods = [], []
    for i in range(n):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
        e = MergeEngine(HK[i], cfg, ModuleParams(m), net.view(HK[i]), run_id="r", stage=1,
                        options=MergeEngineOptions(work_fn=lambda i=i: works[i]))
        net.register(HK[i], e.handle)
        engines.append(e)
        mods.append(m)
    return net, engines, mods


def _train(m, seed, steps=3):
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        loss = m(torch.randn(4, 16, generator=g)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_replica_without_work_does_not_dilute_and_weights_follow_work():
    """A replica that trained nothing in the window (inner step 0, zero pseudo-gradient) takes part
    (it reduces, gathers and ends with the merged weights) but weighs 0: the replica that trained
    keeps all of its progress (fraction kept 1.0; it was 0.5 with equal weights)."""
    cfg = MergeConfig(every_steps=1, **{**FAST, "outer_lr": 1.0, "outer_momentum": 0.0})
    works = [0.0, 0.0]
    net, engines, mods = _engines_with_work(2, cfg, works)
    anchor = engines[0].anchor.clone()
    _train(mods[0], 1)
    works[0] = 2048.0                                   # tokens replica 0 trained; replica 1 got nothing
    moved = anchor - flat(mods[0])
    reps = asyncio.run(merge_all(engines, 0))
    assert all(r.applied for r in reps) and reps[0].weights == {HK[0]: 2048.0, HK[1]: 0.0}
    kept = float(((anchor - flat(mods[1])) @ moved) / (moved @ moved))
    assert abs(kept - 1.0) < 1e-6 and torch.equal(flat(mods[0]), flat(mods[1]))
    # next window: weights in proportion to the work since the last merge (3:1)
    anchor = engines[0].anchor.clone()
    _train(mods[0], 2)
    _train(mods[1], 3)
    works[0], works[1] = works[0] + 300.0, 100.0
    d0, d1 = anchor - flat(mods[0]), anchor - flat(mods[1])
    reps = asyncio.run(merge_all(engines, 1))
    assert all(r.applied for r in reps) and reps[1].weights == {HK[0]: 300.0, HK[1]: 100.0}
    assert torch.allclose(flat(mods[0]), anchor - (3 * d0 + d1) / 4, atol=1e-6)
    # nobody worked: nothing to merge, nothing changes
    before = flat(mods[0]).clone()
    reps = asyncio.run(merge_all(engines, 2))
    assert all(r.status == "alone" and "work" in r.reason for r in reps) and torch.equal(flat(mods[0]), before)


def test_claimed_work_is_capped_at_twice_the_median():
    from iota_subnet.merge.engine import cap_work
    assert cap_work({"a": 100.0, "b": 100.0, "c": 1e9}) == {"a": 100.0, "b": 100.0, "c": 200.0}
    assert cap_work({"a": 100.0, "b": 0.0}) == {"a": 100.0, "b": 0.0}


def test_chunked_merge_equals_unchunked_and_no_message_holds_a_shard():
    """Every shard travels as chunks of at most ``merge.chunk_numel`` values (one message each); the
    merged weights are the same as with one message per shard, bit for bit, whatever the payload."""
    for quant in ("none", "int8"):
        outs = {}
        for cn in (256, 1 << 22):
            cfg = MergeConfig(every_steps=1, quantization=quant, chunk_numel=cn, **FAST)
            net, engines, mods = make_replicas(3, cfg)
            sizes = []
            orig = net._call

            async def spy(me, peer, route, msg, rtype, orig=orig):
                if route == "/merge/contribute":
                    sizes.append(msg.shard.numel())
                reply = await orig(me, peer, route, msg, rtype)
                if route == "/merge/result" and reply[0].mean is not None:
                    sizes.append(reply[0].mean.numel())
                return reply
            net._call = spy
            reps = asyncio.run(merge_all(engines, 0))
            assert all(r.applied for r in reps), [r.reason for r in reps]
            outs[cn] = flat(mods[0])
            shard = engines[0].params.numel // 3
            assert max(sizes) <= min(cn, shard + 1)
            if cn == 256:
                assert len(sizes) > 6 * 3                # several chunks per shard
        assert torch.equal(outs[256], outs[1 << 22]), quant


def test_overlapped_merge_keeps_the_steps_taken_meanwhile():
    """``merge.overlap``: training goes on while the merge runs; the applied weights are the merged
    ones plus the local progress made meanwhile, and the anchors stay identical across replicas."""
    for overlap in (False, True):
        cfg = MergeConfig(every_steps=1, overlap=overlap, **FAST)
        net, engines, mods = make_replicas(2, cfg, transport=InProcessTransport(delay_s=0.05))
        progress = torch.full((engines[0].params.numel,), 1e-3)

        async def run():
            tasks = [asyncio.create_task(e.merge(0, HK[:2])) for e in engines]
            await asyncio.sleep(0.08)                  # both have read their weights; the merge is running
            cur = engines[0].params.read()
            engines[0].params.write(cur + progress)    # an inner step on replica 0 during the merge
            return await asyncio.gather(*tasks)
        reps = asyncio.run(run())
        assert all(r.applied for r in reps)
        assert torch.equal(engines[0].anchor, engines[1].anchor)
        w0, w1 = flat(mods[0]), flat(mods[1])
        if overlap:
            assert torch.allclose(w0, engines[0].anchor + progress, atol=1e-6) and torch.equal(w1, engines[1].anchor)
        else:
            assert torch.equal(w0, w1)                 # the step taken during the merge is overwritten


def test_an_unreachable_peer_does_not_hold_the_lane_for_the_join_timeout():
    """A replica that is down (killed, restarting) is not waited for at the join: with merging on by
    default, every boundary would otherwise pause its peers' lanes for ``join_timeout_s``."""
    import time
    cfg = MergeConfig(every_steps=1, **{**FAST, "join_timeout_s": 20.0})
    net, engines, mods = make_replicas(3, cfg)
    net.kill(HK[2])
    t0 = time.monotonic()
    reps = asyncio.run(merge_all(engines, 0, alive=[0, 1]))
    assert all(r.applied and r.participants == HK[:2] and r.missing == [HK[2]] for r in reps)
    assert time.monotonic() - t0 < 10 and torch.equal(flat(mods[0]), flat(mods[1]))


def test_a_spare_that_trains_in_no_lane_is_not_waited_for_at_the_join():
    """A spare (a replica the validators never handed a lane) answers the join but can never reach a
    boundary: its stage's replicas merged only after the join timeout (30 s by default) at every
    first merge of a run with spares. Now it says so in its answer and is not waited for; it takes
    no part and keeps its weights."""
    import time
    cfg = MergeConfig(every_steps=1, **{**FAST, "join_timeout_s": 20.0})
    net, engines, mods = make_replicas(3, cfg, options={2: MergeEngineOptions(spare_fn=lambda: True)})
    before = flat(mods[2]).clone()
    t0 = time.monotonic()
    reps = asyncio.run(merge_all(engines, 0, alive=[0, 1]))
    assert all(r.applied and r.participants == HK[:2] for r in reps), reps
    assert time.monotonic() - t0 < 10 and torch.equal(flat(mods[0]), flat(mods[1]))
    assert torch.equal(flat(mods[2]), before)
