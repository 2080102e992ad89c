"""Wire messages ("synapses"): one dataclass each.

Every message carries the common header fields (``spec_version``, ``run_id``, ``stage``,
``microbatch_id``, ``inner_step``, free-form ``info``). Fields declared with :func:`tensor_field`
travel as safetensors tensors; every other field travels as JSON in the safetensors
``__metadata__`` header (see :mod:`iota_subnet.protocol.codec`).

Shapes (``b`` is the boundary width after the bottleneck):

============== ================================================================================
MergePayload   ``shard``: float [n] (or int8 [n] with ``scales`` float32 [ceil(n / block)]), slice
               ``[offset, offset + n)`` of a stage's flat pseudo-gradient (see :mod:`iota_subnet.merge`)
MergeJoin      no tensors: a replica's merge readiness (request and reply)
MergeResultRequest / MergeResult
               ``mean``: float32 [n], the weighted mean pseudo-gradient of one shard (optional: hashes only)
StateChunkRequest / StateChunk
               ``data``: float32 [n], slice of the flat state-sync snapshot (weights, anchor, momentum)
StateRequest   no tensors; optional ``names`` to fetch a subset
StateResponse  ``tensors``: {parameter name: tensor}; ``state_meta`` (JSON)
Health         no tensors
MergeEvidence  no tensors: ``reports``, a replica's merge mismatch evidence (JSON), for validators
TicketBatch    no tensors: signed tickets (:class:`~iota_subnet.protocol.ticket.Ticket` JSON) for a head miner
Hop            ``data``: the activation (forward) or activation gradient (backward) [batch, seq, b] in the
               ticket's wire dtype (bf16 / fp32 / int8 or fp8 with ``scales`` float32 [batch, seq]); the ticket
               and the path taken so far travel as JSON
ReceiptBatch   no tensors: what a miner did with the hops of one validator's tickets (JSON receipts)
AuditTraceRequest / AuditTraceCommit
               hop audit round 1 (:mod:`iota_subnet.audit`): ``roots`` uint8 [n_trace, 32] (Merkle roots
               of the traced tensors, layout order), ``weight_roots`` uint8 [n_entries, 32]
AuditProjectRequest / AuditProjection
               round 2: ``seed`` (hex, 32 bytes) -> ``vectors`` float32 [n] (every projection vector,
               layout order, flattened), ``roots`` uint8 [n_committed, 32]
AuditOpenRequest / AuditOpening
               round 3: ``rows`` {tensor name: [row index]} -> ``values`` float32 [n] (trace and
               projection rows), ``weights`` [n] (weight rows and columns, the weights' dtype),
               ``wire`` [n] (wire rows, the wire dtype), ``proofs`` uint8 [n_hashes, 32]; rows in the
               request's order (names sorted, indices as listed), proofs bottom up
============== ================================================================================
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

import torch

#: 2: the codec leaves out JSON fields equal to their default; MergeResult sends no shard/momentum hashes.
#: 3: a message without tensors travels as its JSON metadata alone (no safetensors framing)
SPEC_VERSION = 3

TENSOR_ONE = "one"
TENSOR_DICT = "dict"


def tensor_field(*, required: bool = False, kind: str = TENSOR_ONE) -> Any:
    """A field that travels as a safetensors tensor (``kind="dict"``: a dict of named tensors)."""
    if kind == TENSOR_DICT:
        return field(default_factory=dict, metadata={"tensor": kind, "required": required})
    return field(default=None, metadata={"tensor": kind, "required": required})


def digest_field(*, many: bool = False) -> Any:
    """A sha256 digest (lowercase hex; ``many``: a list of them) that travels as base64 (see the codec)."""
    if many:
        return field(default_factory=list, metadata={"digest": True})
    return field(default="", metadata={"digest": True})


@dataclass(kw_only=True)
class Message:
    TYPE: ClassVar[str] = "Message"
    #: the codec puts each tensor's sha256 in the header and checks it on decode; a message whose body
    #: is covered by the btauth signature and whose receiver commits to its tensors itself (``Hop``)
    #: skips that pass
    HASH_TENSORS: ClassVar[bool] = True
    #: a message with tensors travels as a safetensors payload (its JSON metadata in the header's
    #: ``__metadata__``); False: as a compact body (its JSON metadata with a tensor table, a newline,
    #: the tensors' raw bytes), for the merge's many small chunks (see the codec)
    SAFETENSORS_BODY: ClassVar[bool] = True

    run_id: str = ""
    stage: int = 0
    microbatch_id: str = ""
    inner_step: int = 0
    spec_version: int = SPEC_VERSION
    info: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def tensor_fields(cls) -> dict[str, dataclasses.Field]:
        return {f.name: f for f in dataclasses.fields(cls) if "tensor" in f.metadata}

    @classmethod
    def json_fields(cls) -> dict[str, dataclasses.Field]:
        return {f.name: f for f in dataclasses.fields(cls) if "tensor" not in f.metadata}


@dataclass(kw_only=True)
class MergePayload(Message):
    """One chunk of a replica's pseudo-gradient slice for shard ``shard_index``: values
    ``[offset, offset + n)`` of the flat stage vector, chunk ``chunk`` of ``num_chunks`` (a shard
    travels as chunks of at most ``merge.chunk_numel`` values, in order)."""
    TYPE: ClassVar[str] = "MergePayload"
    SAFETENSORS_BODY: ClassVar[bool] = False
    epoch: int = 0
    shard_index: int = 0
    num_shards: int = 1
    chunk: int = 0
    num_chunks: int = 1
    offset: int = 0
    total_numel: int = 0
    weight: float = 1.0
    attempt: int = 0
    plan_id: str = ""
    #: payload encoding: "none" (float32), "bf16", "int8" (then ``scales`` holds per-block absmax / 127)
    quant: str = "none"
    shard: Optional[torch.Tensor] = tensor_field(required=True)
    scales: Optional[torch.Tensor] = tensor_field()


@dataclass(kw_only=True)
class MergeJoin(Message):
    """Merge readiness of a replica. ``ready_epoch``: the epoch it waits to merge (-1: none);
    ``merged_epoch``: the last epoch it applied; ``closed_epoch``: the last epoch it finished,
    merged or not (one it gave up on is not worth waiting for); ``attempt``: its current attempt.
    ``participants``: always empty (a list of N hotkeys in each of N answers made a replica's join
    O(N^2) bytes; nobody read it), kept so that older peers still decode the answer."""
    TYPE: ClassVar[str] = "MergeJoin"
    epoch: int = 0
    attempt: int = 0
    ready_epoch: int = -1
    merged_epoch: int = -1
    closed_epoch: int = -1
    participants: list[str] = field(default_factory=list)
    in_sync: bool = True
    #: work this replica did in the merge window it is ready to merge (tokens trained since its last
    #: merge); its weight in the mean is proportional to it
    work: float = 0.0
    #: the replica's inner step when it answered (-1: not said): one within a step of the asker's
    #: boundary is about to be ready and is waited for, even when it was found gone before
    inner_step: int = -1
    #: True while the replica has trained nothing in any lane (a spare never handed one): it cannot
    #: reach a merge boundary, so its stage's replicas merge without waiting for it (it takes the
    #: merged state when it is handed a lane)
    spare: bool = False


@dataclass(kw_only=True)
class MergeAck(Message):
    TYPE: ClassVar[str] = "MergeAck"
    status: str = "ok"


@dataclass(kw_only=True)
class MergeResultRequest(Message):
    """Ask a reducer for its result for one shard: its header (``with_tensor`` false: hashes and signed
    claims), or chunk ``chunk`` of the mean alone (``with_tensor``: the header is asked for first), or (route ``/merge/contribution``) ask a contributor for chunk ``chunk`` of the
    pseudo-gradient slice it sent."""
    TYPE: ClassVar[str] = "MergeResultRequest"
    epoch: int = 0
    attempt: int = 0
    plan_id: str = ""
    shard_index: int = 0
    chunk: int = 0
    with_tensor: bool = True


@dataclass(kw_only=True)
class MergeResult(Message):
    """A reducer's result for one shard. ``status``: ``ok`` | ``incomplete`` (``missing`` names the
    contributors it lacks). Hashes are sha256 of raw float32 bytes (see ``tensor_sha256``):
    ``mean_sha256`` of the whole shard's mean; ``chunk_sha256``: of each chunk of the mean, in order
    (empty when the shard is one chunk: its hash is ``mean_sha256``; spec 2 also dropped the hashes of
    the reducer's new weights and momentum, which nobody read); ``mean``: chunk ``chunk`` of
    the mean (when asked with ``with_tensor``), encoded as ``quant`` says (``none``: float32 [n];
    ``bf16``; ``int8`` [n] with ``mean_scales`` float32 [ceil(n / block)]); the hashes are of the
    decoded float32 values. ``contributions_root``: one digest over the
    contributors, their weights and the sha256 of the dequantized values it used from each
    (:func:`iota_subnet.merge.claims.contributions_root`): two reducers that agree on it reduced the
    same inputs; the list itself is not sent (it would make every result O(N), every replica's
    gather O(N^2)): validators fetch it from the reducer's audit copy (``/audit/merge``).
    ``info``: ``claim``, the reducer's signed result claim in its wire form, and ``co``, the other
    reducer's signature over the same statement when both signed it
    (:mod:`iota_subnet.merge.claims`). An answer with the mean carries only ``chunk``, ``quant`` and
    the tensors."""
    TYPE: ClassVar[str] = "MergeResult"
    SAFETENSORS_BODY: ClassVar[bool] = False
    epoch: int = 0
    attempt: int = 0
    plan_id: str = ""
    shard_index: int = 0
    status: str = "ok"
    contributions_root: str = digest_field()
    missing: list[str] = field(default_factory=list)
    mean_sha256: str = digest_field()
    chunk: int = 0
    chunk_sha256: list[str] = digest_field(many=True)
    quant: str = "none"
    mean: Optional[torch.Tensor] = tensor_field()
    mean_scales: Optional[torch.Tensor] = tensor_field()


@dataclass(kw_only=True)
class StateChunkRequest(Message):
    """One chunk ``[offset, offset + numel)`` of the snapshot ``snapshot_id`` (empty: describe the
    current snapshot: the reply has no data, only its manifest in ``manifest``)."""
    TYPE: ClassVar[str] = "StateChunkRequest"
    snapshot_id: str = ""
    offset: int = 0
    numel: int = 0


@dataclass(kw_only=True)
class StateChunk(Message):
    TYPE: ClassVar[str] = "StateChunk"
    snapshot_id: str = ""
    offset: int = 0
    #: manifest (describe requests): total_numel, sha256 of the whole, chunk sha256 list, chunk_numel,
    #: merged_epoch, step, layout (name, numel) ...
    manifest: dict[str, Any] = field(default_factory=dict)
    data: Optional[torch.Tensor] = tensor_field()


@dataclass(kw_only=True)
class StateReplayRequest(Message):
    """Chunk ``chunk`` of the mean pseudo-gradient of the applied merge ``epoch`` (``epoch`` < 0:
    describe the merges the donor keeps: the reply's ``manifest``)."""
    TYPE: ClassVar[str] = "StateReplayRequest"
    epoch: int = -1
    chunk: int = 0


@dataclass(kw_only=True)
class StateReplay(Message):
    """A kept merge's mean pseudo-gradient, one chunk: values ``[offset, offset + n)`` of the stage's
    flat parameters, encoded as ``quant`` says (the gather's encoding, as the merge carried it:
    ``none`` float32 [n]; ``bf16``; ``int8`` [n] with ``mean_scales`` float32 [ceil(n / block)];
    ``topk-*`` / ``sparse-*`` as :mod:`iota_subnet.merge.sparse`). ``manifest`` (describe): ``merges``,
    one ``{prev_epoch, epoch, chunks: [[offset, numel], ...], bytes}`` per kept merge, oldest first,
    and ``max_concurrent``."""
    TYPE: ClassVar[str] = "StateReplay"
    epoch: int = -1
    chunk: int = 0
    offset: int = 0
    quant: str = "none"
    manifest: dict[str, Any] = field(default_factory=dict)
    mean: Optional[torch.Tensor] = tensor_field()
    mean_scales: Optional[torch.Tensor] = tensor_field()


@dataclass(kw_only=True)
class StateRequest(Message):
    TYPE: ClassVar[str] = "StateRequest"
    names: Optional[list[str]] = None
    epoch: Optional[int] = None


@dataclass(kw_only=True)
class StateResponse(Message):
    TYPE: ClassVar[str] = "StateResponse"
    tensors: dict[str, torch.Tensor] = tensor_field(kind=TENSOR_DICT)
    state_meta: dict[str, Any] = field(default_factory=dict)


@dataclass(kw_only=True)
class Health(Message):
    TYPE: ClassVar[str] = "Health"
    status: str = "ok"
    ready: bool = True
    busy: bool = False
    hotkey: str = ""
    uptime_s: float = 0.0
    stats: dict[str, float] = field(default_factory=dict)


@dataclass(kw_only=True)
class MergeEvidence(Message):
    """Request (``reports`` empty) and reply of ``/merge/evidence``: the mismatch evidence a replica
    recorded as a third party (:attr:`iota_subnet.merge.engine.MergeEngine.reports`), newest last.
    ``merged_epoch`` (reply): the last merge epoch the replica applied (-1: none); it keeps what
    audits of the last ``MERGE_AUDIT_KEEP_EPOCHS`` epochs need (:mod:`iota_subnet.protocol.audit`)."""
    TYPE: ClassVar[str] = "MergeEvidence"
    reports: list[dict[str, Any]] = field(default_factory=list)
    merged_epoch: int = -1


@dataclass(kw_only=True)
class TicketBatch(Message):
    """Validator -> head miner: tickets (``Ticket.to_json()`` objects), in step order. ``base_steps``:
    per lane (as a string key), the first lane step the validator has not seen complete: a head that
    is behind it (it restarted from an older checkpoint) may skip to it, never further."""
    TYPE: ClassVar[str] = "TicketBatch"
    tickets: list[dict[str, Any]] = field(default_factory=list)
    base_steps: dict[str, int] = field(default_factory=dict)


@dataclass(kw_only=True)
class TicketAck(Message):
    """The head's answer: how many tickets it queued; ``refused``: ``{microbatch_id, outcome, message}``."""
    TYPE: ClassVar[str] = "TicketAck"
    accepted: int = 0
    refused: list[dict[str, Any]] = field(default_factory=list)


#: Hop directions: an activation forward, an activation gradient backward, or an abort travelling
#: back along the path (the micro-batch died downstream: drop its cached forward, no tensor).
HOP_DIRECTIONS = ("forward", "backward", "abort")


@dataclass(kw_only=True)
class Hop(Message):
    """Miner -> miner, one hop of a ticket's micro-batch (``stage`` is the receiver's stage).

    ``path``: the hotkeys that served stages ``0 .. stage - 1`` (forward) or ``0 .. n - 1``
    (backward and abort), so gradients return to the miners that hold the forwards.
    ``loss`` (backward from the tail): the micro-batch's loss, for the head's receipt."""
    TYPE: ClassVar[str] = "Hop"
    HASH_TENSORS: ClassVar[bool] = False     # signed body; sender and receiver commit with wire_root
    ticket: dict[str, Any] = field(default_factory=dict)
    direction: str = "forward"
    path: list[str] = field(default_factory=list)
    reason: str = ""
    data: Optional[torch.Tensor] = tensor_field()
    scales: Optional[torch.Tensor] = tensor_field()


@dataclass(kw_only=True)
class HopAck(Message):
    """``status``: ``accepted`` (queued), ``duplicate`` (this hop was already received: nothing done)."""
    TYPE: ClassVar[str] = "HopAck"
    status: str = "accepted"


@dataclass(kw_only=True)
class ReceiptBatch(Message):
    """Miner -> validator: receipts (see :mod:`iota_subnet.protocol.receipt`; each names the weights
    version root it used, ``wroot``) and ``updates``: the commitments of inner steps whose hashing
    finished since the last batch (:meth:`iota_subnet.protocol.UpdateCommit.to_dict`, at most
    :data:`MAX_UPDATES_PER_BATCH`). The whole batch is signed (btauth), so every root in it binds
    the miner before any audit is chosen."""
    TYPE: ClassVar[str] = "ReceiptBatch"
    receipts: list[dict[str, Any]] = field(default_factory=list)
    updates: list[dict[str, Any]] = field(default_factory=list)


#: Update commitments accepted per receipt batch (a miner takes a few inner steps per flush at most).
MAX_UPDATES_PER_BATCH = 64


@dataclass(kw_only=True)
class ReceiptAck(Message):
    TYPE: ClassVar[str] = "ReceiptAck"
    accepted: int = 0


@dataclass(kw_only=True)
class AuditTraceRequest(Message):
    """Round 1 of a hop audit (validator -> miner): recompute and commit the trace of the hop of
    ``microbatch_id`` at ``stage`` in ``direction`` (``forward`` | ``backward``) with the weights
    version ``weights_step`` / ``weights_merges`` / ``weights_root`` (hex) its receipt named.
    ``audit_id`` names the session in the rounds that follow."""
    TYPE: ClassVar[str] = "AuditTraceRequest"
    audit_id: str = ""
    direction: str = "forward"
    weights_step: int = 0
    weights_merges: int = 0
    weights_root: str = ""


@dataclass(kw_only=True)
class AuditTraceCommit(Message):
    """Round 1 reply: the Merkle root of every traced tensor (the layout's order) and of every weight
    entry (rows, columns; they combine to the version's root)."""
    TYPE: ClassVar[str] = "AuditTraceCommit"
    audit_id: str = ""
    direction: str = "forward"
    roots: Optional[torch.Tensor] = tensor_field(required=True)
    weight_roots: Optional[torch.Tensor] = tensor_field(required=True)


@dataclass(kw_only=True)
class AuditProjectRequest(Message):
    """Round 2 (validator -> miner): the seed (hex, 32 bytes) of the random projection vectors and
    the blocks (indices inside the stage) the audit checks, whose projections are asked for (empty:
    all blocks)."""
    TYPE: ClassVar[str] = "AuditProjectRequest"
    audit_id: str = ""
    seed: str = ""
    blocks: list[int] = field(default_factory=list)


@dataclass(kw_only=True)
class AuditProjection(Message):
    """Round 2 reply: every projection vector (flattened, layout order) and the roots of the
    committed projection tensors."""
    TYPE: ClassVar[str] = "AuditProjection"
    audit_id: str = ""
    vectors: Optional[torch.Tensor] = tensor_field(required=True)
    roots: Optional[torch.Tensor] = tensor_field(required=True)


@dataclass(kw_only=True)
class AuditOpenRequest(Message):
    """Round 3 (validator -> miner): the rows to open, by committed tensor name; ``whole``: wire tensors
    committed by a flat sha256 in the receipts, sent whole (every row, in order) without proofs;
    ``more``: another part of the opening follows (a replay audit opens a stage's weights in parts,
    each within the miner's opening cap), so the session stays open."""
    TYPE: ClassVar[str] = "AuditOpenRequest"
    audit_id: str = ""
    rows: dict[str, list[int]] = field(default_factory=dict)
    whole: list[str] = field(default_factory=list)
    more: bool = False


@dataclass(kw_only=True)
class AuditOpening(Message):
    """Round 3 reply: the requested rows (concatenated by dtype class, request order) and their proofs."""
    TYPE: ClassVar[str] = "AuditOpening"
    audit_id: str = ""
    values: Optional[torch.Tensor] = tensor_field()
    weights: Optional[torch.Tensor] = tensor_field()
    wire: Optional[torch.Tensor] = tensor_field()
    proofs: Optional[torch.Tensor] = tensor_field()


MESSAGE_TYPES: dict[str, type[Message]] = {
    c.TYPE: c for c in (MergePayload, MergeJoin, MergeAck,
                        MergeResultRequest, MergeResult, StateChunkRequest, StateChunk,
                        StateReplayRequest, StateReplay, StateRequest, StateResponse, Health, MergeEvidence, TicketBatch, TicketAck, Hop, HopAck,
                        ReceiptBatch, ReceiptAck, AuditTraceRequest, AuditTraceCommit, AuditProjectRequest,
                        AuditProjection, AuditOpenRequest, AuditOpening)
}
