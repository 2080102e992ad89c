"""A replay hop audit opened in parts over the real wire (issue 30, item 7; the in-process version:
tests/test_hf_replay_parts.py): the tail of a tiny Qwen2 with an 8192 x 64 fp32 LM head (2 MiB) kept
by a real :class:`~iota_subnet.miner.hop_store.HopStore`, served by the miner's real hop-audit routes
(:class:`~iota_subnet.miner.hop_audit_routes.HopAuditRoutes`, opening cap 1 MiB) on a NeuronServer on
127.0.0.1, audited over signed HTTP by the validator's real :class:`~iota_subnet.validator.auditing.AuditScheduler`
(its ``audit_hop``: trace, then ``/audit/open`` in >= 3 parts of at most 1 MiB). The honest hop passes;
a miner that serves one LM-head row of a later part with other values (and the honest proof) fails;
one audit session opens a bounded number of bytes: a part at most ``1 + MAX_PART_REASKS`` times, new
parts at most the layout's rows (:func:`~iota_subnet.miner.hop_audit_routes.open_budget`), each past
that refused ``MALFORMED`` while the session still serves its last part. ~5 s on 2 cores."""
from __future__ import annotations

import asyncio
import dataclasses
import random
from types import SimpleNamespace

import pytest
import torch
from bittensor.sp_core import Keypair

from iota_subnet.audit import codec
from iota_subnet.audit.commit import wire_root
from iota_subnet.config import load_config
from iota_subnet.config_hf import hf_model_config
from iota_subnet.miner.hop_audit_routes import MAX_PART_REASKS, HopAuditLimits, HopAuditRoutes, open_budget
from iota_subnet.miner.hop_store import HopStore
from iota_subnet.protocol import AuditOpening, AuditTraceCommit, Outcome, ProtocolError, Ticket
from iota_subnet.protocol.receipt import Receipt
from iota_subnet.transport import NeuronClient, NeuronServer
from iota_subnet.validator.audit_policy import AuditPolicy
from iota_subnet.validator.auditing import AuditScheduler, AuditSchedulerOptions
from iota_subnet.validator.auditing.inputs import HopCandidate
from iota_subnet.validator.routing import Replica

from support.dataplane_net import OVR
from test_hf_hop_audit import B, MPS, T, honest_hop
from test_hf_replay_parts import BIG, CAP, big_run  # noqa: F401 - the fixture

pytestmark = pytest.mark.timeout(60)
MB = "mb-0-0"


class SwappingRoutes(HopAuditRoutes):
    """A miner that serves row ``swap[1]`` of ``swap[0]`` with other values (and the honest proof)."""

    def __init__(self, *a, swap, **kw):
        super().__init__(*a, **kw)
        self.swap = swap

    def prover(self, layout, weights, hop):
        p = super().prover(layout, weights, hop)
        row_fn = p._row
        p._row = lambda name, i: row_fn(name, i) + 1e-3 if (name, i) == self.swap else row_fn(name, i)
        return p


