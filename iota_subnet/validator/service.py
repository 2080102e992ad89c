"""The validator process.

Start-up: load the wallet, open the chain, require a uid and a validator permit on ``netuid``
(clear :class:`ValidatorError` otherwise), load the run config and the data, open the state file
(``<out>/validator.sqlite``; a restarted validator resumes at the first lane step it had not
committed), wait until every stage has a replica of our run.

Then, concurrently:

* the control plane (:mod:`.control`) drives ``steps`` lane steps per lane (this validator's share
  of them, see :mod:`.lanes`), then evaluates through lane 0 (``train.eval_batches`` micro-batches);
* the metagraph + commitments are re-read every ``sync_interval_s`` (routing, uid -> hotkey) and
  failed replicas whose cooldown is over are probed with ``/health``;
* weights are set every tempo (when ``block - last_set >= max(tempo, weights_rate_limit)``) with
  ``version_key``; a refusal is logged and retried at the next check;
* ``status.json`` is rewritten (atomically) every ``status_interval_s``; ``metrics.jsonl`` gets a row
  per completed lane step;
* verification: audits (:mod:`.auditing`): every miner's hops are audited at least
  ``audits_per_tempo`` times per tempo, and its inner steps (update audits), chosen after its
  receipts are in, over the verification client, every ``audit_interval_s``; outcomes go to the
  :class:`~.audit_policy.AuditPolicy`. A CLASP probe round (:mod:`.clasp`) runs every
  ``clasp_interval_s``; at each weights round the :class:`~.scoring.Scoreboard` is updated (quality
  0 for a miner flagged by audits, ``clasp_penalty`` for one flagged by CLASP) and the weights come
  from it; the explained
  scores (:mod:`.explain`) go to the state file, ``status.json`` (``scores``) and, with ``port > 0``,
  ``GET http://HOST:PORT/scores`` (JSON, read-only, unauthenticated).

After the steps and the evaluation, weights keep being set every tempo until SIGTERM / SIGINT
(or, with ``exit_when_done``, until the first weights after the evaluation are set).

Every loop above, the lane driving (``train``) and the dashboard's sampler run under the validator's
one :class:`~iota_subnet.utils.supervise.Supervisor`: an exception escaping one is logged with its
traceback and the loop restarts after a backoff; ``status.json`` (``tasks``), the metrics
(``iota_task_restarts_total``) and the public ``GET /health`` (503 naming the task once one keeps
failing) show it. A :class:`ValidatorError` of the lane driving (no complete pipeline) still stops it.

status.json fields: ``hotkey, uid, run_id, netuid, lanes, lane_members, steps_done (per lane),
next_step (per lane), total_steps, validator_index, n_validators, tokens, tokens_per_s, loss (mean of
the last step of each lane), losses (per lane), reroutes, failures, lane_held_s (p2p: seconds each
lane waited at a merge window's last step for the slowest lane, :mod:`.pacing`), microbatches_ok,
microbatches_failed, live_miners, stage_replicas, replicas (per replica: uid, hotkey, stage, endpoint,
lane, available, throughput, successes, failures), miners (per uid: hotkey, stage, work, tokens,
completed, failures, reroutes), probe_loss (latest CLASP round: round, loss, paths), dashboard (its
URL or null), val_loss, done, weights_set_blocks, last_weights, scores, verification_bytes (bodies and
headers of every verification request), audits (``audits, failed, bytes, cpu_s, recent`` and
``per_tempo``: tempo -> hotkey -> hop audits; null when off), elapsed_s, updated_at, tasks`` (per
supervised task: state, restarts, failures, consecutive_failures, last_error, last_error_at).
"""
from __future__ import annotations

import asyncio
import functools
import json
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable, Optional

import torch
from aiohttp import web
from loguru import logger

from iota_subnet.chain import Chain, ChainError, open_chain
from iota_subnet.chain.publisher import ChainPublisher
from iota_subnet.config import ConfigError, RunConfig, load_config
from iota_subnet.dashboard import DashboardServer, ValidatorSource, health_poller
from iota_subnet.data import DataError, build_dataset, fingerprints
from iota_subnet.merge.deadlines import phase_deadline_s
from iota_subnet.transport.probe import PeerProbe
from iota_subnet.model import PipelineStage
from iota_subnet.neuron_common import stop_signals
from iota_subnet.telemetry import NeuronMetrics, health_handler
from iota_subnet.protocol import MergeAuditResponse, Outcome, ProtocolError, ReceiptBatch
from iota_subnet.protocol.commitment import MINER, VALIDATOR, Fingerprints, RunCommitment
from iota_subnet.protocol.messages import MAX_UPDATES_PER_BATCH
from iota_subnet.protocol.refusal import MAX_REPORT_BODY_BYTES, RefusalAck, RefusalReport
from iota_subnet.train.checkpoint import sweep_stray_temporaries
from iota_subnet.train.optim import lr_at
from iota_subnet.transport import NeuronClient, NeuronServer
from iota_subnet.utils.aio import StopRequested, until_stopped
from iota_subnet.utils.atomic import atomic_write_json, atomic_write_text
from iota_subnet.utils.run_folder import hand_over
from iota_subnet.utils.supervise import Supervisor
from iota_subnet.version import __version__, weights_version_key
from iota_subnet.wallets import WalletError
from iota_subnet.wallets import load_wallet as _load_wallet

from . import explain
from .audit_policy import AuditPolicy, merge_quality
from .auditing import AuditScheduler
from .merge_audit import MergeAuditor, record_verdicts
from .merge_weights import MergeOversight
from .pacing import StallWatch
from .clasp import attribute, quality_factors
from .blame import BlameBook
from .control import ControlOptions, ControlPlane
from .lanes import OPEN_ENDED_STEPS, LaneStepResult
from .peers import PeerView, alive_blocks_for, coordinating_validators, heartbeat_due, run_fingerprints
from .routing import Router, discover
from .reveals import PendingReveals
from .scoring import Ledger, Scoreboard, stage_compute_shares, with_burn
from .state import StateError, ValidatorState
from .update_audit import UpdateAuditor

#: Version key sent with the weights (from the package version); the chain refuses keys older than
#: the subnet's ``weights_version``, and the validator stops at start when it is older.
WEIGHTS_VERSION_KEY = weights_version_key()
#: Files of a run's state in the validator's folder (set aside when a new run starts there).
RUN_STATE_FILES = ["validator.sqlite", "validator.sqlite-wal", "validator.sqlite-shm", "metrics.jsonl", "status.json"]


class ValidatorError(RuntimeError):
    """The validator cannot start; the message says how to fix it."""


