"""Signed merge claims: what each replica says it contributed and computed, so that validators can
check accusations themselves instead of counting them.

Two statements, each a canonical JSON object signed with the replica's hotkey (sr25519):

* **contribution claim** (by the sender of a slice): ``t="iota-merge-contribution/1", run, stage,
  epoch, attempt, plan_id, shard, offset, numel, quant, sha256, root, by``: ``sha256`` of the
  dequantized float32 slice (what reducers record as ``contribution_sha256``), ``root`` the Merkle
  root of its chunks (:func:`chunk_tree`: rows of :data:`CHUNK_NUMEL` values, the last shorter).
  It travels in ``MergePayload.info["claim"]`` as its signature only (:func:`wire_contribution`;
  a slice streamed in several chunks also carries its bounds and hashes): the reducer rebuilds the
  statement from the payload's coordinates, its sender and, for a slice sent whole, the hashes of the
  values received (:func:`contribution_from_wire`), so it refuses (``FORBIDDEN``) a slice whose claim
  is unsigned, signed by another hotkey, for other coordinates (a replay), or does not match the slice.
* **result claim** (by a reducer): ``t="iota-merge-result/2", run, stage, epoch, attempt, plan_id,
  shard, offset, numel, n, contributions_root, claims_root, mean_sha256, mean_root, chunk_numel, by``
  over the mean it serves. Its size does not grow with the number of replicas: ``n`` contributors,
  ``contributions_root`` (:func:`contributions_root`) binds who contributed, with which weight and
  the sha256 of the values used from each, ``claims_root`` (:func:`claims_root`) binds the
  contributors' signed claims it used. It travels in ``MergeResult.info["claim"]`` as its signature
  and the two roots not in the result (:func:`wire_result`; the gatherer rebuilds the rest from the
  result and the plan, :func:`result_from_wire`, and files the full claim as evidence), with the
  other reducer's signature over the same statement when both signed it (``info["co"]``,
  :func:`co_signature`: one answer carries both results; a replica gathering N shards receives O(N)
  claim bytes, not O(N^2)); the list itself (the records:
  ``contributors``, ``weights``, ``contribution_sha256``, ``contrib_claims``) is kept with the mean
  and served to validators with it (``/audit/merge``), where it must hash to the signed roots: the
  reducer cannot alter a contributor's claim, nor the list, after signing without the mismatch
  landing on its own signature.

:class:`MergeClaims` is the miner side: the merge engine calls it as its ``observer`` (sign outgoing
slices, check incoming ones, sign results), and it keeps, for the last ``keep_epochs`` merge epochs,
the slices this replica contributed and the means it served with their chunk trees. It serves
``/audit/merge`` (:meth:`MergeClaims.open`) from those copies only: never the engine's sessions,
never waiting for a running merge. Answers are bounded (:data:`MAX_AUDIT_CHUNKS` chunks), so any
shard size is fetched in parts (item 8).

Cost: one extra hash pass (sha256 of the chunks) over every slice sent, received and served;
memory: this replica's slices of the kept epochs (the whole stage per epoch and attempt, fp32) plus
the means it served (about 2 / N of the stage per attempt).
"""
from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import threading
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch
from loguru import logger

from iota_subnet.audit.merkle import MerkleTree, leaf_hash
from iota_subnet.protocol import (MERGE_AUDIT_KEEP_EPOCHS, MergeAuditRequest, MergeAuditResponse, MergePayload, MergeResult, Outcome,
                                  ProtocolError, proof_tensor, tensor_sha256)

#: Values per chunk (Merkle row) of a merge slice or mean: 32 KB of float32.
CHUNK_NUMEL = 8192
#: Chunks one ``/audit/merge`` answer may carry (8 MB).
MAX_AUDIT_CHUNKS = 256

CONTRIBUTION = "iota-merge-contribution/1"
RESULT = "iota-merge-result/2"


