"""Every link of the hop audit is load-bearing: a forgery confined to one link (carried consistently
downstream, the sent outputs being the forged computation's) fails the audit, only at that link,
and passes once that link's check is switched off. Forged projections (round 2) that rescue a
forged link are caught by the column / spot checks. A small model (2 blocks per stage) keeps this
exhaustive matrix fast; ``test_audit.py`` runs the same machinery on ``configs/tiny.yaml``."""
from __future__ import annotations

import math

import pytest
import torch

from support.audit import (EVERY_BLOCK, RescuingProver, Tracer, audit_many, forged_hop, forging_tracer, make_chain)
from iota_subnet.audit import HopProver, weights_commitment
from iota_subnet.audit.check import LinkChecker
from iota_subnet.audit.project import projections

SMALL = {"model": {"name": "tiny", "dim": 64, "n_layers": 6, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128,
                   "vocab_size": 256},
         "data": {"seq_len": 16, "vocab_size": 256},
         "pipeline": {"stages": 3, "compression_ratio": 4},
         "train": {"batch_size": 4, "micro_batch_size": 2, "warmup_steps": 1, "total_steps": 20}}
MHA = {**SMALL, "model": {**SMALL["model"], "n_kv_heads": 4}}      # one query head per kv head


@pytest.fixture(scope="module")
def chain():
    torch.set_num_threads(1)
    return make_chain(SMALL, train_steps=2)


@pytest.fixture(scope="module")
def mha_chain():
    return make_chain(MHA, train_steps=1)


def _switch_off(monkeypatch, keys: set[str]) -> None:
    orig = LinkChecker._record

    def record(self, link, err, tol, where):
        key = link.split(".", 1)[1] if link.startswith("L") and "." in link else link
        if key in keys:
            return orig(self, link, 0.0, tol, where)
        return orig(self, link, err, tol, where)

    monkeypatch.setattr(LinkChecker, "_record", record)


def _keys(verdict) -> set[str]:
    return set(verdict.failed_links)


MATRIX = [
    # stage, direction, forged tensor, links that must catch it
    (0, "forward", "h.0", {"input"}), (0, "forward", "L0.q", {"qkv"}), (0, "forward", "L0.k", {"qkv"}),
    (0, "forward", "L1.v", {"qkv"}), (0, "forward", "L0.s", {"scores"}), (0, "forward", "L1.lse", {"lse"}),
    (0, "forward", "L0.y", {"values"}), (0, "forward", "L1.h1", {"o"}), (0, "forward", "L0.g", {"gu"}),
    (0, "forward", "L1.u", {"gu"}), (0, "forward", "h.1", {"down"}), (0, "forward", "out.z", {"encoder"}),
    (1, "forward", "h.0", {"input"}), (1, "forward", "h.2", {"down"}),
    (1, "backward", "g.2", {"grad_out"}), (1, "backward", "out.dne", {"encoder_bwd"}),
    (1, "backward", "L1.da", {"da"}), (1, "backward", "L1.dn2", {"dn2"}), (1, "backward", "L0.dy", {"dy"}),
    (1, "backward", "L1.dp", {"dp", "dp^T"}), (1, "backward", "L0.delta", {"delta"}),
    (1, "backward", "L1.dq", {"dq"}), (1, "backward", "L0.dk", {"dk"}), (1, "backward", "L1.dv", {"dv"}),
    (1, "backward", "L0.dn1", {"dn1"}), (1, "backward", "g.1", {"grad"}), (1, "backward", "L0.s", {"scores", "s^T"}),
    (1, "backward", "in.dz", {"decoder_bwd"}), (1, "backward", "L1.y", {"values"}),
    (2, "backward", "lm.logits", {"lm.logits", "lm.vocab"}), (2, "backward", "lm.loss", {"lm.loss"}),
    (2, "backward", "lm.dn", {"lm.dn"}), (2, "backward", "g.2", {"grad_out"}), (2, "backward", "h.0", {"input"}),
]


