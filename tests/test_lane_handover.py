"""A replica handed a lane it did not train takes the lane's weights before its first training hop
of that lane (real MinerService replicas of stage 1 over signed HTTP on 127.0.0.1, devnet chain).

Issue 29 (item 4): a spare that took over a departed member's lane jumped its step counter to the
lane's step but kept its own weights, so stage 1 of that lane trained from its starting weights
until the next merge. Here a spare's first trained hop of the lane must be computed with weights
whose hash is the lane's: the departed member's state when it still answers, else the stage's
latest merged state (what the lane trained since that merge on a member that is gone is lost).
"""
from __future__ import annotations

import asyncio
import hashlib
import time

import pytest
import torch

from iota_subnet.protocol import Hop, HopAck, Ticket
from iota_subnet.transport import NeuronClient
from iota_subnet.wallets import create_wallet
from support.merge_net import RUN, Net, merge_epoch, train_locally

pytestmark = pytest.mark.timeout(180)


def weights_hash(flat: torch.Tensor) -> str:
    """sha256 of a stage's parameters as one float32 vector (ModuleParams order)."""
    return hashlib.sha256(flat.detach().to(torch.float32).contiguous().numpy().tobytes()).hexdigest()


def record_training_forwards(svc) -> list[str]:
    """The weights hash each training forward of ``svc``'s worker is computed with (that accumulates
    into its weights: it trains as the lane's own miner)."""
    seen: list[str] = []
    w, compute = svc.worker, svc.worker.compute_forward

    def recorded(mb_id, x, targets=None, *, train=True, accumulate=True):
        if train and accumulate:
            seen.append(weights_hash(svc.merge.params.read()))
        return compute(mb_id, x, targets, train=train, accumulate=accumulate)
    w.compute_forward = recorded
    return seen


async def start_pair(net: Net):
    """Replicas a and b of stage 1 that merged epoch 0 together (both at inner step H), plus a
    registered head and tail (no servers) for the tickets' route."""
    await net.start(2)
    a, b = net.svcs
    for k, s in enumerate(net.svcs):
        train_locally(s, k)
    assert all(r.applied for r in await merge_epoch(net.svcs, 0))
    head = create_wallet("head", "default", net.tmp / "wallets")
    tail = create_wallet("tail", "default", net.tmp / "wallets")
    for w in (head, tail):
        await net.chain.register(w, 9)
    for s in net.svcs:
        s.view.last_refresh = 0
        await s.refresh()
    return a, b, head, tail


def lane_ticket(net: Net, member, head, tail, lane: int, step: int, index: int = 0, not_from=()) -> Ticket:
    cfg, now = net.cfg, time.time()
    t = Ticket(run_id=RUN, validator=net.val.hotkey.ss58_address, lane=lane, step=step, index=index,
               microbatch_id=f"l{lane}-k{step}-m{index}", split="train", seed=0, start=4 * step + 2 * index,
               rows=cfg.train.micro_batch, seq_len=cfg.data.seq_len, width=16, wire_dtype="bf16", train=True,
               micro_per_step=cfg.train.batch_size // cfg.train.micro_batch,
               route=(head.hotkey.ss58_address, member.hotkey, tail.hotkey.ss58_address),
               issued_at=now, deadline=now + 60, not_from=tuple(not_from))
    return t.signed(net.val.hotkey)


async def send_forward(net: Net, member, head, t: Ticket) -> HopAck:
    """The head's forward hop of ``t`` to stage 1's lane member ``member``."""
    x = torch.randn(t.rows, t.seq_len, t.width).to(torch.bfloat16)
    async with NeuronClient(head) as client:
        return await client.call(f"127.0.0.1:{member.port}", member.hotkey, "/hop",
                                 Hop(run_id=RUN, stage=1, microbatch_id=t.microbatch_id, ticket=t.to_json(),
                                     direction="forward", path=[head.hotkey.ss58_address], data=x),
                                 HopAck, retries=0, timeout_s=30)


def train_lane(svc, k: int, lane: int, step: int) -> None:
    """``svc`` trains ``lane`` up to inner step ``step`` (a stand-in: :func:`train_locally` with seed ``k``)."""
    train_locally(svc, k)
    svc.worker.lane, svc.worker.inner_step = lane, step


async def until(cond, timeout_s: float = 60.0) -> None:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout_s, "condition not reached in time"
        await asyncio.sleep(0.05)


