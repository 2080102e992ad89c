"""The spec body a neuron joining by hash reads from a validator (``iota_subnet.run_fetch._get``): the
whole body, even when it arrives in several pieces; of an oversized one, no more than MAX_SPEC_BYTES plus
one piece (which :func:`~iota_subnet.protocol.run_spec.verify_spec` then refuses); a redirect is not
followed."""
from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

from iota_subnet.protocol.run_spec import MAX_SPEC_BYTES, SPEC_ROUTE, SpecHashMismatchError, spec_digest, verify_spec
from iota_subnet.run_fetch import _get
from support.sites import serve_get

pytestmark = pytest.mark.timeout(30)


async def _serve_pieces(pieces: list[bytes], pause_s: float) -> tuple[web.AppRunner, int]:
    """A /run/spec that streams ``pieces`` (chunked), ``pause_s`` seconds apart."""
    async def get(request):
        r = web.StreamResponse(headers={"Content-Type": "text/yaml"})
        await r.prepare(request)
        for p in pieces:
            await r.write(p)
            await asyncio.sleep(pause_s)
        await r.write_eof()
        return r
    return await serve_get(SPEC_ROUTE, get)


def test_a_spec_served_in_pieces_is_read_whole():
    text = b"model:\n  name: tiny\n" + b"# pad\n" * 2000

    async def main():
        runner, port = await _serve_pieces([text[:100], text[100:5000], text[5000:]], 0.05)
        try:
            return await _get(f"127.0.0.1:{port}", 10.0)
        finally:
            await runner.cleanup()
    body = asyncio.run(main())
    assert body == text
    assert verify_spec(body, spec_digest(text), "test") == text.decode()


def test_an_oversized_spec_is_read_only_past_the_limit_and_refused():
    piece = b"x" * (256 << 10)

    async def main():
        runner, port = await _serve_pieces([piece] * 8, 0.0)       # 2 MiB
        try:
            return await _get(f"127.0.0.1:{port}", 10.0)
        finally:
            await runner.cleanup()
    body = asyncio.run(main())
    assert MAX_SPEC_BYTES < len(body) <= MAX_SPEC_BYTES + len(piece)
    with pytest.raises(SpecHashMismatchError, match="above the"):
        verify_spec(body, spec_digest(b"x" * (2 << 20)), "test")


def test_a_redirect_is_not_followed():
    text = b"model: tiny\n"

    async def main():
        honest, honest_port = await _serve_pieces([text], 0.0)

        async def moved(_request):
            raise web.HTTPFound(f"http://127.0.0.1:{honest_port}{SPEC_ROUTE}")
        runner, port = await serve_get(SPEC_ROUTE, moved)
        try:
            with pytest.raises(aiohttp.ClientResponseError) as e:
                await _get(f"127.0.0.1:{port}", 10.0)
            assert e.value.status == 302
            assert await _get(f"127.0.0.1:{honest_port}", 10.0) == text
        finally:
            await runner.cleanup()
            await honest.cleanup()
    asyncio.run(main())
