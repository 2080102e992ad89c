"""The content address of a run: :func:`canonical_yaml` (the resolved config as canonical YAML) and
:func:`config_hash` (its sha256), for any :class:`~iota_subnet.config.RunConfig` (a preset shape, a
hand-written YAML, an SDK :class:`~iota_subnet.sdk.RunSpec`).

A validator serves :func:`canonical_yaml` of its config (``GET /run/spec``) and advertises
:func:`config_hash` in its commitment (``h``, :mod:`iota_subnet.protocol.commitment`); a neuron given
the hash fetches the text, checks that its sha256 is the hash (:func:`iota_subnet.protocol.run_spec.verify_spec`)
and loads it with :func:`~iota_subnet.config.load_config`, which reads back the same config (the text is a
fixed point: its config's canonical YAML is the text itself).
"""
from __future__ import annotations

import hashlib
import json

import yaml

from iota_subnet.config import RunConfig
from iota_subnet.config_hf import HFModelConfig

#: keys of a ``transformers`` config dict that say where or when it was written, not what the model is
VOLATILE_HF_KEYS = ("transformers_version", "_name_or_path", "_commit_hash", "_attn_implementation_autoset")


def canonical_yaml(cfg: RunConfig) -> str:
    """The resolved config as YAML with sorted keys; a ``transformers`` model scratch-initialised is named
    by its config's content (keys that record where or when it was written dropped), not its folder.
    Local data and tokenizer files (and a pretrained start's folder) are named by their paths."""
    d = cfg.to_dict()
    m = cfg.model
    if isinstance(m, HFModelConfig):
        tc = json.loads(m.transformers_config().to_json_string(use_diff=False))
        for k in VOLATILE_HF_KEYS:
            tc.pop(k, None)
        d["model"] = {"hf": m.hf if m.init == "pretrained" else tc.get("model_type"), "init": m.init, "config": tc}
    return yaml.safe_dump(json.loads(json.dumps(d, default=str)), sort_keys=True)


def config_hash(cfg: RunConfig) -> str:
    """sha256 (64 lowercase hex) of :func:`canonical_yaml` (UTF-8): the content address of a run."""
    return hashlib.sha256(canonical_yaml(cfg).encode()).hexdigest()
