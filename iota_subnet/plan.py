"""The compute and memory plan of each pipeline stage on an accelerator (``iota-subnet plan``).

Compute (per token, PaLM appendix B, Chowdhery et al. 2022, as :meth:`PipelineStage.flops_per_token`):
forward = 2 x matmul parameters + attention scores and values; training = 3 x forward, plus the
forward of every block but its last matmul when per-block activation checkpointing recomputes the
blocks in the backward (Chen et al. 2016, arXiv 1604.06174; torch's non-reentrant checkpoint stops
the recomputation once the last tensor the backward needs is back, and the MLP's ``down_proj`` output
is not one), plus one more forward of the LM head at the tail
when its chunked cross-entropy recomputes each chunk's logits in the backward
(:func:`iota_subnet.model.stages.lm_head_recomputed`: a micro-batch's fp32 logits over more than
``CE_CHUNK_BYTES``; every 2,048-token row at a 128,256-id vocabulary). :func:`balanced_layer_split`
gives the layer counts that balance these training FLOPs over the stages (the tail also carries
the LM head).

Memory of one stage replica on its accelerator, all in bytes:

* **state**: fp32 weights (4 B/param), fp32 gradients (4), AdamW moments (8). With merging, the
  merge anchor and outer momentum (8 B/param, ``merge_bytes``) live in host memory
  (:mod:`iota_subnet.merge` keeps all merge state on the host), not on the accelerator;
* **activations per micro-batch in flight**: what autograd holds between a micro-batch's forward
  and its backward, *measured* on the ``meta`` device (no memory used) with
  ``torch.autograd.graph.saved_tensors_hooks``: every distinct storage saved for backward that is not
  a parameter, plus the stage input and output the activation cache keeps. A ``bf16`` run
  (``train.precision``) measures its forward under an autocast equivalent (``torch.autocast("cuda", bfloat16)`` cannot run on ``meta``): linears take
  bf16 copies of their input and weight (so, as with real autocast, every micro-batch in flight
  holds its own bf16 copy of the stage's matrices unless blocks are checkpointed), and attention
  saves what FlashAttention-2 saves (q, k, v, output, fp32 log-sum-exp; SDPA's flash kernel on CUDA),
  not the math path's [B, H, T, T] probabilities that ``meta`` would otherwise take. With
  checkpointing the blocks keep only their inputs (counted from the tensors the blocks receive). An
  ``fp32`` run measures the fp32 forward (no weight copies, fp32 activations; attention as a fused
  kernel all the same: SDPA's memory-efficient kernel saves the same tensors in fp32);
* **workspace**: transient memory of one backward: the largest block's full saved set when blocks are
  recomputed, plus twice the largest single saved tensor (an op's output gradient and input
  gradient; for the tail the fp32 gradient of the logits) -- an estimate, stated as such;
* **reserve**: CUDA context, library workspaces and allocator fragmentation (default 2 GiB).

A non-tail stage holds a micro-batch from its forward until its backward (1F1B steady state: stage
i of S holds S - i); the tail runs its backward at once and never holds more than one. The plan
gives the most micro-batches that fit (``microbatches_in_flight_max``, ``rows_in_flight``,
``activation_cache_bound_bytes``: the bound to give the activation cache), and ``fits``: the stage
holds at least what its schedule needs. The accelerator emulator (``--emulate-gpu``) enforces
the same bound.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from iota_subnet.config import ConfigError, ModelConfig, PipelineConfig, RunConfig
from iota_subnet.hardware import GIB, Accelerator
from iota_subnet.host_plan import host_plan
from iota_subnet.config import bottleneck_dims
from iota_subnet.model.llama import block_flops_per_token
from iota_subnet.config import split_layers
from iota_subnet.model.stages import PipelineStage, lm_head_recomputed, make_stage

#: Bytes per parameter of a stage's training state: fp32 weights, gradients, AdamW exp_avg, exp_avg_sq.
WEIGHT_BYTES, GRAD_BYTES, OPTIMIZER_BYTES = 4, 4, 8
#: Merge anchor + outer momentum, fp32 each, in host memory (:class:`iota_subnet.merge.MergeEngine`).
MERGE_BYTES = 8
#: Bytes the fused AdamW step moves per parameter (reads p, g, m, v; writes p, m, v; fp32).
OPTIMIZER_STEP_BYTES = 28
DEFAULT_RESERVE_BYTES = 2 * GIB


# ------------------------------------------------------------------------------------ compute
@dataclass(frozen=True)
class StageFlops:
    """Forward FLOPs per token of one stage: ``blocks`` and ``other`` (bottleneck projections, LM head;
    the embedding lookup is free). ``block_recompute``: what checkpointed blocks run again in the
    backward (None: all of ``blocks``). ``head_recompute``: forward FLOPs of the LM head that the
    tail's chunked cross-entropy runs again in the backward (0 elsewhere, and when the micro-batch's
    rows are not known: model FLOPs only)."""

    blocks: int
    other: int
    head_recompute: int = 0
    block_recompute: Optional[int] = None

    @property
    def forward(self) -> int:
        return self.blocks + self.other

    def recompute(self, checkpointing: bool) -> int:
        """Forward FLOPs per token run again in the backward: the blocks when checkpointed, the LM head
        when its cross-entropy is chunked."""
        blocks = self.blocks if self.block_recompute is None else self.block_recompute
        return (blocks if checkpointing else 0) + self.head_recompute

    def train(self, checkpointing: bool) -> int:
        """Training FLOPs per token: forward + backward (2 x forward) + recomputation."""
        return 3 * self.forward + self.recompute(checkpointing)


def _other_forward_flops(model: ModelConfig, pipeline: PipelineConfig, stage: int) -> int:
    n = pipeline.stages
    b, r = bottleneck_dims(model, pipeline)
    proj = 2 * model.dim * (b - r) if pipeline.compression_ratio > 1 else 0   # encoder or decoder matmul
    f = 0
    if stage > 0:
        f += proj                          # decoder of the incoming boundary
    if stage < n - 1:
        f += proj                          # encoder of the outgoing boundary
    else:
        f += 2 * model.dim * model.vocab_size   # LM head
    return f


def _block_recompute_flops(model: ModelConfig, seq_len: int) -> int:
    """Forward FLOPs per token a checkpointed block runs again in the backward: all but ``down_proj``
    (non-reentrant ``torch.utils.checkpoint`` stops early, once the saved tensors are back)."""
    return block_flops_per_token(model, seq_len) - 2 * model.dim * model.ffn_dim


def _head_recompute_flops(model: ModelConfig, seq_len: int, rows: Optional[int]) -> int:
    """Forward FLOPs per token of the tail's LM head run again in the backward (0 if not chunked)."""
    if rows is None or not lm_head_recomputed(rows * seq_len, model.vocab_size):
        return 0
    return 2 * model.dim * model.vocab_size


