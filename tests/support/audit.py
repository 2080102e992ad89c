"""Helpers for the hop-audit tests: a real pipeline of StageWorkers trained a few steps on real text,
hops recorded as a miner keeps them (bf16 wire), honest and cheating provers, forging tracers.

Nothing here is used by production code.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

from iota_subnet.audit import (HopAuditor, HopInputs, HopProver, SamplingParams, Tolerances, TraceLayout, Tracer,
                               run_local_audit, weights_commitment, wire_root)
from iota_subnet.audit.commit import wire_sha256
from iota_subnet.audit.merkle import MerkleTree
from iota_subnet.audit.project import projections, randoms
from iota_subnet.config import load_config
from iota_subnet.miner import StageWorker
from iota_subnet.sim.adversary import CheatingStageWorker
from iota_subnet.protocol import from_wire, to_wire

WIKITEXT = Path(__file__).resolve().parents[3] / "shared" / "data" / "wikitext-2" / "wiki.valid.raw.txt"
WIRE = torch.bfloat16


def text_rows(n_rows: int, seq: int, offset: int = 0) -> torch.Tensor:
    """Rows of ``seq + 1`` token ids from WikiText-2: the UTF-8 bytes of the text (ids < 256, valid in
    any vocabulary of at least 256), read in place."""
    raw = WIKITEXT.read_bytes()
    need = n_rows * (seq + 1)
    start = 10_000 + offset * need
    ids = torch.tensor(list(raw[start:start + need]), dtype=torch.int64)
    return ids.view(n_rows, seq + 1)


@dataclass
class Hop:
    """What the miner of ``stage`` keeps of one micro-batch, and what its receipts name."""

    stage: int
    inputs: HopInputs
    weights: dict[str, torch.Tensor]
    loss: Optional[float] = None
    tokens: Optional[torch.Tensor] = None
    targets: Optional[torch.Tensor] = None

    def roots(self, direction: str, layout: TraceLayout) -> dict[str, bytes]:
        """The receipts' wire commitments as :func:`wire_root`."""
        names = set(layout.wire)
        if direction == "forward":
            names -= {"wire.dz", "wire.dx"}
        return {k: wire_root(v) for k, v in self.inputs.wire.items() if k in names}

    def hashes(self, direction: str, layout: TraceLayout) -> dict[str, bytes]:
        """The receipts' wire commitments as the data plane sends them today: flat sha256."""
        names = set(layout.wire)
        if direction == "forward":
            names -= {"wire.dz", "wire.dx"}
        return {k: wire_sha256(v) for k, v in self.inputs.wire.items() if k in names}


@dataclass
class Chain:
    """Three stage workers (``configs/tiny.yaml`` unless overridden) and the hops of one micro-batch."""

    cfg: object
    workers: list
    hops: list[Hop] = field(default_factory=list)
    wire: str = "bf16"

    @property
    def B(self) -> int:
        return self.cfg.train.micro_batch

    @property
    def T(self) -> int:
        return self.cfg.data.seq_len

    @property
    def mps(self) -> int:
        return self.cfg.train.batch_size // self.cfg.train.micro_batch

    def layout(self, stage: int, direction: str) -> TraceLayout:
        return TraceLayout.build(self.cfg.model, self.cfg.pipeline, stage, batch=self.B, seq=self.T,
                                 direction=direction, micro_per_step=self.mps, wire_format=self.wire)