class PartsScheduler(AuditScheduler):
    """The validator's scheduler with its opening parts at most ``CAP`` bytes (the miner's cap here);
    ``auditors``: the hop auditors it made."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.auditors = []

    def hop_auditor(self, c, direction):
        aud, req = super().hop_auditor(c, direction)
        aud.open_part_bytes = CAP
        self.auditors.append(aud)
        return aud, req


class Net:
    """The tail miner (``routes_cls``, its HopStore holding one hop) on 127.0.0.1 and a validator."""

    def __init__(self, big_run, routes_cls=HopAuditRoutes, **routes_kw):
        _, _, stages, tokens, targets = big_run
        self.cfg = dataclasses.replace(load_config("configs/tiny.yaml", OVR),
                                       model=hf_model_config({"hf": "qwen2", "config": BIG}))
        assert self.cfg.train.batch_size // self.cfg.train.micro_batch == MPS
        hop, loss = honest_hop(big_run, 2, "bf16")
        self.store = HopStore(2)
        v = self.store.observe(SimpleNamespace(inner_step=0, merges=0, module=stages[2]))
        self.store.record_forward(MB, wire_format="bf16", x=hop.x, version=v, targets=hop.targets, wire=hop.wire)
        self.routes = routes_cls(self.store, self.cfg, run_id="r", stage=2,
                                 limits=HopAuditLimits(max_open_bytes=CAP), **routes_kw)
        self.mkey, self.vkey = Keypair.create_from_uri("//parts-miner"), Keypair.create_from_uri("//parts-vali")
        self.server = NeuronServer(self.mkey, "127.0.0.1", 0, None, None)
        self.routes.mount(self.server)
        self.rows = torch.cat([tokens, targets[:, -1:]], 1)
        wroot = self.store.commitment(v, 30).root.hex()
        self.receipt = Receipt(id=MB, lane=0, step=0, index=0, attempt=0, stage=2, status="ok",
                               fin=wire_root(hop.wire["wire.x"]).hex(), bout=wire_root(hop.wire["wire.dx"]).hex(),
                               loss=loss, ws=0, wm=0, wroot=wroot, boot=1.0, accumulated=True)
        self.ticket = Ticket(run_id="r", validator="v", lane=0, step=0, index=0, microbatch_id=MB, split="train",
                             seed=0, start=0, rows=B, seq_len=T, width=64, wire_dtype="bf16", train=True,
                             micro_per_step=MPS, route=("a", "b", self.mkey.ss58_address))
        self.client = NeuronClient(self.vkey)
        self.rep = None
        self.sch = None

    async def __aenter__(self):
        await self.server.start()
        self.rep = Replica(7, self.mkey.ss58_address, self.server.endpoint, 2)
        self.sch = PartsScheduler(self.cfg, run_id="r", client=self.client, policy=AuditPolicy(),
                                  rows=lambda t: self.rows, lookup=lambda hk: self.rep,
                                  options=AuditSchedulerOptions(retry_delays_s=(), rng=random.Random(1)))
        return self

    async def __aexit__(self, *exc):
        await self.client.close()
        await self.server.stop()
        self.store.pool.shutdown(wait=False)

    def candidate(self) -> HopCandidate:
        return HopCandidate(self.ticket, self.receipt, self.mkey.ss58_address, 0.0)


def _audit(big_run, routes_cls=HopAuditRoutes, **kw):
    async def main():
        async with Net(big_run, routes_cls, **kw) as net:
            rec = await net.sch.audit_hop(net.rep, 0, net.candidate())
            return rec, net.sch.auditors[-1], net.routes
    return asyncio.run(main())


def test_an_honest_hop_opened_in_parts_over_http_passes(big_run):
    rec, aud, routes = _audit(big_run)
    assert rec.raw == "passed", rec.detail
    assert len(aud.parts) >= 3
    assert routes.served == 1 and not routes.sessions


def test_a_row_swapped_in_a_later_part_fails_over_http(big_run):
    rec, aud, _ = _audit(big_run, SwappingRoutes, swap=("w:lm_head.weight", 5000))
    assert [k for k, p in enumerate(aud.parts) if 5000 in p.get("w:lm_head.weight", [])] != [0]
    assert rec.raw == "failed" and "w:lm_head.weight row 5000 does not match" in rec.detail, rec.detail


def test_an_audit_session_opens_a_bounded_number_of_bytes(big_run):
    async def main():
        async with Net(big_run) as net:
            aud, req = net.sch.hop_auditor(net.candidate(), "backward")
            lay, ep, hk = aud.layout, net.server.endpoint, net.mkey.ss58_address
            commit = await net.client.call(ep, hk, "/audit/trace", req, AuditTraceCommit, retries=0,
                                           response_contract=codec.commit_contract(lay))
            aud.on_commit(*codec.read_commit(commit))
            aud.on_projection({}, [])
            assert len(aud.parts) >= 3

            async def ask(part, more=True):
                oreq = codec.open_request(req, part, [], more=more)
                contract = codec.opening_contract(lay, part, weights_dtype=aud.weights_dtype, whole=[])
                return await net.client.call(ep, hk, "/audit/open", oreq, AuditOpening, retries=0,
                                             response_contract=contract)

            async def refused(part):
                with pytest.raises(ProtocolError) as e:
                    await ask(part)
                return e.value.outcome, e.value.message
            first, answers = aud.parts[0], []
            for _ in range(1 + MAX_PART_REASKS):        # once, and the validator's re-asks
                answers.append(await ask(first))
            outcome, why = await refused(first)
            assert outcome == Outcome.MALFORMED and "opened 3 times already" in why, why
            for part in aud.parts[1:]:
                answers.append(await ask(part))
            assert net.routes.sessions[req.audit_id].opened_bytes == open_budget(lay, CAP)     # every row once
            # new rows past the layout's: the first part's rows in another order (another part)
            outcome, why = await refused({k: v[::-1] for k, v in first.items()})
            assert outcome == Outcome.MALFORMED and "the most one audit of this layout opens" in why, why
            answers[-1] = await ask(aud.parts[-1], more=False)       # the last part again ends the session
            assert not net.routes.sessions and net.routes.served == 1
            for part, answer in zip(aud.parts, answers[MAX_PART_REASKS:]):
                aud.accept(part, codec.read_opening(answer, lay, part, []))
            v = aud.check()
            assert v.ok, v.failures
    asyncio.run(main())
