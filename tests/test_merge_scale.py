"""The merge at many replicas, in process (no network; every message through the wire codec), with
signed claims: the bytes a replica sends and receives, counted apart and split into dense tensor
bytes and metadata, stay linear in the number of replicas N.

N = 128 replicas of a stage of 2^14 float32 values (fp32 payloads), then N = 32: about 60 s on one
shared CPU core (the time goes to the 10 N^2 messages and the signatures, not to the values).
``scripts/bench_merge_scale.py --replicas 100,1000`` is the manual run (docs/BENCHMARKS.md, "Merge
metadata at N replicas").
"""
from __future__ import annotations

import pytest

from iota_subnet.sim.merge_scale import run_scale

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]   # ~70 s on 2 cores: in the slow suite

#: Metadata bytes per replica per peer, each direction: the issue's bound. Measured 1.78 kB at N = 100
#: (at most 1,789 B; 2.66 kB with wire spec 2, 7.2 kB before it): ten messages per peer each way (join,
#: two contributions and their acks, two result requests and answers: a header carrying both
#: reducers' signatures, then the mean alone), those without tensors as bare JSON, the chunks compact
META_PER_PEER = 2_000


def test_merge_bytes_per_replica_are_linear_in_replicas():
    n = 128
    r = run_scale(n, 1 << 14)
    assert r["merged"] and r["identical"], r
    for k in ("max_sent_dense", "max_received_dense"):
        assert r[k] <= 3.1 * r["stage_bytes"], (k, r)
    for k in ("max_sent_meta", "max_received_meta"):
        assert r[k] <= META_PER_PEER * n, (k, r)
    # O(N), not O(N^2): a quarter of the replicas costs each replica about a quarter of the metadata
    q = run_scale(n // 4, 1 << 14)
    assert q["merged"] and q["identical"], q
    assert r["max_received_meta"] / q["max_received_meta"] <= 4 * 1.1, (r, q)
