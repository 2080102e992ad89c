"""Wire protocol: typed messages, safetensors encoding, tensor contracts, typed refusals."""
from .codec import decode, encode, payload_nbytes, read_header, tensor_sha256
from .contract import (
    FLOAT_DTYPES,
    TensorContract,
    TensorSpec,
    hop_contract,
    merge_payload_contract,
)
from .messages import (
    MESSAGE_TYPES,
    SPEC_VERSION,
    AuditOpening,
    AuditOpenRequest,
    AuditProjection,
    AuditProjectRequest,
    AuditTraceCommit,
    AuditTraceRequest,
    HOP_DIRECTIONS,
    Health,
    Hop,
    HopAck,
    MergeAck,
    MergeEvidence,
    MergeJoin,
    MergePayload,
    MergeResult,
    MergeResultRequest,
    Message,
    StateRequest,
    StateChunk,
    StateChunkRequest,
    StateReplay,
    StateReplayRequest,
    StateResponse,
    ReceiptAck,
    ReceiptBatch,
    TicketAck,
    TicketBatch,
    tensor_field,
)
from .ticket import Ticket, TicketError
from .wire import from_wire, to_wire
from .outcome import HTTP_STATUS, Outcome, ProtocolError
from .audit import (MERGE_AUDIT_KEEP_EPOCHS, UPDATE_KINDS, MergeAuditRequest, MergeAuditResponse, UpdateAuditRequest, UpdateAuditResponse,
                    UpdateCommit, opening_key, parse_opening_key, proof_from_tensor, proof_tensor,
                    update_audit_contract)

MESSAGE_TYPES.update({c.TYPE: c for c in (UpdateAuditRequest, UpdateAuditResponse, MergeAuditRequest,
                                          MergeAuditResponse)})

__all__ = [
    "MERGE_AUDIT_KEEP_EPOCHS",
    "AuditOpening", "AuditOpenRequest", "AuditProjection", "AuditProjectRequest", "AuditTraceCommit",
    "AuditTraceRequest", "HOP_DIRECTIONS", "Hop", "HopAck", "ReceiptAck", "ReceiptBatch", "Ticket",
    "TicketAck", "TicketBatch", "TicketError", "from_wire", "hop_contract", "to_wire", "FLOAT_DTYPES", "HTTP_STATUS", "Health",
    "MESSAGE_TYPES", "MergeAck", "MergeEvidence", "MergeJoin", "MergePayload", "MergeResult", "MergeResultRequest",
    "StateChunk", "StateChunkRequest", "StateReplay", "StateReplayRequest", "Message", "Outcome", "ProtocolError", "SPEC_VERSION", "StateRequest",
    "StateResponse", "TensorContract", "TensorSpec", "decode", "encode", "read_header", "tensor_sha256",
    "tensor_field",
    "UPDATE_KINDS", "MergeAuditRequest", "MergeAuditResponse", "UpdateAuditRequest", "UpdateAuditResponse",
    "UpdateCommit", "opening_key", "parse_opening_key", "proof_from_tensor", "proof_tensor", "update_audit_contract",
    "merge_payload_contract", "payload_nbytes",
]
