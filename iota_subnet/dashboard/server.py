"""The dashboard's HTTP server: a read-only aiohttp app on its own port.

Routes (GET only; anything else is 405):

* ``/``: the page (``static/index.html``); it polls ``/api/snapshot`` every 2 s and draws it;
* ``/static/...``: its script and style, and the vendored uPlot (MIT) plotting library: the page
  loads nothing from other hosts (its Content-Security-Policy forbids it), so it works offline;
* ``/api/snapshot``: the source's :meth:`snapshot` (JSON);
* ``/metrics``: Prometheus metrics, when a :class:`~iota_subnet.telemetry.NeuronMetrics` is given;
* ``/healthz``: ``ok``; 503 with ``{"status": "unhealthy", "failing": [task names]}`` while a task of
  its supervisor (the neuron's) keeps failing;
* ``/ops/reach``, ``/ops/bandwidth``: ``iota-subnet doctor``'s peer probes.

A background task (``dashboard``, supervised: restarted after an exception) calls the source's
``sample()`` every ``sample_every_s`` seconds.
"""
from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any, Optional

from aiohttp import web
from loguru import logger

from iota_subnet.transport.probe import PeerProbe
from iota_subnet.transport import start_site
from iota_subnet.utils.supervise import Supervisor

STATIC = Path(__file__).resolve().parent / "static"
#: Only this origin's scripts, styles and data: no CDN, no third-party requests.
CSP = ("default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
       "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'")


@web.middleware
async def _headers(request: web.Request, handler):
    resp = await handler(request)
    resp.headers.setdefault("Content-Security-Policy", CSP)
    resp.headers.setdefault("X-Content-Type-Options", "nosniff")
    resp.headers.setdefault("Referrer-Policy", "no-referrer")
    if request.path.startswith("/api/"):
        resp.headers["Cache-Control"] = "no-store"
    return resp


class DashboardServer:
    """Serve ``source`` (a :class:`~.sources.ValidatorSource` or :class:`~.sources.MinerSource`) on
    ``host:port`` (port 0: any free port; :attr:`url` tells which after :meth:`start`). ``supervisor``:
    runs the sampler (the neuron's, so ``/healthz`` tells the neuron's health; None: one of its own)."""

    def __init__(self, source: Any, host: str = "127.0.0.1", port: int = 0, *, metrics: Any = None,
                 sample_every_s: float = 1.0, supervisor: Optional[Supervisor] = None):
        self.source = source
        self.host, self.port = host, int(port)
        self.metrics = metrics
        self.sample_every_s = sample_every_s
        self.app = web.Application(middlewares=[_headers])
        self.app.router.add_get("/", self._index)
        self.app.router.add_get("/api/snapshot", self._snapshot)
        self.app.router.add_get("/healthz", self._healthz)
        self.app.router.add_static("/static/", STATIC, show_index=False, follow_symlinks=False)
        if metrics is not None:
            self.app.router.add_get("/metrics", metrics.handler)
        for path, handler in PeerProbe().handlers().items():      # iota-subnet doctor asks peers
            self.app.router.add_get(path, handler)
        self._runner: Optional[web.AppRunner] = None
        self.sup = supervisor if supervisor is not None else Supervisor("dashboard")

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "", "::") else self.host
        return f"http://{host}:{self.port}/"

    async def start(self) -> str:
        """Bind, start sampling, and return the page's URL."""
        runner = web.AppRunner(self.app, access_log=None, handle_signals=False)
        await runner.setup()
        await start_site(runner, self.host, self.port, "the dashboard", "--dashboard-port")
        self._runner = runner
        if runner.addresses:
            self.port = int(runner.addresses[0][1])
        await self.source.sample()
        self.sup.spawn("dashboard", self._sampler)
        logger.info("dashboard on {}", self.url)
        return self.url

    async def stop(self) -> None:
        await self.sup.stop(names=["dashboard"])
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _sampler(self) -> None:
        while True:
            await asyncio.sleep(self.sample_every_s)
            try:
                await self.source.sample()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - sampling must go on
                logger.debug("dashboard sample failed: {}: {}", type(e).__name__, e)

    async def _index(self, _request: web.Request) -> web.Response:
        return web.FileResponse(STATIC / "index.html")

    async def _snapshot(self, _request: web.Request) -> web.Response:
        return web.Response(text=json.dumps(finite(self.source.snapshot()), default=_json_default, allow_nan=False),
                            content_type="application/json")

    async def _healthz(self, _request: web.Request) -> web.Response:
        failing = self.sup.failing()
        if failing:
            return web.json_response({"status": "unhealthy", "failing": failing}, status=503)
        return web.Response(text="ok")


def finite(o: Any) -> Any:
    """``o`` with NaN and infinities replaced by None (JSON has no such numbers)."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [finite(v) for v in o]
    return o


def _json_default(o: Any) -> Any:
    if isinstance(o, (set, tuple)):
        return list(o)
    return str(o)
