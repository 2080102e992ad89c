"""The miner-to-miner data plane end to end: real MinerServices and a real ValidatorService (p2p) on a
devnet, real text. The validator issues tickets and reads receipts; the tensors go miner to miner."""
from __future__ import annotations

import pytest

from support.dataplane_net import P2PNet, run

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


# ---------------------------------------------------------------------------------------------- helpers
import asyncio  # noqa: E402
import time  # noqa: E402
from dataclasses import replace  # noqa: E402

import torch  # noqa: E402

from iota_subnet.protocol import Hop, HopAck, Outcome, ProtocolError, Ticket, TicketAck, TicketBatch, to_wire  # noqa: E402
from iota_subnet.transport import NeuronClient  # noqa: E402
from iota_subnet.wallets import create_wallet  # noqa: E402

from support.dataplane_net import RUN  # noqa: E402


def ticket(net, lane=0, step=0, index=0, *, signer=None, route=None, attempt=0, mb_id=None, **kw) -> Ticket:
    """A training ticket for lane 0's route, signed by ``signer`` (default: the validator wallet)."""
    signer = signer or net.vals[0]
    cfg = net.cfg
    route = route or [net.miner_wallets[(s, lane)].hotkey.ss58_address for s in range(net.stages)]
    now = time.time()
    t = Ticket(run_id=RUN, validator=signer.hotkey.ss58_address, lane=lane, step=step, index=index,
               microbatch_id=mb_id or f"t-l{lane}-k{step}-m{index}-a{attempt}", split="train", seed=0,
               start=(step * 2 + index) * 2, rows=cfg.train.micro_batch, seq_len=cfg.data.seq_len, width=16,
               wire_dtype="bf16", train=True, micro_per_step=2, route=tuple(route), alternates=(),
               trains=(), attempt=attempt, issued_at=now, deadline=now + 60)
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


def test_bad_tickets_are_refused_typed_and_nothing_is_trained(tmp_home, tmp_path, wikitext_path, cache_dir):
    async def main():
        net = P2PNet(tmp_path, wikitext_path, cache_dir, replicas=1)
        await net.start()
        head = net.miners[(0, 0)]
        ep, hk = f"127.0.0.1:{head.port}", head.hotkey
        vali = net.vals[0]
        stranger = create_wallet("stranger", "default", tmp_path / "wallets")
        client = NeuronClient(vali)
        miner_client = NeuronClient(net.miner_wallets[(1, 0)])
        try:
            async def send(t, via=client, **kw):
                return await via.call(ep, hk, "/tickets", TicketBatch(run_id=RUN, stage=0, tickets=[
                    t if isinstance(t, dict) else t.to_json()], **kw), TicketAck, retries=0)

            good = ticket(net)
            forged = good.to_json()
            forged["start"] = 999                                       # changed after signing
            await refused(send(forged), Outcome.BAD_TICKET)
            await refused(send(ticket(net, deadline=time.time() - 1)), Outcome.TICKET_EXPIRED)
            await refused(send(ticket(net, run_id="other-run")), Outcome.FORBIDDEN)
            await refused(send(ticket(net, seq_len=net.cfg.data.seq_len * 2)), Outcome.BAD_SHAPE)
            await refused(send(ticket(net, width=7)), Outcome.BAD_SHAPE)
            bad_route = [stranger.hotkey.ss58_address if s == 1 else h for s, h in enumerate(good.route)]
            await refused(send(ticket(net, route=bad_route)), Outcome.BAD_TICKET)
            # signed by a registered miner (no validator permit), delivered by it
            await refused(send(ticket(net, signer=net.miner_wallets[(1, 0)]), via=miner_client), Outcome.FORBIDDEN)
            # a validator's ticket delivered by someone else
            await refused(send(good, via=miner_client), Outcome.FORBIDDEN)
            await refused(send({"run_id": RUN, "junk": 1}), Outcome.MALFORMED)
            await asyncio.sleep(0.3)
            assert all(m.worker.forwards == 0 and m.worker.inner_step == 0 for m in net.miners.values())
            # the miner keeps serving: the good ticket runs the micro-batch through all three stages
            ack = await send(good)
            assert ack.accepted == 1 and not ack.refused
            await until(lambda: head.node.plane.counts["backwards"] == 1)
            assert net.miners[(2, 0)].worker.forwards == 1 and head.worker.backwards == 1
            # an fp8 ticket: activations and gradients cross both boundaries over HTTP as float8 e4m3fn
            # with a float32 scale per token, and the micro-batch completes as the bf16 one did
            t8 = ticket(net, index=1, wire_dtype="fp8")
            assert (await send(t8)).accepted == 1
            await until(lambda: head.node.plane.counts["backwards"] == 2)
            assert net.miners[(2, 0)].worker.forwards == 2 and head.worker.backwards == 2
            rec = net.miners[(1, 0)].node.plane.hops.hop(t8.microbatch_id)   # as the middle miner's audits keep it
            assert rec.wire_format == "fp8"
            for name in ("wire.x", "wire.z", "wire.dz", "wire.dx"):
                q, s = rec.wire[name]
                assert q.dtype == torch.float8_e4m3fn and s.shape == q.shape[:2], name
        finally:
            await client.close()
            await miner_client.close()
            await net.close()

    run(main())


