"""What tensors a receiver accepts: names, dtypes, shapes (with wildcards and bounds), finiteness.

A :class:`TensorContract` is checked in two passes by :func:`iota_subnet.protocol.codec.decode`:
dtypes and shapes from the safetensors header *before* any tensor is materialised, then
finiteness on the loaded tensors.

Shapes use ``-1`` as a wildcard (any size), optionally bounded by ``max_shape`` / ``min_shape``::

    TensorContract({
        "activations": TensorSpec(dtypes=(torch.float32, torch.bfloat16), shape=(-1, 256, 64), max_shape=(8, 256, 64)),
        "targets": TensorSpec(dtypes=(torch.int64,), shape=(-1, 256), max_shape=(8, 256), required=False),
    })

Tensor names are the wire keys: a plain tensor field is keyed by its field name; a dict field
(e.g. ``StateResponse.tensors``) by ``"<field>/<name>"``, which a spec may match with a glob
(``"tensors/*"``).
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional, Sequence

import torch

from .outcome import Outcome, ProtocolError
from .wire import WIRE_TORCH_DTYPES

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class TensorSpec:
    """One accepted tensor. ``shape``: ``None`` accepts any shape (bounded by ``max_numel``);
    otherwise a tuple whose ``-1`` entries are wildcards. ``max_shape`` / ``min_shape`` bound every
    dimension (use ``-1`` for "no bound" in a position)."""

    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES
    shape: Optional[tuple[int, ...]] = None
    max_shape: Optional[tuple[int, ...]] = None
    min_shape: Optional[tuple[int, ...]] = None
    max_numel: Optional[int] = None
    required: bool = True
    finite: bool = True
    #: inclusive value bounds (e.g. token ids in ``[0, vocab_size - 1]``); out of range is MALFORMED.
    min_value: Optional[float] = None
    max_value: Optional[float] = None

    def check(self, name: str, dtype: torch.dtype, shape: Sequence[int]) -> None:
        if dtype not in self.dtypes:
            allowed = ", ".join(str(d).removeprefix("torch.") for d in self.dtypes)
            raise ProtocolError(Outcome.BAD_DTYPE,
                                f"tensor {name!r}: dtype {str(dtype).removeprefix('torch.')} not in ({allowed})")
        shape = tuple(int(s) for s in shape)
        if self.shape is not None:
            if len(shape) != len(self.shape):
                raise ProtocolError(Outcome.BAD_SHAPE, f"tensor {name!r}: shape {list(shape)} has {len(shape)} dims, "
                                                       f"expected {len(self.shape)} ({_fmt(self.shape)})")
            for i, (got, want) in enumerate(zip(shape, self.shape)):
                if want >= 0 and got != want:
                    raise ProtocolError(Outcome.BAD_SHAPE,
                                        f"tensor {name!r}: dim {i} is {got}, expected {want} ({_fmt(self.shape)})")
        for bound, cmp, word in ((self.max_shape, lambda g, b: g > b, "above"),
                                 (self.min_shape, lambda g, b: g < b, "below")):
            if bound is None:
                continue
            if len(bound) != len(shape):
                raise ProtocolError(Outcome.BAD_SHAPE, f"tensor {name!r}: shape {list(shape)} vs bound {_fmt(bound)}")
            for i, (got, b) in enumerate(zip(shape, bound)):
                if b >= 0 and cmp(got, b):
                    raise ProtocolError(Outcome.BAD_SHAPE,
                                        f"tensor {name!r}: dim {i} is {got}, {word} the bound {b} ({_fmt(bound)})")
        if self.max_numel is not None:
            numel = 1
            for s in shape:
                numel *= s
            if numel > self.max_numel:
                raise ProtocolError(Outcome.BAD_SHAPE, f"tensor {name!r}: {numel} elements > limit {self.max_numel}")


def _fmt(shape: Iterable[int]) -> str:
    return "(" + ", ".join("*" if s < 0 else str(s) for s in shape) + ")"


@dataclass(frozen=True)
class TensorContract:
    """Per wire-key :class:`TensorSpec` (exact names first, then glob patterns, in order).

    ``allow_extra``: accept tensors no spec names (they still pass the default finiteness check).
    ``max_tensors``: bound on the number of tensors in one message.
    """

    specs: Mapping[str, TensorSpec] = field(default_factory=dict)
    allow_extra: bool = False
    max_tensors: int = 4096

    def spec_for(self, name: str) -> Optional[TensorSpec]:
        spec = self.specs.get(name)
        if spec is not None:
            return spec
        for pattern, spec in self.specs.items():
            if any(c in pattern for c in "*?[") and fnmatch.fnmatchcase(name, pattern):
                return spec
        return None

    def check_header(self, tensors: Mapping[str, tuple[torch.dtype, Sequence[int]]]) -> None:
        """Names, dtypes and shapes, before the data is touched."""
        if len(tensors) > self.max_tensors:
            raise ProtocolError(Outcome.MALFORMED, f"{len(tensors)} tensors > limit {self.max_tensors}")
        for name, (dtype, shape) in tensors.items():
            spec = self.spec_for(name)
            if spec is None:
                if not self.allow_extra:
                    raise ProtocolError(Outcome.MALFORMED, f"unexpected tensor {name!r}")
                continue
            spec.check(name, dtype, shape)
        for pattern, spec in self.specs.items():
            if spec.required and not any(c in pattern for c in "*?[") and pattern not in tensors:
                raise ProtocolError(Outcome.MALFORMED, f"required tensor {pattern!r} missing")

    def wants_finite(self, name: str) -> bool:
        spec = self.spec_for(name)
        return True if spec is None else spec.finite

    def check_values(self, name: str, t: torch.Tensor) -> None:
        spec = self.spec_for(name)
        if spec is None or t.numel() == 0 or (spec.min_value is None and spec.max_value is None):
            return
        if spec.min_value is not None and bool((t < spec.min_value).any()):
            raise ProtocolError(Outcome.MALFORMED, f"tensor {name!r}: values below {spec.min_value}")
        if spec.max_value is not None and bool((t > spec.max_value).any()):
            raise ProtocolError(Outcome.MALFORMED, f"tensor {name!r}: values above {spec.max_value}")


# ---------------------------------------------------------------------------------------------- ready-made contracts

def merge_payload_contract(*, max_numel: int, block: int = 256) -> TensorContract:
    """A merge contribution: ``shard`` float [n <= max_numel] or int8 [n] (then ``scales`` float32
    [ceil(n / block)] required by the receiver's own check), 1-D."""
    return TensorContract({
        "shard": TensorSpec(dtypes=FLOAT_DTYPES + (torch.int8,), shape=(-1,), max_shape=(max_numel,)),
        "scales": TensorSpec(dtypes=(torch.float32,), shape=(-1,), max_shape=(max_numel // max(1, block) + 1,),
                             required=False),
    })


def hop_contract(*, seq_len: int, width: int, max_batch: int) -> TensorContract:
    """:class:`~iota_subnet.protocol.messages.Hop`: ``data`` [batch <= max_batch, seq_len, width] as
    float32, bfloat16, int8 or float8_e4m3fn (then ``scales`` float32 [batch, seq_len]); both optional (an abort
    carries none). The ticket's own shape fields are checked against the tensor by the receiver."""
    return TensorContract({
        "data": TensorSpec(dtypes=tuple(WIRE_TORCH_DTYPES.values()), shape=(-1, seq_len, width),
                           max_shape=(max_batch, -1, -1), min_shape=(1, -1, -1), required=False),
        "scales": TensorSpec(dtypes=(torch.float32,), shape=(-1, seq_len), max_shape=(max_batch, -1),
                             min_shape=(1, -1), required=False),
    })
