"""What a hop audit commits to and opens: the shapes of a stage's trace, fixed by the run config.

Both sides build the same :class:`TraceLayout` from the config (the validator never takes a shape
from the miner): the miner to lay out its trace, the validator to know how many leaves each
committed tensor has, what each opened row must look like, and which projection vectors to expect.

Notation (per micro-batch): B rows of T tokens, N = B * T token rows (token ``n = b * T + t``);
d model width, H query heads, K key/value heads (grouped-query attention, ``rep = H / K``),
D = d / H head width, F SwiGLU width, V vocabulary, b wire width, r identity rank of the bottleneck
(:mod:`iota_subnet.model.bottleneck`). Every committed tensor is 2-D ``[leaves, width]``: one Merkle
leaf per row (:mod:`.merkle`).

Trace tensors (fp32, see :mod:`.trace`; ``j`` is the block's index inside the stage):

==================  ===============  =============================================================
``h.i``             [N, d]           residual stream at block boundary i = 0..L (``h.0`` stage
                                     input after the embedding / bottleneck decoder)
``L{j}.q``/``.k``   [N, H*D]/[N,K*D] queries / keys after RoPE; ``.v`` [N, K*D] values
``L{j}.s``          [N*K, rep*T]     attention scores q.k/sqrt(D), *unmasked*: row ``n*K + g`` holds
                                     token n's scores for the rep heads of kv group g (head-major), so
                                     an audit opens the groups it checks only; ``L{j}.lse`` [N, H]
                                     their causal logsumexp
``L{j}.y``          [N, H*D]         attention output; ``L{j}.h1`` [N, d] residual after attention
``L{j}.g``/``.u``   [N, F]           gate / up projections
``L{j}.k^T``        [B*K*D, T]       columns of the keys of batch row b (row ``b*K*D + i``)
``out.z``           [N, b]           bottleneck encoder output, before wire rounding (non-tail)
``lm.logits``       [N, V]           tail logits; ``lm.loss`` [B, T] per-token cross-entropy (nats)
==================  ===============  =============================================================

Backward trace tensors (audits of a backward hop; the forward ones above are committed too):
``g.i`` [N, d] gradient of the loss at boundary i; per block ``da`` [N, F], ``dn2`` [N, d], ``dy``
[N, H*D], ``dp`` [N*K, rep*T] (dy.v, unmasked, rows; by kv group as ``s``), ``dq`` [N, H*D],
``dk``/``dv`` [N, K*D] (dq, dk in RoPE space), ``dn1`` [N, d], ``s^T``/``dp^T`` [N*K, rep*T] (columns
of the score and dP matrices: key position n's column for the heads of group g), ``v^T`` [B*K*D, T],
``q^T``/``dy^T`` [B*H*D, T], ``lse_b``/``delta`` [B*K, rep*T] (per batch row and kv group: logsumexp
and dy.y of every token, head-major);
``out.dne`` [N, d] (gradient through the encoder projection), ``lm.dn`` [N, d] (through the LM
head), ``in.dz`` [N, b] (input gradient before wire rounding).

Projection tensors committed in round 2 (``p:`` names, after the validator's seed), one leaf per
batch row (per batch row and kv group ``b*K + g`` where the name says so): ``p:L{j}.c`` [B*K, T]
(values projected on a random vector per kv head) and ``p:L{j}.kappa`` [B, K*D] (keys summed with
random weights over positions); for backward ``p:L{j}.ck`` [B*K, T] (keys), ``p:L{j}.e`` [B*K, rep*T]
(queries), ``p:L{j}.f`` [B*K, rep*T] (dy),
``p:L{j}.nu`` [B, K*D] (values), ``p:L{j}.phi`` / ``p:L{j}.psi`` [B, H*D] (queries / dy). Vectors sent in full in round
2 are listed in :attr:`TraceLayout.vectors`. Wire tensors (their roots are in the receipts):
``wire.x`` (forward input), ``wire.z`` (forward output), ``wire.dz`` (gradient received),
``wire.dx`` (gradient sent), each [N, b] in the wire dtype. Weights: ``w:<param>`` (rows) and
``w:<param>^T`` (columns) of the stage's parameters (:mod:`.commit`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
import torch

from iota_subnet.config import ModelConfig, PipelineConfig
from iota_subnet.config import bottleneck_dims
from iota_subnet.model.llama import rope_cos_sin
from iota_subnet.config import split_layers
from iota_subnet.model.stages import PipelineStage
from iota_subnet.protocol.wire import SCALE_BYTES, WIRE_TORCH_DTYPES, needs_scales

WIRE_FORMATS = tuple(WIRE_TORCH_DTYPES)      # fp32, bf16, int8, fp8
FORWARD = "forward"
BACKWARD = "backward"
DIRECTIONS = (FORWARD, BACKWARD)
EMBED = "embed_tokens.weight"
LM_HEAD = "lm_head.weight"


class LayoutError(ValueError):
    """An audit was asked for something the stage does not have (e.g. the backward of the head)."""


@dataclass(frozen=True)
class Dims:
    """The sizes of one stage's micro-batch (see the module docstring)."""

    B: int
    T: int
    d: int
    H: int
    K: int
    D: int
    F: int
    V: int
    b: int
    r: int
    layers: tuple[int, ...]       # global layer ids of the stage's blocks
    head: bool
    tail: bool
    compressed: bool
    eps: float

    @property
    def N(self) -> int:
        return self.B * self.T

    @property
    def rep(self) -> int:
        return self.H // self.K

    @property
    def HD(self) -> int:
        return self.H * self.D

    @property
    def KD(self) -> int:
        return self.K * self.D

    @property
    def dec_proj(self) -> bool:
        """The stage has a bottleneck decoder projection (``bottleneck_in.proj``)."""
        return not self.head and self.compressed and self.b > self.r

    @property
    def enc_proj(self) -> bool:
        return not self.tail and self.compressed and self.b > self.r


