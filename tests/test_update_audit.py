"""Update audits: a real StageWorker commits to every inner step; the validator
opens random rows with proofs and recomputes torch's AdamW. Honest passes (bit-exact on CPU), the
``noisy-update`` adversary fails, tampered or incomplete answers fail, the store serves from its
window (LATE outside it) without the worker's lock, and the whole path works over signed HTTP."""
from __future__ import annotations

import asyncio
import math
import random
import threading
import time

import pytest
import torch

from iota_subnet.audit.update import (adamw_reference, check_chain, check_update_opening, param_layout, row_units,
                                      sample_rows)
from iota_subnet.config import load_config
from iota_subnet.miner import StageWorker
from iota_subnet.sim.adversary import CheatingStageWorker
from iota_subnet.miner.update_store import UpdateAuditRoute
from iota_subnet.protocol import (UPDATE_KINDS, Outcome, ProtocolError, UpdateAuditRequest, UpdateAuditResponse,
                                  UpdateCommit, decode, encode, opening_key, update_audit_contract)
from iota_subnet.transport import NeuronClient, NeuronServer
from iota_subnet.validator.update_audit import UpdateAuditor
from support.common import OVR, make_wallet

pytestmark = pytest.mark.timeout(120)


def cfg():
    return load_config("configs/tiny.yaml", OVR)


def train(worker: StageWorker, steps: int, seed: int = 0) -> None:
    """``steps`` inner steps of real forward/backward on random inputs (micro_per_step micro-batches each)."""
    g = torch.Generator().manual_seed(seed)
    for k in range(steps * worker.micro_per_step):
        x = torch.randn(2, 16, worker.spec.in_width, generator=g)
        out = worker.forward(f"mb{seed}-{k}", x)
        worker.backward(f"mb{seed}-{k}", torch.randn(out["activations"].shape, generator=g) * 1e-2)


def commits_of(worker: StageWorker, n: int) -> list[UpdateCommit]:
    out = []
    for s in worker.updates.steps()[-n:]:
        c = worker.updates.commitment(s, timeout_s=10)
        assert c is not None
        out.append(c)
    return out


def audit_in_process(auditor: UpdateAuditor, worker: StageWorker, commit: UpdateCommit):
    req = auditor.plan(worker.stage, commit)
    resp = worker.updates.open(req.inner_step, req.merges, req.rows, req.kinds)
    resp = decode(encode(resp), UpdateAuditResponse, update_audit_contract())   # what the wire carries
    return auditor.check(worker.stage, commit, req, resp), req, resp


def test_adamw_reference_is_torch_adamw():
    torch.manual_seed(0)
    for impl in ({"foreach": False}, {"foreach": True}):
        p = torch.nn.Parameter(torch.randn(64, 32) * 0.02)
        opt = torch.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, **impl)
        for step in range(1, 6):
            p.grad = torch.randn_like(p) * (10.0 if step == 3 else 1e-2)
            gn = float(torch.nn.utils.clip_grad_norm_([p], 1.0))
            st = opt.state.get(p, {})
            w0 = p.detach().clone()
            m0 = st["exp_avg"].clone() if st else torch.zeros_like(p)
            v0 = st["exp_avg_sq"].clone() if st else torch.zeros_like(p)
            g = p.grad.clone()
            opt.step()
            w1, m1, v1 = adamw_reference(w0, m0, v0, g, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1,
                                         step=step, clip=1.0)
            assert torch.equal(w1, p.detach()) and torch.equal(m1, opt.state[p]["exp_avg"])
            assert torch.equal(v1, opt.state[p]["exp_avg_sq"])
            assert gn > 0
    assert row_units(torch.ones(3), torch.ones(3)) == 0.0
    assert row_units(torch.ones(3) * (1 + 2 ** -23), torch.ones(3)) == pytest.approx(2.0)
    assert row_units(torch.ones(2), torch.ones(3)) == math.inf


def test_sampling_covers_values_proportionally():
    c = cfg()
    w = StageWorker(c, 1, seed=0)
    lay = param_layout(w.module, c.train.weight_decay)
    rng = random.Random(1)
    counts = {}
    for _ in range(400):
        for n, r in sample_rows(lay, 2, rng):
            counts[n] = counts.get(n, 0) + 1
            p = dict(w.module.named_parameters())[n]
            assert 0 <= r < (p.shape[0] if p.dim() >= 2 else 1)
    sizes = {p.name: p.n_rows * p.row_numel for p in lay}
    big = max(sizes, key=sizes.get)
    small = min(sizes, key=sizes.get)
    assert counts.get(big, 0) > counts.get(small, 0)
    assert [p.weight_decay for p in lay if len(p.shape) == 1] and all(
        p.weight_decay == (c.train.weight_decay if len(p.shape) >= 2 else 0.0) for p in lay)


