"""Validator side of update audits: pick rows of a committed inner step, fetch
them with proofs, recompute AdamW, decide.

A miner's :class:`~iota_subnet.protocol.UpdateCommit` reaches the validator with its receipts
(the data plane's job). Only then, with an OS-seeded RNG, :meth:`UpdateAuditor.plan` picks ``rows``
(param, row) pairs with probability proportional to their size; :meth:`UpdateAuditor.audit` asks the
miner (``/audit/update``, signed HTTP) and :meth:`UpdateAuditor.check` verifies the answer with
:func:`iota_subnet.audit.update.check_update_opening`: roots, proofs, clip factor, learning rate
(the schedule's, from the run config), and the AdamW recomputation within
:data:`~iota_subnet.audit.update.UPDATE_TOL_UNITS`. The hyperparameters come from the run config,
never from the miner.

Outcomes (:class:`AuditResult.outcome`, see :mod:`.audit_policy`): ``passed``; ``failed`` (an
answer that does not verify, or a commitment that differs from the one received); ``refused`` (a
typed refusal, e.g. ``LATE`` for a step the miner no longer keeps; :data:`SUPERSEDED` for an answer
that opens a *later* commitment of the same step, which the scheduler turns back into ``failed``
unless the miner announced a restart in between); ``timeout`` (no answer).

Cost per audit with ``rows`` rows of ``n`` values: ``7 x rows x n x 4`` bytes of rows, ``7 x rows x
depth x 32`` bytes of proofs, ``7 x n_params x 32`` bytes of per-parameter roots, plus ~100 bytes
of header per tensor; on a ``tiny`` stage (30 parameters, rows of 256-768 values), mean of 5
audits: 22-29 kB with 1 row (the default), 37-43 kB with 2 (``scripts/bench_update_audit.py --rows``). Validator CPU: 3 row-sized AdamW steps and
``7 x rows`` proof checks: well under a millisecond.
"""
from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Any, Optional

from iota_subnet.audit.update import (UPDATE_TOL_UNITS, AdamHParams, ParamInfo, UpdateCheck, check_update_opening,
                                      param_layout, sample_rows)
from iota_subnet.config import RunConfig
from iota_subnet.protocol import (UPDATE_KINDS, ProtocolError, UpdateAuditRequest, UpdateAuditResponse, UpdateCommit,
                                  encode, update_audit_contract)
from iota_subnet.train.optim import update_lr
from iota_subnet.transport import TransportError

#: A signed HTTP request or response's headers, allowed per message when counting an audit's bytes.
HTTP_HEADER_BYTES = 1024

#: The code of an update audit answered for a later commitment of the audited step (same inner step
#: and merge count, other roots, a later ``at``): the miner did the step again. A killed miner
#: whose new process resumed from before that step does exactly this (an audit asked of the old
#: process may be answered, at a re-ask, by the new one). It is an
#: answer that does not verify, so it counts as ``failed`` unless the miner announced a restart
#: between the two commitments (then it is work from before the restart, excused within the policy's
#: bound: :mod:`.audit_policy`).
SUPERSEDED = "SUPERSEDED"


def redone(commit: UpdateCommit, served: UpdateCommit) -> bool:
    """``served`` is a later commitment of the step ``commit`` committed, with other contents."""
    return (served.step, served.merges) == (commit.step, commit.merges) and served.at > commit.at and served != commit


@dataclass
class AuditResult:
    """One audit's raw outcome (before the policy's excuses): ``outcome`` in ``passed``, ``failed``,
    ``refused``, ``timeout``; ``detail``; ``bytes``: the request and the answer, bodies (as encoded)
    plus :data:`HTTP_HEADER_BYTES` each (the client's own counters are the exact total); ``check``: the
    verification details when an answer came back."""

    outcome: str
    detail: str = ""
    bytes: int = 0
    check: Optional[UpdateCheck] = None
    wall_s: float = 0.0
    cpu_s: float = 0.0          # validator CPU of the check (its thread's time)


