"""Run configs that bring a ``transformers`` model family and a ``datasets`` dataset.

A run config may name a Hugging Face model instead of a preset shape, and a dataset instead of
``--data``::

    model: {hf: path/to/folder_with_config.json, init: scratch}     # or pretrained (the folder's weights)
    model: {hf: qwen2, config: {hidden_size: 256, num_hidden_layers: 6, ...}}   # a model_type + its fields
    data: {hf: {path: corpus.jsonl, text_field: text, mask_field: null}, tokenizer: path/to/tokenizer_folder,
           seq_len: 256}

``model.config`` overrides keys of the folder's ``config.json`` (or gives them, for a bare
``model_type``). The run then holds an :class:`HFModelConfig` (a :class:`ModelConfig` whose shape
fields are read from the ``transformers`` config, so width, vocabulary and layer counts read the same
everywhere) and an :class:`HFDataConfig` (``data.hf`` is a
:class:`~iota_subnet.data.hf_datasets.DatasetSpec` mapping; ``data.tokenizer`` the local tokenizer
folder). Paths are made absolute at load (relative ones are read from the working directory, else from
the config file's folder), so the config written for a run's neurons names the same files.

Limits of a network run with such a model (refused at load with a :class:`ConfigError` naming the fix):
``pipeline.compression_ratio`` must be 1 (no bottleneck), and ``tie_word_embeddings`` needs one stage
(tied copies on two hosts need an all-reduce between the first and the last stage's holders).
``pipeline.layer_split`` gives layer counts per stage; unset, the layers are split by FLOPs
(:func:`~iota_subnet.model.hf_family.split_hf_layers`).

Errors: :class:`ConfigError` and its ``transformers``-side subclasses
(:class:`~iota_subnet.model.hf_family.UnsupportedFamilyError`, ``StageSplitError``) for the model;
:class:`~iota_subnet.data.sources.DataError` subclasses (``DatasetFieldError``,
``TokenizerMismatchError``) for the data; every one is a ``UserError`` (exit code 2).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from iota_subnet.config import ConfigError, DataConfig, ModelConfig
from iota_subnet.config_kinds import MODEL_KINDS, ModelKind

INITS = ("scratch", "pretrained")
_MODEL_KEYS = {"hf", "init", "config"}


@dataclass(frozen=True)
class HFModelConfig(ModelConfig):
    """A ``transformers`` model: ``hf`` (an absolute folder holding ``config.json``, or a ``model_type``),
    ``hf_config`` (keys overriding or giving the ``config.json`` fields), ``init`` (``scratch``: per-name
    seeded init as ``transformers``' ``_init_weights``; ``pretrained``: the folder's safetensors). The
    inherited shape fields mirror the ``transformers`` config (``dim`` = ``hidden_size``, ...)."""

    hf: str = ""
    hf_config: dict = field(default_factory=dict)
    init: str = "scratch"

    def validate(self) -> "HFModelConfig":
        for k in ("n_heads", "n_kv_heads", "dim", "n_layers", "ffn_dim", "vocab_size", "max_seq_len"):
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"model.config.{k} (from the transformers config) must be a positive integer, got {v!r}")
        return self

    def transformers_config(self):
        """The ``transformers`` config object (a fresh copy; :func:`~iota_subnet.model.hf_family.load_hf_config`)."""
        from iota_subnet.model.hf_family import load_hf_config
        if Path(self.hf).is_dir():
            cfg = load_hf_config(self.hf)
            if self.hf_config:          # rebuilt, so that what the class derives (layer_types, rope) follows
                cfg = load_hf_config({**cfg.to_dict(), **self.hf_config})
            return cfg
        return load_hf_config({"model_type": self.hf, **self.hf_config})

    def user_dict(self) -> dict:
        """The ``model`` section as a config file gives it (what :func:`hf_model_config` reads back)."""
        return {"hf": self.hf, "init": self.init, "config": dict(self.hf_config)}


@dataclass(frozen=True)
class HFDataConfig(DataConfig):
    """A ``datasets`` dataset: ``hf`` is a :class:`~iota_subnet.data.hf_datasets.DatasetSpec` mapping
    (``path`` absolute when local); ``tokenizer`` (inherited) is the model's local tokenizer folder."""

    hf: dict = field(default_factory=dict)


def is_hf_model_section(raw: Any) -> bool:
    return isinstance(raw, dict) and "hf" in raw


