"""A miner's view of the chain: the metagraph, the run's commitments, its own uid and stage, and the
replicas of its stage (its peers).

:class:`ChainView` re-reads the metagraph and commitments (:meth:`ChainView.refresh`), follows this
hotkey's uid, and answers the questions the miner's parts ask of it: where a hotkey serves
(:meth:`ChainView.endpoint_of`), which hotkeys hold this stage (:meth:`ChainView.stage_peers`), what
the run's validators advertise (:meth:`ChainView.run_fingerprints`) and the merge weights of a
merge's participants. :class:`RouteAuth` decides which registered hotkeys may call which route.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, Optional

from loguru import logger

from iota_subnet.chain import Chain
from iota_subnet.config import ConfigError
from iota_subnet.protocol import Outcome, ProtocolError
from iota_subnet.protocol.commitment import (MINER, VALIDATOR, Fingerprints, RunCommitment, RunMismatchError,
                                             merge_weights_from_commitments)


class ChainView:
    """The metagraph and the run's commitments as last read, for the miner of ``hotkey`` in run
    ``run_id`` epoch ``run_epoch`` on ``netuid``. ``refresh_s``: seconds between re-reads (a forced
    re-read comes at most once a second). ``uid``: this hotkey's uid (None: not registered);
    ``stage``: the stage it holds (None until chosen)."""

    def __init__(self, chain: Chain, *, netuid: int, run_id: str, run_epoch: int, hotkey: str, refresh_s: float):
        self.chain, self.netuid, self.run_id, self.run_epoch = chain, netuid, run_id, int(run_epoch)
        self.hotkey, self.refresh_s = hotkey, refresh_s
        self.uid: Optional[int] = None
        self.stage: Optional[int] = None
        #: hotkey -> neuron of the metagraph; hotkey -> raw commitment; hotkey -> stage of this run's miners
        self.neurons: dict[str, Any] = {}
        self.commitments: dict[str, str] = {}
        self.stages: dict[str, int] = {}
        #: time.monotonic() of the last re-read (0: the next :meth:`refresh` re-reads)
        self.last_refresh = 0.0
        self._lock = asyncio.Lock()

    async def refresh(self, force: bool = False) -> None:
        """Re-read metagraph and commitments (at most once a second when forced)."""
        async with self._lock:
            now = time.monotonic()
            if not force and now - self.last_refresh < self.refresh_s:
                return
            if force and now - self.last_refresh < 1.0:
                return
            mg = await self.chain.metagraph(self.netuid)
            commits = await self.chain.commitments(self.netuid)
            self.neurons = {n.hotkey: n for n in mg.neurons}
            self.commitments = dict(commits)
            stages = {}
            for hk, raw in commits.items():
                c = RunCommitment.decode(raw)
                if c is not None and c.role == MINER and c.same_run(self.run_id, self.run_epoch) and hk in self.neurons:
                    stages[hk] = c.stage
            self.stages = stages
            self._track_uid()
            self.last_refresh = time.monotonic()

    def _track_uid(self) -> None:
        """Follow this hotkey's uid in the metagraph: after a deregistration it has none, after a new
        registration another one (never report a uid that now belongs to another hotkey)."""
        me = self.neurons.get(self.hotkey)
        uid = None if me is None else int(me.uid)
        if uid != self.uid:
            if uid is None:
                logger.warning(f"hotkey {self.hotkey[:10]} is no longer registered on netuid {self.netuid} (was uid "
                               f"{self.uid}); it earns nothing until registered again")
            else:
                logger.warning(f"hotkey {self.hotkey[:10]} is now uid {uid} on netuid {self.netuid} (was {self.uid})")
            self.uid = uid

    def endpoint_of(self, hotkey: str) -> Optional[str]:
        """``host:port`` that ``hotkey`` serves on chain, or None (unknown, or no address served)."""
        n = self.neurons.get(hotkey)
        if n is None or not n.axon or n.axon.startswith("0.0.0.0:0"):
            return None
        return n.axon

    def relays_of(self, hotkey: str) -> tuple[str, ...]:
        """The relays (``ip:port``) ``hotkey``'s commitment publishes: it cannot be dialled and is
        reached through them (its axon is the first; :mod:`iota_subnet.transport.relay`)."""
        c = RunCommitment.decode(self.commitments.get(hotkey))
        return c.relays if c is not None else ()

    def relay_hosts(self) -> list[tuple[str, str]]:
        """(endpoint, hotkey) of the neurons that host a relay for this run (their commitment's
        ``rh``, a served axon), validators first, then by uid."""
        out = []
        for hk, raw in self.commitments.items():
            c, n, ep = RunCommitment.decode(raw), self.neurons.get(hk), self.endpoint_of(hk)
            if c is not None and c.relay_host and c.same_run(self.run_id, self.run_epoch) and n is not None and ep:
                out.append((not n.validator_permit, int(n.uid), ep, hk))
        return [(ep, hk) for _, _, ep, hk in sorted(out)]

    def stage_peers(self) -> list[str]:
        """Hotkeys of the other miners of this run that hold this stage, sorted."""
        return sorted(hk for hk, s in self.stages.items() if s == self.stage and hk != self.hotkey)

    def merge_weights(self, participants: list[str]) -> dict[str, float]:
        """Weight of each participant's contribution to a merge, from the run's commitments."""
        return merge_weights_from_commitments(self.commitments, self.neurons, self.run_id, participants,
                                              self.run_epoch)

    def run_fingerprints(self) -> Optional[tuple[Fingerprints, list[int]]]:
        """The fingerprints the run's validators advertise (most common), and their uids."""
        seen: dict[Fingerprints, list[int]] = {}
        for hk, raw in self.commitments.items():
            n = self.neurons.get(hk)
            c = RunCommitment.decode(raw)
            if n is None or not n.validator_permit or c is None or c.role != VALIDATOR or c.fingerprints is None:
                continue
            if c.same_run(self.run_id, self.run_epoch):
                seen.setdefault(c.fingerprints, []).append(int(n.uid))
        if not seen:
            return None
        fps, uids = max(seen.items(), key=lambda kv: len(kv[1]))
        return fps, sorted(uids)

    def check_fingerprints(self, ours: Optional[Fingerprints]) -> None:
        """Raise :class:`RunMismatchError` when ``ours`` (this miner's data) differs from what the
        run's validators advertise."""
        run = self.run_fingerprints()
        if ours is None or run is None:
            return
        fps, uids = run
        bad = ours.differs(fps)
        if bad:
            raise RunMismatchError(
                f"this miner's {' and '.join(bad)} differ from run {self.run_id!r} epoch {self.run_epoch}: ours "
                f"tokenizer {ours.tokenizer} / data {ours.data}, the run's (validators "
                f"{uids}) tokenizer {fps.tokenizer} / data {fps.data}; use the run's --data and config (and "
                "tokenizer cache) or another --run-id")

    def run_spec_hash(self) -> Optional[tuple[str, list[int]]]:
        """The spec hash the run's validators (a validator permit, role ``v``, this run id and epoch)
        advertise (``h``; the most common when they differ), and their uids; None when none advertises
        one (older validators publish no ``h``)."""
        seen: dict[str, list[int]] = {}
        for hk, raw in self.commitments.items():
            n = self.neurons.get(hk)
            c = RunCommitment.decode(raw)
            if n is None or not n.validator_permit or c is None or c.role != VALIDATOR or not c.spec_hash:
                continue
            if c.same_run(self.run_id, self.run_epoch):
                seen.setdefault(c.spec_hash, []).append(int(n.uid))
        if not seen:
            return None
        h, uids = max(seen.items(), key=lambda kv: (len(kv[1]), kv[0]))
        return h, sorted(uids)

    def check_spec_hash(self, ours: str) -> None:
        """Raise :class:`RunMismatchError` (naming both hashes and the fix) when ``ours`` (the hash of this
        miner's config, :func:`iota_subnet.config_hash.config_hash`) differs from the one the run's
        validators advertise; nothing when either is absent (validators that publish no ``h``)."""
        run = self.run_spec_hash()
        if not ours or run is None or run[0] == ours:
            return
        h, uids = run
        raise RunMismatchError(
            f"this miner's config differs from run {self.run_id!r} epoch {self.run_epoch}: its spec hash is {ours}, "
            f"the run's validators (uids {uids}) advertise {h}; join with --spec-hash {h} (the validators' "
            "config, fetched and checked) instead of --config, or use their config file unchanged")

    def choose_stage(self, requested: Optional[int], n_stages: int) -> int:
        """``requested`` when given (:class:`ConfigError` when out of range), else the stage with the
        fewest replicas of this run (the lowest among equals)."""
        if requested is not None:
            if not 0 <= requested < n_stages:
                raise ConfigError(f"--stage {requested} out of range: this run has "
                                  f"{n_stages} stages (0..{n_stages - 1})")
            return requested
        counts = [0] * n_stages
        for hk, s in self.stages.items():
            if hk != self.hotkey and 0 <= s < len(counts):
                counts[s] += 1
        stage = min(range(len(counts)), key=lambda s: (counts[s], s))
        logger.info(f"automatic stage choice: replicas per stage {counts} -> stage {stage}")
        return stage


