"""Validators check merge accusations themselves before anyone is penalised.

A replica that saw two reducers of a shard disagree reports evidence naming the reducer(s) it
found wrong (:attr:`iota_subnet.merge.engine.MergeEngine.reports`), with the reducers' signed
result claims (:mod:`iota_subnet.merge.claims`). :meth:`MergeAuditor.verify` decides each
accusation (reporter R names reducer A for shard s of a plan):

1. A's result claim must be in the report, signed by A, for exactly the reported coordinates, and
   quoted faithfully (``claimed_sha256[A]`` = its ``mean_sha256``). Otherwise the accusation rests
   on nothing A said: **false** (R penalised).
2. A's claim lists no contributors, only roots over them (the result messages stay O(1) in the
   number of replicas): the validator fetches the records from A (``/audit/merge``, what
   ``mean``: contributors, weights, the hashes of the inputs, the contributors' signed claims); they
   must hash to the roots A signed. The plan A names must be the plan those participants and
   weights give (:class:`~iota_subnet.merge.plan.MergePlan`: plan id, shard bounds, A a reducer of
   s), and every contribution A says it used must carry its contributor's signed claim with the same
   hash. Otherwise A published a result it cannot back: **upheld** (A penalised).
3. The validator fetches chunks of A's served mean and of every contributor's slice
   (``/audit/merge``, Merkle proofs against the signed roots), first ``sample_chunks`` random
   ones, and recomputes the weighted mean on them (fp32, the participants' order, the plan's
   weights; tolerance :data:`MEAN_RTOL` of the chunk's largest value, plus, per value, the bound on
   the rounding to the run's gather encoding, ``merge.gather_quantization``: the recomputed mean is
   rounded as an honest reducer rounds it, :func:`~iota_subnet.merge.outer.rounded`, exactly when
   the audit chunks begin on the int8 blocks of the shard (``CHUNK_NUMEL`` a multiple of
   ``merge.int8_block``, or of ``merge.topk_chunk`` for the ``sparse`` gather), else within :func:`~iota_subnet.merge.outer.rounding_bound` of the chunk). A sampled chunk that differs: **upheld**. If all sampled
   chunks agree, before penalising the reporter it checks the whole shard (all chunks, fetched in
   bounded parts, and the full hashes against the signed ``sha256``): all agree: **false**; any
   differ: **upheld**.
4. A contributor that signed two different claims for the same slice (one to A, another to the
   validator) **equivocated**: it is penalised and the accusation stays **unresolved**. A party that
   does not answer leaves it **unresolved** (its refusal or timeout goes to the audit policy, where
   honest faults are excused); the verifier retries unresolved accusations later.

Verdicts feed :class:`~iota_subnet.validator.audit_policy.AuditPolicy` as ``merge`` audits
(:func:`record_verdicts`): upheld -> A failed, false -> R failed, equivocation -> that contributor
failed, no answer -> refused / timeout of the silent party.
"""
from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Mapping, Optional

import torch

from iota_subnet.audit.merkle import leaf_hash, verify_proof
from iota_subnet.merge.claims import (CHUNK_NUMEL, CONTRIBUTION, MAX_AUDIT_CHUNKS, RESULT, n_chunks, records_match,
                                      verify_claim)
from iota_subnet.merge import sparse
from iota_subnet.merge.outer import rounded, rounding_bound, weighted_mean
from iota_subnet.merge.plan import MergePlan, epoch_seed
from iota_subnet.protocol import (MergeAuditRequest, MergeAuditResponse, ProtocolError, proof_from_tensor,
                                  tensor_sha256)

#: Relative tolerance of a recomputed mean chunk (fp32 accumulation order differences only).
MEAN_RTOL = 1e-5

Fetch = Callable[[str, MergeAuditRequest], Awaitable[MergeAuditResponse]]


class _Silent(Exception):
    def __init__(self, who: str, raw: str, detail: str):
        super().__init__(detail)
        self.who, self.raw, self.detail = who, raw, detail


@dataclass
class Verdict:
    """One accusation decided. ``outcome``: ``upheld`` (``accused`` served a wrong result), ``false``
    (``reporter``'s accusation does not hold), ``unresolved``. ``penalise``: hotkey -> reason;
    ``silent``: hotkey -> (raw outcome, detail) of parties that did not answer; ``bytes`` fetched."""

    reporter: str
    accused: str
    outcome: str
    detail: str
    penalise: dict[str, str] = field(default_factory=dict)
    silent: dict[str, tuple[str, str]] = field(default_factory=dict)
    bytes: int = 0
    chunks_checked: int = 0