def stage_dims(cfg: ModelConfig, pcfg: PipelineConfig, stage: int, batch: int, seq: int) -> Dims:
    """Sizes of stage ``stage`` for micro-batches of ``batch`` rows of ``seq`` tokens."""
    if pcfg.stages < 2:
        raise LayoutError("hop audits need a pipeline of at least 2 stages")
    ranges = split_layers(cfg.n_layers, pcfg.stages, pcfg.layer_split)
    b, r = bottleneck_dims(cfg, pcfg)
    return Dims(B=int(batch), T=int(seq), d=cfg.dim, H=cfg.n_heads, K=cfg.n_kv_heads, D=cfg.head_dim,
                F=cfg.ffn_dim, V=cfg.vocab_size, b=b, r=r, layers=tuple(ranges[stage]), head=stage == 0,
                tail=stage == pcfg.stages - 1, compressed=pcfg.compression_ratio > 1, eps=cfg.norm_eps)


def param_shapes(cfg: ModelConfig, pcfg: PipelineConfig, stage: int) -> list[tuple[str, tuple[int, ...]]]:
    """``(name, shape)`` of the stage's parameters in ``state_dict`` order (built on the meta device:
    no memory, works for the 8b shape)."""
    with torch.device("meta"):
        m = PipelineStage(cfg, pcfg, stage, init=False)
    return [(k, tuple(v.shape)) for k, v in m.state_dict().items()]


def is_hf(cfg) -> bool:
    """The run's model is a ``transformers`` family (:class:`~iota_subnet.config_hf.HFModelConfig`)."""
    return getattr(cfg, "hf", None) is not None


