"""The validator's audit scheduler for the data plane: which hops and inner steps to audit, when,
and what the outcome means.

Inputs (nothing here waits for training, nor training for it)
    * every receipt this validator accepted (:meth:`AuditScheduler.on_receipt`): a training hop the
      miner claims, with the roots it is bound to (the wire tensors ``fin``/``fout``/``bin``/``bout``,
      the weights version ``wroot``, the tail's loss) and the miner's boot time (a new one announces
      a restart: :meth:`~.audit_policy.AuditPolicy.announce_restart`);
    * the update commitments of its receipt batches (:meth:`AuditScheduler.on_updates`);
    * training hop outcomes (:meth:`AuditScheduler.on_hop`: the "down" excuse of the policy).

Choice (blind)
    Audits are chosen only after the replies are in, with an OS-seeded RNG, at the moment the audit
    starts: for every miner not yet audited in the current tempo (``hops_per_tempo``), one of its
    receipts of the last ``fresh_s`` seconds that used one of the two latest weights versions it
    named, uniformly (those hops are still in its audit window of ``K >= 3`` versions);
    the direction follows the stage: the head's forward, every other stage's backward (which
    re-checks its forward too; a middle stage's backward whose weights changed after its forward
    leaves the forward output out). Update audits: ``updates_per_tempo`` per miner, of one of its two
    latest commitments (the miner keeps a few steps), whose weights roots must also be the ones its
    receipts named for the versions before and after the step.

Outcomes (:class:`~.audit_policy.AuditPolicy`)
    ``passed``, ``failed`` (the answer does not verify), ``refused`` (a typed refusal: ``LATE`` for
    a hop outside the window, ...), ``timeout`` (no answer in ``timeout_s``). Refusals and timeouts
    are failures unless the policy excuses them (down, restarted); to give a miner that restarted
    the chance to announce it (its first receipts after the restart carry its new boot time), an
    unanswered audit is settled only once a receipt from the miner arrived after it, or after
    ``settle_s`` seconds (then the "down" excuse may apply). A request of an audit that fails on the
    transport (a dropped connection, no answer in ``timeout_s``) is asked again after each of
    ``retry_delays_s`` (default 5 s, then 15 s), before it counts as unanswered: a link that drops for
    a few seconds must not make an honest miner's audit a failure (two unanswered audits flag a
    miner by default: :mod:`..audit_policy`), and a miner that drops every audit still fails after the last
    re-ask. A re-ask reveals nothing new: every request is sent again unchanged, the same audit id,
    seed and rows (the miner answers them again, :mod:`~iota_subnet.miner.hop_audit_routes`), so a
    dropped connection never buys a miner a second challenge; an audit gets no re-ask past
    ``max_audit_s`` from its start, and holds no audit slot while it waits. The miner's ``/health``
    is probed after every failed attempt (the "down" excuse: a miner paused or partitioned at the
    first attempt may be back by the last), and the policy judges an unanswered audit at the time its
    last request first went unanswered. A miner whose receipts show it
    took inner step k (its weights changed from version ``(k, m)`` to ``(k + 1, m)``) but whose
    commitment of step k never came within ``commit_grace_s`` gets an update audit counted
    ``refused``; one whose weights root stayed the same over :data:`STALE_STEPS` inner steps it
    claims, a ``failed`` one (the ``stale`` cheat: it claims steps it never took).

Costs (``scripts/bench_verification.py``, ``docs/hop-audit.md``): one hop audit is six signed
messages: ``tiny`` 0.25 MB (head forward) to 0.74 MB (middle backward); an update audit ~30 kB.
Validator CPU: 0.03-0.2 s a hop audit (checks on a worker thread).

The package's modules: :mod:`.scheduler` (:class:`AuditScheduler`: rounds, concurrency, re-asks and
health probes), :mod:`.inputs` (what the receipts and commitments say of each miner),
:mod:`.hops` (hop audits: the choice, the three rounds), :mod:`.updates` (update audits and the
commitments the receipts show missing), :mod:`.records` (outcomes, settling, the counters kept
across restarts).
"""
from .inputs import MAX_CANDIDATES, HopCandidate
from .records import REQUIRED_VERSIONS, AuditRecord
from .scheduler import AuditScheduler, AuditSchedulerOptions
from .updates import STALE_STEPS

__all__ = ["AuditRecord", "AuditScheduler", "AuditSchedulerOptions", "HopCandidate", "MAX_CANDIDATES",
           "REQUIRED_VERSIONS", "STALE_STEPS"]
