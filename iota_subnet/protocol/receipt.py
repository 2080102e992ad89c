"""Receipts: what a miner reports to the validator about each hop it served (JSON, in a
:class:`~iota_subnet.protocol.messages.ReceiptBatch`, signed by the miner with btauth).

One receipt per micro-batch per stage, sent once the stage is done with it (after its backward;
the tail after its forward, which includes its backward), or at once when it failed:

========== ====================================================================================
id         micro-batch id (the ticket's)
lane, step, index, attempt, stage
status     ``ok`` | ``failed`` (``error``, ``unreachable`` name why and whom) | ``stale`` | ``expired``
fin, fout  commitment of the activation received / sent: :func:`iota_subnet.audit.commit.wire_root`
           of the wire tensor's token rows (int8, fp8: with their scales), hex; ``""`` where none
bin, bout  the same for the activation gradient received / sent
loss       the micro-batch's mean loss (nats per token): the tail, and echoed back to the head
ws, wm     the weights version used: inner step and merges applied
wroot      root of that weights version (:func:`iota_subnet.audit.commit.weights_commitment`), hex;
           ``""`` when the miner keeps no audit window
bwroot     root of the weights the backward used when they differ from the forward's (a merge
           landed in between), else ``""``; ``bws``, ``bwm`` name that version
boot       unix time the miner process started (a new value announces a restart: audits of work
           from before it are excused, :mod:`iota_subnet.validator.audit_policy`)
accumulated  whether this stage trained on it (the lane's own miner, first time)
prev, next hotkeys of the neighbours it received from / sent to
compute_s  seconds of compute (forward + backward); ``t`` unix time when it finished
inner_step this stage's inner step after the hop
========== ====================================================================================

Neighbouring receipts must agree: ``fout`` of stage s equals ``fin`` of stage s + 1 and ``bout``
of stage s + 1 equals ``bin`` of stage s. Audits open single token rows of these tensors against the
roots (:mod:`iota_subnet.audit`). About 0.5 kB each (JSON).
"""
from __future__ import annotations

from typing import Literal, Optional

import pydantic

#: Receipts accepted per batch (a miner flushes every half second or every 256).
MAX_RECEIPTS_PER_BATCH = 4096

_Hex = pydantic.constr(pattern=r"^([0-9a-f]{64})?$")
_Hotkey = pydantic.constr(max_length=64)


class Receipt(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", strict=True, frozen=True)

    id: pydantic.constr(min_length=1, max_length=160)
    lane: pydantic.conint(ge=0)
    step: pydantic.conint(ge=-1)
    index: pydantic.conint(ge=0)
    attempt: pydantic.conint(ge=0)
    stage: pydantic.conint(ge=0, le=4096)
    status: Literal["ok", "failed", "stale", "expired"]
    fin: _Hex = ""
    fout: _Hex = ""
    bin: _Hex = ""
    bout: _Hex = ""
    loss: Optional[pydantic.confloat(allow_inf_nan=False)] = None
    compute_s: pydantic.confloat(ge=0, allow_inf_nan=False) = 0.0
    ws: int = -1
    wm: int = -1
    wroot: _Hex = ""
    bwroot: _Hex = ""
    bws: int = -1
    bwm: int = -1
    boot: pydantic.confloat(ge=0, allow_inf_nan=False) = 0.0
    accumulated: bool = False
    prev: _Hotkey = ""
    next: _Hotkey = ""
    inner_step: pydantic.conint(ge=0) = 0
    t: pydantic.confloat(allow_inf_nan=False) = 0.0
    error: pydantic.constr(max_length=400) = ""
    unreachable: list[_Hotkey] = pydantic.Field(default_factory=list, max_length=16)


def parse_receipt(raw: object) -> Optional[Receipt]:
    """The receipt, or None when it is malformed (never raises)."""
    try:
        return Receipt.model_validate(raw)
    except pydantic.ValidationError:
        return None
