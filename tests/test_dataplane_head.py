"""The head's scheduler when its lane completed steps through another head (found in the churn
benchmark, 2026-12-02): a head held forwards of lane step 1 whose backward never came (the validator
had re-issued them through another head after a partition here, and counted them done there), so it
never took inner step 1 and left every later ticket of its lane queued: the lane stalled until the
tickets' deadline (80 minutes), while the other lanes went on.

A real stage-0 ``StageWorker`` behind a real ``DataPlaneNode`` on the in-process data-plane transport;
the next stage is a recorder that accepts forwards and sends back, through the head's real ``/hop``
route (ticket check, hop contract), only the backwards the test decides."""
from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
import torch

from iota_subnet.config import bottleneck_dims, load_config
from iota_subnet.miner.dataplane import DataPlaneTunables
from iota_subnet.miner.dataplane.admission import STAND_IN_HOLD_S
from iota_subnet.miner.dataplane.transport import InProcessDataPlaneTransport
from iota_subnet.miner.stage_worker import StageWorker
from iota_subnet.protocol import Hop
from iota_subnet.protocol.ticket import Ticket
from iota_subnet.protocol.wire import from_wire, to_wire
from support.dataplane_net import OVR
from support.inprocess_dataplane import HopRecorder, ReceiptInbox, inprocess_node, keypair, neurons

pytestmark = pytest.mark.timeout(120)

KEYS = {n: keypair(f"head-test-{n}") for n in ("head", "s1", "s2", "vali")}
HEAD, S1, S2, VALI = (KEYS[n].ss58_address for n in ("head", "s1", "s2", "vali"))


def ticket(cfg, step: int, index: int, attempt: int = 0, *, head: str = HEAD, **kw) -> Ticket:
    """A training ticket of lane 0 signed by the validator (``kw``: other fields, before signing)."""
    now = time.time()
    t = Ticket(run_id="head-test", validator=VALI, lane=0, step=step, index=index,
               microbatch_id=f"l0-k{step}-m{index}-a{attempt}", split="train", seed=1, start=4 * step + 2 * index,
               rows=cfg.train.micro_batch, seq_len=cfg.data.seq_len, width=bottleneck_dims(cfg.model, cfg.pipeline)[0],
               wire_dtype="bf16", train=True, micro_per_step=2, route=(head, S1, S2), attempt=attempt, issued_at=now,
               deadline=now + 3600)
    return dataclasses.replace(t, **kw).signed(KEYS["vali"])


async def until(cond, timeout_s=30.0):
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError("timed out")
        await asyncio.sleep(0.02)


async def head_setup():
    cfg = load_config("configs/tiny.yaml", OVR)
    worker = StageWorker(cfg, 0, seed=0, total_steps=20)
    net = InProcessDataPlaneTransport()
    nxt, inbox = HopRecorder(net, S1), ReceiptInbox(net, VALI)

    def rows(split, seed, start, n):
        g = torch.Generator().manual_seed(seed * 1000 + start)
        return torch.randint(0, cfg.model.vocab_size, (n, cfg.data.seq_len + 1), generator=g)

    node = inprocess_node(net, worker, KEYS["head"], cfg, run_id="head-test", stage=0,
                          metagraph=neurons([VALI], [HEAD, S1, S2]), rows=rows,
                          tunables=DataPlaneTunables(receipt_interval_s=0.05))
    node.start()
    return cfg, worker, node.plane, nxt, inbox.receipts


def backward_for(fwd: Hop) -> tuple[Hop, Ticket]:
    """The backward stage 1 would send for ``fwd`` (a small random activation gradient)."""
    t = Ticket.from_json(fwd.ticket)
    g = torch.randn(from_wire(fwd.data, fwd.scales).shape) * 1e-3
    data, scales = to_wire(g, t.wire_dtype)
    return Hop(run_id=fwd.run_id, stage=0, microbatch_id=fwd.microbatch_id, ticket=fwd.ticket, direction="backward",
               path=[HEAD], data=data, scales=scales, info={"loss": 5.0}), t


