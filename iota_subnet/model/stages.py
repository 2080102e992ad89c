"""Pipeline stages: a model config plus a split gives S stage modules.

* head stage (0): token embedding + its blocks (+ bottleneck encoder)
* body stages: (bottleneck decoder +) blocks (+ bottleneck encoder)
* tail stage (S-1): (bottleneck decoder +) blocks + final RMSNorm + LM head + cross-entropy loss

A single stage (S = 1) is the whole model. Parameter names are global (``layers.5.mlp.up_proj.weight``),
so the state dicts of S stages together equal the state dict of the one-stage model plus the
bottleneck parameters (``bottleneck_in.*`` / ``bottleneck_out.*``).

Inputs and outputs (B rows, T tokens, d width, b wire width, V vocab):
  head input: token ids int64 [B, T];   other stages: activations float [B, T, b]
  non-tail output: activations [B, T, b];  tail output: scalar mean loss (nats/token) given
  targets [B, T], else logits [B, T, V].
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint
from loguru import logger

from iota_subnet.config import ConfigError, ModelConfig, PipelineConfig, RunConfig, bottleneck_dims, split_layers
from iota_subnet.model.bottleneck import BottleneckDecoder, BottleneckEncoder
from iota_subnet.model.spec import StageSpec
from iota_subnet.model.llama import Block, RMSNorm, block_flops_per_token, init_weights, rope_cos_sin


#: The tail computes the LM head and cross-entropy over at most this many bytes of fp32 logits at a
#: time (the whole [rows x T, vocab] logits of an ``8b`` tail are ~1 GB per 2,048-token row).
CE_CHUNK_BYTES = 256 << 20


def ce_chunk_tokens(vocab_size: int, chunk_bytes: Optional[int] = None) -> int:
    """Tokens per chunk of :func:`lm_head_cross_entropy` (at least 1): ``chunk_bytes`` (default
    :data:`CE_CHUNK_BYTES`) of fp32 logits."""
    return max(1, int(CE_CHUNK_BYTES if chunk_bytes is None else chunk_bytes) // (4 * vocab_size))


def lm_head_recomputed(tokens: int, vocab_size: int, chunk_bytes: Optional[int] = None) -> bool:
    """Whether a training forward over ``tokens`` tokens (rows x T) at the tail runs the LM head a
    second time in its backward: :func:`lm_head_cross_entropy` checkpoints its chunks when the logits
    take more than one chunk (2 x d x V FLOPs per token more), whatever ``activation_checkpointing`` says."""
    return tokens > ce_chunk_tokens(vocab_size, chunk_bytes)


def lm_head_cross_entropy(h: torch.Tensor, lm_head: nn.Linear, targets: torch.Tensor,
                          chunk_bytes: int = CE_CHUNK_BYTES) -> torch.Tensor:
    """Mean cross-entropy (nats/token) of ``lm_head(h)`` against ``targets``, computed in chunks of
    tokens so that at most ``chunk_bytes`` of fp32 logits exist at once, in the forward and in the
    backward (each chunk is recomputed in the backward, ``torch.utils.checkpoint``: Chen et al. 2016).

    h: [B, T, d] (after the final norm); targets: int64 [B, T]. Returns a scalar. With one chunk
    (small vocabularies) it is plain ``F.cross_entropy`` over the whole logits."""
    d, V = h.shape[-1], lm_head.out_features
    hf, tf = h.reshape(-1, d), targets.reshape(-1)
    n = hf.shape[0]
    chunk = ce_chunk_tokens(V, chunk_bytes)
    if n <= chunk:
        return F.cross_entropy(lm_head(hf).float(), tf)

    def ce_sum(hc: torch.Tensor, tc: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(lm_head(hc).float(), tc, reduction="sum")
    total = None
    for o in range(0, n, chunk):
        hc, tc = hf[o:o + chunk], tf[o:o + chunk]
        part = (torch.utils.checkpoint.checkpoint(ce_sum, hc, tc, use_reentrant=False) if torch.is_grad_enabled()
                else ce_sum(hc, tc))
        total = part if total is None else total + part
    return total / n


class PipelineStage(nn.Module):
    """One pipeline stage. See the module docstring for inputs and outputs.

    ``checkpointing``: per-block activation checkpointing in training (``train.activation_checkpointing``):
    keep only each block's input for the backward and recompute the block there
    (``torch.utils.checkpoint``, non-reentrant; Chen et al. 2016, arXiv 1604.06174).
    ``ce_chunk_bytes``: see :func:`lm_head_cross_entropy`.
    """

    def __init__(self, cfg: ModelConfig, pcfg: PipelineConfig, index: int, *, init: bool = True,
                 checkpointing: bool = False, ce_chunk_bytes: int = CE_CHUNK_BYTES):
        super().__init__()
        #: per-block activation checkpointing in training: only block inputs are kept for backward
        self.checkpointing = bool(checkpointing)
        self.ce_chunk_bytes = int(ce_chunk_bytes)
        cfg.validate()
        ranges = split_layers(cfg.n_layers, pcfg.stages, pcfg.layer_split)
        if not 0 <= index < pcfg.stages:
            raise ConfigError(f"stage index {index} out of range for pipeline.stages={pcfg.stages}")
        b, r = bottleneck_dims(cfg, pcfg)
        self.cfg, self.pcfg = cfg, pcfg
        self.compressed = pcfg.compression_ratio > 1
        n = pcfg.stages
        self.spec = StageSpec(index, n, ranges[index],
                              None if index == 0 else b, None if index == n - 1 else b)
        if cfg.tie_embeddings and n > 1:
            logger.warning("tie_embeddings is ignored when the model is split into stages (head and tail live apart)")
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim) if self.spec.is_head else None
        self.bottleneck_in = BottleneckDecoder(cfg, b, r) if (not self.spec.is_head and self.compressed) else None
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in self.spec.layers})
        self.bottleneck_out = BottleneckEncoder(cfg, b, r) if (not self.spec.is_tail and self.compressed) else None
        if self.spec.is_tail:
            self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
            self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        else:
            self.norm = self.lm_head = None
        self._tied = bool(cfg.tie_embeddings and n == 1)
        if init:
            init_weights(self, cfg)
        if self._tied:
            self.lm_head.weight = self.embed_tokens.weight
        self._rope: dict = {}

    # ---- bookkeeping -------------------------------------------------------------------------
    def param_count(self) -> int:
        """Number of parameters held by this stage (tied weights counted once)."""
        return sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())

    def flops_per_token(self, seq_len: int, training: bool = True) -> int:
        """FLOPs per token through this stage: forward = 2 x matmul params + attention
        (PaLM, Chowdhery et al. 2022, appendix B); training (forward + backward) = 3 x forward."""
        f = len(self.spec.layers) * block_flops_per_token(self.cfg, seq_len)
        if self.lm_head is not None:
            f += 2 * self.cfg.dim * self.cfg.vocab_size
        for bn in (self.bottleneck_in, self.bottleneck_out):
            if bn is not None and bn.proj is not None:
                f += 2 * bn.proj.weight.numel()
        return 3 * f if training else f

    def _cos_sin(self, T: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (T, str(device))
        if key not in self._rope:
            self._rope[key] = rope_cos_sin(self.cfg, T, device)
        return self._rope[key]

    # ---- compute -----------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        """head: x int64 [B, T]; others: x float [B, T, in_width].
        Returns [B, T, out_width] activations, or for the tail the mean loss (scalar, nats per
        token) when ``targets`` [B, T] is given, else logits [B, T, V]."""
        if self.spec.is_head:
            if x.dtype not in (torch.int64, torch.int32):
                raise TypeError(f"stage 0 takes token ids (int64 [B, T]), got {x.dtype}")
            h = self.embed_tokens(x)                                           # [B, T, d]
        else:
            if x.dim() != 3 or x.shape[-1] != self.spec.in_width:
                raise ValueError(f"stage {self.spec.index} takes activations [B, T, {self.spec.in_width}], got {tuple(x.shape)}")
            h = self.bottleneck_in(x) if self.bottleneck_in is not None else x  # [B, T, d]
        T = h.shape[1]
        cos, sin = self._cos_sin(T, h.device)
        recompute = self.checkpointing and self.training and torch.is_grad_enabled()
        for blk in self.layers.values():
            if recompute:   # keeps h only; the block runs again in the backward
                h = torch.utils.checkpoint.checkpoint(blk, h, cos, sin, use_reentrant=False)
            else:
                h = blk(h, cos, sin)                                           # [B, T, d]
        if not self.spec.is_tail:
            return self.bottleneck_out(h) if self.bottleneck_out is not None else h   # [B, T, b]
        if targets is None:
            return self.lm_head(self.norm(h))                                  # [B, T, V]
        return lm_head_cross_entropy(self.norm(h), self.lm_head, targets, self.ce_chunk_bytes)


def make_stage(cfg: ModelConfig, pcfg: PipelineConfig, index: int, *, init: bool = True,
               checkpointing: bool = False, seed: int = 0) -> nn.Module:
    """Stage ``index`` of a run: a :class:`PipelineStage`, or for a ``transformers`` model
    (:class:`~iota_subnet.config_hf.HFModelConfig`) an
    :class:`~iota_subnet.model.hf_pipeline.HFPipelineStage` (same interface; its weights seeded by
    ``seed`` and their names, or read from the pretrained folder). A PipelineStage draws from torch's
    global generator (callers seed it, as :func:`build_stages` does)."""
    if getattr(cfg, "hf", None) is not None:
        from iota_subnet.model.hf_pipeline import HFPipelineStage
        return HFPipelineStage(cfg, pcfg, index, init=init, seed=seed, checkpointing=checkpointing)
    return PipelineStage(cfg, pcfg, index, init=init, checkpointing=checkpointing)


def build_stages(cfg: RunConfig | tuple[ModelConfig, PipelineConfig], seed: int = 0) -> list[PipelineStage]:
    """All S stages of a run, initialised from one seed (each stage from ``seed + index``);
    ``train.activation_checkpointing`` of a RunConfig applies to every stage."""
    mcfg, pcfg = (cfg.model, cfg.pipeline) if isinstance(cfg, RunConfig) else cfg
    ckpt = cfg.train.activation_checkpointing if isinstance(cfg, RunConfig) else False
    out = []
    for i in range(pcfg.stages):
        torch.manual_seed(seed + 1000 * i)
        out.append(make_stage(mcfg, pcfg, i, checkpointing=ckpt, seed=seed))
    return out


def build_model(cfg: ModelConfig, seed: int = 0) -> PipelineStage:
    """The whole model as one stage (no bottleneck)."""
    torch.manual_seed(seed)
    return PipelineStage(cfg, PipelineConfig(stages=1), 0)


class StagedModel(nn.Module):
    """Stages chained in one process (the co-located reference): tokens [B, T] -> loss.

    ``boundary``: applied to the activation ``[B, T, b]`` between consecutive stages (None: passed as
    it is), e.g. :class:`iota_subnet.train.wire_boundary.WireBoundary`, which rounds it (and its
    gradient in the backward pass) to the run's wire dtype as the network's miners do."""

    def __init__(self, stages: list[PipelineStage],
                 boundary: Optional[Callable[[torch.Tensor], torch.Tensor]] = None):
        super().__init__()
        self.stages = nn.ModuleList(stages)
        self.boundary = boundary

    def forward(self, tokens: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = tokens
        last = len(self.stages) - 1
        for i, st in enumerate(self.stages):
            if i and self.boundary is not None:
                x = self.boundary(x)
            x = st(x, targets) if i == last else st(x)
        return x

    def param_count(self) -> int:
        return sum(s.param_count() for s in self.stages)

    def flops_per_token(self, seq_len: int, training: bool = True) -> int:
        return sum(s.flops_per_token(seq_len, training) for s in self.stages)