def test_honest_steps_pass_bit_exact_and_chain():
    c = cfg()
    w = StageWorker(c, 1, seed=0, total_steps=c.train.total_steps, audit_window=3)
    train(w, 4)
    commits = commits_of(w, 3)
    assert [x.step for x in commits] == [1, 2, 3] and all(not x.skipped for x in commits)
    assert all(0 < x.clip_coef <= 1 for x in commits)
    auditor = UpdateAuditor(c, run_id="r", total_steps=c.train.total_steps, rows=4, rng=random.Random(0))
    worst = 0.0
    for commit in commits:
        for _ in range(3):
            chk, req, resp = audit_in_process(auditor, w, commit)
            assert chk.ok, chk.reason
            worst = max(worst, chk.worst)
    assert worst == 0.0                  # the single-tensor CPU path is reproduced bit for bit
    for a, b in zip(commits, commits[1:]):
        assert check_chain(a, b) is None
    # the weights after step 3 are the weights version 4: the very root hop receipts name for it
    from iota_subnet.audit.commit import weights_root
    live = weights_root(w.module.state_dict())
    assert w.updates.weights_root(4) == live.hex() == commits[-1].roots["w1"]
    # K = 3 steps kept: step 0 is gone (LATE), byte figure as stated (3 (K+1) + K) x 4 x P at most
    with pytest.raises(ProtocolError) as ei:
        w.updates.open(0, 0, [["bottleneck_in.proj.weight", 0]], list(UPDATE_KINDS))
    assert ei.value.outcome == Outcome.LATE
    P = sum(p.numel() for p in w.module.parameters())
    assert w.updates.nbytes <= (3 * 4 + 3) * 4 * P


def test_noisy_update_fails_and_lr_or_clip_lies_fail():
    c = cfg()
    w = CheatingStageWorker(c, 1, kind="noisy-update", seed=0, total_steps=c.train.total_steps, audit_window=2)
    train(w, 2)
    auditor = UpdateAuditor(c, run_id="r", total_steps=c.train.total_steps, rows=1, rng=random.Random(0))
    for commit in commits_of(w, 2):
        for _ in range(4):                                          # any single row catches it
            chk, _, _ = audit_in_process(auditor, w, commit)
            assert not chk.ok and "AdamW recomputed" in chk.reason and chk.worst > 1e4, chk
    # an honest miner whose commitment misstates the schedule's lr or the clip factor fails too
    h = StageWorker(c, 1, seed=0, total_steps=c.train.total_steps, audit_window=2)
    train(h, 3)
    commit = commits_of(h, 1)[0]                 # step 2: past the warmup, the rate depends on the schedule
    bad_sched = UpdateAuditor(c, run_id="r", total_steps=3 * c.train.total_steps, rows=1, rng=random.Random(0))
    chk, _, _ = audit_in_process(bad_sched, h, commit)
    assert not chk.ok and "learning rate" in chk.reason
    auditor = UpdateAuditor(c, run_id="r", total_steps=c.train.total_steps, rows=1, rng=random.Random(0))
    req = auditor.plan(1, commit)
    resp = h.updates.open(req.inner_step, req.merges, req.rows, req.kinds)
    lie = UpdateCommit.from_dict({**commit.to_dict(), "clip_coef": commit.clip_coef * 0.5})
    resp.commit = lie.to_dict()
    chk = check_update_opening(lie, [tuple(r) for r in req.rows], resp, auditor.layout(1), auditor.hp,
                               expected_lr=auditor.expected_lr(commit.step, commit.adam_step))
    assert not chk.ok and "clip factor" in chk.reason


