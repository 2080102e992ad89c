"""Wire protocol: round trips (bit-exact), contracts, and every typed refusal of decode()."""
from __future__ import annotations

import base64
import json
import pickle
import struct

import pytest
import safetensors.torch
import torch

from iota_subnet.protocol import (
    HTTP_STATUS, SPEC_VERSION, Health, Hop, HopAck, MergeAck, MergePayload, MergeResult, Outcome, ProtocolError,
    StateChunk, StateRequest,
    StateResponse, TensorContract, TensorSpec, decode, encode, from_wire, hop_contract, read_header, tensor_sha256, to_wire,
)
from iota_subnet.protocol.wire import bytes_per_token, check_scales, needs_scales, rounding_bound

B, S, D = 2, 16, 8


def _header(**kw):
    base = dict(run_id="run-1", stage=1, microbatch_id="mb-7", inner_step=42, info={"note": "x"})
    base.update(kw)
    return base


def _messages():
    g = torch.Generator().manual_seed(0)
    return [
        Hop(**_header(), ticket={"lane": 0, "route": ["5Fa", "5Fb"]}, path=["5Fa"],
            data=torch.randn(B, S, D, generator=g)),
        Hop(**_header(stage=2), direction="backward", path=["5Fa", "5Fb", "5Fc"],
            data=torch.randn(B, S, D, generator=g).to(torch.bfloat16)),
        Hop(**_header(), data=torch.randint(-127, 128, (B, S, D), generator=g, dtype=torch.int8),
            scales=torch.rand(B, S, generator=g)),
        Hop(**_header(stage=0), direction="abort", path=["5Fa"], reason="tail gone"),
        Hop(**_header(), data=to_wire(torch.randn(B, S, D, generator=g), "fp8")[0], scales=torch.rand(B, S, generator=g)),
        HopAck(**_header(), status="duplicate"),
        MergePayload(**_header(), epoch=3, shard_index=2, num_shards=4, offset=1000, total_numel=4000, weight=0.5,
                     shard=torch.randn(1000, generator=g)),
        StateRequest(**_header(), names=["layers.0.w", "norm"], epoch=5),
        StateRequest(**_header()),
        StateResponse(**_header(), tensors={"layers.0.attn.wq": torch.randn(D, D, generator=g),
                                            "norm/weight": torch.ones(D, dtype=torch.bfloat16),
                                            "step": torch.tensor(7)},
                      state_meta={"epoch": 5, "weights_version": "abc", "lr": 3e-3}),
        Health(**_header(), status="ok", ready=False, busy=True, hotkey="5Fxyz", uptime_s=12.5, stats={"q": 3.0}),
    ]


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return a == b and type(a) is type(b)


@pytest.mark.parametrize("msg", _messages(), ids=lambda m: type(m).__name__)
def test_round_trip_bit_exact(msg):
    body = encode(msg)
    out = decode(body, type(msg))
    assert type(out) is type(msg)
    for name in msg.__dataclass_fields__:
        assert _same(getattr(msg, name), getattr(out, name)), name
    assert out.spec_version == SPEC_VERSION


def test_body_is_plain_safetensors_with_json_metadata():
    msg = StateChunk(**_header(), data=torch.randn(B * S * D))
    body = encode(msg)
    header, _ = read_header(body)
    meta = json.loads(header["__metadata__"]["iota"])
    assert meta["t"] == "StateChunk" and meta["v"] == SPEC_VERSION
    assert meta["run_id"] == "run-1" and meta["microbatch_id"] == "mb-7" and meta["inner_step"] == 42
    # the tensor's digest (base64 of its 32 bytes); dtype and shape are the safetensors header's
    assert base64.urlsafe_b64decode(meta["tensors"]["data"] + "=").hex() == tensor_sha256(msg.data)
    assert header["data"]["dtype"] == "F32" and header["data"]["shape"] == [B * S * D]
    # fields equal to their default are left out, and decode to it
    assert "offset" not in meta and "snapshot_id" not in meta
    assert torch.equal(safetensors.torch.load(body)["data"], msg.data)