def make_chain(overrides: Optional[dict] = None, train_steps: int = 2, kinds: Optional[dict[int, str]] = None,
               seed: int = 0, base: Optional["Chain"] = None, wire: str = "bf16", cfg=None) -> Chain:
    """Train ``train_steps`` inner steps on real text (so weights are not at init), then run one
    recorded micro-batch through the chain with bf16 on the wire. ``kinds``: stage -> adversary kind
    installed for the recorded micro-batch (``copy`` copies a fresh replica's weights). ``base``: start
    from the weights of another chain's recorded micro-batch instead of training. ``wire``: the wire
    format of the recorded micro-batch (:func:`iota_subnet.protocol.to_wire`). ``cfg``: a RunConfig to
    use instead of ``configs/tiny.yaml`` with ``overrides`` (e.g. a ``transformers`` family's)."""
    if base is not None:
        cfg = base.cfg
    elif cfg is None:
        cfg = load_config("configs/tiny.yaml", overrides)
    # a stage with an adversary kind: honest until armed (below, for the recorded micro-batch)
    workers = [CheatingStageWorker(cfg, s, kind=kinds[s], seed=seed, armed=False) if kinds and s in kinds
               else StageWorker(cfg, s, seed=seed) for s in range(3)]
    if base is not None:
        for w, hop in zip(workers, base.hops):
            w.module.load_state_dict(hop.weights)
        train_steps = 0
    B, T = cfg.train.micro_batch, cfg.data.seq_len
    mps = cfg.train.batch_size // B
    k = 0
    for _ in range(train_steps):
        for _ in range(mps):
            rows = text_rows(B, T, k)
            k += 1
            _run(workers, f"train{k}", rows, cfg)
    chain = Chain(cfg, workers, wire=wire)
    if kinds:
        for s, kind in kinds.items():
            peer = StageWorker(cfg, s, seed=seed + 1)
            workers[s].arm(peer_state=lambda p=peer: p.module.state_dict(), seed=s)
            if kind == "replay":       # the replay cheat needs one honest micro-batch first
                _run(workers, "first", text_rows(B, T, 100), cfg)
    rows = text_rows(B, T, 200)
    # the weights every hop of the recorded micro-batch uses (no inner step happens inside it)
    weights = [{n: p.detach().clone() for n, p in w.module.state_dict().items()} for w in workers]
    sent = _run(workers, "audited", rows, cfg, wire)
    x, y = rows[:, :-1], rows[:, 1:]
    a0, a1, g2, g1, loss = sent
    dec = _decode
    chain.hops = [
        Hop(0, HopInputs(x, wire={"wire.z": a0}), weights[0], tokens=x),
        Hop(1, HopInputs(dec(a0), grad=dec(g2), wire={"wire.x": a0, "wire.z": a1, "wire.dz": g2, "wire.dx": g1}),
            weights[1]),
        Hop(2, HopInputs(dec(a1), targets=y, wire={"wire.x": a1, "wire.dx": g2}), weights[2], loss=loss, targets=y),
    ]
    return chain


def _encode(t: torch.Tensor, wire: str):
    """What goes on the wire: a tensor (fp32, bf16) or ``(data, scales)`` (int8, fp8)."""
    data, scales = to_wire(t, wire)
    return (data, scales) if scales is not None else data


def _decode(w) -> torch.Tensor:
    """What the receiver computes with: bf16/fp32 wire tensors as they are (the stage uses
    ``x.float()``), int8 / fp8 decoded to float."""
    return from_wire(*w) if isinstance(w, tuple) else w


def _run(workers, mid: str, rows: torch.Tensor, cfg, wire: str = "bf16"):
    """One micro-batch through the chain as the data plane does (``wire`` on every boundary)."""
    x, y = rows[:, :-1], rows[:, 1:]
    a0 = _encode(workers[0].forward(mid, x)["activations"], wire)
    a1 = _encode(workers[1].forward(mid, _decode(a0))["activations"], wire)
    out = workers[2].forward(mid, _decode(a1), y)
    g2 = _encode(out["grad"], wire)
    g1 = workers[1].backward(mid, _decode(g2))
    g1 = _encode(g1 if g1 is not None else torch.zeros(_decode(a0).shape), wire)
    workers[0].backward(mid, _decode(g1))
    return a0, a1, g2, g1, out["loss"]


# ---- audits ------------------------------------------------------------------------------------
#: Every block of the stage and every kv-head group checked in each audit (tests of single links;
#: production draws ``SamplingParams.blocks`` blocks and ``SamplingParams.groups`` groups).
EVERY_BLOCK = SamplingParams(blocks=1_000, groups=1_000)


def auditor_for(chain: Chain, hop: Hop, direction: str, *, rng_seed: int, tol: Optional[Tolerances] = None,
                sampling: SamplingParams = SamplingParams(), layout: Optional[TraceLayout] = None,
                weights_root: Optional[bytes] = None, wire_roots: Optional[dict] = None,
                wire_commit: str = "root") -> HopAuditor:
    lay = layout or chain.layout(hop.stage, direction)
    if wire_roots is None:
        wire_roots = hop.roots(direction, lay) if wire_commit == "root" else hop.hashes(direction, lay)
    return HopAuditor(lay, weights_root=weights_root or weights_commitment(hop.weights, keep=False).root,
                      wire_roots=wire_roots, tol=tol or Tolerances.for_precision("fp32"), wire_commit=wire_commit,
                      sampling=sampling, rng=random.Random(rng_seed), tokens=hop.tokens, targets=hop.targets,
                      loss=hop.loss)


