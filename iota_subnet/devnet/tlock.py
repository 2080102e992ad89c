"""Commit-reveal payloads: subtensor's ``WeightsTlockPayload`` (SCALE: ``hotkey: Vec<u8>, uids:
Vec<u16>, values: Vec<u16>, version_key: u64``; the legacy form has no hotkey), timelocked to a
drand quicknet round. :func:`drand_decryptor` opens a commit with the round's signature fetched
over HTTP (``bittensor_core.decrypt``); a :data:`Decryptor` can replace it (tests).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional


@dataclass(frozen=True)
class RevealedWeights:
    """A commit-reveal payload once decrypted (subtensor's ``WeightsTlockPayload``)."""

    uids: list[int]
    values: list[int]
    version_key: int
    hotkey: Optional[bytes] = None  # the committer's public key (v4 payloads)


#: ``decryptor(commit_bytes, reveal_round)``: the revealed weights, or None while not decryptable.
Decryptor = Callable[[bytes, int], Optional[RevealedWeights]]


def _scale_compact(data: bytes, i: int) -> tuple[int, int]:
    mode = data[i] & 3
    if mode == 0:
        return data[i] >> 2, i + 1
    if mode == 1:
        return int.from_bytes(data[i:i + 2], "little") >> 2, i + 2
    if mode == 2:
        return int.from_bytes(data[i:i + 4], "little") >> 2, i + 4
    n = (data[i] >> 2) + 4
    return int.from_bytes(data[i + 1:i + 1 + n], "little"), i + 1 + n


def decode_tlock_payload(data: bytes) -> RevealedWeights:
    """SCALE-decode subtensor's ``WeightsTlockPayload`` (``hotkey: Vec<u8>, uids: Vec<u16>,
    values: Vec<u16>, version_key: u64``; the legacy form has no hotkey). Raises ``ValueError``."""
    def vec_u16(i: int) -> tuple[list[int], int]:
        n, i = _scale_compact(data, i)
        if i + 2 * n > len(data):
            raise ValueError("truncated Vec<u16>")
        return [int.from_bytes(data[i + 2 * k:i + 2 * k + 2], "little") for k in range(n)], i + 2 * n

    for with_hotkey in (True, False):
        try:
            i, hotkey = 0, None
            if with_hotkey:
                n, i = _scale_compact(data, 0)
                if n != 32:
                    continue
                hotkey, i = data[i:i + 32], i + 32
            uids, i = vec_u16(i)
            values, i = vec_u16(i)
            if len(uids) != len(values) or i + 8 != len(data):
                continue
            return RevealedWeights(uids, values, int.from_bytes(data[i:i + 8], "little"), hotkey)
        except (IndexError, ValueError):
            continue
    raise ValueError("not a WeightsTlockPayload")


def drand_decryptor(commit: bytes, reveal_round: int) -> Optional[RevealedWeights]:
    """Decrypt a timelocked weights commit with the drand quicknet signature of its round (fetched
    over HTTP by ``bittensor_core.decrypt``); None while that signature cannot be had."""
    import bittensor_core

    try:
        plain = bittensor_core.decrypt(bytes(commit), no_errors=True)
    except Exception:  # noqa: BLE001 - unreachable beacon or not yet published
        return None
    return None if plain is None else decode_tlock_payload(bytes(plain))
