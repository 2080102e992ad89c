"""A run as a typed object: :class:`RunSpec` (a ``transformers`` model and a ``datasets`` dataset, the
pipeline and the training knobs) and :class:`DataSpec`, the same run as the YAML file the ``iota-subnet``
commands take.

A spec is turned into the project's :class:`~iota_subnet.config.RunConfig` by writing that YAML and
reading it with :func:`~iota_subnet.config.load_config` (the loader of the CLI), so every refusal (an
unsupported family, layers that cannot be split into the stages, a dataset without the text field, a
tokenizer that does not fit the vocabulary, ...) is raised here, as the same ``ConfigError`` /
``DataError`` (all ``UserError``), before any network work. Defaults are those of
:class:`~iota_subnet.config.RunConfig` (read from it, not repeated).

A model given as a ``transformers`` config object is written as a folder (``config.json`` by
``save_pretrained``) beside the YAML (``<name>-model/``) so that the YAML can name it; :meth:`RunSpec.to_config`
without a folder writes it under ``$IOTA_CACHE/sdk/<hash>/`` (content addressed).

:meth:`RunSpec.spec_hash` is the sha256 of the canonical resolved config (YAML, keys sorted) with the
model named by its ``transformers`` config content rather than by the folder holding it, so that the same
run written in two places has one hash. Local data and tokenizer files (and a pretrained start's folder)
are named by their absolute paths, not their content (:mod:`iota_subnet.config_hash`, the same hash for any
config).

A run is addressed by this hash on chain: its validators serve the canonical YAML (``GET /run/spec``) and
advertise the hash in their commitment (``h``); ``iota-subnet miner --spec-hash HASH`` (or ``validator``)
fetches the text from a validator advertising it, refuses it unless its sha256 is ``HASH``
(:class:`~iota_subnet.protocol.run_spec.SpecHashMismatchError`, naming both hashes), caches it under
``$IOTA_CACHE/runs/HASH.yaml`` and joins that validator's run id and epoch (:mod:`iota_subnet.run_fetch`).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import yaml
from transformers import PreTrainedConfig

from iota_subnet.config import ConfigError, RunConfig, load_config, load_yaml
from iota_subnet.config_hash import canonical_yaml, config_hash  # noqa: F401 (re-exported: iota_subnet.sdk)
from iota_subnet.data import default_cache_dir
from iota_subnet.utils.atomic import atomic_write_text

_D = RunConfig()            # the defaults every RunSpec field below takes

#: RunSpec field -> (config section, key): how a spec's knobs are written in (and read from) the YAML
FIELDS: dict[str, tuple[str, str]] = {
    "stages": ("pipeline", "stages"), "layer_split": ("pipeline", "layer_split"),
    "seq_len": ("data", "seq_len"),
    "batch_size": ("train", "batch_size"), "micro_batch_size": ("train", "micro_batch_size"), "lr": ("train", "lr"),
    "warmup_steps": ("train", "warmup_steps"), "steps": ("train", "total_steps"), "seed": ("train", "seed"),
    "eval_batches": ("train", "eval_batches"), "precision": ("train", "precision"),
    "merge_every": ("merge", "every_steps"),
}


def _local(p: Union[str, Path]) -> str:
    """A path that exists here, made absolute (a YAML read from another folder names the same file);
    anything else (a hub id, a model_type) as given."""
    q = Path(str(p)).expanduser()
    return str(q.resolve()) if q.exists() else str(p)


@dataclass(frozen=True)
class DataSpec:
    """The run's text: ``path`` a local jsonl / json / parquet / txt / csv file or folder, or a hub
    dataset id (streamed); ``text_field`` the field holding a document; ``mask_field`` the field holding
    the trained character spans (``None``: every token); ``tokenizer`` the model's local tokenizer folder
    (``tokenizer.json``, as ``save_pretrained`` writes it); ``options`` the other keys of
    :class:`~iota_subnet.data.hf_datasets.DatasetSpec` (``format``, ``name``, ``split``, ``streaming``,
    ``sample_by``)."""

    path: Union[str, Path]
    text_field: str = "text"
    mask_field: Optional[str] = None
    tokenizer: Optional[Union[str, Path]] = None
    options: dict = field(default_factory=dict)

    def section(self) -> dict:
        """The config file's ``data`` section (without ``seq_len``)."""
        return {"hf": {"path": _local(self.path), "text_field": self.text_field, "mask_field": self.mask_field,
                       **self.options},
                "tokenizer": None if self.tokenizer is None else _local(self.tokenizer)}


