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
next_step (per lane), total_steps, wire_dtype (of its tickets), validator_index, n_validators, tokens,
tokens_per_s, loss (mean of the last step of each lane), losses (per lane), reroutes, failures,
lane_held_s (p2p: seconds each lane waited at a merge window's last step for the slowest lane,
:mod:`.pacing`), microbatches_ok, microbatches_failed, live_miners, stage_replicas, replicas (per
replica: uid, hotkey, stage, endpoint, lane, available, throughput, successes, failures), miners (per
uid: hotkey, stage, work, tokens, completed, failures, reroutes), probe_loss (latest CLASP round:
round, loss, paths), dashboard (its URL or null), val_loss, done, weights_set_blocks, last_weights,
scores, verification_bytes (bodies and headers of every verification request), audits (``audits,
failed, bytes, cpu_s, recent`` and ``per_tempo``: tempo -> hotkey -> hop audits; null when off),
paths (per peer hotkey that exchanged traffic with it, ``out`` and ``in``: kind ``direct`` or
``relayed``, via, requests, bytes, last; :mod:`iota_subnet.transport.paths`), elapsed_s, updated_at,
tasks`` (per supervised task: state, restarts, failures, consecutive_failures,
last_error, last_error_at).
"""
from __future__ import annotations

import asyncio
import functools
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, Optional

from loguru import logger

from iota_subnet.chain import Chain, ChainError, open_chain
from iota_subnet.chain.publisher import ChainPublisher
from iota_subnet.config import ConfigError, RunConfig, load_config
from iota_subnet.config_hash import canonical_yaml
from iota_subnet.data import DataError, build_dataset, fingerprints
from iota_subnet.neuron_common import stop_signals
from iota_subnet.protocol.commitment import VALIDATOR, RunCommitment
from iota_subnet.protocol.run_spec import spec_digest
from iota_subnet.telemetry import NeuronMetrics
from iota_subnet.train.checkpoint import sweep_stray_temporaries
from iota_subnet.train.optim import lr_at
from iota_subnet.transport import NeuronClient
from iota_subnet.utils.aio import StopRequested, until_stopped
from iota_subnet.utils.run_folder import hand_over
from iota_subnet.utils.supervise import Supervisor

from .audit_policy import AuditPolicy
from .auditing import AuditScheduler
from .control import ControlOptions, ControlPlane
from .endpoints import ValidatorEndpoints
from .lanes import OPEN_ENDED_STEPS, LaneStepResult
from .merge_rounds import MergeRounds
from .metagraph_view import MetagraphView
from .options import WEIGHTS_VERSION_KEY, ValidatorError, ValidatorOptions, load_wallet
from .pacing import StallWatch
from .progress import LaneProgress
from .routing import Router
from .scorekeeper import ScoreKeeper
from .scoring import Ledger, stage_compute_shares
from .state import StateError, ValidatorState
from .status import StatusFile
from .verification import Verification
from .weights_round import WeightsRound

__all__ = ["RUN_STATE_FILES", "WEIGHTS_VERSION_KEY", "ValidatorError", "ValidatorOptions",
           "ValidatorService", "load_wallet", "run_validator"]

#: Files of a run's state in the validator's folder (set aside when a new run starts there).
RUN_STATE_FILES = ["validator.sqlite", "validator.sqlite-wal", "validator.sqlite-shm", "metrics.jsonl", "status.json"]


class ValidatorService:
    """One validator, composed of its parts: the metagraph view (:attr:`view`, :mod:`.metagraph_view`),
    lane progress (:attr:`progress`), audits (:attr:`verification`), merge oversight (:attr:`merges`),
    scores (:attr:`scores`, :mod:`.scorekeeper`), weights on chain (:attr:`weights`) and what it serves
    (:attr:`endpoints`); the control plane (:attr:`driver`) once lanes are driven.

    ``wallet``/``chain``/``cfg``/``dataset`` may be injected (tests; :attr:`fingerprints` of an injected
    dataset may be set before :meth:`start`). Without ``chain``, :meth:`start` opens one with
    ``chain_opener(opts.chain.network, opts.chain.chain_db, timeout_s=opts.chain.chain_timeout_s)``
    (the entry point passes :func:`iota_subnet.entry.chain.open_network_chain`, which opens a devnet
    file too), or, without an opener, the SDK's endpoint for the network. ``supervisor``: runs and
    restarts its long-lived tasks (None: ``Supervisor("validator")``)."""

    def __init__(self, opts: ValidatorOptions, *, wallet: Any = None, chain: Optional[Chain] = None,
                 cfg: Optional[RunConfig] = None, dataset: Any = None,
                 chain_opener: Optional[Callable[..., Awaitable[Chain]]] = None,
                 supervisor: Optional[Supervisor] = None):
        self.opts = opts
        self._chain_opener = chain_opener
        self.out = Path(opts.outputs.out).expanduser()
        self.wallet, self.chain, self.cfg, self.dataset = wallet, chain, cfg, dataset
        self.fingerprints: Any = None       # of the tokenizer and data (built with the dataset)
        #: the run's spec (canonical config YAML, served on GET /run/spec) and its hash (advertised as ``h``)
        self.spec_text, self.spec_hash = "", ""
        self._own_chain = chain is None
        self.publisher: Optional[ChainPublisher] = None
        self.hotkey: str = ""
        self.uid: Optional[int] = None
        self.router: Optional[Router] = None
        self.driver: Optional[ControlPlane] = None
        self.state: Optional[ValidatorState] = None
        self.client: Optional[NeuronClient] = None
        self.verify_client: Optional[NeuronClient] = None   # audits, merge evidence
        self.ledger: Optional[Ledger] = None                    # verified work per miner (see start())
        self.validator_index, self.n_validators = 0, 1
        self.n_lanes = 0
        self._fatal: Optional[Exception] = None   # why a loop stopped the validator
        self.stop_event = asyncio.Event()
        self.sup = supervisor if supervisor is not None else Supervisor("validator")
        #: Prometheus metrics (GET /metrics on the validator's server and --dashboard-port): hops sent and this status()
        self.prom = NeuronMetrics("validator")
        self.view = MetagraphView(opts.chain, opts.run)
        self.progress = LaneProgress(self.out / "metrics.jsonl")
        self.verification = Verification(opts.audits, opts.run.run_id)
        self.merges = MergeRounds(opts.merges, opts.run.run_id)
        self.scores = ScoreKeeper(opts.scoring)
        self.weights = WeightsRound(opts.chain)
        self.endpoints = ValidatorEndpoints(opts.outputs, self.out, self.prom, self.sup)
        self.status_file = StatusFile(self.out / "status.json")
        self.prom.watch(self.status)

    @property
    def current(self) -> dict[int, str]:
        """uid -> hotkey (the metagraph as last read)."""
        return self.view.current

    @property
    def audits(self) -> AuditPolicy:
        """Outcomes of audits and merge checks (the flags scoring reads)."""
        return self.verification.audits

    @property
    def auditing(self) -> Optional[AuditScheduler]:
        """The audit scheduler while lanes are driven with audits on, else None."""
        return self.verification.auditing

    # ---------------------------------------------------------------- start-up
    async def start(self) -> None:
        o, c = self.opts, self.opts.chain
        if self.wallet is None:
            self.wallet = load_wallet(c.wallet_name, c.wallet_hotkey, c.wallet_path)
        self.hotkey = self.wallet.hotkey.ss58_address
        if self.chain is None:
            try:
                if self._chain_opener is not None:
                    self.chain = await self._chain_opener(c.network, c.chain_db, timeout_s=c.chain_timeout_s)
                else:
                    self.chain = await open_chain(c.network, timeout_s=c.chain_timeout_s)
            except ChainError as e:
                raise ValidatorError(str(e)) from e
        try:
            self.uid = await self.chain.require_uid(self.hotkey, c.netuid)
        except ChainError as e:
            raise ValidatorError(str(e)) from e
        graph = await self.chain.metagraph(c.netuid)
        me = next((n for n in graph.neurons if n.uid == self.uid), None)
        if me is None or not bool(me.validator_permit):
            raise ValidatorError(
                f"hotkey {self.hotkey} (uid {self.uid}) has no validator permit on netuid {c.netuid} ({c.network}); "
                "stake to it (it must be among the top max_validators by stake) and wait for the next epoch")
        hp = await self.chain.hyperparameters(c.netuid)
        self.weights.check_version_key(hp)
        tempo = int(hp.get("tempo", 0) or await self.chain.tempo(c.netuid))
        self.weights.set_timing(hp, tempo)
        self.view.set_timing(tempo, self.weights.rate_limit)
        await self._load_run_data()
        self.view.check_fingerprints(graph, self.fingerprints, self.hotkey)
        self.out.mkdir(parents=True, exist_ok=True)
        sweep_stray_temporaries(self.out)
        hand_over(self.out, o.run.run_id, o.run.run_epoch, RUN_STATE_FILES)
        self.state = ValidatorState(self.out / "validator.sqlite")
        shares = stage_compute_shares(self.cfg)
        self.ledger = self.state.load_ledger(shares)
        self.merges.open(self.cfg)
        self.progress.stall = StallWatch(self.cfg.merge.every_steps if self.cfg.merge.enabled else 0,
                                         self.merges.allowance_s())
        self.weights.weights_blocks = self.state.weights_blocks()
        self.router = Router(self.cfg.pipeline.stages)
        self.view.load_slots(self.router, self.state)
        relays = self.view.relays_of     # miners that cannot be dialled: their other relays
        self.client = NeuronClient(self.wallet, on_request=self.prom.observe_hop, alternates=relays)  # training hops
        self.verify_client = NeuronClient(self.wallet, on_request=self.prom.observe_hop,
                                          alternates=relays)                                  # audits, merge evidence
        self.verification.load(self.state)
        self.scores.load(self.state)
        self.publisher = ChainPublisher(self.chain, self.wallet, c.netuid)
        self.publisher.set_commitment(self.advert())
        await self.sync()
        logger.info("validator uid {} ({}) on netuid {}: run {!r} epoch {} (spec hash {}), {} stages, replicas per "
                    "stage {}; validators coordinating: {} ({})", self.uid, self.hotkey[:10], c.netuid, o.run.run_id,
                    o.run.run_epoch, self.spec_hash, self.cfg.pipeline.stages, self.router.stage_counts(), len(self.view.validators),
                    self.view.peers.summary())

    async def _load_run_data(self) -> None:
        """Run config and dataset (and its fingerprints), unless injected."""
        o = self.opts.run
        try:
            if self.cfg is None:
                self.cfg = load_config(o.config)
            self.spec_text = canonical_yaml(self.cfg)
            self.spec_hash = spec_digest(self.spec_text.encode())
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

    def advert(self) -> str:
        """This validator's commitment: the run it drives, its fingerprints, heartbeat, merge weights."""
        o = self.opts.run
        return RunCommitment(o.run_id, VALIDATOR, o.run_epoch, fingerprints=self.fingerprints,
                             heartbeat=self.view.heartbeat, merge_weights=self.merges.weights,
                             relay_host=self.opts.outputs.relay_host, spec_hash=self.spec_hash).encode()

    async def sync(self) -> None:
        """Re-read metagraph and commitments: routing, uid -> hotkey, the validators that coordinate
        (:mod:`.peers`), and keep this validator's commitment (run advert, heartbeat) on chain."""
        graph = await self.chain.metagraph(self.opts.chain.netuid)
        self.view.route(graph, self.router, self.cfg.pipeline.stages, self.spec_hash)
        self._bar_flagged()
        self.view.reassign(self.router, self.n_lanes, self.state)
        if self.view.update_peers(graph, self.hotkey, self.fingerprints, pending=self.publisher.pending,
                                  spec_hash=self.spec_hash):
            self.publisher.set_commitment(self.advert())
        await self.publisher.sync()

    def _on_proven_fault(self, key: tuple[int, str], stage: int, why: str) -> None:
        """A miner barred for output it was proven to send: flagged for the weights, and a spare of its
        stage takes its lane seat now (not at the next metagraph sync), before the re-issued
        micro-batches that went through it are routed."""
        self.audits.stat(*key, stage).flag(why)
        self.view.reassign(self.router, self.n_lanes, self.state)

    def _bar_flagged(self) -> None:
        """Bar newly flagged miners from routing and save the flags at once, so that a restarted
        validator bars them again (saved only with the next weights set, they would be lost by a
        validator killed before it)."""
        new = self.view.bar(self.router, self.audits.flagged())
        if new and self.state is not None:
            self.verification.save_flags(self.state)

    # ---------------------------------------------------------------- progress
    def _on_step(self, res: LaneStepResult, next_step: int) -> None:
        self.state.commit_lane_step(res.lane, res.step, next_step, [m.row() for m in res.microbatches],
                                    self.ledger, res.loss)
        self.progress.record(res, next_step, lr=lr_at(res.step, self.cfg.train.total_steps, self.cfg.train),
                             validators=self.n_validators)

    def elapsed_s(self) -> float:
        return self.progress.elapsed_s()

    def status(self) -> dict:
        """``status.json`` as it is now (:class:`.status.StatusFile`)."""
        return self.status_file.snapshot(self)

    def write_status(self) -> None:
        self.status_file.write(self)

    # ---------------------------------------------------------------- weights and scores
    async def maybe_set_weights(self) -> bool:
        """Set weights if a tempo (and the rate limit) has passed since the last set. True if set
        (:meth:`.weights_round.WeightsRound.maybe_set`): the merge round runs first, then the uid
        owners are re-read, the scores updated and the merge weights published."""
        async def prepare(block: int) -> dict[int, float]:
            await self.merges.round(self.verify_client, self.router, self.ledger, self.audits)
            graph = await self.chain.metagraph(self.opts.chain.netuid)       # owners now, not at the last sync
            self.view.current = {int(n.uid): str(n.hotkey) for n in graph.neurons}
            weights = self.update_scores(block)
            await self.merges.publish(self.ledger, self.current, self.audits.flagged(), self.publisher, self.advert)
            return weights
        return await self.weights.maybe_set(self.chain, self.wallet, self.uid, prepare, self._record_weights)

    def _record_weights(self, block: int, uids: list[int], vals: list[float]) -> None:
        """Weights the chain shows as set at ``block``: into the state, with the ledger and the scores."""
        self.state.log_weights(block, uids, vals)
        self.state.save_ledger(self.ledger)
        self.verification.save_flags(self.state)
        self.scores.save(self.state)
        self.verification.save_totals(self.state)
        if self.driver is not None:
            self.state.set_meta("hindrances", self.driver.hindrances.to_json())

    def update_scores(self, block: Optional[int] = None) -> dict[int, float]:
        """One tempo's scoring (:meth:`.scorekeeper.ScoreKeeper.update`) from this validator's ledger,
        audits and lanes: weights (uid -> weight, summing to 1, or empty)."""
        d, steps = self.driver, self.opts.run.steps
        stalled = self.progress.lanes_stalled(steps, driving=d is not None)
        lanes = {"unrouted": self.progress.unrouted(self.router, steps, self.cfg.pipeline.stages),
                 "lanes_stalled": stalled, "blocked": d.take_blocked() if d is not None else None,
                 "at": d.clock() if d is not None else None, "paused": self.progress.paused}
        return self.scores.update(self.ledger, self.current, self.audits, block=block, exclude_uids=[self.uid],
                                  lanes=lanes)

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
        if landed and self.progress.done and self.opts.run.exit_when_done:
            self.stop_event.set()

    async def _clasp_round(self) -> None:
        await self.scores.clasp_round(self.driver, self.router)

    async def _audit_round(self) -> None:
        if self.auditing is not None:
            await self.verification.round(await self.chain.block(), self.weights.tempo)

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
        o, p = self.opts.run, self.progress
        await self.verification.close(forget=True)   # a restart after an exception: the last attempt's parts go first
        p.close()
        available = await self.view.wait_for_lanes(self.router, self.stop_event, self.sync)
        await self.view.wait_for_peers(self.stop_event, self.sync)
        self.router.freeze()
        if self.stop_event.is_set():
            return
        if o.n_lanes:
            available = min(available, int(o.n_lanes))
        self.n_lanes = self.state.bind_run(o.run_id, available)
        if self.n_lanes > self.router.n_lanes:
            logger.warning("resuming with {} lanes but only {} complete lanes now: the missing members are "
                           "replaced by rerouting", self.n_lanes, self.router.n_lanes)
        p.resume(self.state, self.n_lanes)
        total = o.steps if o.steps is not None else OPEN_ENDED_STEPS
        self.validator_index = self.view.validators.index(self.hotkey)
        self.n_validators = len(self.view.validators)
        if self.opts.audits.audits:
            self.verification.open_scheduler(self.cfg, self.dataset, self.router, self.verify_client, self.state)
        t = self.opts.tickets
        plane_opts = ControlOptions(run_id=o.run_id, n_lanes=self.n_lanes, validator_index=self.validator_index,
                                    n_validators=self.n_validators, tag=self.hotkey[:6],
                                    lookahead=t.ticket_lookahead, stall_s=t.stall_s, wire_dtype=t.wire_dtype,
                                    on_receipt=self.auditing.on_receipt if self.auditing else None,
                                    on_hop=self.auditing.on_hop if self.auditing else None,
                                    on_flag=self._on_proven_fault)
        self.driver = ControlPlane(self.cfg, router=self.router, client=self.client, keypair=self.wallet,
                                   dataset=self.dataset, ledger=self.ledger, opts=plane_opts)
        saved = self.state.get_meta("hindrances")
        if saved:           # miners held back before a restart stay excused
            self.driver.hindrances.load_json(saved)
        logger.info("driving {} lanes, lane steps {} of {} (validator {} of {} coordinating: steps k with "
                    "k % {} == {}; {})", self.n_lanes, p.next_steps, o.steps if o.steps is not None else "open-ended",
                    self.validator_index, self.n_validators, self.n_validators, self.validator_index,
                    self.view.peers.summary())
        t_train = time.monotonic()
        train_before = float(self.state.get_meta("train_s", "0") or 0)   # earlier runs of this state
        try:
            await self.driver.run(p.next_steps, total, on_step=self._on_step, stop=self.stop_event)
        finally:
            p.train_s = train_before + (time.monotonic() - t_train)
            self.state.set_meta("train_s", p.train_s)
        if self.stop_event.is_set() or o.steps is None:
            return
        p.val_loss = await self.driver.evaluate(self.cfg.train.eval_batches, lane=0)
        self.state.set_meta("val_loss", p.val_loss)
        p.done_block = await self.chain.block()
        p.done = True
        self.write_status()
        logger.info("done: {} lane steps per lane, val loss {}", o.steps,
                    f"{p.val_loss:.4f}" if p.val_loss is not None else "-")

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
        loops = [("status", o.outputs.status_interval_s, self.write_status),
                 ("metagraph", o.chain.sync_interval_s, self._sync_and_probe),
                 ("weights", o.chain.weights_check_s, self._weights_round)]
        if o.scoring.clasp_interval_s > 0:
            loops.append(("clasp", o.scoring.clasp_interval_s, self._clasp_round))
        if o.audits.audits:
            loops.append(("audits", o.audits.audit_interval_s, self._audit_round))
        try:
            for name, period, fn in loops:
                self.sup.spawn(name, functools.partial(self._every, period, fn, name))
            await self.endpoints.serve(self)
            await self.endpoints.serve_dashboard(self)
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

    async def close(self) -> None:
        await self.verification.close()
        await self.endpoints.close_dashboard()
        await self.endpoints.close_server()
        if self.state is not None:
            try:
                self.verification.save_totals(self.state)
                self.verification.save_flags(self.state)
                self.state.set_meta("elapsed_s", self.elapsed_s())
                self.state.save_ledger(self.ledger)
                self.write_status()
            except Exception as e:  # noqa: BLE001
                logger.warning("final save failed: {}", e)
            self.state.close()
            self.state = None
        self.progress.close()
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
