"""Wire formats of activations and activation gradients between miners.

A stage computes in fp32 (or under bf16 autocast) and sends ``[B, T, b]`` over the wire as:

* ``fp32``: unchanged, 4 bytes a value;
* ``bf16`` (default): rounded to bfloat16 (round-to-nearest-even), 2 bytes a value; relative
  rounding error at most 2^-8 per value (8 significant bits: the unit roundoff 2^-8);
* ``int8``: per-row (per token) absmax scaling, ``q = round(x / s)`` with ``s = max|x| / 127``,
  1 byte a value plus one float32 scale per token (``scales`` ``[B, T]``); error at most ``s / 2``
  per value (LLM.int8, Dettmers et al. 2022, section 3, vector-wise quantisation);
* ``fp8``: float8 e4m3fn (4 exponent bits, 3 mantissa bits, no infinities, largest finite 448) with
  the same per-row scaling, ``q = fp8(clamp(x / s, +-448))`` with ``s = max|x| / 448``, 1 byte a
  value plus one float32 scale per token; round to nearest even, so the error of a value whose
  ``|x| / s`` is normal (>= 2^-6) is at most 2^-4 of it (relative: 4 significant bits), and ``s * 2^-10`` below that
  (subnormals: those are values under ~3.5e-5 of the row's largest) (Micikevicius et al. 2022,
  "FP8 Formats for Deep Learning", section 3, table 1: E4M3).

``int8`` and ``fp8`` are the *scaled* wire dtypes (:func:`needs_scales`): their data travels with
``scales``, which must be float32 of shape ``data.shape[:-1]``, finite and >= 0 (:func:`check_scales`).
The receiver decodes to fp32. Bytes per token on the wire: ``b * {4, 2, 1, 1}`` (+ 4 for int8 and
fp8; :func:`bytes_per_token`).
"""
from __future__ import annotations

from typing import Optional, Union

import torch

WIRE_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8,
                     "fp8": torch.float8_e4m3fn}
#: the scaled wire dtypes: the magnitude a row's largest value is mapped to (int8: 127; fp8 e4m3fn: 448,
#: its largest finite value)
SCALE_MAX = {"int8": 127.0, "fp8": 448.0}
#: bytes of one token's scale (float32)
SCALE_BYTES = 4
_BYTES = {"fp32": 4, "bf16": 2, "int8": 1, "fp8": 1}
_SCALED_TORCH = {WIRE_TORCH_DTYPES[k] for k in SCALE_MAX}
#: float8 e4m3fn: explicit mantissa bits and the exponent of its smallest normal value (2^-6)
FP8_MANTISSA_BITS, FP8_MIN_EXP = 3, -6


def _known(wire_dtype: str) -> str:
    if wire_dtype not in WIRE_TORCH_DTYPES:
        raise ValueError(f"unknown wire dtype {wire_dtype!r}; one of {sorted(WIRE_TORCH_DTYPES)}")
    return wire_dtype


def bytes_per_value(wire_dtype: str) -> int:
    """Bytes of one value in ``wire_dtype`` (scales not counted). Raises ValueError for an unknown one."""
    return _BYTES[_known(wire_dtype)]


def bytes_per_token(wire_dtype: str, width: int) -> int:
    """Bytes one token's row of ``width`` values takes on the wire: ``width * bytes_per_value`` plus a
    float32 scale for the scaled dtypes."""
    return int(width) * bytes_per_value(wire_dtype) + (SCALE_BYTES if needs_scales(wire_dtype) else 0)


def needs_scales(dtype: Union[str, torch.dtype]) -> bool:
    """Whether a wire dtype (its name, or the torch dtype of a wire tensor) travels with per-row
    scales: ``int8`` and ``fp8``."""
    if isinstance(dtype, str):
        return _known(dtype) in SCALE_MAX
    return dtype in _SCALED_TORCH