def stage_flops(model: ModelConfig, pipeline: PipelineConfig, seq_len: int, stage: int,
                rows: Optional[int] = None) -> StageFlops:
    """Forward FLOPs per token of ``stage`` (same count as :meth:`PipelineStage.flops_per_token`).

    ``rows``: rows per micro-batch; given, the tail's ``head_recompute`` counts the LM head its chunked
    cross-entropy recomputes in the backward (what the stage executes); None counts model FLOPs only."""
    n = len(split_layers(model.n_layers, pipeline.stages, pipeline.layer_split)[stage])
    tail = stage == pipeline.stages - 1
    return StageFlops(n * block_flops_per_token(model, seq_len), _other_forward_flops(model, pipeline, stage),
                      _head_recompute_flops(model, seq_len, rows) if tail else 0,
                      n * _block_recompute_flops(model, seq_len))


def balanced_layer_split(model: ModelConfig, stages: int, seq_len: int, *, compression_ratio: int = 1,
                         identity_rank: Optional[int] = None, checkpointing: bool = False,
                         rows: Optional[int] = None) -> list[int]:
    """Layer counts per stage that minimise the largest per-stage training FLOPs per token.

    Blocks are added one at a time to the stage with the least training FLOPs so far (ties: the
    earlier stage), starting from one block each; the tail starts with its LM head (and, given
    ``rows`` per micro-batch, the head's recomputation, see :func:`stage_flops`), the others with
    their bottleneck projections. With identical blocks this greedy fill gives the smallest maximum.
    Raises :class:`ConfigError` when there are more stages than layers.
    """
    if not 1 <= stages <= model.n_layers:
        raise ConfigError(f"pipeline.stages={stages} must lie in [1, {model.n_layers}] (one layer per stage at least)")
    pcfg = PipelineConfig(stages=stages, compression_ratio=compression_ratio, identity_rank=identity_rank)
    block = 3 * block_flops_per_token(model, seq_len) + (_block_recompute_flops(model, seq_len) if checkpointing else 0)
    cost = [3 * _other_forward_flops(model, pcfg, s) + block for s in range(stages)]
    cost[-1] += _head_recompute_flops(model, seq_len, rows)
    counts = [1] * stages
    for _ in range(model.n_layers - stages):
        s = min(range(stages), key=lambda i: (cost[i], i))
        counts[s] += 1
        cost[s] += block
    return counts


