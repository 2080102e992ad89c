"""A plain aiohttp application served on 127.0.0.1 for a test (a fake relay, a fake spec server)."""
from __future__ import annotations

from aiohttp import web


async def start_site(app: web.Application) -> tuple[web.AppRunner, int]:
    """Serve ``app`` on 127.0.0.1 at a free port; returns the runner (``await runner.cleanup()``) and the port."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]


async def serve_get(path: str, handler) -> tuple[web.AppRunner, int]:
    """:func:`start_site` of an application with one GET route."""
    app = web.Application()
    app.router.add_get(path, handler)
    return await start_site(app)