def audit_many(chain: Chain, hop: Hop, direction: str, n: int, *, prover: Optional[HopProver] = None,
               tol: Optional[Tolerances] = None, sampling: SamplingParams = SamplingParams(), seed0: int = 0,
               wire_commit: str = "root"):
    """``n`` audits of one hop with independent challenges (one trace commitment, as a miner that is
    audited several times on the same hop would answer). Returns the verdicts."""
    lay = chain.layout(hop.stage, direction)
    wc = weights_commitment(hop.weights)
    prover = prover or HopProver(lay, wc, hop.inputs)
    out = []
    troots = wroots = None
    for i in range(n):
        aud = auditor_for(chain, hop, direction, rng_seed=seed0 + i, tol=tol, sampling=sampling, layout=lay,
                          weights_root=wc.root, wire_commit=wire_commit)
        if i == 0:              # the first through the encoded messages (rounds 1-3), the rest in process
            out.append(run_local_audit(prover, aud, stage=hop.stage).verdict)
            troots, wroots = [prover.trees[nm].root for nm in lay.trace], [e[2] for e in prover.weights.entries]
            continue
        seed = aud.on_commit(troots, wroots)
        vec, proots = prover.project(seed, aud.blocks)
        req = aud.on_projection(vec, proots)
        out.append(aud.check(prover.open(req, aud.whole)))
    return out


# ---- forgeries ---------------------------------------------------------------------------------
#: For each traced tensor (natural shape in :class:`Tracer`): the axes that index (batch row, position).
TOKEN_AXES = {"q": (0, 1), "k": (0, 1), "v": (0, 1), "dq": (0, 1), "dk": (0, 1), "dv": (0, 1),
              "s": (0, 2), "dp": (0, 2), "lse": (0, 2), "delta": (0, 2), "lm.loss": (0, 1)}


def token_axes(name: str) -> Optional[tuple[int, int]]:
    short = name.split(".", 1)[1] if name.startswith("L") else name
    return TOKEN_AXES.get(short)


def perturb(name: str, t: torch.Tensor, mask: torch.Tensor, scale: float, gen: torch.Generator) -> torch.Tensor:
    """``t`` with the entries of the tokens in ``mask`` [B, T] moved by ``scale`` x their RMS (random
    directions)."""
    B, T = mask.shape
    ax = token_axes(name)
    if ax is None:                          # [N, width]
        m = mask.reshape(-1).view(-1, *([1] * (t.dim() - 1)))
    else:
        shape = [1] * t.dim()
        shape[ax[0]], shape[ax[1]] = B, T
        m = mask.view(B, T).reshape(shape)
    noise = torch.randn(t.shape, generator=gen, dtype=torch.float32).to(t.device)
    rms = float(t.float().pow(2).mean().sqrt()) or 1.0
    return t + m.to(t.dtype) * noise.to(t.dtype) * scale * rms


def forging_tracer(target: str, fraction: float = 1.0, scale: float = 0.5, seed: int = 0,
                   weight_delta: Optional[dict[str, torch.Tensor]] = None) -> type[Tracer]:
    """A Tracer class that perturbs the traced tensor ``target`` on a ``fraction`` of the token rows
    (chosen by ``seed``) and carries the change downstream, so that only the link producing
    ``target`` is inconsistent. ``weight_delta``: parameters added to the weights the trace uses (a
    forger computing with fake weights while its commitment names the real ones)."""

    class Forger(Tracer):
        def __init__(self, layout, weights, device=None):
            if weight_delta:
                weights = {k: (v + weight_delta[k].to(v.device, v.dtype) if k in weight_delta else v)
                           for k, v in weights.items()}
            super().__init__(layout, weights, device)
            m = layout.dims
            g = torch.Generator().manual_seed(seed)
            self.mask = torch.rand(m.B, m.T, generator=g) < fraction
            self.gen = torch.Generator().manual_seed(seed + 1)

        def emit(self, name, t):
            if name != target:
                return t
            return perturb(name, t, self.mask, scale, self.gen)

    return Forger


