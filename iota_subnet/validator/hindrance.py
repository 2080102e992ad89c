"""Miners held back by another miner's fault, for scoring (:class:`~.scoring.Scoreboard`).

A micro-batch attempt that fails or is slowed because one miner does not answer (a receipt names it
unreachable, the validator's own call to it fails) or because its output is proven bad
(:mod:`.blame`) also holds back the other miners of its route: their hops time out or wait, their
lane stalls, and their verified work in the meantime is less than the validator would have given
them. Such a miner is *blocked* from the attempt's issue (or from its own latest verified work, if
later: tickets are issued steps ahead) until the fault is known; the scoreboard
neither counts those tempos against its freshness nor into the span its rate is taken over.

Claims are checked before they excuse anyone: a miner named unreachable in a receipt (the sender's
word) blocks the others only once this validator's own ``/health`` probe of it failed too (a miner
cannot excuse itself by naming a healthy neighbour); a fault the validator saw itself (its call to a
head failed) or a proven refusal counts at once. A member that was charged a failure itself since
the block began is not excused. Claims not confirmed within ``horizon_s`` are dropped.

The maps survive a validator restart (:meth:`Hindrances.to_dict` / :meth:`Hindrances.load_dict`, saved
with the scores each weights round): blocks confirmed or claimed before a restart still excuse their
members in the next scoring update. Times are wall-clock seconds, so they stay meaningful across
processes.
"""
from __future__ import annotations

import json
import time
from typing import Any, Callable, Iterable, Mapping, Optional

from loguru import logger

Key = tuple[int, str]


class Hindrances:
    """Blocks by hotkey: culprit -> pending claims, member -> since when it is blocked (clock seconds)."""

    def __init__(self, clock: Callable[[], float] = time.time, horizon_s: float = 600.0):
        self.clock, self.horizon_s = clock, float(horizon_s)
        self._pending: dict[str, list[tuple[str, float, float]]] = {}   # culprit -> [(member, since, noted)]
        self._down: dict[str, float] = {}          # culprit -> when this validator found it down itself
        self._charged: dict[str, float] = {}       # hotkey -> when it was last charged a failure
        self._blocked: dict[str, float] = {}       # member -> since when (confirmed, not yet taken)
        self._worked: dict[str, float] = {}        # hotkey -> when its latest verified work arrived

    def note(self, route: Iterable[str], culprits: Iterable[str], since: float, proven: bool = False) -> None:
        """An attempt over ``route`` (hotkeys) issued at ``since`` was failed or slowed by ``culprits``.
        ``proven``: the validator saw the fault itself (or it is proven); else it is a miner's claim."""
        culprits = set(culprits)
        members = [hk for hk in dict.fromkeys(route) if hk and hk not in culprits]
        now = self.clock()
        starts = [(m, max(float(since), self._worked.get(m, float("-inf")))) for m in members]
        for c in culprits:
            if proven or c in self._down:
                for m, t in starts:
                    self._block(m, t)
            else:
                self._pending.setdefault(c, []).extend((m, t, now) for m, t in starts)

    def worked(self, hotkey: str, at: float) -> None:
        """Verified work of ``hotkey`` arrived at ``at`` (clock seconds): it was not blocked before."""
        self._worked[hotkey] = max(float(at), self._worked.get(hotkey, float("-inf")))

    def charged(self, hotkey: str) -> None:
        """``hotkey`` was charged a failure: it is not excused for the time around it."""
        self._charged[hotkey] = self.clock()

    def down(self, culprit: str) -> None:
        """This validator's own probe of ``culprit`` failed: the claims against it hold."""
        self._down[culprit] = self.clock()
        for m, since, _ in self._pending.pop(culprit, []):
            self._block(m, since)

    def up(self, culprit: str) -> None:
        """``culprit`` answered this validator's probe: pending claims against it do not excuse anyone."""
        self._down.pop(culprit, None)
        self._pending.pop(culprit, None)

    def _block(self, member: str, since: float) -> None:
        self._blocked[member] = min(since, self._blocked.get(member, since))

    def take(self, key_of: Mapping[str, Key] | Callable[[str], Optional[Key]]) -> dict[Key, float]:
        """Confirmed blocks since the last take: miner key -> since when (clock seconds). Members
        charged a failure since their block began are left out; ``key_of``: hotkey -> (uid, hotkey)."""
        look = key_of.get if isinstance(key_of, Mapping) else key_of
        out: dict[Key, float] = {}
        for hk, since in self._blocked.items():
            key = look(hk)
            if key is not None and self._charged.get(hk, float("-inf")) < since:
                out[key] = min(since, out.get(key, since))
        self._blocked = {}
        old = self.clock() - self.horizon_s
        self._charged = {h: t for h, t in self._charged.items() if t >= old}
        self._worked = {h: t for h, t in self._worked.items() if t >= old}
        self._down = {h: t for h, t in self._down.items() if t >= old}     # a later probe finds it again
        self._pending = {c: kept for c, ps in self._pending.items() if (kept := [p for p in ps if p[2] >= old])}
        return out

    def to_dict(self) -> dict[str, Any]:
        """The maps as JSON-able data (hotkeys and clock seconds), for the validator's state."""
        return {"pending": {c: [list(p) for p in ps] for c, ps in self._pending.items()},
                "down": dict(self._down), "charged": dict(self._charged), "blocked": dict(self._blocked),
                "worked": dict(self._worked)}

    def to_json(self) -> str:
        """:meth:`to_dict` as JSON text."""
        return json.dumps(self.to_dict())

    def load_json(self, raw: str) -> bool:
        """:meth:`load_dict` from JSON text; text that is not JSON is logged and ignored."""
        try:
            d = json.loads(raw)
        except ValueError as e:
            logger.warning("saved hindrances ignored (not JSON: {})", e)
            return False
        return self.load_dict(d) if isinstance(d, Mapping) else False

    def load_dict(self, d: Mapping[str, Any]) -> bool:
        """Merge maps saved by :meth:`to_dict` (an earlier process) into this one. A malformed value
        (a corrupt state) is logged and ignored as a whole; returns whether it was loaded."""
        try:
            pending = {str(c): [(str(m), float(since), float(noted)) for m, since, noted in ps]
                       for c, ps in dict(d.get("pending", {})).items()}
            maps = [{str(k): float(v) for k, v in dict(d.get(name, {})).items()}
                    for name in ("down", "charged", "blocked", "worked")]
        except (TypeError, ValueError, AttributeError) as e:
            logger.warning("saved hindrances ignored (malformed: {})", e)
            return False
        for c, ps in pending.items():
            self._pending.setdefault(c, []).extend(ps)
        for mine, saved, keep in zip((self._down, self._charged, self._blocked, self._worked), maps,
                                     (max, max, min, max)):
            for k, v in saved.items():
                mine[k] = keep(v, mine.get(k, v))
        return True
