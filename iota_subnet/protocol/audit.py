"""Audit messages: what a miner commits to per inner step, and how a validator opens it afterwards.

Commit, then audit: a miner commits to every inner optimizer step with an
:class:`UpdateCommit` (Merkle roots, see :mod:`iota_subnet.audit`) before any audit is chosen; a
validator later asks for a few random rows of the committed tensors (:class:`UpdateAuditRequest`,
route ``/audit/update``, validators only) and gets them with Merkle proofs
(:class:`UpdateAuditResponse`). It recomputes AdamW elementwise on those rows
(:func:`iota_subnet.audit.update.check_update_opening`).

Replica merges (``/audit/merge``): :class:`MergeAuditRequest` asks a replica for chunk rows of a
merge slice it contributed (``what="contribution"``) or of a shard mean it served as a reducer
(``what="mean"``), each proved against the root the replica signed in its merge claims
(:mod:`iota_subnet.merge.claims`); :class:`MergeAuditResponse` carries them.

Tensor kinds of an update commitment (every one a list of per-parameter tensors in ``state_dict``
order, committed with :func:`iota_subnet.audit.combine_roots`; each parameter's root over its rows,
first dimension, 1-D parameters one row):

======= =======================================================================================
``w0``  weights before the step (the weights version ``(step, merges)``)
``w1``  weights after the step (the weights version ``(step + 1, merges)``)
``m0``  AdamW first moment (``exp_avg``) before the step (zeros before the first step)
``m1``  ``exp_avg`` after the step
``v0``  AdamW second moment (``exp_avg_sq``) before the step
``v1``  ``exp_avg_sq`` after the step
``g``   the accumulated gradient before clipping (sum of the step's micro-batch gradients)
======= =======================================================================================

Wire keys of the opened rows (``UpdateAuditResponse.rows`` / ``.proofs``): ``"<kind>|<param>|<row>"``;
``rows`` values are float32 [row_numel], ``proofs`` values uint8 [depth, 32] (sibling hashes bottom
up); ``roots`` (per kind) uint8 [n_params, 32]: every parameter's root, in ``state_dict`` order.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, Mapping, Optional

import torch

from .contract import TensorContract, TensorSpec
from .messages import TENSOR_DICT, Message, tensor_field
from .outcome import Outcome, ProtocolError

#: The tensors an update commitment covers (see the module docstring).
UPDATE_KINDS = ("w0", "w1", "m0", "m1", "v0", "v1", "g")


def opening_key(kind: str, name: str, row: int) -> str:
    return f"{kind}|{name}|{int(row)}"


def parse_opening_key(key: str) -> tuple[str, str, int]:
    """Inverse of :func:`opening_key`; raises ProtocolError(MALFORMED)."""
    try:
        kind, name, row = key.split("|")
        return kind, name, int(row)
    except ValueError:
        raise ProtocolError(Outcome.MALFORMED, f"bad opening key {key!r}") from None


@dataclass
class UpdateCommit:
    """A miner's commitment to one inner optimizer step of its stage.

    ``step``: the inner step k (the weights before are version ``(k, merges)``, after ``(k + 1, merges)``);
    ``adam_step``: AdamW's step count after the update (its bias correction uses it; a replica that
    restarted its optimizer counts from 1 again); ``lr``: the learning rate applied; ``grad_norm``:
    the total L2 norm of the accumulated gradient before clipping; ``clip_coef``: the factor the
    gradient was multiplied by (``min(1, grad_clip / (grad_norm + 1e-6))`` in float32, as
    ``torch.nn.utils.clip_grad_norm_``); ``skipped``: the norm was not finite and no update was
    applied; ``roots``: kind -> hex root (:data:`UPDATE_KINDS`); ``no_grad``: parameters that had no
    gradient (AdamW leaves them untouched); ``at``: unix time the step finished.
    """

    step: int
    merges: int
    adam_step: int
    lr: float
    grad_norm: float
    clip_coef: float
    skipped: bool
    roots: dict[str, str]
    no_grad: list[str] = field(default_factory=list)
    at: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "UpdateCommit":
        """Parse and check a commitment received from a miner; raises ProtocolError(MALFORMED)."""
        try:
            roots = {str(k): str(v) for k, v in dict(d["roots"]).items()}
            c = cls(step=int(d["step"]), merges=int(d["merges"]), adam_step=int(d["adam_step"]), lr=float(d["lr"]),
                    grad_norm=float(d["grad_norm"]), clip_coef=float(d["clip_coef"]), skipped=bool(d["skipped"]),
                    roots=roots, no_grad=[str(n) for n in d.get("no_grad", [])], at=float(d.get("at", 0.0)))
        except (KeyError, TypeError, ValueError) as e:
            raise ProtocolError(Outcome.MALFORMED, f"update commitment: {type(e).__name__}: {e}") from None
        if set(c.roots) != set(UPDATE_KINDS) or not all(len(r) == 64 for r in c.roots.values()):
            raise ProtocolError(Outcome.MALFORMED, f"update commitment needs a 64-hex root for each of {UPDATE_KINDS}")
        try:
            for r in c.roots.values():
                bytes.fromhex(r)
        except ValueError:
            raise ProtocolError(Outcome.MALFORMED, "update commitment roots are not hex") from None
        if c.step < 0 or c.merges < 0 or c.adam_step < 0:
            raise ProtocolError(Outcome.MALFORMED, "update commitment: negative step, merges or adam_step")
        for k in ("lr", "clip_coef", "at"):
            if not math.isfinite(getattr(c, k)):
                raise ProtocolError(Outcome.MALFORMED, f"update commitment: {k} is not finite")
        if not c.skipped and not math.isfinite(c.grad_norm):
            raise ProtocolError(Outcome.MALFORMED, "update commitment: non-finite grad_norm on an applied step")
        return c


@dataclass(kw_only=True)
class UpdateAuditRequest(Message):
    """Open rows of the commitment of inner step ``inner_step`` (header field). ``rows``: ``[param
    name, row index]`` pairs; ``kinds``: which committed tensors (default all of :data:`UPDATE_KINDS`)."""
    TYPE: ClassVar[str] = "UpdateAuditRequest"
    rows: list[list[Any]] = field(default_factory=list)
    kinds: list[str] = field(default_factory=lambda: list(UPDATE_KINDS))
    merges: int = 0


@dataclass(kw_only=True)
class UpdateAuditResponse(Message):
    """The opened rows (see the module docstring for keys, dtypes and shapes) and the commitment
    they belong to (``commit``: :meth:`UpdateCommit.to_dict`)."""
    TYPE: ClassVar[str] = "UpdateAuditResponse"
    commit: dict[str, Any] = field(default_factory=dict)
    rows: dict[str, torch.Tensor] = tensor_field(kind=TENSOR_DICT)
    proofs: dict[str, torch.Tensor] = tensor_field(kind=TENSOR_DICT)
    roots: dict[str, torch.Tensor] = tensor_field(kind=TENSOR_DICT)


#: Merge epochs a replica keeps its signed slices and means for, counted back from the newest epoch it
#: applied: a validator may ask about epoch ``e`` while the replica's merged epoch is below
#: ``e + MERGE_AUDIT_KEEP_EPOCHS``; older ones are refused (LATE) and that refusal is not a dodge.
MERGE_AUDIT_KEEP_EPOCHS = 4


@dataclass(kw_only=True)
class MergeAuditRequest(Message):
    """Open chunk rows ``chunks`` of a replica's merge slice (``what="contribution"``) or of a shard
    mean it served (``what="mean"``) of ``(epoch, attempt, plan_id, shard_index)``."""
    TYPE: ClassVar[str] = "MergeAuditRequest"
    epoch: int = 0
    attempt: int = 0
    plan_id: str = ""
    shard_index: int = 0
    what: str = "contribution"
    chunks: list[int] = field(default_factory=list)


@dataclass(kw_only=True)
class MergeAuditResponse(Message):
    """``claim``: the signed claim the chunks belong to (see :mod:`iota_subnet.merge.claims`);
    ``chunks``: ``"<index>"`` -> float32 [chunk_numel] (the last chunk may be shorter);
    ``proofs``: ``"<index>"`` -> uint8 [depth, 32]."""
    TYPE: ClassVar[str] = "MergeAuditResponse"
    claim: dict[str, Any] = field(default_factory=dict)
    chunks: dict[str, torch.Tensor] = tensor_field(kind=TENSOR_DICT)
    proofs: dict[str, torch.Tensor] = tensor_field(kind=TENSOR_DICT)


def update_audit_contract(max_row_numel: int = 1 << 24) -> TensorContract:
    """What a validator accepts in an :class:`UpdateAuditResponse`: float32 rows (the gradient of a
    skipped step may hold NaN / inf: that is why it was skipped), uint8 proofs and roots."""
    return TensorContract({
        "rows/g|*": TensorSpec(dtypes=(torch.float32,), max_numel=max_row_numel, finite=False, required=False),
        "rows/*": TensorSpec(dtypes=(torch.float32,), max_numel=max_row_numel, required=False),
        "proofs/*": TensorSpec(dtypes=(torch.uint8,), shape=(-1, 32), max_shape=(64, 32), required=False),
        "roots/*": TensorSpec(dtypes=(torch.uint8,), shape=(-1, 32), max_shape=(1 << 16, 32), required=False),
    }, max_tensors=4096)


def proof_tensor(proof: list[bytes]) -> torch.Tensor:
    """Sibling hashes -> uint8 [depth, 32] (depth 0 for a one-leaf tree)."""
    if not proof:
        return torch.zeros(0, 32, dtype=torch.uint8)
    return torch.frombuffer(bytearray(b"".join(proof)), dtype=torch.uint8).reshape(len(proof), 32).clone()


def proof_from_tensor(t: Optional[torch.Tensor]) -> list[bytes]:
    """uint8 [depth, 32] -> sibling hashes; raises ProtocolError(MALFORMED) for another shape."""
    if t is None or t.dtype != torch.uint8 or t.dim() != 2 or (t.numel() and t.shape[1] != 32):
        raise ProtocolError(Outcome.MALFORMED, "a Merkle proof must be uint8 [depth, 32]")
    raw = t.contiguous().numpy().tobytes()
    return [raw[i:i + 32] for i in range(0, len(raw), 32)]