@pytest.mark.parametrize("stage,direction,target,links", MATRIX, ids=[f"{m[0]}-{m[1][0]}-{m[2]}" for m in MATRIX])
def test_a_forged_link_is_caught_by_that_link_alone(chain, monkeypatch, stage, direction, target, links):
    tracer = forging_tracer(target, scale=0.3)
    hop, lay = forged_hop(chain, stage, direction, tracer)
    prover = HopProver(lay, weights_commitment(hop.weights), hop.inputs, tracer=tracer)
    verdicts = audit_many(chain, hop, direction, 3, prover=prover, seed0=11, sampling=EVERY_BLOCK)
    for v in verdicts:
        assert not v.ok, target
        assert _keys(v) <= links, (target, v.failures[:4])
    _switch_off(monkeypatch, links)
    for v in audit_many(chain, hop, direction, 3, prover=prover, seed0=11, sampling=EVERY_BLOCK):
        assert v.ok, (target, v.failures[:4])


def test_every_link_check_is_exercised_by_the_matrix(chain):
    """The matrix covers every link the checker records on a backward audit of each stage (so
    switching any of them off breaks a test above)."""
    covered = set().union(*(m[3] for m in MATRIX))
    seen: set[str] = set()
    for stage, direction in ((0, "forward"), (1, "backward"), (2, "backward")):
        for v in audit_many(chain, chain.hops[stage], direction, 1, sampling=EVERY_BLOCK):
            assert v.ok
            seen |= set(v.errors)
    # shared-vector links are covered by the rescue tests below, the outputs by the cheater suite
    shared = {"kappa", "c", "ck", "e", "f", "nu", "phi", "psi", "w_qkv", "w_o", "w_gu", "w_d", "o_d", "o_g", "o_u",
              "o_o", "o_q", "o_k", "o_v", "dec.w", "dec.o", "enc.w", "enc.o", "lm.w", "lm.o", "output", "grad_in", "loss",
              "lse_b", "encoder"}
    assert seen - covered - shared == set(), seen - covered - shared


# ---- forged projections that rescue a forged link ----------------------------------------------
def _fake_weights(hop, name: str, scale: float = 0.3, seed: int = 0) -> dict[str, torch.Tensor]:
    w = hop.weights[name]
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(w.shape, generator=g) * float(w.std()) * scale}


@pytest.mark.parametrize("param,link", [("layers.0.mlp.gate_proj.weight", "w_gu"),
                                        ("layers.1.self_attn.q_proj.weight", "w_qkv"),
                                        ("layers.1.mlp.down_proj.weight", "w_d"),
                                        ("bottleneck_out.proj.weight", "enc.w")])
def test_computing_with_other_weights_fails_the_weight_columns(chain, monkeypatch, param, link):
    """The 'copy'/'replay' cheat done carefully: every link computed with fake weights W' (so all
    token checks pass), while the commitment names the real W: w' = W'^T r differs from W^T r on
    every column where W' differs, and the sampled column catches it."""
    hop0 = chain.hops[0]
    delta = _fake_weights(hop0, param)
    tracer = forging_tracer("none", weight_delta=delta)
    hop, lay = forged_hop(chain, 0, "forward", tracer)
    fake = {k: v + delta[k] if k in delta else v for k, v in hop.weights.items()}

    def fix(layout, records, weights, rnd, vec, com):
        return projections(layout, records, fake, rnd)

    prover = RescuingProver(lay, weights_commitment(hop.weights), hop.inputs, tracer=tracer, fix=fix)
    for v in audit_many(chain, hop, "forward", 3, prover=prover, seed0=3, sampling=EVERY_BLOCK):
        assert not v.ok and _keys(v) == {link}, v.failures[:3]
    _switch_off(monkeypatch, {link})
    assert all(v.ok for v in audit_many(chain, hop, "forward", 2, prover=prover, seed0=3, sampling=EVERY_BLOCK))


