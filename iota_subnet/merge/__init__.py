"""Merging the replicas of a stage: DiLoCo outer steps over a verified butterfly all-reduce.

* :mod:`.plan`      who reduces which shard (deterministic from the epoch seed and the sorted
                    participants; no coordinator);
* :mod:`.outer`     the outer optimizer (Nesterov SGD on the mean pseudo-gradient) and payload
                    quantization (bf16, int8 with per-block scales; fp32 accumulation);
* :mod:`.engine`    the all-reduce state machine of one replica (join, scatter, reduce, gather with
                    the redundancy check, apply all-or-nothing);
* :mod:`.transport` the engine's peer calls: in-process (tests, benchmarks) and signed HTTP;
* :mod:`.sync`      state sync for joiners (multi-peer, chunked, hash-verified, resumable).
"""
from .engine import MergeEngine, MergeReport, ModuleParams, flat_numel
from .outer import dequantize, outer_step, quantize
from .plan import MergePlan, epoch_seed

__all__ = ["MergeEngine", "MergePlan", "MergeReport", "ModuleParams", "dequantize", "epoch_seed", "flat_numel",
           "outer_step", "quantize"]
