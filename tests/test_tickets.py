"""A miner's ticket check (:class:`~iota_subnet.miner.tickets.TicketChecker`): a signature is only good for
the bytes it signed, also after a ticket with that signature was accepted."""
from __future__ import annotations

import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
from bittensor.sp_core import Keypair

from iota_subnet.miner.tickets import TicketChecker, TicketShape
from iota_subnet.protocol import Outcome, ProtocolError, Ticket
from iota_subnet.protocol.ticket import WIRE_DTYPES, TicketError


def _setup():
    val, head, nxt = (Keypair.create_from_uri(f"//tk-{n}") for n in ("val", "head", "next"))
    neurons = {val.ss58_address: SimpleNamespace(validator_permit=True),
               head.ss58_address: SimpleNamespace(validator_permit=False),
               nxt.ss58_address: SimpleNamespace(validator_permit=False)}
    now = time.time()
    t = Ticket(run_id="tk", validator=val.ss58_address, lane=0, step=0, index=0, microbatch_id="tk-0-0-0",
               split="train", seed=1, start=64, rows=2, seq_len=16, width=8, wire_dtype="bf16", train=True,
               micro_per_step=4, route=(head.ss58_address, nxt.ss58_address), trains=(True, True),
               issued_at=now, deadline=now + 60).signed(val)
    shape = TicketShape(run_id="tk", n_stages=2, seq_len=16, width=8, micro_per_step=4, max_rows=8)
    checker = TicketChecker(shape, stage=1, me=nxt.ss58_address, neurons=lambda: neurons)
    return t, checker, head.ss58_address


def test_a_copied_signature_over_changed_fields_is_refused_after_the_good_ticket_was_accepted():
    t, checker, head = _setup()
    assert checker.check(t.to_json(), sender=head, direction="forward") == t       # the good one: accepted (cached)
    assert checker.check(t.to_json(), sender=head, direction="forward") == t       # and again, from the cache
    for field, value in (("start", 4096), ("seed", 2), ("rows", 8), ("step", 3)):
        forged = replace(t, **{field: value})                                       # same signature, other bytes
        assert forged.signature == t.signature
        with pytest.raises(ProtocolError) as e:
            checker.check(forged.to_json(), sender=head, direction="forward")
        assert e.value.outcome == Outcome.BAD_TICKET, (field, e.value)


def test_a_ticket_may_ask_for_any_wire_dtype_and_no_other():
    """fp32, bf16, int8 and fp8 (:mod:`iota_subnet.protocol.wire`) are ticket wire dtypes; another is MALFORMED."""
    t, _, _ = _setup()
    assert WIRE_DTYPES == ("fp32", "bf16", "int8", "fp8")
    for w in WIRE_DTYPES:
        replace(t, wire_dtype=w).check_shape_fields()
    with pytest.raises(TicketError, match="wire_dtype 'fp4'"):
        replace(t, wire_dtype="fp4").check_shape_fields()


def test_not_from_is_signed_when_set_and_a_malformed_one_is_refused():
    """``not_from`` (the validator's barred miners a lane taker must not take weights from) is covered by
    the signature when set, absent from the signed body when empty (a ticket without it reads as
    before), and a malformed one is MALFORMED."""
    t, checker, head = _setup()
    assert "not_from" not in t.to_json() and Ticket.from_json(t.to_json()) == t
    val = Keypair.create_from_uri("//tk-val")
    barred = replace(t, signature="", not_from=(head,)).signed(val)
    d = barred.to_json()
    assert d["not_from"] == [head] and Ticket.from_json(d).not_from == (head,)
    assert checker.check(d, sender=head, direction="forward").not_from == (head,)
    stripped = replace(barred, not_from=())                       # the validator's list dropped in transit
    with pytest.raises(ProtocolError) as e:
        checker.check(stripped.to_json(), sender=head, direction="forward")
    assert e.value.outcome == Outcome.BAD_TICKET
    for bad in ("5Abc", [1, 2], ["x" * 65], ["5Abc"] * 33):
        with pytest.raises(TicketError) as te:
            Ticket.from_json({**d, "not_from": bad})
        assert te.value.outcome == "MALFORMED", bad
