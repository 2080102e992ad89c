"""A merge member that dies after the join (mid-scatter, or as a reducer once its scatter is
acknowledged) costs the survivors the work of its shards, not a second merge: the repair attempt
keeps the failed attempt's layout, reducers reduce again from the chunks they kept, and only the
dead reducers' shards travel again (:mod:`iota_subnet.merge.plan`, repair plans).

In process over the wire codec with signed claims (:func:`iota_subnet.sim.merge_scale.death_cost`),
against the same run where nobody dies: every shard of the applied plan has the same contributor
set (the survivors), the survivors end bit-identical and within 1e-6 of a single-process reference
over that set, and the survivors' dense bytes (tensor bytes sent plus received, summed over them)
exceed their no-death bytes by at most 3 %. The code before repair plans redid every transfer
(about +100 %). ``scripts/bench_merge_scale.py --kill`` is the manual run (docs/BENCHMARKS.md, "A
member's death costs its shards only").
"""
from __future__ import annotations

import pytest

from iota_subnet.sim.merge_scale import death_cost

pytestmark = pytest.mark.timeout(600)


def _check(r: dict, n: int) -> None:
    d = r["died"]
    assert d["merged"] and d["identical"] and d["attempts"] == 2, d
    assert d["contributor_sets"] == 1 and d["shards"] == n, d        # every shard: the same contributors
    assert d["max_ref_err"] <= 1e-6, d
    assert r["survivors_extra_dense"] <= 0.03, r


@pytest.mark.parametrize("kill_at", ["scatter", "reducer"])
def test_a_death_costs_its_shards_only_n32(kill_at):
    _check(death_cost(32, 1 << 14, kill=1, kill_at=kill_at, progress_timeout_s=5.0), 32)


@pytest.mark.slow
def test_a_death_costs_its_shards_only_n128():
    """Mid-scatter only in CI (about 150 s); the reducer's death at N = 128 is the manual run
    ``scripts/bench_merge_scale.py --replicas 128 --kill 0.01 --kill-at reducer``."""
    _check(death_cost(128, 1 << 14, kill=1, kill_at="scatter", progress_timeout_s=60.0), 128)
