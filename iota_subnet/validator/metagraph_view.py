"""The validator's reading of the metagraph: routing (the replicas of its run, :mod:`.routing`), the
lane assignment it keeps across restarts, miners flagged as cheaters barred from routing, uid ->
hotkey, the validators it coordinates with (:mod:`.peers`) and its heartbeat, and the wait for
complete lanes before driving. Neurons of its run id and epoch that advertise another spec hash (``h``:
another config under the same name) are logged, kept out of routing (miners) and of the coordination
(validators), and listed in ``status.json`` (``peers.other_spec``, ``miners_other_spec``)."""
from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Awaitable, Callable, Optional

from loguru import logger

from iota_subnet.protocol.commitment import MINER, Fingerprints, RunCommitment

from .options import ChainOptions, RunOptions, ValidatorError
from .peers import PeerView, alive_blocks_for, coordinating_validators, heartbeat_due, run_fingerprints
from .routing import Router, discover
from .state import ValidatorState


class MetagraphView:
    """One validator's view of the metagraph, refreshed by each sync (``chain``: netuid, sync period,
    liveness window; ``run``: the run it drives and how long it waits for lanes)."""

    def __init__(self, chain: ChainOptions, run: RunOptions):
        self.chain_opts = chain
        self.run = run
        self.current: dict[int, str] = {}  # uid -> hotkey (metagraph)
        self.relays: dict[str, tuple[str, ...]] = {}  # hotkey -> relays its commitment publishes
        self.peers = PeerView([])
        self.validators: list[str] = []
        self.other_runs: dict[str, int] = {}
        #: hotkey -> spec hash of this run's miners advertising another spec hash (not routed to)
        self.other_spec_miners: dict[str, str] = {}
        self.heartbeat = 0
        self.alive_blocks = 0
        self.saved_slots = ""   # the lane assignment as last written to the state (JSON)

    def set_timing(self, tempo: int, rate_limit: int) -> None:
        """The liveness window of the other validators (``peer_alive_blocks``, else two weights periods)."""
        self.alive_blocks = self.chain_opts.peer_alive_blocks or alive_blocks_for(tempo, rate_limit)

    def check_fingerprints(self, graph: Any, fingerprints: Optional[Fingerprints], hotkey: str) -> None:
        """Refuse to join a run whose other validators train on other tokens (naming both); raises
        :class:`ValidatorError`."""
        if fingerprints is None:
            return
        o = self.run
        run = run_fingerprints(graph.neurons, run=o.run_id, epoch=o.run_epoch, block=int(graph.block),
                               alive_blocks=self.alive_blocks, exclude=hotkey)
        if run is None:
            return
        fps, uids = run
        bad = fingerprints.differs(fps)
        if bad:
            raise ValidatorError(
                f"this validator's {' and '.join(bad)} differ from run {o.run_id!r} epoch {o.run_epoch} as its "
                f"validators (uids {uids}) advertise it: ours tokenizer {fingerprints.tokenizer} / data "
                f"{fingerprints.data}, the run's tokenizer {fps.tokenizer} / data {fps.data}. Use the run's "
                "--data, config and tokenizer (no --allow-data-fallback), or another --run-id")

    def route(self, graph: Any, router: Router, stages: int, spec_hash: str = "") -> None:
        """Routing from the metagraph's commitments (replicas of this run with this validator's
        ``spec_hash`` or none advertised), miners of other runs seen, uid -> hotkey."""
        o = self.run
        commits = {n.hotkey: n.commitment.value for n in graph.neurons
                   if n.commitment is not None and n.commitment.value is not None}
        router.update(discover(graph.neurons, commits, o.run_id, stages, o.run_epoch, spec_hash))
        others: dict[str, int] = {}
        relays: dict[str, tuple[str, ...]] = {}
        other_spec: dict[str, str] = {}
        for hk, raw in commits.items():
            c = RunCommitment.decode(raw)
            if c is not None and c.relays:
                relays[hk] = c.relays
            if c is not None and c.role == MINER and not c.same_run(o.run_id, o.run_epoch):
                label = c.run if c.epoch == 0 else f"{c.run}#{c.epoch}"
                others[label] = others.get(label, 0) + 1
            elif c is not None and c.role == MINER and spec_hash and c.spec_hash and c.spec_hash != spec_hash:
                other_spec[hk] = c.spec_hash
        if other_spec and other_spec != self.other_spec_miners:
            logger.warning("miners of run {!r} epoch {} advertise another spec hash than this validator's {}: {}; "
                           "no hop goes to them (they run another config under this run's name)", o.run_id,
                           o.run_epoch, spec_hash, {hk[:10]: h for hk, h in sorted(other_spec.items())})
        self.other_spec_miners = other_spec
        self.other_runs = others
        self.relays = relays
        self.current = {int(n.uid): str(n.hotkey) for n in graph.neurons}

    def relays_of(self, hotkey: str) -> tuple[str, ...]:
        """The relays ``hotkey`` is reached through (its commitment's ``rl``; empty: dialled directly)."""
        return self.relays.get(hotkey, ())

    @staticmethod
    def bar(router: Router, flagged: set[tuple[int, str]]) -> list:
        """Bar newly flagged miners (``flagged``: (uid, hotkey)) from routing
        (:meth:`.routing.Router.bar`); returns the newly barred ones."""
        new = router.bar(flagged)
        for uid, hk in new:
            r = router.get((uid, hk))
            others = [x for x in router.replicas.get(r.stage, []) if router.is_available(x)] if r else []
            logger.warning("uid {} ({}) is flagged as a cheater: no hop goes to it again{}", uid, hk[:10],
                           "" if r is None or others else
                           f"; stage {r.stage} has no other available replica, its hops wait for one")
        return new

    def reassign(self, router: Router, n_lanes: int, state: ValidatorState) -> None:
        """Spare replicas take the lane seats of barred or long unavailable members; the lane
        assignment goes to the state when it changed."""
        for stage, lane, old, new in router.reassign_vacant(n_lanes):
            why = "is barred (flagged as a cheater)" if old in router.barred else \
                f"has been unavailable for {router.vacate_after_s:.0f} s"
            logger.warning("lane {} stage {}: uid {} {}; spare uid {} takes its place in the lane", lane, stage,
                           old[0], why, new[0])
        self.save_slots(router, state)

    def load_slots(self, router: Router, state: ValidatorState) -> None:
        """Restore the lane assignment of this validator's previous process (see
        :meth:`Router.load_slot_table`); a malformed entry is logged and the uid order used."""
        raw = state.get_meta("lane_slots")
        if not raw:
            return
        try:
            router.load_slot_table(json.loads(raw))
        except (ValueError, TypeError, AttributeError) as e:
            logger.warning("the saved lane assignment in {} is unreadable ({}); lanes start from the uid order",
                           state.path, e)
            return
        self.saved_slots = raw

    def save_slots(self, router: Router, state: ValidatorState) -> None:
        raw = json.dumps(router.slot_table(), sort_keys=True)
        if raw != self.saved_slots:
            state.set_meta("lane_slots", raw)
            self.saved_slots = raw

    def update_peers(self, graph: Any, hotkey: str, fingerprints: Optional[Fingerprints], pending: bool,
                     spec_hash: str = "") -> bool:
        """The validators this one coordinates with (those of its run advertising another spec hash
        than ``spec_hash`` are logged and left out); True when its heartbeat was bumped (its commitment
        is due again; ``pending``: one is still being published)."""
        o = self.run
        block = int(graph.block)
        before = self.peers.other_spec
        self.peers = coordinating_validators(graph.neurons, run=o.run_id, epoch=o.run_epoch, block=block,
                                             alive_blocks=self.alive_blocks, self_hotkey=hotkey,
                                             fingerprints=fingerprints, spec_hash=spec_hash)
        if self.peers.other_spec and self.peers.other_spec != before:
            logger.warning("validators of run {!r} epoch {} advertise another spec hash than this one's {}: {}; "
                           "they run another config under this run's name and are not coordinated with (one of "
                           "the two must use another --run-id, or both the same config)", o.run_id, o.run_epoch,
                           spec_hash, {hk[:10]: h for hk, h in sorted(self.peers.other_spec.items())})
        self.validators = self.peers.coordinating
        if not pending and heartbeat_due(graph.neurons, hotkey, block, self.alive_blocks):
            self.heartbeat += 1
            return True
        return False

    async def wait_for_peers(self, stop: asyncio.Event, sync: Callable[[], Awaitable[None]]) -> None:
        """Before the lane steps are split: while a validator-permit holder has no commitment at all
        (``peers.unannounced``), sync again every second for up to ``wait_peers_s``. Validators started
        together publish their commitments a few blocks apart; one that read the metagraph before the
        other's landed would drive every step alone while the other drives its share of them (each
        step twice, and neither the other's receipts). A permit holder that runs other code never
        publishes one: it costs one ``wait_peers_s`` at start."""
        deadline = time.monotonic() + self.chain_opts.wait_peers_s
        if self.peers.unannounced:
            logger.info("{} validator-permit holder(s) publish no commitment yet; waiting up to {:.0f} s for them "
                        "before splitting the lane steps", self.peers.unannounced, self.chain_opts.wait_peers_s)
        while self.peers.unannounced and time.monotonic() < deadline and not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=1.0)
            except asyncio.TimeoutError:
                pass
            await sync()

    async def wait_for_lanes(self, router: Router, stop: asyncio.Event, sync: Callable[[], Awaitable[None]]) -> int:
        """Wait (``wait_miners_s``, syncing) for ``min_lanes`` complete lanes; returns how many there are
        (0 when ``stop`` is set). Raises :class:`ValidatorError` when there is none by then."""
        o = self.run
        deadline = time.monotonic() + o.wait_miners_s
        while router.n_lanes < max(1, int(o.min_lanes)):
            if time.monotonic() > deadline and router.n_lanes > 0:
                logger.warning("only {} of {} lanes complete after {:.0f} s; driving those", router.n_lanes,
                               o.min_lanes, o.wait_miners_s)
                break
            if time.monotonic() > deadline:
                raise ValidatorError(f"no complete pipeline after {o.wait_miners_s:.0f} s: replicas per stage "
                                     f"{router.stage_counts()} for run {o.run_id!r}; start miners for every stage")
            if stop.is_set():
                return 0
            others = self.other_runs
            logger.info("waiting for miners of run {!r}: replicas per stage {}{}", o.run_id,
                        router.stage_counts(),
                        f"; miners of other runs seen: {others} (pass --run-id to join one)" if others else "")
            try:
                await asyncio.wait_for(stop.wait(), timeout=min(2.0, self.chain_opts.sync_interval_s))
            except asyncio.TimeoutError:
                pass
            await sync()
        return router.n_lanes
