"""Merkle commitments over tensors: a miner commits to a tensor with one 32-byte root and later
opens any rows of it with short proofs (commit, then audit).

Leaves
    A tensor is viewed as rows (:func:`as_rows`): a 1-D tensor of n values is ``[1, n]``, a tensor of
    shape ``[r, ...]`` is ``[r, prod(...)]``. Leaf ``i`` is ``sha256(b"\\x00" || raw bytes of row i)``
    (raw = C-contiguous little-endian bytes, as safetensors stores them). Inner nodes are
    ``sha256(b"\\x01" || left || right)``; the domain bytes keep a leaf from passing as a node
    (second pre-image attacks, RFC 6962 section 2.1). An odd node at a level is promoted unchanged.

Roots of several tensors
    :func:`combine_roots` hashes named roots in a fixed order, so a stage's weights commit as one
    root over its parameters' roots (names and shapes included).

Proofs
    :meth:`MerkleTree.proof` returns the sibling hashes from leaf to root (``ceil(log2 n)`` x 32
    bytes at most); :func:`verify_proof` recomputes the root. Cost: hashing a tensor reads its bytes
    once (sha256, about 1-2 GB/s per core; hashlib releases the GIL, so large tensors hash on worker
    threads in parallel).

Device: tensors on any device are copied to host memory before hashing (never ``.numpy()`` on a
device tensor).
"""
from __future__ import annotations

import hashlib
from typing import Iterable, Optional, Sequence

import torch

LEAF = b"\x00"
NODE = b"\x01"
DIGEST_BYTES = 32
# sha256 states that have absorbed the domain byte: ``.copy()`` then ``.update(data)`` hashes
# ``domain || data`` without building the concatenation (rows are hashed by the hundred thousand)
_LEAF_STATE = hashlib.sha256(LEAF)
_NODE_STATE = hashlib.sha256(NODE)


class MerkleError(ValueError):
    """A proof or an opening does not match its commitment."""


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a 2-D C-contiguous host tensor ``[rows, row_numel]`` (see the module docstring)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.contiguous()
    if t.dim() == 0:
        return t.reshape(1, 1)
    if t.dim() == 1:
        return t.reshape(1, -1)
    return t.reshape(t.shape[0], -1)


def _raw(row: torch.Tensor) -> memoryview:
    return memoryview(row.contiguous().view(torch.uint8).numpy())


def leaf_hash(row: torch.Tensor) -> bytes:
    """Leaf hash of one row (a 1-D host tensor)."""
    return hashlib.sha256(LEAF + _raw(row.reshape(-1))).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    h = _NODE_STATE.copy()
    h.update(left)
    h.update(right)
    return h.digest()


def row_leaves(t: torch.Tensor) -> list[bytes]:
    """Leaf hashes of every row of ``t`` (see :func:`as_rows`)."""
    rows = as_rows(t)
    if rows.numel() == 0:
        return [hashlib.sha256(LEAF).digest() for _ in range(rows.shape[0])] or [hashlib.sha256(LEAF).digest()]
    out = []
    for row in rows.view(torch.uint8).numpy():      # [row_bytes] each, no copy
        h = _LEAF_STATE.copy()
        h.update(row)
        out.append(h.digest())
    return out


class MerkleTree:
    """A binary Merkle tree over leaf hashes (all levels kept: about 2 x 32 bytes per leaf)."""

    def __init__(self, leaves: Sequence[bytes]):
        if not leaves:
            raise ValueError("a Merkle tree needs at least one leaf")
        self.levels: list[list[bytes]] = [list(leaves)]
        while len(self.levels[-1]) > 1:
            cur = self.levels[-1]
            nxt = [node_hash(cur[i], cur[i + 1]) for i in range(0, len(cur) - 1, 2)]
            if len(cur) % 2:
                nxt.append(cur[-1])
            self.levels.append(nxt)

    @classmethod
    def of_rows(cls, t: torch.Tensor) -> "MerkleTree":
        return cls(row_leaves(t))

    @property
    def root(self) -> bytes:
        return self.levels[-1][0]

    @property
    def n_leaves(self) -> int:
        return len(self.levels[0])

    def proof(self, index: int) -> list[bytes]:
        """Sibling hashes of leaf ``index``, bottom up (a promoted odd node has no sibling)."""
        if not 0 <= index < self.n_leaves:
            raise IndexError(f"leaf {index} out of range 0..{self.n_leaves - 1}")
        out, i = [], index
        for level in self.levels[:-1]:
            sib = i ^ 1
            if sib < len(level):
                out.append(level[sib])
            i //= 2
        return out


def verify_proof(root: bytes, leaf: bytes, index: int, n_leaves: int, proof: Sequence[bytes]) -> bool:
    """True when ``leaf`` is leaf ``index`` of a tree of ``n_leaves`` leaves with root ``root``."""
    if not 0 <= index < n_leaves or n_leaves < 1:
        return False
    h, i, width, k = leaf, index, n_leaves, 0
    while width > 1:
        sib = i ^ 1
        if sib < width:
            if k >= len(proof):
                return False
            h = node_hash(h, proof[k]) if i % 2 == 0 else node_hash(proof[k], h)
            k += 1
        i //= 2
        width = (width + 1) // 2
    return k == len(proof) and h == root


def check_rows(root: bytes, n_leaves: int, rows: dict[int, torch.Tensor], proofs: dict[int, Sequence[bytes]]) -> None:
    """Verify opened rows (index -> 1-D row) against ``root``; raises :class:`MerkleError` naming the
    first row that does not match."""
    for i, row in rows.items():
        if i not in proofs or not verify_proof(root, leaf_hash(row), int(i), n_leaves, proofs[i]):
            raise MerkleError(f"row {i} does not match the committed root {root.hex()[:16]}...")


def combine_roots(named: Iterable[tuple[str, Sequence[int], bytes]]) -> bytes:
    """One root over ``(name, shape, root)`` triples, in the given order."""
    h = hashlib.sha256(b"iota-roots/1")
    for name, shape, root in named:
        h.update(name.encode() + b"\x00" + ",".join(str(int(s)) for s in shape).encode() + b"\x00" + root)
    return h.digest()


def tensor_root(t: torch.Tensor) -> bytes:
    """Root of a tensor's rows."""
    return MerkleTree.of_rows(t).root


def named_roots(tensors: dict[str, torch.Tensor], names: Optional[Sequence[str]] = None) -> list[tuple[str, tuple, bytes]]:
    """``(name, shape, root)`` for each tensor (``names`` fixes the order; default: sorted names)."""
    order = list(names) if names is not None else sorted(tensors)
    return [(n, tuple(tensors[n].shape), tensor_root(tensors[n])) for n in order]
