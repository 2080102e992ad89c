"""A run addressed by its spec hash: the wire pieces shared by the validators that serve a run's spec
and the neurons that fetch it.

The spec is the run's resolved config as canonical YAML (:func:`iota_subnet.config_hash.canonical_yaml`),
its hash the sha256 (64 lowercase hex) of that text's UTF-8 bytes. A validator serves the text on a
public, unauthenticated ``GET`` :data:`SPEC_ROUTE` of its server (content addressed: whoever reads it
checks it against the hash, so no signature is needed) and advertises the hash in its commitment
(``h``, :mod:`.commitment`). A neuron given the hash refuses any text whose sha256 differs
(:func:`verify_spec` raises :class:`SpecHashMismatchError`, naming both hashes).
"""
from __future__ import annotations

import hashlib
import re

from iota_subnet.errors import UserError

#: the validator's public route serving its run's spec (``text/yaml``, UTF-8)
SPEC_ROUTE = "/run/spec"
#: response header naming the hash of the served spec (informative only: the reader hashes the body)
SPEC_HASH_HEADER = "X-Iota-Spec-Hash"
#: the largest spec text accepted (a resolved config is a few KiB; a transformers config a few more)
MAX_SPEC_BYTES = 1 << 20
_HASH = re.compile(r"^[0-9a-f]{64}$")


class SpecHashMismatchError(UserError):
    """A spec's content does not hash to the hash it was asked for (tampered, truncated or another run's);
    the message names both hashes and where the text came from."""


def is_spec_hash(value: object) -> bool:
    """True for a spec hash: a string of exactly 64 lowercase hex digits."""
    return isinstance(value, str) and bool(_HASH.match(value))


def check_spec_hash(value: str) -> str:
    """``value`` stripped and lower-cased when it is a spec hash; raises :class:`UserError` naming the
    expected form otherwise (a prefix is not accepted: two runs' hashes may share one)."""
    h = value.strip().lower() if isinstance(value, str) else ""
    if not is_spec_hash(h):
        raise UserError(f"spec hash {value!r} is not 64 hex digits (the sha256 a run's validators advertise; "
                        "the commitment key h, or RunSpec.spec_hash())")
    return h


def spec_digest(content: bytes) -> str:
    """sha256 (64 lowercase hex) of a spec's bytes."""
    return hashlib.sha256(content).hexdigest()


def verify_spec(content: bytes, want: str, source: str) -> str:
    """The spec text of ``content`` when its sha256 is ``want``. Raises :class:`SpecHashMismatchError`
    (naming ``want``, the content's hash and ``source``, e.g. the validator's uid and address) when it is
    not, or when it is larger than :data:`MAX_SPEC_BYTES` or not UTF-8 (refused before hashing)."""
    if len(content) > MAX_SPEC_BYTES:
        raise SpecHashMismatchError(f"the run spec from {source} is {len(content)} bytes, above the "
                                    f"{MAX_SPEC_BYTES} accepted; refused (wanted spec hash {want})")
    got = spec_digest(content)
    if got != want:
        raise SpecHashMismatchError(f"the run spec from {source} does not match its hash: wanted {want}, its "
                                    f"content hashes to {got}; refused (that source serves another run or a "
                                    "tampered spec)")
    try:
        return content.decode("utf-8")
    except UnicodeDecodeError:
        raise SpecHashMismatchError(f"the run spec from {source} (hash {want}) is not UTF-8 text; refused") from None