def test_hops_only_from_the_ticket_route_and_a_retried_tail_forward_is_applied_once(
        tmp_home, tmp_path, wikitext_path, cache_dir):
    async def main():
        net = P2PNet(tmp_path, wikitext_path, cache_dir, replicas=2)
        await net.start()
        tail, mid = net.miners[(2, 0)], net.miners[(1, 0)]
        sender_ok = NeuronClient(net.miner_wallets[(1, 0)])      # lane 0's stage-1 miner: the named sender
        sender_bad = NeuronClient(net.miner_wallets[(1, 1)])     # a stage-1 miner the ticket does not name
        try:
            t = ticket(net)
            x = torch.randn(2, net.cfg.data.seq_len, 16)
            data, _ = to_wire(x, "bf16")
            path = [net.miner_wallets[(s, 0)].hotkey.ss58_address for s in range(2)]

            def hop(t, **kw):
                base = dict(run_id=RUN, stage=2, microbatch_id=t.microbatch_id, ticket=t.to_json(),
                            direction="forward", path=path, data=data)
                base.update(kw)
                return Hop(**base)

            async def post(h, via=sender_ok):
                return await via.call(f"127.0.0.1:{tail.port}", tail.hotkey, "/hop", h, HopAck, retries=0)

            await refused(post(hop(t), via=sender_bad), Outcome.NOT_ON_ROUTE)
            await refused(post(hop(t, path=path[:1])), Outcome.NOT_ON_ROUTE)
            await refused(post(hop(t, data=x.float())), Outcome.BAD_DTYPE)
            await refused(post(hop(t, data=data[:, :8].contiguous())), Outcome.BAD_SHAPE)
            await refused(post(hop(t, data=torch.full_like(data, float("nan")))), Outcome.NON_FINITE)
            await refused(post(hop(t, stage=1)), Outcome.NOT_ON_ROUTE)
            # a ticket issued by a miner (no validator permit), on an otherwise well-formed hop
            await refused(post(hop(ticket(net, signer=net.miner_wallets[(0, 0)]))), Outcome.BAD_TICKET)
            assert tail.worker.forwards == 0
            # the same hop twice (a sender's retry after a lost answer): trained once
            counts = tail.node.plane.counts
            first = await post(hop(t))
            again = await post(hop(t))
            assert (first.status, again.status) == ("accepted", "duplicate")
            await until(lambda: counts["forwards"] == 1)
            await asyncio.sleep(0.3)
            assert tail.worker.forwards == 1 and tail.worker.pending == 1
            # a re-issued attempt of the same (lane, step, index): computed, not accumulated again
            t2 = ticket(net, attempt=1)
            assert (await post(hop(t2))).status == "accepted"
            await until(lambda: counts["forwards"] == 2)
            assert tail.worker.forwards == 2 and tail.worker.pending == 1
            # index 1 of the step completes it: the tail takes exactly one inner step
            assert (await post(hop(ticket(net, index=1)))).status == "accepted"
            await until(lambda: counts["steps"] == 1)
            assert tail.worker.inner_step == 1 and tail.worker.pending == 0
            assert mid.worker.forwards == 0
        finally:
            await sender_ok.close()
            await sender_bad.close()
            await net.close()

    run(main())


def test_a_killed_middle_miner_is_routed_around_and_no_replica_runs_ahead(tmp_home, tmp_path, wikitext_path, cache_dir):
    steps = 8

    async def main():
        net = P2PNet(tmp_path, wikitext_path, cache_dir, replicas=2)
        await net.start(hop_timeout_s=5.0)
        victim = net.miners[(1, 0)]
        try:
            vali = net.validator(steps=steps, stall_s=4.0)
            task = asyncio.create_task(vali.run())
            while victim.worker.inner_step < 2:
                await asyncio.sleep(0.05)
            await victim.stop()                  # lane 0's stage-1 miner goes away mid-run
            assert await asyncio.wait_for(task, 200) == 0
            st = net.status()
            assert st["done"] and st["steps_done"] == {"0": steps, "1": steps}, st
            assert st["reroutes"] > 0
            for (s, r), m in net.miners.items():
                if m is victim:
                    continue
                # every live miner, the replacement that also served lane 0 included, is exactly at its
                # lane's step: nobody trained on another lane's micro-batches or ran ahead
                assert m.worker.inner_step == steps, ((s, r), m.worker.inner_step)
            alt = net.miners[(1, 1)].node.plane.counts
            assert alt["forwards"] > 2 * steps            # it served lane 0's hops as well as its own
            assert victim.worker.inner_step < steps
        finally:
            await net.close()

    run(main())
