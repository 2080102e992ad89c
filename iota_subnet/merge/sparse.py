"""Compressed merge payloads: top-k with low-bit values and error feedback (SparseLoCo).

SparseLoCo (arXiv 2508.15706): each replica keeps an error-feedback accumulator ``e`` (float32 [P]);
at a merge ``acc = beta * e + delta`` (``delta`` the pseudo-gradient ``anchor - weights``), every block
of ``chunk`` values sends only its ``k`` largest magnitudes, each as a ``bits``-bit code, and keeps the
rest, ``e = acc - sent``, for later merges. The mean of the replicas' sparse contributions is the
outer update. Two wire encodings (``merge.quantization: topk``):

* **scatter**, mode ``topk-<k>-<chunk>-<bits>`` (:func:`topk_mode`): per block of ``chunk`` values,
  the ``k`` positions (ascending, ``ceil(log2 chunk)`` bits each: 12 for 4096) and codes (sign bit + ``bits - 1`` magnitude bits,
  ``|v| = lo + (m + 0.5) x step`` with ``lo``, ``step`` float32 per block, ``step = (hi - lo) / 2^(bits-1)``
  over the block's selected magnitudes ``[lo, hi]``);
* **gather**, mode ``sparse-<chunk>`` (:func:`sparse_mode`): the reduced mean (up to N x k nonzeros
  per block) rounded to int8 with one float32 scale ``absmax / 127`` per block, sent as counts per
  block (int16) + positions (bit-packed as above) + int8 values or as dense int8, whichever is smaller; both layouts decode to the same values, so the
  layout never changes what is applied.

Wire form of one message chunk of ``n`` values: ``(q, scales)``, ``q`` int8 bytes = an 8-byte header
(layout letter ``T`` / ``S`` / ``D``, bits, k as uint16, n as uint32; little-endian) and the body
(bit streams little-endian, padded to a byte),
``scales`` float32 (``[2 x nb]`` for ``topk``, ``[nb]`` for ``sparse``; ``nb = ceil(n / chunk)``).
Decoding checks every size, range and order (positions strictly ascending), so equal bytes decode
to equal float32 values on every replica. Sources: SparseLoCo (2-bit values, blocks of 4096, k = 32
to 128, error-feedback decay 0.95); error feedback for compressed SGD, arXiv 1901.09847.
"""
from __future__ import annotations

import math
from typing import Iterable, Optional

import torch

HEADER = 8
#: Largest ``n`` a decoder accepts in one message chunk (float32 values; 256 MiB).
MAX_NUMEL = 1 << 26
TOPK_BITS = (2, 4, 8)


def topk_mode(k: int, chunk: int, bits: int) -> str:
    """The scatter's wire mode name (what travels in ``MergePayload.quant``)."""
    return f"topk-{int(k)}-{int(chunk)}-{int(bits)}"


def sparse_mode(chunk: int) -> str:
    """The gather's wire mode name for the mean of sparse contributions."""
    return f"sparse-{int(chunk)}"


def is_sparse(mode: str) -> bool:
    return isinstance(mode, str) and (mode.startswith("topk-") or mode.startswith("sparse-"))


def parse(mode: str) -> tuple[str, int, int, int]:
    """``(kind, k, chunk, bits)``; ``kind`` is ``topk`` or ``sparse`` (then k = 0, bits = 8). Raises ValueError."""
    try:
        kind, *nums = mode.split("-")
        vals = [int(v) for v in nums]
        if kind == "topk" and len(vals) == 3:
            k, chunk, bits = vals
        elif kind == "sparse" and len(vals) == 1:
            k, chunk, bits = 0, vals[0], 8
        else:
            raise ValueError
    except (ValueError, AttributeError):
        raise ValueError(f"unknown quantization {mode!r}") from None
    if not (1 <= chunk <= 32767) or (kind == "topk" and not (1 <= k <= chunk and bits in TOPK_BITS)):
        raise ValueError(f"bad sparse mode {mode!r}: chunk in [1, 32767], k in [1, chunk], bits in {TOPK_BITS}")
    return kind, k, chunk, bits