def test_tampered_or_incomplete_answers_fail():
    c = cfg()
    w = StageWorker(c, 1, seed=0, total_steps=c.train.total_steps, audit_window=2)
    train(w, 1)
    commit = commits_of(w, 1)[0]
    auditor = UpdateAuditor(c, run_id="r", total_steps=c.train.total_steps, rows=2, rng=random.Random(3))
    req = auditor.plan(1, commit)

    def fresh():
        return decode(encode(w.updates.open(req.inner_step, req.merges, req.rows, req.kinds)), UpdateAuditResponse,
                      update_audit_contract())
    assert auditor.check(1, commit, req, fresh()).ok
    name, r = req.rows[0]
    # a changed value (a miner "fixing" its update after the fact) no longer matches the root
    resp = fresh()
    key = opening_key("w1", name, r)
    resp.rows[key] = resp.rows[key].clone()
    resp.rows[key][0] += 1e-3
    chk = auditor.check(1, commit, req, resp)
    assert not chk.ok and "does not match the committed root" in chk.reason
    # a missing row, a missing proof, other per-parameter roots, another commitment: all failures
    resp = fresh()
    del resp.rows[opening_key("m0", name, r)]
    assert "missing" in auditor.check(1, commit, req, resp).reason
    resp = fresh()
    resp.proofs[opening_key("g", name, r)] = torch.zeros(3, 7, dtype=torch.uint8)
    assert not auditor.check(1, commit, req, resp).ok
    resp = fresh()
    resp.roots["v1"] = torch.zeros_like(resp.roots["v1"])
    assert "combine" in auditor.check(1, commit, req, resp).reason
    other = UpdateCommit.from_dict({**commit.to_dict(), "roots": {**commit.roots, "g": "00" * 32}})
    assert "another commitment" in auditor.check(1, other, req, fresh()).reason
    # malformed requests are typed refusals, not crashes
    for rows, outcome in (([["nope", 0]], Outcome.BAD_SHAPE), ([[name, 10 ** 6]], Outcome.BAD_SHAPE),
                          ([[name]], Outcome.MALFORMED), ([[name, 0]] * 65, Outcome.BAD_SHAPE)):
        with pytest.raises(ProtocolError) as ei:
            w.updates.open(commit.step, commit.merges, rows, list(UPDATE_KINDS))
        assert ei.value.outcome == outcome
    with pytest.raises(ProtocolError):
        UpdateCommit.from_dict({**commit.to_dict(), "lr": math.nan})
    with pytest.raises(ProtocolError):
        UpdateCommit.from_dict({**commit.to_dict(), "roots": {"w0": "ab"}})


def test_skipped_step_and_replaced_weights_are_committed_faithfully():
    c = cfg()
    w = StageWorker(c, 1, seed=0, total_steps=c.train.total_steps, audit_window=4)
    train(w, 1)
    # a merge replaces the weights between two steps: the next step starts from the merged weights
    with w.lock, torch.no_grad():
        for p in w.module.parameters():
            p.mul_(0.5)
        w.weights_replaced()
    train(w, 1, seed=1)
    # a non-finite gradient: the step is skipped (no update) and committed as skipped
    x = torch.randn(2, 16, w.spec.in_width)
    for m in range(w.micro_per_step):
        out = w.forward(f"nan{m}", x)
        w.backward(f"nan{m}", torch.full_like(out["activations"], math.nan))
    a, b, s = commits_of(w, 3)
    assert (a.merges, b.merges) == (0, 1) and s.skipped and s.step == b.step + 1
    assert check_chain(a, b) is None and b.roots["w0"] != a.roots["w1"] and b.roots["m0"] == a.roots["m1"]
    assert s.roots["w0"] == s.roots["w1"] == b.roots["w1"]
    auditor = UpdateAuditor(c, run_id="r", total_steps=c.train.total_steps, rows=3, rng=random.Random(5))
    for commit in (a, b, s):
        chk, _, _ = audit_in_process(auditor, w, commit)
        assert chk.ok, (commit.step, chk.reason)
    # a broken chain is named
    forged = UpdateCommit.from_dict({**b.to_dict(), "merges": a.merges})
    assert "weights before" in check_chain(a, forged)


def test_audit_over_http_not_blocked_by_the_worker_lock(tmp_home):
    """The /audit/update route answers from stored copies while the worker's lock is held (a merge
    writing the weights, a long compute): audits are never blocked by merges."""
    c = cfg()
    root = tmp_home / "wallets"
    mw, vw = make_wallet(root, "m"), make_wallet(root, "v")
    w = StageWorker(c, 1, seed=0, total_steps=c.train.total_steps, audit_window=2)
    train(w, 3)                                  # steps 1 and 2 kept, step 0 gone

    async def main():
        server = NeuronServer(mw, "127.0.0.1", 0, None, None)
        server.add_route("/audit/update", UpdateAuditRoute(w.updates, "r", 1), UpdateAuditRequest)
        await server.start()
        client = NeuronClient(vw)
        auditor = UpdateAuditor(c, run_id="r", total_steps=c.train.total_steps, rows=2)
        release = threading.Event()
        holder = threading.Thread(target=lambda: (w.lock.acquire(), release.wait(20), w.lock.release()))
        holder.start()
        try:
            commit = w.updates.commitment(w.updates.steps()[-1], timeout_s=10)
            t0 = time.monotonic()
            res = await auditor.audit(client, server.endpoint, server.hotkey, 1, commit, timeout_s=10)
            took = time.monotonic() - t0
            assert res.outcome == "passed", res
            assert took < 5.0 and res.bytes > 0
            stale = UpdateCommit.from_dict({**commit.to_dict(), "step": 0})
            res = await auditor.audit(client, server.endpoint, server.hotkey, 1, stale, timeout_s=10)
            assert res.outcome == "refused" and "LATE" in res.detail
            bad = await auditor.audit(client, "127.0.0.1:1", server.hotkey, 1, commit, timeout_s=2)
            assert bad.outcome == "timeout"
        finally:
            release.set()
            holder.join()
            await client.close()
            await server.stop()
    asyncio.run(main())