def test_merge_chunks_travel_compact_and_tensorless_messages_as_json():
    """Spec 3: a MergePayload is its JSON metadata with a tensor table, a newline, the raw bytes; a
    message without tensors its JSON alone (docs/BENCHMARKS.md, "Merge metadata at N replicas")."""
    msg = MergePayload(**_header(), shard=torch.randn(B * S * D), scales=torch.ones(3))
    body = encode(msg)
    text, data = body.split(b"\n", 1)
    meta = json.loads(text)
    assert meta["t"] == "MergePayload" and meta["v"] == SPEC_VERSION and "epoch" not in meta
    assert meta["tensors"]["shard"][:2] == ["F32", [B * S * D]] and meta["tensors"]["scales"][:2] == ["F32", [3]]
    assert base64.urlsafe_b64decode(meta["tensors"]["shard"][2] + "=").hex() == tensor_sha256(msg.shard)
    assert data == msg.shard.numpy().tobytes() + msg.scales.numpy().tobytes()
    out = decode(body, MergePayload)
    assert torch.equal(out.shard, msg.shard) and torch.equal(out.scales, msg.scales)
    assert _refused(body + b"\0", MergePayload) == Outcome.MALFORMED           # bytes past the table
    assert _refused(body[:-1], MergePayload) == Outcome.MALFORMED
    assert _refused(_tamper_data(body), MergePayload) == Outcome.HASH_MISMATCH
    ack = encode(MergeAck(run_id="r"))
    assert json.loads(ack) == {"t": "MergeAck", "v": SPEC_VERSION, "run_id": "r"} and decode(ack, MergeAck).run_id == "r"
    for bad in ([["F32", [2]]], [["X9", [1], ""]], [["F32", [-1], ""]], [["F32", "2", ""]]):
        body = _rewrite_meta(encode(MergePayload(shard=torch.zeros(2))), lambda m: m["tensors"].__setitem__("shard", bad[0]))
        assert _refused(body, MergePayload) == Outcome.MALFORMED, bad


def test_non_contiguous_and_tied_tensors_encode():
    w = torch.randn(D, D)
    msg = StateResponse(tensors={"a": w.t(), "b": w, "c": w})  # transposed view + shared storage
    out = decode(encode(msg), StateResponse)
    assert torch.equal(out.tensors["a"], w.t()) and torch.equal(out.tensors["c"], w)


def _contract(seq=S, b=D, max_batch=4):
    return TensorContract({"data": TensorSpec(dtypes=(torch.float32, torch.bfloat16), shape=(-1, seq, b),
                                              max_shape=(max_batch, -1, -1)),
                           "scales": TensorSpec(dtypes=(torch.float32,), shape=(-1, seq), required=False)})


def _refused(body, typ, contract=None, **kw) -> Outcome:
    with pytest.raises(ProtocolError) as ei:
        decode(body, typ, contract, **kw)
    assert ei.value.status == HTTP_STATUS[ei.value.outcome]
    return ei.value.outcome


def test_contract_accepts_valid_and_wildcards():
    for batch in (1, 4):
        decode(encode(Hop(data=torch.randn(batch, S, D))), Hop, _contract())


@pytest.mark.parametrize("act,outcome", [
    (torch.randn(B, S + 1, D), Outcome.BAD_SHAPE),        # wrong seq
    (torch.randn(B, S, D + 1), Outcome.BAD_SHAPE),        # wrong width
    (torch.randn(B, S), Outcome.BAD_SHAPE),               # wrong rank
    (torch.randn(5, S, D), Outcome.BAD_SHAPE),            # batch above the bound
    (torch.randn(B, S, D).double(), Outcome.BAD_DTYPE),
    (torch.randn(B, S, D).half(), Outcome.BAD_DTYPE),     # not in the allowed list
    (torch.randint(0, 5, (B, S, D)), Outcome.BAD_DTYPE),
])
def test_contract_refusals(act, outcome):
    assert _refused(encode(Hop(data=act)), Hop, _contract()) == outcome


def test_contract_unexpected_and_missing_tensors():
    c = TensorContract({"data": TensorSpec(shape=(-1, S, D))})
    body = encode(Hop(data=torch.randn(B, S, D), scales=torch.ones(B, S)))
    assert _refused(body, Hop, c) == Outcome.MALFORMED          # scales not in the contract
    c2 = TensorContract({"data": TensorSpec(shape=(-1, S, D)), "scales": TensorSpec(dtypes=(torch.float32,))})
    body = encode(Hop(data=torch.randn(B, S, D)))
    assert _refused(body, Hop, c2) == Outcome.MALFORMED         # required scales missing
    # a message type's required tensor, without a contract
    assert _refused(encode(MergePayload()), MergePayload) == Outcome.MALFORMED


