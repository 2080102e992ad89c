"""Commit-then-audit: Merkle commitments to tensors and the checks validators run on opened parts.

Shared by miners (they commit and open) and validators (they verify); no networking here.

Hop audit (``docs/hop-audit.md``): at hop time a miner is bound only by the roots in its receipts
(the wire tensors it received and sent: :func:`wire_root`; the weights version: :func:`weights_root`).
When a validator picks the hop (after the fact, blind), three rounds follow:

1. the miner recomputes the stage's trace (:class:`Tracer`) and commits to every intermediate
   (:meth:`HopProver.commit`);
2. the validator sends a random seed; the miner returns random projections of every product
   (Freivalds) (:meth:`HopProver.project`);
3. the validator samples token rows, positions, columns and weight rows; the miner opens them with
   Merkle proofs and the validator checks every link of the stage on them (:class:`HopAuditor`,
   :mod:`.check`).

Layout of the trace: :mod:`.layout`; wire messages: :mod:`.codec`; the whole exchange in one process:
:func:`run_local_audit`.
"""
from .auditor import AuditFailure, HopAuditor
from .challenge import Sample, SamplingParams, draw_sample, openings
from .check import LinkChecker, Tolerances, Verdict
from .commit import WeightsCommitment, host_snapshot, weights_commitment, weights_root, wire_root
from .layout import BACKWARD, FORWARD, LayoutError, TraceLayout
from .local import AuditRun, run_local_audit
from .merkle import (MerkleError, MerkleTree, as_rows, check_rows, combine_roots, leaf_hash, named_roots, row_leaves,
                     tensor_root, verify_proof)
from .prover import HopInputs, HopProver, Opened, OpenRequestError
from .trace import Tracer, TraceResult

__all__ = ["AuditFailure", "AuditRun", "BACKWARD", "FORWARD", "HopAuditor", "HopInputs", "HopProver", "LayoutError",
           "LinkChecker", "MerkleError", "MerkleTree", "OpenRequestError", "Opened", "Sample", "SamplingParams",
           "Tolerances", "TraceLayout", "TraceResult", "Tracer", "Verdict", "WeightsCommitment", "as_rows",
           "check_rows", "combine_roots", "draw_sample", "host_snapshot", "leaf_hash", "named_roots", "openings", "row_leaves",
           "run_local_audit", "tensor_root", "verify_proof", "weights_commitment", "weights_root", "wire_root"]
