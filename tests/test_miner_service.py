"""A real miner (MinerService on 127.0.0.1, devnet chain) driven by a real validator wallet.

Each refusal checks the HTTP status and typed outcome, then that the miner still serves a good
request and lost no state.
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
from iota_subnet.miner.service import MinerService
from iota_subnet.protocol import (Backward, BackwardResult, Forward, ForwardResult, Health, Outcome, ProtocolError,
                                  StateRequest, StateResponse, encode)
from iota_subnet.transport import NeuronClient
from iota_subnet.wallets import create_wallet

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
        self.svc = MinerService(self.cfg, self.miner_w, self.chain, netuid=9, run_id=RUN, stage=1,
                                out_dir=self.tmp / "miner", host="127.0.0.1", external_ip="127.0.0.1")
        self.port = await self.svc.start()
        self.ep = f"127.0.0.1:{self.port}"
        self.hk = self.miner_w.hotkey.ss58_address

    async def close(self):
        await self.svc.stop()
        await self.chain.close()


def fwd(mb="m0", x=None, **kw):
    return Forward(run_id=RUN, stage=1, microbatch_id=mb, activations=torch.randn(B, T, W) if x is None else x, **kw)


async def raw_post(net: Net, body: bytes, headers: dict, path="/forward"):
    async with aiohttp.ClientSession() as s:
        async with s.post(f"http://{net.ep}{path}", data=body, headers=headers) as r:
            data = await r.read()
            return r.status, (json.loads(data) if r.status != 200 else data)


async def still_serves(net: Net, client: NeuronClient, mb: str) -> None:
    res = await client.call(net.ep, net.hk, "/forward", fwd(mb), ForwardResult, retries=0)
    assert res.activations.shape == (B, T, W)
    back = await client.call(net.ep, net.hk, "/backward", Backward(run_id=RUN, stage=1, microbatch_id=mb,
                                                                    grad=torch.randn(B, T, W)), BackwardResult)
    assert back.grad.shape == (B, T, W)


def test_miner_serves_and_refuses_bad_requests(tmp_home):
    async def go():
        net = Net(tmp_home)
        await net.setup()
        client = NeuronClient(net.val)
        try:
            await still_serves(net, client, "first")
            assert net.svc.worker.backwards == 1
            signer = net.val.hotkey
            body = encode(fwd("raw"))

            def signed(b=body, path="/forward", **kw):
                return http_auth.sign(signer, method="POST", path=path, body=b, receiver_ss58=net.hk, **kw)

            cases = []
            cases.append(("missing signature", body, {}, 401, Outcome.MISSING_SIGNATURE))
            h = signed(); h["X-Bittensor-Signature"] = ""
            cases.append(("empty signature", body, h, 401, Outcome.MISSING_SIGNATURE))
            h = signed(); sig = h["X-Bittensor-Signature"]
            h["X-Bittensor-Signature"] = sig[:-4] + ("0000" if not sig.endswith("0000") else "1111")
            cases.append(("bad signature", body, h, 401, Outcome.BAD_SIGNATURE))
            tampered = encode(fwd("raw", x=torch.ones(B, T, W)))
            cases.append(("body changed after signing", tampered, signed(), 401, Outcome.BAD_SIGNATURE))
            h = http_auth.sign(net.stranger.hotkey, method="POST", path="/forward", body=body, receiver_ss58=net.hk)
            cases.append(("unregistered hotkey", body, h, 403, Outcome.UNREGISTERED_HOTKEY))
            h = http_auth.sign(net.other.hotkey, method="POST", path="/forward", body=body, receiver_ss58=net.hk)
            cases.append(("caller without permit", body, h, 403, Outcome.FORBIDDEN))
            for name, x in [("wrong shape", torch.randn(B, T, W + 1)), ("wrong dtype", torch.randn(B, T, W).double()),
                            ("NaN", torch.full((B, T, W), float("nan"))), ("inf", torch.full((B, T, W), float("inf")))]:
                b = encode(fwd("bad", x=x))
                want = {"wrong shape": (422, Outcome.BAD_SHAPE), "wrong dtype": (422, Outcome.BAD_DTYPE)}.get(
                    name, (422, Outcome.NON_FINITE))
                cases.append((name, b, signed(b), *want))
            big = b"\0" * (net.svc.server.max_body_bytes + 10)
            cases.append(("body over the limit", big, signed(big), 413, Outcome.BODY_TOO_LARGE))
            b = encode(Forward(run_id=RUN, stage=0, microbatch_id="s", activations=torch.randn(B, T, W)))
            cases.append(("wrong stage", b, signed(b), 403, Outcome.FORBIDDEN))
            for i, (name, b, headers, status, outcome) in enumerate(cases):
                got_status, payload = await raw_post(net, b, headers)
                assert (got_status, payload["outcome"]) == (status, outcome.value), name
                await still_serves(net, client, f"ok-{i}")
            # replayed nonce: the same signed request twice
            h = signed()
            assert (await raw_post(net, body, h))[0] == 200
            st, payload = await raw_post(net, body, h)
            assert (st, payload["outcome"]) == (401, Outcome.REPLAYED_NONCE.value)
            # unknown micro-batch on backward
            with pytest.raises(ProtocolError) as e:
                await client.call(net.ep, net.hk, "/backward",
                                  Backward(run_id=RUN, stage=1, microbatch_id="never", grad=torch.randn(B, T, W)),
                                  BackwardResult, retries=0)
            assert e.value.outcome == Outcome.UNKNOWN_MICROBATCH
            # a miner may not pull forwards; another validator cannot backprop through our forward
            # (micro-batches are keyed by caller)
            other_client = NeuronClient(net.other)
            with pytest.raises(ProtocolError) as e:
                await other_client.call(net.ep, net.hk, "/backward",
                                        Backward(run_id=RUN, stage=1, microbatch_id="ok-0", grad=torch.randn(B, T, W)),
                                        BackwardResult, retries=0)
            assert e.value.outcome == Outcome.FORBIDDEN
            await other_client.close()
            backwards = net.svc.worker.backwards
            assert backwards == 1 + len(cases)        # every good request counted, no bad one
            # health, state and metrics
            hres = await client.call(net.ep, net.hk, "/health", Health(), Health)
            assert hres.stats["backwards"] == backwards
            sres = await client.call(net.ep, net.hk, "/state", StateRequest(run_id=RUN, stage=1), StateResponse)
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
            await still_serves(net, client, "after-restart")
        finally:
            await client.close()
            await net.close()
    asyncio.run(go())