def test_glob_contract_for_state_dicts():
    c = TensorContract({"tensors/*": TensorSpec(dtypes=(torch.float32,), max_numel=100)})
    decode(encode(StateResponse(tensors={"a.w": torch.randn(10, 10)})), StateResponse, c)
    assert _refused(encode(StateResponse(tensors={"a.w": torch.randn(11, 10)})), StateResponse, c) == Outcome.BAD_SHAPE


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_refused(bad):
    x = torch.randn(B, S, D)
    x[1, 3, 2] = bad
    assert _refused(encode(Hop(data=x)), Hop, _contract()) == Outcome.NON_FINITE
    assert _refused(encode(Hop(data=x.bfloat16())), Hop) == Outcome.NON_FINITE
    assert _refused(encode(MergePayload(shard=torch.zeros(4), weight=bad)), MergePayload) == Outcome.NON_FINITE
    assert _refused(encode(Health(stats={"a": bad})), Health) == Outcome.NON_FINITE


def test_finite_check_can_be_waived_per_tensor():
    x = torch.full((3,), float("inf"))
    c = TensorContract({"shard": TensorSpec(finite=False)})
    assert torch.isinf(decode(encode(MergePayload(shard=x)), MergePayload, c).shard).all()


def _tamper_data(body: bytes) -> bytes:
    b = bytearray(body)
    b[-1] ^= 0x01
    return bytes(b)


def test_hash_mismatch():
    body = encode(MergePayload(shard=torch.randn(B * S * D)))
    assert _refused(_tamper_data(body), MergePayload) == Outcome.HASH_MISMATCH


def _rewrite_meta(body: bytes, fn) -> bytes:
    if body[:1] == b"{":                                 # spec 3 JSON or compact body
        text, sep, data = body.partition(b"\n")
        meta = json.loads(text)
        fn(meta)
        return json.dumps(meta).encode() + sep + data
    header, start = read_header(body)
    meta = json.loads(header["__metadata__"]["iota"])
    fn(meta)
    header["__metadata__"]["iota"] = json.dumps(meta)
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + body[start:]


def test_spec_version_refused():
    assert _refused(encode(Health(spec_version=SPEC_VERSION + 1)), Health) == Outcome.SPEC_VERSION
    body = _rewrite_meta(encode(Health()), lambda m: m.pop("v"))
    assert _refused(body, Health) == Outcome.SPEC_VERSION
    body = _rewrite_meta(encode(Health()), lambda m: m.__setitem__("v", "1"))
    assert _refused(body, Health) == Outcome.SPEC_VERSION
    # a spec 2 peer: safetensors body, "type" and "spec_version": refused by version, clearly
    old = safetensors.torch.save({}, metadata={"iota": json.dumps({"type": "Health", "spec_version": 2})})
    with pytest.raises(ProtocolError, match="spec_version 2, this node speaks 3"):
        decode(old, Health)
    body = _rewrite_meta(encode(Health()), lambda m: m.__setitem__("spec_version", 5))   # a second version
    assert _refused(body, Health) == Outcome.MALFORMED


def test_wrong_type_and_bad_fields_malformed():
    assert _refused(encode(Health()), Hop) == Outcome.MALFORMED                     # another message type
    body = _rewrite_meta(encode(Health()), lambda m: m.__setitem__("stage", "zero"))
    assert _refused(body, Health) == Outcome.MALFORMED
    body = _rewrite_meta(encode(Health()), lambda m: m.__setitem__("evil", 1))
    assert _refused(body, Health) == Outcome.MALFORMED
    # metadata naming a tensor the payload does not hold, or a malformed digest
    body = _rewrite_meta(encode(Hop(data=torch.randn(B, S, D))), lambda m: m["tensors"].__setitem__("scales", ""))
    assert _refused(body, Hop) == Outcome.MALFORMED
    body = _rewrite_meta(encode(MergePayload(shard=torch.randn(8))), lambda m: m["tensors"].__setitem__("shard", "zz"))
    assert _refused(body, MergePayload) == Outcome.MALFORMED


