"""The cheater suite against the validator's verification, one test per adversary kind.

A 3-stage x 3-replica network of in-process miners (StageWorker behind a signed NeuronServer on
127.0.0.1, the miner API: /forward /backward /state /health with ``stats.weights_step``), replica 1
of the middle stage running the adversary. The validator side is the real PipelineDriver with a
SpotChecker, CLASP probe rounds, update audits (every miner's latest committed inner step, rows
opened over /audit/update, outcomes through the AuditPolicy) and the Scoreboard; one "tempo" is two
lane steps per lane plus CLASP rounds and audits, then scores are updated and weights computed. Asserted for every kind: within 3
tempos the adversary's weight is 0, honest miners hold >= 95 % of the weight, no honest miner is
flagged (spot checks or CLASP) at any tempo.
"""
from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
import torch

from iota_subnet.config import load_config
from iota_subnet.miner import StageWorker, UnknownMicrobatch
from iota_subnet.sim.adversary import ADVERSARY_KINDS, CheatingStageWorker
from iota_subnet.protocol import (Backward, BackwardResult, Forward, ForwardResult, Health, Outcome, ProtocolError,
                                  StateRequest, StateResponse)
from iota_subnet.transport import NeuronClient, NeuronServer
from iota_subnet.validator.clasp import attribute, quality_factors
from iota_subnet.validator.driver import PipelineDriver
from iota_subnet.validator.routing import Replica, Router
from iota_subnet.validator.scoring import Ledger, Scoreboard, stage_compute_shares
from iota_subnet.miner.update_store import UpdateAuditRoute
from iota_subnet.protocol import UpdateAuditRequest
from iota_subnet.validator.audit_policy import AuditPolicy, merge_quality
from iota_subnet.validator.update_audit import UpdateAuditor
from iota_subnet.validator.verification import SpotChecker
from support.common import OVR, PatternData, make_wallet

pytestmark = pytest.mark.timeout(120)

ADV_STAGE, ADV_REPLICA = 1, 1


class Miner:
    """An in-process miner: the miner API of MinerService without the chain."""

    def __init__(self, cfg, stage: int, wallet, adversary: str | None = None, peer=None):
        self.cfg, self.stage = cfg, stage
        self.adversary = adversary
        if adversary:
            self.worker = CheatingStageWorker(
                cfg, stage, kind=adversary, seed=cfg.train.seed, total_steps=cfg.train.total_steps, audit_window=2,
                peer_state=(lambda: peer.worker.module.state_dict()) if peer is not None else None)
        else:
            self.worker = StageWorker(cfg, stage, seed=cfg.train.seed, total_steps=cfg.train.total_steps, audit_window=2)
        self.server = NeuronServer(wallet, "127.0.0.1", 0, None, None)
        self.server.add_route("/forward", self.forward, Forward)
        self.server.add_route("/backward", self.backward, Backward)
        self.server.add_route("/state", self.state, StateRequest)
        self.server.add_route("/health", self.health, Health)
        self.server.add_route("/audit/update", UpdateAuditRoute(self.worker.updates, "r", stage), UpdateAuditRequest)
        self.hotkey = self.server.hotkey

    async def forward(self, msg: Forward, ctx) -> ForwardResult:
        key = f"{ctx.caller_hotkey}:{msg.microbatch_id}"
        out = await asyncio.to_thread(self.worker.forward, key, msg.activations, msg.targets,
                                      train=msg.keep_for_backward)
        return ForwardResult(run_id=msg.run_id, stage=self.stage, microbatch_id=msg.microbatch_id,
                             inner_step=self.worker.inner_step, activations=out.get("activations"),
                             loss=out.get("loss"), grad=out.get("grad"),
                             stats={"weights_step": float(out["weights_step"]),
                                    "weights_merges": float(out["weights_merges"]),
                                    "bf16": 1.0 if self.worker.precision == "bf16" else 0.0})

    async def backward(self, msg: Backward, ctx) -> BackwardResult:
        key = f"{ctx.caller_hotkey}:{msg.microbatch_id}"
        w = self.worker
        try:
            g, used = await asyncio.to_thread(lambda: (w.backward(key, msg.grad), w.last_weights_step))
        except UnknownMicrobatch:
            raise ProtocolError(Outcome.UNKNOWN_MICROBATCH, msg.microbatch_id) from None
        return BackwardResult(run_id=msg.run_id, stage=self.stage, microbatch_id=msg.microbatch_id, grad=g,
                              stats={"weights_step": float(used)})

    async def state(self, msg: StateRequest, ctx) -> StateResponse:
        def snap():
            with self.worker.lock:
                return ({k: v.detach().clone() for k, v in self.worker.module.state_dict().items()},
                        self.worker.meta())
        t, meta = await asyncio.to_thread(snap)
        return StateResponse(run_id=msg.run_id, stage=self.stage, inner_step=meta["step"], tensors=t, state_meta=meta)

    async def health(self, msg: Health, ctx) -> Health:
        return Health(ready=True, hotkey=self.hotkey, stats={"stage": self.stage})


