"""The Python SDK: a run as a typed spec built from ``transformers`` / ``datasets`` objects, launched on a
local network, watched and exported (docs/hf-models.md, "Python SDK")::

    spec = RunSpec(model=Qwen2Config(...), data=DataSpec("corpus.jsonl", tokenizer="tok/"), stages=3, steps=20)
    run = launch_local(spec, replicas=2, out="runs/sdk")
    for p in run.watch(5):
        print(p.steps_done, p.steps_total, p.loss, p.tokens_per_s)
    run.export("trained/")

``spec.save("run.yaml")`` writes the same run as the file ``iota-subnet localnet --config`` takes.
"""
from .local import LocalRun, MinerProgress, RunProgress, launch_local
from .spec import DataSpec, RunSpec, canonical_yaml, config_hash

__all__ = ["DataSpec", "LocalRun", "MinerProgress", "RunProgress", "RunSpec", "canonical_yaml", "config_hash",
           "launch_local"]
