"""Transport: a real aiohttp NeuronServer on 127.0.0.1, real bittensor wallets, btauth/1 signing.

Every refusal test checks the status code and the typed outcome, then that the server still
serves a good request.
"""
from __future__ import annotations

import asyncio
import io
import pickle
import socket
import statistics
import time

import aiohttp
import pytest
import torch
from bittensor import http_auth

from iota_subnet.protocol import (Health, Hop, HopAck, MergePayload, Outcome, ProtocolError, StateRequest,
                                  StateResponse, encode)
from iota_subnet.transport import NeuronClient, SqliteNonceStore, TransportError
from iota_subnet.transport.client import _nodelay_socket
from support.transport import B, D, MAX_BODY, S, Env, Node, bits, good, raw, signed, wallets  # noqa: F401 (fixture)

pytestmark = pytest.mark.timeout(60)


def run(coro):
    return asyncio.run(coro)


# ---------------------------------------------------------------------------------------------- round trips

def test_round_trip_every_message_type(wallets, tmp_path):
    async def main():
        async with Env(wallets, tmp_path) as env:
            c, n, ep, hk = env.client, env.node, env.node.server.endpoint, env.node.server.hotkey
            act = torch.randn(B, S, D)
            scales = torch.rand(B, S)
            hop = Hop(run_id="r1", stage=2, microbatch_id="mb-9", inner_step=17, data=act, scales=scales,
                      ticket={"lane": 1}, path=["5Fa", "5Fb"], info={"k": [1, 2]})
            res = await c.call(ep, hk, "/hop", hop, Hop)
            got, ctx = n.received["hop"]
            assert bits(got.data) == bits(act) and torch.equal(got.scales, scales)
            assert (got.run_id, got.stage, got.microbatch_id, got.inner_step, got.info, got.ticket, got.path) == \
                ("r1", 2, "mb-9", 17, {"k": [1, 2]}, {"lane": 1}, ["5Fa", "5Fb"])
            assert ctx.caller_hotkey == c.hotkey and ctx.route == "/hop"
            assert bits(res.data) == bits(act) and res.info == {"loss": 1.25}
            assert (res.run_id, res.microbatch_id, res.inner_step) == ("r1", "mb-9", 17)

            bf = await c.call(ep, hk, "/hop", Hop(data=act.bfloat16()), Hop)
            assert bf.data.dtype == torch.bfloat16 and bits(bf.data) == bits(act.bfloat16())

            g = torch.randn(B, S, D)
            ack = await c.call(ep, hk, "/ack", Hop(microbatch_id="mb-9", data=g), HopAck)
            assert bits(n.received["ack"].data) == bits(g) and ack.status == "duplicate"
            assert ack.microbatch_id == "mb-9"

            shard = torch.randn(5000)
            mp = MergePayload(epoch=3, shard_index=1, num_shards=4, offset=5000, total_numel=20000, weight=0.5, shard=shard)
            mres = await c.call(ep, hk, "/merge", mp, MergePayload)
            assert bits(mres.shard) == bits(shard)
            assert (mres.epoch, mres.shard_index, mres.num_shards, mres.offset, mres.total_numel, mres.weight) == \
                   (3, 1, 4, 5000, 20000, 0.5)

            st = await c.call(ep, hk, "/state", StateRequest(stage=1, names=["a.w", "b"], epoch=4), StateResponse)
            assert n.received["state"].names == ["a.w", "b"]
            assert set(st.tensors) == {"a.w", "b"} and torch.equal(st.tensors["b"], torch.full((3, 2), 1.0))
            assert st.state_meta == {"epoch": 4} and st.stage == 1

            await good(c, n)
            assert c.bytes_sent > act.numel() * 4 + shard.numel() * 4 and c.bytes_received > 0
            assert n.server.outcomes["OK"] == 6
    run(main())


def test_byte_counters_and_concurrency(wallets, tmp_path):
    async def main():
        async with Env(wallets, tmp_path) as env:
            c, ep, hk = env.client, env.node.server.endpoint, env.node.server.hotkey
            msg = Hop(data=torch.randn(B, S, D))
            body_len = len(encode(msg))
            outs = await asyncio.gather(*[c.call(ep, hk, "/hop", msg, Hop) for _ in range(16)])
            assert all(torch.equal(o.data, msg.data) for o in outs)
            assert c.bytes_sent == 16 * body_len and c.requests == 16 and c.retries == 0
            assert env.node.server.bytes_received == 16 * body_len
            assert c.bytes_received == env.node.server.bytes_sent
    run(main())