async def send_back(nxt: HopRecorder, fwd: Hop) -> None:
    """Stage 1 sends the head the backward of ``fwd``; the head's /hop route accepts it."""
    hop, _ = backward_for(fwd)
    assert (await nxt.send_back(HEAD, hop)).status == "accepted"


def test_a_head_whose_lane_completed_a_step_elsewhere_drops_its_forwards_and_goes_on():
    """Lane step 0 done here; both forwards of step 1 never get their backward (completed through another
    head). Tickets of step 2 saying steps < 2 are complete: the head drops the two forwards and starts
    step 2 at once (the old code waited for the tickets' deadline)."""
    async def main():
        cfg, worker, dp, nxt, receipts = await head_setup()
        try:
            dp.accept_tickets([ticket(cfg, 0, 0), ticket(cfg, 0, 1)], base_steps={0: 0})
            await until(lambda: len(nxt.forwards) == 2)
            for fwd in nxt.forwards[:2]:
                await send_back(nxt, fwd)
            await until(lambda: worker.inner_step == 1)
            dp.accept_tickets([ticket(cfg, 1, 0), ticket(cfg, 1, 1)], base_steps={0: 1})
            await until(lambda: len(nxt.forwards) == 4)
            assert len(dp.pending) == 2 and dp.steps.busy(0, 1)
            # the validator re-issued step 1 through another head and counted it done there
            dp.accept_tickets([ticket(cfg, 2, 0), ticket(cfg, 2, 1)], base_steps={0: 2})
            await until(lambda: len(nxt.forwards) == 6, timeout_s=10.0)
            assert [Ticket.from_json(h.ticket).step for h in nxt.forwards[4:]] == [2, 2]
            assert worker.inner_step == 2 and dp.counts["settled"] == 2
            assert {p.ticket.step for p in dp.pending.values()} == {2}
        finally:
            await dp.stop()
    asyncio.run(main())


def test_what_a_head_accumulated_of_a_step_completed_elsewhere_is_applied_not_dropped():
    """Of step 1, micro-batch 0 came back here (accumulated), micro-batch 1 went through another head.
    Tickets of step 2 (steps < 2 complete): the head takes inner step 1 with the gradient it holds (the
    weights change), then starts step 2."""
    async def main():
        cfg, worker, dp, nxt, receipts = await head_setup()
        try:
            worker.skip_to(1)
            dp.accept_tickets([ticket(cfg, 1, 0), ticket(cfg, 1, 1)], base_steps={0: 1})
            await until(lambda: len(nxt.forwards) == 2)
            await send_back(nxt, nxt.forwards[0])
            await until(lambda: dp.steps.done.get((0, 1)) == {0})
            before = [p.detach().clone() for p in worker.module.parameters()]
            dp.accept_tickets([ticket(cfg, 2, 0), ticket(cfg, 2, 1)], base_steps={0: 2})
            await until(lambda: len(nxt.forwards) == 4, timeout_s=10.0)
            assert worker.inner_step == 2 and dp.counts["steps"] == 1 and dp.counts["settled"] == 1
            assert any(not torch.equal(a, b.detach()) for a, b in zip(before, worker.module.parameters()))
        finally:
            await dp.stop()
    asyncio.run(main())