@dataclass
class ValidatorOptions:
    wallet_name: str = "default"
    wallet_hotkey: str = "default"
    wallet_path: str = "~/.bittensor/wallets"
    network: str = "devnet"
    chain_db: Optional[str] = None
    netuid: int = 9
    config: str = "configs/tiny.yaml"
    data: Optional[str] = None
    cache_dir: Optional[str] = None
    allow_data_fallback: bool = False  # substitute data / tokenizer when the hub is unreachable
    steps: Optional[int] = 10  # lane steps per lane; None: an open-ended run (until stopped)
    out: str = "runs/validator"
    run_id: str = "iota"
    run_epoch: int = 0
    chain_timeout_s: float = 30.0  # deadline of every chain call
    peer_alive_blocks: Optional[int] = None  # liveness window of the other validators (default: 2 tempos + 10)
    port: int = 0  # the validator's server: /receipts (signed) and GET /scores; 0 = any free port
    dashboard_port: Optional[int] = None  # the web dashboard and GET /metrics (None: off; 0: any free port)
    host: str = "0.0.0.0"
    external_ip: str = "127.0.0.1"  # published on chain (ServeAxon) so miners can deliver receipts
    wire_dtype: str = "bf16"  # activations and gradients on the wire (miner to miner): bf16, fp32 or int8
    ticket_lookahead: int = 8  # lane steps of tickets a head miner holds ahead
    stall_s: float = 30.0  # at most this long without progress before a lane step's micro-batches are re-issued
    audits: bool = True  # hop and update audits of every miner (off: nothing is verified but CLASP)
    audits_per_tempo: int = 1  # hop audits (and update audits) of each miner per tempo
    audit_interval_s: float = 2.0  # seconds between audit rounds (each audits the miners still due)
    # seconds a miner has to answer each round of an audit (a trace recomputation, not a training hop:
    # independent of hop_timeout_s, which sets how fast a dead training hop is routed around)
    audit_timeout_s: float = 30.0
    # seconds before each re-ask of an audit request whose connection dropped or timed out (a link
    # that blips for a few seconds must not fail an honest miner's audit); () = none
    audit_retry_s: tuple[float, ...] = (5.0, 15.0)
    clasp_interval_s: float = 5.0  # seconds between CLASP probe rounds; 0 = off
    clasp_paths: int = 6  # pathways per CLASP round
    clasp_window: int = 600  # most recent probes used for attribution
    clasp_penalty: float = 0.5  # quality factor of a CLASP-flagged miner
    score_window: int = 16  # active tempos over which verified work rates are measured
    stale_grace: int = 2  # tempos without verified work before a score counts as stale and loses weight
    burn_uid: Optional[int] = 0  # where the weight stale scores lost goes (uid 0: the subnet owner's); None: nowhere
    n_lanes: Optional[int] = None  # cap on the lanes driven (default: every complete lane)
    sync_interval_s: float = 5.0
    status_interval_s: float = 1.0
    weights_check_s: float = 2.0
    hop_timeout_s: float = 30.0
    version_key: int = WEIGHTS_VERSION_KEY
    wait_miners_s: float = 600.0
    min_lanes: int = 1  # wait (up to wait_miners_s) for this many complete lanes before driving
    exit_when_done: bool = False


def load_wallet(name: str, hotkey: str, path: str) -> Any:
    try:
        return _load_wallet(name, hotkey, path)
    except WalletError as e:
        raise ValidatorError(str(e)) from e


