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

Compute runs on one dedicated thread, so the event loop keeps answering (health, refusals)
while a stage computes.
"""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

import torch
from loguru import logger

from iota_subnet.chain import Chain
from iota_subnet.chain.publisher import ChainPublisher
from iota_subnet.chain.registration import ensure_registered
from iota_subnet.config import ConfigError, RunConfig
from iota_subnet.data import DataError, build_dataset, fingerprints
from iota_subnet.merge import MergeEngine, ModuleParams
from iota_subnet.merge.claims import MergeAuditRoute, MergeClaims
from iota_subnet.merge.sync import SnapshotDonor, SyncError, sync_state
from iota_subnet.merge.transport import HttpTransport
from iota_subnet.miner.catch_up import catch_up
from iota_subnet.miner.dataplane_http import DataPlaneNode
from iota_subnet.miner.hop_audit_routes import HopAuditRoutes
from iota_subnet.miner.lane_handover import take_lane
from iota_subnet.miner.health import miner_health
from iota_subnet.miner.hop_store import DEFAULT_KEEP_VERSIONS, HopStore
from iota_subnet.miner.parts import MinerParts
from iota_subnet.miner.stage_worker import StageWorker
from iota_subnet.utils.spill import SpillDir
from iota_subnet.model import bottleneck_dims
from iota_subnet.utils.aio import StopRequested, until_stopped
from iota_subnet.protocol import (Health, MergeAuditRequest, MergeEvidence, MergeJoin, MergePayload,
                                  MergeResultRequest, Outcome, ProtocolError, StateChunkRequest, StateRequest,
                                  StateResponse, UpdateAuditRequest, merge_payload_contract)
from iota_subnet.dashboard import DashboardServer, MinerSource
from iota_subnet.transport.probe import PeerProbe
from iota_subnet.telemetry import NeuronMetrics, health_handler
from iota_subnet.protocol.commitment import (MINER, VALIDATOR, Fingerprints, RunCommitment, RunMismatchError,
                                             merge_weights_from_commitments)
from iota_subnet.train.checkpoint import CheckpointError, read_checkpoint, sweep_stray_temporaries, tensors_bytes
from iota_subnet.transport import NeuronClient, NeuronServer, TransportError
from iota_subnet.transport.shaping import compute_slowdown
from iota_subnet.utils.atomic import atomic_write_bytes, atomic_write_json
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
    """One miner: registration, stage choice, serving, checkpoints, status.

    ``stage``: the stage to hold, or None to take the stage with the fewest replicas of this run.
    ``total_steps``: inner steps of the learning-rate schedule (None: the config's; an open-ended
    run's is None too). ``out_dir``: checkpoint, nonce store, status.
    ``register``: register an unregistered hotkey (burns TAO), at most at ``max_burn_tao``.
    ``run_epoch``: with ``run_id``, identifies the run. ``fingerprints``: the tokenizer and data
    fingerprints when this miner loads the run's data; then it refuses to join a run whose
    validators advertise others. ``parts``: the factories of its worker, merge engine and audit
    routes (:class:`~iota_subnet.miner.parts.MinerParts`; None: the production parts). ``supervisor``:
    runs and restarts its long-lived tasks (None: ``Supervisor("miner")``).
    """

    def __init__(self, cfg: RunConfig, wallet: Any, chain: Chain, *, netuid: int, run_id: str,
                 stage: Optional[int], out_dir: str | Path, host: str = "0.0.0.0", port: int = 0,
                 external_ip: str = "127.0.0.1", device: str = "cpu", total_steps: Optional[int] = None,
                 checkpoint_every: int = 10, metagraph_refresh_s: float = 5.0, register: bool = False,
                 max_burn_tao: Optional[float] = None, run_epoch: int = 0,
                 fingerprints: Optional[Fingerprints] = None,
                 data: Optional[str] = None, cache_dir: Optional[str] = None, allow_data_fallback: bool = False,
                 max_in_flight: Optional[int] = None, hop_timeout_s: float = 30.0, dataset: Any = None,
                 audit_window: int = DEFAULT_KEEP_VERSIONS, parts: Optional[MinerParts] = None,
                 dashboard_port: Optional[int] = None, supervisor: Optional[Supervisor] = None):
        self.cfg, self.wallet, self.chain = cfg, wallet, chain
        self.netuid, self.run_id, self.requested_stage = netuid, run_id, stage
        self.run_epoch = int(run_epoch)
        self.fingerprints = fingerprints
        self.max_burn_tao = max_burn_tao
        self.publisher = ChainPublisher(chain, wallet, netuid)
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.host, self.port, self.external_ip, self.device = host, port, external_ip, device
        self.total_steps = total_steps or cfg.train.total_steps
        self.checkpoint_every = checkpoint_every
        self.refresh_s = metagraph_refresh_s
        self.do_register = register
        #: the factories of this miner's parts (production ones unless an entry point gives others)
        self.parts = parts if parts is not None else MinerParts()
        #: the data source the head and tail read token rows from (see :mod:`iota_subnet.miner.dataplane`)
        self.data, self.cache_dir = data, cache_dir
        #: substitute data / tokenizer when the hub is unreachable (localnet, or asked for)
        self.allow_data_fallback = allow_data_fallback
        self.max_in_flight, self.hop_timeout_s = max_in_flight, hop_timeout_s
        #: the head's and tail's TokenDataset (built from ``data`` at start unless given)
        self.dataset: Any = dataset
        self.node: Optional[DataPlaneNode] = None
        #: the audit window: weights versions (and their hops) kept for hop audits
        #: (:class:`~iota_subnet.miner.hop_store.HopStore`) and inner steps kept for update audits
        #: (:class:`~iota_subnet.miner.update_store.UpdateStore`); 0: off (validators then count every
        #: audit of this miner as refused)
        self.audit_window = int(audit_window)
        self.spill: Optional[SpillDir] = None       # audit copies on disk (:meth:`audit_spill`), made at start
        self.hops: Optional[HopStore] = None
        self.hop_routes: Optional[HopAuditRoutes] = None
        self.hotkey: str = wallet.hotkey.ss58_address
        self.uid: Optional[int] = None
        self.stage: Optional[int] = None
        self.worker: Optional[StageWorker] = None
        self.server: Optional[NeuronServer] = None
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stage-compute")
        #: checkpoints are serialised and written here, off the compute thread (see checkpoint())
        self.ckpt_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        self._ckpt_write: Optional[asyncio.Future] = None
        self._neurons: dict[str, Any] = {}
        self._commitments: dict[str, str] = {}
        self._stages: dict[str, int] = {}
        self._last_refresh = 0.0
        self._refresh_lock = asyncio.Lock()
        self._last_ckpt_step = 0
        #: weights came from this miner's own checkpoint at start (else its merge-state file, a peer, or the seed)
        self.resumed_from_checkpoint = False
        #: inner step at which the merge engine's anchor (the merged weights) was set: by a merge, a
        #: state sync or the merge-state file (saved with it: which of checkpoint and merge state is newer)
        self.anchor_step = 0
        self.started_at = time.time()
        #: Prometheus metrics (GET /metrics): served requests, merges, and this miner's status()
        self.metrics = NeuronMetrics("miner")
        self.metrics.watch(self.status)
        self.dashboard_port = dashboard_port   # the read-only web dashboard (None: off; 0: any free port)
        self.dashboard: Optional[DashboardServer] = None
        # merging (set up in start() when the run merges replicas; see _setup_merge)
        self.merge: Optional[MergeEngine] = None
        self.donor: Optional[SnapshotDonor] = None
        self.sync_report: Optional[dict] = None   # the latest state sync (status.json merge.sync)
        self.claims: Optional[MergeClaims] = None
        self.merge_client: Optional[NeuronClient] = None
        #: set while no merge runs (compute waits on it unless ``merge.overlap``); the last epoch closed
        self._gate = asyncio.Event()
        self._gate.set()
        self._last_epoch = -1
        self._sync_task: Optional[asyncio.Task] = None
        self._merge_task: Optional[asyncio.Task] = None
        self.sup = supervisor if supervisor is not None else Supervisor("miner")

    # ---- chain view ----------------------------------------------------------------------------
    async def refresh(self, force: bool = False) -> None:
        """Re-read metagraph and commitments (at most once a second when forced)."""
        async with self._refresh_lock:
            now = time.monotonic()
            if not force and now - self._last_refresh < self.refresh_s:
                return
            if force and now - self._last_refresh < 1.0:
                return
            mg = await self.chain.metagraph(self.netuid)
            commits = await self.chain.commitments(self.netuid)
            self._neurons = {n.hotkey: n for n in mg.neurons}
            self._commitments = dict(commits)
            stages = {}
            for hk, raw in commits.items():
                c = RunCommitment.decode(raw)
                if c is not None and c.role == MINER and c.same_run(self.run_id, self.run_epoch) and hk in self._neurons:
                    stages[hk] = c.stage
            self._stages = stages
            self._track_uid()
            self._last_refresh = time.monotonic()

    def _track_uid(self) -> None:
        """Follow this hotkey's uid in the metagraph: after a deregistration it has none, after a new
        registration another one (never report a uid that now belongs to another hotkey)."""
        me = self._neurons.get(self.hotkey)
        uid = None if me is None else int(me.uid)
        if uid != self.uid:
            if uid is None:
                logger.warning(f"hotkey {self.hotkey[:10]} is no longer registered on netuid {self.netuid} (was uid "
                               f"{self.uid}); it earns nothing until registered again")
            else:
                logger.warning(f"hotkey {self.hotkey[:10]} is now uid {uid} on netuid {self.netuid} (was {self.uid})")
            self.uid = uid

    def run_fingerprints(self) -> Optional[tuple[Fingerprints, list[int]]]:
        """The fingerprints the run's validators advertise (most common), and their uids."""
        seen: dict[Fingerprints, list[int]] = {}
        for hk, raw in self._commitments.items():
            n = self._neurons.get(hk)
            c = RunCommitment.decode(raw)
            if n is None or not n.validator_permit or c is None or c.role != VALIDATOR or c.fingerprints is None:
                continue
            if c.same_run(self.run_id, self.run_epoch):
                seen.setdefault(c.fingerprints, []).append(int(n.uid))
        if not seen:
            return None
        fps, uids = max(seen.items(), key=lambda kv: len(kv[1]))
        return fps, sorted(uids)

    def check_fingerprints(self) -> None:
        """Refuse to join when this miner's data differs from what the run's validators advertise."""
        run = self.run_fingerprints()
        if self.fingerprints is None or run is None:
            return
        fps, uids = run
        bad = self.fingerprints.differs(fps)
        if bad:
            raise RunMismatchError(
                f"this miner's {' and '.join(bad)} differ from run {self.run_id!r} epoch {self.run_epoch}: ours "
                f"tokenizer {self.fingerprints.tokenizer} / data {self.fingerprints.data}, the run's (validators "
                f"{uids}) tokenizer {fps.tokenizer} / data {fps.data}; use the run's --data and config (and "
                "tokenizer cache) or another --run-id")

    def commitment(self) -> str:
        return RunCommitment(self.run_id, MINER, self.run_epoch, stage=self.stage,
                             fingerprints=self.fingerprints).encode()

    async def authorize(self, hotkey: str, route: str) -> None:
        if hotkey not in self._neurons:
            await self.refresh(force=True)
        n = self._neurons.get(hotkey)
        if n is None:
            raise ProtocolError(Outcome.UNREGISTERED_HOTKEY, f"hotkey {hotkey} is not registered on netuid {self.netuid}")
        if (route in ("/evidence", "/tickets") or route.startswith("/audit/")) \
                and not n.validator_permit:
            raise ProtocolError(Outcome.FORBIDDEN, f"{route} is for validators with a permit; uid {n.uid} has none")
        if route == "/state" and not (n.validator_permit or self._stages.get(hotkey) == self.stage):
            raise ProtocolError(Outcome.FORBIDDEN, "/state is for validators and replicas of the same stage")
        if route.startswith("/merge/") or route == "/state/chunk":
            if self._stages.get(hotkey) != self.stage:
                await self.refresh(force=True)
            if self._stages.get(hotkey) != self.stage or hotkey == self.hotkey:
                raise ProtocolError(Outcome.FORBIDDEN, f"{route} is for other replicas of stage {self.stage}")

    def choose_stage(self) -> int:
        if self.requested_stage is not None:
            if not 0 <= self.requested_stage < self.cfg.pipeline.stages:
                raise ConfigError(f"--stage {self.requested_stage} out of range: this run has "
                                 f"{self.cfg.pipeline.stages} stages (0..{self.cfg.pipeline.stages - 1})")
            return self.requested_stage
        counts = [0] * self.cfg.pipeline.stages
        for hk, s in self._stages.items():
            if hk != self.hotkey and 0 <= s < len(counts):
                counts[s] += 1
        stage = min(range(len(counts)), key=lambda s: (counts[s], s))
        logger.info(f"automatic stage choice: replicas per stage {counts} -> stage {stage}")
        return stage

    # ---- lifecycle -----------------------------------------------------------------------------
    @property
    def checkpoint_path(self) -> Path:
        return self.out / f"stage{self.stage}.safetensors"

    async def start(self) -> int:
        """Register (only when asked), pick the stage, load weights, serve and publish (only what
        changed; rate-limited publications are retried from :meth:`run`). Returns the port."""
        sweep_stray_temporaries(self.out)
        hand_over(self.out, self.run_id, self.run_epoch, ["stage*.safetensors", "status.json"])
        self.uid = await ensure_registered(self.chain, self.wallet, self.netuid, register=self.do_register,
                                           max_burn_tao=self.max_burn_tao)
        await self.refresh(force=True)
        self.check_fingerprints()
        self.stage = self.choose_stage()
        self.worker, bound = self.parts.make_worker(self, self.stage)
        await self._load_weights()
        self._last_ckpt_step = self.worker.inner_step
        T, mb = self.cfg.data.seq_len, MAX_MICRO_BATCH_ROWS
        b, _ = bottleneck_dims(self.cfg.model, self.cfg.pipeline)
        spec = self.worker.spec
        self.server = NeuronServer(self.wallet, self.host, await self._listen_port(), authorizer=self.authorize,
                                   nonce_store_path=self.out / "nonces.sqlite",
                                   max_body_bytes=mb * T * max(b, 2) * 4 * 2 + (1 << 20))
        self.server.add_route("/state", self._state, StateRequest, None)
        self.server.add_route("/health", self._health, Health, None)
        self._setup_audits()
        if self.cfg.merge.enabled and self.worker.has_weights:    # emulated stages have no weights to merge
            self._setup_merge()
        rows = await self._row_source() if (spec.is_head or spec.is_tail) else None
        self.node = DataPlaneNode(self.worker, self.wallet, cfg=self.cfg, run_id=self.run_id, stage=self.stage, width=b,
                                  max_rows=mb, neurons=lambda: self._neurons, endpoint_of=self._endpoint_of,
                                  refresh=lambda: self.refresh(force=True), compute=self._compute, rows=rows,
                                  gate=self._merge_gate if self.merge is not None else None,
                                  after_compute=self._maybe_merge,
                                  max_in_flight=in_flight_window(self.cfg, self.max_in_flight, bound),
                                  hop_timeout_s=self.hop_timeout_s, hops=self.hops, boot=self.started_at,
                                  updates=self.worker.updates, supervisor=self.sup,
                                  take_lane=(lambda t: take_lane(self, t)) if self.worker.has_weights else None)
        for client in (self.node.hop_client, self.node.receipt_client):    # hops to miners, receipts: metrics
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
        self.publisher.set_axon(self.external_ip, self.port)
        self.publisher.set_commitment(self.commitment())
        if not await self.publisher.sync():
            logger.warning(f"not yet published on chain: {self.publisher.status()}; retrying in the background")
        logger.info(f"miner uid {self.uid} ({self.hotkey[:10]}) serves stage {self.stage} "
                    f"(layers {spec.layers.start}-{spec.layers.stop - 1}, {self.worker.module.param_count():,} params) "
                    f"on {self.external_ip}:{self.port}, inner step {self.worker.inner_step}")
        if self.merge is not None:
            self._sync_task = self.sup.spawn("catch-up", self._catch_up)
        self.node.start()
        if self.dashboard_port is not None:
            self.dashboard = DashboardServer(MinerSource(status=self.status), self.host, self.dashboard_port,
                                             metrics=self.metrics, supervisor=self.sup)
            await self.dashboard.start()
        self.write_status()
        return self.port

    async def _row_source(self):
        """The head and the tail read token rows themselves, by the tickets' sample addresses. The
        data they build is fingerprinted and checked against what the run's validators advertise."""
        if self.dataset is None:
            def build():
                tok, ds = build_dataset(self.cfg.data, self.data, Path(self.cache_dir) if self.cache_dir else None,
                                        allow_fallback=self.allow_data_fallback)
                return ds, fingerprints(tok, ds)
            try:
                self.dataset, built = await asyncio.to_thread(build)
            except DataError as e:
                raise ConfigError(f"data: {e}") from e
            if self.fingerprints is None:
                self.fingerprints = built
        self.check_fingerprints()
        ds = self.dataset

        def rows(split: str, seed: int, start: int, n: int) -> torch.Tensor:
            return ds.batch(seed, start, n) if split == "train" else ds.val_batch(start, n)
        return rows

    # ---- audits (iota_subnet.miner.update_store, iota_subnet.merge.claims) -------------------------
    def audit_spill(self) -> Optional[SpillDir]:
        """Where audit copies go once hashed (``<out>/audit-spill``; None when audits are off)."""
        if self.audit_window <= 0:
            return None
        if self.spill is None:
            self.spill = SpillDir(self.out / "audit-spill")
        return self.spill

    def _setup_audits(self) -> None:
        """Hop audits (``/audit/trace|project|open``) over the last ``audit_window`` weights versions
        and ``/audit/update`` over the last ``audit_window`` inner steps (validators; real stage workers
        only: an emulated one has no weights)."""
        if not self.worker.has_weights or self.audit_window <= 0:
            return
        self.hops = HopStore(self.audit_window, shared=self.worker.updates.weights_version
                             if self.worker.updates is not None else None, spill=self.audit_spill())
        self.hop_routes = self.parts.make_hop_audit_routes(self.hops, self.cfg, run_id=self.run_id, stage=self.stage,
                                                           device=self.worker.device)
        update_route = (self.parts.make_update_audit_route(self.worker.updates, self.run_id, self.stage)
                        if self.worker.updates is not None else None)
        self.hop_routes.mount(self.server)
        if update_route is not None:
            self.server.add_route("/audit/update", update_route, UpdateAuditRequest, None)
    async def _listen_port(self) -> int:
        """``--port``, or with port 0 the port this hotkey already serves on chain (when the address
        is ours): a restart then needs no new ``serve_axon``, which the serving rate limit could refuse."""
        return self.port or await self.publisher.served_port(self.external_ip)

    # ---- merging (iota_subnet.merge) -------------------------------------------------------------
    @property
    def merge_state_path(self) -> Path:
        return self.out / f"stage{self.stage}.merge.safetensors"

    def _setup_merge(self) -> None:
        mc = self.cfg.merge
        self.merge_client = NeuronClient(self.wallet, on_request=self.metrics.observe_hop)
        transport = HttpTransport(self.merge_client, self._endpoint_of, timeout_s=mc.phase_timeout_s + 5,
                                  bytes_per_s=mc.assumed_uplink_bps / 8, reply_bytes=4 * mc.chunk_numel)
        self.claims = MergeClaims(self.wallet.hotkey, self.run_id, self.stage, int8_block=mc.int8_block,
                                  spill=self.audit_spill())
        self.merge = self.parts.make_merge_engine(self.hotkey, mc, ModuleParams(self.worker.module, self.worker.lock,
                                                                on_write=self.worker.weights_replaced), transport,
                                 run_id=self.run_id, stage=self.stage, weights_fn=self._merge_weights,
                                 work_fn=lambda: float(self.worker.trained_tokens), on_applied=self._on_merged,
                                 before_attempt=lambda: self.refresh(force=True), observer=self.claims,
                                 step_fn=lambda: self.worker.inner_step)
        self.server.add_route("/audit/merge", MergeAuditRoute(self.claims), MergeAuditRequest, None)
        self.merge.in_sync = False
        self._load_merge_state()
        self.donor = SnapshotDonor(self.run_id, self.stage, mc.sync_chunk_numel, mc.max_concurrent_transfers)
        self.donor.publish(self.merge.anchor, self.merge.momentum, self.merge.merged_epoch, self.worker.inner_step)
        self._last_epoch = self._epoch_at(self.worker.inner_step)
        P = self.merge.params.numel
        self.server.add_route("/merge/join", self._merge_route, MergeJoin, None)
        # a message holds one chunk of a slice (fp32) plus int8 scales and the JSON header
        C = min(P, mc.chunk_numel)
        self.server.add_route("/merge/contribute", self._merge_route, MergePayload,
                              merge_payload_contract(max_numel=C, block=mc.int8_block),
                              max_body_bytes=4 * C + 4 * (C // mc.int8_block + 1) + (1 << 20),
                              on_body_bytes=self._merge_body_bytes)
        self.server.add_route("/merge/result", self._merge_route, MergeResultRequest, None)
        self.server.add_route("/merge/contribution", self._merge_route, MergeResultRequest, None)
        self.server.add_route("/state/chunk", self._chunk_route, StateChunkRequest, None)
        self.server.add_route("/evidence", self._evidence_route, MergeEvidence, None)

    def _epoch_at(self, step: int) -> int:
        """Merge epoch k closes at inner step (k + 1) * H: the last closed epoch at ``step``."""
        H = self.cfg.merge.every_steps
        return step // H - 1 if H else -1

    def _endpoint_of(self, hotkey: str) -> Optional[str]:
        n = self._neurons.get(hotkey)
        if n is None or not n.axon or n.axon.startswith("0.0.0.0:0"):
            return None
        return n.axon

    def _peers(self) -> list[str]:
        return sorted(hk for hk, s in self._stages.items() if s == self.stage and hk != self.hotkey)

    def _merge_weights(self, participants: list[str]) -> dict[str, float]:
        return merge_weights_from_commitments(self._commitments, self._neurons, self.run_id, participants,
                                              self.run_epoch)

    def _merge_body_bytes(self, hotkey: str, remote: str, n: int) -> None:
        """Bytes of a merge contribution still arriving show the sender's progress (its transfer is not
        cut while they move), counted only when they come from the address the sender serves on chain
        (before its signature can be checked, a forger could otherwise keep a stalled peer looking alive;
        a sender whose outbound address differs shows progress per message only)."""
        ep = self._endpoint_of(hotkey)
        if ep is not None and ep.rsplit(":", 1)[0] == remote:
            self.merge.link.moving(hotkey, n)

    async def _merge_route(self, msg, ctx):
        self._check_header(msg)
        return await self.merge.handle(ctx.route, msg, ctx.caller_hotkey)

    async def _evidence_route(self, msg, ctx):
        """(validators) the merge mismatch evidence this replica recorded, newest last."""
        self._check_header(msg)
        return MergeEvidence(run_id=self.run_id, stage=self.stage, reports=self.merge.reports[-50:],
                             merged_epoch=int(self.merge.merged_epoch))

    async def _chunk_route(self, msg, ctx):
        self._check_header(msg)
        return await self.donor.handle(msg, ctx.caller_hotkey, on_sent=ctx.on_sent)

    def _load_merge_state(self) -> None:
        p = self.merge_state_path
        if not p.exists():
            return
        try:
            tensors, meta = read_checkpoint(p)
            # the inner step the merged weights were set at (files of older versions hold the save's step)
            merged_at = int(meta.get("anchor_step", 0))
            # the merged weights are the newest it has without a checkpoint, or with one older than the
            # merge (checkpoints come every checkpoint_every steps, merges every H: a replica killed at
            # step 23 with a step-10 checkpoint and the merged state of step 20 resumes the merged
            # weights; training on the stale step-10 weights as "in sync" would set its lane back)
            # (>=: a checkpoint due at the boundary step is taken while the lane waits at the merge
            # gate, before the merge applies; the merge state of that step holds the merged weights)
            own = not self.resumed_from_checkpoint or merged_at >= self.worker.inner_step
            self.merge.set_state(tensors["anchor"], tensors["momentum"], int(meta["merged_epoch"]), write_params=own)
            self.anchor_step = merged_at
            if own:
                why = (f"its checkpoint (inner step {self.worker.inner_step}) is older than its merge state"
                       if self.resumed_from_checkpoint else "no checkpoint")
                self.worker.inner_step = max(self.worker.inner_step, merged_at)
                logger.info(f"stage {self.stage}: {why}; resuming from the merged weights of epoch "
                            f"{self.merge.merged_epoch} at inner step {self.worker.inner_step}")
            self.merge.work_base = min(float(meta.get("work_base", self.merge.work_base)),
                                       float(self.worker.trained_tokens))
        except Exception as e:  # noqa: BLE001 - a bad file means: sync from peers
            logger.warning(f"ignoring merge state {p}: {e}")

    def _save_merge_state(self) -> None:
        data = tensors_bytes({"anchor": self.merge.anchor.contiguous().cpu(),
                              "momentum": self.merge.momentum.contiguous().cpu()},
                             {"merged_epoch": self.merge.merged_epoch, "step": self.anchor_step,
                              "anchor_step": self.anchor_step, "work_base": self.merge.work_base})
        atomic_write_bytes(self.merge_state_path, data)

    async def _on_merged(self, rep) -> None:
        self.anchor_step = self.worker.inner_step
        self.donor.publish(self.merge.anchor, self.merge.momentum, self.merge.merged_epoch, self.worker.inner_step)
        await asyncio.get_running_loop().run_in_executor(None, self._save_merge_state)
        logger.info(f"stage {self.stage}: merge epoch {rep.epoch} applied with {len(rep.participants)} replicas "
                    f"in {rep.wall_s:.2f}s ({rep.bytes_sent:,} B sent, {rep.bytes_received:,} B received)")

    async def _catch_up(self) -> None:
        """On start: sync from peers when they merged an epoch this replica has not; then in sync
        (:mod:`iota_subnet.miner.catch_up`: waits for an answer rather than trusting a silence)."""
        mc = self.cfg.merge
        try:
            res = await catch_up(self.merge, self._peers, lambda e: self.pull_merged_state(min_epoch=e),
                                 own_state=self.resumed_from_checkpoint or self.merge.merged_epoch >= 0,
                                 ask_timeout_s=min(5.0, mc.join_timeout_s), max_wait_s=4 * mc.join_timeout_s)
            logger.info(f"stage {self.stage}: catch-up {res.how} after {res.wall_s:.1f} s ({res.rounds} rounds); "
                        f"merged epoch {self.merge.merged_epoch}, inner step {self.worker.inner_step}")
        finally:
            self.merge.in_sync = True

    async def pull_merged_state(self, min_epoch: int = -1, keep_progress: bool = False) -> bool:
        """State sync from every peer at once; applies all or nothing. Returns True when applied.
        ``keep_progress``: keep this replica's progress since its old anchor on top of the pulled one
        (:meth:`~iota_subnet.merge.engine.MergeEngine.set_state`; a replica late to a merge)."""
        was_in_sync, self.merge.in_sync = self.merge.in_sync, False
        # status.json's merge.sync: how the state sync goes; missing_chunks names the chunks of the last
        # failed attempt that no donor delivered
        self.sync_report = {"state": "syncing", "attempt": 1, "missing_chunks": [], "error": None}
        try:
            for attempt in range(3):
                try:
                    anchor, mom, man = await sync_state(self._peers(), self.merge.transport, run_id=self.run_id,
                                                        stage=self.stage, param_numel=self.merge.params.numel,
                                                        work_dir=self.out / "sync", min_epoch=min_epoch,
                                                        window=self.cfg.merge.sync_window)
                except SyncError as e:
                    logger.warning(f"state sync attempt {attempt + 1} failed: {e}")
                    self.sync_report = {"state": "syncing" if attempt < 2 else "failed", "attempt": attempt + 1,
                                        "missing_chunks": list(e.missing), "error": str(e)}
                    self.write_status()
                    await asyncio.sleep(2.0 ** attempt)     # backoff; the next try may find a later snapshot
                    continue

                def apply():
                    with self.worker.lock:
                        self.merge.set_state(anchor, mom, man["merged_epoch"], keep_progress=keep_progress)
                        # no lane drives it yet: start at the donors' inner step (in a lane, the lane's step
                        # stays). Not (merged_epoch + 1) x H: epochs are labels the replicas agree on and run
                        # ahead of the steps under churn (a joiner could come up at inner step 65 while the
                        # lanes are at 41-52, and the validator would count its lane's steps 51-64 done)
                        if self.worker.auto_step:
                            self.worker.inner_step = max(self.worker.inner_step, int(man.get("step", 0)))
                        self.worker.opt.zero_grad(set_to_none=True)
                        self.worker.pending = 0
                        # also with kept progress: on a restart the merge state (this anchor) must not look
                        # older than a checkpoint taken before this pull (its weights sit on the old anchor)
                        self.anchor_step = self.worker.inner_step
                await self._compute(apply)
                self._last_epoch = max(self._last_epoch, man["merged_epoch"])
                self.donor.publish(self.merge.anchor, self.merge.momentum, self.merge.merged_epoch,
                                   self.worker.inner_step)
                await asyncio.get_running_loop().run_in_executor(None, self._save_merge_state)
                logger.info(f"stage {self.stage}: synced merged state of epoch {man['merged_epoch']} from "
                            f"{len(man['sync']['donors'])} peers ({man['sync']})")
                self.sync_report = {"state": "synced", "attempt": attempt + 1, "missing_chunks": [], "error": None,
                                    "merged_epoch": man["merged_epoch"]}
                return True
            return False
        finally:
            self.merge.in_sync = was_in_sync     # the catch-up declares it in sync when it is done

    def _maybe_merge(self) -> None:
        """After a compute: start the merge of the epoch that just closed (by inner steps or blocks)."""
        if self.merge is None or (self._merge_task is not None and not self._merge_task.done()):
            return
        epoch = self._epoch_at(self.worker.inner_step)
        if epoch <= self._last_epoch:
            return
        jumped_from, jumped_to = self.worker.last_skip
        H = self.cfg.merge.every_steps
        boundary = (epoch + 1) * H
        if jumped_from < boundary < jumped_to or (jumped_to == boundary and boundary - jumped_from > H // 2):
            # it jumped to its lane's step past this boundary (restarted behind the lane, or a lane step
            # went past it): its peers merged that epoch without it. Proposing one here would make it
            # ready for a *later* epoch (labels never repeat) at once, pausing its lane until the peers
            # get there (26-30 s stalls of both lanes in a localnet after a SIGKILL). The next
            # boundary it trains to merges as usual (a peer holding newer merged weights then says
            # so, and it pulls them). A short jump that lands *on* the boundary (it trained at least
            # half the window and missed its last steps, e.g. a slow link) merges now: its peers are
            # at this boundary too, and skipping it would leave the replica unmerged, merging alone,
            # then pulling. A long one does not: a replica restarted from an old checkpoint that jumps
            # 8 steps onto the boundary may see other merge weights than its peer right after the
            # restart and hold it 30 s in a failed attempt (plan mismatch). Either way the epoch is closed here,
            # so peers at that boundary do not wait for this replica.
            logger.info(f"stage {self.stage}: jumped from inner step {jumped_from} to {jumped_to} over the merge "
                        f"boundary of epoch {epoch} (step {boundary}); merging again at the next boundary")
            self._last_epoch = epoch
            self.merge.skip(self.merge.next_epoch(epoch))     # the label a merge here would have used
            return
        self._start_merge(epoch)

    def _start_merge(self, epoch: int) -> None:
        self._last_epoch = epoch
        self._gate.clear()
        self._merge_task = self.sup.spawn("merge", lambda: self._run_merge(epoch))

    async def _run_merge(self, epoch: int) -> None:
        try:
            updates = getattr(self.worker, "updates", None)
            if updates is not None:          # the last step's audit copies leave host memory before the merge's
                await asyncio.to_thread(updates.settle)      # buffers arrive (iota_subnet.host_plan)
            rep = await self.merge.merge(epoch, self._peers)     # re-read after each attempt's refresh
            self.metrics.observe_merge(rep.status, rep.wall_s, rep.bytes_sent, rep.bytes_received)
            if rep.status == "late":        # a peer holds a newer merged state (not necessarily this epoch's)
                rep = await self._late_to_merge(rep)
            if rep.status not in ("merged", "late"):
                logger.info(f"stage {self.stage}: merge epoch {epoch} {rep.status}: {rep.reason}")
        except Exception:  # noqa: BLE001 - a merge failure must never stop serving
            logger.exception(f"merge epoch {epoch} failed")
        finally:
            self._gate.set()

    async def _late_to_merge(self, rep):
        """A peer merged a later epoch than this replica's merged state (``rep``: the late report of
        epoch ``rep.epoch``). Pull the merged state; keep this replica's progress since its anchor when
        that spans at most two merge windows and training goes on (never at the last step: replicas
        end bit-identical), and join ``rep.epoch`` again when the peers have not merged it yet (they
        wait for a replica at their boundary while it pulls: :meth:`MergeEngine._join`). Were
        the progress dropped, the replica would stay one merged epoch behind at every later boundary,
        late again each time. Otherwise the epoch is closed here (peers
        stop waiting). Returns the report of the epoch's last merge."""
        H = self.cfg.merge.every_steps
        span = self.worker.inner_step - self.anchor_step      # since its last merge or pull
        total = self.worker.total_steps
        keep = H > 0 and 0 < span <= 2 * H and (total is None or self.worker.inner_step < total)
        since = self.anchor_step
        pulled = await self.pull_merged_state(min_epoch=self.merge.merged_epoch + 1, keep_progress=keep)
        if not (pulled and keep and self.merge.merged_epoch < rep.epoch):
            self.merge.skip(rep.epoch)
            if pulled and keep:
                logger.info(f"stage {self.stage}: late to merge epoch {rep.epoch}; its progress of inner steps "
                            f"{since}-{self.worker.inner_step} goes into its next merge")
            return rep
        again = await self.merge.merge(rep.epoch, self._peers)
        self.metrics.observe_merge(again.status, again.wall_s, again.bytes_sent, again.bytes_received)
        if again.status == "late":          # merged meanwhile without it: the next merge takes its progress
            self.merge.skip(again.epoch)
        return again

    async def _load_weights(self) -> None:
        """Latest own checkpoint, else a replica of the same stage, else the run's seeded init."""
        try:
            if await asyncio.get_running_loop().run_in_executor(self.pool, self.worker.load, self.checkpoint_path):
                self.resumed_from_checkpoint = True
                return
        except CheckpointError as e:
            logger.warning(f"ignoring checkpoint: {e}")
        if self.cfg.merge.enabled and self.worker.has_weights:
            return      # merging: its merge-state file, else the catch-up's state sync once it is published (_catch_up)
        got = await self._peer_state_response(timeout_s=30, retries=1)
        if got is not None:
            uid, resp = got
            try:
                self.worker.module.load_state_dict(resp.tensors, strict=True)
                self.worker.inner_step = int(resp.state_meta.get("step", 0))
                logger.info(f"stage {self.stage}: weights synced from uid {uid} at inner step {self.worker.inner_step}")
                return
            except RuntimeError as e:
                logger.warning(f"state from uid {uid} does not fit this stage: {e}")
        logger.info(f"stage {self.stage}: no usable peer state; starting from the run's seeded initialisation")

    async def _peer_state_response(self, timeout_s: float, retries: int) -> Optional[tuple[int, StateResponse]]:
        """(uid, /state answer) of the first replica of this stage that answers, or None."""
        peers = [hk for hk, s in self._stages.items() if s == self.stage and hk != self.hotkey]
        async with NeuronClient(self.wallet) as client:
            for hk in peers:
                n = self._neurons.get(hk)
                if n is None or not n.axon or n.axon.startswith("0.0.0.0:0"):
                    continue
                try:
                    resp = await client.call(n.axon, hk, "/state", StateRequest(run_id=self.run_id, stage=self.stage),
                                             StateResponse, timeout_s=timeout_s, retries=retries)
                    return n.uid, resp
                except (TransportError, ProtocolError) as e:
                    logger.warning(f"state from {hk[:10]} failed: {e}")
        return None

    async def peer_weights(self) -> dict:
        """The weights (state dict, host tensors) of the first replica of this stage that answers
        ``/state``, or {} when none does."""
        got = await self._peer_state_response(timeout_s=20, retries=0)
        return dict(got[1].tensors) if got is not None else {}

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until ``stop`` is set; the supervised task ``chain`` refreshes the chain view,
        publishes, checkpoints and writes status every second (a round in progress may end first)."""
        try:
            chain = self.sup.spawn("chain", lambda: self._chain_rounds(stop))
            await stop.wait()
            await asyncio.wait([chain], timeout=10.0)
        finally:
            await self.stop()

    async def _chain_rounds(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=1.0)
            except asyncio.TimeoutError:
                pass
            try:
                await until_stopped(self.refresh(), stop)
                await until_stopped(self.publisher.sync(), stop)
            except StopRequested:
                return
            except Exception as e:  # noqa: BLE001 - a chain hiccup must not stop serving (next round retries)
                logger.warning(f"chain round skipped: {type(e).__name__}: {e}")
            if self.merge is not None and self.cfg.merge.every_blocks:
                try:
                    epoch = await self.chain.block() // self.cfg.merge.every_blocks - 1
                    if epoch > self._last_epoch and (self._merge_task is None or self._merge_task.done()):
                        self._start_merge(epoch)
                except Exception as e:  # noqa: BLE001
                    logger.warning(f"block-clock merge check failed: {e}")
            if self.worker.inner_step - self._last_ckpt_step >= self.checkpoint_every:
                await self.checkpoint()
            self.write_status()

    async def checkpoint(self, wait: bool = False) -> None:
        """Snapshot weights + optimizer state on the compute thread (host copies only), then serialise
        and write them on the checkpoint-writer thread while training goes on. A checkpoint due while
        the previous one is still being written is skipped (the next one is taken later). ``wait``:
        return only when written (shutdown)."""
        loop = asyncio.get_running_loop()
        if self._ckpt_write is not None and not self._ckpt_write.done():
            if not wait:
                return
            await self._ckpt_write
        step = self.worker.inner_step
        t0 = time.monotonic()
        snap = await loop.run_in_executor(self.pool, self.worker.snapshot)
        paused = time.monotonic() - t0
        self._ckpt_write = loop.run_in_executor(self.ckpt_pool, self.worker.write_snapshot, snap, self.checkpoint_path)
        self._last_ckpt_step = step
        if self.merge is not None:
            await loop.run_in_executor(None, self._save_merge_state)
        if wait:
            await self._ckpt_write
        logger.debug(f"checkpoint at inner step {step} -> {self.checkpoint_path} (compute paused {paused:.3f}s "
                     f"for the host snapshot)")

    async def stop(self) -> None:
        await self.sup.stop()
        if self.node is not None:
            await self.node.stop()
        if self.dashboard is not None:
            await self.dashboard.stop()
            self.dashboard = None
        if self.merge_client is not None:
            await self.merge_client.close()
        if self.server is not None:
            await self.server.stop()
            self.server = None
            if self.worker is not None:
                await self.checkpoint(wait=True)
            self.write_status()
        if self.worker is not None and self.worker.updates is not None:
            self.worker.updates.close()
        if self.hops is not None:
            self.hops.close()
        self.pool.shutdown(wait=False)
        self.ckpt_pool.shutdown(wait=True)

    def status(self) -> dict:
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
        if self.server is not None:
            d["outcomes"] = dict(self.server.outcomes)
            if self.server.shaper is not None:      # --link: the emulated uplink's counters
                d["uplink"] = self.server.shaper.stats()
        if self.node is not None:
            d["dataplane"] = self.node.status()
        if self.hops is not None:
            d["audits"] = {"window": self.hops.status(), "hop_sessions": self.hop_routes.status(),
                           "window_bytes": self.hops.nbytes}
        if self.merge is not None:
            d["merge"] = self.merge.status()
            d["merge"]["mismatch_evidence"] = self.merge.reports[-10:]
            d["merge"]["sync"] = self.sync_report
        return d

    def write_status(self) -> None:
        atomic_write_json(self.out / "status.json", self.status())

    # ---- handlers ------------------------------------------------------------------------------
    def _check_header(self, msg) -> None:
        if msg.run_id != self.run_id:
            raise ProtocolError(Outcome.FORBIDDEN, f"this miner trains run {self.run_id!r}, not {msg.run_id!r}")
        if msg.stage != self.stage:
            raise ProtocolError(Outcome.FORBIDDEN, f"this miner serves stage {self.stage}, not {msg.stage}")

    async def _compute(self, fn, *args, **kw):
        """Run ``fn`` on the compute thread. Under a chaos ``slow`` event (``--link-control``) the
        thread stays busy ``factor`` times as long, as a slower accelerator would."""
        def run():
            t0 = time.perf_counter()
            out = fn(*args, **kw)
            factor = compute_slowdown()
            if factor > 1.0:
                time.sleep((factor - 1.0) * (time.perf_counter() - t0))
            return out
        return await asyncio.get_running_loop().run_in_executor(self.pool, run)

    async def _merge_gate(self) -> None:
        """The data plane's gate before each compute: waits for a running merge unless ``merge.overlap``."""
        await self._await_merge(training=True)

    async def _await_merge(self, training: bool = False) -> None:
        """Wait for a running replica merge to finish; BUSY (503) if it outlasts its own deadlines.
        With ``merge.overlap`` training goes on during a merge (``training``: a training forward) and
        only evaluation waits. ``/state`` and the audit routes never wait: they read kept state."""
        if self._gate.is_set() or (training and self.cfg.merge.overlap):
            return
        mc = self.cfg.merge
        try:
            await asyncio.wait_for(self._gate.wait(), timeout=mc.join_timeout_s + 3 * mc.phase_timeout_s)
        except asyncio.TimeoutError:
            raise ProtocolError(Outcome.BUSY, "merging with the other replicas") from None

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
        tensors, meta = await self._compute(snapshot)
        if msg.names:
            tensors = {k: v for k, v in tensors.items() if k in set(msg.names)}
        return StateResponse(run_id=self.run_id, stage=self.stage, inner_step=meta["step"], tensors=tensors,
                             state_meta=meta)

    async def _health(self, msg: Health, ctx) -> Health:
        return miner_health(self)