@dataclass(frozen=True)
class StageTiming:
    """Seconds per token of one stage on an accelerator at a given MFU (no network, no bubble).

    ``forward_s``: forward; ``backward_s``: backward (2 x forward) plus the recomputed forwards
    (blocks with checkpointing, the tail's chunked LM head); ``input_backward_s``: a backward that
    computes only the input gradient (1 x forward, plus the recomputation; a micro-batch a stage
    serves without training on it);
    ``step_s``: one inner optimizer step (memory-bound: params x :data:`OPTIMIZER_STEP_BYTES` /
    memory bandwidth), per inner step, not per token.
    """

    forward_s: float
    backward_s: float
    step_s: float
    input_backward_s: float = 0.0

    def per_token(self, tokens_per_step: int) -> float:
        """Seconds per trained token, the optimizer step spread over the inner step's tokens."""
        return self.forward_s + self.backward_s + self.step_s / max(1, tokens_per_step)


def stage_timing(flops: StageFlops, params: int, acc: Accelerator, mfu: float, checkpointing: bool) -> StageTiming:
    rate = acc.peak_flops * mfu
    fwd = flops.forward / rate
    recompute = flops.recompute(checkpointing)
    bwd = (2 * flops.forward + recompute) / rate
    return StageTiming(fwd, bwd, params * OPTIMIZER_STEP_BYTES / acc.memory_bandwidth,
                       input_backward_s=(flops.forward + recompute) / rate)


# ------------------------------------------------------------------------------------ memory
class _FlashAttentionSaved(torch.autograd.Function):
    """Stands in for SDPA's flash kernel on ``meta``: saves q, k, v, the output and the fp32
    log-sum-exp [B, H, T] (FlashAttention-2, Dao 2023, arXiv 2307.08691, algorithm 1)."""

    @staticmethod
    def forward(ctx, q, k, v):                       # [B, H, T, D] each
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


class _AutocastBF16(TorchFunctionMode):
    """What ``torch.autocast("cuda", torch.bfloat16)`` does to this model's matmuls, on any device:
    linears run on bf16 copies of input and weight (weight casts cached per forward, as autocast does),
    attention on bf16 q, k, v through :class:`_FlashAttentionSaved`. Everything else is untouched
    (fp32 residual stream, fp32 norms and loss, as under autocast)."""

    def __init__(self, autocast_bf16: bool = True, flash_attention: bool = True) -> None:
        super().__init__()
        self.autocast_bf16, self.flash_attention = autocast_bf16, flash_attention
        self.weight_copies: dict[int, torch.Tensor] = {}

    def _cast(self, t: torch.Tensor) -> torch.Tensor:
        return t if (t.dtype == torch.bfloat16 or not self.autocast_bf16) else t.to(torch.bfloat16)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and self.autocast_bf16:
            x, w = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if id(w) not in self.weight_copies:
                self.weight_copies[id(w)] = self._cast(w)
            return F.linear(self._cast(x), self.weight_copies[id(w)], None if bias is None else self._cast(bias))
        if func is F.scaled_dot_product_attention and self.flash_attention:
            q, k, v = (self._cast(t) for t in args[:3])
            return _FlashAttentionSaved.apply(q, k, v)
        return func(*args, **kwargs)


