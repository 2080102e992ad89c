"""The miner process: a :class:`StageWorker` behind a signed HTTP server, registered on chain.

Routes (all signed POSTs, btauth/1; see :mod:`iota_subnet.protocol.messages`):

* ``/tickets``, ``/hop``: the data plane (:mod:`iota_subnet.miner.dataplane_http`): tickets from
  validators with a permit to a stage-0 miner, hops between the miners a ticket names
* ``/state``    StateRequest -> StateResponse (validators, and miners of the same stage)
* ``/audit/trace``, ``/audit/project``, ``/audit/open`` (validators): the three rounds of a hop audit
  over the audit window (:mod:`iota_subnet.miner.hop_store`, :mod:`iota_subnet.miner.hop_audit_routes`);
  ``/audit/update`` UpdateAuditRequest -> UpdateAuditResponse (validators): rows of a committed inner
  step with Merkle proofs (:mod:`iota_subnet.miner.update_store`); ``/audit/merge``
  MergeAuditRequest -> MergeAuditResponse (validators, with merging): chunks of a merge slice or mean
  this replica signed (:mod:`iota_subnet.merge.claims`). Both answer from stored copies, never
  waiting for the compute thread or a running merge.
* ``/health``   Health -> Health           (any registered hotkey; ``ready`` is False while syncing; 503
  while a supervised task keeps failing, :mod:`iota_subnet.miner.health`); ``GET /health`` the same, public
* ``/merge/join|contribute|result|contribution``, ``/state/chunk``: replica merging and state sync
  (replicas of the same stage only; see :mod:`iota_subnet.merge`), when ``merge`` is configured;
  ``/evidence`` (validators): the merge mismatch evidence this replica recorded
* ``GET /metrics`` Prometheus text (unauthenticated; names in the README), ``GET /ops/reach`` and
  ``GET /ops/bandwidth`` (``iota-subnet doctor``'s peer probes, :mod:`iota_subnet.doctor.probe`)

Every long-lived task (the data plane's loops, the chain round of :meth:`MinerService.run`, merges,
catch-up, the dashboard) runs under the miner's one :class:`~iota_subnet.utils.supervise.Supervisor`:
logged and restarted after an exception, shown in ``status.json`` (``tasks``) and the metrics.

Compute runs on one dedicated thread (:mod:`iota_subnet.miner.compute_thread`), so the event loop keeps
answering (health, refusals) while a stage computes. The audit routes are mounted by
:mod:`iota_subnet.miner.audits`, the merge routes by :mod:`iota_subnet.miner.merging`; who may call which
route is decided by :class:`~iota_subnet.miner.chain_view.RouteAuth`.
"""
from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any, Optional

from loguru import logger

from iota_subnet.chain import Chain
from iota_subnet.chain.publisher import ChainPublisher
from iota_subnet.chain.registration import ensure_registered
from iota_subnet.config import ConfigError, RunConfig
from iota_subnet.config_hash import config_hash
from iota_subnet.dashboard import DashboardServer, MinerSource
from iota_subnet.data import DataError, build_dataset, fingerprints
from iota_subnet.miner.audits import MinerAudits
from iota_subnet.miner.chain_view import ChainView, RouteAuth
from iota_subnet.miner.checkpoints import Checkpoints
from iota_subnet.miner.compute_thread import ComputeThread
from iota_subnet.miner.dataplane import DataPlaneTunables
from iota_subnet.miner.dataplane_http import DataPlaneNode, NodeLinks, NodeParts
from iota_subnet.miner.health import miner_health
from iota_subnet.miner.lane_handover import take_lane
from iota_subnet.miner.merging import MergingLinks, MinerMerging
from iota_subnet.miner.options import MinerOptions
from iota_subnet.miner.parts import MinerParts
from iota_subnet.miner.relaying import MinerRelays
from iota_subnet.miner.stage_worker import StageWorker
from iota_subnet.miner.tickets import TicketShape
from iota_subnet.miner.update_store import UpdateStore
from iota_subnet.model import bottleneck_dims
from iota_subnet.protocol import Health, Outcome, ProtocolError, StateRequest, StateResponse
from iota_subnet.protocol.commitment import MINER, RunCommitment, RunMismatchError
from iota_subnet.telemetry import NeuronMetrics, health_handler
from iota_subnet.train.checkpoint import sweep_stray_temporaries
from iota_subnet.transport import NeuronServer
from iota_subnet.transport.paths import path_book
from iota_subnet.transport.probe import PeerProbe
from iota_subnet.utils.aio import StopRequested, until_stopped
from iota_subnet.utils.atomic import atomic_write_json
from iota_subnet.utils.run_folder import hand_over
from iota_subnet.utils.supervise import Supervisor

