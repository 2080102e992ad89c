"""Units of verification: replay comparisons and tolerances, the stale-weights and unverifiable
rules, blind sampling, CLASP attribution on synthetic probes."""
from __future__ import annotations

import math
import random
from types import SimpleNamespace

import torch

from iota_subnet.config import load_config
from iota_subnet.miner import StageWorker
from iota_subnet.sim.adversary import CheatingStageWorker
from iota_subnet.validator.clasp import attribute, quality_factors
from iota_subnet.validator.routing import Replica
from iota_subnet.validator.verification import TOLERANCES, Snapshot, SpotChecker, rel_err
from support.common import OVR


def cfg():
    return load_config("configs/tiny.yaml", OVR)


def test_rel_err():
    a = torch.ones(3, 4)
    assert rel_err(a, a) == 0.0
    assert abs(rel_err(a * 1.01, a) - 0.01) < 1e-6
    assert rel_err(torch.ones(2), a) == math.inf and rel_err(None, a) == math.inf
    assert rel_err(a * math.nan, a) == math.inf
    assert rel_err(2.0, 1.0) == 1.0
    assert TOLERANCES["fp32"] < TOLERANCES["bf16"] < 0.03


def _hop(checker, worker, r, step, mb, grad_seed=0, record_backward=True):
    """Drive one hop of ``worker`` as the driver would and hand it to the checker."""
    torch.manual_seed(grad_seed)
    x = torch.randn(2, 16, worker.spec.in_width)
    out = worker.forward(mb, x)
    reply = SimpleNamespace(activations=out["activations"], stats={"weights_step": out["weights_step"]}, inner_step=0)
    checker.on_forward(0, step, mb, r, x, None, reply, True)
    g = torch.randn_like(out["activations"])
    gb = worker.backward(mb, g)
    if record_backward:
        checker.on_backward(mb, r, g, gb, SimpleNamespace(stats={"weights_step": worker.last_weights_step}))


def _snap(checker, worker, r):
    snap = Snapshot(r.uid, r.hotkey, r.stage, worker.inner_step,
                    {k: v.detach().clone() for k, v in worker.module.state_dict().items()})
    checker._check_stale(r, snap)
    checker.snaps[r.key] = snap
    checker.delivered[r.key] = 0


def _run(kind=None, steps=3):
    c = cfg()
    w = CheatingStageWorker(c, 1, kind=kind, seed=0) if kind else StageWorker(c, 1, seed=0)
    r = Replica(5, "hk5", "127.0.0.1:1", 1)
    ch = SpotChecker(c, run_id="r", rate=1.0, rng=random.Random(0))
    for k in range(steps):
        _snap(ch, w, r)
        for m in range(2):
            _hop(ch, w, r, k, f"k{k}m{m}", grad_seed=10 * k + m)
        ch.check_samples([ch.pending.pop(key) for key in list(ch.pending)])
    return ch.stats[r.key]


def test_honest_replays_pass_and_weights_change():
    st = _run()
    assert st.passed == 6 and st.failed == 0 and not st.flagged
    assert st.stale_checks == 2 and st.stale_failed == 0 and st.max_err_passed < 1e-5


def test_cheats_fail_replay_or_stale():
    for kind, what in (("lazy", "replay"), ("zero", "replay"), ("claim", "replay"), ("stale", "stale")):
        st = _run(kind)
        assert st.flagged and st.failed >= 1 and st.reasons[0].startswith(what), (kind, st)


def test_unverifiable_hops_counted_then_flagged_with_one_validator():
    c = cfg()
    w = StageWorker(c, 1, seed=0)
    r = Replica(5, "hk5", "127.0.0.1:1", 1)
    ch = SpotChecker(c, run_id="r", rate=1.0, rng=random.Random(0), min_samples=4)
    _snap(ch, w, r)
    for m in range(4):   # it claims weights of step 99, which no snapshot has
        x = torch.randn(2, 16, w.spec.in_width)
        out = w.forward(f"m{m}", x)
        ch.on_forward(0, 0, f"m{m}", r, x, None,
                      SimpleNamespace(activations=out["activations"], stats={"weights_step": 99}), True)
    ch.check_samples([ch.pending.pop(k) for k in list(ch.pending)])
    st = ch.stats[r.key]
    assert st.unverifiable == 4 and st.failed == 0 and st.flagged and "evades" in st.reasons[0]
    ch2 = SpotChecker(c, run_id="r", rate=1.0, rng=random.Random(0), min_samples=4, single_validator=False)
    ch2.snaps = ch.snaps
    ch2.stat(r.uid, r.hotkey, 1).unverifiable = 10
    assert not ch2.flagged()