class MetricsWriter:
    """``metrics.jsonl``: one row per completed lane step; on resume keeps only committed steps."""

    def __init__(self, path: Path, next_steps: dict[int, int]):
        self.path = path
        rows: list[str] = []
        if path.exists() and next_steps:
            for line in path.read_text().splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    break
                if row.get("step", 0) < next_steps.get(row.get("lane"), 0):
                    rows.append(json.dumps(row))
        atomic_write_text(path, "".join(r + "\n" for r in rows))
        self._f = open(path, "a", encoding="utf-8")

    def write(self, row: dict) -> None:
        self._f.write(json.dumps(row) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()


class ValidatorService:
    """One validator. ``wallet``/``chain``/``cfg``/``dataset`` (and its ``fingerprints``) may be
    injected (tests). Without ``chain``, :meth:`start` opens one with
    ``chain_opener(opts.network, opts.chain_db, timeout_s=opts.chain_timeout_s)`` (the entry point
    passes :func:`iota_subnet.entry.chain.open_network_chain`, which opens a devnet file too),
    or, without an opener, the SDK's endpoint for ``opts.network``. ``supervisor``: runs and restarts
    its long-lived tasks (None: ``Supervisor("validator")``)."""

    def __init__(self, opts: ValidatorOptions, *, wallet: Any = None, chain: Optional[Chain] = None,
                 cfg: Optional[RunConfig] = None, dataset: Any = None, fingerprints: Optional[Fingerprints] = None,
                 chain_opener: Optional[Callable[..., Awaitable[Chain]]] = None,
                 supervisor: Optional[Supervisor] = None):
        self.opts = opts
        self._chain_opener = chain_opener
        self.out = Path(opts.out).expanduser()
        self.wallet, self.chain, self.cfg, self.dataset = wallet, chain, cfg, dataset
        self.fingerprints = fingerprints
        self._own_chain = chain is None
        self.publisher: Optional[ChainPublisher] = None
        self.peers = PeerView([])
        self.alive_blocks = 0
        self.heartbeat = 0
        self.merge_weights: dict[int, float] = {}
        self.other_runs: dict[str, int] = {}
        self.hotkey: str = ""
        self.uid: Optional[int] = None
        self.router: Optional[Router] = None
        self.saved_slots = ""   # the lane assignment as last written to the state (JSON)
        self.driver: Optional[ControlPlane] = None
        self.state: Optional[ValidatorState] = None
        self.client: Optional[NeuronClient] = None
        self.verify_client: Optional[NeuronClient] = None   # audits, merge evidence
        self.metrics: Optional[MetricsWriter] = None
        self.current: dict[int, str] = {}  # uid -> hotkey (metagraph)
        self.validators: list[str] = []
        self.validator_index, self.n_validators = 0, 1
        self.n_lanes = 0
        self.next_steps: dict[int, int] = {}
        self.steps_done: dict[int, int] = {}
        self.lane_loss: dict[int, Optional[float]] = {}
        self.lane_tokens: dict[int, int] = {}
        self.val_loss: Optional[float] = None
        self.done_block: Optional[int] = None
        self.train_s: Optional[float] = None
        self.done = False
        self.weights_blocks: list[int] = []
        self.last_weights: dict[int, float] = {}
        self.reveals = PendingReveals()      # commit-reveal: commits not yet seen revealed
        self._fatal: Optional[Exception] = None   # why a loop stopped the validator
        self.started = time.time()
        self.elapsed_offset = 0.0
        self.tokens_at_start = 0
        self.stop_event = asyncio.Event()
        self._tempo = 0
        self._rate_limit = 0
        #: outcomes of audits (update audits, hop audits, merge checks) and their excuses
        self.audits = AuditPolicy()
        self._verification_loaded = False   # audit records read from the state (see _load_verification)
        self.merge_oversight: Optional[MergeOversight] = None   # when the run merges replicas (see start())
        self.merge_auditor: Optional[MergeAuditor] = None       # checks merge accusations, likewise
        self.ledger: Optional[Ledger] = None                    # verified work per miner (see start())
        self.auditing: Optional[AuditScheduler] = None   # audits (see _train)
        self._numel: dict[int, int] = {}
        #: whether every lane stalled between two scores updates (a merge's pause excepted; see start())
        self.stall: Optional[StallWatch] = None
        self.board = Scoreboard(window=opts.score_window, grace=opts.stale_grace)
        self.probes: list[dict] = []
        self.clasp_rounds = 0
        self._clasp_rng = random.SystemRandom()    # which lanes CLASP probes: unpredictable to miners
        self.attribution: dict = {}
        self.explained: dict = {}
        self.server: Any = None   # NeuronServer: /receipts, GET /scores
        self.last_probe: dict = {}  # the latest CLASP round: {round, loss (mean, nats/token), paths}
        #: Prometheus metrics (GET /metrics on the validator's server and --dashboard-port): hops sent and this status()
        self.prom = NeuronMetrics("validator")
        self.prom.watch(self.status)
        self.dashboard: Optional[DashboardServer] = None
        self._dashboard_client: Optional[NeuronClient] = None
        self.sup = supervisor if supervisor is not None else Supervisor("validator")

    # ---------------------------------------------------------------- start-up
    async def start(self) -> None:
        o = self.opts
        if self.wallet is None:
            self.wallet = load_wallet(o.wallet_name, o.wallet_hotkey, o.wallet_path)
        self.hotkey = self.wallet.hotkey.ss58_address
        if self.chain is None:
            try:
                if self._chain_opener is not None:
                    self.chain = await self._chain_opener(o.network, o.chain_db, timeout_s=o.chain_timeout_s)
                else:
                    self.chain = await open_chain(o.network, timeout_s=o.chain_timeout_s)
            except ChainError as e:
                raise ValidatorError(str(e)) from e
        try:
            self.uid = await self.chain.require_uid(self.hotkey, o.netuid)
        except ChainError as e:
            raise ValidatorError(str(e)) from e
        graph = await self.chain.metagraph(o.netuid)
        me = next((n for n in graph.neurons if n.uid == self.uid), None)
        if me is None or not bool(me.validator_permit):
            raise ValidatorError(
                f"hotkey {self.hotkey} (uid {self.uid}) has no validator permit on netuid {o.netuid} ({o.network}); "
                "stake to it (it must be among the top max_validators by stake) and wait for the next epoch")
        hp = await self.chain.hyperparameters(o.netuid)
        self._check_version_key(hp)
        self._tempo = int(hp.get("tempo", 0) or await self.chain.tempo(o.netuid))
        self._rate_limit = int(hp.get("weights_rate_limit", 0) or 0)
        self.alive_blocks = o.peer_alive_blocks or alive_blocks_for(self._tempo, self._rate_limit)
        await self._load_run_data()
        self._check_fingerprints(graph)
        self.out.mkdir(parents=True, exist_ok=True)
        sweep_stray_temporaries(self.out)
        hand_over(self.out, o.run_id, o.run_epoch, RUN_STATE_FILES)
        self.state = ValidatorState(self.out / "validator.sqlite")
        shares = stage_compute_shares(self.cfg)
        self.ledger = self.state.load_ledger(shares)
        self.stall = StallWatch(self.cfg.merge.every_steps if self.cfg.merge.enabled else 0, self._merge_allowance_s())
        self.weights_blocks = self.state.weights_blocks()
        self.router = Router(self.cfg.pipeline.stages)
        self._load_lane_slots()
        self.client = NeuronClient(self.wallet, on_request=self.prom.observe_hop)         # training hops
        self.verify_client = NeuronClient(self.wallet, on_request=self.prom.observe_hop)  # audits, merge evidence
        if self.cfg.merge.enabled:
            self.merge_oversight = MergeOversight(o.run_id)
            self.merge_auditor = MergeAuditor(o.run_id, self._stage_numel, gather_quant=self.cfg.merge.gather_quant,
                                              int8_block=self.cfg.merge.int8_block)
        self._load_verification()
        self.publisher = ChainPublisher(self.chain, self.wallet, o.netuid)
        self.publisher.set_commitment(self.advert())
        await self.sync()
        logger.info("validator uid {} ({}) on netuid {}: run {!r} epoch {}, {} stages, replicas per stage {}; "
                    "validators coordinating: {} ({})", self.uid, self.hotkey[:10], o.netuid, o.run_id, o.run_epoch,
                    self.cfg.pipeline.stages, self.router.stage_counts(), len(self.validators), self.peers.summary())

    def _check_version_key(self, hp: dict, log: bool = True) -> None:
        """Stop when the subnet requires a newer weights version key than this release sends
        (at start and before every set of weights). Raises :class:`ValidatorError`."""
        required = int(hp.get("weights_version", 0) or 0)
        if self.opts.version_key < required:
            raise ValidatorError(
                f"this validator (iota-subnet {__version__}) sends weights version key {self.opts.version_key}, but "
                f"netuid {self.opts.netuid} requires weights_version {required}: the subnet moved to a newer release. "
                "Update (git pull && make setup) and restart; the chain refuses weights with an older key")
        if self.opts.version_key > required and log:
            logger.info("weights version key {} (iota-subnet {}); the subnet requires at least {}",
                        self.opts.version_key, __version__, required)

    async def _load_run_data(self) -> None:
        """Run config and dataset (and its fingerprints), unless injected."""
        o = self.opts
        try:
            if self.cfg is None:
                self.cfg = load_config(o.config)
            if self.dataset is None:
                def build():
                    tok, ds = build_dataset(self.cfg.data, o.data, Path(o.cache_dir) if o.cache_dir else None,
                                            allow_fallback=o.allow_data_fallback)
                    return ds, fingerprints(tok, ds)
                try:
                    self.dataset, self.fingerprints = await asyncio.to_thread(build)
                except DataError as e:
                    raise ValidatorError(f"data: {e}") from e
        except ConfigError as e:
            raise ValidatorError(f"config: {e}") from e

    def _check_fingerprints(self, graph: Any) -> None:
        """Refuse to join a run whose other validators train on other tokens (naming both)."""
        if self.fingerprints is None:
            return
        o = self.opts
        run = run_fingerprints(graph.neurons, run=o.run_id, epoch=o.run_epoch, block=int(graph.block),
                               alive_blocks=self.alive_blocks, exclude=self.hotkey)
        if run is None:
            return
        fps, uids = run
        bad = self.fingerprints.differs(fps)
        if bad:
            raise ValidatorError(
                f"this validator's {' and '.join(bad)} differ from run {o.run_id!r} epoch {o.run_epoch} as its "
                f"validators (uids {uids}) advertise it: ours tokenizer {self.fingerprints.tokenizer} / data "
                f"{self.fingerprints.data}, the run's tokenizer {fps.tokenizer} / data {fps.data}. Use the run's "
                "--data, config and tokenizer (no --allow-data-fallback), or another --run-id")

    def advert(self) -> str:
        """This validator's commitment: the run it drives, its fingerprints, heartbeat, merge weights."""
        o = self.opts
        return RunCommitment(o.run_id, VALIDATOR, o.run_epoch, fingerprints=self.fingerprints,
                             heartbeat=self.heartbeat, merge_weights=self.merge_weights).encode()

    async def sync(self) -> None:
        """Re-read metagraph and commitments: routing, uid -> hotkey, the validators that coordinate
        (:mod:`.peers`), and keep this validator's commitment (run advert, heartbeat) on chain."""
        o = self.opts
        graph = await self.chain.metagraph(o.netuid)
        commits = {n.hotkey: n.commitment.value for n in graph.neurons
                   if n.commitment is not None and n.commitment.value is not None}
        self.router.update(discover(graph.neurons, commits, o.run_id, self.cfg.pipeline.stages, o.run_epoch))
        self._bar_flagged()
        for stage, lane, old, new in self.router.reassign_vacant(self.n_lanes):
            why = "is barred (flagged as a cheater)" if old in self.router.barred else \
                f"has been unavailable for {self.router.vacate_after_s:.0f} s"
            logger.warning("lane {} stage {}: uid {} {}; spare uid {} takes its place in the lane", lane, stage,
                           old[0], why, new[0])
        self._save_lane_slots()
        others: dict[str, int] = {}
        for raw in commits.values():
            c = RunCommitment.decode(raw)
            if c is not None and c.role == MINER and not c.same_run(o.run_id, o.run_epoch):
                label = c.run if c.epoch == 0 else f"{c.run}#{c.epoch}"
                others[label] = others.get(label, 0) + 1
        self.other_runs = others
        self.current = {int(n.uid): str(n.hotkey) for n in graph.neurons}
        self._update_peers(graph)
        await self.publisher.sync()

    def _update_peers(self, graph: Any) -> None:
        o = self.opts
        block = int(graph.block)
        self.peers = coordinating_validators(graph.neurons, run=o.run_id, epoch=o.run_epoch, block=block,
                                             alive_blocks=self.alive_blocks, self_hotkey=self.hotkey,
                                             fingerprints=self.fingerprints)
        self.validators = self.peers.coordinating
        if not self.publisher.pending and heartbeat_due(graph.neurons, self.hotkey, block, self.alive_blocks):
            self.heartbeat += 1
            self.publisher.set_commitment(self.advert())

    async def wait_for_lanes(self) -> int:
        deadline = time.monotonic() + self.opts.wait_miners_s
        while self.router.n_lanes < max(1, int(self.opts.min_lanes)):
            if time.monotonic() > deadline and self.router.n_lanes > 0:
                logger.warning("only {} of {} lanes complete after {:.0f} s; driving those", self.router.n_lanes,
                               self.opts.min_lanes, self.opts.wait_miners_s)
                break
            if time.monotonic() > deadline:
                raise ValidatorError(f"no complete pipeline after {self.opts.wait_miners_s:.0f} s: replicas per stage "
                                     f"{self.router.stage_counts()} for run {self.opts.run_id!r}; start miners for every stage")
            if self.stop_event.is_set():
                return 0
            others = self.other_runs
            logger.info("waiting for miners of run {!r}: replicas per stage {}{}", self.opts.run_id,
                        self.router.stage_counts(),
                        f"; miners of other runs seen: {others} (pass --run-id to join one)" if others else "")
            try:
                await asyncio.wait_for(self.stop_event.wait(), timeout=min(2.0, self.opts.sync_interval_s))
            except asyncio.TimeoutError:
                pass
            await self.sync()
        return self.router.n_lanes

    # ---------------------------------------------------------------- progress
    def _on_step(self, res: LaneStepResult, next_step: int) -> None:
        self.state.commit_lane_step(res.lane, res.step, next_step, [m.row() for m in res.microbatches],
                                    self.ledger, res.loss)
        self.next_steps[res.lane] = next_step
        self.steps_done[res.lane] = self.steps_done.get(res.lane, 0) + 1
        self.lane_loss[res.lane] = res.loss
        self.lane_tokens[res.lane] = self.lane_tokens.get(res.lane, 0) + res.tokens
        if res.loss is None:
            return     # a step trained while this validator was away: no loss or tokens of its own to record
        self.metrics.write({"step": res.step, "lane": res.lane, "tokens": sum(self.lane_tokens.values()),
                            "lane_tokens": self.lane_tokens[res.lane], "loss": res.loss,
                            "lr": lr_at(res.step, self.cfg.train.total_steps, self.cfg.train),
                            "validators": self.n_validators,
                            "elapsed_s": round(self.elapsed_s(), 3), "reroutes": res.reroutes,
                            "failures": res.failures, "microbatches_ok": res.ok_count})

    def elapsed_s(self) -> float:
        return self.elapsed_offset + time.time() - self.started

    def status(self) -> dict:
        tokens = sum(self.lane_tokens.values())
        el = time.time() - self.started
        losses = [l for l in self.lane_loss.values() if l is not None and math.isfinite(l)]
        d = self.driver
        return {
            "hotkey": self.hotkey, "uid": self.uid, "run_id": self.opts.run_id, "run_epoch": self.opts.run_epoch,
            "netuid": self.opts.netuid, "peers": self.peers.summary(), "validators": list(self.validators),
            "chain": self.publisher.status() if self.publisher else {},
            "fingerprints": vars(self.fingerprints) if self.fingerprints else None,
            "lanes": self.n_lanes,
            "lane_members": [[r.uid if r is not None else None for r in lane] for lane in self.router.lanes()]
            if self.router else [],
            "steps_done": {str(k): v for k, v in sorted(self.steps_done.items())},
            "next_step": {str(k): v for k, v in sorted(self.next_steps.items())},
            "total_steps": self.opts.steps, "validator_index": self.validator_index,
            "n_validators": self.n_validators, "tokens": tokens,
            "tokens_per_s": (tokens - self.tokens_at_start) / el if el > 0 else 0.0,
            "loss": sum(losses) / len(losses) if losses else None,
            "losses": {str(k): v for k, v in sorted(self.lane_loss.items())},
            "reroutes": d.reroutes if d else 0, "failures": d.failures if d else 0,
            # seconds each lane was held at a merge window's last step for the slowest lane (pacing)
            "lane_held_s": {str(k): round(v, 1) for k, v in sorted(d.pacer.held_s.items())} if d else {},
            "microbatches_ok": d.microbatches_ok if d else 0, "microbatches_failed": d.microbatches_failed if d else 0,
            "live_miners": sum(1 for r in self.router.live_replicas() if self.router.is_available(r)) if self.router else 0,
            "stage_replicas": self.router.stage_counts() if self.router else [],
            "replicas": self.router.snapshot() if self.router else [],
            # miners flagged as cheaters, out of routing for good ([uid, hotkey])
            "barred": sorted(list(k) for k in self.router.barred) if self.router else [],
            "blame": self.driver.blame.status() if getattr(self.driver, "blame", None) is not None else {},
            "probe_loss": self.last_probe, "dashboard": self.dashboard.url if self.dashboard else None,
            "val_loss": self.val_loss, "done": self.done, "weights_set_blocks": list(self.weights_blocks),
            "last_weights": {str(k): v for k, v in self.last_weights.items()},
            "miners": {str(r.uid): {"hotkey": r.hotkey, "stage": r.stage, "work": r.work, "tokens": r.tokens,
                                    "completed": r.completed, "failures": r.failures, "reroutes": r.reroutes}
                       for r in self.ledger.records.values() if self.current.get(r.uid) == r.hotkey}
            if self.ledger is not None else {},
            "done_block": self.done_block, "train_s": self.train_s,
            "scores": self.explained.get("miners", []),
            "wire_bytes": (self.client.bytes_sent + self.client.bytes_received) if self.client else 0,
            # every byte this validator sent or received on the training path (tickets, receipts, health
            # probes), HTTP headers included
            "validator_bytes": (self.client.total_bytes if self.client else 0)
            + (self.server.route_bytes.get("/receipts", 0) if self.server else 0),
            # every byte of verification (audits, merge evidence), HTTP headers included
            "verification_bytes": self.verify_client.total_bytes if self.verify_client is not None else 0,
            "verification_bytes_by_path": dict(self.verify_client.bytes_by_path) if self.verify_client is not None
            else {},
            "audits": self.auditing.status() | {"per_tempo": {str(k): v for k, v in self.auditing.per_tempo().items()}}
            if self.auditing is not None else None,
            "elapsed_s": round(self.elapsed_s(), 3), "updated_at": time.time(), "tasks": self.sup.status(),
        }

    def write_status(self) -> None:
        atomic_write_json(self.out / "status.json", self.status())

    # ---------------------------------------------------------------- weights
    async def maybe_set_weights(self) -> bool:
        """Set weights if a tempo (and the rate limit) has passed since the last set. True if set.

        The subnet's weights version is checked first (raises :class:`ValidatorError`, as at start,
        when it rose above this release's key). The uid owners are re-read just before (a uid that
        changed hands since it was scored gets nothing), and the weights count as set only once the
        chain's state shows them (the hotkey's ``last_update`` reached the extrinsic's block);
        otherwise the next check retries. With commit-reveal, committed weights count as set once
        the chain has revealed them (:mod:`.reveals`; a True may confirm an earlier commit)."""
        confirmed = await self._confirm_reveals()
        block = await self.chain.block()
        last = max(self.weights_blocks[-1:] + [b for b in (self.reveals.last_block(),) if b is not None], default=None)
        every = max(self._tempo, self._rate_limit, 1)
        if last is not None and block - last < every:
            return confirmed
        self._check_version_key(await self.chain.hyperparameters(self.opts.netuid), log=False)
        await self._merge_round()
        graph = await self.chain.metagraph(self.opts.netuid)       # owners now, not at the last sync
        self.current = {int(n.uid): str(n.hotkey) for n in graph.neurons}
        weights = self.update_scores(block)
        await self._publish_merge_weights()
        if not weights:
            return confirmed
        uids = sorted(weights)
        vals = [weights[u] for u in uids]
        try:
            receipt = await self.chain.set_weights(self.wallet, self.opts.netuid, uids, vals,
                                                   version_key=self.opts.version_key)
        except ChainError as e:
            logger.warning("set_weights refused at block {}: {}", block, e)
            return confirmed
        if not await self.chain.weights_landed(self.hotkey, self.opts.netuid, receipt):
            logger.warning("set_weights at block {}: the chain reported success but its state does not show the "
                           "weights (last_update is older than block {}); not recorded, retrying", block, receipt.block)
            return confirmed
        if receipt.commit_reveal:
            self.reveals.add(receipt, dict(zip(uids, vals)), self.last_weights)
            logger.info("weights committed at block {} for reveal at drand round {}; recorded once revealed",
                        receipt.block, receipt.reveal_round)
            return confirmed
        self._record_weights(receipt.block, uids, vals)
        return True

    async def _confirm_reveals(self) -> bool:
        """Record the committed weights the chain now shows revealed (True if any). A commit the chain
        refused at its reveal is dropped with a warning, and the weights version is checked again (a
        raised version makes the chain refuse reveals: stop). See :mod:`.reveals`."""
        if not self.reveals.due():
            return False
        pending = await self.chain.pending_commits(self.hotkey, self.opts.netuid)
        row = dict(await self.chain.weights(self.opts.netuid)).get(self.uid)
        revealed, refused = self.reveals.resolve(pending, row)
        for c in refused:
            logger.warning("weights committed at block {} (drand round {}) were not revealed: the chain refused "
                           "them at the reveal or dropped them; not recorded as set", c.receipt.block,
                           c.receipt.reveal_round)
        if refused:
            self._check_version_key(await self.chain.hyperparameters(self.opts.netuid), log=False)
        if revealed is None:
            return False
        self._record_weights(revealed.receipt.block, list(revealed.weights), list(revealed.weights.values()))
        return True

    def _record_weights(self, block: int, uids: list[int], vals: list[float]) -> None:
        """Weights the chain shows as set at ``block``: into the state, the status and the log."""
        self.weights_blocks.append(block)
        self.last_weights = dict(zip(uids, vals))
        self.state.log_weights(block, uids, vals)
        self.state.save_ledger(self.ledger)
        self._save_verification()
        logger.info("weights set at block {}: {}", block, {u: round(w, 4) for u, w in zip(uids, vals)})

    async def _merge_round(self) -> None:
        """With merging on: collect the replicas' merge mismatch evidence and check every accusation
        (:class:`.merge_audit.MergeAuditor`: this validator recomputes the disputed shard from the
        participants' signed slices); the verdicts go to the audit policy: a reducer proven wrong, or
        an accuser whose evidence does not hold, is flagged (weight 0, merge weight 0)."""
        mo = self.merge_oversight
        if mo is None or self.router is None:
            return
        live = self.router.live_replicas()
        new = await mo.collect(self.verify_client, live)
        if new:
            logger.info("merge evidence: {} new report(s) from the replicas", new)
        who = {hk: (uid, rec.stage) for (uid, hk), rec in self.ledger.records.items()}
        who.update({r.hotkey: (r.uid, r.stage) for r in live})
        endpoints = {r.hotkey: r.endpoint for r in live}

        async def fetch(hotkey: str, req):
            ep = endpoints.get(hotkey)
            if ep is None:
                raise ConnectionError(f"no endpoint for {hotkey[:10]}")
            return await self.verify_client.call(ep, hotkey, "/audit/merge", req, MergeAuditResponse,
                                                 timeout_s=self.opts.hop_timeout_s, retries=1)
        verdicts = await mo.verify(self.merge_auditor, fetch)
        for v in verdicts:
            logger.log("WARNING" if v.penalise else "INFO", "merge accusation by {} against {}: {} ({})",
                       v.reporter[:10], v.accused[:10], v.outcome, v.detail)
        record_verdicts(self.audits, verdicts, who)

    def _stage_numel(self, stage: int) -> int:
        n = self._numel.get(stage)
        if n is None:
            with torch.device("meta"):
                n = self._numel[stage] = sum(p.numel() for p in PipelineStage(self.cfg.model, self.cfg.pipeline, stage,
                                                                              init=False).parameters())
        return n

    def _flagged(self) -> set[tuple[int, str]]:
        """(uid, hotkey) of every miner flagged as a cheater by audits."""
        return self.audits.flagged()

    def _bar_flagged(self) -> None:
        """Bar newly flagged miners from routing (:meth:`.routing.Router.bar`) and save the flags at
        once, so that a restarted validator bars them again (saved only with the next weights set, they
        would be lost by a validator killed before it)."""
        new = self.router.bar(self._flagged())
        for uid, hk in new:
            r = self.router.get((uid, hk))
            others = [x for x in self.router.replicas.get(r.stage, []) if self.router.is_available(x)] if r else []
            logger.warning("uid {} ({}) is flagged as a cheater: no hop goes to it again{}", uid, hk[:10],
                           "" if r is None or others else
                           f"; stage {r.stage} has no other available replica, its hops wait for one")
        if new and self.state is not None:
            self._save_flags()

    def _save_flags(self) -> None:
        """Save the audit records (flags included), once they were loaded (a start-up that failed
        before :meth:`_load_verification` must not overwrite them with empty ones)."""
        if self._verification_loaded:
            self.state.set_meta("audits", json.dumps(self.audits.to_dict()))

    async def _publish_merge_weights(self) -> None:
        """Publish each replica's weight in its stage's merge (commitment), when it changed."""
        mo = self.merge_oversight
        if mo is None:
            return
        uids = [uid for (uid, hk) in self.ledger.records if self.current.get(uid) == hk]
        cheaters = {uid for uid, hk in self._flagged() if self.current.get(uid) == hk}
        decided = mo.decided(uids, cheaters)
        if decided == self.merge_weights:
            return
        self.merge_weights = decided
        self.publisher.set_commitment(self.advert())
        try:
            await self.publisher.sync()
            logger.info("merge weights published: {}", decided)
        except ChainError as e:
            logger.warning("merge weights not published yet: {}", e)

    # ---------------------------------------------------------------- loops
    async def _every(self, period: float, fn, what: str) -> None:
        while not self.stop_event.is_set():
            try:
                r = fn()
                if asyncio.iscoroutine(r):
                    await r
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - a background loop must survive a bad round
                logger.warning("{} failed: {}: {}", what, type(e).__name__, e)
            try:
                await asyncio.wait_for(self.stop_event.wait(), timeout=period)
            except asyncio.TimeoutError:
                pass

    async def _sync_and_probe(self) -> None:
        await self.sync()
        if self.driver is not None:
            await self.driver.probe()

    async def _weights_round(self) -> None:
        try:
            landed = await self.maybe_set_weights()
        except ValidatorError as e:        # the subnet moved to a newer weights version: stop
            logger.error("{}", e)
            self._fatal = e
            self.stop_event.set()
            return
        if landed and self.done and self.opts.exit_when_done:
            self.stop_event.set()

    async def _drive(self) -> None:
        """The supervised task ``train``: :meth:`_train`. A :class:`ValidatorError` (no complete
        pipeline) or :class:`StateError` (a state of another run) stops the validator (raised by
        :meth:`run`) instead of restarting it."""
        try:
            await self._train()
        except (ValidatorError, StateError) as e:
            logger.error("{}", e)
            self._fatal = e
            self.stop_event.set()

    async def _train(self) -> None:
        o = self.opts
        if self.auditing is not None:      # a restart after an exception: the last attempt's parts go first
            await self.auditing.close()
            self.auditing = None
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        available = await self.wait_for_lanes()
        if self.stop_event.is_set():
            return
        if o.n_lanes:
            available = min(available, int(o.n_lanes))
        self.n_lanes = self.state.bind_run(o.run_id, available)
        if self.n_lanes > self.router.n_lanes:
            logger.warning("resuming with {} lanes but only {} complete lanes now: the missing members are "
                           "replaced by rerouting", self.n_lanes, self.router.n_lanes)
        progress = self.state.lane_progress()
        self.next_steps = {l: progress.get(l, {}).get("next_step", 0) for l in range(self.n_lanes)}
        self.steps_done = {l: progress.get(l, {}).get("steps_done", 0) for l in range(self.n_lanes)}
        self.lane_tokens = {l: progress.get(l, {}).get("tokens", 0) for l in range(self.n_lanes)}
        self.lane_loss = {l: progress.get(l, {}).get("last_loss") for l in range(self.n_lanes)}
        self.tokens_at_start = sum(self.lane_tokens.values())
        self.metrics = MetricsWriter(self.out / "metrics.jsonl", self.next_steps)
        self.elapsed_offset = float(self.state.get_meta("elapsed_s", "0") or 0)
        total = o.steps if o.steps is not None else OPEN_ENDED_STEPS
        self.validator_index = self.validators.index(self.hotkey)
        self.n_validators = len(self.validators)
        self.auditing = self._make_auditing() if o.audits else None
        plane_opts = ControlOptions(run_id=o.run_id, n_lanes=self.n_lanes, validator_index=self.validator_index,
                                    n_validators=self.n_validators, tag=self.hotkey[:6],
                                    lookahead=o.ticket_lookahead, stall_s=o.stall_s, wire_dtype=o.wire_dtype,
                                    on_receipt=self.auditing.on_receipt if self.auditing else None,
                                    on_hop=self.auditing.on_hop if self.auditing else None)
        self.driver = ControlPlane(self.cfg, router=self.router, client=self.client, keypair=self.wallet,
                                   dataset=self.dataset, ledger=self.ledger, opts=plane_opts)
        # refused output: its sender is charged (flag: weight 0)
        self.driver.blame = BlameBook(self.driver, flag=lambda k, s, why: self.audits.stat(*k, s).flag(why))
        logger.info("driving {} lanes, lane steps {} of {} (validator {} of {} coordinating: steps k with "
                    "k % {} == {}; {})", self.n_lanes, self.next_steps, o.steps if o.steps is not None else "open-ended",
                    self.validator_index, self.n_validators, self.n_validators, self.validator_index,
                    self.peers.summary())
        t_train = time.monotonic()
        train_before = float(self.state.get_meta("train_s", "0") or 0)   # earlier runs of this state
        try:
            await self.driver.run(self.next_steps, total, on_step=self._on_step, stop=self.stop_event)
        finally:
            self.train_s = train_before + (time.monotonic() - t_train)
            self.state.set_meta("train_s", self.train_s)
        if self.stop_event.is_set() or o.steps is None:
            return
        self.val_loss = await self.driver.evaluate(self.cfg.train.eval_batches, lane=0)
        self.state.set_meta("val_loss", self.val_loss)
        self.done_block = await self.chain.block()
        self.done = True
        self.write_status()
        logger.info("done: {} lane steps per lane, val loss {}", o.steps,
                    f"{self.val_loss:.4f}" if self.val_loss is not None else "-")

    async def run(self) -> int:
        """Run until stopped (signal, :meth:`request_stop`, or ``exit_when_done``). Returns an exit code.
        A stop requested during start-up (a chain that does not answer, a slow dataset) ends it too."""
        try:
            await until_stopped(self.start(), self.stop_event)
        except StopRequested:
            logger.info("stopped during start-up")
            await self.close()
            return 0
        except StateError as e:
            await self.close()
            raise ValidatorError(str(e)) from None
        self.write_status()
        o = self.opts
        loops = [("status", o.status_interval_s, self.write_status),
                 ("metagraph", o.sync_interval_s, self._sync_and_probe),
                 ("weights", o.weights_check_s, self._weights_round)]
        if o.clasp_interval_s > 0:
            loops.append(("clasp", o.clasp_interval_s, self._clasp_round))
        if o.audits:
            loops.append(("audits", o.audit_interval_s, self._audit_round))
        try:
            for name, period, fn in loops:
                self.sup.spawn(name, functools.partial(self._every, period, fn, name))
            await self._serve()
            await self._serve_dashboard()
            self.sup.spawn("train", self._drive)
            await self.stop_event.wait()
            if self._fatal is not None:
                raise self._fatal
        finally:
            self.stop_event.set()
            await self.sup.stop(timeout_s=60.0)
            await self.close()
        return 0

    def request_stop(self) -> None:
        self.stop_event.set()

    # ---------------------------------------------------------------- verification and scores
    def _make_auditing(self) -> AuditScheduler:
        """The audit scheduler: receipts in, audits over the verification client, outcomes into
        :attr:`audits` (the policy that scoring reads)."""
        ds = self.dataset

        def rows(t):
            return ds.batch(t.seed, t.start, t.rows) if t.split == "train" else ds.val_batch(t.start, t.rows)

        def lookup(hotkey: str):
            # a miner the router holds as failed (cooling down) is not audited: it is away, not dodging
            return next((r for r in self.router.live_replicas() if r.hotkey == hotkey and self.router.is_available(r)),
                        None)
        return AuditScheduler(self.cfg, run_id=self.opts.run_id, client=self.verify_client, policy=self.audits,
                              rows=rows, lookup=lookup,
                              update_auditor=UpdateAuditor(self.cfg, run_id=self.opts.run_id,
                                                           total_steps=self.cfg.train.total_steps),
                              timeout_s=self.opts.audit_timeout_s, hops_per_tempo=self.opts.audits_per_tempo,
                              updates_per_tempo=self.opts.audits_per_tempo, retry_delays_s=self.opts.audit_retry_s,
                              totals=self._load_audit_totals())

    async def _audit_round(self) -> None:
        if self.auditing is None:
            return
        block = await self.chain.block()
        await self.auditing.round(block // max(1, self._tempo), wait_s=self.opts.audit_interval_s)

    def _load_lane_slots(self) -> None:
        """Restore the lane assignment of this validator's previous process (see
        :meth:`Router.load_slot_table`); a malformed entry is logged and the uid order used."""
        raw = self.state.get_meta("lane_slots")
        if not raw:
            return
        try:
            self.router.load_slot_table(json.loads(raw))
        except (ValueError, TypeError, AttributeError) as e:
            logger.warning("the saved lane assignment in {} is unreadable ({}); lanes start from the uid order",
                           self.state.path, e)
            return
        self.saved_slots = raw

    def _save_lane_slots(self) -> None:
        raw = json.dumps(self.router.slot_table(), sort_keys=True)
        if raw != self.saved_slots:
            self.state.set_meta("lane_slots", raw)
            self.saved_slots = raw

    def _load_verification(self) -> None:
        self._verification_loaded = True
        raw = self.state.get_meta("scoreboard")
        if raw:
            self.board = Scoreboard.from_dict(json.loads(raw))
        raw = self.state.get_meta("audits")
        if raw:
            self.audits.load_dict(json.loads(raw))
        raw = self.state.get_meta("clasp_probes")
        if raw:
            self.probes = json.loads(raw)
            self.clasp_rounds = 1 + max((p.get("round", 0) for p in self.probes), default=-1)
        raw = self.state.get_meta("scores")
        if raw:
            self.explained = json.loads(raw)

    def _load_audit_totals(self) -> dict:
        """The audit counters of this validator's earlier processes ({} when none or unreadable)."""
        try:
            raw = json.loads(self.state.get_meta("audit_totals") or "{}")
        except ValueError:
            logger.warning("validator state: unreadable audit totals; counting audits from 0")
            return {}
        return raw if isinstance(raw, dict) else {}

    def _save_verification(self) -> None:
        self._save_flags()
        self.state.set_meta("scoreboard", json.dumps(self.board.to_dict()))
        self.state.set_meta("clasp_probes", json.dumps(self.probes[-self.opts.clasp_window:]))
        self.state.set_meta("scores", json.dumps(self.explained))
        if self.auditing is not None:
            self.state.set_meta("audit_totals", json.dumps(self.auditing.totals()))

    def update_scores(self, block: Optional[int] = None) -> dict[int, float]:
        """One tempo's scoring: CLASP attribution, quality factors, Scoreboard update, weights
        (uid -> weight, summing to 1, or empty), explained scores. See :mod:`.scoring`."""
        self.attribution = attribute(self.probes[-self.opts.clasp_window:], exclude=self.audits.flagged())
        qf = quality_factors(self.attribution, self.opts.clasp_penalty)
        quality = {key: qf.get(key, (1.0, [])) for key in self.ledger.records}
        quality = merge_quality(quality, self.audits.quality())
        d = self.driver
        stalled = self._lanes_stalled()
        self.board.update(self.ledger, quality, unrouted=self._unrouted(), lanes_stalled=stalled,
                          blocked=d.take_blocked() if d is not None else None, at=d.clock() if d is not None else None,
                          paused=self.stall is not None and self.stall.paused)
        weights = self.board.weights(self.ledger.shares, self.current, exclude_uids=[self.uid])
        self.explained = explain.build(self.ledger, self.attribution, self.board, self.current, block,
                                       audits=self.audits)
        return with_burn(weights, self._burn_uid())

    def _lanes_stalled(self) -> bool:
        """This validator drives lanes that are not finished, and none completed a step since the last
        update (a merge's pause excepted: :class:`~.pacing.StallWatch`)."""
        driving = self.driver is not None and any(self.opts.steps is None or n < self.opts.steps
                                                  for n in self.next_steps.values())
        if self.stall is None:
            return False
        return self.stall.update(sum(self.steps_done.values()), list(self.next_steps.values()), self.opts.steps,
                                 driving)

    def _merge_allowance_s(self) -> float:
        """The longest a merge may pause the lanes before a tempo without lane steps counts as stalled:
        ``merge.max_attempts`` x (its join timeout plus the deadline of a scatter and a gather of the
        largest stage in fp32 at the declared uplink, ``merge.assumed_uplink_bps``;
        :mod:`iota_subnet.merge.deadlines`). Not the floor rate a moving merge may go down to: that
        would excuse lanes held at a merge boundary for hours."""
        mc = self.cfg.merge
        if not mc.enabled:
            return 0.0
        largest = max(self._stage_numel(s) for s in range(self.cfg.pipeline.stages))
        return mc.max_attempts * (mc.join_timeout_s + phase_deadline_s(mc, 2 * 4 * largest))

    def _unrouted(self) -> set:
        """Miners of lanes this validator has finished driving (no work for them by its own choice)."""
        if self.router is None:
            return set()
        out = set()
        for lane, nxt in self.next_steps.items():
            if nxt >= self.opts.steps:
                for stage in range(self.cfg.pipeline.stages):
                    r = self.router.lane_member(lane, stage)
                    if r is not None:
                        out.add(r.key)
        return out

    def _burn_uid(self) -> Optional[int]:
        """The burn uid for stale weight, or None: not set or not in the metagraph. Who holds it does
        not matter: when this validator holds it, the stale share goes on its own uid, so its weights
        row shows the decay as any other validator's does (leaving it out let the chain renormalise
        the stale weights back to full strength). Yuma drops self-weights from the epoch, so that
        share then earns this validator nothing."""
        b = self.opts.burn_uid
        if b is None or int(b) not in self.current:
            return None
        return int(b)

    async def _clasp_round(self) -> None:
        if self.driver is None or self.router is None or self.router.n_lanes == 0:
            return
        got = await self.driver.clasp_round(self.clasp_rounds, self.opts.clasp_paths, self._clasp_rng)
        if got:
            self.last_probe = {"round": self.clasp_rounds, "loss": sum(g["loss"] for g in got) / len(got),
                               "paths": len(got)}
        self.clasp_rounds += 1
        self.probes.extend(got)
        del self.probes[:-self.opts.clasp_window]

    async def _serve(self) -> None:
        """The validator's own server: miners deliver receipts (``/receipts``, signed, registered
        hotkeys) and evidence of hops they refused (``/refusals``, :mod:`.blame`); ``GET /scores`` is
        public and read-only. Its endpoint is published on chain."""
        async def scores(_request):
            return web.json_response(self.explained or {"miners": []})

        async def authorize(hotkey: str, route: str) -> None:
            if hotkey not in self.current.values():
                await self.sync()
            if hotkey not in self.current.values():
                raise ProtocolError(Outcome.UNREGISTERED_HOTKEY, f"hotkey {hotkey} is not registered on netuid "
                                                                  f"{self.opts.netuid}")

        async def receipts(msg: ReceiptBatch, ctx):
            if msg.run_id != self.opts.run_id:
                raise ProtocolError(Outcome.FORBIDDEN, f"this validator drives run {self.opts.run_id!r}")
            if self.driver is None:
                raise ProtocolError(Outcome.NOT_READY, "not driving lanes yet")
            if self.auditing is not None and msg.updates:
                self.auditing.on_updates(ctx.caller_hotkey, msg.updates[:MAX_UPDATES_PER_BATCH])
            return self.driver.on_receipts(msg, ctx.caller_hotkey)

        async def refusals(msg: RefusalReport, ctx):
            blame = getattr(self.driver, "blame", None)
            if msg.run_id != self.opts.run_id or blame is None:
                raise ProtocolError(Outcome.NOT_READY, "not driving lanes of this run")
            return RefusalAck(run_id=self.opts.run_id, verdict=blame.on_report(msg, ctx.caller_hotkey))

        def refused_receipts(*args):
            blame = getattr(self.driver, "blame", None)
            if blame is not None:
                blame.on_refused_receipts(*args)

        # --port, else the port already served on chain (a restart then re-publishes nothing)
        want = int(self.opts.port) or await self.publisher.served_port(self.opts.external_ip)
        self.server = NeuronServer(self.wallet, self.opts.host, want, authorizer=authorize,
                                   nonce_store_path=self.out / "nonces.sqlite", max_body_bytes=8 << 20)
        self.server.add_route("/receipts", receipts, ReceiptBatch, None, on_refused=refused_receipts)
        self.server.add_route("/refusals", refusals, RefusalReport, None, max_body_bytes=MAX_REPORT_BODY_BYTES)
        self.server.add_public_get("/scores", scores)
        self.server.add_public_get("/metrics", self.prom.handler)
        self.server.add_public_get("/health", health_handler(self.sup))
        for path, handler in PeerProbe().handlers().items():      # iota-subnet doctor asks peers
            self.server.add_public_get(path, handler)
        self.prom.instrument(self.server.app)
        try:
            port = await self.server.start()
        except OSError:
            if self.opts.port:
                raise
            self.server.port = 0                  # the old port is taken: any free one (published when allowed)
            port = await self.server.start()
        self.publisher.set_axon(self.opts.external_ip, port)
        if not await self.publisher.sync():
            logger.warning("not yet published on chain: {}; retrying in the background", self.publisher.status())
        logger.info("validator serves receipts and GET /scores on {}:{} (published as {}:{})", self.opts.host, port,
                    self.opts.external_ip, port)

    async def _serve_dashboard(self) -> None:
        """The read-only web dashboard (``dashboard_port``; see :mod:`iota_subnet.dashboard`)."""
        if self.opts.dashboard_port is None:
            return
        self._dashboard_client = NeuronClient(self.wallet, on_request=self.prom.observe_hop)
        src = ValidatorSource(status=self.status, metrics_path=self.out / "metrics.jsonl", chain=self.chain,
                              netuid=self.opts.netuid, network=self.opts.network,
                              health=health_poller(self._dashboard_client, self.opts.run_id))
        self.dashboard = DashboardServer(src, self.opts.host, self.opts.dashboard_port, metrics=self.prom,
                                         supervisor=self.sup)
        self.prom.instrument(self.dashboard.app)
        await self.dashboard.start()
        self.write_status()

    async def close(self) -> None:
        if self.auditing is not None:
            await self.auditing.close()
        if self.dashboard is not None:
            await self.dashboard.stop()
            await self._dashboard_client.close()
        if self.server is not None:
            await self.server.stop()
            self.server = None
        if self.state is not None:
            try:
                if self.auditing is not None:
                    self.state.set_meta("audit_totals", json.dumps(self.auditing.totals()))
                self._save_flags()
                self.state.set_meta("elapsed_s", self.elapsed_s())
                self.state.save_ledger(self.ledger)
                self.write_status()
            except Exception as e:  # noqa: BLE001
                logger.warning("final save failed: {}", e)
            self.state.close()
            self.state = None
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        if self.client is not None:
            await self.client.close()
        if self.verify_client is not None:
            await self.verify_client.close()
        if self.chain is not None and self._own_chain:
            await self.chain.close()


async def run_validator(opts: ValidatorOptions,
                        chain_opener: Optional[Callable[..., Awaitable[Chain]]] = None) -> int:
    """Run a validator with SIGTERM / SIGINT / SIGHUP (a closed terminal; not under ``nohup``)
    mapped to a clean shutdown; ``chain_opener`` as in :class:`ValidatorService`."""
    svc = ValidatorService(opts, chain_opener=chain_opener)
    loop = asyncio.get_running_loop()
    for sig in stop_signals():
        try:
            loop.add_signal_handler(sig, svc.request_stop)
        except (NotImplementedError, RuntimeError):
            pass
    return await svc.run()