def test_scores_with_fake_keys_fail_the_key_columns(chain, monkeypatch):
    """Scores computed with keys K' = K + dK (the committed keys honest): kappa' = K'^T rho passes the
    score rows but differs from the opened columns of K."""
    g = torch.Generator().manual_seed(5)

    class FakeKeys(Tracer):
        def emit(self, name, t):
            if name == "L0.k":
                self.k = t
            if name == "L0.s":
                m = self.layout.dims
                kk = self.k + torch.randn(self.k.shape, generator=g) * float(self.k.std()) * 0.3
                self.fake_k = kk
                kh = kk.permute(0, 2, 1, 3).repeat_interleave(m.rep, dim=1)
                q = self.q_last
                return q.permute(0, 2, 1, 3) @ kh.transpose(-1, -2) / math.sqrt(m.D)
            if name == "L0.q":
                self.q_last = t
            return t

    holder = {}

    class Keep(FakeKeys):
        def run(self, *a, **kw):
            g.manual_seed(5)
            res = super().run(*a, **kw)
            holder["fake_k"] = self.fake_k
            return res

    hop, lay = forged_hop(chain, 1, "forward", Keep)

    def fix(layout, records, weights, rnd, vec, com):
        m = layout.dims
        kk = holder["fake_k"].reshape(m.B, m.T, m.KD).double()
        com["p:L0.kappa"] = torch.einsum("btk,t->bk", kk, rnd["L0.rho"]).float()
        return vec, com

    prover = RescuingProver(lay, weights_commitment(hop.weights), hop.inputs, tracer=Keep, fix=fix)
    for v in audit_many(chain, hop, "forward", 3, prover=prover, seed0=8, sampling=EVERY_BLOCK):
        assert not v.ok and _keys(v) == {"kappa"}, v.failures[:3]
    _switch_off(monkeypatch, {"kappa"})
    assert all(v.ok for v in audit_many(chain, hop, "forward", 2, prover=prover, seed0=8, sampling=EVERY_BLOCK))


def _probabilities(records, layout, j):
    m = layout.dims
    s = records[f"L{j}.s"].double().view(m.B, m.T, m.H, m.T).permute(0, 2, 1, 3)        # [B, H, t, s]
    lse = records[f"L{j}.lse"].double().view(m.B, m.T, m.H).permute(0, 2, 1)           # [B, H, t]
    mask = torch.ones(m.T, m.T, dtype=torch.bool).tril()
    return torch.exp(s - lse[..., None]).masked_fill(~mask, 0.0)


def test_attention_outputs_rescued_by_a_forged_value_projection_fail_the_spots(mha_chain, monkeypatch):
    """Forged attention outputs y' (committed in round 1) with c' solved, after r is known, so that
    every token's values check passes: c' = c + P^-1 r.(y' - y) differs from the committed values
    from the first forged position on, and the spot positions catch it. (With grouped-query
    attention two heads share c and the system has no solution; this model has one head per group.)"""
    ch = mha_chain
    tracer = forging_tracer("L1.y", scale=0.3)
    hop, lay = forged_hop(ch, 1, "forward", tracer)
    honest = Tracer(lay, hop.weights).run(hop.inputs.x).records
    m = lay.dims

    def fix(layout, records, weights, rnd, vec, com):
        P = _probabilities(records, layout, 1)                                            # [B, H, t, s]
        dy = (records["L1.y"] - honest["L1.y"]).double().view(m.B, m.T, m.H, m.D)
        r = rnd["L1.r_c"].view(m.K, m.D)
        c = com["p:L1.c"].double().view(m.B, m.K, m.T).clone()                          # rows b*K + g
        for b in range(m.B):
            for h in range(m.H):
                rhs = dy[b, :, h] @ r[h]
                c[b, h] += torch.linalg.solve_triangular(P[b, h], rhs[:, None], upper=False)[:, 0]
        com["p:L1.c"] = c.reshape(m.B * m.K, m.T).float()
        return vec, com

    prover = RescuingProver(lay, weights_commitment(hop.weights), hop.inputs, tracer=tracer, fix=fix)
    verdicts = audit_many(ch, hop, "forward", 4, prover=prover, seed0=21, sampling=EVERY_BLOCK)
    for v in verdicts:
        assert not v.ok and _keys(v) == {"c"}, v.failures[:3]
    _switch_off(monkeypatch, {"c"})
    assert all(v.ok for v in audit_many(ch, hop, "forward", 2, prover=prover, seed0=21, sampling=EVERY_BLOCK))