def test_hop_store_reuses_the_update_stores_commitment_of_the_same_weights():
    """The weights after inner step k are version k + 1 of hop receipts: committed once (the update
    store's ``w1``), unless the live weights changed since that copy (then the hop store hashes its own)."""
    from iota_subnet.audit.commit import weights_root
    from iota_subnet.audit.merkle import verify_proof, leaf_hash
    from iota_subnet.miner.hop_store import HopStore
    c = cfg()
    w = StageWorker(c, 1, seed=0, total_steps=c.train.total_steps, audit_window=3)
    train(w, 2)
    hops = HopStore(3, shared=w.updates.weights_version)
    with w.lock:
        v = hops.observe(w)
    assert v == (2, 0) and (hops.shared_versions, hops.snapshots) == (1, 0) and hops.nbytes == 0
    wc = hops.commitment(v, timeout_s=10)
    step1 = w.updates.commitment(1, timeout_s=10)      # sealed after the trees: wait for it, not just the trees
    assert wc.root == weights_root(w.module.state_dict()) and wc.root.hex() == step1.roots["w1"]
    mat = next(n for n, shape, _ in wc.entries if n.endswith("^T"))[:-2]
    for name in ("w:" + mat + "^T", "w:" + mat):
        row, proof = wc.open_row(name, 5)
        assert verify_proof(wc.trees[name].root, leaf_hash(row), 5, wc.trees[name].n_leaves, proof)
    # weights touched in place after the step, version unchanged: not the committed copy any more
    with w.lock, torch.no_grad():
        next(w.module.parameters()).add_(1.0)
        fresh = HopStore(3, shared=w.updates.weights_version)
        v2 = fresh.observe(w)
    assert v2 == v and (fresh.shared_versions, fresh.snapshots) == (0, 1)
    assert fresh.commitment(v2, timeout_s=10).root == weights_root(w.module.state_dict()) != wc.root
    # a version the update store does not hold (another merge count) is hashed by the hop store
    assert w.updates.weights_version((2, 1)) is None and w.updates.weights_version((9, 0)) is None


def test_a_skip_to_the_lanes_step_is_committed_as_a_skipped_step_that_passes_its_audit():
    """A lane member that jumps inner steps (``skip_to``: its lane completed them elsewhere) commits the
    last step jumped over as skipped, weights unchanged: validators flagged honest miners that skipped
    one step at a time under churn as ``stale`` cheats (same weights root over inner steps it claims)."""
    c = cfg()
    w = StageWorker(c, 1, seed=0, total_steps=c.train.total_steps, audit_window=4)
    train(w, 2)
    last = commits_of(w, 1)[0]
    assert w.skip_to(w.inner_step + 3) == 3
    s = w.updates.commitment(w.inner_step - 1, timeout_s=10)
    assert s is not None and s.skipped and s.step == last.step + 3
    assert s.roots["w0"] == s.roots["w1"] == last.roots["w1"]            # nothing changed the weights
    chk, _, _ = audit_in_process(UpdateAuditor(c, run_id="r", total_steps=c.train.total_steps, rows=3,
                                               rng=random.Random(1)), w, s)
    assert chk.ok, chk.reason
    assert w.skip_to(w.inner_step) == 0 and w.updates.steps()[-1] == s.step     # no jump: nothing committed


