"""Which validators this one coordinates with.

Lane step ``k`` of every lane belongs to validator ``k mod V`` over the *coordinating* validators,
ordered by hotkey (see :mod:`.lanes`). On a live subnet most validator-permit holders run other
code, or nothing at all; counting them would leave their steps undriven and make this validator
wait for turns that never come. A permit holder coordinates only when

* its commitment advertises this run (id and epoch) in the validator role
  (:class:`~iota_subnet.protocol.commitment.RunCommitment`), with the same tokenizer and data
  fingerprints when both sides publish them, and the same spec hash (``h``, the sha256 of the run's
  canonical config, :mod:`iota_subnet.config_hash`) when both publish one (a validator of the same run
  id and epoch advertising another hash runs another config under that name: it is listed in
  ``other_spec``, logged and shown in ``status.json``, and does not coordinate), and
* it is alive: it published its commitment or set weights within ``alive_blocks`` blocks (a
  validator of ours sets weights every tempo, and re-publishes its commitment with a bumped
  heartbeat when it has not for half that window: :func:`heartbeat_due`).

This validator always counts itself. Everything here reads one metagraph (which carries each
neuron's commitment and the block it was published at), so it is pure and tested alone.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from iota_subnet.protocol.commitment import VALIDATOR, Fingerprints, RunCommitment


def alive_blocks_for(tempo: int, weights_rate_limit: int = 0) -> int:
    """Default liveness window: two weight-setting periods (``max(tempo, rate limit)``) plus 10 blocks."""
    return 2 * max(int(tempo), int(weights_rate_limit), 1) + 10


@dataclass(frozen=True)
class PeerView:
    """One reading of the metagraph from this validator's point of view.

    ``coordinating``: hotkeys (sorted, this validator included) that split the lane steps;
    ``foreign``: permit holders without a validator commitment of ours (other code, or none);
    ``other_runs``: run label -> validators advertising another run or epoch; ``dead``: hotkeys of
    ours that were silent longer than the window; ``mismatched``: hotkey -> fingerprints of
    validators of this run whose fingerprints differ from this one's; ``unannounced``: those of the
    ``foreign`` with no commitment at all (one starting up has not published its own yet);
    ``other_spec``: hotkey -> spec hash of validators of this run id and epoch advertising another
    spec hash than this one's."""

    coordinating: list[str]
    foreign: int = 0
    other_runs: dict[str, int] = field(default_factory=dict)
    dead: list[str] = field(default_factory=list)
    mismatched: dict[str, Fingerprints] = field(default_factory=dict)
    unannounced: int = 0
    other_spec: dict[str, str] = field(default_factory=dict)

    def summary(self) -> dict:
        return {"coordinating": len(self.coordinating), "foreign": self.foreign, "other_runs": dict(self.other_runs),
                "dead": len(self.dead), "mismatched": len(self.mismatched), "other_spec": dict(self.other_spec)}


def _advert(n: Any) -> tuple[Optional[RunCommitment], int]:
    """(decoded commitment, block it was published at) of a metagraph neuron."""
    c = getattr(n, "commitment", None)
    if c is None:
        return None, -1
    return RunCommitment.decode(getattr(c, "value", None)), int(getattr(c, "block", -1) or -1)


def coordinating_validators(neurons: Iterable[Any], *, run: str, epoch: int, block: int, alive_blocks: int,
                            self_hotkey: str, fingerprints: Optional[Fingerprints] = None,
                            spec_hash: str = "") -> PeerView:
    """The validators that coordinate with ``self_hotkey`` (see the module docstring); ``spec_hash``:
    this validator's (``""``: none, no validator is set aside for its hash).

    ``neurons``: metagraph neurons (``hotkey``, ``validator_permit``, ``last_update``,
    ``commitment`` with ``value`` and ``block``)."""
    coordinating, dead, foreign, unannounced = {str(self_hotkey)}, [], 0, 0
    other: dict[str, int] = {}
    mismatched: dict[str, Fingerprints] = {}
    other_spec: dict[str, str] = {}
    for n in neurons:
        hk = str(n.hotkey)
        if hk == self_hotkey or not bool(n.validator_permit):
            continue
        c, published = _advert(n)
        if c is None or c.role != VALIDATOR:
            foreign += 1
            unannounced += getattr(getattr(n, "commitment", None), "value", None) is None
            continue
        if not c.same_run(run, epoch):
            label = f"{c.run}#{c.epoch}"
            other[label] = other.get(label, 0) + 1
            continue
        if fingerprints is not None and fingerprints.differs(c.fingerprints):
            mismatched[hk] = c.fingerprints
            continue
        if spec_hash and c.spec_hash and c.spec_hash != spec_hash:
            other_spec[hk] = c.spec_hash
            continue
        if block - max(published, int(n.last_update or 0)) > alive_blocks:
            dead.append(hk)
            continue
        coordinating.add(hk)
    return PeerView(sorted(coordinating), foreign, other, sorted(dead), mismatched, unannounced, other_spec)


def run_fingerprints(neurons: Iterable[Any], *, run: str, epoch: int, block: int, alive_blocks: int,
                     exclude: str) -> Optional[tuple[Fingerprints, list[int]]]:
    """The fingerprints the alive validators of the run advertise (the ones backed by the most stake
    when they disagree) and the uids advertising them; None when no other validator advertises any."""
    backing: dict[Fingerprints, tuple[float, list[int]]] = {}
    for n in neurons:
        if str(n.hotkey) == exclude or not bool(n.validator_permit):
            continue
        c, published = _advert(n)
        if c is None or c.role != VALIDATOR or not c.same_run(run, epoch) or c.fingerprints is None:
            continue
        if block - max(published, int(n.last_update or 0)) > alive_blocks:
            continue
        stake = float(getattr(getattr(n, "total_stake", None), "rao", 0) or 0)
        s, uids = backing.get(c.fingerprints, (0.0, []))
        backing[c.fingerprints] = (s + stake, uids + [int(n.uid)])
    if not backing:
        return None
    fps, (_, uids) = max(backing.items(), key=lambda kv: (kv[1][0], len(kv[1][1])))
    return fps, sorted(uids)


def heartbeat_due(neurons: Iterable[Any], self_hotkey: str, block: int, alive_blocks: int) -> bool:
    """Whether this validator should re-publish its commitment to stay counted as alive: neither its
    commitment nor its weights are more recent than half the liveness window."""
    for n in neurons:
        if str(n.hotkey) == self_hotkey:
            _, published = _advert(n)
            return block - max(published, int(n.last_update or 0)) > alive_blocks // 2
    return False