def test_a_spare_takes_the_departed_members_weights_before_its_first_hop_of_the_lane(tmp_path, tmp_home):
    """a trained lane 0 past the merge; the validator hands lane 0 to the spare b (a was unavailable
    for vacate_after_s) while a still answers: b's first trained hop of lane 0 uses a's weights."""
    async def main():
        net = Net(tmp_path)
        try:
            a, b, head, tail = await start_pair(net)
            H = net.cfg.merge.every_steps
            train_locally(a, 5)                     # lane 0's steps H .. H + 1 on a
            a.worker.lane, a.worker.inner_step = 0, H + 1
            lane_hash = weights_hash(a.merge.params.read())
            assert weights_hash(b.merge.params.read()) != lane_hash          # b holds the merged weights only
            seen = record_training_forwards(b)
            ack = await send_forward(net, b, head, lane_ticket(net, b, head, tail, lane=0, step=H + 1))
            await until(lambda: seen)
            return ack, seen, lane_hash, getattr(b.worker, "lane", None), b.worker.inner_step, H, b.node.plane.counts
        finally:
            await net.close()
    ack, seen, lane_hash, lane, step, H, counts = asyncio.run(main())
    assert ack.status == "accepted"                  # not refused: nobody is charged for the wait
    assert seen[0] == lane_hash, "the spare's first hop of the lane was computed with weights other than the lane's"
    assert (lane, step) == (0, H + 1) and counts["lanes_taken"] == 1 and counts["parked_for_lane"] == 1


def test_with_the_departed_member_gone_the_spare_takes_the_stages_merged_state(tmp_path, tmp_home):
    """b trained lane 1 since the merge; lane 0's member a is gone (stopped): b's first trained hop of
    lane 0 uses the stage's latest merged state (lane 0's steps on a since the merge are lost), not
    lane 1's weights."""
    async def main():
        net = Net(tmp_path)
        try:
            a, b, head, tail = await start_pair(net)
            H = net.cfg.merge.every_steps
            train_lane(a, 5, lane=0, step=H + 1)
            train_lane(b, 6, lane=1, step=H + 1)   # lane 1's step H on b
            await a.stop()
            merged_hash = weights_hash(b.merge.anchor)
            assert weights_hash(b.merge.params.read()) != merged_hash
            seen = record_training_forwards(b)
            ack = await send_forward(net, b, head, lane_ticket(net, b, head, tail, lane=0, step=H + 1))
            await until(lambda: seen)
            return ack, seen, merged_hash, getattr(b.worker, "lane", None)
        finally:
            await net.close()
    ack, seen, merged_hash, lane = asyncio.run(main())
    assert ack.status == "accepted"
    assert seen[0] == merged_hash, "the spare trained lane 0 with lane 1's weights"
    assert lane == 0


