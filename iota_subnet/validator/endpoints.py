"""What the validator serves: its own signed server (``/receipts`` and ``/refusals`` from miners,
public ``GET /scores``, ``/run/spec`` (the run's spec, :mod:`iota_subnet.protocol.run_spec`), ``/metrics``,
``/health`` and the peer probe), published on chain, and the
read-only web dashboard (``dashboard_port``, :mod:`iota_subnet.dashboard`)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from aiohttp import web
from loguru import logger

from iota_subnet.dashboard import DashboardServer, ValidatorSource, health_poller
from iota_subnet.protocol import Outcome, ProtocolError
from iota_subnet.protocol.run_spec import SPEC_HASH_HEADER, SPEC_ROUTE
from iota_subnet.telemetry import NeuronMetrics, health_handler
from iota_subnet.transport import NeuronClient, NeuronServer
from iota_subnet.transport.probe import PeerProbe
from iota_subnet.transport.relay import RelayHost
from iota_subnet.utils.supervise import Supervisor

from .control_routes import control_routes
from .options import OutputOptions


class ValidatorEndpoints:
    """The validator's server (:attr:`server`) and dashboard (:attr:`dashboard`); ``out``: the state
    folder (its nonce store); ``prom``/``sup``: the metrics and the supervisor they expose."""

    def __init__(self, opts: OutputOptions, out: Path, prom: NeuronMetrics, sup: Supervisor):
        self.opts = opts
        self.out = out
        self.prom = prom
        self.sup = sup
        self.server: Any = None   # NeuronServer: /receipts, GET /scores
        self.dashboard: Optional[DashboardServer] = None
        self._dashboard_client: Optional[NeuronClient] = None
        #: the relay for miners that cannot be dialled (``relay_host``; built with the server)
        self.relay: Optional[RelayHost] = None

    async def serve(self, svc: Any) -> None:
        """The validator's own server for validator ``svc``: miners deliver receipts (``/receipts``,
        signed, registered hotkeys) and evidence of hops they refused (``/refusals``, :mod:`.blame`)
        (both :func:`.control_routes.control_routes`); ``GET /scores`` and ``GET /run/spec`` (the run's
        canonical config, whose sha256 its commitment advertises) are public and read-only. Its endpoint is published on chain."""
        run_id = svc.opts.run.run_id

        async def scores(_request):
            return web.json_response(svc.scores.explained or {"miners": []})

        async def run_spec(_request):          # content addressed: the reader checks it against the hash
            return web.Response(text=svc.spec_text, content_type="text/yaml",
                                headers={SPEC_HASH_HEADER: svc.spec_hash})

        async def authorize(hotkey: str, route: str) -> None:
            if hotkey not in svc.current.values():
                await svc.sync()
            if hotkey not in svc.current.values():
                raise ProtocolError(Outcome.UNREGISTERED_HOTKEY, f"hotkey {hotkey} is not registered on netuid "
                                                                  f"{svc.opts.chain.netuid}")

        o = self.opts
        # --port, else the port already served on chain (a restart then re-publishes nothing)
        want = int(o.port) or await svc.publisher.served_port(o.external_ip)
        self.server = NeuronServer(svc.wallet, o.host, want, authorizer=authorize,
                                   nonce_store_path=self.out / "nonces.sqlite", max_body_bytes=8 << 20)
        def on_updates(hotkey: str, updates: list) -> None:
            if svc.auditing is not None:
                svc.auditing.on_updates(hotkey, updates)

        for r in control_routes(run_id, lambda: svc.driver, on_updates):
            self.server.add_route(r.path, r.handler, r.message_type, r.contract_fn, max_body_bytes=r.max_body_bytes,
                                  on_refused=r.on_refused)
        self.server.add_public_get("/scores", scores)
        self.server.add_public_get(SPEC_ROUTE, run_spec)
        self.server.add_public_get("/metrics", self.prom.handler)
        self.server.add_public_get("/health", health_handler(self.sup))
        for path, handler in PeerProbe().handlers().items():      # iota-subnet doctor asks peers
            self.server.add_public_get(path, handler)
        if o.relay_host:          # registered hotkeys may attach; who is relayed shows in status.json
            self.relay = RelayHost(svc.wallet, authorize=lambda hk: hk in svc.current.values(),
                                   rate_bytes_per_s=o.relay_rate_bytes_per_s)
            self.relay.mount(self.server)
        self.prom.instrument(self.server.app)
        try:
            port = await self.server.start()
        except OSError:
            if o.port:
                raise
            self.server.port = 0                  # the old port is taken: any free one (published when allowed)
            port = await self.server.start()
        svc.publisher.set_axon(o.external_ip, port)
        if not await svc.publisher.sync():
            logger.warning("not yet published on chain: {}; retrying in the background", svc.publisher.status())
        logger.info("validator serves receipts and GET /scores on {}:{} (published as {}:{})", o.host, port,
                    o.external_ip, port)

    async def serve_dashboard(self, svc: Any) -> None:
        """The read-only web dashboard of validator ``svc`` (``dashboard_port``; None: none)."""
        o = self.opts
        if o.dashboard_port is None:
            return
        self._dashboard_client = NeuronClient(svc.wallet, on_request=self.prom.observe_hop)
        src = ValidatorSource(status=svc.status, metrics_path=self.out / "metrics.jsonl", chain=svc.chain,
                              netuid=svc.opts.chain.netuid, network=svc.opts.chain.network,
                              health=health_poller(self._dashboard_client, svc.opts.run.run_id))
        self.dashboard = DashboardServer(src, o.host, o.dashboard_port, metrics=self.prom, supervisor=self.sup)
        self.prom.instrument(self.dashboard.app)
        await self.dashboard.start()
        svc.write_status()

    async def close_dashboard(self) -> None:
        if self.dashboard is not None:
            await self.dashboard.stop()
            await self._dashboard_client.close()

    async def close_server(self) -> None:
        if self.server is not None:
            await self.server.stop()
            self.server = None