class RouteAuth:
    """Which registered hotkeys may call which route of the miner seeing the chain through ``view``:
    validators with a permit the validators' routes (``/tickets``, ``/evidence``, ``/audit/*``),
    validators and replicas of the same stage ``/state``, other replicas of the same stage the merge
    routes (``/merge/*``, ``/state/chunk``), any registered hotkey the rest. An unknown caller forces
    a re-read of the chain first (a new registration or commitment)."""

    def __init__(self, view: ChainView):
        self.view = view

    async def __call__(self, hotkey: str, route: str) -> None:
        """Raise :class:`ProtocolError` (UNREGISTERED_HOTKEY or FORBIDDEN) unless ``hotkey`` may call ``route``."""
        v = self.view
        if hotkey not in v.neurons:
            await v.refresh(force=True)
        n = v.neurons.get(hotkey)
        if n is None:
            raise ProtocolError(Outcome.UNREGISTERED_HOTKEY, f"hotkey {hotkey} is not registered on netuid {v.netuid}")
        if (route in ("/evidence", "/tickets") or route.startswith("/audit/")) \
                and not n.validator_permit:
            raise ProtocolError(Outcome.FORBIDDEN, f"{route} is for validators with a permit; uid {n.uid} has none")
        if route == "/state" and not (n.validator_permit or v.stages.get(hotkey) == v.stage):
            raise ProtocolError(Outcome.FORBIDDEN, "/state is for validators and replicas of the same stage")
        if route.startswith("/merge/") or route == "/state/chunk":
            if v.stages.get(hotkey) != v.stage:
                await v.refresh(force=True)
            if v.stages.get(hotkey) != v.stage or hotkey == v.hotkey:
                raise ProtocolError(Outcome.FORBIDDEN, f"{route} is for other replicas of stage {v.stage}")
