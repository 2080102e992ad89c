"""Merge weights: how much each replica counts in its stage's mean pseudo-gradient.

Validators decide them from their scores and publish them in their run commitment (the ``mw``
entry of :class:`iota_subnet.protocol.commitment.RunCommitment`, which also advertises the run).

Rule (:func:`compute_merge_weights`): a replica this validator caught cheating (a failed
audit, including a merge accusation the validator verified itself, see
:mod:`.merge_audit`) gets 0; every other replica keeps the default 1.0 (equal weights
among the replicas that reached the merge, which means they did the epoch's inner steps). Weights
proportional to verified work are not used: lanes' work differs by a few percent from tempo to
tempo, so the published weights would change every tempo, and a commitment landing between two
replicas' reads makes them build different plans (the attempt fails and is retried), which stalls
merges (seen in a 3 x 3 localnet). Only non-default weights are published, so the commitment changes only
when a replica is caught.

Miners read every validator's commitment
(:func:`iota_subnet.protocol.commitment.merge_weights_from_commitments`): the weight of a
participant is the median of the validators' weights for its uid; with no decision published it
is 1.0 (equal weights). All replicas read the same chain state, so they build the same plan; when
they do not (a commitment landed in between), the plan ids differ and the attempt is retried.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional

from iota_subnet.protocol.audit import MERGE_AUDIT_KEEP_EPOCHS
from iota_subnet.protocol.commitment import VALIDATOR, RunCommitment, merge_weights_from_commitments


def compute_merge_weights(uids: Iterable[int], *, cheaters: Iterable[int] = ()) -> dict[int, float]:
    """uid -> merge weight: 0.0 for ``cheaters``, else 1.0."""
    bad = {int(u) for u in cheaters}
    return {int(u): 0.0 if int(u) in bad else 1.0 for u in uids}


def encode_commitment(run_id: str, weights: Mapping[int, float], run_epoch: int = 0) -> str:
    """A validator commitment carrying only merge weights (see :class:`RunCommitment`)."""
    return RunCommitment(run_id, VALIDATOR, run_epoch, merge_weights=dict(weights)).encode()


def decode_commitment(raw: Optional[str], run_id: str, run_epoch: int = 0) -> Optional[dict[int, float]]:
    """uid -> weight, or None when ``raw`` is not a validator commitment of the run (never raises)."""
    c = RunCommitment.decode(raw)
    if c is None or c.role != VALIDATOR or not c.same_run(run_id, run_epoch):
        return None
    return dict(c.merge_weights)


def weights_from_commitments(commitments: Mapping[str, str], neurons: Mapping[str, Any], run_id: str, stage: int,
                             participants: Iterable[str], run_epoch: int = 0) -> dict[str, float]:
    """Participant hotkey -> weight: median over validators (``validator_permit``) that published one; 1.0 else.
    (:func:`iota_subnet.protocol.commitment.merge_weights_from_commitments`; ``stage`` is not used.)"""
    return merge_weights_from_commitments(commitments, neurons, run_id, participants, run_epoch)


def penalised_from_evidence(evidence: Iterable[Mapping[str, Any]], *, min_reporters: int = 1) -> set[str]:
    """Hotkeys named ``wrong`` in merge mismatch evidence by at least ``min_reporters`` distinct reporters
    other than themselves (the evidence a replica's ``status.json`` / merge reports carry: reducers' claimed hashes and the
    third party's recomputed hash)."""
    reporters: dict[str, set[str]] = {}
    for ev in evidence:
        claimed = ev.get("claimed_sha256") or {}
        rec = ev.get("recomputed_sha256")
        for hk in ev.get("wrong") or []:
            if hk == ev.get("reporter"):
                continue       # only other replicas' evidence counts
            if rec and claimed.get(hk) == rec and (ev.get("served_sha256") or {}).get(hk, rec) == rec:
                continue       # the evidence does not support the accusation
            reporters.setdefault(hk, set()).add(str(ev.get("reporter", "")))
    return {hk for hk, rs in reporters.items() if len(rs) >= min_reporters}


class MergeOversight:
    """A validator's side of merging: collects mismatch evidence from the replicas, has every
    accusation checked (:class:`~iota_subnet.validator.merge_audit.MergeAuditor`: the validator
    recomputes the disputed shard from the participants' signed slices; nothing is penalised on
    the accusers' word, however many they are), and publishes merge weights.

    * :meth:`collect` asks every replica for its evidence (``/evidence``, signed); a report counts
      only as coming from the replica that served it (its ``reporter`` must be that hotkey, its
      ``run_id`` this run, its ``stage`` the replica's stage).
    * :meth:`accusations`: (report, accused) pairs not decided yet, skipping those against a replica
      already proven wrong (moot: it is penalised); :meth:`verify` decides up to ``limit`` of them
      (unresolved ones are retried at later rounds, at most ``max_tries`` times).
    * Replicas keep what merge audits need for the last ``MERGE_AUDIT_KEEP_EPOCHS`` epochs: a LATE
      refusal about an epoch that far behind the stage is not a dodge. The stage's epoch is the lower
      median of the merged epochs its replicas state in ``/evidence`` (a replica that overstates its
      own cannot move it); such an accusation ends ``expired`` and nobody's audit record changes.
    * :meth:`commitment`: the merge-weights commitment to publish (:func:`compute_merge_weights`:
      0 for the replicas caught cheating; only those entries), or None when unchanged.
    """

    def __init__(self, run_id: str, *, max_reports: int = 2000, max_tries: int = 3):
        self.run_id = run_id
        self.max_reports = int(max_reports)
        self.max_tries = int(max_tries)
        self.reports: dict[tuple, dict] = {}
        self.published: Optional[str] = None
        self.verdicts: dict[tuple, Any] = {}      # (report key, accused) -> Verdict (decided)
        self.tries: dict[tuple, int] = {}
        self.proven_wrong: set[str] = set()       # accused hotkeys with an upheld accusation
        self.stated_epochs: dict[int, dict[str, int]] = {}   # stage -> hotkey -> merged epoch it states

    def add(self, reporter: str, stage: int, reports: Iterable[Mapping[str, Any]]) -> int:
        """Keep ``reports`` served by ``reporter`` (a replica of ``stage``). Returns how many are new."""
        new = 0
        for ev in reports:
            if not isinstance(ev, Mapping) or ev.get("reporter") != reporter or ev.get("run_id") != self.run_id:
                continue
            if ev.get("stage") != stage or not isinstance(ev.get("wrong"), list):
                continue
            key = (reporter, ev.get("epoch"), ev.get("attempt"), ev.get("plan_id"), ev.get("shard"))
            if key not in self.reports:
                self.reports[key] = dict(ev)
                new += 1
        while len(self.reports) > self.max_reports:
            self.reports.pop(next(iter(self.reports)))
        return new

    async def collect(self, client: Any, replicas: Iterable[Any], timeout_s: float = 10.0) -> int:
        """Fetch the evidence of every replica (``Replica``: uid, hotkey, endpoint, stage); unreachable
        replicas are skipped. Returns the number of new reports."""
        import asyncio

        from iota_subnet.protocol import MergeEvidence

        async def one(r):
            try:
                got = await client.call(r.endpoint, r.hotkey, "/evidence", MergeEvidence(run_id=self.run_id, stage=r.stage),
                                        MergeEvidence, timeout_s=timeout_s, retries=0)
                self.stated_epochs.setdefault(int(r.stage), {})[r.hotkey] = int(got.merged_epoch)
                return self.add(r.hotkey, r.stage, got.reports or [])
            except Exception:  # noqa: BLE001 - no evidence from an unreachable replica
                return 0
        return sum(await asyncio.gather(*(one(r) for r in replicas)))

    def accusations(self) -> list[tuple[tuple, dict, str]]:
        """(report key, report, accused) for every accusation not decided yet (self-accusations skipped)."""
        out = []
        for key, ev in self.reports.items():
            for hk in ev.get("wrong") or []:
                k = (key, hk)
                if hk == ev.get("reporter") or k in self.verdicts or self.tries.get(k, 0) >= self.max_tries:
                    continue
                if hk in self.proven_wrong:
                    continue                      # moot: already penalised on an upheld accusation
                out.append((key, ev, hk))
        return out

    def stage_epoch(self, stage: int) -> int:
        """The lower median of the merged epochs the replicas of ``stage`` stated (-1: none known)."""
        got = sorted(self.stated_epochs.get(int(stage), {}).values())
        return got[(len(got) - 1) // 2] if got else -1

    def expired(self, ev: Mapping[str, Any]) -> bool:
        """The report's epoch is outside the window replicas keep for audits."""
        try:
            return int(ev.get("epoch", -1)) + MERGE_AUDIT_KEEP_EPOCHS <= self.stage_epoch(int(ev.get("stage", -1)))
        except (TypeError, ValueError):
            return False

    async def verify(self, auditor: Any, fetch: Any, limit: int = 8) -> list:
        """Decide up to ``limit`` pending accusations with ``auditor`` (``MergeAuditor``) and ``fetch``
        (hotkey, MergeAuditRequest) -> MergeAuditResponse. Returns the new verdicts (unresolved
        ones included: their silent parties are reported too)."""
        out = []
        # newest first: replicas keep the evidence of their last few merge epochs only
        # (merge.claims.MergeClaims.keep_epochs), so a backlog is worked from the end that can still be checked
        pending = sorted(self.accusations(), key=lambda a: (int(a[1].get("epoch", -1)), float(a[1].get("time", 0.0))),
                         reverse=True)
        for key, ev, hk in pending[:max(0, int(limit))]:
            if hk in self.proven_wrong:
                continue
            v = await auditor.verify(ev, hk, fetch)
            k = (key, hk)
            self.tries[k] = self.tries.get(k, 0) + 1
            late = {w for w, (raw, detail) in v.silent.items() if raw == "refused" and detail.startswith("LATE")}
            if v.outcome == "unresolved" and late and self.expired(ev):
                for w in late:
                    v.silent.pop(w)
                v.outcome = "expired"
                v.detail = (f"epoch {ev.get('epoch')} is outside the {MERGE_AUDIT_KEEP_EPOCHS} epochs replicas keep "
                            f"(stage at epoch {self.stage_epoch(int(ev.get('stage', -1)))}); not counted")
            if v.outcome == "upheld":
                self.proven_wrong.add(hk)
            if v.outcome != "unresolved":
                self.verdicts[k] = v
            out.append(v)
        return out

    def decided(self, uids: Iterable[int], cheaters: Iterable[int]) -> dict[int, float]:
        """The merge weights to publish: only those that differ from the default 1.0, so that they fit
        a commitment (2,048 bytes: about 150 entries besides the run advert)."""
        w = compute_merge_weights(uids, cheaters=cheaters)
        return dict(sorted((u, v) for u, v in w.items() if v != 1.0)[:150])

    def commitment(self, uids: Iterable[int], cheaters: Iterable[int]) -> Optional[str]:
        """A merge-weights-only commitment text, or None when unchanged since the last call."""
        raw = encode_commitment(self.run_id, self.decided(uids, cheaters))
        if raw == self.published:
            return None
        self.published = raw
        return raw
