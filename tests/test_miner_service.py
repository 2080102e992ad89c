"""A real miner (MinerService on 127.0.0.1, devnet chain) driven by a real validator wallet.

Each refusal checks the HTTP status and typed outcome, then that the miner still serves a good
request and lost no state (its weights and inner step).
"""
from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
import torch
from bittensor import http_auth

from iota_subnet.devnet import add_stake, create_devnet, open_devnet
from iota_subnet.config import load_config
from iota_subnet.miner.options import MinerOptions
from iota_subnet.miner.service import MinerService
from iota_subnet.protocol import (Health, Hop, Outcome, ProtocolError, StateRequest, StateResponse, TicketAck,
                                  TicketBatch, encode)
from iota_subnet.transport import NeuronClient
from iota_subnet.wallets import create_wallet

from support.miners import LOCAL

pytestmark = pytest.mark.timeout(120)

OVR = {"model": {"name": "tiny", "dim": 64, "n_layers": 3, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128,
                 "vocab_size": 256},
       "data": {"seq_len": 16, "vocab_size": 256},
       "pipeline": {"stages": 3, "compression_ratio": 4},
       "train": {"batch_size": 4, "micro_batch_size": 2}}
RUN = "test-run"
B, T, W = 2, 16, 16


class Net:
    def __init__(self, tmp):
        self.tmp = tmp
        self.db = tmp / "chain.db"
        create_devnet(self.db, 9, tempo=50, block_time=0.5, weights_rate_limit=1, max_validators=1)
        wp = tmp / "wallets"
        self.val = create_wallet("val", "default", wp)
        self.miner_w = create_wallet("miner", "default", wp)
        self.other = create_wallet("other", "default", wp)      # registered, no permit
        self.stranger = create_wallet("stranger", "default", wp)  # never registered
        self.cfg = load_config("configs/tiny.yaml", OVR)

    async def setup(self):
        self.chain = await open_devnet(self.db)
        for w in (self.val, self.other):
            await self.chain.register(w, 9)
        add_stake(self.db, self.val.hotkey.ss58_address, self.val.coldkey.ss58_address, 100.0)
        await self.start_miner()

    async def start_miner(self):
        await self.chain.register(self.miner_w, 9)
        self.svc = MinerService(self.cfg, self.miner_w, self.chain,
                                MinerOptions(netuid=9, run_id=RUN, stage=1, out_dir=self.tmp / "miner", serve=LOCAL))
        self.port = await self.svc.start()
        self.ep = f"127.0.0.1:{self.port}"
        self.hk = self.miner_w.hotkey.ss58_address

    async def close(self):
        await self.svc.stop()
        await self.chain.close()


def hop(mb="m0", x=None, **kw):
    """A forward hop into stage 1 without a ticket (refused MALFORMED by the handler)."""
    return Hop(run_id=RUN, stage=1, microbatch_id=mb, data=torch.randn(B, T, W) if x is None else x, **kw)


def state_req(**kw):
    return StateRequest(run_id=RUN, stage=1, **kw)


async def raw_post(net: Net, body: bytes, headers: dict, path="/state"):
    async with aiohttp.ClientSession() as s:
        async with s.post(f"http://{net.ep}{path}", data=body, headers=headers) as r:
            data = await r.read()
            return r.status, (json.loads(data) if r.status != 200 else data)


async def still_serves(net: Net, client: NeuronClient, weights: dict, step: int) -> None:
    res = await client.call(net.ep, net.hk, "/state", state_req(), StateResponse, retries=0)
    assert set(res.tensors) == set(weights) and all(torch.equal(res.tensors[k], v) for k, v in weights.items())
    assert res.state_meta["step"] == step and net.svc.worker.inner_step == step
    h = await client.call(net.ep, net.hk, "/health", Health(), Health, retries=0)
    assert h.ready and h.inner_step == step


