"""Round 3 of a hop audit: the validator's sample, and the rows of every committed tensor it opens.

The sample is drawn only after the miner answered rounds 1 and 2 (its trace roots, then its
projections), from the validator's own OS-seeded RNG:

* ``rows`` batch rows, and in each ``tokens`` token positions (uniform, without replacement): the
  stage's boundary links (input, output, and for a backward hop the gradient received and sent) and
  every link of ``blocks`` of its transformer blocks, drawn uniformly, are checked on these token
  rows (:mod:`.check`); the attention links (scores, softmax, values and their backward) on the
  heads of ``groups`` of the K kv-head groups, drawn uniformly (the score and dP rows, ``rep x T``
  values per group and token, are the largest single part of a backward audit's bytes);
* per sampled batch row, ``spots`` positions where the committed per-position projections
  (``p:`` tensors) are recomputed from opened activation rows, and ``act_cols`` columns of every
  activation matrix whose projection (``kappa``, ``nu``, ``phi``, ``psi``) is recomputed;
* entries of every weight projection vector (``w_*``: a weight column each, ``o_*``: a weight row
  each), as many as :func:`index_counts` says; for the tail, LM-head rows on which every sampled
  token's logits and the entries of ``lm.o`` are recomputed (the LM head's V-long columns are
  opened only where the token rows do not span the model width, see :func:`index_counts`).

Detection (every checked link is checked exactly on the sampled token rows, see :mod:`.check`): an
inconsistency confined to a fraction f of the token rows of a micro-batch is caught with
probability ``1 - (1 - f)^s`` when the s = rows x tokens sampled rows are drawn from rows holding
it (``rows`` batch rows out of B) and its link is checked: always for a boundary link (a hop whose
sent output is not the recomputed trace's, e.g. every cheat that skips or fakes work and answers the
audit honestly), with probability ``blocks / L`` for a link inside one of the stage's L blocks (a
cheater that forges its trace to hide skipped work must break the chain in some block). Checking
one block of L cuts the opened rows about L-fold (``docs/hop-audit.md``, "Block sampling"); a forged
projection is caught by the spot and column checks with the probabilities stated in
:mod:`.project` and ``docs``.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from .layout import TraceLayout, block_of


@dataclass(frozen=True)
class SamplingParams:
    """How much one audit opens (defaults sized for ``tiny``: see ``scripts/bench_audit.py``).

    ``weight_idx``: entries checked per weight projection vector at least; ``rescue_miss``: the
    chance one audit may miss a forged projection vector that rescues a forged link, which sets
    the number of entries checked where the token rows do not span the vector's space
    (:func:`index_counts`); ``max_idx`` caps it. ``vocab``: LM-head rows checked at least (tail).
    ``scale_rows``: rows of the gradient a backward hop sent (``wire.dx``) opened only for their
    norms, whose median is the reference scale of the ``grad_in`` comparison (see
    :meth:`.check.LinkChecker.wire_close`): ~100 bytes each with its proof. ``blocks``: transformer
    blocks of the stage whose links are checked (uniform, without replacement; all of them when the
    stage has at most that many): each costs about a stage's opened bytes divided by its blocks.

    ``tokens = 1`` rather than 2: a cheat on every token (skipped or faked work, what the
    suite's kinds do) is caught by every audit either way; one on a fraction f of the tokens is
    caught with probability f per audit instead of ~2f, for ~21 % fewer bytes (``tiny``: 1.45 instead
    of 1.85 MB per tempo of the 3 x 2 network). Both the cheater's saving and its expected loss are
    proportional to f, so sampling more tokens changes the constant, not whether partial cheating
    pays: a flagged miner loses its weight for many tempos for compute saved in one
    (``docs/hop-audit.md``, "Detection").

    ``groups = 1``: the attention links are checked on the heads of one kv-head group of K, drawn
    uniformly after round 2 (a forged trace whose chain breaks only inside the attention of some
    heads is caught with probability (their groups) / K per audit; every other link, and every
    boundary link, on every audit). The per-head score, dP and softmax-statistics rows are
    ``H x T`` values per token and block, about 30 % of a ``tiny`` backward audit with every group:
    one of K = 4 cuts a middle backward audit from 212 to 157 kB. Test:
    ``tests/test_audit.py::test_one_sampled_kv_group_catches_a_forgery_in_its_heads_exactly_when_drawn``.
    """

    rows: int = 1
    tokens: int = 1
    spots: int = 4
    act_cols: int = 1
    weight_idx: int = 1
    vocab: int = 4
    scale_rows: int = 16
    blocks: int = 1
    groups: int = 1
    rescue_miss: float = 0.1
    max_idx: int = 256

    def validate(self) -> "SamplingParams":
        for k in ("rows", "tokens", "spots", "act_cols", "weight_idx", "vocab", "scale_rows", "blocks", "groups",
                  "max_idx"):
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"sampling.{k} must be an integer >= 1, got {v!r}")
        if not 0 < self.rescue_miss < 1:
            raise ValueError(f"sampling.rescue_miss must be in (0, 1), got {self.rescue_miss!r}")
        return self


@dataclass
class Sample:
    """One audit's draws. ``tokens``: batch row -> positions; ``spots``: batch row -> positions;
    ``cols``: (vector name, batch row) -> column indices; ``idx``: vector name -> entry indices;
    ``scale_rows``: token rows (b * T + t) of the sent gradient opened for its scale (backward,
    non-head; else empty); ``blocks``: indices (0 .. L-1, inside the stage) of the blocks whose links
    are checked, sorted; ``groups``: the kv-head groups (0 .. K-1) whose attention links are checked,
    sorted."""

    tokens: dict[int, list[int]]
    spots: dict[int, list[int]]
    cols: dict[tuple[str, int], list[int]] = field(default_factory=dict)
    idx: dict[str, list[int]] = field(default_factory=dict)
    scale_rows: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    groups: list[int] = field(default_factory=list)

    def token_rows(self, T: int) -> list[int]:
        return sorted(b * T + t for b, ts in self.tokens.items() for t in ts)

    def to_json(self) -> dict:
        return {"tokens": {str(b): v for b, v in self.tokens.items()},
                "spots": {str(b): v for b, v in self.spots.items()},
                "cols": [[k[0], k[1], v] for k, v in self.cols.items()],
                "idx": self.idx, "scale_rows": self.scale_rows, "blocks": self.blocks,
                "groups": self.groups}


#: D-dim projections per batch row, and the activation column tensor each is checked against.
ACT_PROJ = {"kappa": "k^T", "nu": "v^T", "phi": "q^T", "psi": "dy^T"}


def weight_vectors(layout: TraceLayout) -> dict[str, list[tuple[str, str]]]:
    """For every weight projection vector: the weight entries (``w:<param>`` rows or ``w:<param>^T``
    columns) whose opened row ``i`` recomputes its entry ``i``."""
    m = layout.dims
    out: dict[str, list[tuple[str, str]]] = {}
    for j in range(len(m.layers)):
        p, bp = f"L{j}.", lambda s, j=j: "w:" + layout.block_param(j, s)
        q, k, v = bp("self_attn.q_proj.weight"), bp("self_attn.k_proj.weight"), bp("self_attn.v_proj.weight")
        o, g, u, dn = bp("self_attn.o_proj.weight"), bp("mlp.gate_proj.weight"), bp("mlp.up_proj.weight"), \
            bp("mlp.down_proj.weight")
        out[p + "w_qkv"] = [(q + "^T", p + "r_q"), (k + "^T", p + "r_k"), (v + "^T", p + "r_v")]
        out[p + "w_o"] = [(o + "^T", p + "r_o")]
        out[p + "w_gu"] = [(g + "^T", p + "r_g"), (u + "^T", p + "r_u")]
        out[p + "w_d"] = [(dn + "^T", p + "r_d")]
        if layout.backward:
            out[p + "o_d"] = [(dn, p + "r_da")]
            out[p + "o_g"] = [(g, p + "r_dn2")]
            out[p + "o_u"] = [(u, p + "r_dn2")]
            out[p + "o_o"] = [(o, p + "r_dy")]
            out[p + "o_q"] = [(q, p + "r_dn1")]
            out[p + "o_k"] = [(k, p + "r_dn1")]
            out[p + "o_v"] = [(v, p + "r_dn1")]
    if m.dec_proj:
        out["dec.w"] = [("w:bottleneck_in.proj.weight^T", "dec.r")]
        if layout.backward:
            out["dec.o"] = [("w:bottleneck_in.proj.weight", "dec.r_b")]
    if m.tail:
        out["lm.w"] = [("w:lm_head.weight^T", "lm.rho")]
        out["lm.o"] = [("w:lm_head.weight", "lm.r_b")]
    elif m.enc_proj:
        out["enc.w"] = [("w:bottleneck_out.proj.weight^T", "enc.r")]
        if layout.backward:
            out["enc.o"] = [("w:bottleneck_out.proj.weight", "enc.r_b")]
    return out


def unknowns(layout: TraceLayout) -> dict[str, int]:
    """For every weight projection vector: the number of unknowns of the token identity it enters (the
    entries of every vector checked in the same identity, e.g. ``o_g`` and ``o_u``)."""
    m = layout.dims
    out: dict[str, int] = {}
    for j in range(len(m.layers)):
        p = f"L{j}."
        out.update({p + "w_qkv": m.d, p + "w_o": m.HD, p + "w_gu": m.d, p + "w_d": m.F})
        if layout.backward:
            out.update({p + "o_d": m.d, p + "o_g": 2 * m.F, p + "o_u": 2 * m.F, p + "o_o": m.d,
                        p + "o_q": m.HD + 2 * m.KD, p + "o_k": m.HD + 2 * m.KD, p + "o_v": m.HD + 2 * m.KD})
    if m.dec_proj:
        out["dec.w"] = m.b - m.r
        if layout.backward:
            out["dec.o"] = m.d
    if m.tail:
        out["lm.w"] = m.d
        out["lm.o"] = m.V
    elif m.enc_proj:
        out["enc.w"] = m.d
        if layout.backward:
            out["enc.o"] = m.b - m.r
    return out


def index_counts(layout: TraceLayout, params: SamplingParams) -> dict[str, int]:
    """Entries to check of every weight projection vector.

    A forged vector ``w' = w + e`` that rescues forged token rows must satisfy one linear identity per
    token (N of them, honest rows included, or those rows fail): with U unknowns in the identity, ``e``
    needs at least ``min(N, U)`` nonzero entries, so a checked entry catches it with probability at
    least ``rho = min(1, N / U)``. Where ``rho < 1``, ``k = ceil(ln(rescue_miss) / ln(1 - rho))``
    entries are checked (at least ``weight_idx``, at most ``max_idx``); where ``rho = 1`` (``tiny``,
    N = 1024 tokens, mostly), ``weight_idx`` entries (these also catch projections of fake weights, whose
    error is dense). ``lm.w`` is also bound by the logits checked on LM-head rows, and needs its own
    entries (V-long columns) only where ``rho < 1``.
    """
    N = layout.dims.N
    out = {}
    for vname, U in unknowns(layout).items():
        n = layout.vectors[vname][0]
        rho = min(1.0, N / U)
        if rho >= 1.0:
            k = 0 if vname == "lm.w" else params.weight_idx
        else:
            k = max(params.weight_idx, math.ceil(math.log(params.rescue_miss) / math.log(1.0 - rho)))
        out[vname] = min(k, n, params.max_idx)
    return out


def draw_blocks(layout: TraceLayout, params: SamplingParams, rng: random.Random) -> list[int]:
    """The blocks (indices inside the stage) one audit checks: ``params.blocks`` of them, uniform
    without replacement, sorted. Drawn after the miner committed its trace (round 1) and sent with
    the round-2 seed, so the miner projects only those blocks."""
    L = len(layout.dims.layers)
    return sorted(rng.sample(range(L), min(params.blocks, L)))


def draw_sample(layout: TraceLayout, params: SamplingParams, rng: random.Random,
                blocks: list[int] | None = None) -> Sample:
    """The validator's draws for one audit (``rng``: seeded from ``os.urandom`` in production);
    ``blocks``: the blocks drawn for round 2 (:func:`draw_blocks`; None: drawn here, last)."""
    params.validate()
    m = layout.dims
    rows = rng.sample(range(m.B), min(params.rows, m.B))
    tokens = {b: sorted(rng.sample(range(m.T), min(params.tokens, m.T))) for b in rows}
    spots = {b: sorted(rng.sample(range(m.T), min(params.spots, m.T))) for b in rows}
    s = Sample(tokens, spots)
    for j in range(len(m.layers)):
        p = f"L{j}."
        names = ["kappa"] + (["nu", "phi", "psi"] if layout.backward else [])
        for nm in names:
            width = layout.committed["p:" + p + nm].width
            for b in rows:
                s.cols[(p + nm, b)] = sorted(rng.sample(range(width), min(params.act_cols, width)))
    counts = index_counts(layout, params)
    for vname in weight_vectors(layout):
        if vname == "lm.o":
            continue
        n = layout.vectors[vname][0]
        s.idx[vname] = sorted(rng.sample(range(n), counts[vname]))
    if m.tail:              # LM-head rows: the sampled tokens' logits and the entries of lm.o
        s.idx["lm.vocab"] = sorted(rng.sample(range(m.V), min(max(params.vocab, counts["lm.o"]), m.V)))
        s.idx["lm.o"] = s.idx["lm.vocab"]
    if layout.backward and not m.head:
        s.scale_rows = sorted(rng.sample(range(m.N), min(params.scale_rows, m.N)))
    s.blocks = sorted(blocks) if blocks is not None else draw_blocks(layout, params, rng)
    for key in [k for k in s.cols if block_of(k[0]) not in s.blocks]:
        del s.cols[key]
    for vname in [v for v in s.idx if block_of(v) is not None and block_of(v) not in s.blocks]:
        s.idx[vname] = []
    s.groups = sorted(rng.sample(range(m.K), min(params.groups, m.K)))
    return s


def openings(layout: TraceLayout, sample: Sample, tokens_of_rows: dict[int, int] | None = None) -> dict[str, list[int]]:
    """Every row to open for ``sample``: layout name -> sorted row indices.

    ``tokens_of_rows``: token row n -> token id (the head's embedding rows; the validator knows the
    micro-batch's tokens from its sample address).
    """
    m = layout.dims
    T = m.T
    want: dict[str, set[int]] = {}

    def add(name: str, idx) -> None:
        want.setdefault(name, set()).update(int(i) for i in idx)

    toks = sample.token_rows(T)
    rows = sorted(sample.tokens)
    K = m.K
    gtoks = [n * K + g for n in toks for g in sample.groups]        # per (token, kv group) rows
    grows = [b * K + g for b in rows for g in sample.groups]        # per (batch row, kv group) rows
    L = len(m.layers)
    add("h.0", toks)
    add(f"h.{L}", toks)
    for j in sample.blocks:
        p = f"L{j}."
        add(f"h.{j}", toks)
        add(f"h.{j + 1}", toks)
        for nm in ("q", "k", "v", "lse", "y", "h1", "g", "u"):
            add(p + nm, toks)
        add(p + "s", gtoks)
        add("p:" + p + "c", grows)
        add("p:" + p + "kappa", rows)
        for b in rows:
            add(p + "v", [b * T + s for s in sample.spots[b]])
            add(p + "k^T", [b * m.KD + i for i in sample.cols[(p + "kappa", b)]])
        for par in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            add("w:" + layout.block_param(j, par), [0])
        if layout.backward:
            for nm in ("da", "dn2", "dy", "dq", "dk", "dv", "dn1"):
                add(p + nm, toks)
            for nm in ("dp", "s^T", "dp^T"):
                add(p + nm, gtoks)
            add(p + "lse_b", grows)
            add(p + "delta", grows)
            for nm in ("ck", "e", "f"):
                add("p:" + p + nm, grows)
            for nm in ("nu", "phi", "psi"):
                add("p:" + p + nm, rows)
            for b in rows:
                spots = [b * T + s for s in sample.spots[b]]
                add(p + "k", spots)
                add(p + "q", spots)
                add(p + "dy", spots)
                add(p + "v^T", [b * m.KD + i for i in sample.cols[(p + "nu", b)]])
                add(p + "q^T", [b * m.HD + i for i in sample.cols[(p + "phi", b)]])
                add(p + "dy^T", [b * m.HD + i for i in sample.cols[(p + "psi", b)]])
    if layout.backward:
        add(f"g.{L}", toks)
        add("g.0", toks)
        for j in sample.blocks:
            add(f"g.{j}", toks)
            add(f"g.{j + 1}", toks)
    for vname, parts in weight_vectors(layout).items():
        for wname, _ in parts:
            if sample.idx[vname]:
                add(wname, sample.idx[vname])
    if m.head:
        if tokens_of_rows is None:
            raise ValueError("auditing the head needs the micro-batch's token ids")
        add("w:embed_tokens.weight", [tokens_of_rows[n] for n in toks])
    else:
        add("wire.x", toks)
    if m.tail:
        add("lm.logits", toks)
        add("w:lm_head.weight", sample.idx["lm.vocab"])
        add("lm.loss", range(m.B))
        add("w:norm.weight", [0])
        if layout.backward:
            add("lm.dn", toks)
    else:
        add("wire.z", toks)
        if m.enc_proj:
            add("out.z", toks)
            add("w:bottleneck_out.norm.weight", [0])
        if layout.backward:
            add("wire.dz", toks)
            if m.enc_proj:
                add("out.dne", toks)
    if layout.backward and not m.head:
        add("wire.dx", toks)
        add("wire.dx", sample.scale_rows)
        if m.dec_proj:
            add("in.dz", toks)
    return {k: sorted(v) for k, v in sorted(want.items())}