@dataclass(frozen=True)
class RunSpec:
    """One training run (see the module docstring).

    ``model``: a ``transformers`` config object (``Qwen2Config(...)``; family llama, qwen2, qwen3 or
    mistral), a local folder holding ``config.json`` (and safetensors for ``init="pretrained"``), or a
    ``model_type`` name; ``model_config``: ``config.json`` fields overriding (or, for a name, giving)
    the model's. ``init``: ``scratch`` or ``pretrained``. ``seq_len`` tokens per row; ``stages`` pipeline
    stages (``layer_split``: layers per stage, ``None`` = by FLOPs); ``batch_size`` rows per inner step,
    ``micro_batch_size`` rows per micro-batch (``None`` = one); ``lr`` peak AdamW learning rate;
    ``steps`` inner steps (``train.total_steps``); ``merge_every`` inner steps between replica merges
    (0 = never); ``precision`` ``fp32`` / ``bf16`` (``None``: by model size, ``default_precision``);
    ``extra``: any other config key, ``{section: {key: value}}`` (e.g. ``{"train": {"schedule": "wsd"}}``)."""

    model: Union[PreTrainedConfig, str, Path]
    data: DataSpec
    init: str = "scratch"
    model_config: dict = field(default_factory=dict)
    seq_len: int = _D.data.seq_len
    stages: int = _D.pipeline.stages
    layer_split: Optional[tuple] = None
    batch_size: int = _D.train.batch_size
    micro_batch_size: Optional[int] = _D.train.micro_batch_size
    lr: float = _D.train.lr
    warmup_steps: int = _D.train.warmup_steps
    steps: Optional[int] = _D.train.total_steps
    seed: int = _D.train.seed
    eval_batches: int = _D.train.eval_batches
    merge_every: int = _D.merge.every_steps
    precision: Optional[str] = None
    extra: dict = field(default_factory=dict)

    # ---- the YAML ----------------------------------------------------------------------------
    def sections(self, model_ref: str) -> dict:
        """The config file's sections, the model named by ``model_ref`` (a folder or a model_type).
        Raises ConfigError for an ``extra`` that is not ``{section: {key: value}}``."""
        m = {"hf": model_ref, "init": self.init, **({"config": dict(self.model_config)} if self.model_config else {})}
        raw: dict = {"model": m, "pipeline": {}, "data": self.data.section(), "train": {}, "merge": {}}
        for name, (sec, key) in FIELDS.items():
            v = getattr(self, name)
            if v is None and name in ("layer_split", "precision"):
                continue                     # unset: the loader derives them
            raw[sec][key] = list(v) if name == "layer_split" else v
        if not isinstance(self.extra, dict) or not all(isinstance(v, dict) for v in self.extra.values()):
            raise ConfigError(f"RunSpec.extra must be {{section: {{key: value}}}}, got {self.extra!r}")
        for sec, vals in self.extra.items():
            raw[sec] = {**(raw.get(sec) or {}), **vals}
        return raw

    def _model_ref(self, folder: Path) -> str:
        """The ``model.hf`` value; a config object is written to ``folder`` (``save_pretrained``) first."""
        if isinstance(self.model, PreTrainedConfig):
            self.model.save_pretrained(str(folder))
            return str(folder.resolve())
        if isinstance(self.model, (str, Path)) and str(self.model):
            return _local(self.model)
        raise ConfigError(f"RunSpec.model must be a transformers config object (e.g. Qwen2Config(...)), a local "
                          f"folder holding config.json, or a model_type name; got {type(self.model).__name__}")

    def save(self, path: Union[str, Path]) -> Path:
        """Write the run config YAML to ``path`` (what ``iota-subnet localnet --config`` and the other
        commands take); a config-object model goes to ``<path stem>-model/`` beside it. Returns the
        YAML's path. Checks nothing beyond :meth:`sections` (:meth:`to_config` checks)."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        raw = self.sections(self._model_ref(p.parent / f"{p.stem}-model"))
        atomic_write_text(p, yaml.safe_dump(raw, sort_keys=False))
        return p

    @classmethod
    def load(cls, path: Union[str, Path]) -> "RunSpec":
        """The spec of a run config YAML naming a ``transformers`` model (``model: {hf: ...}``) and a
        dataset (``data: {hf: {...}, tokenizer: ...}``). Raises ConfigError for a missing or unreadable file,
        or one naming a preset shape or ``--data`` text (use the YAML with the CLI then)."""
        p = Path(path)
        try:
            raw = load_yaml(p.read_text())
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"cannot read the run config {str(p)!r}: {e}") from None
        if not isinstance(raw, dict) or not isinstance(raw.get("model"), dict) or "hf" not in raw["model"] \
                or not isinstance((raw.get("data") or {}).get("hf"), dict):
            raise ConfigError(f"{p}: a RunSpec reads a config naming a transformers model and a dataset "
                              "(model: {hf: ...}, data: {hf: {path: ...}, tokenizer: ...}); a preset-shape config runs "
                              "with the iota-subnet commands as it is")
        secs = {k: dict(v or {}) for k, v in raw.items() if k != "model"}
        m = dict(raw["model"])
        data = dict(secs.get("data", {}))
        hf = dict(data.pop("hf"))
        ds = DataSpec(path=hf.pop("path", ""), text_field=hf.pop("text_field", "text"),
                      mask_field=hf.pop("mask_field", None), tokenizer=data.pop("tokenizer", None), options=hf)
        secs["data"] = data
        kw: dict[str, Any] = {}
        for name, (sec, key) in FIELDS.items():
            if key in secs.get(sec, {}):
                v = secs[sec].pop(key)
                kw[name] = tuple(v) if name == "layer_split" and v is not None else v
        extra = {sec: vals for sec, vals in secs.items() if vals}
        return cls(model=m.get("hf", ""), data=ds, init=m.get("init", "scratch"), model_config=dict(m.get("config") or {}),
                   extra=extra, **kw)

    # ---- the config ------------------------------------------------------------------------------
    def _identity(self) -> str:
        """sha256 of what the spec says (a config object by its JSON): names its cache folder."""
        model = self.model.to_json_string(use_diff=False) if isinstance(self.model, PreTrainedConfig) \
            else str(self.model)
        text = json.dumps({"model": model, **self.sections("")}, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()

    def to_config(self, folder: Optional[Union[str, Path]] = None) -> RunConfig:
        """The run's :class:`RunConfig`, read by :func:`~iota_subnet.config.load_config` from the YAML
        :meth:`save` writes to ``folder/run.yaml`` (default ``$IOTA_CACHE/sdk/<hash>/``). Raises the loader's
        ConfigError (UnsupportedFamilyError, StageSplitError, ...) and DataError (DatasetFieldError,
        TokenizerMismatchError, ...) subclasses, every one naming the fix."""
        d = Path(folder) if folder is not None else default_cache_dir() / "sdk" / self._identity()[:16]
        return load_config(self.save(d / "run.yaml"))

    def spec_hash(self) -> str:
        """sha256 (hex) of the canonical resolved config (see the module docstring). Raises as :meth:`to_config`."""
        return config_hash(self.to_config())

    def replace(self, **changes) -> "RunSpec":
        """A copy with ``changes`` (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)
