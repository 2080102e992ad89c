"""Typed outcomes of a request: every refusal names why, and maps to one HTTP status.

4xx: the caller's fault (do not retry the same request); 503: try again later
(``BUSY``, ``NOT_READY``; 429 ``TOO_MANY_REQUESTS``: the caller's own in-flight cap); 500: our fault (``INTERNAL``).
"""
from __future__ import annotations

import enum
from typing import Any, Optional


class Outcome(str, enum.Enum):
    OK = "OK"
    # authentication (btauth/1)
    MISSING_SIGNATURE = "MISSING_SIGNATURE"
    BAD_SIGNATURE = "BAD_SIGNATURE"
    REPLAYED_NONCE = "REPLAYED_NONCE"
    STALE_REQUEST = "STALE_REQUEST"
    CLOCK_SKEW = "CLOCK_SKEW"
    WRONG_RECEIVER = "WRONG_RECEIVER"
    # authorization (metagraph)
    UNREGISTERED_HOTKEY = "UNREGISTERED_HOTKEY"
    FORBIDDEN = "FORBIDDEN"
    # body validation
    MALFORMED = "MALFORMED"
    SPEC_VERSION = "SPEC_VERSION"
    BAD_SHAPE = "BAD_SHAPE"
    BAD_DTYPE = "BAD_DTYPE"
    NON_FINITE = "NON_FINITE"
    HASH_MISMATCH = "HASH_MISMATCH"
    BODY_TOO_LARGE = "BODY_TOO_LARGE"
    # application state
    UNKNOWN_MICROBATCH = "UNKNOWN_MICROBATCH"
    # data plane tickets
    BAD_TICKET = "BAD_TICKET"
    TICKET_EXPIRED = "TICKET_EXPIRED"
    NOT_ON_ROUTE = "NOT_ON_ROUTE"
    UNKNOWN_ROUTE = "UNKNOWN_ROUTE"
    LATE = "LATE"
    BUSY = "BUSY"
    TOO_MANY_REQUESTS = "TOO_MANY_REQUESTS"
    NOT_READY = "NOT_READY"
    INTERNAL = "INTERNAL"

    @property
    def retryable(self) -> bool:
        """True for outcomes where the same request may succeed later (503s)."""
        return self in (Outcome.BUSY, Outcome.NOT_READY, Outcome.TOO_MANY_REQUESTS)


HTTP_STATUS: dict[Outcome, int] = {
    Outcome.OK: 200,
    Outcome.MISSING_SIGNATURE: 401,
    Outcome.BAD_SIGNATURE: 401,
    Outcome.REPLAYED_NONCE: 401,
    Outcome.STALE_REQUEST: 401,        # signed longer ago than the freshness window (when the request started)
    Outcome.CLOCK_SKEW: 401,           # signed in the future: the caller's clock is ahead of ours
    Outcome.WRONG_RECEIVER: 421,       # Misdirected Request: signed for another hotkey
    Outcome.UNREGISTERED_HOTKEY: 403,
    Outcome.FORBIDDEN: 403,
    Outcome.MALFORMED: 400,
    Outcome.SPEC_VERSION: 426,         # Upgrade Required: the peer runs another protocol version
    Outcome.BAD_SHAPE: 422,
    Outcome.BAD_DTYPE: 422,
    Outcome.NON_FINITE: 422,
    Outcome.HASH_MISMATCH: 400,
    Outcome.BODY_TOO_LARGE: 413,
    Outcome.UNKNOWN_MICROBATCH: 404,
    Outcome.BAD_TICKET: 403,           # forged, malformed, for another run, or issued by a non-validator
    Outcome.TICKET_EXPIRED: 410,       # past the ticket's deadline
    Outcome.NOT_ON_ROUTE: 403,         # the ticket does not name this miner, or the hop's sender
    Outcome.UNKNOWN_ROUTE: 404,
    Outcome.LATE: 410,                 # Gone: the micro-batch / epoch window has closed
    Outcome.BUSY: 503,
    Outcome.TOO_MANY_REQUESTS: 429,    # this caller already has its cap of requests in flight
    Outcome.NOT_READY: 503,
    Outcome.INTERNAL: 500,
}
assert set(HTTP_STATUS) == set(Outcome)


class ProtocolError(Exception):
    """A request refused (server side) or a refusal received (client side).

    ``status`` is the HTTP status the outcome maps to, or the one actually received.
    """

    def __init__(self, outcome: Outcome, message: str = "", *, status: Optional[int] = None):
        self.outcome = Outcome(outcome)
        self.message = message
        self.status = HTTP_STATUS[self.outcome] if status is None else status
        super().__init__(f"{self.outcome.value}: {message}" if message else self.outcome.value)

    def to_json(self) -> dict[str, Any]:
        return {"outcome": self.outcome.value, "message": self.message}