def test_a_head_handed_another_lane_keeps_its_tickets_queued_until_it_holds_the_lanes_weights():
    """The head's side (a real stage-0 StageWorker behind a real DataPlaneNode on the in-process
    data-plane transport, the next stage a recorder):
    a head that trained lane 1 gets lane 0's tickets; it starts no forward of lane 0 before its
    ``take_lane`` has set the lane's weights, then trains lane 0 from the lane's step."""
    from iota_subnet.config import load_config
    from iota_subnet.miner.dataplane import DataPlaneTunables
    from iota_subnet.miner.dataplane.transport import InProcessDataPlaneTransport
    from iota_subnet.miner.stage_worker import StageWorker
    from support.dataplane_net import OVR
    from support.inprocess_dataplane import HopRecorder, ReceiptInbox, inprocess_node, keypair, neurons

    keys = {n: keypair(f"handover-{n}") for n in ("head", "s1", "s2", "vali")}
    HEAD, S1, S2, VALI = (keys[n].ss58_address for n in ("head", "s1", "s2", "vali"))

    async def main():
        cfg = load_config("configs/tiny.yaml", OVR)
        worker = StageWorker(cfg, 0, seed=0, total_steps=20)
        worker.lane, worker.inner_step = 1, 3                 # it trained lane 1 up to step 3
        lane_weights = {k: v + 0.5 for k, v in worker.module.state_dict().items()}
        net = InProcessDataPlaneTransport()
        nxt, _ = HopRecorder(net, S1), ReceiptInbox(net, VALI)
        forwards, released, hashes = nxt.forwards, asyncio.Event(), []

        async def take_lane(t):
            await released.wait()
            with worker.lock:
                worker.module.load_state_dict(lane_weights)
                worker.weights_replaced()
                worker.inner_step, worker.lane = t.step, t.lane
            return "test holder"

        def rows(split, seed, start, n):
            g = torch.Generator().manual_seed(seed * 1000 + start)
            return torch.randint(0, cfg.model.vocab_size, (n, cfg.data.seq_len + 1), generator=g)
        compute = worker.compute_forward

        def recorded(mb_id, x, targets=None, *, train=True, accumulate=True):
            if train and accumulate:
                hashes.append(weights_hash(torch.cat([p.detach().reshape(-1) for p in worker.module.parameters()])))
            return compute(mb_id, x, targets, train=train, accumulate=accumulate)
        worker.compute_forward = recorded
        node = inprocess_node(net, worker, keys["head"], cfg, run_id="head-test", stage=0,
                              metagraph=neurons([VALI], [HEAD, S1, S2]), rows=rows, take_lane=take_lane,
                              tunables=DataPlaneTunables(receipt_interval_s=0.05))
        node.start()
        dp = node.plane
        try:
            now = time.time()
            tickets = [Ticket(run_id="head-test", validator=VALI, lane=0, step=5, index=i, microbatch_id=f"l0-k5-m{i}",
                              split="train", seed=1, start=20 + 2 * i, rows=cfg.train.micro_batch,
                              seq_len=cfg.data.seq_len, width=64, wire_dtype="bf16", train=True, micro_per_step=2,
                              route=(HEAD, S1, S2), issued_at=now, deadline=now + 3600) for i in range(2)]
            dp.accept_tickets(tickets, base_steps={0: 5})
            await asyncio.sleep(1.5)
            waited = (len(forwards), len(dp.tickets), worker.inner_step, worker.lane)
            released.set()
            await until(lambda: len(forwards) == 2, 30)
            want = weights_hash(torch.cat([lane_weights[k].reshape(-1) for k, _ in worker.module.named_parameters()]))
            return waited, hashes, want, worker.lane, dp.counts["lanes_taken"]
        finally:
            await dp.stop()
    waited, hashes, want, lane, taken = asyncio.run(main())
    assert waited == (0, 2, 3, 1), waited          # nothing started, nothing skipped, before the weights are in
    assert hashes == [want, want] and lane == 0 and taken == 1


def test_a_holder_state_that_does_not_fit_the_stage_is_not_taken():
    """Checked before anything is loaded: another name set, shape or dtype, or a non-finite value."""
    import torch

    from iota_subnet.miner.lane_handover import state_mismatch
    own = {"w": torch.zeros(2, 3), "b": torch.zeros(3)}
    assert state_mismatch(own, {"w": torch.ones(2, 3), "b": torch.ones(3)}) == ""
    assert "names" in state_mismatch(own, {"w": torch.ones(2, 3)})
    assert "shape" in state_mismatch(own, {"w": torch.ones(3, 2), "b": torch.ones(3)})
    assert "shape" in state_mismatch(own, {"w": torch.ones(2, 3, dtype=torch.float64), "b": torch.ones(3)})
    assert "non-finite" in state_mismatch(own, {"w": torch.full((2, 3), float("nan")), "b": torch.ones(3)})
    assert "names" in state_mismatch(own, None)


def test_a_spare_never_takes_a_barred_members_weights(tmp_path, tmp_home):
    """Lane 0's member a was barred as a cheater and still answers that it trained lane 0: the
    validator's ticket names it in ``not_from``, so the spare b takes the stage's merged state, not
    a's weights (before, b copied whatever the barred miner served)."""
    async def main():
        net = Net(tmp_path)
        try:
            a, b, head, tail = await start_pair(net)
            H = net.cfg.merge.every_steps
            train_lane(a, 5, lane=0, step=H + 1)
            barred_hash = weights_hash(a.merge.params.read())
            merged_hash = weights_hash(b.merge.anchor)
            seen = record_training_forwards(b)
            ack = await send_forward(net, b, head, lane_ticket(net, b, head, tail, lane=0, step=H + 1,
                                                               not_from=[a.hotkey]))
            await until(lambda: seen)
            return ack, seen, barred_hash, merged_hash
        finally:
            await net.close()
    ack, seen, barred_hash, merged_hash = asyncio.run(main())
    assert ack.status == "accepted"
    assert seen[0] != barred_hash, "the spare took the barred member's weights"
    assert seen[0] == merged_hash
