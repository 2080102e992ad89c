"""A signed NeuronServer with one route per kind of request, and helpers to drive it, shared by the
transport tests (tests/test_transport.py, tests/test_transport_operator.py)."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import bittensor as bt
import pytest
import torch
from bittensor import http_auth

from iota_subnet.protocol import (Health, Hop, HopAck, MergePayload, Outcome, ProtocolError, StateRequest,
                                  StateResponse, TensorContract, TensorSpec)
from iota_subnet.transport import NeuronClient, NeuronServer

B, S, D = 2, 16, 8
MAX_BODY = 256 << 10


def _wallet(path: Path, name: str) -> bt.Wallet:
    w = bt.Wallet(name=name, hotkey="hk", path=str(path))
    w.create_new_coldkey(use_password=False, overwrite=True, suppress=True)
    w.create_new_hotkey(use_password=False, overwrite=True, suppress=True)
    return w


@pytest.fixture()
def wallets(tmp_home):
    """Wallets ``server``, ``client``, ``limited`` (may not call ``/merge``) and ``stranger`` (unregistered)."""
    path = tmp_home / "wallets"
    return {n: _wallet(path, n) for n in ("server", "client", "limited", "stranger")}


class Node:
    """A server with one route per message type, an authorizer over a fake metagraph."""

    def __init__(self, wallets, store: Path, **kw):
        self.received: dict[str, object] = {}
        self.busy_left = 0
        registered = {wallets[n].hotkey.ss58_address for n in ("client", "limited")}
        limited = wallets["limited"].hotkey.ss58_address

        def authorizer(hotkey: str, route: str) -> None:
            if hotkey not in registered:
                raise ProtocolError(Outcome.UNREGISTERED_HOTKEY, "not in the metagraph")
            if hotkey == limited and route == "/merge":
                raise ProtocolError(Outcome.FORBIDDEN, "no validator permit")

        self.server = NeuronServer(wallets["server"], "127.0.0.1", 0, authorizer, store, MAX_BODY, **kw)
        contract = TensorContract({
            "data": TensorSpec(dtypes=(torch.float32, torch.bfloat16), shape=(-1, S, D), max_shape=(4, -1, -1)),
            "scales": TensorSpec(dtypes=(torch.float32,), shape=(-1, S), required=False)})
        s = self.server
        s.add_route("/hop", self.hop, Hop, lambda: contract)
        s.add_route("/ack", self.ack, Hop, TensorContract({"data": TensorSpec(dtypes=(torch.float32,), shape=(-1, S, D))}))
        s.add_route("/merge", self.merge, MergePayload)
        s.add_route("/state", self.state, StateRequest)
        s.add_route("/health", self.health, Health)
        s.add_route("/fail", self.fail, Health)
        s.add_route("/slow", self.slow, Health)
        s.add_route("/busy", self.busy, Health)
        s.add_route("/hang", self.hang, Health)

    async def hop(self, msg: Hop, ctx) -> Hop:
        self.received["hop"] = (msg, ctx)
        return Hop(run_id=msg.run_id, stage=msg.stage, microbatch_id=msg.microbatch_id, inner_step=msg.inner_step,
                   data=msg.data, info={"loss": 1.25})

    def ack(self, msg: Hop, ctx) -> HopAck:  # sync handlers work too
        self.received["ack"] = msg
        return HopAck(microbatch_id=msg.microbatch_id, status="duplicate")

    async def merge(self, msg: MergePayload, ctx) -> MergePayload:
        self.received["merge"] = msg
        return msg

    async def state(self, msg: StateRequest, ctx) -> StateResponse:
        self.received["state"] = msg
        return StateResponse(stage=msg.stage, tensors={n: torch.full((3, 2), float(i)) for i, n in
                                                       enumerate(msg.names or ["w"])}, state_meta={"epoch": msg.epoch})

    async def health(self, msg: Health, ctx) -> Health:
        return Health(hotkey=self.server.hotkey, info={"caller": ctx.caller_hotkey})

    async def fail(self, msg, ctx):
        raise RuntimeError("handler bug")

    async def slow(self, msg, ctx):
        await asyncio.sleep(0.8)
        return Health()

    async def hang(self, msg, ctx):
        self.received["hang"] = True
        await asyncio.sleep(120)
        return Health()

    async def busy(self, msg, ctx):
        if self.busy_left > 0:
            self.busy_left -= 1
            raise ProtocolError(Outcome.BUSY, "queue full")
        return Health()


async def good(client: NeuronClient, node: Node) -> None:
    """The server still serves a valid request."""
    out = await client.call(node.server.endpoint, node.server.hotkey, "/health", Health(), Health, timeout_s=5)
    assert out.hotkey == node.server.hotkey and out.info["caller"] == client.hotkey


async def raw(node: Node, path: str, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s:
        async with s.post(f"http://{node.server.endpoint}{path}", data=body, headers=headers or {}) as r:
            data = await r.read()
            try:
                return r.status, json.loads(data)
            except ValueError:
                return r.status, {"raw": data}


def signed(wallet, node: Node, path: str, body: bytes, **kw) -> dict:
    return http_auth.sign(wallet, method="POST", path=path, body=body, receiver_ss58=kw.pop("receiver", node.server.hotkey),
                          **kw)


class Env:
    def __init__(self, wallets, tmp_path, **kw):
        self.wallets = wallets
        self.store = tmp_path / "nonces.sqlite"
        self.node = Node(wallets, self.store, **kw)
        self.client = NeuronClient(wallets["client"])

    async def __aenter__(self):
        await self.node.server.start()
        return self

    async def __aexit__(self, *exc):
        await self.client.close()
        await self.node.server.stop()


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
