"""A miner's side of the data plane: micro-batches arrive from (and go to) other miners, not the validator.

Flow of one training micro-batch through S stages (see :mod:`iota_subnet.protocol.ticket`)::

    validator --tickets--> head: reads token rows [B, T] by the ticket's sample address, forward
    head --Hop(forward, bf16 [B, T, b])--> stage 1 --> ... --> tail: reads targets, loss, backward
    tail --Hop(backward, dL/dz)--> stage S-2 --> ... --> head: backward, done
    every stage --receipts (hashes of what it received and sent, loss, timing)--> validator

Schedule (per stage, one compute thread)
    Backward work first, then forwards in (step, index) order: 1F1B priority, so activations held
    for pending backwards are freed as early as possible. The head admits the forwards of its lane
    step ``k`` (at most ``max_in_flight`` waiting for their backward) only once it has taken inner
    step ``k - 1``: a flush per lane step, so every stage updates exactly as the co-located trainer
    does (GPipe / 1F1B with flush; Narayanan et al. 2021, "Efficient large-scale language model
    training on GPU clusters", section 2.2). Many micro-batches are in flight; nothing waits for the
    validator: tickets for the next steps are already at the head.

Exactly-once accumulation
    Each stage accumulates the gradient of every ``(lane, step, index)`` at most once: a repeated
    hop (same micro-batch id and direction) is acknowledged ``duplicate`` and ignored, a re-issued
    micro-batch (higher ``attempt``) replaces a pending older attempt or, when the older one was
    already accumulated, runs without accumulating. A stage takes its inner step when every index
    of the lane step has been accumulated (:class:`StepTracker`).

Who trains on what
    Only the route's own miner of a stage (``ticket.route[stage]``) trains on a micro-batch. An
    alternate that takes a hop for a failed miner computes the forward and the input gradient only
    (no weight gradients, no inner step): a replica never runs ahead of its own lane. A lane member
    that receives step ``k`` while it is still at an earlier step (it was away) skips to ``k``.

Failures
    A forward that no candidate of the next stage accepts aborts the micro-batch: an ``abort`` hop
    travels back along the path (every stage drops its cached forward and releases its claim) and a
    ``failed`` receipt names the unreachable miners; the validator re-issues the micro-batch. A
    backward that cannot reach the previous stage is reported the same way.

Everything here runs on the miner's event loop except the ``compute`` calls (the stage's compute
thread) and the transfers (``send``, concurrent with compute).

The package's modules: :mod:`.plane` (:class:`DataPlane`: inbound hops and tickets, the schedule,
lifecycle), :mod:`.admission` (the head: which ticket starts next, stand-in heads, settling a lane
that completed elsewhere), :mod:`.compute` (forward, backward and the inner step on the compute
thread), :mod:`.outbound` (hops to the next and previous stages, failures and aborts),
:mod:`.receipts` (receipt batches to the validators), :mod:`.tracking` (what a stage keeps of its
micro-batches: pending forwards, the exactly-once step tracker), :mod:`.options` (its optional parts
and tunables).
"""
from .admission import STAND_IN_HOLD_S
from .options import DataPlaneParts, DataPlaneTunables
from .outbound import OFFLOAD_BYTES, commit_wire
from .plane import SEEN_HOPS, DataPlane
from .tracking import Pending, RowSource, StepTracker

__all__ = ["DataPlane", "DataPlaneParts", "DataPlaneTunables", "OFFLOAD_BYTES", "Pending", "RowSource", "SEEN_HOPS",
           "STAND_IN_HOLD_S", "StepTracker", "commit_wire"]