def _abs(path: str, base: Optional[Path], what: str, must_exist: bool) -> str:
    p = Path(str(path)).expanduser()
    if p.is_absolute():
        cand = [p]
    else:
        cand = [Path.cwd() / p] + ([base / p] if base is not None else [])
    for c in cand:
        if c.exists():
            return str(c.resolve())
    if must_exist:
        raise ConfigError(f"{what} {str(path)!r} does not exist (looked in {', '.join(str(c) for c in cand)}); "
                          "give an existing local folder or file (absolute, or relative to the config file)")
    return str(path)


def hf_model_config(raw: dict, base: Optional[Path] = None) -> HFModelConfig:
    """``model: {hf: ..., init: ..., config: {...}}`` -> :class:`HFModelConfig` (the ``transformers``
    config is read and checked: supported family, positive shape). Raises :class:`ConfigError`."""
    from iota_subnet.model.hf_family import FAMILIES, UnsupportedFamilyError
    unknown = sorted(set(raw) - _MODEL_KEYS)
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown} in a transformers model section; allowed: {sorted(_MODEL_KEYS)} "
                          "(put transformers config fields under model.config)")
    src, init = raw.get("hf"), raw.get("init", "scratch")
    over = raw.get("config") or {}
    if not isinstance(src, str) or not src:
        raise ConfigError(f"model.hf must be a local folder holding config.json or a model_type "
                          f"({', '.join(sorted(FAMILIES))}), got {src!r}")
    if not isinstance(over, dict):
        raise ConfigError(f"model.config must be a mapping of transformers config fields, got {over!r}")
    if init not in INITS:
        raise ConfigError(f"model.init={init!r} unknown; choose one of {list(INITS)}")
    if src not in FAMILIES:
        looks_like_type = "/" not in src and not Path(src).expanduser().exists() and \
            (base is None or not (base / src).exists())
        if looks_like_type:
            raise UnsupportedFamilyError(
                f"model.hf={src!r} is neither a local folder holding config.json nor a supported model_type; "
                f"supported: {', '.join(sorted(FAMILIES))}. Give a folder written by save_pretrained or one of these types")
        src = _abs(src, base, "model.hf folder", True)
        if init == "pretrained":
            from iota_subnet.model.hf_folder import read_layout
            read_layout(src)            # CheckpointFolderError: no safetensors to start from
    elif init == "pretrained":
        raise ConfigError(f"model.init=pretrained needs model.hf to be a checkpoint folder (config.json and "
                          f"safetensors), not the bare model_type {src!r}; use init: scratch or give the folder")
    m = HFModelConfig(hf=src, hf_config=dict(over), init=init)
    c = m.transformers_config()
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    scaling = getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {}
    theta = float(scaling.get("rope_theta", getattr(c, "rope_theta", 10000.0)) if isinstance(scaling, dict)
                  else getattr(c, "rope_theta", 10000.0))
    return dataclasses.replace(
        m, name=f"hf-{c.model_type}-hd{hd}", vocab_size=c.vocab_size, dim=c.hidden_size, n_layers=c.num_hidden_layers,
        n_heads=c.num_attention_heads, n_kv_heads=c.num_key_value_heads, ffn_dim=c.intermediate_size,
        max_seq_len=c.max_position_embeddings, rope_theta=theta, norm_eps=float(c.rms_norm_eps),
        tie_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
        init_std=float(getattr(c, "initializer_range", 0.02))).validate()


def hf_data_raw(raw: dict, base: Optional[Path]) -> dict:
    """The ``data`` section of an HF run with local paths made absolute (``hf.path``, ``tokenizer``).
    Raises :class:`ConfigError` for a missing tokenizer or a ``data.hf`` that is not a mapping."""
    from iota_subnet.data.hf_datasets import DatasetSpec
    d = dict(raw)
    spec = d.get("hf")
    if not isinstance(spec, dict):
        raise ConfigError(f"data.hf must be a mapping such as {{path: corpus.jsonl, text_field: text}}, got {spec!r}")
    spec = dataclasses.asdict(DatasetSpec.from_mapping(spec))
    p = Path(spec["path"]).expanduser()
    if p.is_absolute() or p.exists() or (base is not None and (base / p).exists()) or spec["path"].startswith((".", "~")) \
            or p.suffix:
        spec["path"] = _abs(spec["path"], base, "data.hf.path", True)
    d["hf"] = spec
    if not d.get("tokenizer"):
        raise ConfigError("data.hf needs data.tokenizer: the model's local tokenizer folder (tokenizer.json, as "
                          "save_pretrained writes it)")
    d["tokenizer"] = _abs(d["tokenizer"], base, "data.tokenizer folder", True)
    return d