def hf_stage_dims(cfg, pcfg: PipelineConfig, stage: int, batch: int, seq: int) -> tuple[Dims, list]:
    """Sizes and ``(name, shape)`` parameters (``state_dict`` order, built on the meta device) of
    stage ``stage`` of a ``transformers`` family run: no bottleneck, the wire carries ``[N, d]``."""
    from iota_subnet.model.hf_pipeline import HFPipelineStage, hf_split
    if pcfg.stages < 2:
        raise LayoutError("hop audits need a pipeline of at least 2 stages")
    hcfg = cfg.transformers_config()
    ranges = hf_split(cfg, pcfg, hcfg)
    d, H = hcfg.hidden_size, hcfg.num_attention_heads
    dims = Dims(B=int(batch), T=int(seq), d=d, H=H, K=getattr(hcfg, "num_key_value_heads", None) or H,
                D=getattr(hcfg, "head_dim", None) or d // H, F=hcfg.intermediate_size, V=hcfg.vocab_size, b=d, r=d,
                layers=tuple(ranges[stage]), head=stage == 0, tail=stage == pcfg.stages - 1, compressed=False,
                eps=float(getattr(hcfg, "rms_norm_eps", 1e-6)))
    with torch.device("meta"):
        m = HFPipelineStage(cfg, pcfg, stage, init=False)
    return dims, [(k, tuple(v.shape)) for k, v in m.state_dict().items()]


def block_of(name: str) -> int | None:
    """The block index (inside the stage) of a per-block name (``L{j}.*``, ``p:L{j}.*``); None for
    the stage's own names (``h.i``, ``dec.*``, ``enc.*``, ``lm.*``, ...)."""
    bare = name[2:] if name.startswith("p:") else name
    if bare.startswith("L") and "." in bare and bare[1:bare.index(".")].isdigit():
        return int(bare[1:bare.index(".")])
    return None


def has_columns(name: str, shape: tuple[int, ...]) -> bool:
    """Whether a parameter is also committed column-wise: every matrix but the token embedding (only
    ever read by rows)."""
    return len(shape) == 2 and name != EMBED


@dataclass(frozen=True)
class Entry:
    """One committed 2-D tensor: ``rows`` Merkle leaves of ``width`` values each."""

    name: str
    rows: int
    width: int
    dtype: str = "float32"     # "float32", or "wire" (the hop's wire dtype), or the weights' dtype


