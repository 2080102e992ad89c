"""Binary encoding of messages (wire spec 3). Three body forms, told apart by their first bytes
(:func:`is_json_body`):

* a message without tensors: its JSON metadata alone (UTF-8 text);
* a message with tensors whose class says ``SAFETENSORS_BODY`` (hops, state, audits): standard
  safetensors, readable by any safetensors implementation::

      u64 little-endian header length N | N bytes JSON header | tensor data

  the JSON metadata in the header's ``__metadata__`` as ``{"iota": "<JSON>"}``;
* the merge's chunks (``MergePayload``, ``MergeResult``: ``SAFETENSORS_BODY = False``), a compact
  body: the JSON metadata, whose ``"tensors"`` is the tensor table (wire key -> [safetensors dtype
  code, shape, digest]), a newline, then the tensors' raw little-endian bytes in the table's order
  and nothing after (no framing or padding of its own: about 110 bytes less per chunk, the
  merge's ten small messages per peer each way, docs/BENCHMARKS.md "Merge metadata at N replicas").

The JSON metadata holds ``"t"`` (the message class), ``"v"`` (the spec version: a body of spec 1-2,
whose metadata says ``"spec_version"``, is refused with SPEC_VERSION), every other non-tensor field
of the message whose value differs from the class's default (a field left out decodes to its
default) and, when the message carries tensors, ``"tensors"`` (per wire key: the sha256 of its raw
little-endian bytes; its dtype and shape are the safetensors header's, or the compact table's).
Digests (those tensor hashes and the fields declared with :func:`~.messages.digest_field`) travel as
unpadded url-safe base64 of their 32 bytes (43 characters, not 64 of hex); a message holds them as
lowercase hex.

Never pickle: :func:`decode` parses the header itself, checks it against the expected message
type and the :class:`TensorContract` before any tensor is materialised, hashes the raw data
slices, then loads with ``safetensors.torch.load`` (a compact body: a copy of each tensor's bytes) and
checks finiteness.
"""
from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import json
import math
from functools import lru_cache
from typing import Any, Iterator, Optional, TypeVar, get_type_hints

import pydantic
import safetensors.torch
import torch

from iota_subnet.utils.st_dtypes import ST_CODES, ST_DTYPES

from .contract import TensorContract
from .messages import SPEC_VERSION, TENSOR_DICT, Message
from .outcome import Outcome, ProtocolError
from .wire import fp8_nan

M = TypeVar("M", bound=Message)

META_KEY = "iota"
#: Refuse safetensors headers above this size (a StateResponse of a few thousand tensors fits).
MAX_HEADER_BYTES = 8 << 20

