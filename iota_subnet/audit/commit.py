"""Commitments a miner is bound to: the weights version (one 32-byte root), the wire tensors of a
hop (one root each), and, when audited, its trace (one root per traced tensor).

Weights root (extends the DESIGN's row root with columns, still one root per version)
    For every parameter in ``state_dict`` order: the entry ``(name, shape, root of its rows)``
    (:meth:`MerkleTree.of_rows`: rows = first dim, a 1-D parameter is one row), followed for every
    matrix but the token embedding (:func:`~.layout.has_columns`) by ``(name + "^T", (in, out), root
    of its columns)`` (the rows of the transpose). The version's root is :func:`combine_roots` over these entries. Audits open
    weight rows (backward checks: ``W r``) and columns (forward checks: ``W^T r``) against it; see
    :mod:`.check`.

    Cost: every matrix is hashed twice (rows and columns) plus one transposed host copy at a time.
    Measured in ``scripts/bench_audit.py``; the 8b figures there come from the parameter counts of the
    shape and the measured hash rate of this machine.

Wire root
    :func:`wire_root` of a ``[B, T, b]`` wire tensor is the Merkle root of its ``N = B * T`` token
    rows in the wire dtype's raw bytes (bf16: 2 bytes a value; int8 and fp8: 1 byte a value, then the
    row's float32 scale). It costs one pass of sha256 over the
    tensor, as a flat sha256 does, plus ~2N small hashes; it lets an audit open single token rows
    instead of the whole tensor. Receipts should carry it (``in_root`` / ``out_root``).

Device: every tensor is copied to host memory before hashing (:func:`~.merkle.as_rows`).
"""
from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional, Sequence, Union

import torch

from iota_subnet.protocol.wire import SCALE_BYTES, WIRE_TORCH_DTYPES, needs_scales

from .layout import has_columns
from .merkle import MerkleTree, combine_roots


def host_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a C-contiguous 2-D host tensor ``[rows, width]`` (1-D: one row)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    if t.dim() <= 1:
        return t.reshape(1, -1).contiguous()
    return t.reshape(t.shape[0], -1).contiguous()


def host_cols(t: torch.Tensor) -> torch.Tensor:
    """Columns of a matrix ``[out, in]`` as rows: the C-contiguous host transpose ``[in, out]``."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    return t.t().contiguous()


def host_snapshot(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Host copies of a stage's weights (``state_dict()``), to hash off the compute thread.

    Take it on the compute thread right after the inner step (under the worker's lock): the device ->
    host copy is the only part that must not overlap the next step (8b head stage: 5.6 GB, ~0.3 s
    over PCIe 4); then run :func:`weights_commitment` on it in a worker thread.
    """
    out = {}
    for k, v in state.items():
        v = v.detach()
        out[k] = v.to("cpu") if v.device.type != "cpu" else v.clone()
    return out


@dataclass
class WeightsCommitment:
    """The root of one weights version and what opening rows and columns of it needs.

    ``entries``: ``(name, shape, root)`` in commitment order (``name`` or ``name^T``); ``trees``: by
    layout name (``w:<name>`` / ``w:<name>^T``); ``tensors``: the host copies the rows and columns
    are read from (``keep=False`` keeps neither: the root only).
    """

    root: bytes
    entries: list[tuple[str, tuple[int, ...], bytes]]
    trees: dict[str, MerkleTree] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def open_row(self, name: str, index: int) -> tuple[torch.Tensor, list[bytes]]:
        """Row ``index`` of layout entry ``name`` (``w:p`` a row of p, ``w:p^T`` a column) and its proof."""
        base = name[2:]
        if base.endswith("^T"):
            t = self.tensors[base[:-2]]
            row = t[:, index].contiguous()
        else:
            row = host_rows(self.tensors[base])[index]
        return row, self.trees[name].proof(index)


def _param_roots(name: str, t: torch.Tensor) -> list[tuple[str, tuple[int, ...], MerkleTree]]:
    shape = tuple(t.shape)
    rows = MerkleTree.of_rows(host_rows(t))
    out = [(name, shape, rows)]
    if has_columns(name, shape):
        out.append((name + "^T", (shape[1], shape[0]), MerkleTree.of_rows(host_cols(t))))
    return out


def weights_commitment(state: Mapping[str, torch.Tensor], *, keep: bool = True, threads: int = 1) -> WeightsCommitment:
    """Commit to a stage's weights (``state_dict`` order; any device: copied to host first).

    Run it off the compute thread on a snapshot of the weights taken right after the inner step
    (``{k: v.detach().clone()}``): hashing reads every byte twice. ``threads`` hashes parameters in
    parallel (hashlib releases the GIL on rows above 2 KiB). ``keep=False`` returns the root alone.
    """
    items = [(k, v) for k, v in state.items()]
    if threads > 1:
        with ThreadPoolExecutor(max_workers=threads) as ex:
            parts = list(ex.map(lambda kv: _param_roots(kv[0], kv[1]), items))
    else:
        parts = [_param_roots(k, v) for k, v in items]
    entries, trees = [], {}
    for part in parts:
        for name, shape, tree in part:
            entries.append((name, shape, tree.root))
            trees["w:" + name] = tree
    root = combine_roots(entries)
    if not keep:
        return WeightsCommitment(root, entries)
    tensors = {k: (v.detach().to("cpu") if v.device.type != "cpu" else v.detach()) for k, v in items}
    return WeightsCommitment(root, entries, trees, tensors)