def check_scales(data: torch.Tensor, scales: Optional[torch.Tensor]) -> None:
    """Raise ValueError unless ``scales`` fits ``data``: a scaled wire tensor (int8, fp8) ``[..., b]``
    needs float32 ``scales`` ``[...]``, finite and >= 0 (and an fp8 one holds no NaN, its only
    non-finite value); any other carries none."""
    name = str(data.dtype).removeprefix("torch.")
    if not needs_scales(data.dtype):
        if scales is not None:
            raise ValueError(f"{name} wire tensors carry no scales (only int8 and fp8 do)")
        return
    want = tuple(data.shape[:-1])
    if scales is None or tuple(scales.shape) != want:
        got = None if scales is None else tuple(scales.shape)
        raise ValueError(f"{name} wire data {tuple(data.shape)} needs float32 scales of shape {want}, got {got}")
    if scales.dtype != torch.float32:
        raise ValueError(f"{name} wire scales must be float32, got {scales.dtype}")
    if not bool(torch.isfinite(scales).all()) or bool((scales < 0).any()):
        raise ValueError(f"{name} wire scales must be finite and >= 0")
    if data.dtype == torch.float8_e4m3fn and bool(fp8_nan(data).any()):
        raise ValueError("fp8 wire data holds NaN")


def fp8_nan(t: torch.Tensor) -> torch.Tensor:
    """NaN mask of a float8 e4m3fn tensor (bool, same shape): its NaN is the bit pattern S.1111.111 (it
    has no infinities). Bitwise, so it runs on any device."""
    return (t.view(torch.uint8) & 0x7F) == 0x7F


def to_wire(x: torch.Tensor, wire_dtype: str) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``x`` float ``[..., b]`` -> (wire tensor, per-row scales ``[...]`` float32 for int8 / fp8 else
    None). Runs on ``x``'s device; the caller moves the result to the host. Raises ValueError for an
    unknown ``wire_dtype``."""
    _known(wire_dtype)
    x = x.detach()
    if wire_dtype == "fp32":
        return x.float().contiguous(), None
    if wire_dtype == "bf16":
        return x.to(torch.bfloat16).contiguous(), None
    x = x.float()
    top = SCALE_MAX[wire_dtype]
    scales = x.abs().amax(dim=-1).clamp_min(1e-30) / top                  # [...]
    y = x / scales.unsqueeze(-1)
    if wire_dtype == "int8":
        q = torch.round(y).clamp_(-top, top).to(torch.int8)
    else:       # fp8: clamp first (a quotient a rounding above 448 must not become NaN)
        q = y.clamp_(-top, top).to(torch.float8_e4m3fn)
    return q.contiguous(), scales.contiguous()


def from_wire(data: torch.Tensor, scales: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Wire tensor (+ int8 / fp8 scales) -> float32 ``[..., b]``. Raises ValueError when the scales
    do not fit the data (:func:`check_scales`)."""
    check_scales(data, scales)
    if scales is not None:
        return data.float() * scales.unsqueeze(-1)
    return data.float()


def rounding_bound(mag: torch.Tensor, scales: Optional[torch.Tensor], wire_dtype: str) -> torch.Tensor:
    """Half the wire's rounding step (float64, shape of ``mag``) at magnitudes ``mag`` ``[..., b]``
    (e.g. the larger of a sent and a recomputed value) of a scaled wire dtype with per-row ``scales``
    ``[...]``: the largest error of rounding to nearest. ``int8``: ``s / 2``; ``fp8``: ``s`` times half
    an e4m3 ulp at ``mag / s`` (``2^(E - 5)`` for ``mag / s`` in ``[2^(E-1), 2^E)``, at least the
    subnormal ``2^-10``). Raises ValueError for another dtype (float wire dtypes: half an ulp of the
    value itself)."""
    if not needs_scales(wire_dtype):
        raise ValueError(f"{wire_dtype} has no per-row scales")
    s = scales.to(torch.float64).unsqueeze(-1)
    mag = mag.to(torch.float64)
    if wire_dtype == "int8":
        return (s / 2).expand_as(mag)
    _, e = torch.frexp(mag / s.clamp_min(1e-300))
    e = e.clamp_min(FP8_MIN_EXP + 1)
    return s * torch.ldexp(torch.ones_like(mag), e - FP8_MANTISSA_BITS - 2)


def dtype_of(t: torch.Tensor) -> str:
    """The wire dtype name of a wire tensor."""
    for name, dt in WIRE_TORCH_DTYPES.items():
        if t.dtype == dt:
            return name
    raise ValueError(f"{t.dtype} is not a wire dtype")