def test_digest_fields_travel_as_base64_and_round_trip():
    h = tensor_sha256(torch.arange(4.0))
    msg = MergeResult(contributions_root=h, mean_sha256=h, chunk_sha256=[h, h])
    meta = json.loads(encode(msg))
    assert len(meta["mean_sha256"]) == 43 and len(meta["chunk_sha256"][1]) == 43
    out = decode(encode(msg), MergeResult)
    assert (out.contributions_root, out.mean_sha256, out.chunk_sha256) == (h, h, [h, h])
    with pytest.raises(ValueError):
        encode(MergeResult(mean_sha256="ABCD"))                 # not a lowercase hex digest: cannot travel
    for bad in ("x" * 43, h, 5):
        body = _rewrite_meta(encode(msg), lambda m: m.__setitem__("mean_sha256", bad))
        assert _refused(body, MergeResult) == Outcome.MALFORMED


@pytest.mark.parametrize("body", [
    b"", b"\x00" * 7, b"garbage" * 100, bytes(range(256)) * 4, struct.pack("<Q", 10) + b"{not json}",
    struct.pack("<Q", 2) + b"[]", safetensors.torch.save({"x": torch.zeros(2)}),   # safetensors without metadata
], ids=["empty", "short", "text", "random", "badjson", "notobject", "nometa"])
def test_malformed(body):
    assert _refused(body, Hop) == Outcome.MALFORMED


def test_random_bytes_malformed():
    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        body = torch.randint(0, 256, (int(torch.randint(0, 4096, (1,), generator=g)),), generator=g,
                             dtype=torch.uint8).numpy().tobytes()
        assert _refused(body, Hop) == Outcome.MALFORMED


def test_pickle_payload_refused():
    class Boom:
        def __reduce__(self):
            return (exec, ("raise SystemExit('pickle was executed')",))

    for obj in ({"data": torch.randn(2, 2)}, Boom()):
        body = pickle.dumps(obj)
        assert _refused(body, Hop) == Outcome.MALFORMED
    import io
    buf = io.BytesIO()
    torch.save({"data": torch.randn(2, 2)}, buf)
    assert _refused(buf.getvalue(), Hop) == Outcome.MALFORMED


def test_body_too_large():
    body = encode(Hop(data=torch.randn(B, S, D)))
    assert _refused(body, Hop, max_body_bytes=len(body) - 1) == Outcome.BODY_TOO_LARGE
    decode(body, Hop, max_body_bytes=len(body))


def test_outcome_statuses():
    assert all(400 <= HTTP_STATUS[o] < 500 for o in Outcome
               if o not in (Outcome.OK, Outcome.BUSY, Outcome.NOT_READY, Outcome.INTERNAL))
    assert HTTP_STATUS[Outcome.BUSY] == HTTP_STATUS[Outcome.NOT_READY] == 503
    assert HTTP_STATUS[Outcome.INTERNAL] == 500 and HTTP_STATUS[Outcome.OK] == 200
    e = ProtocolError(Outcome.LATE, "too late")
    assert e.status == 410 and e.to_json() == {"outcome": "LATE", "message": "too late"}


def test_ready_made_contracts():
    from iota_subnet.protocol import hop_contract, merge_payload_contract

    hc = hop_contract(seq_len=S, width=D, max_batch=4)
    for data, scales in ((torch.randn(B, S, D), None), (torch.randn(B, S, D).bfloat16(), None),
                         (torch.zeros(B, S, D, dtype=torch.int8), torch.ones(B, S)),
                         (torch.zeros(B, S, D, dtype=torch.float8_e4m3fn), torch.ones(B, S)), (None, None)):
        decode(encode(Hop(data=data, scales=scales)), Hop, hc)
    assert _refused(encode(Hop(data=torch.randn(B, S, 2 * D))), Hop, hc) == Outcome.BAD_SHAPE
    assert _refused(encode(Hop(data=torch.randn(5, S, D))), Hop, hc) == Outcome.BAD_SHAPE
    assert _refused(encode(Hop(data=torch.randn(0, S, D))), Hop, hc) == Outcome.BAD_SHAPE
    assert _refused(encode(Hop(data=torch.randn(B, S, D).double())), Hop, hc) == Outcome.BAD_DTYPE
    assert _refused(encode(Hop(data=torch.randint(0, 100, (B, S, D)))), Hop, hc) == Outcome.BAD_DTYPE

    mc = merge_payload_contract(max_numel=1000)
    decode(encode(MergePayload(shard=torch.randn(1000))), MergePayload, mc)
    decode(encode(MergePayload(shard=torch.zeros(1000, dtype=torch.int8), scales=torch.ones(4))), MergePayload, mc)
    assert _refused(encode(MergePayload(shard=torch.randn(1001))), MergePayload, mc) == Outcome.BAD_SHAPE
    assert _refused(encode(MergePayload(shard=torch.randn(10, 10))), MergePayload, mc) == Outcome.BAD_SHAPE


