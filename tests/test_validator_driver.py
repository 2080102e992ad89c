"""The pipeline driver against real miners: NeuronServer + StageWorker on 127.0.0.1, signed HTTP.

The in-test miner serves /forward, /backward and /health exactly as the miner API says (the last
stage runs its backward with its forward and returns d loss / d input).
"""
from __future__ import annotations

import asyncio
import random

import pytest

from iota_subnet.config import load_config
from iota_subnet.miner import StageWorker, UnknownMicrobatch
from iota_subnet.protocol import (Backward, BackwardResult, Forward, ForwardResult, Health, Outcome, ProtocolError)
from iota_subnet.transport import NeuronClient, NeuronServer
from iota_subnet.validator.driver import PipelineDriver, sample_start
from iota_subnet.validator.routing import Replica, Router
from iota_subnet.validator.scoring import Ledger, stage_compute_shares
from support.common import OVR, PatternData, make_wallet

pytestmark = pytest.mark.timeout(120)


class StageMiner:
    """A miner in a few lines: one StageWorker behind a NeuronServer."""

    def __init__(self, cfg, stage: int, wallet, *, allowed: set[str] | None = None, total_steps: int = 20):
        self.cfg, self.stage = cfg, stage
        self.worker = StageWorker(cfg, stage, seed=cfg.train.seed, total_steps=total_steps)

        def authorizer(hotkey: str, route: str) -> None:
            if allowed is not None and hotkey not in allowed:
                raise ProtocolError(Outcome.FORBIDDEN, "no validator permit")

        self.server = NeuronServer(wallet, "127.0.0.1", 0, authorizer if allowed is not None else None, None)
        self.server.add_route("/forward", self.forward, Forward)
        self.server.add_route("/backward", self.backward, Backward)
        self.server.add_route("/health", self.health, Health)
        self.hotkey = self.server.hotkey

    async def forward(self, msg: Forward, ctx) -> ForwardResult:
        key = f"{ctx.caller_hotkey}:{msg.microbatch_id}"
        out = await asyncio.to_thread(self.worker.forward, key, msg.activations, msg.targets,
                                      train=msg.keep_for_backward)
        return ForwardResult(run_id=msg.run_id, stage=self.stage, microbatch_id=msg.microbatch_id,
                             inner_step=self.worker.inner_step, activations=out.get("activations"),
                             loss=out.get("loss"), grad=out.get("grad"))

    async def backward(self, msg: Backward, ctx) -> BackwardResult:
        key = f"{ctx.caller_hotkey}:{msg.microbatch_id}"
        try:
            g = await asyncio.to_thread(self.worker.backward, key, msg.grad)
        except UnknownMicrobatch:
            raise ProtocolError(Outcome.UNKNOWN_MICROBATCH, msg.microbatch_id) from None
        return BackwardResult(run_id=msg.run_id, stage=self.stage, microbatch_id=msg.microbatch_id, grad=g)

    async def health(self, msg: Health, ctx) -> Health:
        w = self.worker
        return Health(ready=True, hotkey=self.hotkey, stats={"stage": self.stage, "inner_step": w.inner_step,
                                                            "forwards": w.forwards, "backwards": w.backwards,
                                                            "tokens": w.tokens})


@pytest.fixture()
def cfg():
    return load_config("configs/tiny.yaml", OVR)


@pytest.fixture()
def wallets(tmp_home):
    root = tmp_home / "wallets"
    return {"vali": make_wallet(root, "vali"), **{f"m{i}": make_wallet(root, f"m{i}") for i in range(6)}}


async def start_miners(cfg, wallets, n_lanes: int, allowed=None) -> list[StageMiner]:
    miners = []
    i = 0
    for lane in range(n_lanes):
        for s in range(cfg.pipeline.stages):
            m = StageMiner(cfg, s, wallets[f"m{i}"], allowed=allowed)
            await m.server.start()
            miners.append(m)
            i += 1
    return miners


def replicas_of(miners: list[StageMiner]) -> dict[int, list[Replica]]:
    out: dict[int, list[Replica]] = {}
    for uid, m in enumerate(miners):
        out.setdefault(m.stage, []).append(Replica(uid + 1, m.hotkey, m.server.endpoint, m.stage))
    return out


def test_sample_addressing_matches_colocated_with_one_lane():
    # one lane: step k, micro-batch m reads rows k*B + m*mb, like the co-located trainer
    assert [sample_start(0, k, m, 1, 8, 4) for k in range(2) for m in range(2)] == [0, 4, 8, 12]
    # two lanes interleave whole steps
    assert sample_start(1, 0, 0, 2, 8, 4) == 8 and sample_start(0, 1, 1, 2, 8, 4) == 20