@dataclass(frozen=True)
class ActivationMeasure:
    """Bytes one micro-batch keeps for its backward at one stage (measured on ``meta``).

    ``saved_bytes``: all of it; ``weight_copy_bytes``: the part that is bf16 copies of weights;
    ``largest_block_bytes``: the largest saved set of one block without checkpointing (what a
    checkpointed block re-materialises in the backward); ``largest_tensor_bytes``: the largest
    single saved storage.
    """

    saved_bytes: int
    weight_copy_bytes: int
    largest_block_bytes: int
    largest_tensor_bytes: int


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def measure_activations(module: PipelineStage, rows: int, seq_len: int, *, checkpointing: bool,
                        autocast_bf16: bool = True, flash_attention: bool = True) -> ActivationMeasure:
    """Run one training forward of ``module`` on ``rows`` x ``seq_len`` tokens and measure what it keeps
    for the backward. ``module`` lives on ``meta`` (no memory used) or any real device (same bytes:
    the tests check it on CPU). ``autocast_bf16`` / ``flash_attention``: the GPU path (see
    :class:`_AutocastBF16`); both off measures the module exactly as it runs on a CPU."""
    spec = module.spec
    dev = next(module.parameters()).device
    persistent = {_storage_key(t) for t in [*module.parameters(), *module.buffers()]}
    persistent.update(_storage_key(t) for t in module._cos_sin(seq_len, dev))   # cached rope tables
    held: dict[int, tuple[int, str]] = {}    # storage -> (bytes, owner: block name or "")
    keep: list[torch.Tensor] = []            # keeps measured storages alive (their keys stay unique)
    where = [""]

    def note(t: torch.Tensor) -> None:
        k = _storage_key(t)
        if k not in persistent and k not in held:
            held[k] = (t.untyped_storage().nbytes(), where[0])
            keep.append(t)

    def pack(t: torch.Tensor) -> torch.Tensor:
        note(t)
        return t

    hooks = []
    for name, blk in module.layers.items():
        def pre(_m, args, name=name):
            where[0] = name
            note(args[0])                    # a checkpointed block keeps its input
        def post(_m, _args, _out):
            where[0] = ""
        hooks += [blk.register_forward_pre_hook(pre), blk.register_forward_hook(post)]
    was_ckpt, was_training = module.checkpointing, module.training
    module.checkpointing = checkpointing
    module.train()
    mode = _AutocastBF16(autocast_bf16, flash_attention)
    try:
        if spec.is_head:
            x = torch.zeros(rows, seq_len, dtype=torch.int64, device=dev)
        else:   # the stage input as the worker makes it: fp32, requires grad, held by the cache
            x = torch.zeros(rows, seq_len, spec.in_width, dtype=torch.float32, device=dev, requires_grad=True)
            note(x)
        targets = torch.zeros(rows, seq_len, dtype=torch.int64, device=dev) if spec.is_tail else None
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), mode:
            out = module(x, targets) if spec.is_tail else module(x)
        if not spec.is_tail:
            note(out)                        # the activation cache keeps the output
        copies = {_storage_key(t) for t in mode.weight_copies.values()}
    finally:
        for h in hooks:
            h.remove()
        module.checkpointing = was_ckpt
        module.train(was_training)
    per_block: dict[str, int] = {}
    for nbytes, owner in held.values():
        if owner:
            per_block[owner] = per_block.get(owner, 0) + nbytes
    return ActivationMeasure(saved_bytes=sum(n for n, _ in held.values()),
                             weight_copy_bytes=sum(held[k][0] for k in copies if k in held),
                             largest_block_bytes=max(per_block.values(), default=0),
                             largest_tensor_bytes=max((n for n, _ in held.values()), default=0))


