"""Evidence of a refused hop: what a receiver shows a validator so that the sender, not the receiver,
answers for output nobody can use.

A miner that refuses a hop for a reason it can prove from the bytes alone (:data:`PROVABLE`:
non-finite numbers, a shape or dtype other than the ticket's, content that does not match the
root the sender committed in the hop's ``info["root"]``) sends the validator that signed the hop's
ticket a :class:`RefusalReport`: the hop's request body exactly as received, with the sender's
btauth/1 headers. Those headers sign the sha256 of that body, this receiver's hotkey and the path,
so the report proves what the sender sent to whom; a relay or a forger cannot make one that
verifies. The validator re-decides the refusal on the body itself (:mod:`iota_subnet.validator.blame`)
and charges the sender only when it finds the same fault.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

import torch

from .codec import META_KEY, is_json_body, read_header, with_defaults
from .messages import Hop, Message, tensor_field
from .outcome import Outcome, ProtocolError

#: Refusal outcomes a hop's signed body proves on its own.
PROVABLE = frozenset({Outcome.NON_FINITE, Outcome.BAD_SHAPE, Outcome.BAD_DTYPE, Outcome.HASH_MISMATCH})

#: btauth/1 headers a report carries (the signature and what it binds besides the body).
AUTH_HEADERS = ("X-Bittensor-Version", "X-Bittensor-Hotkey", "X-Bittensor-Receiver", "X-Bittensor-Nonce",
                "X-Bittensor-Crypto", "X-Bittensor-Signature")

#: Hop request bodies a report may carry (an activation of the largest runs, with its header).
MAX_REPORT_BODY_BYTES = 96 << 20


@dataclass(kw_only=True)
class RefusalReport(Message):
    """Miner (receiver) -> validator: a hop this miner refused. ``sender``: the hotkey that signed it;
    ``auth``: its btauth/1 headers (:data:`AUTH_HEADERS`); ``path``: the route it was posted to;
    ``outcome`` / ``reason``: the refusal as the receiver answered it; ``body``: uint8 [n], the
    request body exactly as received."""
    TYPE: ClassVar[str] = "RefusalReport"
    sender: str = ""
    auth: dict[str, str] = field(default_factory=dict)
    path: str = "/hop"
    outcome: str = ""
    reason: str = ""
    body: Optional[torch.Tensor] = tensor_field(required=True)


@dataclass(kw_only=True)
class RefusalAck(Message):
    """Validator -> miner: ``verdict`` ``proven`` (the sender is charged), ``unproven`` (the body
    holds no such fault, or the signature does not bind it), or ``unknown`` (not this validator's
    ticket)."""
    TYPE: ClassVar[str] = "RefusalAck"
    verdict: str = ""


def auth_headers(headers: Any) -> dict[str, str]:
    """The btauth/1 headers of a request (a mapping with ``get``), for a :class:`RefusalReport`."""
    return {k: str(headers.get(k)) for k in AUTH_HEADERS if headers.get(k)}


def hop_header(body: bytes) -> Optional[dict[str, Any]]:
    """The JSON fields of a hop request body (``ticket``, ``direction``, ``stage``, ``microbatch_id``,
    ``info``...), or None when the body is not a readable message body (safetensors, or JSON alone) with a ticket.
    Non-finite numbers are read, not refused."""
    try:
        if is_json_body(body):               # spec 3: a hop without tensors (an abort) is its JSON alone
            meta = json.loads(bytes(body))
        else:
            header, _ = read_header(body)
            meta = json.loads(header["__metadata__"][META_KEY])
    except (ProtocolError, KeyError, TypeError, ValueError):
        return None
    if not isinstance(meta, dict):
        return None
    meta = with_defaults(meta, Hop)          # the codec leaves out fields equal to their default
    return meta if isinstance(meta.get("ticket"), dict) else None
