"""Validator logic: routing over stage replicas, the control plane, scoring, persistence and the process.

* :mod:`.routing`: discover replicas from metagraph + commitments, lanes, SWARM-style rerouting, cooldowns.
* :mod:`.control`: signs tickets for the lanes' micro-batches and books the miners' receipts.
* :mod:`.lanes`: lane step results, data addressing, which lane steps this validator drives.
* :mod:`.scoring`: per-(uid, hotkey) accounting of verified work and the weights it earns.
* :mod:`.state`: SQLite (WAL) persistence of accounting and progress (resume after a restart).
* :mod:`.service`: the validator process (chain, metagraph sync, weights, status.json, metrics.jsonl).
"""
from .lanes import LaneStepResult, MicrobatchResult, sample_start, steps_of
from .routing import Replica, Router, discover, parse_commitment
from .scoring import Ledger, MinerRecord, compute_weights, stage_compute_shares
from .state import StateError, ValidatorState

__all__ = ["LaneStepResult", "Ledger", "MicrobatchResult", "MinerRecord", "Replica", "Router",
           "StateError", "ValidatorState", "compute_weights", "discover", "parse_commitment", "sample_start",
           "stage_compute_shares", "steps_of"]