#: Largest micro-batch (rows) a miner accepts; bounds the memory one request can claim.
MAX_MICRO_BATCH_ROWS = 64


def in_flight_window(cfg: RunConfig, requested: Optional[int], bound: Optional[int]) -> int:
    """Micro-batches the first stage keeps waiting for their backward: ``requested``, or by default one
    lane step's worth (with a flush per lane step no more can be in flight), never above what the
    device's memory holds (``bound``)."""
    per_step = cfg.train.batch_size // cfg.train.micro_batch
    w = int(requested) if requested else per_step
    return max(1, min(w, bound) if bound else w)


class MinerService:
    """One miner: registration, stage choice, serving, status; the composition root of its parts.

    ``opts``: what it is told to do (:class:`~iota_subnet.miner.options.MinerOptions`). ``parts``: the
    factories of its worker, merge engine and audit routes (:class:`~iota_subnet.miner.parts.MinerParts`;
    None: the production parts). ``supervisor``: runs and restarts its long-lived tasks (None:
    ``Supervisor("miner")``).

    Its parts, built here and set up in :meth:`start`: ``view`` (the chain view: metagraph, commitments,
    uid, stage, peers; :mod:`iota_subnet.miner.chain_view`), ``compute`` (the compute thread),
    ``checkpoints`` (:mod:`iota_subnet.miner.checkpoints`), ``audits`` (:mod:`iota_subnet.miner.audits`),
    ``merging`` (:mod:`iota_subnet.miner.merging`) and, once started, the ``worker``, the ``server`` and
    the data plane's ``node``.
    """

    def __init__(self, cfg: RunConfig, wallet: Any, chain: Chain, opts: MinerOptions, *,
                 parts: Optional[MinerParts] = None, supervisor: Optional[Supervisor] = None):
        self.cfg, self.wallet, self.chain, self.opts = cfg, wallet, chain, opts
        self.netuid, self.run_id, self.run_epoch = opts.netuid, opts.run_id, int(opts.run_epoch)
        #: the tokenizer and data fingerprints (given, or those of the data built at start)
        self.fingerprints = opts.fingerprints
        #: the run's spec hash (:func:`iota_subnet.config_hash.config_hash` of ``cfg``), published as ``h``
        self.spec_hash = config_hash(cfg)
        self.publisher = ChainPublisher(chain, wallet, opts.netuid)
        self.out = Path(opts.out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.port = opts.serve.port
        self.device, self.audit_window = opts.device, int(opts.audit_window)
        self.total_steps = opts.total_steps or cfg.train.total_steps
        #: the factories of this miner's parts (production ones unless an entry point gives others)
        self.parts = parts if parts is not None else MinerParts()
        #: the head's and tail's TokenDataset (built from ``opts.data`` at start unless given)
        self.dataset: Any = opts.data.dataset
        self.hotkey: str = wallet.hotkey.ss58_address
        self.started_at = time.time()
        self.sup = supervisor if supervisor is not None else Supervisor("miner")
        #: Prometheus metrics (GET /metrics): served requests, merges, and this miner's status()
        self.metrics = NeuronMetrics("miner")
        self.metrics.watch(self.status)
        self.view = ChainView(chain, netuid=opts.netuid, run_id=opts.run_id, run_epoch=self.run_epoch,
                              hotkey=self.hotkey, refresh_s=opts.metagraph_refresh_s)
        self.relays = MinerRelays(opts.serve.relays, self.view, wallet)
        self.compute = ComputeThread()
        self.checkpoints = Checkpoints(self.out, opts.checkpoint_every, compute=self.compute, view=self.view,
                                       wallet=wallet, updates=self.update_store)
        self.audits = MinerAudits(cfg, self.out, self.audit_window, run_id=opts.run_id, parts=self.parts)
        self.merging = MinerMerging(cfg, wallet, out=self.out, view=self.view, compute=self.compute,
                                    checkpoints=self.checkpoints, audits=self.audits,
                                    links=MergingLinks(metrics=self.metrics, supervisor=self.sup, parts=self.parts,
                                                       write_status=self.write_status))
        self.worker: Optional[StageWorker] = None
        self.server: Optional[NeuronServer] = None
        self.node: Optional[DataPlaneNode] = None
        self.dashboard: Optional[DashboardServer] = None

    # ---- what the parts hold -----------------------------------------------------------------------
    @property
    def uid(self) -> Optional[int]:
        """This hotkey's uid (None: not registered)."""
        return self.view.uid

    @property
    def stage(self) -> Optional[int]:
        """The stage this miner holds (None until :meth:`start` chose it)."""
        return self.view.stage

    @property
    def merge(self):
        """The merge engine (:class:`~iota_subnet.merge.engine.MergeEngine`; None: not merging)."""
        return self.merging.engine

    async def refresh(self, force: bool = False) -> None:
        """Re-read metagraph and commitments (:meth:`ChainView.refresh`)."""
        await self.view.refresh(force)

    def update_store(self) -> Optional[UpdateStore]:
        """The stage's update store (None before :meth:`start` built the worker, or with audits off);
        checkpoints are written from its copies (:mod:`iota_subnet.miner.checkpoints`)."""
        return self.worker.updates if self.worker is not None else None

    def audit_spill(self):
        """Where audit copies go once hashed (None when audits are off; :meth:`MinerAudits.spill_dir`)."""
        return self.audits.spill_dir()

    async def peer_weights(self) -> dict:
        """The weights (state dict, host tensors) of the first replica of this stage that answers
        ``/state``, or {} when none does."""
        got = await self.checkpoints.peer_state(timeout_s=20, retries=0)
        return dict(got[1].tensors) if got is not None else {}

    def commitment(self) -> str:
        return RunCommitment(self.run_id, MINER, self.run_epoch, stage=self.stage,
                             fingerprints=self.fingerprints, relays=self.relays.endpoints(),
                             spec_hash=self.spec_hash).encode()

    # ---- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> int:
        """Register (only when asked), pick the stage, load weights, serve and publish (only what
        changed; rate-limited publications are retried from :meth:`run`). Returns the port."""
        o, view = self.opts, self.view
        sweep_stray_temporaries(self.out)
        hand_over(self.out, self.run_id, self.run_epoch, ["stage*.safetensors", "status.json"])
        view.uid = await ensure_registered(self.chain, self.wallet, self.netuid, register=o.register,
                                           max_burn_tao=o.max_burn_tao)
        await view.refresh(force=True)
        view.check_fingerprints(self.fingerprints)
        view.check_spec_hash(self.spec_hash)
        view.stage = view.choose_stage(o.stage, self.cfg.pipeline.stages)
        self.worker, bound = self.parts.make_worker(self, self.stage)
        await self.checkpoints.resume(self.worker, merging=self.cfg.merge.enabled)
        T, mb = self.cfg.data.seq_len, MAX_MICRO_BATCH_ROWS
        b, _ = bottleneck_dims(self.cfg.model, self.cfg.pipeline)
        spec = self.worker.spec
        self.server = NeuronServer(self.wallet, o.serve.host, await self._listen_port(), authorizer=RouteAuth(view),
                                   nonce_store_path=self.out / "nonces.sqlite",
                                   max_body_bytes=mb * T * max(b, 2) * 4 * 2 + (1 << 20))
        self.server.add_route("/state", self._state, StateRequest, None)
        self.server.add_route("/health", self._health, Health, None)
        self.audits.mount(self.server, self.worker, self.stage)
        if self.cfg.merge.enabled and self.worker.merge_module is not None:   # emulated stages: a proxy
            self.merging.mount(self.server, self.worker)
        rows = await self._row_source() if (spec.is_head or spec.is_tail) else None
        links = NodeLinks(neurons=lambda: view.neurons, endpoint_of=view.endpoint_of,
                          refresh=lambda: view.refresh(force=True),
                          gate=self.merging.gate if self.merge is not None else None,
                          after_compute=self.merging.maybe_merge,
                          take_lane=self._take_lane if self.worker.has_weights else None,
                          relays_of=view.relays_of)
        tunables = DataPlaneTunables(max_in_flight=in_flight_window(self.cfg, o.max_in_flight, bound),
                                     hop_timeout_s=o.hop_timeout_s, boot=self.started_at)
        transport = self.parts.make_dataplane_transport(self.wallet, view.endpoint_of, links.refresh,
                                                        o.hop_timeout_s, alternates=view.relays_of)
        self.node = DataPlaneNode(self.worker, self.wallet,
                                  shape=TicketShape.of_run(self.cfg, run_id=self.run_id, width=b, max_rows=mb),
                                  stage=self.stage, compute=self.compute.run, links=links,
                                  parts=NodeParts(rows=rows, hops=self.audits.hops, updates=self.worker.updates,
                                                  supervisor=self.sup, transport=transport),
                                  tunables=tunables)
        for client in (self.node.transport.hop_client, self.node.transport.receipt_client):  # hops, receipts: metrics
            client.on_request = self.metrics.observe_hop
        self.node.mount(self.server)
        self.server.add_public_get("/metrics", self.metrics.handler)
        self.server.add_public_get("/health", health_handler(self.sup))
        for path, handler in PeerProbe().handlers().items():      # iota-subnet doctor asks peers
            self.server.add_public_get(path, handler)
        self.metrics.instrument(self.server.app)
        try:
            self.port = await self.server.start()
        except OSError:
            if not self.port and self.server.port:   # the port we served before is taken: any port
                self.server.port = 0
                self.port = await self.server.start()
            else:
                raise
        if self.relays.enabled:              # reached through relays: their address is the axon
            await self.relays.resolve()
            self.relays.open(self.server.endpoint, self.server.relay_token)
            self.publisher.set_axon(*self.relays.axon())
        else:
            self.publisher.set_axon(o.serve.external_ip, self.port)
        self.publisher.set_commitment(self.commitment())
        if not await self.publisher.sync():
            logger.warning(f"not yet published on chain: {self.publisher.status()}; retrying in the background")
        logger.info(f"miner uid {self.uid} ({self.hotkey[:10]}) serves stage {self.stage} "
                    f"(layers {spec.layers.start}-{spec.layers.stop - 1}, {self.worker.module.param_count():,} params) "
                    f"on {o.serve.external_ip}:{self.port}, inner step {self.worker.inner_step}")
        if self.merge is not None:
            self.merging.start_catch_up()
        self.node.start()
        if o.serve.dashboard_port is not None:
            self.dashboard = DashboardServer(MinerSource(status=self.status), o.serve.host, o.serve.dashboard_port,
                                             metrics=self.metrics, supervisor=self.sup)
            await self.dashboard.start()
        self.write_status()
        return self.port

    async def _take_lane(self, t) -> str:
        """The data plane's lane handover (:func:`~iota_subnet.miner.lane_handover.take_lane`)."""
        return await take_lane(t, worker=self.worker, wallet=self.wallet, view=self.view, compute=self.compute,
                               merging=self.merging if self.merge is not None else None)

    async def _row_source(self):
        """The head and the tail read token rows themselves, by the tickets' sample addresses. The
        data they build is fingerprinted and checked against what the run's validators advertise."""
        if self.dataset is None:
            d = self.opts.data

            def build():
                tok, ds = build_dataset(self.cfg.data, d.source, Path(d.cache_dir) if d.cache_dir else None,
                                        allow_fallback=d.allow_fallback)
                return ds, fingerprints(tok, ds)
            try:
                self.dataset, built = await asyncio.to_thread(build)
            except DataError as e:
                raise ConfigError(f"data: {e}") from e
            if self.fingerprints is None:
                self.fingerprints = built
        try:
            self.view.check_fingerprints(self.fingerprints)
        except RunMismatchError as e:
            if self.opts.data.source is not None or self.opts.data.dataset is not None \
                    or getattr(self.cfg.data, "hf", None) is not None:
                raise
            raise RunMismatchError(f"{e}. This miner was given no --data and read the default source; the run's "
                                   "data source is not part of its config or spec hash: pass the run's --data "
                                   "(the file or hf:// source its validators read)") from None
        spec = self.worker.spec
        # a loss mask (data.hf.mask_field) reaches the tail's loss as ignored targets (-100); a stage that is
        # also the head reads its inputs from these rows, unmasked
        return self.dataset.target_batch if spec.is_tail and not spec.is_head else self.dataset.split_batch

    async def _listen_port(self) -> int:
        """``--port``, or with port 0 the port this hotkey already serves on chain (when the address
        is ours): a restart then needs no new ``serve_axon``, which the serving rate limit could refuse."""
        return self.port or await self.publisher.served_port(self.opts.serve.external_ip)

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until ``stop`` is set; the supervised task ``chain`` refreshes the chain view,
        publishes, checkpoints and writes status every second (a round in progress may end first)."""
        try:
            chain = self.sup.spawn("chain", lambda: self._chain_rounds(stop))
            tasks = [chain]
            if self.relays.enabled:
                tasks.append(self.sup.spawn("relay", lambda: self.relays.run(stop)))
            await stop.wait()
            await asyncio.wait(tasks, timeout=10.0)
        finally:
            await self.stop()

    async def _chain_rounds(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=1.0)
            except asyncio.TimeoutError:
                pass
            try:
                await until_stopped(self.view.refresh(), stop)
                await until_stopped(self.publisher.sync(), stop)
            except StopRequested:
                return
            except Exception as e:  # noqa: BLE001 - a chain hiccup must not stop serving (next round retries)
                logger.warning(f"chain round skipped: {type(e).__name__}: {e}")
            await self.merging.block_clock()
            if self.checkpoints.due(self.worker):
                await self.checkpoint()
            self.write_status()

    async def checkpoint(self, wait: bool = False) -> None:
        """Checkpoint the stage (:meth:`Checkpoints.save`), and the merge state when merging. ``wait``:
        return only when written (shutdown)."""
        await self.checkpoints.save(self.worker, wait=wait,
                                    also=self.merging.save_state if self.merge is not None else None)

    async def stop(self) -> None:
        await self.sup.stop()
        if self.node is not None:
            await self.node.stop()
        if self.dashboard is not None:
            await self.dashboard.stop()
            self.dashboard = None
        await self.merging.close()
        if self.server is not None:
            await self.server.stop()
            self.server = None
            if self.worker is not None:
                self.write_status()         # the final counters, should the last checkpoint's write outlast
                await self.checkpoint(wait=True)    # the stop's grace (a large stage's: tens of seconds)
            self.write_status()
        if self.worker is not None and self.worker.updates is not None:
            self.worker.updates.close()
        self.audits.close()
        self.compute.shutdown()
        self.checkpoints.close()

    # ---- status --------------------------------------------------------------------------------
    def status(self) -> dict:
        """``status.json`` (and the metrics' view of it): identity, chain, tasks, the worker's progress
        and what each part reports."""
        w = self.worker
        d = {"hotkey": self.hotkey, "uid": self.uid, "stage": self.stage, "port": self.port,
             "run_id": self.run_id, "run_epoch": self.run_epoch, "chain": self.publisher.status(),
             "uptime_s": round(time.time() - self.started_at, 1), "tasks": self.sup.status()}
        d.update(self.parts.status)
        if self.dashboard is not None:
            d["dashboard"] = self.dashboard.url
        if w is not None:
            d.update({"inner_step": w.inner_step, "forwards": w.forwards, "backwards": w.backwards,
                      "tokens": w.tokens, "cache": w.cache.stats(), "busy_s": round(w.busy_s, 3)})
            if not w.has_weights:                   # emulated: its modelled update store and checkpoints
                d["modelled"] = w.modelled()
        if self.server is not None:
            d["outcomes"] = dict(self.server.outcomes)
            if self.server.shaper is not None:      # --link: the emulated uplink's counters
                d["uplink"] = self.server.shaper.stats()
        if self.node is not None:
            d["dataplane"] = self.node.status()
        audits = self.audits.status()
        if audits is not None:
            d["audits"] = audits
        merge = self.merging.status()
        if merge is not None:
            d["merge"] = merge
        relays = self.relays.status()
        if relays is not None:
            d["relay"] = relays
        # per peer hotkey that exchanged traffic with this miner: direct or relayed (via which relay)
        d["paths"] = path_book().snapshot(self.hotkey)
        return d

    def write_status(self) -> None:
        atomic_write_json(self.out / "status.json", self.status())

    # ---- handlers ------------------------------------------------------------------------------
    async def _state(self, msg: StateRequest, ctx) -> StateResponse:
        if msg.stage != self.stage:
            raise ProtocolError(Outcome.FORBIDDEN, f"this miner serves stage {self.stage}, not {msg.stage}")
        # never waits for a running merge: the merge writes the weights in one piece under the
        # worker's lock, so the snapshot is the state before or after it, named by state_meta's
        # (step, merges)

        def snapshot():
            with self.worker.lock:
                sd = {k: v.detach().to("cpu", copy=True) for k, v in self.worker.module.state_dict().items()}
                return sd, self.worker.meta()
        tensors, meta = await self.compute.run(snapshot)
        if msg.names:
            tensors = {k: v for k, v in tensors.items() if k in set(msg.names)}
        return StateResponse(run_id=self.run_id, stage=self.stage, inner_step=meta["step"], tensors=tensors,
                             state_meta=meta)

    async def _health(self, msg: Health, ctx) -> Health:
        return miner_health(self)
