"""Big payloads: transfers that could exceed a body limit are chunked, so a stage
over 256 MiB (the client's response cap) is audited and synced.

* An update audit of a synthetic module of 272 MB (68 M fp32 parameters): the audit opens two
  rows with proofs over signed HTTP; the answer is a few tens of KB whatever the stage size.
* A state sync of a 272 MB snapshot (anchor + momentum) through the existing chunked mechanism
  (:mod:`iota_subnet.merge.sync`, ``/state/chunk``) over signed HTTP with the client's 256 MiB
  cap, resumed after an interruption; the same tensors in one ``StateResponse`` body are refused.

Memory: about 3 GB at peak (the module, its AdamW state, the update store's copies); time about
20-60 s on 2 cores, hence ``slow``.
"""
from __future__ import annotations

import asyncio
import random

import pytest
import torch

from iota_subnet.audit.update import AdamHParams, check_update_opening, param_layout, sample_rows
from iota_subnet.merge.sync import SnapshotDonor, sync_state
from iota_subnet.merge.transport import HttpTransport
from iota_subnet.miner.update_store import UpdateAuditRoute, UpdateStore
from iota_subnet.protocol import (UPDATE_KINDS, Outcome, ProtocolError, StateChunkRequest, StateRequest,
                                  StateResponse, UpdateAuditRequest, UpdateAuditResponse, update_audit_contract)
from iota_subnet.config import TrainConfig
from iota_subnet.train.optim import make_optimizer
from iota_subnet.transport import NeuronClient, NeuronServer
from support.common import make_wallet

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CAP = 256 << 20


class Big(torch.nn.Module):
    def __init__(self, rows: int = 16384, cols: int = 4160):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(rows, cols) * 0.02)
        self.norm = torch.nn.Parameter(torch.ones(cols))


def test_update_audit_of_a_stage_over_256_mib(tmp_home):
    torch.manual_seed(0)
    m = Big()
    nbytes = sum(p.numel() * 4 for p in m.parameters())
    assert nbytes > CAP
    tcfg = TrainConfig()
    opt = make_optimizer(m, tcfg)
    store = UpdateStore(m, opt, keep_steps=1)
    for step in range(2):
        for p in m.parameters():
            p.grad = torch.randn_like(p) * 1e-3
        pending = store.begin(step, 0)
        gn = float(torch.nn.utils.clip_grad_norm_(m.parameters(), tcfg.grad_clip))
        opt.step()
        from iota_subnet.audit.update import clip_coef
        store.finish(pending, lr=tcfg.lr, grad_norm=gn, clip_coef=clip_coef(gn, tcfg.grad_clip), skipped=False)
        opt.zero_grad(set_to_none=True)
    commit = store.commitment(1, timeout_s=120)
    assert commit is not None and store.steps() == [1]
    root = tmp_home / "wallets"
    mw, vw = make_wallet(root, "m"), make_wallet(root, "v")
    layout = param_layout(m, tcfg.weight_decay)

    async def main():
        server = NeuronServer(mw, "127.0.0.1", 0, None, None)
        server.add_route("/audit/update", UpdateAuditRoute(store, "r", 0), UpdateAuditRequest)
        await server.start()
        client = NeuronClient(vw)                          # max_response_bytes: 256 MiB
        assert client.max_response_bytes == CAP
        try:
            rows = sample_rows(layout, 2, random.Random(1))
            req = UpdateAuditRequest(run_id="r", stage=0, inner_step=1, merges=0, rows=[[n, r] for n, r in rows],
                                     kinds=list(UPDATE_KINDS))
            resp = await client.call(server.endpoint, server.hotkey, "/audit/update", req, UpdateAuditResponse,
                                     timeout_s=60, response_contract=update_audit_contract())
            chk = check_update_opening(commit, rows, resp, layout, AdamHParams.from_train(tcfg))
            assert chk.ok and chk.worst == 0.0, chk
            assert client.bytes_received < 1 << 20             # rows and proofs, not the stage
        finally:
            await client.close()
            await server.stop()
            store.close()
    asyncio.run(main())


def test_state_sync_over_256_mib_is_chunked_and_resumable(tmp_home, tmp_path):
    P = 34 << 20                                          # anchor + momentum: 2 x 34 Mi floats = 272 MiB
    g = torch.Generator().manual_seed(0)
    anchor = torch.randn(P, generator=g)
    momentum = torch.randn(P, generator=g) * 1e-3
    assert 2 * P * 4 > CAP
    donor = SnapshotDonor("r", 1, chunk_numel=1 << 20, max_concurrent=2)
    donor.publish(anchor, momentum, merged_epoch=3, step=40)
    root = tmp_home / "wallets"
    dw, jw = make_wallet(root, "donor"), make_wallet(root, "joiner")
    served = []

    async def main():
        server = NeuronServer(dw, "127.0.0.1", 0, None, None)

        async def chunk(msg, ctx):
            if msg.snapshot_id:
                served.append(msg.offset)
                if len(served) == 20 and not interrupted:       # the donor drops out mid-transfer once
                    interrupted.append(1)
                    raise ProtocolError(Outcome.FORBIDDEN, "going away")
            return await donor.handle(msg, ctx.caller_hotkey)

        async def whole(msg, ctx):
            return StateResponse(run_id="r", stage=1, tensors={"anchor": anchor, "momentum": momentum})
        interrupted: list = []
        server.add_route("/state/chunk", chunk, StateChunkRequest)
        server.add_route("/state", whole, StateRequest)
        await server.start()
        client = NeuronClient(jw)
        transport = HttpTransport(client, lambda hk: server.endpoint if hk == server.hotkey else None, timeout_s=60)
        try:
            # one body with the whole state is over the cap: refused, nothing transferred in full
            with pytest.raises(ProtocolError) as ei:
                await client.call(server.endpoint, server.hotkey, "/state", StateRequest(run_id="r", stage=1),
                                  StateResponse, timeout_s=120, retries=0)
            assert ei.value.outcome == Outcome.BODY_TOO_LARGE
            # chunked: the first attempt is cut off by the donor, the second resumes from disk
            from iota_subnet.merge.sync import SyncError
            with pytest.raises(SyncError):
                await sync_state([server.hotkey], transport, run_id="r", stage=1, param_numel=P,
                                 work_dir=tmp_path / "sync")
            kept = len(list((tmp_path / "sync").rglob("chunk*.bin")))
            assert kept >= 10
            a, mom, man = await sync_state([server.hotkey], transport, run_id="r", stage=1, param_numel=P,
                                           work_dir=tmp_path / "sync")
            assert man["sync"]["resumed"] == kept and man["merged_epoch"] == 3
            assert torch.equal(a, anchor) and torch.equal(mom, momentum)
        finally:
            await client.close()
            await server.stop()
    asyncio.run(main())