# ------------------------------------------------------------------------------------ the plan
@dataclass(frozen=True)
class StagePlan:
    """One stage replica on one accelerator; every ``*_bytes`` in bytes (see the module docstring)."""

    stage: int
    layers: list[int]                       # [first, last + 1)
    params: int
    weights_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    merge_bytes: int
    state_bytes: int
    microbatch_rows: int
    seq_len: int
    activation_checkpointing: bool
    activation_bytes_per_microbatch: int
    activation_bytes_no_checkpointing: int
    activation_bytes_checkpointing: int
    weight_copy_bytes_per_microbatch: int
    workspace_bytes: int
    reserve_bytes: int
    holds_microbatches: bool                # False for the tail (backward right after forward)
    microbatches_in_flight_needed: int
    microbatches_in_flight_max: int
    rows_in_flight: int
    activation_cache_bound_bytes: int
    total_bytes: int
    gpu_mem_bytes: int
    fits: bool
    forward_flops_per_token: int
    train_flops_per_token: int
    precision: str = "bf16"                 # train.precision the activations were measured at
    host: Optional[dict] = None             # host memory, disk and device -> host bytes (iota_subnet.host_plan)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def _with_stages(cfg: RunConfig, stages: Optional[int]) -> RunConfig:
    """``cfg`` with ``stages`` stages; a layer split written for another stage count is replaced by
    :func:`balanced_layer_split`."""
    if stages is None or stages == cfg.pipeline.stages:
        return cfg
    p = cfg.pipeline
    split = balanced_layer_split(cfg.model, stages, cfg.data.seq_len, compression_ratio=p.compression_ratio,
                                 identity_rank=p.identity_rank, checkpointing=cfg.train.activation_checkpointing,
                                 rows=cfg.train.micro_batch)
    return replace(cfg, pipeline=replace(p, stages=stages, layer_split=split)).validate()


def _buffer_bytes(module: torch.nn.Module) -> int:
    """Bytes of ``module``'s state_dict entries that are not parameters (persistent buffers)."""
    params = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    return sum(t.numel() * t.element_size() for n, t in module.state_dict().items() if n not in params)


def meta_stage(cfg: RunConfig, stage: int) -> PipelineStage:
    """Stage ``stage`` of ``cfg`` built on the ``meta`` device (shapes only, no memory)."""
    with torch.device("meta"):
        return make_stage(cfg.model, cfg.pipeline, stage, init=False,
                          checkpointing=cfg.train.activation_checkpointing)