# ---- wire dtypes (iota_subnet.protocol.wire) -----------------------------------------------------------
def _activations(seed: int = 0) -> torch.Tensor:
    """[2, 64, 256] with the spread of real hidden states: channel scales over five decades, a few
    outlier channels ~50x the rest (LLM.int8, Dettmers et al. 2022, section 3), tokens of varied norm."""
    g = torch.Generator().manual_seed(seed)
    ch = torch.logspace(-3, 1, 256)[torch.randperm(256, generator=g)]
    ch[torch.randint(0, 256, (4,), generator=g)] = 50.0
    tok = torch.rand(2, 64, 1, generator=g) * 4 + 0.1
    return torch.randn(2, 64, 256, generator=g) * ch * tok


@pytest.mark.parametrize("wire", ["bf16", "int8", "fp8"])
def test_wire_round_trip_error_bounds(wire):
    x = _activations()
    data, scales = to_wire(x, wire)
    y = from_wire(data, scales)
    assert y.dtype == torch.float32 and y.shape == x.shape and needs_scales(wire) == (scales is not None)
    assert data.numel() * data.element_size() + (0 if scales is None else 4 * scales.numel()) \
        == bytes_per_token(wire, 256) * 2 * 64
    err = (y - x).abs()
    if wire == "bf16":
        assert bool((err <= x.abs() * 2 ** -8).all())
        return
    top = {"int8": 127.0, "fp8": 448.0}[wire]
    assert torch.allclose(scales, x.abs().amax(-1) / top)
    assert bool((err <= rounding_bound(x.abs(), scales, wire) * (1 + 1e-6)).all())
    if wire == "fp8":   # relative 2^-4 on every value whose x / s is normal (>= 2^-6), s 2^-10 below
        normal = x.abs() / scales.unsqueeze(-1) >= 2 ** -6
        assert bool((err[normal] <= x.abs()[normal] * 2 ** -4 * (1 + 1e-6)).all())
        assert bool((err[~normal] <= (scales.unsqueeze(-1) * 2 ** -10).expand_as(x)[~normal] * (1 + 1e-6)).all())
        assert 0.01 < float((y - x).norm() / x.norm()) < 0.05          # ~2^-5.5: 3 mantissa bits
        # a row's largest value maps to 448, the largest finite e4m3fn: no NaN, ever
        assert float(data.float().abs().amax()) == 448.0 and not bool(torch.isnan(y).any())


def test_fp8_hop_round_trips_through_the_codec_bit_exact():
    data, scales = to_wire(_activations(1), "fp8")
    got = decode(encode(Hop(data=data, scales=scales)), Hop, hop_contract(seq_len=64, width=256, max_batch=2))
    assert got.data.dtype == torch.float8_e4m3fn and got.scales.dtype == torch.float32
    assert torch.equal(got.data.view(torch.uint8), data.view(torch.uint8)) and torch.equal(got.scales, scales)
    assert read_header(encode(Hop(data=data)))[0]["data"]["dtype"] == "F8_E4M3"    # safetensors' name
    nan = data.clone()
    nan.view(torch.uint8)[1, 3, 2] = 0xFF          # e4m3fn's NaN (it has no inf)
    assert _refused(encode(Hop(data=nan, scales=scales)), Hop) == Outcome.NON_FINITE


@pytest.mark.parametrize("wire", ["int8", "fp8"])
def test_scaled_wire_tensors_refuse_bad_scales(wire):
    data, scales = to_wire(_activations(2), wire)
    for bad, why in ((None, "needs float32 scales"), (scales[:1], "needs float32 scales"),
                     (scales.reshape(-1), "needs float32 scales"), (scales.double(), "must be float32"),
                     (torch.full_like(scales, float("nan")), "finite"), (torch.full_like(scales, float("inf")), "finite"),
                     (-scales, ">= 0")):
        with pytest.raises(ValueError, match=why):
            from_wire(data, bad)
    with pytest.raises(ValueError, match="carry no scales"):
        check_scales(data.float(), scales)
    if wire == "fp8":
        nan = data.clone()
        nan.view(torch.uint8)[0, 0, 0] = 0x7F
        with pytest.raises(ValueError, match="NaN"):
            from_wire(nan, scales)
