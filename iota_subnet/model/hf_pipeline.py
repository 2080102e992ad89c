"""A ``transformers`` family stage with the interface of :class:`~iota_subnet.model.stages.PipelineStage`,
so that a miner's stage worker, the validator and the co-located trainer hold it as they hold the
project's own stages.

Built from a run's :class:`~iota_subnet.config_hf.HFModelConfig` and ``PipelineConfig``: the layers are
split by :func:`~iota_subnet.model.hf_family.split_hf_layers` at the model's ``max_position_embeddings``
(a fixed length, so every neuron derives the same split whatever the run's rows), or by
``pipeline.layer_split`` counts. There is no bottleneck: the wire carries the hidden state
``[B, T, d]``. Parameter names are :class:`HFStage`'s (``transformers`` names, stage-local layer
indices).

Inputs and outputs as :class:`PipelineStage`: the head takes token ids int64 ``[B, T]``; the others
hidden states float ``[B, T, d]``; non-tail stages return ``[B, T, d]``; the tail returns the mean loss
(nats per trained target, :func:`~iota_subnet.model.lm_loss.masked_lm_loss`: targets equal to ``-100``
are not trained) when given targets ``[B, T]``, else logits ``[B, T, V]``.

Weights: ``init`` scratch draws every tensor from a generator seeded by the run seed and the tensor's
name (:func:`~iota_subnet.model.hf_family.init_stage_weights`: the same on every host); ``pretrained``
reads the stage's slice of the folder's safetensors (:mod:`iota_subnet.model.hf_folder`).
"""
from __future__ import annotations

import functools
from typing import Any, Optional

import torch
import torch.utils.checkpoint

from iota_subnet.config import ConfigError, PipelineConfig
from iota_subnet.model.hf_family import HFStage, init_stage_weights, layer_flops_per_token, split_hf_layers
from iota_subnet.model.lm_loss import masked_lm_loss
from iota_subnet.model.spec import StageSpec

HFModelConfig = Any
"""An :class:`iota_subnet.config_hf.HFModelConfig` (its ``transformers_config()``, ``max_seq_len``, ``init``, ``hf``)."""


def layer_ranges(pcfg: PipelineConfig) -> Optional[list[range]]:
    """``pipeline.layer_split`` (counts per stage) as decoder-layer ranges, or None (split by FLOPs)."""
    if pcfg.layer_split is None:
        return None
    out, start = [], 0
    for c in pcfg.layer_split:
        out.append(range(start, start + int(c)))
        start += int(c)
    return out


def hf_split(cfg: HFModelConfig, pcfg: PipelineConfig, hcfg=None) -> list[range]:
    """Decoder-layer ranges of the run's stages (see the module docstring). Raises ``StageSplitError``."""
    hcfg = hcfg if hcfg is not None else cfg.transformers_config()
    return split_hf_layers(hcfg, pcfg.stages, seq_len=cfg.max_seq_len, layer_ranges=layer_ranges(pcfg))


class HFPipelineStage(HFStage):
    """Stage ``index`` of a run whose model is a ``transformers`` family (see the module docstring).

    ``init``: set the weights (scratch: seeded by ``seed``; pretrained: read from the folder); False
    leaves PyTorch's defaults for weights loaded next (checkpoints, audits, shapes on the meta device).
    ``checkpointing``: recompute each decoder layer in the backward (``torch.utils.checkpoint``)."""

    def __init__(self, cfg: HFModelConfig, pcfg: PipelineConfig, index: int, *, init: bool = True, seed: int = 0,
                 checkpointing: bool = False):
        if not 0 <= index < pcfg.stages:
            raise ConfigError(f"stage index {index} out of range for pipeline.stages={pcfg.stages}")
        hcfg = cfg.transformers_config()
        ranges = hf_split(cfg, pcfg, hcfg)
        super().__init__(hcfg, index, pcfg.stages, ranges[index])
        self.cfg, self.pcfg = cfg, pcfg
        self.checkpointing = bool(checkpointing)
        if self.checkpointing:      # the family's own switch (transformers' GradientCheckpointingLayer)
            for layer in self.layers:
                layer.gradient_checkpointing = True
                layer._gradient_checkpointing_func = functools.partial(torch.utils.checkpoint.checkpoint,
                                                                       use_reentrant=False)
        d, n = hcfg.hidden_size, pcfg.stages
        self.spec = StageSpec(index, n, ranges[index], None if index == 0 else d, None if index == n - 1 else d)
        if init:
            if cfg.init == "pretrained":
                from iota_subnet.model.hf_folder import read_layout, read_stage_tensors
                from iota_subnet.model.hf_family import load_stage_state
                load_stage_state(self, read_stage_tensors(self, read_layout(cfg.hf)))
            else:
                init_stage_weights(self, seed)

    def param_count(self) -> int:
        return sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())

    def flops_per_token(self, seq_len: int, training: bool = True) -> int:
        """Forward FLOPs per token (:func:`layer_flops_per_token`, plus ``2 d V`` for the LM head);
        training counts 3 x forward, as :meth:`PipelineStage.flops_per_token`."""
        per = layer_flops_per_token(self.config, seq_len)
        f = sum(per[i] for i in self.layer_range)
        if self.is_last:
            f += 2 * self.config.hidden_size * self.config.vocab_size
        return 3 * f if training else f

    def forward(self, x: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        """See the module docstring. Raises ``TypeError`` / ``ValueError`` for inputs of the wrong kind."""
        if self.is_first:
            if x.dtype not in (torch.int64, torch.int32):
                raise TypeError(f"stage 0 takes token ids (int64 [B, T]), got {x.dtype}")
        elif x.dim() != 3 or x.shape[-1] != self.spec.in_width:
            raise ValueError(f"stage {self.index} takes hidden states [B, T, {self.spec.in_width}], got {tuple(x.shape)}")
        out = super().forward(x)
        if targets is None or not self.is_last:
            return out
        return masked_lm_loss(out, targets)