class UpdateAuditor:
    """Plans and checks update audits for one run. ``total_steps``: the inner-step schedule length
    miners use (for the expected learning rate; None: the rate is not checked); ``rows``: rows opened
    per audit (default 1 rather than 2: a wrong update of every row, what skipping or
    faking the optimizer step gives, fails every audit either way; one confined to a fraction f of
    the rows fails with probability ~f per audit instead of ~2f, the same trade as one token per hop
    audit, ``docs/hop-audit.md``, "Detection"; 13-19 kB less per audit on ``tiny``); ``rng``:
    OS-seeded by default (miners cannot predict the rows)."""

    def __init__(self, cfg: RunConfig, *, run_id: str, total_steps: Optional[int] = None, rows: int = 1,
                 rng: Optional[random.Random] = None, tol_units: float = UPDATE_TOL_UNITS):
        self.cfg, self.run_id = cfg, run_id
        self.total_steps = total_steps
        self.rows = max(1, int(rows))
        self.rng = rng or random.SystemRandom()   # the OS CSPRNG: draws a miner cannot predict
        self.tol_units = float(tol_units)
        self.hp = AdamHParams.from_train(cfg.train)
        self._layouts: dict[int, list[ParamInfo]] = {}

    def layout(self, stage: int) -> list[ParamInfo]:
        lay = self._layouts.get(stage)
        if lay is None:
            import torch

            from iota_subnet.model import make_stage
            with torch.device("meta"):         # shapes only: no memory, any model size
                m = make_stage(self.cfg.model, self.cfg.pipeline, stage, init=False)
            lay = self._layouts[stage] = param_layout(m, self.cfg.train.weight_decay)
        return lay

    def expected_lr(self, step: int, adam_step: int) -> Optional[float]:
        """The learning rate an honest update at inner ``step`` with AdamW step count ``adam_step``
        used: the schedule's, re-warmed for a state younger than the run (:func:`update_lr`)."""
        return None if self.total_steps is None else update_lr(step, adam_step, self.total_steps, self.cfg.train)

    def plan(self, stage: int, commit: UpdateCommit) -> UpdateAuditRequest:
        rows = sample_rows(self.layout(stage), self.rows, self.rng)
        return UpdateAuditRequest(run_id=self.run_id, stage=stage, inner_step=commit.step, merges=commit.merges,
                                  rows=[[n, r] for n, r in rows], kinds=list(UPDATE_KINDS))

    def check(self, stage: int, commit: UpdateCommit, req: UpdateAuditRequest, resp: UpdateAuditResponse
              ) -> UpdateCheck:
        """Verify ``resp`` against the commitment received earlier (``commit``)."""
        try:
            served = UpdateCommit.from_dict(resp.commit)
        except ProtocolError as e:
            return UpdateCheck(False, f"answer's commitment: {e}")
        if served != commit:
            return UpdateCheck(False, f"answered for another commitment of step {commit.step} than the one committed "
                                      f"(roots differ: {[k for k in UPDATE_KINDS if served.roots.get(k) != commit.roots[k]]})")
        return check_update_opening(commit, [(str(n), int(r)) for n, r in req.rows], resp, self.layout(stage), self.hp,
                                    expected_lr=self.expected_lr(commit.step, commit.adam_step), tol_units=self.tol_units)

    async def audit(self, client: Any, endpoint: str, hotkey: str, stage: int, commit: UpdateCommit, *,
                    timeout_s: float = 10.0, req: Optional[UpdateAuditRequest] = None) -> AuditResult:
        """Plan (unless ``req``, a plan of :meth:`plan`, is given: a request asked again after a
        transport failure must not draw new rows), ask, check. ``client``: a
        :class:`~iota_subnet.transport.NeuronClient`."""
        req = self.plan(stage, commit) if req is None else req
        t0 = time.monotonic()
        n = len(encode(req)) + HTTP_HEADER_BYTES        # the answer's body and headers are added below
        try:
            resp = await client.call(endpoint, hotkey, "/audit/update", req, UpdateAuditResponse,
                                     timeout_s=timeout_s, retries=1, response_contract=update_audit_contract())
        except ProtocolError as e:
            return AuditResult("refused", f"{e.outcome.value}: {e.message}"[:200], n, wall_s=time.monotonic() - t0)
        except (TransportError, asyncio.TimeoutError) as e:
            return AuditResult("timeout", str(e)[:200], n, wall_s=time.monotonic() - t0)
        n += len(encode(resp)) + HTTP_HEADER_BYTES
        def timed():
            c0 = time.thread_time()
            return self.check(stage, commit, req, resp), time.thread_time() - c0
        chk, cpu = await asyncio.to_thread(timed)
        if not chk.ok:
            try:
                served = UpdateCommit.from_dict(resp.commit)
            except ProtocolError:
                served = None
            if served is not None and redone(commit, served):
                return AuditResult("refused", f"{SUPERSEDED}: it answered for a commitment of step {commit.step} made "
                                              f"{served.at - commit.at:.1f} s after the one committed (it did the step "
                                              f"again)", n, chk, time.monotonic() - t0, cpu)
        return AuditResult("passed" if chk.ok else "failed", chk.reason or f"max {chk.worst:.3g} units on {chk.rows} rows",
                           n, chk, time.monotonic() - t0, cpu)


def audit_bytes(req: UpdateAuditRequest, resp: UpdateAuditResponse) -> int:
    """Encoded body bytes of one audit (request + answer; HTTP headers excluded)."""
    return len(encode(req)) + len(encode(resp))