def test_driver_two_lanes_three_stages_with_a_miner_killed(cfg, wallets):
    steps = 6

    async def main():
        vali = wallets["vali"]
        miners = await start_miners(cfg, wallets, 2, allowed={vali.hotkey.ss58_address})
        client = NeuronClient(vali)
        try:
            router = Router(cfg.pipeline.stages, cooldown_base_s=0.3, rng=random.Random(0))
            router.update(replicas_of(miners))
            assert router.n_lanes == 2
            ledger = Ledger(stage_compute_shares(cfg))
            data = PatternData(256, cfg.data.seq_len)
            drv = PipelineDriver(cfg, run_id="t", router=router, client=client, dataset=data, ledger=ledger,
                                 n_lanes=2, hop_timeout_s=10, retries=0)
            results = []
            # phase 1: all miners up
            await drv.run({}, steps, on_step=lambda r, nxt: results.append(r))
            assert len(results) == 2 * steps
            for lane in range(2):
                losses = [r.loss for r in sorted(results, key=lambda r: r.step) if r.lane == lane]
                assert all(l is not None and l == l for l in losses)
                assert sum(losses[-2:]) / 2 < losses[0], losses
            for m in miners:   # each miner stepped once per lane step, over its own lane's tokens
                assert m.worker.inner_step == steps, (m.stage, m.worker.inner_step)
                assert m.worker.backwards == steps * 2
            assert drv.reroutes == 0 and drv.failures == 0
            # data addressing: lane r, step k, micro-batch m
            assert sorted(c[1] for c in data.calls) == sorted(
                sample_start(l, k, m, 2, 4, 2) for l in range(2) for k in range(steps) for m in range(2))
            # every miner has verified work; the pathway of lane 0 is lane 0's replicas
            assert all(rec.completed == steps * 2 for rec in ledger.records.values())
            lane0 = {(p["uid"]) for r in results if r.lane == 0 for mb in r.microbatches for p in mb.pathway}
            assert lane0 == {1, 2, 3}
            w = ledger.weights({i + 1: m.hotkey for i, m in enumerate(miners)})
            assert abs(sum(w.values()) - 1) < 1e-9 and len(w) == 6

            # phase 2: stop lane 0's body miner; lane 0's body hops go to lane 1's body replica.
            # (That replica now serves two streams: when it steps between another micro-batch's
            # forward and backward, the StageWorker refuses that backward; such micro-batches are
            # lost, the replica is probed back, and training goes on.)
            dead = miners[1]
            await dead.server.stop()
            results.clear()
            await drv.run({0: steps, 1: steps}, steps + 3, on_step=lambda r, nxt: results.append(r))
            assert len(results) == 2 * 3 and all(r.ok_count >= 1 for r in results)
            assert drv.reroutes > 0 and drv.failures >= 1
            assert not router.is_available(router.get((2, dead.hotkey)))
            assert all(mb.pathway[1]["uid"] == 5 for r in results for mb in r.microbatches if mb.ok)
            assert ledger.records[(2, dead.hotkey)].failures >= 1
            assert ledger.records[(5, miners[4].hotkey)].reroutes >= 1
            assert miners[0].worker.inner_step > steps   # lane 0's head kept training
            assert all(r.loss == r.loss for r in results)
            val = await drv.evaluate(2, lane=1)
            assert val is not None and val == val
            assert miners[3].worker.forwards > 0
        finally:
            await client.close()
            for m in miners:
                await m.server.stop()

    asyncio.run(main())


def test_driver_refused_hop_is_rerouted_and_failed_backward_is_final(cfg, wallets):
    """A miner that refuses forwards (no permit for us) is rerouted around; a backward to a miner
    that lost the micro-batch ends that micro-batch."""

    async def main():
        vali = wallets["vali"]
        miners = await start_miners(cfg, wallets, 2, allowed={vali.hotkey.ss58_address})
        client = NeuronClient(vali)
        try:
            miners[2].server.authorizer = lambda hk, route: (_ for _ in ()).throw(
                ProtocolError(Outcome.FORBIDDEN, "go away"))
            router = Router(cfg.pipeline.stages, rng=random.Random(1))
            router.update(replicas_of(miners))
            ledger = Ledger(stage_compute_shares(cfg))
            drv = PipelineDriver(cfg, run_id="t", router=router, client=client, dataset=PatternData(256, 16),
                                 ledger=ledger, n_lanes=2, retries=0)
            res = await drv.run_lane_step(0, 0)
            assert res.ok_count == 2 and res.reroutes >= 1
            assert all(mb.pathway[2]["uid"] == 6 for mb in res.microbatches)
            assert ledger.records[(3, miners[2].hotkey)].failures >= 1

            # the body miner forgets the micro-batch between forward and backward
            orig = miners[4].worker.backward

            def forgetful(mb_id, grad):
                raise UnknownMicrobatch(mb_id)

            miners[4].worker.backward = forgetful
            mb = await drv.run_microbatch(1, 1, 0, PatternData(256, 16).batch(0, 0, 2))
            assert not mb.ok and mb.phase == "backward" and mb.attempts == 1
            assert mb.failures[-1]["phase"] == "backward" and mb.failures[-1]["uid"] == 5
            miners[4].worker.backward = orig
        finally:
            await client.close()
            for m in miners:
                await m.server.stop()

    asyncio.run(main())