def test_miner_serves_and_refuses_bad_requests(tmp_home):
    async def go():
        net = Net(tmp_home)
        await net.setup()
        client = NeuronClient(net.val)
        try:
            weights = {k: v.detach().clone() for k, v in net.svc.worker.module.state_dict().items()}
            step = net.svc.worker.inner_step
            await still_serves(net, client, weights, step)
            signer = net.val.hotkey
            body = encode(state_req())

            def signed(b=body, path="/state", **kw):
                return http_auth.sign(signer, method="POST", path=path, body=b, receiver_ss58=net.hk, **kw)

            cases = []      # (name, path, body, headers, status, outcome)
            cases.append(("missing signature", "/state", body, {}, 401, Outcome.MISSING_SIGNATURE))
            h = signed(); h["X-Bittensor-Signature"] = ""
            cases.append(("empty signature", "/state", body, h, 401, Outcome.MISSING_SIGNATURE))
            h = signed(); sig = h["X-Bittensor-Signature"]
            h["X-Bittensor-Signature"] = sig[:-4] + ("0000" if not sig.endswith("0000") else "1111")
            cases.append(("bad signature", "/state", body, h, 401, Outcome.BAD_SIGNATURE))
            tampered = encode(state_req(names=["x"]))
            cases.append(("body changed after signing", "/state", tampered, signed(), 401, Outcome.BAD_SIGNATURE))
            h = http_auth.sign(net.stranger.hotkey, method="POST", path="/state", body=body, receiver_ss58=net.hk)
            cases.append(("unregistered hotkey", "/state", body, h, 403, Outcome.UNREGISTERED_HOTKEY))
            tb = encode(TicketBatch(run_id=RUN))
            h = http_auth.sign(net.other.hotkey, method="POST", path="/tickets", body=tb, receiver_ss58=net.hk)
            cases.append(("caller without permit", "/tickets", tb, h, 403, Outcome.FORBIDDEN))
            for name, x in [("wrong shape", torch.randn(B, T, W + 1)), ("wrong dtype", torch.randn(B, T, W).double()),
                            ("NaN", torch.full((B, T, W), float("nan"))), ("inf", torch.full((B, T, W), float("inf")))]:
                b = encode(hop("bad", x=x))
                want = {"wrong shape": (422, Outcome.BAD_SHAPE), "wrong dtype": (422, Outcome.BAD_DTYPE)}.get(
                    name, (422, Outcome.NON_FINITE))
                cases.append((name, "/hop", b, signed(b, "/hop"), *want))
            b = encode(hop("no-ticket"))
            cases.append(("hop without a ticket", "/hop", b, signed(b, "/hop"), 400, Outcome.MALFORMED))
            big = b"\0" * (net.svc.server.max_body_bytes + 10)
            cases.append(("body over the limit", "/hop", big, signed(big, "/hop"), 413, Outcome.BODY_TOO_LARGE))
            b = encode(StateRequest(run_id=RUN, stage=0))
            cases.append(("wrong stage", "/state", b, signed(b), 403, Outcome.FORBIDDEN))
            for name, path, b, headers, status, outcome in cases:
                got_status, payload = await raw_post(net, b, headers, path)
                assert (got_status, payload["outcome"]) == (status, outcome.value), name
                await still_serves(net, client, weights, step)
            # replayed nonce: the same signed request twice
            h = signed()
            assert (await raw_post(net, body, h))[0] == 200
            st, payload = await raw_post(net, body, h)
            assert (st, payload["outcome"]) == (401, Outcome.REPLAYED_NONCE.value)
            # a miner may not hand out tickets: /tickets is for validators with a permit
            other_client = NeuronClient(net.other)
            with pytest.raises(ProtocolError) as e:
                await other_client.call(net.ep, net.hk, "/tickets", TicketBatch(run_id=RUN), TicketAck, retries=0)
            assert e.value.outcome == Outcome.FORBIDDEN
            await other_client.close()
            w = net.svc.worker
            assert w.forwards == 0 and w.backwards == 0       # no refused request reached the stage
            # health, state and metrics
            hres = await client.call(net.ep, net.hk, "/health", Health(), Health)
            assert hres.stats["backwards"] == 0 and hres.stats["forwards"] == 0
            sres = await client.call(net.ep, net.hk, "/state", state_req(), StateResponse)
            assert set(sres.tensors) == set(net.svc.worker.module.state_dict())
            async with aiohttp.ClientSession() as s:
                async with s.get(f"http://{net.ep}/metrics") as r:
                    assert r.status == 200 and "iota_miner_inner_step" in await r.text()
            # replay after a restart: the nonce store is on disk
            replay_headers = signed()
            assert (await raw_post(net, body, replay_headers))[0] == 200
            step_before = net.svc.worker.inner_step
            await net.svc.stop()
            await net.start_miner()
            assert net.svc.worker.inner_step == step_before     # resumed from its checkpoint
            st, payload = await raw_post(net, body, replay_headers)
            assert (st, payload["outcome"]) == (401, Outcome.REPLAYED_NONCE.value)
            await still_serves(net, client, weights, step)
        finally:
            await client.close()
            await net.close()
    asyncio.run(go())