def test_small_round_trips_are_fast_nodelay(wallets, tmp_path):
    s = _nodelay_socket((socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", ("127.0.0.1", 0)))
    try:
        assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    finally:
        s.close()

    async def main():
        async with Env(wallets, tmp_path) as env:
            await good(env.client, env.node)
            times = []
            for _ in range(20):
                t0 = time.perf_counter()
                await good(env.client, env.node)
                times.append(time.perf_counter() - t0)
            assert statistics.median(times) < 0.030, times  # Nagle + delayed ACK would stall ~40 ms
    run(main())


# ---------------------------------------------------------------------------------------------- refusals

async def _expect(node: Node, path: str, body: bytes, headers: dict | None, status: int, outcome: Outcome,
                  client: NeuronClient) -> None:
    got_status, data = await raw(node, path, body, headers)
    assert (got_status, data.get("outcome")) == (status, outcome.value), data
    assert isinstance(data.get("message"), str)
    await good(client, node)


def _hop_body(**kw) -> bytes:
    return encode(Hop(data=torch.randn(B, S, D), **kw))


def test_auth_refusals(wallets, tmp_path):
    async def main():
        async with Env(wallets, tmp_path) as env:
            n, c, cw = env.node, env.client, wallets["client"]
            body = _hop_body()
            # missing signature (no btauth headers at all), and with only the signature header dropped
            await _expect(n, "/hop", body, None, 401, Outcome.MISSING_SIGNATURE, c)
            h = signed(cw, n, "/hop", body)
            h.pop(http_auth.HEADER_SIGNATURE)
            await _expect(n, "/hop", body, h, 401, Outcome.MISSING_SIGNATURE, c)
            # empty signature
            h = signed(cw, n, "/hop", body)
            h[http_auth.HEADER_SIGNATURE] = ""
            await _expect(n, "/hop", body, h, 401, Outcome.MISSING_SIGNATURE, c)
            # truncated / non-hex signature
            for sig in ("0x1234", "0xzz"):
                h = signed(cw, n, "/hop", body)
                h[http_auth.HEADER_SIGNATURE] = sig
                await _expect(n, "/hop", body, h, 401, Outcome.BAD_SIGNATURE, c)
            # bad signature: a valid signature of another request
            h = signed(cw, n, "/hop", body)
            h[http_auth.HEADER_SIGNATURE] = signed(cw, n, "/hop", b"other")[http_auth.HEADER_SIGNATURE]
            await _expect(n, "/hop", body, h, 401, Outcome.BAD_SIGNATURE, c)
            # signed by someone else than the claimed hotkey
            h = signed(wallets["stranger"], n, "/hop", body)
            h[http_auth.HEADER_HOTKEY] = cw.hotkey.ss58_address
            await _expect(n, "/hop", body, h, 401, Outcome.BAD_SIGNATURE, c)
            # body changed after signing
            h = signed(cw, n, "/hop", body)
            await _expect(n, "/hop", _hop_body(), h, 401, Outcome.BAD_SIGNATURE, c)
            # signed for another path
            h = signed(cw, n, "/ack", body)
            await _expect(n, "/hop", body, h, 401, Outcome.BAD_SIGNATURE, c)
            # stale / future nonce
            h = signed(cw, n, "/hop", body, nonce_ns=time.time_ns() - 60 * 10**9)
            await _expect(n, "/hop", body, h, 401, Outcome.STALE_REQUEST, c)
            h = signed(cw, n, "/hop", body, nonce_ns=time.time_ns() + 60 * 10**9)
            await _expect(n, "/hop", body, h, 401, Outcome.CLOCK_SKEW, c)       # a clock ahead, not staleness
            # wrong receiver, and no receiver
            h = signed(cw, n, "/hop", body, receiver=wallets["stranger"].hotkey.ss58_address)
            await _expect(n, "/hop", body, h, 421, Outcome.WRONG_RECEIVER, c)
            h = http_auth.sign(cw, method="POST", path="/hop", body=body)
            await _expect(n, "/hop", body, h, 421, Outcome.WRONG_RECEIVER, c)
            # replayed nonce
            h = signed(cw, n, "/hop", body)
            status, _ = await raw(n, "/hop", body, h)
            assert status == 200
            await _expect(n, "/hop", body, h, 401, Outcome.REPLAYED_NONCE, c)
            assert n.received["hop"][0].data.shape == (B, S, D)
    run(main())


def test_replay_refused_after_restart(wallets, tmp_path):
    async def main():
        store = tmp_path / "nonces.sqlite"
        body = _hop_body()
        node = Node(wallets, store)
        await node.server.start()
        h = signed(wallets["client"], node, "/hop", body)
        assert (await raw(node, "/hop", body, h))[0] == 200
        await node.server.stop()

        node2 = Node(wallets, store)                # same hotkey, same nonce store file, new port
        await node2.server.start()
        client = NeuronClient(wallets["client"])
        try:
            await _expect(node2, "/hop", body, h, 401, Outcome.REPLAYED_NONCE, client)
        finally:
            await client.close()
            await node2.server.stop()
    run(main())


def test_authorizer_refusals(wallets, tmp_path):
    async def main():
        async with Env(wallets, tmp_path) as env:
            n, ep, hk = env.node, env.node.server.endpoint, env.node.server.hotkey
            for who, path, msg, rtype, outcome in [
                ("stranger", "/health", Health(), Health, Outcome.UNREGISTERED_HOTKEY),
                ("limited", "/merge", MergePayload(shard=torch.zeros(4)), MergePayload, Outcome.FORBIDDEN),
            ]:
                async with NeuronClient(wallets[who]) as c:
                    with pytest.raises(ProtocolError) as ei:
                        await c.call(ep, hk, path, msg, rtype, retries=3, backoff_s=0.01)
                    assert (ei.value.status, ei.value.outcome) == (403, outcome)
                    assert c.requests == 1 and c.retries == 0          # 4xx is never retried
                await good(env.client, n)
            async with NeuronClient(wallets["limited"]) as c:          # limited may call other routes
                await c.call(ep, hk, "/health", Health(), Health)
    run(main())


def test_body_refusals(wallets, tmp_path):
    async def main():
        async with Env(wallets, tmp_path) as env:
            n, c, cw, ep, hk = env.node, env.client, wallets["client"], env.node.server.endpoint, env.node.server.hotkey

            async def refused(path, msg, rtype, status, outcome):
                with pytest.raises(ProtocolError) as ei:
                    await c.call(ep, hk, path, msg, rtype, retries=2)
                assert (ei.value.status, ei.value.outcome) == (status, outcome), ei.value
                await good(c, n)

            nan = torch.randn(B, S, D)
            nan[0, 0, 0] = float("nan")
            inf = torch.randn(B, S, D)
            inf[1, 2, 3] = float("inf")
            await refused("/hop", Hop(data=torch.randn(B, S + 1, D)), Hop, 422, Outcome.BAD_SHAPE)
            await refused("/hop", Hop(data=torch.randn(5, S, D)), Hop, 422, Outcome.BAD_SHAPE)
            await refused("/hop", Hop(data=torch.randn(B, S, D).double()), Hop, 422, Outcome.BAD_DTYPE)
            await refused("/hop", Hop(data=torch.randn(B, S, D), scales=torch.zeros(B, S, dtype=torch.float64)),
                          Hop, 422, Outcome.BAD_DTYPE)
            await refused("/hop", Hop(data=nan), Hop, 422, Outcome.NON_FINITE)
            await refused("/hop", Hop(data=inf), Hop, 422, Outcome.NON_FINITE)
            await refused("/merge", MergePayload(shard=torch.tensor([1.0, float("-inf")])), MergePayload, 422,
                          Outcome.NON_FINITE)
            await refused("/health", Health(spec_version=99), Health, 426, Outcome.SPEC_VERSION)
            await refused("/health", Hop(data=torch.randn(B, S, D)), Health, 400, Outcome.MALFORMED)
            await refused("/merge", MergePayload(shard=torch.zeros(MAX_BODY // 4 + 10)), MergePayload, 413,
                          Outcome.BODY_TOO_LARGE)
            assert c.retries == 0

            # hash mismatch: the tensor bytes changed before signing (integrity of the payload itself)
            tampered = bytearray(encode(MergePayload(shard=torch.randn(B * S * D))))
            tampered[-1] ^= 0x40
            tampered = bytes(tampered)
            await _expect(n, "/merge", tampered, signed(cw, n, "/merge", tampered), 400, Outcome.HASH_MISMATCH, c)
            # malformed: random bytes, pickle, torch.save
            junk = torch.randint(0, 256, (4096,), dtype=torch.uint8).numpy().tobytes()
            await _expect(n, "/hop", junk, signed(cw, n, "/hop", junk), 400, Outcome.MALFORMED, c)
            pk = pickle.dumps({"data": torch.randn(B, S, D)})
            await _expect(n, "/hop", pk, signed(cw, n, "/hop", pk), 400, Outcome.MALFORMED, c)
            buf = io.BytesIO()
            torch.save({"data": torch.randn(B, S, D)}, buf)
            ts = buf.getvalue()
            await _expect(n, "/hop", ts, signed(cw, n, "/hop", ts), 400, Outcome.MALFORMED, c)
            await _expect(n, "/hop", b"", signed(cw, n, "/hop", b""), 400, Outcome.MALFORMED, c)
            # over the limit: a Content-Length over it is refused before authentication; a chunked body
            # is read (up to the limit) only once its headers authenticate and authorize the caller
            big = b"\0" * (MAX_BODY + 1)
            await _expect(n, "/hop", big, None, 413, Outcome.BODY_TOO_LARGE, c)

            async def chunks():
                for _ in range(8):
                    yield b"\0" * (MAX_BODY // 4)
            await _expect(n, "/hop", chunks(), None, 401, Outcome.MISSING_SIGNATURE, c)
            await _expect(n, "/hop", chunks(), signed(cw, n, "/hop", b"x"), 413, Outcome.BODY_TOO_LARGE, c)
            assert n.server.outcomes["BODY_TOO_LARGE"] == 3
    run(main())


def test_handler_faults_and_routes(wallets, tmp_path):
    async def main():
        async with Env(wallets, tmp_path) as env:
            n, c, ep, hk = env.node, env.client, env.node.server.endpoint, env.node.server.hotkey
            with pytest.raises(ProtocolError) as ei:
                await c.call(ep, hk, "/fail", Health(), Health, retries=2, backoff_s=0.01)
            assert (ei.value.status, ei.value.outcome) == (500, Outcome.INTERNAL)
            assert c.retries == 0
            await good(c, n)
            with pytest.raises(ProtocolError) as ei:
                await c.call(ep, hk, "/nope", Health(), Health)
            assert (ei.value.status, ei.value.outcome) == (404, Outcome.UNKNOWN_ROUTE)
            async with aiohttp.ClientSession() as s:
                async with s.get(f"http://{ep}/health") as r:
                    assert r.status == 404 and (await r.json())["outcome"] == "UNKNOWN_ROUTE"
            await good(c, n)
    run(main())


def test_retries_on_503_only(wallets, tmp_path):
    async def main():
        async with Env(wallets, tmp_path) as env:
            n, c, ep, hk = env.node, env.client, env.node.server.endpoint, env.node.server.hotkey
            n.busy_left = 2
            await c.call(ep, hk, "/busy", Health(), Health, retries=3, backoff_s=0.01)
            assert c.retries == 2 and c.requests == 3
            n.busy_left = 5
            with pytest.raises(ProtocolError) as ei:
                await c.call(ep, hk, "/busy", Health(), Health, retries=1, backoff_s=0.01)
            assert (ei.value.status, ei.value.outcome) == (503, Outcome.BUSY)
            await good(c, n)
    run(main())


def test_transport_errors(wallets, tmp_path):
    async def main():
        async with Env(wallets, tmp_path) as env:
            n, c, ep, hk = env.node, env.client, env.node.server.endpoint, env.node.server.hotkey
            t0 = time.perf_counter()
            with pytest.raises(TransportError):
                await c.call(ep, hk, "/slow", Health(), Health, timeout_s=0.2, retries=0)
            assert time.perf_counter() - t0 < 0.7
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            dead = f"127.0.0.1:{sock.getsockname()[1]}"
            sock.close()
            before = c.retries
            with pytest.raises(TransportError) as ei:
                await c.call(dead, hk, "/health", Health(), Health, timeout_s=1, retries=2, backoff_s=0.01)
            assert ei.value.attempts == 3 and c.retries - before == 2
            await good(c, n)
    run(main())


def test_stop_does_not_wait_for_a_hanging_request(wallets, tmp_path):
    """A request still running when the server stops gets 2 x SHUTDOWN_GRACE_S, not aiohttp's 60 s: a
    neuron stops inside the 15 s that localnet and process managers give it before SIGKILL."""
    from iota_subnet.transport.server import SHUTDOWN_GRACE_S

    async def main():
        env = Env(wallets, tmp_path)
        await env.node.server.start()
        n, c = env.node, env.client
        call = asyncio.ensure_future(c.call(n.server.endpoint, n.server.hotkey, "/hang", Health(), Health,
                                            timeout_s=60, retries=0))
        while "hang" not in n.received:
            await asyncio.sleep(0.02)
        t0 = time.perf_counter()
        await n.server.stop()
        took = time.perf_counter() - t0
        assert took < 2 * SHUTDOWN_GRACE_S + 2.0, took
        with pytest.raises((TransportError, ProtocolError)):
            await asyncio.wait_for(call, 10)
        await c.close()
    run(main())


def test_response_signature_checked(wallets, tmp_path):
    async def main():
        async with Env(wallets, tmp_path, sign_responses=False) as env:
            ep, hk = env.node.server.endpoint, env.node.server.hotkey
            with pytest.raises(ProtocolError) as ei:
                await env.client.call(ep, hk, "/health", Health(), Health)
            assert ei.value.outcome == Outcome.BAD_SIGNATURE
            async with NeuronClient(wallets["client"], verify_responses=False) as c:
                await c.call(ep, hk, "/health", Health(), Health)
    run(main())


def test_sqlite_nonce_store(tmp_path):
    path = tmp_path / "n.sqlite"
    s = SqliteNonceStore(path, max_age=10, allowed_skew=2)
    assert s.retention >= 12
    now = time.time_ns()
    assert s.check_and_store("hk", now) and not s.check_and_store("hk", now)
    assert s.check_and_store("other", now)
    assert not s.check_and_store("hk", now - 100 * 10**9)    # signed before this store existed
    s.close()
    import sqlite3
    db = sqlite3.connect(path)                                 # pretend the store is 200 s old
    db.execute("UPDATE meta SET value=? WHERE key='created_ns'", (str(now - 200 * 10**9),))
    db.commit()
    db.close()
    s = SqliteNonceStore(path, max_age=10, allowed_skew=2)
    assert s.check_and_store("hk", now - 100 * 10**9)
    s.close()
    s = SqliteNonceStore(path, max_age=10, allowed_skew=2)   # reopening prunes the old entry, keeps the fresh
    assert len(s) == 2 and not s.check_and_store("hk", now)
    assert s.prune(now_ns=now + 10**12) == 2 and len(s) == 0
    s.close()


def test_large_state_download(wallets, tmp_path):
    """A response much larger than its request (encoded off the event loop), bit-exact."""
    async def main():
        async with Env(wallets, tmp_path) as env:
            n, c, ep, hk = env.node, env.client, env.node.server.endpoint, env.node.server.hotkey
            names = [f"layers.{i}.w" for i in range(8)]
            st = await c.call(ep, hk, "/state", StateRequest(names=names, epoch=1), StateResponse)
            assert list(st.tensors) == names
            big = {f"w{i}": torch.randn(256, 1024) for i in range(4)}                  # 4 MiB

            async def state(msg, ctx):
                return StateResponse(tensors=big, state_meta={"n": len(big)})
            n.state = state
            n.server.routes["/state"].handler = state
            st = await c.call(ep, hk, "/state", StateRequest(), StateResponse)
            assert all(bits(st.tensors[k]) == bits(v) for k, v in big.items())
            assert c.bytes_received > 4 * 256 * 1024 * 4
            await good(c, n)
    run(main())
