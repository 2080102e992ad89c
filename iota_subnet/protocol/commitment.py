"""What a neuron publishes on chain (its commitment): the run it takes part in, and in what role.

One small, versioned JSON object for both roles (a few dozen to a few hundred bytes; the chain
keeps at most 2048, and every write costs commitment space, so it changes only when its content
does)::

    miner      {"v":2,"r":"tiny","e":0,"k":"m","s":1,"t":"<tokenizer fp>","d":"<data fp>","h":"<spec hash>",
                "rl":["ip:port"]}
    validator  {"v":2,"r":"tiny","e":0,"k":"v","t":"...","d":"...","h":"<spec hash>","hb":3,"mw":{"5":0.0},"rh":1}

``r`` run id and ``e`` run epoch (a run is identified by both: a new epoch is a new run that
reuses the id); ``k`` role (``m`` miner, ``v`` validator); ``s`` the miner's stage; ``t`` / ``d``
the tokenizer and data fingerprints (16 hex chars each; absent when the neuron does not load the
data); ``hb`` a validator's heartbeat counter (bumped to show it is alive when it has set no weights
for a while); ``mw`` the validator's merge weights (uid -> weight, only entries that differ from
the default 1.0; see :mod:`iota_subnet.validator.merge_weights`); ``rl`` the relays a miner that
cannot be dialled is reached through (``ip:port`` each, at most :data:`MAX_RELAYS`; its axon is the
first, the others are tried when it fails: :mod:`iota_subnet.transport.relay`); ``rh`` a neuron that
hosts a relay for the run's neurons; ``h`` the run's spec hash (64 hex: the sha256 of its canonical
config, :mod:`iota_subnet.config_hash`; a validator serves that spec, :mod:`.run_spec`; absent: not
advertised). Four relays of 21 bytes (``255.255.255.255:65535``) add 96 bytes to a miner's commitment.
Measured (``tests/test_run_spec_hash.py``), with a 16-character run id, epoch 3, both fingerprints and
the spec hash: a miner at stage 2 with four such relays is 270 bytes; a validator with heartbeat 999999,
relay host and merge weights for 8 three-digit uids is 267 bytes (the spec hash is 71 of each; each
further merge weight about 12): at most 14 % of the 2048.

:meth:`RunCommitment.decode` never raises: anything that is not a commitment of this format (other
subnets' code, garbage, too large) decodes to None. Version-1 texts (``{"v":1,"run","stage"}``
from miners, ``{"v":1,"kind":"merge_weights",...}`` from validators) still decode, as epoch 0.
"""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional

from iota_subnet.errors import UserError

from .run_spec import is_spec_hash

COMMITMENT_VERSION = 2
MAX_COMMITMENT_BYTES = 2048
#: relays a miner may publish (``rl``), and the longest ``host:port`` accepted for one
MAX_RELAYS, MAX_RELAY_CHARS = 4, 64
MINER, VALIDATOR = "miner", "validator"
_ROLE_CODE = {MINER: "m", VALIDATOR: "v"}
_ROLE_NAME = {v: k for k, v in _ROLE_CODE.items()}


class RunMismatchError(UserError, ValueError):
    """This neuron's data, tokenizer or spec hash differs from its run's: it must not join (the message
    names both sides and the fix; the command line prints it as one line, exit code 2)."""


@dataclass(frozen=True)
class Fingerprints:
    """What decides the tokens a run trains on: the tokenizer's and the packed data's fingerprints
    (see :func:`iota_subnet.data.fingerprints`)."""

    tokenizer: str
    data: str

    def differs(self, other: Optional["Fingerprints"]) -> list[str]:
        """The names of the fingerprints that differ from ``other`` (none when ``other`` is None)."""
        if other is None:
            return []
        return [n for n in ("tokenizer", "data") if getattr(self, n) != getattr(other, n)]


