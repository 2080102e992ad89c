"""Commit-reveal weights waiting for their reveal, and how a validator confirms them.

With commit-reveal on (``CommitRevealWeightsEnabled``), ``set_weights`` only commits the weights,
timelocked to a drand round (:class:`iota_subnet.chain.interface.WeightsReceipt`); the chain reveals
them later and may refuse them then (an older weights version key: ``IncorrectWeightVersionKey``; a
uid gone), without an error reaching the committer. A commit therefore counts as set only once the
chain no longer holds it as pending (:meth:`Chain.pending_commits`) and its weights row shows what was
committed; a commit gone from the pending ones whose weights the row does not show was refused (or
dropped) and is never recorded as set. A commit of the weights last recorded as set cannot be told
from its refusal by the row (the row shows them either way): it is recorded neither as set nor as
refused (the version check before every set still catches a raised weights version).

Sources: subtensor's ``reveal_crv3_commits_for_subnet`` (takes each epoch's commits, reveals them
through ``do_set_mechanism_weights``, drops those that fail), the devnet's
:meth:`DevnetState.reveal_due_commits`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional

from bittensor.timelock import current_round

from iota_subnet.chain.interface import WeightsReceipt

#: largest difference per uid between committed and revealed weights (each normalised to sum 1)
#: that still counts as the same weights: the chain keeps u16 weights scaled to their maximum
MATCH_TOL = 2e-3


@dataclass
class Commit:
    """Weights committed at ``receipt.block`` for reveal at drand round ``receipt.reveal_round``."""

    receipt: WeightsReceipt
    weights: dict[int, float]   # uid -> weight as committed
    ambiguous: bool = False     # the same weights as those last recorded as set


def same_weights(a: Mapping[int, float], b: Mapping[int, float], tol: float = MATCH_TOL) -> bool:
    """Whether two weight vectors agree once each is normalised to sum 1 (a uid missing counts as 0)."""
    za, zb = sum(a.values()), sum(b.values())
    if za <= 0 or zb <= 0:
        return False
    return all(abs(a.get(u, 0.0) / za - b.get(u, 0.0) / zb) <= tol for u in set(a) | set(b))


@dataclass
class PendingReveals:
    """This validator's commits not yet seen revealed, oldest first."""

    commits: list[Commit] = field(default_factory=list)

    def add(self, receipt: WeightsReceipt, weights: Mapping[int, float], last_set: Mapping[int, float]) -> None:
        """A commit of ``weights``; ``last_set``: the weights last recorded as set."""
        w = {int(u): float(v) for u, v in weights.items()}
        self.commits.append(Commit(receipt, w, ambiguous=same_weights(w, last_set)))

    def last_block(self) -> Optional[int]:
        return self.commits[-1].receipt.block if self.commits else None

    def due(self, now: Optional[float] = None) -> bool:
        """Whether the oldest commit's drand round has been published (before that the chain cannot
        have revealed it, and reading the chain is not worth it)."""
        rnd = self.commits[0].receipt.reveal_round if self.commits else None
        return rnd is not None and current_round(now) >= rnd

    def resolve(self, pending: set[int], row: Optional[Iterable[tuple[int, float]]]
                ) -> tuple[Optional[Commit], list[Commit]]:
        """``pending``: blocks of this validator's commits the chain still holds (read *before*
        ``row``, its weights row now: ``(uid, weight)`` pairs, or None). Every commit no longer pending
        leaves the queue. Returns ``(revealed, refused)``: the newest of them that the row shows,
        unless it is ambiguous (then None), and those newer than it (all of them when the row shows
        none) that the row does not show. Older ones were overwritten on chain and count as neither."""
        shown = dict(row or [])
        done = [c for c in self.commits if c.receipt.block not in pending]
        self.commits = [c for c in self.commits if c.receipt.block in pending]
        last = max((i for i, c in enumerate(done) if same_weights(c.weights, shown)), default=-1)
        revealed = done[last] if last >= 0 and not done[last].ambiguous else None
        return revealed, done[last + 1:]