def test_a_joiner_re_warms_its_fresh_optimizer_and_its_updates_pass_audit():
    """A replica that joins mid-run (AdamW moments younger than the run) ramps its learning rate over
    ``train.rewarm_steps`` updates (fresh moments make the first updates sign-like at the schedule's
    full mid-run rate); validators recompute the same rate from the committed AdamW step count, so
    the honest joiner passes and one that skips the ramp fails."""
    from iota_subnet.train.optim import lr_at
    c = cfg()
    W = c.train.rewarm_steps
    total = c.train.total_steps
    joiner = StageWorker(c, 1, seed=0, total_steps=total, audit_window=4)
    joiner.skip_to(90)                                    # synced, then jumped to its lane's step
    train(joiner, 3)
    auditor = UpdateAuditor(c, run_id="r", total_steps=total, rows=2, rng=random.Random(0))
    commits = [cm for cm in commits_of(joiner, 4) if not cm.skipped]
    assert [cm.adam_step for cm in commits] == [1, 2, 3]
    for cm in commits:
        assert cm.lr == pytest.approx(lr_at(cm.step, total, c.train) * cm.adam_step / W, rel=1e-9)
        chk, _, _ = audit_in_process(auditor, joiner, cm)
        assert chk.ok, chk
    # a replica that trained every step from the start is not re-warmed: the schedule's rate
    veteran = StageWorker(c, 1, seed=0, total_steps=total, audit_window=2)
    train(veteran, 2)
    assert [cm.lr for cm in commits_of(veteran, 2)] == pytest.approx([lr_at(k, total, c.train) for k in (0, 1)])
    # a joiner that skips the ramp (the schedule's full rate on fresh moments) fails the audit
    rushed = StageWorker(c.__class__(**{**c.__dict__, "train": c.train.__class__(**{**c.train.__dict__,
                                                                                     "rewarm_steps": 0})}),
                         1, seed=0, total_steps=total, audit_window=2)
    rushed.skip_to(90)
    train(rushed, 1)
    cm = [x for x in commits_of(rushed, 2) if not x.skipped][0]
    chk, _, _ = audit_in_process(auditor, rushed, cm)
    assert not chk.ok and "learning rate" in chk.reason


def test_an_adam_step_count_that_buys_a_lower_rate_fails():
    """The re-warm factor follows the committed AdamW step count, which the miner reports: a fresh
    state's count (1) on moments that are not empty fails, and so does another count than the one
    the moments were updated with (the recomputed update does not match)."""
    from iota_subnet.train.optim import update_lr
    c = cfg()
    total = c.train.total_steps
    h = StageWorker(c, 1, seed=0, total_steps=total, audit_window=2)
    h.skip_to(60)
    train(h, 3)                                             # a joiner: counts 1, 2, 3 at steps 60-62
    commit = commits_of(h, 1)[0]
    assert (commit.step, commit.adam_step) == (62, 3)
    auditor = UpdateAuditor(c, run_id="r", total_steps=total, rows=1, rng=random.Random(0))
    assert audit_in_process(auditor, h, commit)[0].ok
    req = auditor.plan(1, commit)
    for adam_step, why in ((1, "fresh state"), (64, "AdamW")):
        lie = UpdateCommit.from_dict({**commit.to_dict(), "adam_step": adam_step,
                                      "lr": update_lr(commit.step, adam_step, total, c.train)})
        resp = h.updates.open(req.inner_step, req.merges, req.rows, req.kinds)
        resp.commit = lie.to_dict()
        chk = check_update_opening(lie, [tuple(r) for r in req.rows], resp, auditor.layout(1), auditor.hp,
                                   expected_lr=auditor.expected_lr(lie.step, lie.adam_step))
        assert not chk.ok and why in chk.reason, chk


def test_a_replica_handed_a_lane_at_a_lower_step_passes_with_its_own_count():
    """A replica that trained 5 inner steps in one lane and is handed another lane at step 0 keeps
    its moments and AdamW count (:mod:`iota_subnet.miner.lane_handover`): its update at step 0 is
    committed with count 6, and an honest update audits as passed."""
    c = cfg()
    total = c.train.total_steps
    h = StageWorker(c, 1, seed=0, total_steps=total, audit_window=8)
    train(h, 5)
    with h.lock:                                   # what take_lane does when no state is taken
        h.opt.zero_grad(set_to_none=True)
        h.pending = 0
        h.inner_step = 0
    train(h, 1, seed=1)
    commit = h.updates.commitment(0, timeout_s=10)
    assert commit is not None and (commit.step, commit.adam_step, commit.skipped) == (0, 6, False)
    auditor = UpdateAuditor(c, run_id="r", total_steps=total, rows=2, rng=random.Random(0))
    chk, _, _ = audit_in_process(auditor, h, commit)
    assert chk.ok, chk.reason
