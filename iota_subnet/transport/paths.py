"""Which path each pair of neurons' traffic took: direct, or through a relay (home miners behind NAT).

Every :class:`~iota_subnet.transport.client.NeuronClient` call that got an HTTP answer (a reply or a
refusal) is recorded under the caller's hotkey, direction ``out``, per receiver hotkey:

* ``"relayed"`` (``via``: the relay's ``ip:port``) when the endpoint it dialled is one of the
  receiver's relays (what ``alternates(receiver)`` names: its commitment's ``rl``, whose first is
  also its axon);
* ``"direct"`` when it dialled any other address (the receiver's own). A client without
  ``alternates`` knows no relays, so what it records is "direct" as far as it can tell.

Every request a :class:`~iota_subnet.transport.server.NeuronServer` served to a caller whose
signature verified is recorded under the server's hotkey, direction ``in``, per caller hotkey:
``"relayed"`` (``via``: the relay) when it came in through this process's
:class:`~iota_subnet.transport.relay.RelayTunnel` (the tunnel marks the requests it replays with
:func:`tunnel_headers`, holding a random token of this process that no other process knows, so a
caller cannot claim to be relayed), ``"direct"`` otherwise.

There is no hole punching in this project, so no path is ever ``"hole-punched"``; :data:`HOLE_PUNCHED`
names that kind only as a future value (never recorded).

The record is one per process (:func:`path_book`), keyed by the local hotkey so that neurons sharing
a process (in-process tests) each see their own; bounded: :data:`MAX_PEERS` peers per local hotkey
(the least recently seen is forgotten) and :data:`MAX_LOCALS` local hotkeys.
"""
from __future__ import annotations

import hmac
import secrets
import time
from typing import Any, Callable, Mapping, Optional

DIRECT, RELAYED = "direct", "relayed"
#: not implemented here (no hole punching): reserved for a future path kind, never recorded
HOLE_PUNCHED = "hole-punched"
#: peers kept per local hotkey; local hotkeys kept
MAX_PEERS, MAX_LOCALS = 256, 64
#: headers the relay tunnel adds to the requests it replays against its own server
HEADER_TUNNEL, HEADER_VIA = "X-Iota-Tunnel", "X-Iota-Relayed-Via"

_TOKEN = secrets.token_hex(16)


def tunnel_headers(via: Optional[str]) -> dict[str, str]:
    """Headers that mark a request replayed by this process's relay tunnel, which came through the
    relay at ``via`` (``ip:port``)."""
    return {HEADER_TUNNEL: _TOKEN, HEADER_VIA: via or "?"}


def relayed_via(headers: Mapping[str, str]) -> Optional[str]:
    """The relay a request came through when this process's tunnel replayed it (its token is right);
    None: it came directly."""
    token = headers.get(HEADER_TUNNEL)
    if not token or not hmac.compare_digest(token.encode(), _TOKEN.encode()):
        return None
    return headers.get(HEADER_VIA) or "?"


class PathBook:
    """Per local hotkey, per peer hotkey and direction (``out``: calls made, ``in``: requests served):
    the path kind of the latest exchange, its relay (``via``, None when direct), requests and bytes
    (bodies and headers, both directions) per kind, the time of the latest (unix seconds)."""

    def __init__(self, max_peers: int = MAX_PEERS, max_locals: int = MAX_LOCALS,
                 clock: Callable[[], float] = time.time):
        self.max_peers, self.max_locals, self.clock = int(max_peers), int(max_locals), clock
        #: local hotkey -> peer hotkey -> direction -> record
        self.book: dict[str, dict[str, dict[str, dict[str, Any]]]] = {}

    def record(self, local: str, peer: str, direction: str, via: Optional[str], nbytes: int) -> None:
        """One exchange between ``local`` and ``peer`` (``direction``: ``"out"`` or ``"in"``),
        through the relay ``via`` (None: direct), of ``nbytes`` bytes. Raises ValueError on an
        unknown direction."""
        if direction not in ("out", "in"):
            raise ValueError(f"path direction must be 'out' or 'in', not {direction!r}")
        peers = self.book.get(local)
        if peers is None:
            if len(self.book) >= self.max_locals:
                self.book.pop(next(iter(self.book)))
            peers = self.book[local] = {}
        entry = peers.pop(peer, None) or {}          # re-inserted last: the dict is kept in recency order
        if len(peers) >= self.max_peers:
            peers.pop(next(iter(peers)))
        peers[peer] = entry
        kind = RELAYED if via else DIRECT
        r = entry.setdefault(direction, {"kind": kind, "via": via, "requests": 0, "bytes": 0, "last": 0.0,
                                         "by_kind": {}})
        r["kind"], r["via"] = kind, via
        r["requests"] += 1
        r["bytes"] += int(nbytes)
        r["last"] = round(self.clock(), 3)
        k = r["by_kind"].setdefault(kind, {"requests": 0, "bytes": 0})
        k["requests"] += 1
        k["bytes"] += int(nbytes)

    def snapshot(self, local: str) -> dict[str, dict[str, dict[str, Any]]]:
        """JSON-ready: peer hotkey -> {``out``/``in``: {kind, via, requests, bytes, last, by_kind}},
        most recently seen peer last."""
        return {peer: {d: {**r, "by_kind": {k: dict(v) for k, v in r["by_kind"].items()}} for d, r in e.items()}
                for peer, e in self.book.get(local, {}).items()}


_BOOK = PathBook()


def path_book() -> PathBook:
    """The process's :class:`PathBook`."""
    return _BOOK