def test_a_restarted_validators_ticket_replaces_the_one_its_previous_process_queued():
    """Chaos run, 2026-12-02: after every validator restart the head refused the new process's tickets
    for the look-ahead steps as DUPLICATE of those the old process had queued (whose receipts would go
    to nobody): 10-20 s lost per step until re-issued as a higher attempt."""
    async def main():
        cfg, worker, dp, nxt, receipts = await head_setup()
        try:
            dp.accept_tickets([ticket(cfg, 0, 0), ticket(cfg, 0, 1), ticket(cfg, 1, 0)], base_steps={0: 0})
            await until(lambda: len(nxt.forwards) == 2)          # step 0 started; step 1 queued
            queued = dp.tickets[(0, 1, 0)]
            again = dataclasses.replace(queued, microbatch_id="restarted-l0-k1-m0-a0", issued_at=queued.issued_at + 5)
            stale = dataclasses.replace(queued, microbatch_id="older-l0-k1-m0-a0", issued_at=queued.issued_at - 5)
            other = dataclasses.replace(queued, microbatch_id="other-l0-k1-m0-a0", validator="5OtherVali",
                                        issued_at=queued.issued_at + 9)
            return dp.accept_tickets([again]), dp.accept_tickets([stale]), dp.accept_tickets([other]), dp.tickets[(0, 1, 0)]
        finally:
            await dp.stop()
    again, stale, other, now = asyncio.run(main())
    assert again == (1, []) and now.microbatch_id == "restarted-l0-k1-m0-a0"
    assert stale[0] == 0 and stale[1][0]["outcome"] == "DUPLICATE"        # an older one does not
    assert other[0] == 0 and other[1][0]["outcome"] == "DUPLICATE"        # nor another validator's


def test_a_stand_in_head_runs_a_lanes_steps_one_after_the_other():
    """Chaos run (2026-12-02): the lane's own head was killed, so the validator sent the lane's
    look-ahead tickets (steps 0-3) to a stand-in head, which does not train on them; it ran them all
    at once, the later stages' lane members received step 3 while step 0 was in flight, skipped their
    inner steps to it and lost the micro-batches of the steps between. A stand-in head keeps the
    lane's order: step k starts when its forwards of step k - 1 came back, or when the validator
    says the earlier steps are complete."""
    async def main():
        cfg, worker, dp, nxt, receipts = await head_setup()
        try:
            stand_in = [ticket(cfg, k, m, trains=(False, True, True)) for k in range(4) for m in range(2)]
            dp.accept_tickets(stand_in, base_steps={0: 0})
            await until(lambda: len(nxt.forwards) >= 2)
            await asyncio.sleep(0.5)
            sent = [Ticket.from_json(h.ticket).step for h in nxt.forwards]
            assert sent == [0, 0], sent                                   # step 1 waits for step 0's backwards
            for fwd in nxt.forwards[:2]:
                await send_back(nxt, fwd)
            await until(lambda: len(nxt.forwards) == 4)
            await asyncio.sleep(0.3)
            assert [Ticket.from_json(h.ticket).step for h in nxt.forwards] == [0, 0, 1, 1]
            assert worker.inner_step == 0                                 # a stand-in does not train
            # step 1 went through another head: the validator's next batch says steps < 3 are complete;
            # the queued tickets of step 2, and one of step 1 in that very batch, never run
            late = ticket(cfg, 1, 1, attempt=1, trains=(False, True, True))
            dp.accept_tickets([late, ticket(cfg, 4, 0, trains=(False, True, True))], base_steps={0: 3})
            await until(lambda: len(nxt.forwards) >= 6)
            await asyncio.sleep(0.3)
            assert [Ticket.from_json(h.ticket).step for h in nxt.forwards[4:]] == [3, 3]
            await until(lambda: sum(r["status"] == "stale" for r in receipts) == 3)
            stale = sorted((r["step"], r["index"]) for r in receipts if r["status"] == "stale")
            assert stale == [(1, 1), (2, 0), (2, 1)]
            assert not dp.pending.keys() & {"l0-k1-m0-a0", "l0-k1-m1-a0"}     # step 1's forwards dropped too
            # a step-3 backward that never comes holds step 4 only for STAND_IN_HOLD_S
            for p in dp.pending.values():
                p.started -= STAND_IN_HOLD_S + 1
            dp._wake.set()
            await until(lambda: len(nxt.forwards) == 7)
            assert Ticket.from_json(nxt.forwards[6].ticket).step == 4
        finally:
            await dp.stop()
    asyncio.run(main())