def plan_stage(cfg: RunConfig, stage: int, gpu_mem_bytes: int, *, checkpointing: Optional[bool] = None,
               in_flight: Optional[int] = None, reserve_bytes: int = DEFAULT_RESERVE_BYTES,
               module: Optional[PipelineStage] = None) -> StagePlan:
    """The plan of one stage of ``cfg`` on ``gpu_mem_bytes`` of device memory.

    ``checkpointing``: True / False, or None for the config's ``train.activation_checkpointing``.
    ``in_flight``: micro-batches a non-tail stage must hold for ``fits`` (default: 1F1B's S - stage).
    """
    S, T, rows = cfg.pipeline.stages, cfg.data.seq_len, cfg.train.micro_batch
    if getattr(cfg.model, "hf", None) is not None:
        raise ConfigError(f"the memory plan measures the project's own stages; this run's model is a transformers "
                          f"family ({cfg.model.name}), whose activations are not measured yet: size its hosts by "
                          "running a stage (iota-subnet localnet on one machine) instead")
    if not 0 <= stage < S:
        raise ConfigError(f"stage {stage} out of range for {S} stages")
    if in_flight is not None and in_flight < 1:
        raise ConfigError(f"--in-flight {in_flight}: a stage holds at least 1 micro-batch")
    if reserve_bytes < 0 or gpu_mem_bytes <= 0:
        raise ConfigError("--gpu-mem must be positive and --reserve at least 0")
    ckpt = cfg.train.activation_checkpointing if checkpointing is None else bool(checkpointing)
    m = module if module is not None else meta_stage(cfg, stage)
    P = m.param_count()
    merge = MERGE_BYTES * P if cfg.merge.enabled else 0          # host memory, not the accelerator's
    state = (WEIGHT_BYTES + GRAD_BYTES + OPTIMIZER_BYTES) * P
    bf16 = cfg.train.precision == "bf16"
    full = measure_activations(m, rows, T, checkpointing=False, autocast_bf16=bf16)
    light = measure_activations(m, rows, T, checkpointing=True, autocast_bf16=bf16)
    act = light if ckpt else full
    workspace = (full.largest_block_bytes if ckpt else 0) + 2 * act.largest_tensor_bytes
    holds = not m.spec.is_tail
    needed = max(1, in_flight if (in_flight is not None and holds) else (S - stage if holds else 1))
    free = gpu_mem_bytes - state - workspace - reserve_bytes
    if holds:
        max_mb = max(0, free // act.saved_bytes) if act.saved_bytes else 0
    else:
        max_mb = 1 if free >= act.saved_bytes else 0
    total = state + workspace + reserve_bytes + needed * act.saved_bytes
    flops = stage_flops(cfg.model, cfg.pipeline, T, stage, rows)
    layers = m.spec.layers
    return StagePlan(
        stage=stage, layers=[layers.start, layers.stop], params=P,
        weights_bytes=WEIGHT_BYTES * P, grad_bytes=GRAD_BYTES * P, optimizer_bytes=OPTIMIZER_BYTES * P,
        merge_bytes=merge, state_bytes=state, microbatch_rows=rows, seq_len=T, activation_checkpointing=ckpt,
        activation_bytes_per_microbatch=act.saved_bytes, activation_bytes_no_checkpointing=full.saved_bytes,
        activation_bytes_checkpointing=light.saved_bytes, weight_copy_bytes_per_microbatch=act.weight_copy_bytes,
        workspace_bytes=workspace, reserve_bytes=reserve_bytes, holds_microbatches=holds,
        microbatches_in_flight_needed=needed, microbatches_in_flight_max=int(max_mb),
        rows_in_flight=int(max_mb) * rows, activation_cache_bound_bytes=int(max_mb) * act.saved_bytes if holds else 0,
        total_bytes=total, gpu_mem_bytes=int(gpu_mem_bytes), fits=bool(total <= gpu_mem_bytes and max_mb >= needed),
        forward_flops_per_token=flops.forward, train_flops_per_token=flops.train(ckpt),
        precision=cfg.train.precision,
        host=host_plan(cfg, stage, P, [tuple(p.shape) for p in m.parameters()], flops.train(ckpt),
                       state_extra_bytes=_buffer_bytes(m)).to_json())


def plan(cfg: RunConfig, gpu_mem_bytes: int, *, stages: Optional[int] = None, checkpointing: Optional[bool] = None,
         auto_checkpointing: bool = False, in_flight: Optional[int] = None,
         reserve_bytes: int = DEFAULT_RESERVE_BYTES) -> list[StagePlan]:
    """:func:`plan_stage` for every stage (with ``stages`` overriding the config's stage count).

    ``auto_checkpointing``: per stage, checkpoint only when the stage does not fit without it.
    """
    cfg = _with_stages(cfg, stages)
    out = []
    for s in range(cfg.pipeline.stages):
        m = meta_stage(cfg, s)
        kw = dict(in_flight=in_flight, reserve_bytes=reserve_bytes, module=m)
        if auto_checkpointing:
            p = plan_stage(cfg, s, gpu_mem_bytes, checkpointing=False, **kw)
            if not p.fits:
                p = plan_stage(cfg, s, gpu_mem_bytes, checkpointing=True, **kw)
        else:
            p = plan_stage(cfg, s, gpu_mem_bytes, checkpointing=checkpointing, **kw)
        out.append(p)
    return out


def require_fit(cfg: RunConfig, stage: int, gpu_mem_bytes: int, *, device_name: str = "this device") -> StagePlan:
    """The stage's plan on ``gpu_mem_bytes``; :class:`ConfigError` with the plan table when it does not fit
    (a miner refuses to start rather than run out of memory mid-run)."""
    p = plan_stage(cfg, stage, gpu_mem_bytes)
    if not p.fits:
        hint = "" if p.activation_checkpointing else "turn on train.activation_checkpointing, "
        raise ConfigError(f"stage {stage} does not fit {device_name} ({gpu_mem_bytes / GIB:.1f} GiB):\n"
                          f"{format_table([p])}\n{hint}use more stages, or a device with more memory")
    return p


# ------------------------------------------------------------------------------------ throughput
def stage_timings(cfg: RunConfig, acc: Accelerator, mfu: float,
                  checkpointing: Optional[list[bool] | bool] = None) -> list[StageTiming]:
    """:class:`StageTiming` of every stage of ``cfg`` (``checkpointing``: one flag for all stages, a
    flag per stage, or None for the config's)."""
    S = cfg.pipeline.stages
    if checkpointing is None or isinstance(checkpointing, bool):
        flags = [cfg.train.activation_checkpointing if checkpointing is None else checkpointing] * S
    else:
        flags = list(checkpointing)
    out = []
    for s in range(S):
        P = meta_stage(cfg, s).param_count()
        flops = stage_flops(cfg.model, cfg.pipeline, cfg.data.seq_len, s, cfg.train.micro_batch)
        out.append(stage_timing(flops, P, acc, mfu, flags[s]))
    return out


def ideal_tokens_per_s(timings: list[StageTiming], replicas: int, tokens_per_step: int) -> float:
    """``replicas`` x the token rate of the slowest stage: the throughput of the pipeline with no
    network and no bubble (tokens/s, in the accelerator's time)."""
    if replicas < 1 or not timings:
        raise ValueError("need at least one stage and one replica")
    return replicas / max(t.per_token(tokens_per_step) for t in timings)


# ------------------------------------------------------------------------------------ output
def _gib(n: int) -> str:
    return f"{n / GIB:.2f}"


def format_table(plans: list[StagePlan]) -> str:
    """A plain-text table of :func:`plan`'s result (GiB)."""
    head = ("stage", "layers", "params", "state GiB", "act/mb GiB", "ckpt", "mb needed", "mb max",
            "rows in flight", "cache bound GiB", "total GiB", "gpu GiB", "fits")
    rows = [head]
    for p in plans:
        rows.append((str(p.stage), f"{p.layers[0]}-{p.layers[1] - 1}", f"{p.params:,}", _gib(p.state_bytes),
                     _gib(p.activation_bytes_per_microbatch), "on" if p.activation_checkpointing else "off",
                     str(p.microbatches_in_flight_needed), str(p.microbatches_in_flight_max), str(p.rows_in_flight),
                     _gib(p.activation_cache_bound_bytes), _gib(p.total_bytes), _gib(p.gpu_mem_bytes),
                     "yes" if p.fits else "NO"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows)


def plans_json(plans: list[StagePlan]) -> str:
    """A JSON array, one object per stage, one stage per line."""
    return "[\n" + ",\n".join(json.dumps(p.to_json()) for p in plans) + "\n]"


def summary_note(plans: list[StagePlan]) -> str:
    bad = [p.stage for p in plans if not p.fits]
    if not bad:
        return "every stage fits"
    return (f"stage(s) {bad} do not fit: turn on train.activation_checkpointing, use more stages, fewer rows per "
            "micro-batch, or a device with more memory")


__all__ = ["StageFlops", "StageTiming", "StagePlan", "ActivationMeasure", "stage_flops", "balanced_layer_split",
           "stage_timing", "stage_timings", "ideal_tokens_per_s", "measure_activations", "meta_stage", "plan_stage",
           "plan", "require_fit", "format_table", "plans_json", "summary_note"]