def test_key_gradients_rescued_by_a_forged_query_projection_fail_the_spots(chain, monkeypatch):
    """Forged dk' with e' solved (least squares over the heads of each group, after r is known) so
    that every token's dk check passes: e' is wrong at most positions, and the spots catch it."""
    tracer = forging_tracer("L1.dk", scale=0.3)
    hop, lay = forged_hop(chain, 1, "backward", tracer)
    h = hop.inputs
    honest = Tracer(lay, hop.weights).run(h.x, grad=h.grad).records
    m = lay.dims

    def fix(layout, records, weights, rnd, vec, com):
        P = _probabilities(records, layout, 1)
        dp = records["L1.dp"].double().view(m.B, m.T, m.H, m.T).permute(0, 2, 1, 3)
        delta = records["L1.delta"].double().view(m.B, m.H, m.T)                         # rows b*K + g
        dS = P * (dp - delta[..., None]) / math.sqrt(m.D)                                # [B, H, t, u]
        ddk = (records["L1.dk"] - honest["L1.dk"]).double().view(m.B, m.T, m.K, m.D)
        r = rnd["L1.r_dk"].view(m.K, m.D)
        e = com["p:L1.e"].double().view(m.B, m.H, m.T).clone()                          # rows b*K + g
        for b in range(m.B):
            for g in range(m.K):
                heads = list(range(g * m.rep, (g + 1) * m.rep))
                A = torch.cat([dS[b, hh].T for hh in heads], dim=1)                     # [u, rep * t]
                rhs = ddk[b, :, g] @ r[g]
                sol = torch.linalg.pinv(A, rtol=1e-12) @ rhs                           # minimum-norm exact solve
                assert float((A @ sol - rhs).norm()) < 1e-9 * (float(rhs.norm()) + 1e-30)
                for i, hh in enumerate(heads):
                    e[b, hh] += sol[i * m.T:(i + 1) * m.T]
        com["p:L1.e"] = e.reshape(m.B * m.K, m.rep * m.T).float()
        return vec, com

    prover = RescuingProver(lay, weights_commitment(hop.weights), hop.inputs, tracer=tracer, fix=fix)
    for v in audit_many(chain, hop, "backward", 4, prover=prover, seed0=41, sampling=EVERY_BLOCK):
        assert not v.ok and _keys(v) == {"e"}, v.failures[:3]
    _switch_off(monkeypatch, {"e"})
    assert all(v.ok for v in audit_many(chain, hop, "backward", 2, prover=prover, seed0=41, sampling=EVERY_BLOCK))


def test_a_projection_made_up_without_rescue_fails(chain):
    """Projections that are simply wrong (noise added) fail both their own checks and the token links."""
    hop = chain.hops[1]
    lay = chain.layout(1, "backward")

    def fix(layout, records, weights, rnd, vec, com):
        vec = {k: v + 0.1 * v.std() * torch.randn_like(v) for k, v in vec.items()}
        com = {k: v + 0.1 * v.std() * torch.randn_like(v) for k, v in com.items()}
        return vec, com

    prover = RescuingProver(lay, weights_commitment(hop.weights), hop.inputs, fix=fix)
    v = audit_many(chain, hop, "backward", 1, prover=prover, sampling=EVERY_BLOCK)[0]
    keys = _keys(v)
    assert not v.ok and {"w_qkv", "o_d", "c"} & keys and {"qkv", "values", "dk"} & keys, keys