def check_hf_run(cfg, *, data: bool = True) -> None:
    """Everything about an HF run that can be refused before any network work: the ratio, tied
    embeddings across stages, the layer split, the vocabulary against ``data.vocab_size``; with ``data``
    also the tokenizer against the model and the dataset's fields. Raises :class:`ConfigError` /
    ``DataError`` subclasses naming the fix."""
    from iota_subnet.model.hf_family import split_hf_layers
    from iota_subnet.model.hf_pipeline import layer_ranges
    m, p = cfg.model, cfg.pipeline
    if not isinstance(m, HFModelConfig):
        if isinstance(cfg.data, HFDataConfig):
            raise ConfigError("data.hf (a datasets dataset) needs a transformers model (model: {hf: ...}); the preset "
                              "models read their data from --data")
        return
    if p.compression_ratio != 1:
        raise ConfigError(f"pipeline.compression_ratio={p.compression_ratio}: a transformers model trains without a "
                          "bottleneck in this version; set pipeline.compression_ratio: 1 (or remove it)")
    if m.tie_embeddings and p.stages > 1:
        raise ConfigError(f"tie_word_embeddings is true but the run has pipeline.stages={p.stages}: tied embeddings on "
                          "two hosts need an all-reduce between the first and the last stage's holders, which the "
                          "network does not run yet; set model.config.tie_word_embeddings: false, or use one stage "
                          "(the in-process trainer, iota_subnet.train.hf_trainer, supports tied models)")
    split_hf_layers(m.transformers_config(), p.stages, seq_len=cfg.data.seq_len, layer_ranges=layer_ranges(p))
    if not isinstance(cfg.data, HFDataConfig):
        raise ConfigError("a transformers model needs its data named in the config: data: {hf: {path: corpus.jsonl, "
                          "text_field: text}, tokenizer: <the model's tokenizer folder>}")
    if data:
        from iota_subnet.data.hf_datasets import (DatasetSpec, _check_columns, check_tokenizer, load_hf_tokenizer,
                                                  open_dataset)
        check_tokenizer(load_hf_tokenizer(cfg.data.tokenizer), {"vocab_size": m.vocab_size})
        spec = DatasetSpec.from_mapping(cfg.data.hf)
        ds = open_dataset(spec)
        cols = getattr(ds, "column_names", None)
        if cols is None:            # a streamed dataset whose features are unknown until read
            first = next(iter(ds), None)
            cols = list(first) if isinstance(first, dict) else None
        _check_columns(spec, cols)


def with_hf_split(cfg):
    """``cfg`` with ``pipeline.layer_split`` set to the FLOP-balanced split of the ``transformers`` model
    (:func:`~iota_subnet.model.hf_family.split_hf_layers` at ``max_position_embeddings``) when the config
    gives none, so that every part of a neuron that counts layers per stage (FLOPs, deadlines, scoring)
    sees the stages' real ranges. Raises ``StageSplitError`` for a split that cannot be made."""
    from iota_subnet.model.hf_family import split_hf_layers
    p = cfg.pipeline
    if p.layer_split is not None:
        return cfg
    ranges = split_hf_layers(cfg.model.transformers_config(), p.stages, seq_len=cfg.model.max_seq_len)
    return dataclasses.replace(cfg, pipeline=dataclasses.replace(p, layer_split=[len(r) for r in ranges]))


def run_to_dict(cfg) -> dict:
    """:meth:`RunConfig.to_dict` of an HF run: the ``model`` and ``data`` sections as a config file
    gives them (absolute paths), the rest as usual."""
    d = dataclasses.asdict(cfg)
    if isinstance(cfg.model, HFModelConfig):
        d["model"] = cfg.model.user_dict()
    return d


class HFKind(ModelKind):
    """The ``hf`` kind of :mod:`iota_subnet.config_kinds`: the functions above."""

    key = "hf"

    def model(self, raw: dict, base: Optional[Path]) -> HFModelConfig:
        return hf_model_config(raw, base)

    def data(self, raw: dict, base: Optional[Path]) -> tuple[dict, type]:
        return hf_data_raw(raw, base), HFDataConfig

    def resolve(self, cfg):
        return with_hf_split(cfg)

    def check(self, cfg, *, files: bool) -> None:
        check_hf_run(cfg, data=files)

    def to_dict(self, cfg) -> dict:
        return run_to_dict(cfg)


MODEL_KINDS[HFKind.key] = HFKind()
