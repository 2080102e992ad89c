"""A stage boundary in one process, as the network's wire makes it.

Miners exchange the activation ``[B, T, b]`` forward and its gradient backward in the run's wire dtype
(:mod:`iota_subnet.protocol.wire`: ``fp32``, ``bf16``, ``int8`` or ``fp8`` with one float32 scale per
token). A co-located trainer (:mod:`.colocated`, :mod:`.hf_trainer`) puts :func:`through_wire` at every
boundary so that it rounds exactly what the network rounds: :class:`WireRoundTrip` is the identity up
to ``from_wire(to_wire(x))`` in the forward pass and the same round trip of the incoming gradient in
the backward pass (a straight-through estimator: the rounding itself is not differentiated, as on
the network, where the upstream miner receives the rounded gradient and nothing else).
"""
from __future__ import annotations

import torch

from iota_subnet.protocol.wire import WIRE_TORCH_DTYPES, from_wire, to_wire


def wire_round_trip(x: torch.Tensor, wire_dtype: str) -> torch.Tensor:
    """``x`` ``[..., d]`` as the receiver decodes it after the wire (``x``'s dtype and device); ``fp32``
    returns ``x`` itself. Raises ValueError for an unknown ``wire_dtype``."""
    if wire_dtype == "fp32" and x.dtype == torch.float32:
        return x
    data, scales = to_wire(x, wire_dtype)
    return from_wire(data, scales).to(x.dtype)


class WireRoundTrip(torch.autograd.Function):
    """Identity up to the wire format: the activation forward, its gradient backward (both ``[..., d]``,
    in ``x``'s dtype)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, wire_dtype: str) -> torch.Tensor:  # pylint: disable=arguments-differ
        ctx.wire_dtype = wire_dtype
        y = wire_round_trip(x, wire_dtype)
        return y.clone() if y is x else y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # pylint: disable=arguments-differ
        return wire_round_trip(grad, ctx.wire_dtype), None


def through_wire(x: torch.Tensor, wire_dtype: str) -> torch.Tensor:
    """``x`` after a stage boundary in ``wire_dtype``, differentiable (the gradient crosses the same
    wire); ``fp32`` on a float32 ``x`` returns ``x`` itself. Raises ValueError for an unknown ``wire_dtype``."""
    if wire_dtype not in WIRE_TORCH_DTYPES:
        raise ValueError(f"unknown wire dtype {wire_dtype!r}; one of {sorted(WIRE_TORCH_DTYPES)}")
    if wire_dtype == "fp32" and x.dtype == torch.float32:
        return x
    return WireRoundTrip.apply(x, wire_dtype)


class WireBoundary:
    """The boundary function a :class:`~iota_subnet.model.StagedModel` applies between its stages:
    :func:`through_wire` in ``wire_dtype`` (a callable object, so a model holding it can be pickled).
    Raises ValueError for an unknown ``wire_dtype``."""

    def __init__(self, wire_dtype: str):
        if wire_dtype not in WIRE_TORCH_DTYPES:
            raise ValueError(f"unknown wire dtype {wire_dtype!r}; one of {sorted(WIRE_TORCH_DTYPES)}")
        self.wire_dtype = wire_dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return through_wire(x, self.wire_dtype)

    def __repr__(self) -> str:
        return f"WireBoundary({self.wire_dtype!r})"
