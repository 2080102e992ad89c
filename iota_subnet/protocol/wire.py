"""Wire formats of activations and activation gradients between miners.

A stage computes in fp32 (or under bf16 autocast) and sends ``[B, T, b]`` over the wire as:

* ``fp32``: unchanged, 4 bytes a value;
* ``bf16`` (default): rounded to bfloat16 (round-to-nearest-even), 2 bytes a value; relative
  rounding error at most 2^-9 per value;
* ``int8``: per-row (per token) absmax scaling, ``q = round(x / s)`` with ``s = max|x| / 127``,
  1 byte a value plus one float32 scale per token (``scales`` ``[B, T]``); error at most ``s / 2``
  per value (LLM.int8, Dettmers et al. 2022, section 3, vector-wise quantisation).

The receiver decodes to fp32. Bytes per token on the wire: ``b * {4, 2, 1}`` (+ 4 for int8).
"""
from __future__ import annotations

from typing import Optional

import torch

WIRE_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}


def bytes_per_value(wire_dtype: str) -> int:
    return {"fp32": 4, "bf16": 2, "int8": 1}[wire_dtype]


def to_wire(x: torch.Tensor, wire_dtype: str) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``x`` float ``[..., b]`` -> (wire tensor, per-row scales ``[...]`` float32 for int8 else None).
    Runs on ``x``'s device; the caller moves the result to the host. Raises ValueError for an
    unknown ``wire_dtype``."""
    if wire_dtype not in WIRE_TORCH_DTYPES:
        raise ValueError(f"unknown wire dtype {wire_dtype!r}; one of {sorted(WIRE_TORCH_DTYPES)}")
    x = x.detach()
    if wire_dtype == "fp32":
        return x.float().contiguous(), None
    if wire_dtype == "bf16":
        return x.to(torch.bfloat16).contiguous(), None
    x = x.float()
    scales = x.abs().amax(dim=-1).clamp_min(1e-30) / 127.0                  # [...]
    q = torch.round(x / scales.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scales.contiguous()


def from_wire(data: torch.Tensor, scales: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Wire tensor (+ int8 scales) -> float32 ``[..., b]``. Raises ValueError when an int8 tensor
    comes without matching scales."""
    if data.dtype == torch.int8:
        if scales is None or tuple(scales.shape) != tuple(data.shape[:-1]):
            raise ValueError(f"int8 activations {tuple(data.shape)} need scales of shape {tuple(data.shape[:-1])}")
        return data.float() * scales.float().unsqueeze(-1)
    return data.float()


def dtype_of(t: torch.Tensor) -> str:
    """The wire dtype name of a wire tensor."""
    for name, dt in WIRE_TORCH_DTYPES.items():
        if t.dtype == dt:
            return name
    raise ValueError(f"{t.dtype} is not a wire dtype")