def _blocks(x: torch.Tensor, chunk: int) -> torch.Tensor:
    n = x.numel()
    nb = math.ceil(n / chunk)
    return torch.nn.functional.pad(x, (0, nb * chunk - n)).view(nb, chunk)


def _header(kind: str, bits: int, k: int, n: int) -> torch.Tensor:
    h = bytes([ord(kind), bits]) + int(k).to_bytes(2, "little") + int(n).to_bytes(4, "little")
    return torch.frombuffer(bytearray(h), dtype=torch.uint8)


def pos_bits(chunk: int) -> int:
    """Bits of a position inside a block of ``chunk`` values (12 for 4096)."""
    return max(1, (int(chunk) - 1).bit_length())


def _pack(vals: torch.Tensor, bits: int) -> torch.Tensor:
    """Integers [M] in ``[0, 2^bits)`` -> uint8 [ceil(M x bits / 8)]: a little-endian bit stream."""
    shifts = torch.arange(bits, dtype=torch.int64)
    stream = ((vals.to(torch.int64).reshape(-1, 1) >> shifts) & 1).reshape(-1)
    stream = torch.nn.functional.pad(stream, (0, (-stream.numel()) % 8)).view(-1, 8)
    return (stream << torch.arange(8, dtype=torch.int64)).sum(dim=1).to(torch.uint8)


def _unpack(packed: torch.Tensor, bits: int, m: int) -> torch.Tensor:
    """Inverse of :func:`_pack`: int64 [m]."""
    stream = ((packed.to(torch.int64).unsqueeze(1) >> torch.arange(8, dtype=torch.int64)) & 1).reshape(-1)
    return (stream[:m * bits].view(m, bits) << torch.arange(bits, dtype=torch.int64)).sum(dim=1)


def _packed_len(m: int, bits: int) -> int:
    return math.ceil(m * bits / 8)


