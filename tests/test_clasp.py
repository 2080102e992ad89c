"""CLASP attribution on synthetic probes: the lossy miner is flagged, honest noise is not."""
from __future__ import annotations

import random

from iota_subnet.validator.clasp import attribute, quality_factors


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
    # excluded (already flagged by audits): its pathways are dropped
    attr = attribute(_probes(effects, 20, 6, 0.1), exclude=[(5, "hk5")])
    assert (5, "hk5") not in attr and not any(a.flagged for a in attr.values())
