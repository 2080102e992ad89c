"""A miner's replica merging (:mod:`iota_subnet.merge`): when it merges, the gate that holds compute
while a merge runs, its merge state on disk, state sync from its peers, and the merge routes.

Merge epoch k closes at inner step (k + 1) x ``merge.every_steps`` (or by blocks with
``merge.every_blocks``); after each compute the miner starts the merge of the epoch that just closed
(:meth:`MinerMerging.maybe_merge`). While a merge runs, compute waits at the gate
(:meth:`MinerMerging.gate`) unless ``merge.overlap``. The merged state is saved next to the checkpoint
(``<out>/stage<k>.merge.safetensors``: anchor, momentum, merged epoch, the inner step it was set at,
the work base) and published to peers for state sync (``/state/chunk``). On start the replica catches
up (:mod:`iota_subnet.miner.catch_up`) before it counts as in sync.

Routes (replicas of the same stage only): ``/merge/join|contribute|result|contribution``,
``/state/chunk``; ``/evidence`` (validators): the merge mismatch evidence this replica recorded;
``/audit/merge`` (validators): chunks of a merge slice or mean this replica signed.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from loguru import logger

from iota_subnet.config import RunConfig
from iota_subnet.merge import MergeEngine, MergeEngineOptions, ModuleParams
from iota_subnet.merge.claims import MergeAuditRoute, MergeClaims
from iota_subnet.merge.replay import ReplayError, replay_to_newest
from iota_subnet.merge.sync import SnapshotDonor, SyncError, sync_state
from iota_subnet.merge.transport import HttpTransport
from iota_subnet.miner.audits import MinerAudits
from iota_subnet.miner.catch_up import catch_up
from iota_subnet.miner.chain_view import ChainView
from iota_subnet.miner.checkpoints import Checkpoints
from iota_subnet.miner.compute_thread import ComputeThread
from iota_subnet.protocol import (MergeAuditRequest, MergeEvidence, MergeJoin, MergePayload, MergeResultRequest,
                                  Outcome, ProtocolError, StateChunkRequest, StateReplayRequest,
                                  merge_payload_contract)
from iota_subnet.telemetry import NeuronMetrics
from iota_subnet.train.checkpoint import read_checkpoint, tensors_bytes
from iota_subnet.transport import NeuronClient, NeuronServer
from iota_subnet.utils.atomic import atomic_write_bytes
from iota_subnet.utils.supervise import Supervisor


def progress_credited(remote: str, endpoint: Optional[str], relays: Sequence[str] = ()) -> bool:
    """Whether body bytes from ``remote`` (an IP) count as the progress of a sender that serves
    ``endpoint`` (``ip:port`` on chain, or None) and publishes ``relays`` (``ip:port``; a sender behind
    a NAT): its axon's host or one of its relays' hosts. A NAT'd sender's own public address is
    published nowhere, so its bytes count only when it shares an address with one of its relays (the
    same machine or network, as on a localnet)."""
    hosts = {ep.rsplit(":", 1)[0] for ep in (endpoint, *relays) if ep}
    return bool(remote) and remote in hosts


@dataclass(frozen=True)
class MergingLinks:
    """What the merge part uses of its miner service: ``metrics`` (merges and merge hops are counted
    there), ``supervisor`` (runs the catch-up and merge tasks), ``parts`` (the
    :class:`~iota_subnet.miner.parts.MinerParts` whose ``make_merge_engine`` builds the engine) and
    ``write_status()`` (rewrites ``status.json`` after a state sync)."""

    metrics: NeuronMetrics
    supervisor: Supervisor
    parts: Any
    write_status: Callable[[], None]


class MinerMerging:
    """The merge part of a miner (see the module docstring). Built with the miner; :meth:`mount`
    sets it up for a started worker when the run merges. ``links``: what it uses of the service
    (:class:`MergingLinks`; its fields are kept as attributes, the supervisor as ``sup``). ``engine``: the
    :class:`~iota_subnet.merge.engine.MergeEngine` (None: not merging); ``anchor_step``: the inner step
    at which the engine's anchor (the merged weights) was set, by a merge, a state sync or the
    merge-state file (saved with it: which of checkpoint and merge state is newer); ``sync_report``:
    the latest state sync (``status.json`` ``merge.sync``)."""

    def __init__(self, cfg: RunConfig, wallet: Any, *, out: Path, view: ChainView, compute: ComputeThread,
                 checkpoints: Checkpoints, audits: MinerAudits, links: MergingLinks):
        self.cfg, self.wallet, self.out, self.view, self.compute = cfg, wallet, Path(out), view, compute
        self.checkpoints, self.audits = checkpoints, audits
        self.metrics, self.sup, self.parts = links.metrics, links.supervisor, links.parts
        self.write_status = links.write_status
        self.worker: Any = None
        self.engine: Optional[MergeEngine] = None
        self.donor: Optional[SnapshotDonor] = None
        self.sync_report: Optional[dict] = None
        self.claims: Optional[MergeClaims] = None
        self.client: Optional[NeuronClient] = None
        self.anchor_step = 0
        #: set while no merge runs (compute waits on it unless ``merge.overlap``); the last epoch closed
        self.gate_open = asyncio.Event()
        self.gate_open.set()
        self.last_epoch = -1
        self.sync_task: Optional[asyncio.Task] = None
        self.task: Optional[asyncio.Task] = None

    @property
    def stage(self) -> Optional[int]:
        return self.view.stage

    @property
    def state_path(self) -> Path:
        """``<out>/stage<k>.merge.safetensors``."""
        return self.out / f"stage{self.stage}.merge.safetensors"

    def mount(self, server: NeuronServer, worker: Any) -> None:
        """Build the merge engine for ``worker`` (over its ``merge_module``), load the merge-state file,
        publish the state to peers and mount the merge routes on ``server``."""
        mc, run_id, stage = self.cfg.merge, self.view.run_id, self.stage
        self.worker = worker
        self.client = NeuronClient(self.wallet, on_request=self.metrics.observe_hop, alternates=self.view.relays_of)
        transport = HttpTransport(self.client, self.view.endpoint_of, timeout_s=mc.phase_timeout_s + 5,
                                  bytes_per_s=mc.assumed_uplink_bps / 8, reply_bytes=4 * mc.chunk_numel)
        self.claims = MergeClaims(self.wallet.hotkey, run_id, stage, int8_block=mc.int8_block,
                                  spill=self.audits.spill_dir())
        params = ModuleParams(worker.merge_module, worker.lock, on_write=worker.weights_replaced)
        options = MergeEngineOptions(weights_fn=self.view.merge_weights, work_fn=lambda: float(worker.trained_tokens),
                                     on_applied=self._on_merged, before_attempt=lambda: self.view.refresh(force=True),
                                     observer=self.claims, step_fn=lambda: worker.inner_step,
                                     spare_fn=lambda: worker.lane is None and worker.trained_tokens == 0)
        self.engine = self.parts.make_merge_engine(self.view.hotkey, mc, params, transport, run_id=run_id, stage=stage,
                                                   options=options)
        server.add_route("/audit/merge", MergeAuditRoute(self.claims), MergeAuditRequest, None)
        self.engine.in_sync = False
        self._load_state()
        # the engine's config: a subclass's may differ from the run's (the simulation's virtual merges)
        self.donor = self.parts.make_snapshot_donor(self.engine, run_id, stage, self.engine.cfg.sync_chunk_numel,
                                                    mc.max_concurrent_transfers)
        self.donor.publish(self.engine.anchor, self.engine.momentum, self.engine.merged_epoch, worker.inner_step)
        self.last_epoch = self.epoch_at(worker.inner_step)
        P = self.engine.params.numel
        server.add_route("/merge/join", self._merge_route, MergeJoin, None)
        # a message holds one chunk of a slice (fp32) plus int8 scales and the JSON header
        C = min(P, mc.chunk_numel)
        server.add_route("/merge/contribute", self._merge_route, MergePayload,
                         merge_payload_contract(max_numel=C, block=mc.int8_block),
                         max_body_bytes=4 * C + 4 * (C // mc.int8_block + 1) + (1 << 20),
                         on_body_bytes=self._body_bytes)
        server.add_route("/merge/result", self._merge_route, MergeResultRequest, None)
        server.add_route("/merge/contribution", self._merge_route, MergeResultRequest, None)
        server.add_route("/state/chunk", self._chunk_route, StateChunkRequest, None)
        server.add_route("/state/replay", self._replay_route, StateReplayRequest, None)
        server.add_route("/evidence", self._evidence_route, MergeEvidence, None)

    def start_catch_up(self) -> None:
        """Start the supervised ``catch-up`` task (:meth:`_catch_up`)."""
        self.sync_task = self.sup.spawn("catch-up", self._catch_up)

    def epoch_at(self, step: int) -> int:
        """Merge epoch k closes at inner step (k + 1) * H: the last closed epoch at ``step``."""
        H = self.cfg.merge.every_steps
        return step // H - 1 if H else -1

    # ---- the gate --------------------------------------------------------------------------------
    async def gate(self) -> None:
        """The data plane's gate before each compute: waits for a running merge unless ``merge.overlap``."""
        await self.wait_for_merge(training=True)

    async def wait_for_merge(self, training: bool = False) -> None:
        """Wait for a running replica merge to finish; BUSY (503) if it outlasts its own deadlines.
        With ``merge.overlap`` training goes on during a merge (``training``: a training forward) and
        only evaluation waits. ``/state`` and the audit routes never wait: they read kept state."""
        if self.gate_open.is_set() or (training and self.cfg.merge.overlap):
            return
        mc = self.cfg.merge
        try:
            await asyncio.wait_for(self.gate_open.wait(), timeout=mc.join_timeout_s + 3 * mc.phase_timeout_s)
        except asyncio.TimeoutError:
            raise ProtocolError(Outcome.BUSY, "merging with the other replicas") from None

    # ---- routes ----------------------------------------------------------------------------------
    def _check_header(self, msg) -> None:
        run_id = self.view.run_id
        if msg.run_id != run_id:
            raise ProtocolError(Outcome.FORBIDDEN, f"this miner trains run {run_id!r}, not {msg.run_id!r}")
        if msg.stage != self.stage:
            raise ProtocolError(Outcome.FORBIDDEN, f"this miner serves stage {self.stage}, not {msg.stage}")

    def _body_bytes(self, hotkey: str, remote: str, n: int) -> None:
        """Bytes of a merge contribution still arriving show the sender's progress (its transfer is not
        cut while they move), counted only when they come from an address the sender publishes
        (:func:`progress_credited`; before its signature can be checked, a forger could otherwise keep
        a stalled peer looking alive; a sender whose outbound address it does not publish shows
        progress per message only). Through this miner's relay tunnel ``remote`` is the address the
        relay saw: a lying relay can keep a stalled peer looking alive until the backstop deadline,
        no more (:mod:`iota_subnet.transport.relay`)."""
        if progress_credited(remote, self.view.endpoint_of(hotkey), self.view.relays_of(hotkey)):
            self.engine.link.moving(hotkey, n)

    async def _merge_route(self, msg, ctx):
        self._check_header(msg)
        return await self.engine.handle(ctx.route, msg, ctx.caller_hotkey)

    async def _evidence_route(self, msg, ctx):
        """(validators) the merge mismatch evidence this replica recorded, newest last."""
        self._check_header(msg)
        return MergeEvidence(run_id=self.view.run_id, stage=self.stage, reports=self.engine.reports[-50:],
                             merged_epoch=int(self.engine.merged_epoch))

    async def _chunk_route(self, msg, ctx):
        self._check_header(msg)
        return await self.donor.handle(msg, ctx.caller_hotkey, on_sent=ctx.on_sent)

    async def _replay_route(self, msg, ctx):
        self._check_header(msg)
        return await self.donor.handle_replay(msg, ctx.caller_hotkey, on_sent=ctx.on_sent)

    # ---- merge state on disk ---------------------------------------------------------------------
    def _load_state(self) -> None:
        p, w = self.state_path, self.worker
        if not p.exists():
            return
        resumed = self.checkpoints.resumed
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
            own = not resumed or merged_at >= w.inner_step
            self.engine.set_state(tensors["anchor"], tensors["momentum"], int(meta["merged_epoch"]), write_params=own)
            self.engine.feedback.load(tensors.get("error_feedback"), self.engine.params.numel)
            self.anchor_step = merged_at
            if own:
                why = (f"its checkpoint (inner step {w.inner_step}) is older than its merge state"
                       if resumed else "no checkpoint")
                w.inner_step = max(w.inner_step, merged_at)
                logger.info(f"stage {self.stage}: {why}; resuming from the merged weights of epoch "
                            f"{self.engine.merged_epoch} at inner step {w.inner_step}")
            self.engine.work_base = min(float(meta.get("work_base", self.engine.work_base)), float(w.trained_tokens))
        except Exception as e:  # noqa: BLE001 - a bad file means: sync from peers
            logger.warning(f"ignoring merge state {p}: {e}")

    def save_state(self) -> None:
        """Write the merge state (blocking; run it off the event loop)."""
        m = self.engine
        tensors = {"anchor": m.anchor.contiguous().cpu(), "momentum": m.momentum.contiguous().cpu()}
        if m.feedback.state is not None:            # top-k merges: the unsent residual
            tensors["error_feedback"] = m.feedback.state.contiguous()
        data = tensors_bytes(tensors,
                             {"merged_epoch": m.merged_epoch, "step": self.anchor_step,
                              "anchor_step": self.anchor_step, "work_base": m.work_base})
        atomic_write_bytes(self.state_path, data)

    async def _on_merged(self, rep) -> None:
        self.anchor_step = self.worker.inner_step
        self.donor.record(self.engine.last_applied)
        self.donor.publish(self.engine.anchor, self.engine.momentum, self.engine.merged_epoch, self.worker.inner_step)
        await asyncio.get_running_loop().run_in_executor(None, self.save_state)
        logger.info(f"stage {self.stage}: merge epoch {rep.epoch} applied with {len(rep.participants)} replicas "
                    f"in {rep.wall_s:.2f}s ({rep.bytes_sent:,} B sent, {rep.bytes_received:,} B received)")

    # ---- state sync ------------------------------------------------------------------------------
    async def _catch_up(self) -> None:
        """On start: sync from peers when they merged an epoch this replica has not; then in sync
        (:mod:`iota_subnet.miner.catch_up`: waits for an answer rather than trusting a silence)."""
        mc = self.cfg.merge
        try:
            # its own state: its merge-state file, or its own checkpoint of the weights it merges (a worker
            # without weights, e.g. an emulated one merging a proxy, "resumes" its step counters only: a
            # fresh one must wait for its peers' answer, not go on from the proxy's seeded values)
            own = (self.checkpoints.resumed and getattr(self.worker, "has_weights", True)) or self.engine.merged_epoch >= 0
            res = await catch_up(self.engine, self.view.stage_peers, lambda e: self.pull_merged_state(min_epoch=e),
                                 own_state=own,
                                 ask_timeout_s=min(5.0, mc.join_timeout_s), max_wait_s=4 * mc.join_timeout_s)
            logger.info(f"stage {self.stage}: catch-up {res.how} after {res.wall_s:.1f} s ({res.rounds} rounds); "
                        f"merged epoch {self.engine.merged_epoch}, inner step {self.worker.inner_step}")
        finally:
            self.engine.in_sync = True

    async def pull_merged_state(self, min_epoch: int = -1, keep_progress: bool = False) -> bool:
        """Catch up with the stage's newest merged state; applies all or nothing. Returns True when
        applied. A replica holding a merged state of its own replays the merges it missed
        (:mod:`iota_subnet.merge.replay`: the gather's bytes per merge, checked against the donors'
        snapshot hash); otherwise, or when that fails, state sync from every peer at once
        (:mod:`iota_subnet.merge.sync`), then a replay of the merges applied while it ran.
        ``keep_progress``: keep this replica's progress since its old anchor on top of the pulled one
        (:meth:`~iota_subnet.merge.engine.MergeEngine.set_state`; a replica late to a merge)."""
        m, w = self.engine, self.worker
        was_in_sync, m.in_sync = m.in_sync, False
        t0 = time.monotonic()
        # status.json's merge.sync: how the state sync goes; missing_chunks names the chunks of the last
        # failed attempt that no donor delivered
        self.sync_report = {"state": "syncing", "attempt": 1, "missing_chunks": [], "error": None}
        try:
            for attempt in range(3):
                # its own state: once (a state that failed the check fails it again; the snapshot path retries)
                own = attempt == 0 and m.merged_epoch >= 0
                got = await self._replay(m.anchor, m.momentum, m.merged_epoch) if own else None
                if got is None:
                    try:
                        got = await sync_state(self.view.stage_peers(), m.transport, run_id=self.view.run_id,
                                               stage=self.stage, param_numel=m.params.numel,
                                               work_dir=self.out / "sync", min_epoch=min_epoch,
                                               window=self.cfg.merge.sync_window)
                    except SyncError as e:
                        logger.warning(f"state sync attempt {attempt + 1} failed: {e}")
                        self.sync_report = {"state": "syncing" if attempt < 2 else "failed", "attempt": attempt + 1,
                                            "missing_chunks": list(e.missing), "error": str(e)}
                        self.write_status()
                        await asyncio.sleep(2.0 ** attempt)     # backoff; the next try may find a later snapshot
                        continue
                    # the donors merged on while it fetched (they kept serving the snapshot it started on)
                    anchor, mom, man = got
                    got = await self._replay(anchor, mom, int(man["merged_epoch"]), snapshot=man) or got
                anchor, mom, man = got

                def apply():
                    with w.lock:
                        m.set_state(anchor, mom, man["merged_epoch"], keep_progress=keep_progress)
                        # no lane drives it yet: start at the donors' inner step (in a lane, the lane's step
                        # stays). Not (merged_epoch + 1) x H: epochs are labels the replicas agree on and run
                        # ahead of the steps under churn (a joiner could come up at inner step 65 while the
                        # lanes are at 41-52, and the validator would count its lane's steps 51-64 done)
                        if w.auto_step:
                            w.inner_step = max(w.inner_step, int(man.get("step", 0)))
                        w.opt.zero_grad(set_to_none=True)
                        w.pending = 0
                        # also with kept progress: on a restart the merge state (this anchor) must not look
                        # older than a checkpoint taken before this pull (its weights sit on the old anchor)
                        self.anchor_step = w.inner_step
                await self.compute.run(apply)
                self.last_epoch = max(self.last_epoch, man["merged_epoch"])
                self.donor.publish(m.anchor, m.momentum, m.merged_epoch, w.inner_step)
                await asyncio.get_running_loop().run_in_executor(None, self.save_state)
                sync, replay = man.get("sync") or {}, man.get("replay") or {}
                logger.info(f"stage {self.stage}: merged state of epoch {man['merged_epoch']} "
                            f"(sync: {sync or 'none'}; replay: {replay or 'none'})")
                # wall_s: from the first describe to applied (retries included); synced_at: unix time;
                # bytes: the state's tensor bytes fetched (an emulated stage's: the proxy's, 1/scale);
                # replayed_merges / replay_bytes: merges replayed after (or instead of) the snapshot
                self.sync_report = {"state": "synced", "attempt": attempt + 1, "missing_chunks": [], "error": None,
                                    "merged_epoch": man["merged_epoch"], "wall_s": round(time.monotonic() - t0, 3),
                                    "synced_at": round(time.time(), 3), "bytes": int(sync.get("bytes", 0)),
                                    "chunks": int(sync.get("chunks", 0)), "donors": len(sync.get("donors", [])),
                                    "snapshot_epoch": replay.get("from_epoch", man["merged_epoch"]) if sync else None,
                                    "replayed_merges": int(replay.get("merges", 0)),
                                    "replay_bytes": int(replay.get("bytes", 0))}
                return True
            return False
        finally:
            m.in_sync = was_in_sync     # the catch-up declares it in sync when it is done

    async def _replay(self, anchor, momentum, epoch: int, snapshot: Optional[dict] = None) -> Optional[tuple]:
        """Replay the merges after merged ``epoch`` onto ``(anchor, momentum)`` (this replica's own
        state, or the ``snapshot`` manifest's it just synced): ``(anchor, momentum, manifest)``
        checked against the donors' newest snapshot, or None when it cannot (the reason is logged)."""
        mc = self.engine.cfg
        try:
            a, mom, newest = await replay_to_newest(self.view.stage_peers(), self.engine.transport,
                                                    run_id=self.view.run_id, stage=self.stage, anchor=anchor,
                                                    momentum=momentum, epoch=epoch, lr=mc.outer_lr,
                                                    mu=mc.outer_momentum, nesterov=mc.nesterov, block=mc.int8_block,
                                                    window=self.cfg.merge.sync_window,
                                                    sha256=None if snapshot is None else snapshot.get("sha256"))
        except ReplayError as e:
            logger.info(f"stage {self.stage}: no replay from merged epoch {epoch}: {e}")
            return None
        if snapshot is not None:
            newest["sync"] = snapshot.get("sync")
        return a, mom, newest

    # ---- when to merge ---------------------------------------------------------------------------
    def maybe_merge(self) -> None:
        """After a compute: start the merge of the epoch that just closed (by inner steps or blocks)."""
        if self.engine is None or (self.task is not None and not self.task.done()):
            return
        epoch = self.epoch_at(self.worker.inner_step)
        if epoch <= self.last_epoch:
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
            self.last_epoch = epoch
            self.engine.skip(self.engine.next_epoch(epoch))     # the label a merge here would have used
            return
        self.start_merge(epoch)

    async def block_clock(self) -> None:
        """With ``merge.every_blocks``: start the merge of the epoch the chain's block closed, unless
        one runs (the chain round calls it every second)."""
        if self.engine is None or not self.cfg.merge.every_blocks:
            return
        try:
            epoch = await self.view.chain.block() // self.cfg.merge.every_blocks - 1
            if epoch > self.last_epoch and (self.task is None or self.task.done()):
                self.start_merge(epoch)
        except Exception as e:  # noqa: BLE001
            logger.warning(f"block-clock merge check failed: {e}")

    def start_merge(self, epoch: int) -> None:
        """Close ``epoch`` and start its merge (supervised task ``merge``; compute waits at the gate)."""
        self.last_epoch = epoch
        self.gate_open.clear()
        self.task = self.sup.spawn("merge", lambda: self._run_merge(epoch))

    async def _run_merge(self, epoch: int) -> None:
        try:
            updates = getattr(self.worker, "updates", None)
            if updates is not None:          # the last step's audit copies leave host memory before the merge's
                await asyncio.to_thread(updates.settle)      # buffers arrive (iota_subnet.host_plan)
            rep = await self.engine.merge(epoch, self.view.stage_peers)     # re-read after each attempt's refresh
            self.metrics.observe_merge(rep.status, rep.wall_s, rep.bytes_sent, rep.bytes_received)
            if rep.status == "late":        # a peer holds a newer merged state (not necessarily this epoch's)
                rep = await self._late_to_merge(rep)
            if rep.status not in ("merged", "late"):
                logger.info(f"stage {self.stage}: merge epoch {epoch} {rep.status}: {rep.reason}")
        except Exception:  # noqa: BLE001 - a merge failure must never stop serving
            logger.exception(f"merge epoch {epoch} failed")
        finally:
            self.gate_open.set()

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
        w = self.worker
        span = w.inner_step - self.anchor_step      # since its last merge or pull
        total = w.total_steps
        keep = H > 0 and 0 < span <= 2 * H and (total is None or w.inner_step < total)
        since = self.anchor_step
        pulled = await self.pull_merged_state(min_epoch=self.engine.merged_epoch + 1, keep_progress=keep)
        if not (pulled and keep and self.engine.merged_epoch < rep.epoch):
            self.engine.skip(rep.epoch)
            if pulled and keep:
                logger.info(f"stage {self.stage}: late to merge epoch {rep.epoch}; its progress of inner steps "
                            f"{since}-{w.inner_step} goes into its next merge")
            return rep
        again = await self.engine.merge(rep.epoch, self.view.stage_peers)
        self.metrics.observe_merge(again.status, again.wall_s, again.bytes_sent, again.bytes_received)
        if again.status == "late":          # merged meanwhile without it: the next merge takes its progress
            self.engine.skip(again.epoch)
        return again

    # ---- status and shutdown ---------------------------------------------------------------------
    def status(self) -> Optional[dict]:
        """``status.json``'s ``merge`` (None when not merging)."""
        if self.engine is None:
            return None
        d = self.engine.status()
        d["mismatch_evidence"] = self.engine.reports[-10:]
        d["sync"] = self.sync_report
        d["donor"] = None if self.donor is None else self.donor.status()
        return d

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()
