"""The miner-to-miner data plane. End to end over HTTP: real MinerServices and a real ValidatorService
(p2p) on a devnet, real text; the validator issues tickets and reads receipts, the tensors go miner to
miner. Hop level in process (:mod:`support.inprocess_net`): real StageWorkers behind real DataPlaneNodes
and the validator's real ControlPlane on the in-process transports (wire codec and the same route
handlers as over HTTP, no sockets), real text."""
from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest
import torch

from iota_subnet.config import bottleneck_dims
from iota_subnet.protocol import Hop, HopAck, Outcome, ProtocolError, Ticket, TicketAck, TicketBatch, to_wire
from support.dataplane_net import RUN, P2PNet, run
from support.inprocess_dataplane import ReceiptInbox, keypair
from support.inprocess_net import InProcessNet

pytestmark = pytest.mark.timeout(300)


def test_p2p_lanes_train_and_the_validator_carries_no_tensors(tmp_home, tmp_path, wikitext_path, cache_dir):
    async def main():
        net = P2PNet(tmp_path, wikitext_path, cache_dir)
        await net.start()
        try:
            vali = net.validator(steps=4)
            assert await vali.run() == 0
            st = net.status()
            assert st["done"] and st["steps_done"] == {"0": 4, "1": 4}, st
            assert st["val_loss"] is not None and st["microbatches_failed"] == 0
            for (s, r), m in net.miners.items():
                assert m.worker.inner_step == 4, ((s, r), m.worker.inner_step)
                c = m.node.plane.counts
                assert c["steps"] == 4 and c["forwards"] >= 8
            # the validator's only HTTP traffic: tickets and health probes out, receipts in; no hop route
            server_routes = set(vali.client.stats())   # noqa: F841
            assert vali.endpoints.server is None        # closed after the run
            assert st["validator_bytes"] > 0
            hop_bytes = sum(m.node.transport.hop_client.bytes_sent for m in net.miners.values())
            assert hop_bytes > 20 * st["validator_bytes"] / 10, (hop_bytes, st["validator_bytes"])
        finally:
            await net.close()

    run(main())


# ---------------------------------------------------------------------------------------------- in process
def ticket(net: InProcessNet, lane=0, step=0, index=0, *, signer=None, route=None, attempt=0, mb_id=None,
           **kw) -> Ticket:
    """A training ticket for lane ``lane``'s route, signed by ``signer`` (a keypair; default: the validator)."""
    signer = signer or net.vali
    cfg = net.cfg
    route = route or [net.hotkey(s, lane) for s in range(net.stages)]
    now = time.time()
    t = Ticket(run_id=RUN, validator=signer.ss58_address, lane=lane, step=step, index=index,
               microbatch_id=mb_id or f"t-l{lane}-k{step}-m{index}-a{attempt}", split="train", seed=0,
               start=(step * 2 + index) * 2, rows=cfg.train.micro_batch, seq_len=cfg.data.seq_len,
               width=bottleneck_dims(cfg.model, cfg.pipeline)[0], wire_dtype="bf16", train=True, micro_per_step=2,
               route=tuple(route), alternates=(), trains=(), attempt=attempt, issued_at=now, deadline=now + 60)
    return replace(t, **kw).signed(signer)