def encode(x: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode float32 [n] in a ``topk-*`` or ``sparse-*`` mode: ``(q int8 bytes, scales float32)``."""
    kind, k, chunk, bits = parse(mode)
    x = x.detach().float().reshape(-1)
    n = x.numel()
    if n > MAX_NUMEL:
        raise ValueError(f"{n} values in one chunk > {MAX_NUMEL}")
    xp = _blocks(x, chunk)                                               # [nb, chunk]
    if kind == "topk":
        kk = min(k, chunk)
        idx = xp.abs().topk(kk, dim=1, sorted=False).indices.sort(dim=1).values     # [nb, kk]
        v = xp.gather(1, idx)
        mag = v.abs()
        lo = mag.amin(dim=1) if kk else torch.zeros(len(xp))
        hi = mag.amax(dim=1) if kk else torch.zeros(len(xp))
        levels = 1 << (bits - 1)
        step = (hi - lo) / levels
        m = torch.floor((mag - lo.unsqueeze(1)) / step.clamp_min(1e-30).unsqueeze(1)).clamp_(0, levels - 1)
        codes = ((v < 0).to(torch.int32) << (bits - 1)) | m.to(torch.int32)
        body = [_pack(idx.reshape(-1), pos_bits(chunk)), _pack(codes.reshape(-1), bits)]
        q = torch.cat([_header("T", bits, k, n)] + body)
        scales = torch.stack([lo, step], dim=1).reshape(-1).float()
        return q.view(torch.int8).contiguous(), scales.contiguous()
    scales = xp.abs().amax(dim=1) / 127.0
    qi = torch.round(xp / scales.clamp_min(1e-30).unsqueeze(1)).clamp_(-127, 127).to(torch.int8)   # [nb, chunk]
    nz = qi != 0
    nnz = int(nz.sum())
    if 2 * len(qi) + _packed_len(nnz, pos_bits(chunk)) + nnz < n:        # sparse layout is smaller
        pos = nz.nonzero()                                                # [nnz, 2] (block, index), ascending
        body = [nz.sum(dim=1).to(torch.int16).view(torch.uint8), _pack(pos[:, 1], pos_bits(chunk)),
                qi[nz].view(torch.uint8)]
        q = torch.cat([_header("S", 8, 0, n)] + body)
    else:
        q = torch.cat([_header("D", 8, 0, n), qi.reshape(-1)[:n].view(torch.uint8)])
    return q.view(torch.int8).contiguous(), scales.float().contiguous()


def decode(q: torch.Tensor, scales: Optional[torch.Tensor], mode: str) -> torch.Tensor:
    """Inverse of :func:`encode` (float32 [n]). Raises ValueError for any inconsistent payload."""
    kind, k, chunk, bits = parse(mode)
    if q.dtype != torch.int8 or q.dim() != 1 or q.numel() < HEADER or scales is None or scales.dtype != torch.float32:
        raise ValueError(f"{kind} payload needs int8 bytes (>= {HEADER}) and float32 scales")
    b = q.view(torch.uint8)
    head = bytes(b[:HEADER].tolist())
    layout, hbits, hk, n = chr(head[0]), head[1], int.from_bytes(head[2:4], "little"), int.from_bytes(head[4:], "little")
    if n > MAX_NUMEL:
        raise ValueError(f"{n} values in one chunk > {MAX_NUMEL}")
    nb = math.ceil(n / chunk)
    if not bool(torch.isfinite(scales).all()) or bool((scales < 0).any()):
        raise ValueError("scales must be finite and >= 0")
    body = b[HEADER:]
    if kind == "topk":
        kk = min(k, chunk)
        m = nb * kk
        lp = _packed_len(m, pos_bits(chunk))
        if (layout, hbits, hk) != ("T", bits, k) or body.numel() != lp + _packed_len(m, bits) or scales.numel() != 2 * nb:
            raise ValueError(f"topk payload does not fit {mode} for {n} values")
        idx = _unpack(body[:lp], pos_bits(chunk), m).view(nb, kk)
        codes = _unpack(body[lp:], bits, m).view(nb, kk)
        _check_positions(idx, torch.arange(nb).unsqueeze(1).expand(nb, kk), chunk)
        lo, step = scales.view(nb, 2).unbind(dim=1)
        mag = lo.unsqueeze(1) + (codes & ((1 << (bits - 1)) - 1)).float().add_(0.5) * step.unsqueeze(1)
        vals = torch.where((codes >> (bits - 1)) == 1, -mag, mag)
        out = torch.zeros(nb, chunk)
        out.scatter_(1, idx, vals)
        return out.reshape(-1)[:n].contiguous()
    if hbits != 8 or hk != 0 or scales.numel() != nb:
        raise ValueError(f"sparse payload does not fit {mode} for {n} values")
    if layout == "D":
        if body.numel() != n:
            raise ValueError(f"dense int8 mean of {body.numel()} bytes for {n} values")
        vals = torch.nn.functional.pad(body.clone().view(torch.int8).float(), (0, nb * chunk - n)).view(nb, chunk)
        return (vals * scales.unsqueeze(1)).reshape(-1)[:n].contiguous()
    if layout != "S" or body.numel() < 2 * nb:
        raise ValueError("sparse mean layout unknown or truncated")
    counts = body[:2 * nb].clone().view(torch.int16).to(torch.int64)
    nnz = int(counts.sum())
    lp = _packed_len(nnz, pos_bits(chunk))
    if bool((counts < 0).any()) or bool((counts > chunk).any()) or body.numel() != 2 * nb + lp + nnz:
        raise ValueError("sparse mean counts do not match its values")
    idx = _unpack(body[2 * nb:2 * nb + lp], pos_bits(chunk), nnz)
    rows = torch.repeat_interleave(torch.arange(nb), counts)
    _check_positions(idx, rows, chunk)
    vals = body[2 * nb + lp:].clone().view(torch.int8).float() * scales[rows]
    out = torch.zeros(nb * chunk)
    out[rows * chunk + idx] = vals
    return out[:n].contiguous()


def _check_positions(idx: torch.Tensor, rows: torch.Tensor, chunk: int) -> None:
    """Positions in ``[0, chunk)`` and strictly ascending over the blocks (no value written twice)."""
    if idx.numel() == 0:
        return
    if bool((idx < 0).any()) or bool((idx >= chunk).any()):
        raise ValueError(f"position outside a block of {chunk}")
    pos = (rows * chunk + idx).reshape(-1)
    if bool((pos[1:] <= pos[:-1]).any()):
        raise ValueError("positions must be strictly ascending")


def rounding_bound(x: torch.Tensor, mode: str, block: int = 0) -> torch.Tensor:
    """Per value, a bound on ``|decode(encode(x)) - x|`` for the ``sparse-*`` gather (float32 [n]):
    half an int8 step of the absmax over groups of ``max(chunk, block)`` values (a coarser group than
    the encoder's block gives a larger bound). ``topk-*`` has no such bound (its residual is fed back)."""
    kind, _, chunk, _ = parse(mode)
    if kind != "sparse":
        raise ValueError(f"no rounding bound for {mode!r}: top-k keeps what it drops in the error feedback")
    x = x.detach().float().reshape(-1)
    g = max(chunk, int(block))
    xp = _blocks(x.abs(), g)
    return (xp.amax(dim=1, keepdim=True) / 254.0).expand_as(xp).reshape(-1)[:x.numel()].contiguous()


def wire_bytes(mode: str, n: int, nnz_per_block: Optional[int] = None) -> int:
    """Bytes (``q`` plus ``scales``) of one message chunk of ``n`` values: exact for ``topk-*``; for
    ``sparse-*`` the smaller layout given ``nnz_per_block`` nonzeros per block (None: dense)."""
    kind, k, chunk, bits = parse(mode)
    nb = math.ceil(n / chunk)
    if kind == "topk":
        m = nb * min(k, chunk)
        return HEADER + _packed_len(m, pos_bits(chunk)) + _packed_len(m, bits) + 8 * nb
    dense = HEADER + n + 4 * nb
    if nnz_per_block is None:
        return dense
    nnz = min(nnz_per_block, chunk) * nb
    return min(dense, HEADER + 2 * nb + _packed_len(nnz, pos_bits(chunk)) + nnz + 4 * nb)


def bytes_per_value(mode: str, nnz_per_block: Optional[int] = None, n: int = 1 << 22) -> float:
    """Wire bytes per value of a message chunk of ``n`` values (see :func:`wire_bytes`)."""
    return wire_bytes(mode, n, nnz_per_block) / n


class ErrorFeedback:
    """A replica's error-feedback accumulator ``e`` (float32 [P], host; None until its first merge,
    i.e. zero). ``beta`` None: feedback off (:meth:`accumulate` returns the pseudo-gradient as is).

    One attempt: ``acc = accumulate(delta)``; after encoding, :meth:`hold` keeps ``acc - sent``;
    :meth:`commit` makes it ``e`` once the merge is applied (a failed attempt changes nothing)."""

    def __init__(self, beta: Optional[float]):
        self.beta = beta
        self.state: Optional[torch.Tensor] = None
        self._pending: Optional[torch.Tensor] = None

    @property
    def on(self) -> bool:
        return self.beta is not None

    def accumulate(self, delta: torch.Tensor) -> torch.Tensor:
        """``beta x e + delta`` (float32, a new tensor), or ``delta`` when off or ``e`` is zero."""
        if not self.on or self.state is None:
            return delta
        return self.state.mul(float(self.beta)).add_(delta)

    def hold(self, acc: torch.Tensor, sent: Iterable[tuple[int, torch.Tensor]], applied: bool = True) -> None:
        """Residual ``acc - sent`` (``sent``: (offset, decoded chunk) pairs covering what was sent);
        ``applied`` False (this replica weighs 0 in the mean): nothing it sends is applied, it keeps all."""
        if not self.on:
            return
        res = acc.clone()
        if applied:
            for off, x in sent:
                res[off:off + x.numel()].sub_(x)
        self._pending = res

    def commit(self) -> None:
        if self._pending is not None:
            self.state, self._pending = self._pending, None

    def reset(self) -> None:
        self.state = self._pending = None

    def load(self, state: Optional[torch.Tensor], numel: int) -> None:
        """Adopt a saved accumulator (ignored when absent or of another size: start from zero)."""
        self.reset()
        if self.on and state is not None and state.numel() == numel:
            self.state = state.detach().to("cpu", torch.float32).reshape(-1).clone()