@dataclass(frozen=True)
class RunCommitment:
    run: str
    role: str                                # MINER or VALIDATOR
    epoch: int = 0
    stage: Optional[int] = None              # miners
    fingerprints: Optional[Fingerprints] = None
    heartbeat: int = 0                       # validators
    merge_weights: Mapping[int, float] = field(default_factory=dict)   # validators
    relays: tuple[str, ...] = ()             # miners reached through relays: their ``ip:port``
    relay_host: bool = False                 # hosts a relay for the run's neurons
    spec_hash: str = ""                      # the run's spec hash (64 hex; "" = not advertised)

    def same_run(self, run: str, epoch: int) -> bool:
        return self.run == run and self.epoch == int(epoch)

    def encode(self) -> str:
        """Compact JSON; raises ``ValueError`` when it would not fit on chain."""
        d: dict[str, Any] = {"v": COMMITMENT_VERSION, "r": self.run, "e": int(self.epoch), "k": _ROLE_CODE[self.role]}
        if self.stage is not None:
            d["s"] = int(self.stage)
        if self.fingerprints is not None:
            d["t"], d["d"] = self.fingerprints.tokenizer, self.fingerprints.data
        if self.heartbeat:
            d["hb"] = int(self.heartbeat)
        if self.merge_weights:
            d["mw"] = {str(int(u)): round(float(w), 3) for u, w in sorted(self.merge_weights.items())}
        if self.relays:
            if _relays(list(self.relays)) is None:
                raise ValueError(f"relays must be at most {MAX_RELAYS} 'host:port' strings: {list(self.relays)}")
            d["rl"] = list(self.relays)
        if self.relay_host:
            d["rh"] = 1
        if self.spec_hash:
            if not is_spec_hash(self.spec_hash):
                raise ValueError(f"spec_hash must be 64 lowercase hex digits: {self.spec_hash!r}")
            d["h"] = self.spec_hash
        raw = json.dumps(d, separators=(",", ":"))
        if len(raw.encode()) > MAX_COMMITMENT_BYTES:
            raise ValueError(f"commitment is {len(raw.encode())} bytes; at most {MAX_COMMITMENT_BYTES} fit on chain")
        return raw

    @staticmethod
    def decode(raw: Optional[str]) -> Optional["RunCommitment"]:
        """The commitment, or None when ``raw`` is absent or not one of ours (never raises)."""
        if not raw or not isinstance(raw, str) or len(raw) > MAX_COMMITMENT_BYTES:
            return None
        try:
            d = json.loads(raw)
            if not isinstance(d, dict):
                return None
            if d.get("v") == 1:
                return _decode_v1(d)
            if d.get("v") != COMMITMENT_VERSION:
                return None
            run, epoch, role = d.get("r"), d.get("e", 0), _ROLE_NAME.get(d.get("k"))
            if not isinstance(run, str) or not run or role is None or not _nonneg_int(epoch):
                return None
            stage = d.get("s")
            if role == MINER and not _nonneg_int(stage):
                return None
            fps = None
            if "t" in d or "d" in d:
                t, dd = d.get("t"), d.get("d")
                if not (_fingerprint(t) and _fingerprint(dd)):
                    return None
                fps = Fingerprints(t, dd)
            hb = d.get("hb", 0)
            if not _nonneg_int(hb):
                return None
            mw = _weights(d.get("mw", {}))
            relays = _relays(d.get("rl", []))
            h = d.get("h", "")
            if mw is None or relays is None or d.get("rh", 0) not in (0, 1) or not (h == "" or is_spec_hash(h)):
                return None
            return RunCommitment(run, role, int(epoch), int(stage) if role == MINER else None, fps, int(hb), mw,
                                 relays, bool(d.get("rh", 0)), h)
        except (ValueError, TypeError, AttributeError, RecursionError):
            return None


def _nonneg_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**63


def _fingerprint(v: Any) -> bool:
    return isinstance(v, str) and 0 < len(v) <= 64 and all(c in "0123456789abcdef" for c in v)


def _weights(w: Any) -> Optional[dict[int, float]]:
    if not isinstance(w, dict):
        return None
    out = {}
    for k, v in w.items():
        f = float(v)
        if isinstance(v, bool) or not (math.isfinite(f) and 0 <= f < 1e6):
            return None
        out[int(k)] = f
    return out


def _relays(v: Any) -> Optional[tuple[str, ...]]:
    """``rl``: at most MAX_RELAYS ``host:port`` strings with a port in 1..65535; None when not."""
    if not isinstance(v, list) or len(v) > MAX_RELAYS:
        return None
    for e in v:
        if not isinstance(e, str) or not 0 < len(e) <= MAX_RELAY_CHARS or ":" not in e:
            return None
        host, _, port = e.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            return None
    return tuple(v)


def _decode_v1(d: dict) -> Optional[RunCommitment]:
    run = d.get("run")
    if not isinstance(run, str):
        return None
    if d.get("kind") == "merge_weights":
        mw = _weights(d.get("w", {}))
        return None if mw is None else RunCommitment(run, VALIDATOR, 0, merge_weights=mw)
    stage = d.get("stage")
    if not _nonneg_int(stage):
        return None
    return RunCommitment(run, MINER, 0, stage=int(stage))


@dataclass(frozen=True)
class StageCommitment:
    """A miner's commitment as run id and stage (epoch 0, no fingerprints): kept for callers that
    need only these two; :class:`RunCommitment` is the full format."""

    run: str
    stage: int

    def encode(self) -> str:
        return RunCommitment(self.run, MINER, stage=int(self.stage)).encode()

    @staticmethod
    def decode(raw: Optional[str]) -> Optional["StageCommitment"]:
        """A miner's commitment, or None when it is absent, a validator's, or not ours (never raises)."""
        c = RunCommitment.decode(raw)
        if c is None or c.role != MINER or c.stage is None:
            return None
        return StageCommitment(c.run, c.stage)


def merge_weights_from_commitments(commitments: Mapping[str, str], neurons: Mapping[str, Any], run_id: str,
                                   participants: Iterable[str], run_epoch: int = 0) -> dict[str, float]:
    """Participant hotkey -> merge weight: the median over the validators (``validator_permit``) of
    run (``run_id``, ``run_epoch``) that published one for its uid; 1.0 when none did.
    ``neurons``: hotkey -> metagraph neuron (``uid``, ``validator_permit``)."""
    decisions = []
    for hk, raw in commitments.items():
        n = neurons.get(hk)
        if n is None or not getattr(n, "validator_permit", False):
            continue
        c = RunCommitment.decode(raw)
        if c is not None and c.role == VALIDATOR and c.same_run(run_id, run_epoch):
            decisions.append(c.merge_weights)
    out = {}
    for p in participants:
        uid = getattr(neurons.get(p), "uid", None)
        vals = [d[int(uid)] for d in decisions if uid is not None and int(uid) in d]
        out[p] = float(statistics.median(vals)) if vals else 1.0
    return out