async def until(cond, timeout: float = 30.0) -> None:
    """Wait for ``cond()`` (polling; the machine may be slow)."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


async def refused(coro, outcome: Outcome) -> ProtocolError:
    try:
        await coro
    except ProtocolError as e:
        assert e.outcome == outcome, (e.outcome, e.message)
        assert 400 <= e.status < 500
        return e
    raise AssertionError(f"expected a {outcome.value} refusal")


def test_bad_tickets_are_refused_typed_and_nothing_is_trained(wikitext_path, cache_dir):
    async def main():
        net = InProcessNet(wikitext_path, cache_dir, replicas=1)
        net.start()
        ReceiptInbox(net.net, net.vali.ss58_address)
        head, hk = net.nodes[(0, 0)], net.hotkey(0, 0)
        stranger = keypair("inproc-stranger")
        try:
            async def send(t, via=net.vali.ss58_address, **kw):
                return await net.net.view(via).call(hk, "/tickets", TicketBatch(run_id=RUN, stage=0, tickets=[
                    t if isinstance(t, dict) else t.to_json()], **kw), TicketAck)

            good = ticket(net)
            forged = good.to_json()
            forged["start"] = 999                                       # changed after signing
            await refused(send(forged), Outcome.BAD_TICKET)
            await refused(send(ticket(net, deadline=time.time() - 1)), Outcome.TICKET_EXPIRED)
            await refused(send(ticket(net, run_id="other-run")), Outcome.FORBIDDEN)
            await refused(send(ticket(net, seq_len=net.cfg.data.seq_len * 2)), Outcome.BAD_SHAPE)
            await refused(send(ticket(net, width=7)), Outcome.BAD_SHAPE)
            bad_route = [stranger.ss58_address if s == 1 else h for s, h in enumerate(good.route)]
            await refused(send(ticket(net, route=bad_route)), Outcome.BAD_TICKET)
            # Delivered by a miner: over signed HTTP the miner's authorizer refuses a caller without a
            # validator permit on /tickets first (FORBIDDEN, tests/test_miner_service.py); in process there is
            # no authorizer and the route's own ticket check refuses it. Signed by a registered miner (no
            # validator permit), delivered by it:
            await refused(send(ticket(net, signer=net.keys[(1, 0)]), via=net.hotkey(1, 0)), Outcome.BAD_TICKET)
            # a validator's ticket delivered by someone else
            await refused(send(good, via=net.hotkey(1, 0)), Outcome.NOT_ON_ROUTE)
            await refused(send({"run_id": RUN, "junk": 1}), Outcome.MALFORMED)
            await asyncio.sleep(0.3)
            assert all(w.forwards == 0 and w.inner_step == 0 for w in net.workers.values())
            # the miner keeps serving: the good ticket runs the micro-batch through all three stages
            ack = await send(good)
            assert ack.accepted == 1 and not ack.refused
            await until(lambda: head.plane.counts["backwards"] == 1)
            assert net.workers[(2, 0)].forwards == 1 and net.workers[(0, 0)].backwards == 1
            # an fp8 ticket: activations and gradients cross both boundaries through the wire codec as
            # float8 e4m3fn with a float32 scale per token, and the micro-batch completes as the bf16 one did
            t8 = ticket(net, index=1, wire_dtype="fp8")
            assert (await send(t8)).accepted == 1
            await until(lambda: head.plane.counts["backwards"] == 2)
            assert net.workers[(2, 0)].forwards == 2 and net.workers[(0, 0)].backwards == 2
            rec = net.nodes[(1, 0)].plane.hops.hop(t8.microbatch_id)   # as the middle miner's audits keep it
            assert rec.wire_format == "fp8"
            for name in ("wire.x", "wire.z", "wire.dz", "wire.dx"):
                q, s = rec.wire[name]
                assert q.dtype == torch.float8_e4m3fn and s.shape == q.shape[:2], name
        finally:
            await net.close()

    run(main())


def test_hops_only_from_the_ticket_route_and_a_retried_tail_forward_is_applied_once(wikitext_path, cache_dir):
    async def main():
        net = InProcessNet(wikitext_path, cache_dir, replicas=2)
        net.start()
        tail, tail_w, mid_w = net.nodes[(2, 0)], net.workers[(2, 0)], net.workers[(1, 0)]
        sender_ok = net.net.view(net.hotkey(1, 0))      # lane 0's stage-1 miner: the named sender
        sender_bad = net.net.view(net.hotkey(1, 1))     # a stage-1 miner the ticket does not name
        try:
            t = ticket(net)
            x = torch.randn(2, net.cfg.data.seq_len, bottleneck_dims(net.cfg.model, net.cfg.pipeline)[0])
            data, _ = to_wire(x, "bf16")
            path = [net.hotkey(s, 0) for s in range(2)]

            def hop(t, **kw):
                base = dict(run_id=RUN, stage=2, microbatch_id=t.microbatch_id, ticket=t.to_json(),
                            direction="forward", path=path, data=data)
                base.update(kw)
                return Hop(**base)

            async def post(h, via=sender_ok) -> HopAck:
                return await via.send_hop(net.hotkey(2, 0), h)

            await refused(post(hop(t), via=sender_bad), Outcome.NOT_ON_ROUTE)
            await refused(post(hop(t, path=path[:1])), Outcome.NOT_ON_ROUTE)
            await refused(post(hop(t, data=x.float())), Outcome.BAD_DTYPE)
            await refused(post(hop(t, data=data[:, :8].contiguous())), Outcome.BAD_SHAPE)
            await refused(post(hop(t, data=torch.full_like(data, float("nan")))), Outcome.NON_FINITE)
            await refused(post(hop(t, stage=1)), Outcome.NOT_ON_ROUTE)
            # a ticket issued by a miner (no validator permit), on an otherwise well-formed hop
            await refused(post(hop(ticket(net, signer=net.keys[(0, 0)]))), Outcome.BAD_TICKET)
            assert tail_w.forwards == 0
            # the same hop twice (a sender's retry after a lost answer): trained once
            counts = tail.plane.counts
            first = await post(hop(t))
            again = await post(hop(t))
            assert (first.status, again.status) == ("accepted", "duplicate")
            await until(lambda: counts["forwards"] == 1)
            await asyncio.sleep(0.3)
            assert tail_w.forwards == 1 and tail_w.pending == 1
            # a re-issued attempt of the same (lane, step, index): computed, not accumulated again
            t2 = ticket(net, attempt=1)
            assert (await post(hop(t2))).status == "accepted"
            await until(lambda: counts["forwards"] == 2)
            assert tail_w.forwards == 2 and tail_w.pending == 1
            # index 1 of the step completes it: the tail takes exactly one inner step
            assert (await post(hop(ticket(net, index=1)))).status == "accepted"
            await until(lambda: counts["steps"] == 1)
            assert tail_w.inner_step == 1 and tail_w.pending == 0
            assert mid_w.forwards == 0
        finally:
            await net.close()

    run(main())


def test_a_killed_middle_miner_is_routed_around_and_no_replica_runs_ahead(wikitext_path, cache_dir):
    steps = 8

    async def main():
        net = InProcessNet(wikitext_path, cache_dir, replicas=2)
        net.start()
        victim = net.workers[(1, 0)]
        try:
            cp = net.control(stall_s=4.0)
            done: dict[int, list] = {0: [], 1: []}
            task = asyncio.create_task(cp.run({0: 0, 1: 0}, steps, on_step=lambda res, _: done[res.lane].append(res)))
            await until(lambda: victim.inner_step >= 2, timeout=120)
            net.net.kill(net.hotkey(1, 0))          # lane 0's stage-1 miner goes away mid-run
            assert await asyncio.wait_for(task, 200) == {0: steps, 1: steps}
            for lane, results in done.items():      # every lane step of both lanes completed, in order
                assert [r.step for r in results] == list(range(steps)), (lane, [r.step for r in results])
                assert all(r.ok_count == len(r.microbatches) == 2 for r in results), lane
            assert cp.reroutes > 0 and cp.microbatches_ok >= 2 * 2 * steps
            for k, w in net.workers.items():
                if w is victim:
                    continue
                # every live miner, the replacement that also served lane 0 included, is exactly at its
                # lane's step: nobody trained on another lane's micro-batches or ran ahead
                assert w.inner_step == steps, (k, w.inner_step)
            alt = net.nodes[(1, 1)].plane.counts
            assert alt["forwards"] > 2 * steps            # it served lane 0's hops as well as its own
            assert victim.inner_step < steps
        finally:
            await net.close()

    run(main())
