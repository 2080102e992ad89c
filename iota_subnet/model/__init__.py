"""Llama-3 style model split into pipeline stages with residual-bottleneck boundaries."""
from iota_subnet.config import bottleneck_dims, split_layers
from iota_subnet.model.bottleneck import BottleneckDecoder, BottleneckEncoder
from iota_subnet.model.llama import Block, RMSNorm, rope_cos_sin
from iota_subnet.model.stages import PipelineStage, StagedModel, StageSpec, build_model, build_stages, make_stage

__all__ = ["Block", "RMSNorm", "rope_cos_sin", "BottleneckEncoder", "BottleneckDecoder", "bottleneck_dims",
           "PipelineStage", "StagedModel", "StageSpec", "build_model", "build_stages", "make_stage", "split_layers"]