def test_sampling_is_independent_of_the_miner():
    # the draws come from the validator's RNG only: the same seed samples the same hop positions
    # whatever the miner answers, and about `rate` of them
    c = cfg()
    r = Replica(5, "hk5", "127.0.0.1:1", 1)
    picks = []
    for act in (torch.zeros(2, 16, 16), torch.randn(2, 16, 16)):
        ch = SpotChecker(c, run_id="r", rate=0.25, rng=random.Random(42))
        for i in range(400):
            ch.on_forward(0, 0, f"m{i}", r, torch.zeros(2, 16, 16), None,
                          SimpleNamespace(activations=act, stats={"weights_step": 0}), True)
        picks.append(sorted(ch.pending))
    assert picks[0] == picks[1] and 70 <= len(picks[0]) <= 130
    # the default RNG is seeded from the OS: two checkers draw differently
    a, b = SpotChecker(c, run_id="r"), SpotChecker(c, run_id="r")
    assert [a.rng.random() for _ in range(4)] != [b.rng.random() for _ in range(4)]


def _probes(effects: dict[tuple[int, int], float], rounds: int, paths: int, noise: float, seed: int = 0):
    rng = random.Random(seed)
    by_stage = {}
    for (s, uid) in effects:
        by_stage.setdefault(s, []).append(uid)
    out = []
    for k in range(rounds):
        base = 5.0 + rng.gauss(0, 0.5)   # the round's batch difficulty, shared by its pathways
        for _ in range(paths):
            path = [(s, rng.choice(by_stage[s])) for s in sorted(by_stage)]
            loss = base + sum(effects[p] for p in path) + rng.gauss(0, noise)
            out.append({"round": k, "loss": loss,
                        "pathway": [{"stage": s, "uid": u, "hotkey": f"hk{u}"} for s, u in path]})
    return out


def test_clasp_flags_the_lossy_miner_only():
    effects = {(s, 1 + s + 3 * r): 0.0 for s in range(3) for r in range(3)}
    effects[(1, 5)] = 0.6    # pathways through uid 5 lose 0.6 nats more
    attr = attribute(_probes(effects, rounds=20, paths=6, noise=0.1))
    assert [k[0] for k, a in attr.items() if a.flagged] == [5]
    a5 = attr[(5, "hk5")]
    assert abs(a5.excess - 0.6 * (1 - 1 / 6)) < 0.1 and a5.z > 4   # centring within rounds of 6 shrinks by 5/6
    q = quality_factors(attr, penalty=0.5)
    assert q[(5, "hk5")][0] == 0.5 and "CLASP" in q[(5, "hk5")][1][0] and q[(1, "hk1")] == (1.0, [])
    # honest noise only: nobody flagged, over many seeds
    honest = {k: 0.0 for k in effects}
    for seed in range(20):
        assert not any(a.flagged for a in attribute(_probes(honest, 20, 6, 0.1, seed)).values())
    # excluded (already flagged by spot checks): its pathways are dropped
    attr = attribute(_probes(effects, 20, 6, 0.1), exclude=[(5, "hk5")])
    assert (5, "hk5") not in attr and not any(a.flagged for a in attr.values())


def test_weights_replaced_by_a_merge_are_unverifiable_not_failed():
    """A merge replaces the weights without an inner step: a hop computed after it must not be
    compared with a snapshot taken before it (honest miners would fail the replay)."""
    c = cfg()
    w = StageWorker(c, 1, seed=0)
    r = Replica(5, "hk5", "127.0.0.1:1", 1)
    ch = SpotChecker(c, run_id="r", rate=1.0, rng=random.Random(0))
    snap = Snapshot(r.uid, r.hotkey, r.stage, w.inner_step,
                    {k: v.detach().clone() for k, v in w.module.state_dict().items()}, merges=w.merges)
    ch.snaps[r.key] = snap
    with torch.no_grad():                                   # a merge: new weights, same inner step
        for p in w.module.parameters():
            p.add_(0.01)
    w.weights_replaced()
    x = torch.randn(2, 16, w.spec.in_width)
    out = w.forward("m0", x)
    assert out["weights_step"] == snap.step and out["weights_merges"] == snap.merges + 1
    ch.on_forward(0, 0, "m0", r, x, None, SimpleNamespace(activations=out["activations"], stats={
        "weights_step": out["weights_step"], "weights_merges": out["weights_merges"]}), True)
    ch.check_samples([ch.pending.pop(k) for k in list(ch.pending)])
    st = ch.stats[r.key]
    assert st.unverifiable == 1 and st.failed == 0 and not st.flagged
    # the same hop reported without the merge counter is replayed against the old weights: it fails
    ch.on_forward(0, 0, "m1", r, x, None, SimpleNamespace(activations=out["activations"], stats={
        "weights_step": out["weights_step"]}), True)
    ch.check_samples([ch.pending.pop(k) for k in list(ch.pending)])
    assert st.failed == 1
