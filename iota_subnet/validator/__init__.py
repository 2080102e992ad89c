"""Validator logic: routing over stage replicas, the pipeline driver, scoring, persistence and the process.

* :mod:`.routing`: discover replicas from metagraph + commitments, lanes, SWARM-style rerouting, cooldowns.
* :mod:`.driver`: pushes micro-batches forward and backward through the miners (GPipe per lane).
* :mod:`.scoring`: per-(uid, hotkey) accounting of verified work and the weights it earns.
* :mod:`.state`: SQLite (WAL) persistence of accounting and progress (resume after a restart).
* :mod:`.service`: the validator process (chain, metagraph sync, weights, status.json, metrics.jsonl).
"""
from .driver import LaneStepResult, MicrobatchResult, PipelineDriver, sample_start, steps_of
from .routing import Replica, Router, discover, parse_commitment
from .scoring import Ledger, MinerRecord, compute_weights, stage_compute_shares
from .state import StateError, ValidatorState

__all__ = ["LaneStepResult", "Ledger", "MicrobatchResult", "MinerRecord", "PipelineDriver", "Replica", "Router",
           "StateError", "ValidatorState", "compute_weights", "discover", "parse_commitment", "sample_start",
           "stage_compute_shares", "steps_of"]
