"""Merkle commitments: every row opens against the root, any change to a row, an index or a proof fails."""
import pytest
import torch

from iota_subnet.audit import MerkleError, MerkleTree, check_rows, combine_roots, leaf_hash, tensor_root, verify_proof


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 13, 64, 100])
def test_every_leaf_opens_and_tampering_fails(n):
    g = torch.Generator().manual_seed(n)
    t = torch.randn(n, 7, generator=g)
    tree = MerkleTree.of_rows(t)
    assert tree.n_leaves == n
    for i in range(n):
        proof = tree.proof(i)
        assert len(proof) <= max(1, (n - 1).bit_length())
        assert verify_proof(tree.root, leaf_hash(t[i]), i, n, proof)
        bad = t[i].clone()
        bad[3] += 1e-6
        assert not verify_proof(tree.root, leaf_hash(bad), i, n, proof)
        if n > 1:
            assert not verify_proof(tree.root, leaf_hash(t[i]), (i + 1) % n, n, proof)
        if proof:
            forged = list(proof)
            forged[0] = bytes(32)
            assert not verify_proof(tree.root, leaf_hash(t[i]), i, n, forged)


def test_rows_of_any_shape_and_dtype_and_roots_differ():
    a = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    assert MerkleTree.of_rows(a).n_leaves == 2
    assert MerkleTree.of_rows(a.reshape(-1)).n_leaves == 1
    assert tensor_root(a) != tensor_root(a.to(torch.bfloat16))
    assert tensor_root(a) != tensor_root(a.reshape(4, 6))       # same bytes, other rows
    r1 = combine_roots([("w", (2, 12), tensor_root(a))])
    r2 = combine_roots([("w", (4, 6), tensor_root(a))])
    assert r1 != r2


def test_check_rows_names_the_bad_row():
    t = torch.randn(9, 5)
    tree = MerkleTree.of_rows(t)
    rows = {2: t[2].clone(), 6: t[6].clone()}
    proofs = {i: tree.proof(i) for i in rows}
    check_rows(tree.root, 9, rows, proofs)
    rows[6][0] = 0.0
    with pytest.raises(MerkleError, match="row 6"):
        check_rows(tree.root, 9, rows, proofs)


def test_a_leaf_cannot_pass_as_an_inner_node():
    t = torch.randn(4, 3)
    tree = MerkleTree.of_rows(t)
    inner = tree.levels[1][0]          # hash of leaves 0 and 1
    # the verifier knows the leaf count from the committed shape (4 rows): a shortened proof that
    # presents the inner node as a leaf is refused
    assert not verify_proof(tree.root, inner, 0, 4, [tree.levels[1][1]])
    # and row bytes equal to the two child hashes do not hash to that node (domain separation)
    fake_row = torch.frombuffer(bytearray(tree.levels[0][0] + tree.levels[0][1]), dtype=torch.uint8)
    assert leaf_hash(fake_row) != inner
