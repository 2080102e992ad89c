"""A replay hop audit of a ``transformers`` stage whose weights exceed the miner's opening cap
(issue 30, item 7): a tiny Qwen2 tail with an 8192 x 64 fp32 LM head (2 MiB) against a prover whose
``max_open_bytes`` is 1 MiB (standing in for Qwen2.5-0.5B's 545 MB head against the 64 MiB default).
The validator opens the stage in parts (:func:`iota_subnet.audit.replay.split_openings`), each within
the cap and verified against the committed entry roots: the honest hop passes; asking for it in one
request is refused; a wrong gradient, a wrong loss, and one row of the LM head swapped in a later
part (with the honest proof) fail. ~3 s on 2 cores."""
from __future__ import annotations

import random

import pytest
import torch

from iota_subnet.audit import HopAuditor, HopProver, Tolerances, TraceLayout, run_local_audit, weights_commitment
from iota_subnet.audit.commit import wire_root, wire_sha256
from iota_subnet.audit.replay import replay_openings, split_openings
from iota_subnet.config import PipelineConfig
from iota_subnet.config_hf import hf_model_config
from test_hf_hop_audit import B, MPS, QWEN2, T, _tamper, honest_hop, qwen2_run

CAP = 1 << 20
BIG = {**QWEN2, "vocab_size": 8192}


@pytest.fixture(scope="module")
def big_run():
    return qwen2_run(BIG)


def _audit(run, hop, loss, *, part_bytes=CAP, commit="root", swap=None):
    cfg, pcfg, stages, tokens, targets = run
    lay = TraceLayout.build(cfg, pcfg, 2, batch=B, seq=T, direction="backward", micro_per_step=MPS,
                            wire_format="bf16")
    wc = weights_commitment(stages[2].state_dict())
    root = wire_sha256 if commit == "sha256" else wire_root
    aud = HopAuditor(lay, weights_root=wc.root, wire_roots={k: root(v) for k, v in hop.wire.items()},
                     tol=Tolerances.for_precision("fp32"), wire_commit=commit, rng=random.Random(1), targets=targets,
                     loss=loss, open_part_bytes=part_bytes)
    prover = HopProver(lay, wc, hop, max_open_bytes=CAP)
    if swap is not None:        # serves row ``swap[1]`` of ``swap[0]`` with other values (and the honest proof)
        row_fn = prover._row

        def cheat(name, i):
            r = row_fn(name, i)
            return r + 1e-3 if (name, i) == swap else r
        prover._row = cheat
    return run_local_audit(prover, aud, stage=2), aud, lay


def test_a_stage_over_the_open_cap_is_replayed_in_parts(big_run):
    hop, loss = honest_hop(big_run, 2, "bf16")
    res, aud, lay = _audit(big_run, hop, loss)
    assert res.verdict.ok, res.verdict.failures
    full = replay_openings(lay, None, tuple(hop.wire))
    assert sum(len(v) * lay.entry(k).width * 4 for k, v in full.items()) > 2 * CAP       # over the cap
    assert len(aud.parts) >= 3 and "r3.2_resp" in res.bytes
    for part in aud.parts:                                                               # each within it
        assert sum(len(v) * lay.entry(k).width * 4 for k, v in part.items()) <= CAP
    assert {k: sorted(i for p in aud.parts for i in p.get(k, [])) for k in full} == full     # every row, once
    assert _audit(big_run, hop, loss, commit="sha256")[0].verdict.ok     # wire tensors whole, in one part
    one = _audit(big_run, hop, loss, part_bytes=64 << 20)[0].verdict      # all in one request: refused
    assert not one.ok and "limit" in one.reason


def test_cheaters_still_fail_when_opened_in_parts(big_run):
    hop, loss = honest_hop(big_run, 2, "bf16")
    v = _audit(big_run, _tamper(hop, "wire.dx", lambda t: t * 1.01), loss)[0].verdict
    assert not v.ok and "grad_in" in v.failed_links
    v = _audit(big_run, hop, loss * 1.01)[0].verdict
    assert not v.ok and "loss" in v.failed_links
    res, aud, _ = _audit(big_run, hop, loss, swap=("w:lm_head.weight", 5000))     # one row of the head
    assert [k for k, p in enumerate(aud.parts) if 5000 in p.get("w:lm_head.weight", [])] != [0]  # in a later part
    assert not res.verdict.ok and "w:lm_head.weight row 5000 does not match" in res.verdict.reason, res.verdict.reason


def test_split_openings_limits():
    cfg = hf_model_config({"hf": "qwen2", "config": BIG})
    lay = TraceLayout.build(cfg, PipelineConfig(stages=3), 2, batch=B, seq=T, direction="backward",
                            micro_per_step=MPS, wire_format="bf16")
    req = replay_openings(lay, None, ("wire.x", "wire.dx"))
    parts = split_openings(lay, req, max_bytes=1 << 16, max_rows=100)
    assert all(sum(len(v) for v in p.values()) <= 100 for p in parts)
    with pytest.raises(ValueError):
        split_openings(lay, req, max_bytes=64)                 # one row of 64 fp32 values is 256 bytes
    with pytest.raises(ValueError):
        split_openings(lay, req, ("wire.x",), max_bytes=1 << 12)   # a whole tensor is never split