@dataclass
class TraceLayout:
    """Everything both sides must agree on for an audit of one hop of one stage.

    ``direction``: ``"forward"`` (forward trace only) or ``"backward"`` (forward and backward
    trace; the tail's hop is always audited this way). ``micro_per_step``: the tail divides its
    loss by it before backward (the gradient scale). ``wire_format``: ``fp32``, ``bf16``, ``int8`` or
    ``fp8`` (:mod:`iota_subnet.protocol.wire`); int8 and fp8 wire rows are ``b`` bytes plus a float32 scale.
    ``blocks``: the blocks (indices inside the stage) whose round-2 projections the audit asks for
    (None: all); :meth:`for_blocks` makes such a view. ``kind``: ``"replay"`` for a stage of a
    ``transformers`` family run (:func:`is_hf`): no trace, no projections, only its wire tensors and
    weights (``params`` from :class:`~iota_subnet.model.hf_pipeline.HFPipelineStage`; ``pcfg`` and
    ``stage`` rebuild it), which the validator replays (:mod:`.replay`). Raises :class:`LayoutError`.
    """

    dims: Dims
    direction: str
    model: ModelConfig
    micro_per_step: int = 1
    wire_format: str = "bf16"
    params: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)
    trace: dict[str, Entry] = field(default_factory=dict)          # round 1
    committed: dict[str, Entry] = field(default_factory=dict)      # round 2 (p: tensors)
    vectors: dict[str, tuple[int, ...]] = field(default_factory=dict)   # round 2, sent in full
    wire: dict[str, Entry] = field(default_factory=dict)
    weights: dict[str, Entry] = field(default_factory=dict)
    blocks: tuple[int, ...] | None = None
    #: ``"trace"`` (the project's stages: row and link checks on the trace) or ``"replay"`` (a
    #: ``transformers`` family stage: no trace; the validator replays the hop, :mod:`.replay`)
    kind: str = "trace"
    pcfg: PipelineConfig | None = None
    stage: int = 0

    @classmethod
    def build(cls, cfg: ModelConfig, pcfg: PipelineConfig, stage: int, *, batch: int, seq: int,
              direction: str, micro_per_step: int = 1, wire_format: str = "bf16") -> "TraceLayout":
        if direction not in DIRECTIONS:
            raise LayoutError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
        if wire_format not in WIRE_FORMATS:
            raise LayoutError(f"wire_format must be one of {WIRE_FORMATS}, got {wire_format!r}")
        if is_hf(cfg):
            dims, params = hf_stage_dims(cfg, pcfg, stage, batch, seq)
        else:
            dims, params = stage_dims(cfg, pcfg, stage, batch, seq), None
        if dims.tail:
            direction = BACKWARD          # the tail runs its backward with its forward
        if dims.head and direction == BACKWARD:
            raise LayoutError("the head stage sends no gradient: its backward hop has no output to audit "
                              "(its weight gradient is the update audit's job); audit its forward")
        if params is not None:
            lay = cls(dims, direction, cfg, int(micro_per_step), wire_format, params, kind="replay", pcfg=pcfg,
                      stage=int(stage))
            lay._fill_replay()
            return lay
        lay = cls(dims, direction, cfg, int(micro_per_step), wire_format, param_shapes(cfg, pcfg, stage))
        lay._fill()
        return lay

    @property
    def replay(self) -> bool:
        return self.kind == "replay"

    def _fill_replay(self) -> None:
        """A replayed stage commits no trace and projects nothing: its wire tensors and weights only."""
        self._fill()
        self.trace.clear()
        self.committed.clear()
        self.vectors.clear()

    @property
    def backward(self) -> bool:
        return self.direction == BACKWARD

    def _fill(self) -> None:
        m = self.dims
        N, B, T, d, H, K, F = m.N, m.B, m.T, m.d, m.H, m.K, m.F
        HD, KD, rep = m.HD, m.KD, m.rep
        tr, cm, vec = self.trace, self.committed, self.vectors

        def add(dst, name, rows, width, dtype="float32"):
            dst[name] = Entry(name, int(rows), int(width), dtype)

        L = len(m.layers)
        for i in range(L + 1):
            add(tr, f"h.{i}", N, d)
        for j in range(L):
            p = f"L{j}."
            for nm, w in (("q", HD), ("k", KD), ("v", KD), ("lse", H), ("y", HD), ("h1", d),
                          ("g", F), ("u", F)):
                add(tr, p + nm, N, w)
            add(tr, p + "s", N * K, rep * T)          # by kv group: an audit opens the groups it checks
            add(tr, p + "k^T", B * KD, T)
            add(cm, "p:" + p + "c", B * K, T)
            for nm, n in (("w_qkv", d), ("w_o", HD), ("w_gu", d), ("w_d", F)):
                vec[p + nm] = (n,)
            add(cm, "p:" + p + "kappa", B, KD)
        if m.dec_proj:
            vec["dec.w"] = (m.b - m.r,)
        if m.tail:
            add(tr, "lm.logits", N, m.V)
            add(tr, "lm.loss", B, T)
            vec["lm.w"] = (d,)
        elif m.enc_proj:
            add(tr, "out.z", N, m.b)
            vec["enc.w"] = (d,)
        if self.backward:
            for i in range(L + 1):
                add(tr, f"g.{i}", N, d)
            for j in range(L):
                p = f"L{j}."
                for nm, w in (("da", F), ("dn2", d), ("dy", HD), ("dq", HD), ("dk", KD), ("dv", KD), ("dn1", d)):
                    add(tr, p + nm, N, w)
                for nm in ("dp", "s^T", "dp^T"):
                    add(tr, p + nm, N * K, rep * T)
                add(tr, p + "v^T", B * KD, T)
                add(tr, p + "q^T", B * HD, T)
                add(tr, p + "dy^T", B * HD, T)
                add(tr, p + "lse_b", B * K, rep * T)
                add(tr, p + "delta", B * K, rep * T)
                add(cm, "p:" + p + "ck", B * K, T)
                add(cm, "p:" + p + "e", B * K, rep * T)
                add(cm, "p:" + p + "f", B * K, rep * T)
                for nm, n in (("o_d", d), ("o_g", F), ("o_u", F), ("o_o", d), ("o_q", HD), ("o_k", KD),
                              ("o_v", KD)):
                    vec[p + nm] = (n,)
                add(cm, "p:" + p + "nu", B, KD)
                add(cm, "p:" + p + "phi", B, HD)
                add(cm, "p:" + p + "psi", B, HD)
            if m.tail:
                add(tr, "lm.dn", N, d)
                vec["lm.o"] = (m.V,)
            elif m.enc_proj:
                add(tr, "out.dne", N, d)
                vec["enc.o"] = (m.b - m.r,)
            if m.dec_proj:
                add(tr, "in.dz", N, m.b)
                vec["dec.o"] = (d,)
        # wire tensors named by the receipts of this hop
        ww = m.b + SCALE_BYTES if needs_scales(self.wire_format) else m.b
        if not m.head:
            add(self.wire, "wire.x", N, ww, "wire")
        if not m.tail:
            add(self.wire, "wire.z", N, ww, "wire")
        if self.backward and not m.tail:
            add(self.wire, "wire.dz", N, ww, "wire")
        if self.backward and not m.head:
            add(self.wire, "wire.dx", N, ww, "wire")
        for name, shape in self.params:
            rows = shape[0] if len(shape) >= 2 else 1
            width = int(torch.Size(shape).numel()) // max(1, rows)
            add(self.weights, "w:" + name, rows, width, "weights")
            if has_columns(name, shape):
                add(self.weights, "w:" + name + "^T", shape[1], shape[0], "weights")

    def block_ids(self) -> tuple[int, ...]:
        """The blocks this layout's round 2 covers (all of the stage's unless :meth:`for_blocks`)."""
        return tuple(range(len(self.dims.layers))) if self.blocks is None else self.blocks

    def for_blocks(self, blocks) -> "TraceLayout":
        """The same layout with round 2 (``committed`` projections and ``vectors``) restricted to
        ``blocks`` (indices inside the stage) plus the stage's own vectors (decoder, encoder, LM
        head): what an audit that checks those blocks asks the miner to project. Raises
        :class:`LayoutError` for an index out of range or repeated."""
        L = len(self.dims.layers)
        bs = tuple(sorted(int(j) for j in blocks))
        if not bs or len(set(bs)) != len(bs) or bs[0] < 0 or bs[-1] >= L:
            raise LayoutError(f"blocks must be distinct indices in 0..{L - 1}, got {list(blocks)}")
        def kept(name: str) -> bool:
            j = block_of(name)
            return j is None or j in bs

        return dataclasses.replace(self, committed={k: v for k, v in self.committed.items() if kept(k)},
                                   vectors={k: v for k, v in self.vectors.items() if kept(k)}, blocks=bs)

    # ---- lookups ------------------------------------------------------------------------------
    def entry(self, name: str) -> Entry:
        for table in (self.trace, self.committed, self.wire, self.weights):
            if name in table:
                return table[name]
        raise KeyError(name)

    def block_param(self, j: int, suffix: str) -> str:
        """Parameter name of block ``j`` (index inside the stage), e.g. ``mlp.up_proj.weight``."""
        return f"layers.{self.dims.layers[j]}.{suffix}"

    @property
    def wire_torch_dtype(self) -> torch.dtype:
        """dtype of the opened wire rows (int8 and fp8 rows travel as their bytes and scale: uint8)."""
        return torch.uint8 if needs_scales(self.wire_format) else WIRE_TORCH_DTYPES[self.wire_format]

    def rope_tables(self, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, D] (fp32) of the model's rotary embedding, as the stage computes them."""
        return rope_cos_sin(self.model, self.dims.T, device)

    def vector_numel(self) -> int:
        n = 0
        for shape in self.vectors.values():
            k = 1
            for s in shape:
                k *= s
            n += k
        return n

    def trace_bytes(self) -> int:
        """Bytes of the fp32 trace the miner keeps for the audit (round 1 tensors)."""
        return sum(e.rows * e.width * 4 for e in self.trace.values())
