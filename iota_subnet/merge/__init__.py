"""Merging the replicas of a stage: DiLoCo outer steps over a verified butterfly all-reduce.

* :mod:`.plan`      who reduces which shard (deterministic from the epoch seed and the sorted
                    participants; no coordinator);
* :mod:`.outer`     the outer optimizer (Nesterov SGD on the mean pseudo-gradient) and payload
                    quantization (bf16, int8 with per-block scales; fp32 accumulation);
* :mod:`.engine`    the all-reduce state machine of one replica (epochs, attempts, the report), made of
                    :mod:`.join` (who takes part at a boundary), :mod:`.allreduce` (scatter, gather
                    with the redundancy check, third-party recompute, apply all-or-nothing) and
                    :mod:`.serve` (the reducer side: the routes peers call);
* :mod:`.params`    the flat float32 host copy of a stage's parameters the merge reads and writes;
* :mod:`.transport` the engine's peer calls: in-process (tests, benchmarks) and signed HTTP;
* :mod:`.sync`      state sync for joiners (multi-peer, chunked, hash-verified, resumable).
"""
from .engine import MergeEngine, MergeEngineOptions, MergeReport
from .outer import dequantize, outer_step, quantize
from .params import ModuleParams, flat_numel
from .plan import MergePlan, epoch_seed

__all__ = ["MergeEngine", "MergeEngineOptions", "MergePlan", "MergeReport", "ModuleParams", "dequantize", "epoch_seed",
           "flat_numel", "outer_step", "quantize"]
