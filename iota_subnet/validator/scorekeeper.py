"""The validator's scores: CLASP probe rounds, the :class:`~.scoring.Scoreboard` and the explained
scores, updated once per weights round from the ledger of verified work and the audits' outcomes.

A part of the validator that tests build alone: ``ScoreKeeper(ScoringOptions())`` then
:meth:`ScoreKeeper.update` with a :class:`~.scoring.Ledger`, the uid -> hotkey map and an
:class:`~.audit_policy.AuditPolicy`.
"""
from __future__ import annotations

import json
import random
from typing import Any, Iterable, Optional

from . import explain
from .audit_policy import AuditPolicy, merge_quality
from .clasp import attribute, quality_factors
from .options import ScoringOptions
from .scoring import Ledger, Scoreboard, with_burn
from .state import ValidatorState


class ScoreKeeper:
    """Scores of one validator (see :mod:`.scoring`): the scoreboard, the CLASP probes of the last
    ``clasp_window`` rounds, their attribution and the explained scores (``scores`` in the state,
    ``status.json`` and ``GET /scores``)."""

    def __init__(self, opts: ScoringOptions):
        self.opts = opts
        self.board = Scoreboard(window=opts.score_window, grace=opts.stale_grace)
        self.probes: list[dict] = []
        self.clasp_rounds = 0
        self._clasp_rng = random.SystemRandom()    # which lanes CLASP probes: unpredictable to miners
        self.attribution: dict = {}
        self.explained: dict = {}
        self.last_probe: dict = {}  # the latest CLASP round: {round, loss (mean, nats/token), paths}

    def update(self, ledger: Ledger, current: dict[int, str], audits: AuditPolicy, *, block: Optional[int] = None,
               exclude_uids: Iterable[int] = (), lanes: Optional[dict] = None) -> dict[int, float]:
        """One tempo's scoring: CLASP attribution, quality factors, Scoreboard update, weights (uid ->
        weight, summing to 1, or empty; the stale share on the burn uid), explained scores.
        ``lanes``: what the lanes did since the last update, as :meth:`.scoring.Scoreboard.update`
        takes it (``unrouted, lanes_stalled, blocked, at, paused``)."""
        self.attribution = attribute(self.probes[-self.opts.clasp_window:], exclude=audits.flagged())
        qf = quality_factors(self.attribution, self.opts.clasp_penalty)
        quality = {key: qf.get(key, (1.0, [])) for key in ledger.records}
        quality = merge_quality(quality, audits.quality())
        self.board.update(ledger, quality, **(lanes or {}))
        weights = self.board.weights(ledger.shares, current, exclude_uids=list(exclude_uids))
        self.explained = explain.build(ledger, self.attribution, self.board, current, block, audits=audits)
        return with_burn(weights, self.burn_uid(current))

    def burn_uid(self, current: dict[int, str]) -> Optional[int]:
        """The burn uid for stale weight, or None: not set or not in the metagraph (``current``). Who
        holds it does not matter: when this validator holds it, the stale share goes on its own uid, so
        its weights row shows the decay as any other validator's does (leaving it out let the chain
        renormalise the stale weights back to full strength). Yuma drops self-weights from the epoch,
        so that share then earns this validator nothing."""
        b = self.opts.burn_uid
        if b is None or int(b) not in current:
            return None
        return int(b)

    async def clasp_round(self, driver: Any, router: Any) -> None:
        """One CLASP probe round through ``driver`` (the control plane), when lanes are driven."""
        if driver is None or router is None or router.n_lanes == 0:
            return
        got = await driver.clasp_round(self.clasp_rounds, self.opts.clasp_paths, self._clasp_rng)
        if got:
            self.last_probe = {"round": self.clasp_rounds, "loss": sum(g["loss"] for g in got) / len(got),
                               "paths": len(got)}
        self.clasp_rounds += 1
        self.probes.extend(got)
        del self.probes[:-self.opts.clasp_window]

    def load(self, state: ValidatorState) -> None:
        """The scoreboard, probes and explained scores of this validator's earlier processes."""
        raw = state.get_meta("scoreboard")
        if raw:
            self.board = Scoreboard.from_dict(json.loads(raw))
        raw = state.get_meta("clasp_probes")
        if raw:
            self.probes = json.loads(raw)
            self.clasp_rounds = 1 + max((p.get("round", 0) for p in self.probes), default=-1)
        raw = state.get_meta("scores")
        if raw:
            self.explained = json.loads(raw)

    def save(self, state: ValidatorState) -> None:
        state.set_meta("scoreboard", json.dumps(self.board.to_dict()))
        state.set_meta("clasp_probes", json.dumps(self.probes[-self.opts.clasp_window:]))
        state.set_meta("scores", json.dumps(self.explained))