def n_chunks(numel: int, chunk: int = CHUNK_NUMEL) -> int:
    return max(1, -(-int(numel) // chunk))


def chunk_tree(flat: torch.Tensor, chunk: int = CHUNK_NUMEL) -> MerkleTree:
    """Merkle tree over the chunks of a flat float32 tensor (leaf i: values [i*chunk, (i+1)*chunk))."""
    x = flat.detach().reshape(-1).float().contiguous()
    return MerkleTree([leaf_hash(x[o:o + chunk]) for o in range(0, max(1, x.numel()), chunk)])


def statement(claim: Mapping[str, Any]) -> bytes:
    """The signed bytes of a claim: canonical JSON of every field but ``sig``."""
    body = {k: v for k, v in claim.items() if k != "sig"}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def sign_claim(claim: dict, keypair: Any) -> dict:
    """``claim`` with ``by`` (the signer's ss58) and ``sig`` (hex sr25519 signature) set."""
    claim = dict(claim, by=keypair.ss58_address)
    claim["sig"] = keypair.sign(statement(claim)).hex()
    return claim


def verify_claim(claim: Any, signer: str, kind: str) -> bool:
    """True when ``claim`` is a ``kind`` claim signed by hotkey ``signer``."""
    if not isinstance(claim, Mapping) or claim.get("t") != kind or claim.get("by") != signer:
        return False
    try:
        from bittensor.sp_core import Keypair
        return bool(Keypair(ss58_address=signer).verify(statement(claim), bytes.fromhex(str(claim.get("sig", "")))))
    except Exception:  # noqa: BLE001 - malformed key or signature: not verified
        return False


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def contributions_root(contributors: list[str], weights: list[float], contribution_sha256: list[str]) -> str:
    """sha256 (hex) of the canonical JSON ``[contributors, weights, contribution_sha256]`` (the three
    lists in the plan's participant order; weights as floats)."""
    return _digest([list(contributors), [float(w) for w in weights], list(contribution_sha256)])


def claims_root(contributors: list[str], contrib_claims: Mapping[str, Any]) -> str:
    """sha256 (hex) of the canonical JSON list, per contributor in order, of the sha256 of its signed
    contribution claim (canonical JSON, ``sig`` included; ``""`` where the reducer holds none)."""
    return _digest([_digest(contrib_claims[p]) if isinstance(contrib_claims.get(p), Mapping) else ""
                    for p in contributors])


def records_match(claim: Mapping[str, Any], records: Any) -> bool:
    """True when ``records`` (``contributors``, ``weights``, ``contribution_sha256``, ``contrib_claims``)
    hash to the roots of the signed result ``claim`` (and list ``n`` contributors)."""
    if not isinstance(records, Mapping):
        return False
    parts, weights, hashes = records.get("contributors"), records.get("weights"), records.get("contribution_sha256")
    cc = records.get("contrib_claims")
    if not (isinstance(parts, list) and isinstance(weights, list) and isinstance(hashes, list)
            and isinstance(cc, Mapping) and len(parts) == len(weights) == len(hashes) == claim.get("n")):
        return False
    try:
        return (contributions_root(parts, weights, hashes) == claim.get("contributions_root")
                and claims_root(parts, cc) == claim.get("claims_root"))
    except (TypeError, ValueError):
        return False


def coords(run_id: str, stage: int, epoch: int, attempt: int, plan_id: str, shard: int) -> dict:
    return {"run": run_id, "stage": int(stage), "epoch": int(epoch), "attempt": int(attempt), "plan_id": plan_id,
            "shard": int(shard)}


def _b64(hexstr: str) -> str:
    """Hex digest or signature -> unpadded url-safe base64 (32 bytes: 43 characters, not 64)."""
    return base64.urlsafe_b64encode(bytes.fromhex(hexstr)).rstrip(b"=").decode()


def _unb64(text: Any, nbytes: int) -> str:
    """:func:`_b64` undone (hex); raises ValueError unless ``text`` encodes exactly ``nbytes`` bytes."""
    if not isinstance(text, str) or len(text) != -(-4 * nbytes // 3):
        raise ValueError("bad base64 length")
    raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    if len(raw) != nbytes or _b64(raw.hex()) != text:
        raise ValueError("not canonical base64")
    return raw.hex()


def _int(v: Any) -> int:
    if type(v) is not int:
        raise ValueError("not an integer")
    return v


def wire_contribution(claim: Mapping[str, Any], whole: bool) -> dict:
    """The wire form of a signed contribution claim (``MergePayload.info["claim"]``): its signature
    (base64) and, unless the payload carries the whole slice (``whole``), ``offset``, ``numel``,
    ``sha256`` and ``root`` (base64). The rest is the payload's own coordinates and sender, from which
    the receiver rebuilds the signed statement (:func:`contribution_from_wire`); a whole slice's
    hashes are recomputed from its values, so its signature also binds the values received."""
    w: dict[str, Any] = {"sig": _b64(claim["sig"])}
    if not whole:
        w.update(offset=int(claim["offset"]), numel=int(claim["numel"]), sha256=_b64(claim["sha256"]),
                 root=_b64(claim["root"]))
    return w


def contribution_from_wire(w: Any, msg: MergePayload, sender: str, x: torch.Tensor, chunk: int = CHUNK_NUMEL) -> dict:
    """The full contribution claim (``t``, coordinates, ``offset``, ``numel``, ``sha256``, ``root``,
    ``by``, hex ``sig``: what was signed) of the wire form ``w`` received with ``msg`` (``x``: its
    dequantized values) from ``sender``. Raises ValueError/TypeError when ``w`` is malformed; the
    signature is not checked here (:func:`verify_claim`)."""
    if not isinstance(w, Mapping) or not set(w) <= {"sig", "offset", "numel", "sha256", "root"}:
        raise ValueError("not a contribution claim")
    c: dict[str, Any] = {"t": CONTRIBUTION, **coords(msg.run_id, msg.stage, msg.epoch, msg.attempt, msg.plan_id,
                                                      msg.shard_index)}
    c["offset"] = _int(w["offset"]) if "offset" in w else int(msg.offset)
    c["numel"] = _int(w["numel"]) if "numel" in w else int(x.numel())
    c["sha256"] = _unb64(w["sha256"], 32) if "sha256" in w else tensor_sha256(x.float().contiguous())
    c["root"] = _unb64(w["root"], 32) if "root" in w else chunk_tree(x, chunk).root.hex()
    c["by"], c["sig"] = sender, _unb64(w.get("sig"), 64)
    return c


def wire_result(claim: Mapping[str, Any]) -> dict:
    """The wire form of a signed result claim (``MergeResult.info["claim"]``): ``sig``, ``claims_root``
    and ``mean_root`` (base64). The rest is the result's own fields (coordinates,
    ``contributions_root``, ``mean_sha256``), its reducer (``by``) and the plan the result's plan id
    names (``offset``, ``numel``: the shard's bounds; ``n``: its participants; ``chunk_numel``), from
    which a gatherer rebuilds the statement (:func:`result_from_wire`)."""
    return {"sig": _b64(claim["sig"]), "claims_root": _b64(claim["claims_root"]), "mean_root": _b64(claim["mean_root"])}


def result_from_wire(res: MergeResult, reducer: str, plan: Any) -> Optional[dict]:
    """The full result claim ``reducer`` signed (``t``, coordinates, ``offset``, ``numel``, ``n``,
    ``contributions_root``, ``claims_root``, ``mean_sha256``, ``mean_root``, ``chunk_numel``, ``by``,
    hex ``sig``: what :meth:`MergeClaims.on_result` signs), rebuilt from ``res``, the wire form in
    ``res.info["claim"]`` and ``plan`` (a :class:`~iota_subnet.merge.plan.MergePlan`, the one
    ``res.plan_id`` names), for the evidence a gatherer files (validators verify it:
    :mod:`iota_subnet.validator.merge_audit`). None when ``res`` carries none, a malformed one, or is
    for another plan. The signature is not checked here (:func:`verify_claim`)."""
    w = res.info.get("claim") if isinstance(res.info, Mapping) else None
    if (not isinstance(w, Mapping) or set(w) != {"sig", "claims_root", "mean_root"} or res.plan_id != plan.plan_id
            or not 0 <= res.shard_index < plan.num_shards):
        return None
    off, n = plan.bounds[res.shard_index]
    try:
        return {"t": RESULT, **coords(res.run_id, res.stage, res.epoch, res.attempt, res.plan_id, res.shard_index),
                "offset": int(off), "numel": int(n), "n": len(plan.participants),
                "contributions_root": res.contributions_root, "claims_root": _unb64(w["claims_root"], 32),
                "mean_sha256": res.mean_sha256, "mean_root": _unb64(w["mean_root"], 32),
                "chunk_numel": int(plan.chunk_numel), "by": reducer, "sig": _unb64(w["sig"], 64)}
    except (TypeError, ValueError):
        return None


def co_signature(mine: MergeResult, other: MergeResult, other_reducer: str, plan: Any) -> Optional[str]:
    """The signature (wire form) of ``other_reducer``'s result ``other`` when it states exactly what
    this reducer's ``mine`` states (status ok, coordinates, ``contributions_root``, ``mean_sha256`` and
    every field of the signed claim but ``by``) and verifies; else None. Carried in
    ``mine.info["co"]``, it lets a gatherer take both reducers' signed results from one answer
    (:func:`co_result`) instead of asking each reducer for its own."""
    wm = mine.info.get("claim") if isinstance(mine.info, Mapping) else None
    wo = other.info.get("claim") if isinstance(other.info, Mapping) else None
    if not (isinstance(wm, Mapping) and isinstance(wo, Mapping)) or mine.status != "ok" or other.status != "ok":
        return None
    same = ("run_id", "stage", "epoch", "attempt", "plan_id", "shard_index", "contributions_root", "mean_sha256")
    if any(getattr(mine, k) != getattr(other, k) for k in same) or (
            {k: v for k, v in wm.items() if k != "sig"} != {k: v for k, v in wo.items() if k != "sig"}):
        return None
    full = result_from_wire(other, other_reducer, plan)
    return str(wo["sig"]) if full is not None and verify_claim(full, other_reducer, RESULT) else None


def co_result(res: MergeResult, co_reducer: str, plan: Any) -> Optional[MergeResult]:
    """``co_reducer``'s result as ``res`` (its co-reducer's header) carries it in ``info["co"]``
    (:func:`co_signature`): the same header with the co-reducer's signature, once that verifies over
    the statement rebuilt for ``co_reducer``; None when ``res`` carries none or an invalid one (then
    ask the co-reducer itself)."""
    co = res.info.get("co") if isinstance(res.info, Mapping) else None
    w = res.info.get("claim") if isinstance(res.info, Mapping) else None
    if not isinstance(co, str) or not isinstance(w, Mapping) or res.status != "ok":
        return None
    other = MergeResult(**{**res.__dict__, "info": {"claim": {**w, "sig": co}}, "mean": None, "mean_scales": None})
    full = result_from_wire(other, co_reducer, plan)
    return other if full is not None and verify_claim(full, co_reducer, RESULT) else None


@dataclass
class _Kept:
    flat: torch.Tensor
    spilled: str            # spill file name ("" when in host memory)
    tree: MerkleTree
    claim: dict
    records: Optional[dict] = None     # a mean's: contributors, weights, contribution_sha256, contrib_claims


class MergeClaims:
    """Miner side of merge claims (see the module docstring). ``keypair``: this replica's hotkey
    (``wallet.hotkey``); ``chunk``: values per chunk; ``keep_epochs``: merge epochs kept for audits;
    ``spill``: a :class:`~iota_subnet.utils.spill.SpillDir` the kept slices and means are written to
    (read back through a memory map; None: host memory)."""

    def __init__(self, keypair: Any, run_id: str, stage: int, *, chunk: int = CHUNK_NUMEL, keep_epochs: int = MERGE_AUDIT_KEEP_EPOCHS,
                 int8_block: int = 256, spill: Any = None):
        self.keypair, self.run_id, self.stage = keypair, run_id, int(stage)
        self.me = keypair.ss58_address
        self.chunk, self.keep_epochs, self.int8_block = int(chunk), int(keep_epochs), int(int8_block)
        self._lock = threading.Lock()
        self.contributions: dict[tuple, _Kept] = {}       # (epoch, attempt, plan_id, shard) -> my slice
        self.means: dict[tuple, _Kept] = {}               # (epoch, attempt, plan_id, shard) -> mean I served
        self.received: dict[tuple, dict[str, dict]] = {}  # (epoch, attempt, plan_id, shard) -> sender -> claim
        self.served = 0
        self.spill = spill

    def _keep(self, x: torch.Tensor) -> tuple[torch.Tensor, str]:
        """A kept copy of ``x`` (fp32, flat): on disk with ``spill`` (in memory if writing fails)."""
        flat = x.detach().float().reshape(-1)
        if self.spill is not None:
            try:
                fname, views = self.spill.put({"flat": flat}, tag="merge")
                return views["flat"], fname
            except OSError:
                pass
        return flat.clone(), ""

    # ---- engine observer ------------------------------------------------------------------------
    def on_contributions(self, plan: Any, slices: Mapping[int, torch.Tensor], payloads: list[MergePayload]
                         ) -> dict[int, dict]:
        """Sign this replica's slices of ``plan`` (shard -> dequantized float32 slice), attach the
        claims to the outgoing ``payloads`` (the engine streams chunks and attaches them itself) and
        keep the slices. Returns shard -> signed claim. Runs off the event loop."""
        claims = {}
        for s, x in slices.items():
            off, n = plan.bounds[s]
            tree = chunk_tree(x, self.chunk)
            claim = sign_claim({"t": CONTRIBUTION, **coords(self.run_id, self.stage, plan.epoch, plan.attempt,
                                                            plan.plan_id, s),
                                "offset": int(off), "numel": int(n), "sha256": tensor_sha256(x.float().contiguous()),
                                "root": tree.root.hex()}, self.keypair)
            claims[s] = claim
            key = (plan.epoch, plan.attempt, plan.plan_id, s)
            with self._lock:
                self.contributions[key] = _Kept(*self._keep(x), tree, claim)
                self.received.setdefault(key, {})[self.me] = claim
        for m in payloads:
            m.info = {**m.info, "claim": wire_contribution(claims[m.shard_index],
                                                           whole=m.shard is not None and m.shard.numel() == claims[m.shard_index]["numel"])}
        self._prune(plan.epoch)
        return claims

    def on_contribution_in(self, sender: str, msg: MergePayload, x: torch.Tensor) -> None:
        """Check the claim of an incoming slice (``x``: dequantized; the claim in its wire form,
        :func:`contribution_from_wire`); raises ProtocolError(FORBIDDEN)."""
        w = msg.info.get("claim") if isinstance(msg.info, Mapping) else None
        try:
            c = contribution_from_wire(w, msg, sender, x, self.chunk)
        except (TypeError, ValueError):
            raise ProtocolError(Outcome.FORBIDDEN, "merge slice without a well-formed contribution claim") from None
        if not verify_claim(c, sender, CONTRIBUTION):
            # rebuilt from the slice's own coordinates (and values, when sent whole): a claim for other
            # coordinates or another slice, or signed by another hotkey, fails here
            raise ProtocolError(Outcome.FORBIDDEN, "merge slice without a valid contribution claim signed by its sender "
                                                   "for this slice")
        c_off, c_n = c["offset"], c["numel"]
        if not (c_off <= msg.offset and msg.offset + x.numel() <= c_off + c_n):
            raise ProtocolError(Outcome.FORBIDDEN, "contribution claim does not cover this chunk of the slice")
        # a slice sent whole is checked here; a slice streamed in chunks is bound to its claim by the
        # reducer's digest of the chunks it received (contribution_sha256, checked in on_result)
        if x.numel() == c_n and ("sha256" in w or "root" in w) and (
                c["sha256"] != tensor_sha256(x.float().contiguous()) or c["root"] != chunk_tree(x, self.chunk).root.hex()):
            raise ProtocolError(Outcome.FORBIDDEN, "contribution claim does not match the slice sent")
        with self._lock:
            self.received.setdefault((msg.epoch, msg.attempt, msg.plan_id, msg.shard_index), {})[sender] = c

    def on_result(self, res: MergeResult, served: torch.Tensor, offset: int, chunk_numel: Optional[int] = None, *,
                  contributors: list[str], weights: list[float], contribution_sha256: list[str],
                  base: Optional[list] = None) -> None:
        """Sign a result this replica computed (``served``: the mean it serves; ``chunk_numel``: the
        plan's streaming chunk, part of its plan id; the contributors in the plan's order, their
        weights and the sha256 of the values used from each; ``base``: a repair plan's
        ``[attempt, participants]`` of the layout it keeps, bound by its plan id) and keep the mean
        with its records. Sets ``res.info["claim"]``."""
        key = (res.epoch, res.attempt, res.plan_id, res.shard_index)
        tree = chunk_tree(served, self.chunk)
        with self._lock:
            got = dict(self.received.get(key, {}))
        for p, digest in zip(contributors, contribution_sha256):
            if p in got and got[p].get("sha256") != digest:
                # the chunks this sender streamed are not the slice it signed: its claim is not evidence
                logger.warning(f"merge claims: {p[:10]}'s chunks of shard {res.shard_index} do not match its "
                               f"signed contribution claim")
                got.pop(p)
        used = {p: got[p] for p in contributors if p in got}
        records = {"contributors": list(contributors), "weights": [float(w) for w in weights],
                   "contribution_sha256": list(contribution_sha256), "contrib_claims": used}
        if base is not None:
            records["base"] = [int(base[0]), list(base[1])]
        claim = sign_claim({"t": RESULT, **coords(self.run_id, self.stage, res.epoch, res.attempt, res.plan_id,
                                                  res.shard_index),
                            "offset": int(offset), "numel": int(served.numel()), "n": len(contributors),
                            "contributions_root": contributions_root(contributors, weights, contribution_sha256),
                            "claims_root": claims_root(contributors, used), "mean_sha256": res.mean_sha256,
                            "mean_root": tree.root.hex(),
                            **({"chunk_numel": int(chunk_numel)} if chunk_numel is not None else {})}, self.keypair)
        res.info = {**res.info, "claim": wire_result(claim)}
        with self._lock:
            self.means[key] = _Kept(*self._keep(served), tree, claim, records)

    def _prune(self, epoch: int) -> None:
        with self._lock:
            for d in (self.contributions, self.means, self.received):
                for k in [k for k in d if k[0] <= epoch - self.keep_epochs]:
                    gone = d.pop(k)
                    if isinstance(gone, _Kept) and gone.spilled and self.spill is not None:
                        self.spill.drop(gone.spilled)

    # ---- validators ---------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(k.flat.numel() * 4 for d in (self.contributions, self.means) for k in d.values() if not k.spilled)

    def open(self, msg: MergeAuditRequest) -> MergeAuditResponse:
        """Chunks (with proofs) of a kept slice or mean and its signed claim (``claim["claim"]``; a
        mean's also with its records, see the module docstring). Raises ProtocolError:
        LATE (not kept: another plan, or an epoch out of the window), BAD_SHAPE (chunk indices),
        MALFORMED (``what``)."""
        if msg.what not in ("contribution", "mean"):
            raise ProtocolError(Outcome.MALFORMED, f"what must be 'contribution' or 'mean', not {msg.what!r}")
        key = (msg.epoch, msg.attempt, msg.plan_id, msg.shard_index)
        with self._lock:
            kept = (self.contributions if msg.what == "contribution" else self.means).get(key)
        if kept is None:
            raise ProtocolError(Outcome.LATE, f"no {msg.what} kept for epoch {msg.epoch} attempt {msg.attempt} plan "
                                              f"{msg.plan_id[:12]} shard {msg.shard_index}")
        n = n_chunks(kept.flat.numel(), self.chunk)
        if len(msg.chunks) > MAX_AUDIT_CHUNKS or len(set(msg.chunks)) != len(msg.chunks) or any(
                not 0 <= int(i) < n for i in msg.chunks):
            raise ProtocolError(Outcome.BAD_SHAPE, f"chunks must be distinct indices in 0..{n - 1}, at most "
                                                   f"{MAX_AUDIT_CHUNKS} per request")
        chunks, proofs = {}, {}
        for i in msg.chunks:
            i = int(i)
            chunks[str(i)] = kept.flat[i * self.chunk:(i + 1) * self.chunk].clone()
            proofs[str(i)] = proof_tensor(kept.tree.proof(i))
        claim = {"claim": dict(kept.claim)}
        if msg.what == "mean":          # the records the signed roots bind (O(N): once per audit)
            claim.update(kept.records or {})
        self.served += 1
        return MergeAuditResponse(run_id=self.run_id, stage=self.stage, claim=claim, chunks=chunks, proofs=proofs)


class MergeAuditRoute:
    """``/audit/merge`` handler (``MergeAuditRequest -> MergeAuditResponse``) over :class:`MergeClaims`;
    authorisation (validators with a permit) is the server's authorizer's job."""

    def __init__(self, claims: MergeClaims):
        self.claims = claims

    async def __call__(self, msg: MergeAuditRequest, ctx: Any = None) -> MergeAuditResponse:
        if msg.run_id != self.claims.run_id or msg.stage != self.claims.stage:
            raise ProtocolError(Outcome.FORBIDDEN, f"this replica merges run {self.claims.run_id!r} stage "
                                                   f"{self.claims.stage}, not {msg.run_id!r} stage {msg.stage}")
        return await asyncio.to_thread(self.claims.open, msg)