def weights_root(state: Mapping[str, torch.Tensor], threads: int = 1) -> bytes:
    """The 32-byte root of a weights version (see the module docstring)."""
    return weights_commitment(state, keep=False, threads=threads).root


def weights_entries_root(params: Sequence[tuple[str, tuple[int, ...]]], roots: Sequence[bytes]) -> bytes:
    """Validator side: the version root from the parameter ``(name, shape)`` list the validator built
    from the config and the per-entry roots the miner sent (in commitment order)."""
    return combine_roots(list(zip(entry_names(params), entry_shapes(params), roots)))


def entry_names(params: Sequence[tuple[str, tuple[int, ...]]]) -> list[str]:
    out = []
    for name, shape in params:
        out.append(name)
        if has_columns(name, shape):
            out.append(name + "^T")
    return out


def entry_shapes(params: Sequence[tuple[str, tuple[int, ...]]]) -> list[tuple[int, ...]]:
    out = []
    for name, shape in params:
        out.append(tuple(shape))
        if has_columns(name, shape):
            out.append((shape[1], shape[0]))
    return out


WireTensor = Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]


def wire_rows(t: WireTensor) -> torch.Tensor:
    """A wire tensor ``[B, T, b]`` (fp32 / bf16) as its ``[B * T, b]`` token rows on the host; a scaled
    one (int8 / fp8, :func:`~iota_subnet.protocol.wire.needs_scales`), given as ``(data [B, T, b],
    scales float32 [B, T])`` (:func:`iota_subnet.protocol.to_wire`), as uint8 rows ``[B * T, b + 4]``:
    each token's bytes followed by its scale's. Raises ValueError when the scales do not fit."""
    scales = None
    if isinstance(t, tuple):
        t, scales = t
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    if t.dim() != 3:
        raise ValueError(f"a wire tensor is [B, T, b], got shape {tuple(t.shape)}")
    rows = t.reshape(-1, t.shape[-1]).contiguous()
    if needs_scales(t.dtype):
        if scales is None or tuple(scales.shape) != tuple(t.shape[:2]):
            raise ValueError(f"{t.dtype} wire rows need their scales [B, T] = {list(t.shape[:2])}")
        s = scales.detach().to("cpu", torch.float32).reshape(-1, 1).contiguous()
        return torch.cat((rows.view(torch.uint8), s.view(torch.uint8)), dim=1)
    if scales is not None:
        raise ValueError("only int8 and fp8 wire tensors carry scales")
    return rows


def split_wire_rows(raw: torch.Tensor, wire_format: str) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Opened wire rows -> (values float64 ``[N, b]``, per-row scales float64 ``[N]`` or None): the
    inverse of :func:`wire_rows`. ``raw``: ``[N, b]`` in the wire dtype (fp32 / bf16), or uint8
    ``[N, b + 4]`` for a scaled format (int8 / fp8: each token's bytes then its float32 scale),
    decoded ``data * scale``."""
    if not needs_scales(wire_format):
        return raw.to(torch.float64), None
    b = raw.shape[-1] - SCALE_BYTES
    data = raw[:, :b].contiguous().view(WIRE_TORCH_DTYPES[wire_format]).to(torch.float64)
    scales = raw[:, b:].contiguous().view(torch.float32).reshape(-1).to(torch.float64)
    return data * scales[:, None], scales


def wire_root(t: WireTensor) -> bytes:
    """Merkle root over the token rows of a wire tensor (see :func:`wire_rows`): what a receipt
    should name for the tensor (the hash of an int8 or fp8 one covers its scales)."""
    return MerkleTree.of_rows(wire_rows(t)).root


def wire_sha256(t: WireTensor) -> bytes:
    """The flat sha256 of a wire tensor's rows in order: for fp32 / bf16 the sha256 of its raw bytes,
    as the receipts of the data plane carry it today (:func:`iota_subnet.protocol.tensor_sha256`).
    An audit against it opens the whole tensor (see :class:`~.auditor.HopAuditor`)."""
    return hashlib.sha256(wire_rows(t).view(torch.uint8).numpy().tobytes()).digest()


def commit_rows(tensors: Mapping[str, torch.Tensor], names: Optional[Iterable[str]] = None) -> dict[str, MerkleTree]:
    """Row trees of 2-D host tensors (trace records, projection tensors)."""
    return {n: MerkleTree.of_rows(tensors[n]) for n in (names if names is not None else tensors)}