async def run_network(cfg, wallets, adversary: str | None, *, tempos: int = 3, steps_per_tempo: int = 2,
                      rate: float = 0.5, clasp_rounds: int = 4, clasp_paths: int = 6, seed: int = 0) -> dict:
    """Run the network; returns per-tempo weights, flags and the adversary's uid."""
    miners: list[Miner] = []
    replicas: dict[int, list[Replica]] = {}
    uid = 1
    by_pos: dict[tuple[int, int], Miner] = {}
    audited: list[tuple[Miner, Replica]] = []
    for r in range(3):
        for s in range(cfg.pipeline.stages):
            kind = adversary if (adversary and (s, r) == (ADV_STAGE, ADV_REPLICA)) else None
            peer = by_pos.get((s, 0)) if kind == "copy" else None
            m = Miner(cfg, s, wallets[f"m{len(miners)}"], kind, peer)
            await m.server.start()
            by_pos[(s, r)] = m
            miners.append(m)
            replicas.setdefault(s, []).append(Replica(uid, m.hotkey, m.server.endpoint, s))
            audited.append((m, replicas[s][-1]))
            if kind:
                adv_uid = uid
            uid += 1
    adv_uid = adv_uid if adversary else None
    current = {rep.uid: rep.hotkey for reps in replicas.values() for rep in reps}
    client = NeuronClient(wallets["vali"])
    rng = random.Random(seed)
    out = {"adv_uid": adv_uid, "weights": [], "spot_flagged": [], "clasp_flagged": [], "checks": None}
    try:
        router = Router(cfg.pipeline.stages, rng=random.Random(seed))
        router.update(replicas)
        shares = stage_compute_shares(cfg)
        ledger = Ledger(shares)
        checker = SpotChecker(cfg, run_id="r", client=client, rate=rate, rng=random.Random(seed + 1))
        driver = PipelineDriver(cfg, run_id="r", router=router, client=client, dataset=PatternData(256, 16),
                                ledger=ledger, n_lanes=3, hop_timeout_s=20, verifier=checker)
        board = Scoreboard()
        policy = AuditPolicy()
        auditor = UpdateAuditor(cfg, run_id="r", total_steps=cfg.train.total_steps, rows=2, rng=random.Random(seed + 2))
        probes: list[dict] = []
        next_steps: dict[int, int] = {}
        for t in range(tempos):
            total = (t + 1) * steps_per_tempo
            next_steps = await driver.run(next_steps, total)
            for i in range(clasp_rounds):
                probes += await driver.clasp_round(t * clasp_rounds + i, clasp_paths, rng)
            for m, rep in audited:
                commits = m.worker.updates.take_commitments()       # what its receipts would carry
                if commits:
                    res = await auditor.audit(client, rep.endpoint, rep.hotkey, rep.stage, commits[-1])
                    policy.record(rep.uid, rep.hotkey, rep.stage, "update", res.outcome, detail=res.detail)
            flagged = checker.flagged() | policy.flagged()
            attr = attribute(probes, exclude=flagged)
            q = quality_factors(attr)
            quality = {}
            for key in ledger.records:
                f, why = q.get(key, (1.0, []))
                if key in checker.flagged():
                    f, why = 0.0, ["spot check failed: " + "; ".join(checker.stats[key].reasons)] + why
                quality[key] = (f, why)
            board.update(ledger, merge_quality(quality, policy.quality()))
            out["weights"].append(board.weights(shares, current))
            out["spot_flagged"].append(sorted(k[0] for k in flagged))
            out["clasp_flagged"].append(sorted(k[0] for k, a in attr.items() if a.flagged))
        out["checks"] = {k[0]: s.to_dict() for k, s in checker.stats.items()}
        out["audits"] = {k[0]: s.to_dict() for k, s in policy.stats.items()}
        out["attr"] = {k[0]: a.to_dict() for k, a in attribute(probes, exclude=checker.flagged()).items()}
        out["board"] = board
    finally:
        await client.close()
        for m in miners:
            await m.server.stop()
    return out


