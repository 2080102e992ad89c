"""The merge routes of a :class:`~iota_subnet.merge.engine.MergeEngine` on a bare NeuronServer (as a
miner mounts them), for tests that run engines without a miner service."""
from __future__ import annotations

from iota_subnet.protocol import MergeJoin, MergePayload, MergeResultRequest


def mount_merge_routes(server, engine) -> None:
    """``/merge/join|contribute|result|contribution`` handled by ``engine``; a contribution's body bytes
    count as its sender's progress as they arrive."""
    async def route(msg, ctx):
        return await engine.handle(ctx.route, msg, ctx.caller_hotkey)
    server.add_route("/merge/join", route, MergeJoin)
    server.add_route("/merge/contribute", route, MergePayload,
                     on_body_bytes=lambda hk, remote, n: engine.link.moving(hk, n))
    server.add_route("/merge/result", route, MergeResultRequest)
    server.add_route("/merge/contribution", route, MergeResultRequest)
