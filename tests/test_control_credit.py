"""When the control plane tells the audit policy a miner served a training hop (churn benchmark,
2026-12-02): a hop is credited once the neighbours' receipts are in too, and a neighbour's receipt
may arrive while the miner itself is partitioned. Reported at the credit, the hop read as "it served
just then", which contradicted the unanswered /health probe of an honest partitioned miner, and its
timed-out audits were not excused (it was flagged and merged with weight 0). The hop now counts at
the arrival of the miner's own receipt.

A real :class:`ControlPlane`, :class:`Router` and :class:`Ledger`; the head is a scripted client."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

from bittensor.sp_core import Keypair

from iota_subnet.config import load_config
from iota_subnet.protocol import ReceiptBatch
from iota_subnet.protocol.receipt import Receipt
from iota_subnet.validator.control import ControlOptions, ControlPlane
from iota_subnet.validator.routing import Replica, Router
from iota_subnet.validator.scoring import Ledger
from support.dataplane_net import OVR
from support.control import StuckHead
from support.control import Clock


def test_a_hop_counts_as_served_when_its_own_receipt_arrived_not_when_its_credit_completes():
    cfg = load_config("configs/tiny.yaml", OVR)
    hks = [Keypair.create_from_uri(f"//m{s}").ss58_address for s in range(cfg.pipeline.stages)]
    router = Router(cfg.pipeline.stages)
    router.update({s: [Replica(uid=s + 1, hotkey=hks[s], endpoint=f"127.0.0.1:{9000 + s}", stage=s)]
                   for s in range(cfg.pipeline.stages)})
    clock = Clock()
    hops: list[tuple[tuple[int, str], bool, float]] = []
    cp = ControlPlane(cfg, router=router, client=StuckHead(0), keypair=Keypair.create_from_uri("//v"),
                      dataset=SimpleNamespace(n_val_rows=8), ledger=Ledger([1.0] * cfg.pipeline.stages),
                      opts=ControlOptions(run_id="credit", n_lanes=1, clock=clock,
                                          on_hop=lambda key, ok, at: hops.append((key, ok, at))))
    assert asyncio.run(cp.tickets.issue_step(0, 0))
    fl = next(f for f in cp.flights.values() if f.ticket.index == 0)
    h = [f"{i:064x}" for i in range(1, 8)]
    n = cfg.pipeline.stages

    def receipt(s: int) -> dict:
        return Receipt(id=fl.ticket.microbatch_id, lane=0, step=0, index=0, attempt=0, stage=s, status="ok",
                       fin=h[s], fout=h[s + 1], bin=h[s + 4] if s < n - 1 else "", bout=h[s + 3] if s else "",
                       prev=hks[s - 1] if s else "", next=hks[s + 1] if s < n - 1 else "", t=clock.t).model_dump()

    cp.on_receipts(ReceiptBatch(run_id="credit", receipts=[receipt(1)]), hks[1])       # stage 1 reports ...
    served_at = clock.t
    clock.t += 30.0                                                                     # ... then is cut off;
    for s in (0, 2):                                                                    # its neighbours report
        cp.on_receipts(ReceiptBatch(run_id="credit", receipts=[receipt(s)]), hks[s])
    assert cp.hash_mismatches == 0 and 1 in fl.credited
    at = {key[1]: t for key, ok, t in hops if ok}
    assert at[hks[1]] == served_at                  # not 30 s later, when its credit completed
    assert at[hks[0]] == at[hks[2]] == clock.t