def forged_hop(chain: Chain, stage: int, direction: str, tracer_cls: type[Tracer]) -> tuple[Hop, TraceLayout]:
    """The hop a cheater computing with ``tracer_cls`` would have sent: its wire outputs (and the
    tail's loss) are those of the forged computation, rounded to the wire dtype."""
    hop = chain.hops[stage]
    lay = chain.layout(stage, direction)
    res = tracer_cls(lay, hop.weights).run(hop.inputs.x, targets=hop.inputs.targets, grad=hop.inputs.grad)
    wire = dict(hop.inputs.wire)
    if res.out is not None:
        wire["wire.z"] = _encode(res.out, chain.wire)
    if res.grad_in is not None:
        wire["wire.dx"] = _encode(res.grad_in, chain.wire)
    loss = res.loss if res.loss is not None else hop.loss
    return Hop(stage, HopInputs(hop.inputs.x, hop.inputs.targets, hop.inputs.grad, wire), hop.weights, loss,
               hop.tokens, hop.targets), lay


class RescuingProver(HopProver):
    """A prover whose round-2 answer is computed by ``fix(layout, records, weights, randoms, vec, com)``
    (returns the forged ``vec, com``), e.g. projections made with fake weights or solved to rescue a
    forged link."""

    def __init__(self, *a, fix: Callable, **kw):
        super().__init__(*a, **kw)
        self.fix = fix

    def project(self, seed: bytes, blocks=None):
        lay = self.layout if blocks is None else self.layout.for_blocks(blocks)
        rnd = randoms(self.layout, seed)
        vec, com = projections(lay, self.records, self.weights.tensors, rnd)
        vec, com = self.fix(lay, self.records, self.weights.tensors, rnd, vec, com)
        self.round2, self.vectors, self.committed = lay, vec, com
        for name, t in com.items():
            self.trees[name] = MerkleTree.of_rows(t)
        return vec, [self.trees[n].root for n in lay.committed]


# ---- near-zero gradient rows ---------------------------------------------------------------------
def confident_tail_hop(chain: Chain, lm_scale: float = 1000.0, last: int = 2) -> Hop:
    """The tail's hop of ``chain``'s micro-batch with the LM head scaled by ``lm_scale`` and, at the
    last ``last`` positions of every row, the target set to the model's top prediction: there the
    target's probability rounds to 1 and the input gradient's row is near zero (no later token
    sends it gradient), as on trained weights. Computed honestly (StageWorker, fp32, bf16 wire)."""
    hop = chain.hops[2]
    w = {k: v.detach().clone() for k, v in hop.weights.items()}
    w["lm_head.weight"] *= lm_scale
    lay = chain.layout(2, "backward")
    x, y = hop.inputs.x, hop.targets.clone()
    logits = Tracer(lay, w).run(x, targets=y).records["lm.logits"].view(*y.shape, -1)
    y[:, -last:] = logits.argmax(-1)[:, -last:]
    worker = StageWorker(chain.cfg, 2, seed=0)
    worker.module.load_state_dict(w)
    out = worker.forward("confident", x.float(), y, accumulate=False)
    g = _encode(out["grad"], chain.wire)
    return Hop(2, HopInputs(x, targets=y, wire={"wire.x": hop.inputs.wire["wire.x"], "wire.dx": g}), w,
               loss=out["loss"], targets=y)


def seed_sampling(layout: TraceLayout, want, sampling: SamplingParams = SamplingParams(),
                  tries: int = 100_000) -> tuple[int, list[int]]:
    """An auditor RNG seed (:func:`auditor_for` ``rng_seed``) whose sample includes a token row for
    which ``want(n)`` holds (the auditor draws the 32-byte projection seed, then the sample), and
    that sample's token rows."""
    from iota_subnet.audit import draw_sample
    from iota_subnet.audit.challenge import draw_blocks
    for s in range(tries):
        rng = random.Random(s)
        for _ in range(32):
            rng.getrandbits(8)
        blocks = draw_blocks(layout, sampling, rng)
        rows = draw_sample(layout, sampling, rng, blocks=blocks).token_rows(layout.dims.T)
        if any(want(n) for n in rows):
            return s, rows
    raise AssertionError("no seed samples such a row")
