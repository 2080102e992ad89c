"""Commit-then-audit: Merkle commitments to tensors and the checks validators run on opened parts.

Shared by miners (they commit and open) and validators (they verify); no networking here.
"""
from .merkle import (MerkleError, MerkleTree, as_rows, check_rows, combine_roots, leaf_hash, named_roots, row_leaves,
                     tensor_root, verify_proof)

__all__ = ["MerkleError", "MerkleTree", "as_rows", "check_rows", "combine_roots", "leaf_hash", "named_roots",
           "row_leaves", "tensor_root", "verify_proof"]