@pytest.fixture()
def cfg():
    return load_config("configs/tiny.yaml", OVR)


@pytest.fixture()
def wallets(tmp_home):
    root = tmp_home / "wallets"
    return {"vali": make_wallet(root, "vali"), **{f"m{i}": make_wallet(root, f"m{i}") for i in range(9)}}


def assert_caught(res: dict) -> None:
    adv = res["adv_uid"]
    for t, (w, sf, cf) in enumerate(zip(res["weights"], res["spot_flagged"], res["clasp_flagged"])):
        assert set(sf) <= {adv}, f"tempo {t}: honest miner flagged by spot checks: {sf} ({res['checks']})"
        assert set(cf) <= {adv}, f"tempo {t}: honest miner flagged by CLASP: {cf} ({res['attr']})"
    final = res["weights"][-1]
    assert final.get(adv, 0.0) == 0.0, (final, res["checks"].get(adv))
    honest = sum(v for u, v in final.items() if u != adv)
    assert honest >= 0.95 and abs(sum(final.values()) - 1) < 1e-9, final


def test_honest_network_nobody_flagged(cfg, wallets):
    res = asyncio.run(run_network(cfg, wallets, None))
    for sf, cf in zip(res["spot_flagged"], res["clasp_flagged"]):
        assert sf == [] and cf == []
    audits = res["audits"]                   # every miner's update audited once per tempo, all passed
    assert len(audits) == 9 and all(a["passed"] == 3 and a["failed"] + a["refused"] + a["timed_out"] == 0
                                    for a in audits.values()), audits
    checks = res["checks"]
    assert sum(c["passed"] for c in checks.values()) >= 20 and all(c["failed"] == 0 for c in checks.values())
    assert max(c["max_err_passed"] for c in checks.values()) < 1e-4    # fp32 replay: far below the 1e-3 tolerance
    w = res["weights"][-1]
    assert len(w) == 9 and all(v > 0 for v in w.values())
    # stage budgets follow compute: each stage's miners share its compute share
    shares = stage_compute_shares(cfg)
    for s in range(3):
        assert abs(sum(w[1 + s + 3 * r] for r in range(3)) - shares[s]) < 1e-6


# poison and accuse need replica merges: tests/test_merge_http.py and tests/test_merge_audit.py
@pytest.mark.parametrize("kind", [k for k in ADVERSARY_KINDS if k not in ("poison", "accuse")])
def test_adversary_caught(cfg, wallets, kind):
    res = asyncio.run(run_network(cfg, wallets, kind))
    assert_caught(res)
    adv = res["adv_uid"]
    assert adv in res["spot_flagged"][-1]
    if kind == "noisy-update":           # caught by the update audits, not by the replays
        assert res["audits"][adv]["flagged"] and not res["checks"].get(adv, {}).get("failed")
    assert res["board"].entries[(adv, [e.hotkey for e in res["board"].entries.values() if e.uid == adv][0])].why