_DTYPE_NAMES: dict[torch.dtype, str] = {d: str(d).removeprefix("torch.") for d in ST_DTYPES.values()}
_NAME_DTYPES: dict[str, torch.dtype] = {v: k for k, v in _DTYPE_NAMES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot travel on the wire; use one of {sorted(_NAME_DTYPES)}") from None


#: Bytes copied to host memory at a time when hashing a tensor that lives on an accelerator.
HASH_CHUNK_BYTES = 64 << 20


def host_bytes(t: torch.Tensor, chunk_bytes: int = HASH_CHUNK_BYTES) -> Iterator[memoryview]:
    """The tensor's raw (C-contiguous, little-endian) bytes as host memory views, in order.

    A CPU tensor is viewed in place (no copy when contiguous). A tensor on any other device is
    copied to host ``chunk_bytes`` at a time (never ``.numpy()`` on a device tensor, never a host
    copy of the whole tensor at once). Raises NotImplementedError for ``meta`` tensors (no data).
    """
    t = t.detach()
    if t.numel() == 0:
        return
    flat = (t if t.is_contiguous() else t.contiguous()).reshape(-1).view(torch.uint8)   # [nbytes], same device
    if flat.device.type == "cpu":
        yield memoryview(flat.numpy())
        return
    step = max(1, int(chunk_bytes))
    for off in range(0, flat.numel(), step):
        yield memoryview(flat[off:off + step].to("cpu").numpy())


def tensor_sha256(t: torch.Tensor) -> str:
    """sha256 of the tensor's raw (C-contiguous, little-endian) bytes, as safetensors stores them.

    Works for tensors on any device (see :func:`host_bytes`); equal values give equal digests
    whatever the device."""
    h = hashlib.sha256()
    for view in host_bytes(t):
        h.update(view)
    return h.hexdigest()


def all_finite(t: torch.Tensor) -> bool:
    """Whether a floating tensor holds no NaN or inf (float8 e4m3fn, which has no inf and no
    ``isfinite`` kernel, by its NaN bit pattern: :func:`~.wire.fp8_nan`)."""
    if t.dtype == torch.float8_e4m3fn:
        return not bool(fp8_nan(t).any())
    return bool(torch.isfinite(t).all())


def _wire_tensors(msg: Message) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, f in type(msg).tensor_fields().items():
        value = getattr(msg, name)
        if value is None:
            continue
        if f.metadata["tensor"] == TENSOR_DICT:
            if not isinstance(value, dict):
                raise TypeError(f"{type(msg).__name__}.{name} must be a dict of tensors")
            for k, t in value.items():
                out[f"{name}/{k}"] = t
        else:
            out[name] = value
    seen_storage: set[int] = set()
    for key, t in out.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{key} is a {type(t).__name__}, not a tensor")
        dtype_name(t.dtype)
        t = t.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr() if t.numel() else 0
        if ptr and ptr in seen_storage:  # safetensors refuses tensors sharing memory (tied weights)
            t = t.clone()
        seen_storage.add(ptr)
        out[key] = t
    return out


def payload_nbytes(msg: Message) -> int:
    """Tensor bytes ``msg`` will carry (to decide whether encoding is worth a worker thread)."""
    total = 0
    for name, f in type(msg).tensor_fields().items():
        value = getattr(msg, name)
        if value is None:
            continue
        for t in (value.values() if isinstance(value, dict) else (value,)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def field_default(f: dataclasses.Field) -> Any:
    """The value a JSON field takes when the wire leaves it out (its dataclass default)."""
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def with_defaults(meta: dict[str, Any], cls: type[Message]) -> dict[str, Any]:
    """``meta`` (a message's raw JSON metadata) with every field it leaves out set to ``cls``'s default."""
    return {**{name: field_default(f) for name, f in cls.json_fields().items()}, **meta}


def b64_digest(hexstr: str) -> str:
    """A sha256 digest in lowercase hex -> unpadded url-safe base64 of its 32 bytes (``""`` stays
    ``""``). Raises ValueError for anything else (the wire must give it back unchanged)."""
    raw = bytes.fromhex(hexstr) if isinstance(hexstr, str) else None
    if raw is None or raw.hex() != hexstr or len(raw) not in (0, 32):
        raise ValueError(f"{hexstr!r} is not a lowercase hex sha256 digest")
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def hex_digest(text: Any, where: str) -> str:
    """:func:`b64_digest` undone; raises ProtocolError(MALFORMED) unless ``text`` is the canonical
    base64 of 32 bytes (or ``""``)."""
    try:
        if not isinstance(text, str):
            raise ValueError
        out = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)).hex()
        if b64_digest(out) != text:
            raise ValueError
    except (ValueError, binascii.Error):
        raise ProtocolError(Outcome.MALFORMED, f"{where} is not a base64 digest") from None
    return out


def encode(msg: Message) -> bytes:
    """Serialize ``msg`` in the body form its class takes (module docstring): fields equal to their
    default left out, ``"t"`` and ``"v"`` always sent. Raises ValueError (a dtype or digest that
    cannot travel), TypeError (not a message, a tensor field holding something else)."""
    if not isinstance(msg, Message):
        raise TypeError(f"encode() takes a Message, got {type(msg).__name__}")
    tensors = _wire_tensors(msg)
    meta: dict[str, Any] = {"t": msg.TYPE, "v": msg.spec_version}
    for name, f in type(msg).json_fields().items():
        value, default = getattr(msg, name), field_default(f)
        if name != "spec_version" and (type(value) is not type(default) or value != default):
            if f.metadata.get("digest"):
                value = [b64_digest(v) for v in value] if isinstance(value, list) else b64_digest(value)
            meta[name] = value
    if not tensors:
        return json.dumps(meta, separators=(",", ":")).encode()        # ASCII, no NUL byte: see is_json_body
    hashed = type(msg).HASH_TENSORS
    digests = {key: b64_digest(tensor_sha256(t)) if hashed else "" for key, t in tensors.items()}
    if type(msg).SAFETENSORS_BODY:
        meta["tensors"] = digests
        return safetensors.torch.save(tensors, metadata={META_KEY: json.dumps(meta, separators=(",", ":"))})
    meta["tensors"] = {key: [ST_CODES[t.dtype], list(t.shape), digests[key]] for key, t in tensors.items()}
    return b"".join([json.dumps(meta, separators=(",", ":")).encode(), b"\n",
                     *(v for t in tensors.values() for v in host_bytes(t))])


