"""The in-process data-plane transport refuses a hop exactly as a miner's HTTP server does: one real
stage-1 DataPlaneNode serves its routes both on a signed NeuronServer (127.0.0.1) and on an
InProcessDataPlaneTransport; every bad hop gets the same Outcome through both, and none is computed."""
from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest
import torch

from iota_subnet.config import bottleneck_dims, load_config
from iota_subnet.miner.dataplane.transport import InProcessDataPlaneTransport
from iota_subnet.miner.dataplane_http import DataPlaneNode, NodeLinks
from iota_subnet.miner.stage_worker import StageWorker
from iota_subnet.miner.tickets import TicketShape
from iota_subnet.protocol import Hop, HopAck, Outcome, ProtocolError, Ticket, to_wire
from iota_subnet.transport import NeuronClient, NeuronServer
from iota_subnet.wallets import create_wallet
from support.dataplane_net import OVR
from support.inprocess_dataplane import neurons

pytestmark = pytest.mark.timeout(120)

RUN = "transport-test"


async def _nothing() -> None:
    return None


async def _outcome(coro) -> Outcome:
    try:
        await coro
    except ProtocolError as e:
        return e.outcome
    raise AssertionError("the hop was accepted")


def test_a_hop_refused_in_process_gets_the_same_outcome_as_over_http(tmp_path):
    cfg = load_config("configs/tiny.yaml", OVR)
    b, _ = bottleneck_dims(cfg.model, cfg.pipeline)
    w = {n: create_wallet(n, "default", tmp_path / "w") for n in ("head", "mid", "tail", "vali")}
    hk = {n: x.hotkey.ss58_address for n, x in w.items()}
    worker = StageWorker(cfg, 1, seed=0, total_steps=20)

    def ticket(signer="vali", **kw) -> Ticket:
        now = time.time()
        t = Ticket(run_id=RUN, validator=hk[signer], lane=0, step=0, index=0, microbatch_id="l0-k0-m0-a0",
                   split="train", seed=0, start=0, rows=cfg.train.micro_batch, seq_len=cfg.data.seq_len, width=b,
                   wire_dtype="bf16", train=True, micro_per_step=2, route=(hk["head"], hk["mid"], hk["tail"]),
                   issued_at=now, deadline=now + 60)
        return replace(t, **kw).signed(w[signer])

    good = ticket()
    data, _ = to_wire(torch.randn(cfg.train.micro_batch, cfg.data.seq_len, b), "bf16")
    forged = good.to_json()
    forged["start"] = 999                                          # changed after signing
    fp8_ticket = ticket(wire_dtype="fp8").to_json()
    q, s = to_wire(torch.randn(cfg.train.micro_batch, cfg.data.seq_len, b), "fp8")
    q_nan = q.clone()
    q_nan.view(torch.uint8)[0, 0, 0] = 0x7F                        # e4m3fn's NaN (it has no inf)

    def hop(**kw) -> Hop:
        base = dict(run_id=RUN, stage=1, microbatch_id=good.microbatch_id, ticket=good.to_json(), direction="forward",
                    path=[hk["head"]], data=data)
        base.update(kw)
        return Hop(**base)

    cases = [  # (sender, hop, the outcome both transports must give)
        ("head", hop(ticket=forged), Outcome.BAD_TICKET),          # first: before the good signature is cached
        ("head", hop(data=data[:, :8].contiguous()), Outcome.BAD_SHAPE),
        ("head", hop(data=torch.full_like(data, float("nan"))), Outcome.NON_FINITE),
        ("head", hop(data=data.float()), Outcome.BAD_DTYPE),
        ("head", hop(ticket=ticket(signer="head").to_json()), Outcome.BAD_TICKET),    # no validator permit
        ("head", hop(ticket=ticket(deadline=time.time() - 1).to_json()), Outcome.TICKET_EXPIRED),
        ("tail", hop(), Outcome.NOT_ON_ROUTE),                                         # not the stage-0 sender
        ("head", hop(stage=2), Outcome.NOT_ON_ROUTE),
        ("head", hop(info={"root": "0" * 64}), Outcome.HASH_MISMATCH),
        # an fp8 ticket: the data travels with float32 per-token scales that fit it
        ("head", hop(ticket=fp8_ticket, data=q), Outcome.MALFORMED),                          # no scales
        ("head", hop(ticket=fp8_ticket, data=q, scales=s[:1].contiguous()), Outcome.MALFORMED),   # other shape
        ("head", hop(ticket=fp8_ticket, data=q, scales=-s), Outcome.MALFORMED),               # negative
        ("head", hop(ticket=fp8_ticket, data=q, scales=torch.full_like(s, float("inf"))), Outcome.NON_FINITE),
        ("head", hop(ticket=fp8_ticket, data=q_nan, scales=s), Outcome.NON_FINITE),
        ("head", hop(data=q, scales=s), Outcome.BAD_DTYPE),                                   # on a bf16 ticket
        ("head", hop(ticket=fp8_ticket, data=data, scales=s), Outcome.BAD_DTYPE),
        ("head", hop(data=data, scales=s), Outcome.MALFORMED),                                # bf16 with scales
    ]

    async def main():
        metagraph = neurons([hk["vali"]], [hk["head"], hk["mid"], hk["tail"]])
        node = DataPlaneNode(worker, w["mid"], shape=TicketShape.of_run(cfg, run_id=RUN, width=b,
                                                                        max_rows=cfg.train.micro_batch),
                             stage=1, compute=lambda fn: asyncio.to_thread(fn),
                             links=NodeLinks(neurons=lambda: metagraph, endpoint_of=lambda h: None, refresh=_nothing))
        server = NeuronServer(w["mid"], "127.0.0.1", 0, None, tmp_path / "nonces.sqlite")
        node.mount(server)                                          # HTTP (the default transport)
        port = await server.start()
        net = InProcessDataPlaneTransport()
        net.register(hk["mid"], node.routes())                      # the same node's routes, in process
        clients = {n: NeuronClient(w[n]) for n in ("head", "tail")}
        try:
            got = []
            for sender, h, want in cases:
                over_http = await _outcome(clients[sender].call(f"127.0.0.1:{port}", hk["mid"], "/hop", h, HopAck,
                                                                retries=0))
                in_process = await _outcome(net.view(hk[sender]).send_hop(hk["mid"], h))
                got.append((over_http, in_process, want))
            return got, node.plane.counts["forwards"]
        finally:
            for c in clients.values():
                await c.close()
            await node.transport.close()
            await server.stop()

    got, forwards = asyncio.run(main())
    assert all(http == inproc == want for http, inproc, want in got), got
    assert forwards == 0 and worker.forwards == 0