@pytest.mark.parametrize("stage,direction,target", [(0, "forward", "L0.y"), (0, "forward", "L1.q"),
                                                    (1, "backward", "L1.dk"), (1, "backward", "g.1"),
                                                    (2, "backward", "lm.dn")])
def test_small_forgeries_are_caught(chain, stage, direction, target):
    """A forgery of 0.2 % of the tensor's RMS fails: the link tolerance (1e-4) sits ~200x above the
    honest fp32 error and well below any change a cheat needs."""
    tracer = forging_tracer(target, scale=2e-3, seed=9)
    hop, lay = forged_hop(chain, stage, direction, tracer)
    prover = HopProver(lay, weights_commitment(hop.weights), hop.inputs, tracer=tracer)
    for v in audit_many(chain, hop, direction, 2, prover=prover, seed0=13, sampling=EVERY_BLOCK):
        assert not v.ok, target


def test_a_sparse_rescue_where_tokens_do_not_span_is_caught_at_the_stated_rate(chain, monkeypatch):
    """Here N = 32 token rows and dn2 = Wg^T dg + Wu^T du has 2F = 256 unknowns in its identity, so a
    forger can rescue forged dn2 rows with (o_g, o_u) wrong on only N = 32 of their 256 entries (the
    sparsest solution: solved on a random support of exactly N). The validator checks
    ``index_counts`` entries of each (18 here, for rescue_miss = 0.1): every audit must fail, at those
    vectors only, and pass with them switched off."""
    from iota_subnet.audit.challenge import SamplingParams, index_counts
    tracer = forging_tracer("L1.dn2", scale=0.3)
    hop, lay = forged_hop(chain, 1, "backward", tracer)
    h = hop.inputs
    honest = Tracer(lay, hop.weights).run(h.x, grad=h.grad).records
    m = lay.dims
    k = index_counts(lay, SamplingParams())
    assert k["L1.o_g"] == k["L1.o_u"] == math.ceil(math.log(0.1) / math.log(1 - m.N / (2 * m.F)))

    def fix(layout, records, weights, rnd, vec, com):
        g, u, da = (records[f"L1.{n}"].double() for n in ("g", "u", "da"))
        sg = torch.sigmoid(g)
        A = torch.cat((da * u * (sg * (1 + g * (1 - sg))), da * g * sg), dim=1)          # [N, 2F]: (dg, du)
        rhs = (records["L1.dn2"] - honest["L1.dn2"]).double() @ rnd["L1.r_dn2"]
        support = torch.randperm(2 * m.F, generator=torch.Generator().manual_seed(1))[:m.N]
        sol = torch.zeros(2 * m.F, dtype=torch.float64)
        sol[support] = torch.linalg.solve(A[:, support], rhs)
        assert float((A @ sol - rhs).norm()) < 1e-8 * float(rhs.norm())
        vec["L1.o_g"] = vec["L1.o_g"] + sol[:m.F].float()
        vec["L1.o_u"] = vec["L1.o_u"] + sol[m.F:].float()
        return vec, com

    prover = RescuingProver(lay, weights_commitment(hop.weights), hop.inputs, tracer=tracer, fix=fix)
    for v in audit_many(chain, hop, "backward", 6, prover=prover, seed0=61, sampling=EVERY_BLOCK):
        assert not v.ok and _keys(v) <= {"o_g", "o_u"}, v.failures[:3]
    _switch_off(monkeypatch, {"o_g", "o_u"})
    assert all(v.ok for v in audit_many(chain, hop, "backward", 2, prover=prover, seed0=61, sampling=EVERY_BLOCK))
