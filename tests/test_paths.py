"""The path book (iota_subnet/transport/paths.py): per local hotkey and peer, direct or relayed, bounded;
a request claims to come through the relay tunnel only with this process's token."""
from __future__ import annotations

import pytest

from iota_subnet.transport.paths import HEADER_TUNNEL, HEADER_VIA, PathBook, relayed_via, tunnel_headers


def test_records_per_local_and_peer_kind_via_and_bounds():
    t = [100.0]
    book = PathBook(max_peers=2, max_locals=2, clock=lambda: t[0])
    book.record("me", "a", "out", None, 10)
    book.record("me", "a", "out", "1.2.3.4:9", 5)
    book.record("me", "a", "in", "1.2.3.4:9", 7)
    a = book.snapshot("me")["a"]
    assert a["out"] == {"kind": "relayed", "via": "1.2.3.4:9", "requests": 2, "bytes": 15, "last": 100.0,
                        "by_kind": {"direct": {"requests": 1, "bytes": 10}, "relayed": {"requests": 1, "bytes": 5}}}
    assert a["in"]["kind"] == "relayed" and a["in"]["requests"] == 1
    assert book.snapshot("other") == {}
    book.record("me", "b", "out", None, 1)
    book.record("me", "a", "out", None, 1)            # a seen again: b is now the least recent
    book.record("me", "c", "in", None, 1)
    assert list(book.snapshot("me")) == ["a", "c"]
    book.record("x", "a", "out", None, 1)
    book.record("y", "a", "out", None, 1)             # a third local hotkey: the first is forgotten
    assert book.snapshot("me") == {} and book.snapshot("y")
    with pytest.raises(ValueError, match="direction"):
        book.record("me", "a", "sideways", None, 1)


def test_only_this_process_token_marks_a_request_relayed():
    assert relayed_via(tunnel_headers("9.9.9.9:1")) == "9.9.9.9:1"
    assert relayed_via({}) is None
    assert relayed_via({HEADER_TUNNEL: "0" * 32, HEADER_VIA: "9.9.9.9:1"}) is None
    assert relayed_via({HEADER_VIA: "9.9.9.9:1"}) is None
