"""The three rounds of a hop audit run in one process through the real wire encoding.

:func:`run_local_audit` is what the miner service and the validator do over HTTP, minus the
transport: every message is encoded (:func:`iota_subnet.protocol.encode`) and decoded against its
contract (:mod:`.codec`), so its byte counts are the audit's body bytes on the wire. Tests and
``scripts/bench_audit.py`` use it; the lead's HTTP routes call the same pieces in the same order.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from iota_subnet.protocol import (AuditOpening, AuditOpenRequest, AuditProjection, AuditProjectRequest,
                                  AuditTraceCommit, AuditTraceRequest, ProtocolError, decode, encode)

from . import codec
from .auditor import AuditFailure, HopAuditor
from .check import Verdict
from .prover import HopProver, OpenRequestError

#: A signed HTTP request or response's headers (btauth signature, nonce, hotkeys, content type and
#: length; measured ~0.6-0.8 kB), allowed per message when counting bytes.
HTTP_HEADER_BYTES = 1024


@dataclass
class AuditRun:
    """``verdict``; ``bytes``: body bytes per message (``r1_req`` ... ``r3_resp``; a replay opened in
    parts: ``r3.1_req``, ``r3.1_resp`` ... for the parts after the first); ``seconds``: miner
    and validator CPU seconds per phase."""

    verdict: Verdict
    bytes: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    def total_bytes(self, header_bytes: int = HTTP_HEADER_BYTES) -> int:
        return sum(self.bytes.values()) + header_bytes * len(self.bytes)


def _roundtrip(msg, cls, contract, sizes: dict, key: str):
    body = encode(msg)
    sizes[key] = len(body)
    return decode(body, cls, contract)


def run_local_audit(prover: HopProver, auditor: HopAuditor, *, stage: int = 0, microbatch_id: str = "mb",
                    run_id: str = "run") -> AuditRun:
    """Run rounds 1-3 between ``prover`` and ``auditor``. Any refusal or malformed answer is a failed
    verdict (never an exception)."""
    lay = auditor.layout
    sizes: dict[str, int] = {}
    secs: dict[str, float] = {}
    req = AuditTraceRequest(run_id=run_id, stage=stage, microbatch_id=microbatch_id, audit_id=uuid.uuid4().hex,
                            direction=lay.direction, weights_root=auditor.weights_root.hex())
    try:
        req = _roundtrip(req, AuditTraceRequest, None, sizes, "r1_req")
        t = time.process_time()
        troots, wroots = prover.commit()
        secs["miner_trace"] = time.process_time() - t
        commit = _roundtrip(codec.commit_message(req, troots, wroots), AuditTraceCommit, codec.commit_contract(lay),
                            sizes, "r1_resp")
        t = time.process_time()
        seed = auditor.on_commit(*codec.read_commit(commit))
        secs["validator"] = time.process_time() - t
        if lay.replay:        # a replayed stage has no round 2
            rows = auditor.on_projection({}, [])
        else:
            preq = _roundtrip(codec.project_request(req, seed, auditor.blocks), AuditProjectRequest, None, sizes,
                              "r2_req")
            t = time.process_time()
            vec, roots = prover.project(codec.read_seed(preq), codec.read_blocks(preq, lay))
            secs["miner_project"] = time.process_time() - t
            proj = _roundtrip(codec.projection_message(preq, prover.round2, vec, roots), AuditProjection,
                              codec.projection_contract(auditor.round2), sizes, "r2_resp")
            t = time.process_time()
            rows = auditor.on_projection(*codec.read_projection(proj, auditor.round2))
            secs["validator"] += time.process_time() - t
        secs["miner_open"] = 0.0
        for k, part in enumerate(auditor.parts):        # a replay's rows in parts (each within the miner's cap)
            whole = auditor.whole_of(part)
            key = "r3" if k == 0 else f"r3.{k}"
            oreq = _roundtrip(codec.open_request(req, part, whole, more=k + 1 < len(auditor.parts)), AuditOpenRequest,
                              None, sizes, key + "_req")
            t = time.process_time()
            opened = prover.open(codec.read_open_request(oreq, lay), oreq.whole)
            secs["miner_open"] += time.process_time() - t
            contract = codec.opening_contract(lay, part, weights_dtype=auditor.weights_dtype, whole=whole)
            opening = _roundtrip(codec.opening_message(oreq, lay, opened), AuditOpening, contract, sizes,
                                 key + "_resp")
            t = time.process_time()
            auditor.accept(part, codec.read_opening(opening, lay, part, whole))
            secs["validator"] += time.process_time() - t
        t = time.process_time()
        verdict = auditor.check()
        secs["validator"] += time.process_time() - t
    except (ProtocolError, AuditFailure, OpenRequestError) as e:
        verdict = HopAuditor.failed(f"{type(e).__name__}: {e}")
    return AuditRun(verdict, sizes, secs)