class MergeAuditor:
    """Checks merge accusations for one run. ``stage_numel(stage)``: parameters of a stage (plans
    are rebuilt from it); ``sample_chunks``: random chunks checked first; ``rng``: OS-seeded."""

    def __init__(self, run_id: str, stage_numel: Callable[[int], int], *, sample_chunks: int = 4,
                 rng: Optional[random.Random] = None, chunks_per_request: int = 64, gather_quant: str = "none",
                 int8_block: int = 256):
        self.run_id = run_id
        self.gather_quant, self.int8_block = gather_quant, int(int8_block)
        #: audit chunks (CHUNK_NUMEL values from a shard's start) begin on int8 blocks of the shard
        block = sparse.parse(gather_quant)[2] if sparse.is_sparse(gather_quant) else self.int8_block
        self.aligned = CHUNK_NUMEL % block == 0
        self.stage_numel = stage_numel
        self.sample_chunks = max(1, int(sample_chunks))
        self.rng = rng or random.SystemRandom()   # the OS CSPRNG: draws a miner cannot predict
        self.chunks_per_request = max(1, min(int(chunks_per_request), MAX_AUDIT_CHUNKS))

    async def verify(self, report: Mapping[str, Any], accused: str, fetch: Fetch) -> Verdict:
        reporter = str(report.get("reporter", ""))
        v = Verdict(reporter, accused, "unresolved", "")
        try:
            return await self._verify(report, accused, fetch, v)
        except _Silent as e:
            v.silent[e.who] = (e.raw, e.detail)
            v.outcome, v.detail = "unresolved", f"{e.who[:10]} did not answer: {e.detail}"
            return v

    # ------------------------------------------------------------------------------------------
    async def _verify(self, report: Mapping[str, Any], accused: str, fetch: Fetch, v: Verdict) -> Verdict:
        reporter = v.reporter
        coords = {"run": self.run_id, "stage": report.get("stage"), "epoch": report.get("epoch"),
                  "attempt": report.get("attempt"), "plan_id": report.get("plan_id"), "shard": report.get("shard")}
        results = report.get("results") if isinstance(report.get("results"), Mapping) else {}
        info = results.get(accused) if isinstance(results.get(accused), Mapping) else {}
        claim = info.get("claim")

        def false(why: str) -> Verdict:
            v.outcome, v.detail = "false", why
            v.penalise[reporter] = f"filed an accusation against {accused[:10]} that does not hold ({why})"
            return v

        def upheld(why: str) -> Verdict:
            v.outcome, v.detail = "upheld", why
            v.penalise[accused] = (f"served a wrong merge result (epoch {coords['epoch']}, shard "
                                   f"{coords['shard']}): {why}")
            return v

        # 1. the accused's own signed words
        if not verify_claim(claim, accused, RESULT):
            return false("the report carries no result claim signed by the accused")
        if any(claim.get(k) != val for k, val in coords.items()):
            return false("the accused's claim is for other coordinates than the report")
        if (report.get("claimed_sha256") or {}).get(accused) != claim.get("mean_sha256"):
            return false("the report misquotes the hash the accused signed")
        # 2. the records the accused signed the roots of, the plan and the contributions it says it used
        stage, epoch, attempt, shard = int(claim["stage"]), int(claim["epoch"]), int(claim["attempt"]), int(claim["shard"])
        records = await self._records(accused, claim, fetch)
        if not records_match(claim, records):
            return upheld("the contributions it serves do not hash to the roots it signed")
        parts, weights = list(records["contributors"]), list(records["weights"])
        try:
            plan = MergePlan.make(epoch, attempt, epoch_seed(self.run_id, stage, epoch), parts,
                                  int(self.stage_numel(stage)), dict(zip(parts, weights)),
                                  chunk_numel=claim.get("chunk_numel"),
                                  base=None if records.get("base") is None else (int(records["base"][0]),
                                                                                 list(records["base"][1])))
        except (ValueError, TypeError, IndexError) as e:
            return upheld(f"its claim names no valid plan ({e})")
        if (plan.plan_id != claim["plan_id"] or list(plan.participants) != parts or not 0 <= shard < plan.num_shards
                or tuple(plan.bounds[shard]) != (claim.get("offset"), claim.get("numel"))
                or accused not in plan.reducers[shard] or len(weights) != len(parts)):
            return upheld("its claim's contributors, weights or bounds are not the plan's")
        contribs = records["contrib_claims"]
        hashes = list(records["contribution_sha256"])
        if len(hashes) != len(parts):
            return upheld("its claim lists a hash per contributor")
        for p, h in zip(parts, hashes):
            cc = contribs.get(p)
            if not verify_claim(cc, p, CONTRIBUTION) or cc.get("sha256") != h or any(
                    cc.get(k) != claim.get(k) for k in ("run", "stage", "epoch", "attempt", "plan_id", "shard",
                                                        "offset", "numel")):
                return upheld(f"it used a contribution of {p[:10]} that {p[:10]} did not sign")
        # 3. chunks: sampled first, then everything before anyone's accusation is called false
        n = n_chunks(int(claim["numel"]))
        sample = sorted(self.rng.sample(range(n), min(n, self.sample_chunks)))
        bad, _ = await self._check_chunks(claim, contribs, parts, weights, sample, fetch, v)
        if isinstance(bad, Verdict):
            return bad
        if bad:
            return upheld(f"chunk {bad[0]} of its mean differs from the mean of the signed contributions")
        bad, full = await self._check_chunks(claim, contribs, parts, weights, list(range(n)), fetch, v)
        if isinstance(bad, Verdict):
            return bad
        if bad:
            return upheld(f"chunk {bad[0]} of its mean differs from the mean of the signed contributions")
        # whole-tensor hashes: the signed sha256 must describe the chunks served (and proved)
        for who, sha in [("mean", claim["mean_sha256"])] + [(p, contribs[p]["sha256"]) for p in parts]:
            if tensor_sha256(torch.cat([full[who][i] for i in range(n)])) != sha:
                if who == "mean":
                    return upheld("its signed hash does not describe the mean it serves")
                v.penalise[who] = "signed a contribution claim whose hash does not describe its slice"
                v.outcome, v.detail = "unresolved", f"{who[:10]}'s claim is inconsistent"
                return v
        return false(f"all {n} chunk(s) of the accused's mean equal the mean of the signed contributions")

    async def _records(self, accused: str, claim: Mapping, fetch: Fetch) -> Any:
        """The records behind ``claim`` (see :mod:`iota_subnet.merge.claims`), as the accused serves
        them with its kept mean. Raises _Silent when it does not answer, or answers for another claim."""
        req = MergeAuditRequest(run_id=self.run_id, stage=int(claim["stage"]), epoch=int(claim["epoch"]),
                                attempt=int(claim["attempt"]), plan_id=str(claim["plan_id"]),
                                shard_index=int(claim["shard"]), what="mean", chunks=[])
        try:
            resp = await fetch(accused, req)
        except ProtocolError as e:
            raise _Silent(accused, "refused", f"{e.outcome.value}: {e.message}"[:160]) from None
        except Exception as e:  # noqa: BLE001 - unreachable / timed out
            raise _Silent(accused, "timeout", f"{type(e).__name__}: {e}"[:160]) from None
        got = resp.claim or {}
        if got.get("claim") != dict(claim):
            raise _Silent(accused, "failed", "answered for a result claim other than the signed one")
        return got

    async def _check_chunks(self, claim, contribs, parts, weights, idx, fetch, v) -> tuple[Any, dict]:
        """Fetch chunks ``idx`` of the accused's mean and of every contribution (in parts of
        ``chunks_per_request``), recompute and compare. Returns (indices that differ, or a Verdict
        for an equivocation; the chunks per party). Raises _Silent for a party that does not answer."""
        MEAN = "mean"                    # the accused's mean (it is a contributor too: its slice is under its hotkey)
        got: dict[str, dict[int, torch.Tensor]] = {MEAN: {}, **{p: {} for p in parts}}
        for i0 in range(0, len(idx), self.chunks_per_request):
            part = idx[i0:i0 + self.chunks_per_request]
            jobs = [self._fetch(claim["by"], "mean", claim, claim["mean_root"], part, fetch, v)]
            jobs += [self._fetch(p, "contribution", contribs[p], contribs[p]["root"], part, fetch, v) for p in parts]
            res = await asyncio.gather(*jobs, return_exceptions=True)
            for r in res:
                if isinstance(r, _Equivocation):
                    v.penalise[r.who] = f"signed two different contribution claims for one slice ({r.detail})"
                    v.outcome, v.detail = "unresolved", f"contributor {r.who[:10]} equivocated"
                    return v, got
            for r in res:
                if isinstance(r, BaseException):
                    raise r
            for who, chunks in zip([MEAN] + parts, res):
                got[who].update(chunks)
        bad = []
        for i in idx:
            ref = weighted_mean([(w, got[p][i]) for p, w in zip(parts, weights)])
            mine = got[MEAN][i]
            v.chunks_checked += 1
            if self.differs(ref, mine):
                bad.append(i)
        return bad, got

    def differs(self, ref: torch.Tensor, mine: torch.Tensor) -> bool:
        """Whether a served chunk of the mean ``mine`` differs from the recomputed ``ref`` (float32 [n],
        before the gather's rounding) by more than :data:`MEAN_RTOL` of its largest value."""
        if mine.shape != ref.shape:
            return True
        tol = MEAN_RTOL * float(ref.abs().max()) if ref.numel() else 0.0
        if self.aligned:       # audit chunks start on int8 blocks of the shard: round exactly as the reducer
            ref = rounded(ref, self.gather_quant, self.int8_block)[0]
        else:                  # blocks straddle audit chunks: bound by the chunk's absmax (looser)
            tol = tol + rounding_bound(ref, self.gather_quant, max(1, ref.numel())) * 1.001
        return bool(((mine - ref).abs() > tol).any())

    async def _fetch(self, who: str, what: str, signed: Mapping, root_hex: str, idx: list[int], fetch: Fetch,
                     v: Verdict) -> dict[int, torch.Tensor]:
        req = MergeAuditRequest(run_id=self.run_id, stage=int(signed["stage"]), epoch=int(signed["epoch"]),
                                attempt=int(signed["attempt"]), plan_id=str(signed["plan_id"]),
                                shard_index=int(signed["shard"]), what=what, chunks=[int(i) for i in idx])
        try:
            resp = await fetch(who, req)
        except ProtocolError as e:
            raise _Silent(who, "refused", f"{e.outcome.value}: {e.message}"[:160]) from None
        except Exception as e:  # noqa: BLE001 - unreachable / timed out
            raise _Silent(who, "timeout", f"{type(e).__name__}: {e}"[:160]) from None
        served = (resp.claim or {}).get("claim")
        if served != dict(signed):
            if verify_claim(served, who, CONTRIBUTION if what == "contribution" else RESULT) and what == "contribution":
                raise _Equivocation(who, "the claim it serves differs from the one the reducer holds")
            raise _Silent(who, "failed", f"answered for a claim other than the signed one ({what})")
        n = n_chunks(int(signed["numel"]))
        root = bytes.fromhex(root_hex)
        out = {}
        for i in idx:
            x = resp.chunks.get(str(i))
            try:
                proof = proof_from_tensor(resp.proofs.get(str(i)))
            except ProtocolError:
                raise _Silent(who, "failed", f"chunk {i}: malformed proof") from None
            if x is None or x.dtype != torch.float32 or not verify_proof(root, leaf_hash(x), i, n, proof):
                raise _Silent(who, "failed", f"chunk {i} of its {what} does not match its signed root")
            out[i] = x
            v.bytes += x.numel() * 4 + len(proof) * 32
        return out


class _Equivocation(Exception):
    def __init__(self, who: str, detail: str):
        super().__init__(detail)
        self.who, self.detail = who, detail


def record_verdicts(policy: Any, verdicts: list[Verdict], who: Mapping[str, tuple[int, int]]) -> None:
    """Feed verdicts into an :class:`~iota_subnet.validator.audit_policy.AuditPolicy`; ``who``:
    hotkey -> (uid, stage) of the replicas."""
    for v in verdicts:
        for hk, reason in v.penalise.items():
            if hk in who:
                policy.record(who[hk][0], hk, who[hk][1], "merge", "failed", detail=reason)
        for hk, (raw, detail) in v.silent.items():
            if hk in who:
                policy.record(who[hk][0], hk, who[hk][1], "merge", raw if raw in ("refused", "timeout", "failed")
                              else "refused", detail=detail)
        if v.outcome == "upheld" and v.reporter in who and v.reporter not in v.penalise:
            policy.record(who[v.reporter][0], v.reporter, who[v.reporter][1], "merge", "passed",
                          detail=f"its accusation against {v.accused[:10]} held")