def _refuse_constant(token: str) -> Any:
    raise ProtocolError(Outcome.NON_FINITE, f"non-finite number {token} in metadata")


@lru_cache(maxsize=None)
def _fields_model(cls: type[Message]) -> type[pydantic.BaseModel]:
    hints = get_type_hints(cls)
    fields = {name: (hints[name], field_default(f)) for name, f in cls.json_fields().items()}
    return pydantic.create_model(f"{cls.__name__}Fields",
                                 __config__=pydantic.ConfigDict(extra="forbid", strict=True), **fields)


def _check_floats(value: Any, where: str) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ProtocolError(Outcome.NON_FINITE, f"{where} is {value}")
    if isinstance(value, dict):
        for k, v in value.items():
            _check_floats(v, f"{where}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_floats(v, f"{where}[{i}]")


def read_header(body: bytes | bytearray | memoryview) -> tuple[dict[str, Any], int]:
    """Parse the safetensors JSON header; returns (header, data_start). Raises MALFORMED."""
    if len(body) < 8:
        raise ProtocolError(Outcome.MALFORMED, f"body of {len(body)} bytes is not a safetensors payload")
    n = int.from_bytes(bytes(body[:8]), "little")
    if n > MAX_HEADER_BYTES or n > len(body) - 8 or n < 2:
        raise ProtocolError(Outcome.MALFORMED, "not a safetensors payload (bad header length)")
    try:
        header = json.loads(bytes(body[8:8 + n]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise ProtocolError(Outcome.MALFORMED, "safetensors header is not JSON") from None
    if not isinstance(header, dict):
        raise ProtocolError(Outcome.MALFORMED, "safetensors header is not an object")
    return header, 8 + n


def is_json_body(body: bytes | bytearray | memoryview) -> bool:
    """Whether ``body`` is a message without tensors (spec 3: its JSON metadata alone, UTF-8 text),
    not a safetensors payload. Unambiguous: a safetensors body starts with its header length as a
    u64 little-endian below :data:`MAX_HEADER_BYTES` (2^23), so its bytes 3..7 are zero, and JSON
    text holds no NUL byte."""
    return len(body) >= 2 and bytes(body[:1]) == b"{" and (len(body) < 8 or any(bytes(body[3:8])))


def _compact_header(meta: Any, data_len: int) -> dict[str, Any]:
    """The tensor table of a compact body (``meta["tensors"]``: wire key -> [safetensors dtype code,
    shape, base64 sha256], data in that order, nothing after) as a safetensors header; leaves the
    digests alone in ``meta["tensors"]``. Raises MALFORMED."""
    table = meta.get("tensors") if isinstance(meta, dict) else None
    if not isinstance(table, dict):
        raise ProtocolError(Outcome.MALFORMED, "compact body without a tensor table")
    header: dict[str, Any] = {}
    start = 0
    for key, entry in table.items():
        dtype = ST_DTYPES.get(entry[0]) if isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str) else None
        shape = entry[1] if dtype is not None else None
        if not isinstance(shape, list) or not all(type(x) is int and x >= 0 for x in shape):
            raise ProtocolError(Outcome.MALFORMED, f"tensor {key!r}: bad entry in the tensor table")
        end = start + math.prod(shape) * torch.tensor([], dtype=dtype).element_size()
        header[key] = {"dtype": entry[0], "shape": shape, "data_offsets": [start, end]}
        start = end
    if start != data_len:
        raise ProtocolError(Outcome.MALFORMED, f"{data_len} bytes of tensor data for a table of {start}")
    meta["tensors"] = {key: entry[2] for key, entry in table.items()}
    return header


def _load_compact(data: memoryview, layout: dict[str, tuple[torch.dtype, tuple[int, ...], int, int, str]]
                  ) -> dict[str, torch.Tensor]:
    """A compact body's tensors (copies of ``data[start:end]``, C-contiguous, little-endian)."""
    out: dict[str, torch.Tensor] = {}
    for key, (dtype, shape, start, end, _) in layout.items():
        out[key] = (torch.frombuffer(bytearray(data[start:end]), dtype=dtype).reshape(shape) if end > start
                    else torch.empty(shape, dtype=dtype))
    return out


def read_meta(body: bytes | bytearray | memoryview) -> tuple[Any, Optional[dict[str, Any]], int]:
    """A body's raw iota metadata (JSON-decoded, non-finite constants refused, not validated), its
    tensors' safetensors header without ``__metadata__`` (``{}`` for a JSON body; None for a compact
    body, whose tensor table is ``meta["tensors"]``: :func:`_compact_header`) and where its tensor
    data starts. Raises ProtocolError: MALFORMED (not a message body), NON_FINITE."""
    compact = is_json_body(body)
    if compact:
        view = memoryview(body)
        nl = bytes(view[:MAX_HEADER_BYTES]).find(b"\n")      # JSON text holds no raw newline
        text, header, data_start = bytes(view[:nl]) if nl >= 0 else bytes(view), {}, (nl + 1 if nl >= 0 else len(body))
    else:
        header, data_start = read_header(body)
        st_meta = header.pop("__metadata__", None)
        if not isinstance(st_meta, dict) or not isinstance(st_meta.get(META_KEY), str):
            raise ProtocolError(Outcome.MALFORMED, "safetensors payload without iota metadata")
        text = st_meta[META_KEY]
    try:
        meta = json.loads(text, parse_constant=_refuse_constant)
    except ProtocolError:
        raise
    except ValueError:                  # UnicodeDecodeError included
        raise ProtocolError(Outcome.MALFORMED, "iota metadata is not JSON") from None
    return meta, (None if compact and nl >= 0 else header), data_start


def decode(body: bytes | bytearray | memoryview, expected: type[M], contract: Optional[TensorContract] = None,
           *, max_body_bytes: Optional[int] = None) -> M:
    """Parse and validate ``body`` as an ``expected`` message; raises :class:`ProtocolError`.

    Checks, in order: body size, safetensors framing, spec version, message type, header vs
    metadata consistency (dtype, shape, byte ranges), message tensor fields, the contract (names,
    dtypes, shapes), content hashes, finiteness (tensors and JSON numbers), JSON field types.
    """
    if max_body_bytes is not None and len(body) > max_body_bytes:
        raise ProtocolError(Outcome.BODY_TOO_LARGE, f"body of {len(body)} bytes > limit {max_body_bytes}")
    meta, header, data_start = read_meta(body)
    if not isinstance(meta, dict):
        raise ProtocolError(Outcome.MALFORMED, "iota metadata is not an object")
    # spec 3 names them "v" and "t"; a spec 1-2 body "spec_version" and "type" (refused by version)
    version = meta.pop("v") if "v" in meta else meta.get("spec_version")
    if type(version) is not int or version != SPEC_VERSION:
        raise ProtocolError(Outcome.SPEC_VERSION, f"spec_version {version!r}, this node speaks {SPEC_VERSION}")
    if meta.get("t") != expected.TYPE:
        raise ProtocolError(Outcome.MALFORMED, f"expected a {expected.TYPE}, got {meta.get('t')!r}")
    meta.pop("t")
    if "spec_version" in meta or "type" in meta:
        raise ProtocolError(Outcome.MALFORMED, "spec 3 metadata names its version and type \"v\" and \"t\" alone")
    compact = header is None
    if compact:
        header = _compact_header(meta, len(body) - data_start)
    tmeta = meta.pop("tensors", None if is_json_body(body) else {})
    if tmeta is None:
        tmeta = {}                       # a body without tensors: its JSON alone
    elif not isinstance(tmeta, dict) or set(tmeta) != set(header):
        raise ProtocolError(Outcome.MALFORMED, "tensor list in metadata does not match the payload")

    # Header entries: dtype, shape, byte ranges, agreement with the metadata.
    data_len = len(body) - data_start
    layout: dict[str, tuple[torch.dtype, tuple[int, ...], int, int, str]] = {}
    for key, entry in header.items():
        tm = tmeta[key]
        try:
            st_dtype, shape, (start, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            digest = "" if tm == "" else hex_digest(tm, f"tensor {key!r}'s sha256")
        except (KeyError, TypeError, ValueError):
            raise ProtocolError(Outcome.MALFORMED, f"tensor {key!r}: incomplete header entry") from None
        dtype = ST_DTYPES.get(st_dtype) if isinstance(st_dtype, str) else None
        if dtype is None:
            raise ProtocolError(Outcome.BAD_DTYPE, f"tensor {key!r}: unsupported dtype {st_dtype!r}")
        if (not isinstance(shape, list) or not all(type(s) is int and s >= 0 for s in shape)
                or type(start) is not int or type(end) is not int or not 0 <= start <= end <= data_len
                or not isinstance(digest, str)):
            raise ProtocolError(Outcome.MALFORMED, f"tensor {key!r}: bad shape or data offsets")
        numel = math.prod(shape)
        if (end - start) != numel * torch.tensor([], dtype=dtype).element_size():
            raise ProtocolError(Outcome.MALFORMED, f"tensor {key!r}: {end - start} bytes for shape {shape}")
        layout[key] = (dtype, tuple(shape), start, end, digest)

    # Tensor keys must map onto the expected message's tensor fields.
    tfields = expected.tensor_fields()
    present: set[str] = set()
    for key in layout:
        fname = key.split("/", 1)[0] if "/" in key else key
        f = tfields.get(fname)
        if f is None or (f.metadata["tensor"] == TENSOR_DICT) != ("/" in key):
            raise ProtocolError(Outcome.MALFORMED, f"{expected.TYPE} has no tensor {key!r}")
        present.add(fname)
    for fname, f in tfields.items():
        if f.metadata.get("required") and fname not in present:
            raise ProtocolError(Outcome.MALFORMED, f"{expected.TYPE} needs tensor {fname!r}")

    if contract is not None:
        contract.check_header({k: (v[0], v[1]) for k, v in layout.items()})

    view = memoryview(body)
    for key, (_, _, start, end, digest) in layout.items():
        if not expected.HASH_TENSORS and digest == "":
            continue                 # covered by the request signature; the receiver commits itself
        got = hashlib.sha256(view[data_start + start:data_start + end]).hexdigest()
        if got != digest:
            raise ProtocolError(Outcome.HASH_MISMATCH, f"tensor {key!r}: content hash mismatch")

    try:
        loaded = (_load_compact(view[data_start:], layout) if compact
                  else safetensors.torch.load(bytes(body)) if layout or not is_json_body(body) else {})
    except Exception as e:  # safetensors raises its own error types
        raise ProtocolError(Outcome.MALFORMED, f"safetensors: {e}") from None
    if set(loaded) != set(layout):
        raise ProtocolError(Outcome.MALFORMED, "safetensors payload tensors differ from its header")

    for key, t in loaded.items():
        if t.is_floating_point() and (contract is None or contract.wants_finite(key)):
            if not all_finite(t):
                raise ProtocolError(Outcome.NON_FINITE, f"tensor {key!r} holds NaN or inf")
        if contract is not None:
            contract.check_values(key, t)

    _check_floats(meta, "metadata")
    for name, f in expected.json_fields().items():
        if f.metadata.get("digest") and name in meta:
            v = meta[name]
            meta[name] = ([hex_digest(x, f"{name}[{i}]") for i, x in enumerate(v)] if isinstance(v, list)
                          else hex_digest(v, name))
    try:
        fields = _fields_model(expected).model_validate(meta)
    except pydantic.ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise ProtocolError(Outcome.MALFORMED, f"field {where}: {first.get('msg')}") from None

    kwargs: dict[str, Any] = {name: getattr(fields, name) for name in expected.json_fields()}
    for fname, f in tfields.items():
        if f.metadata["tensor"] == TENSOR_DICT:
            prefix = fname + "/"
            # keep the sender's order (safetensors reorders tensors by dtype and size)
            kwargs[fname] = {k[len(prefix):]: loaded[k] for k in tmeta if k.startswith(prefix)}
        elif fname in loaded:
            kwargs[fname] = loaded[fname]
    return expected(**kwargs)
