"""Configuration: named model shapes and the run config read from YAML (``configs/*.yaml``).

A run config has four sections::

    model: tiny            # a named shape (see MODEL_CONFIGS) or a mapping {name: tiny, n_layers: 4, ...}
    pipeline: {stages: 3, compression_ratio: 8}
    data: {vocab_size: 8192, seq_len: 256}
    train: {batch_size: 8, lr: 3.0e-3, ...}

Every error raised here is a :class:`ConfigError` whose message says how to fix it.
"""
from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Optional

import yaml
from iota_subnet.config_kinds import MODEL_KINDS, kind_of as _kind_of
from iota_subnet.config_merge import GATHER_QUANTIZATIONS, MERGE_QUANTIZATIONS, MergeConfig  # noqa: F401 (re-exported)
from iota_subnet.config_presets import config_path
from iota_subnet.errors import ConfigError  # noqa: F401 (re-exported)


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-3 style decoder.

    ``dim`` is the residual width d; ``ffn_dim`` the SwiGLU hidden width; attention uses
    ``n_heads`` query heads of width ``dim // n_heads`` and ``n_kv_heads`` key/value heads (GQA).
    ``rope_scaling`` follows Llama 3.1 (keys ``factor``, ``low_freq_factor``, ``high_freq_factor``,
    ``original_max_position_embeddings``); ``None`` disables it.
    """

    name: str = "custom"
    vocab_size: int = 8192
    dim: int = 256
    n_layers: int = 8
    n_heads: int = 8
    n_kv_heads: int = 4
    ffn_dim: int = 768
    max_seq_len: int = 1024
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def param_count(self, tied: Optional[bool] = None) -> int:
        """Parameters of the whole model from the shape alone (no module built): embedding, blocks
        (attention, SwiGLU, two RMSNorms), final norm and LM head. ``tied``: whether the LM head shares
        the embedding (default ``tie_embeddings``; a model split into stages never ties). The
        bottleneck projections of a split model are not counted (d x (b - r) per boundary side)."""
        d, D, V = self.dim, self.head_dim, self.vocab_size
        attn = d * self.n_heads * D * 2 + d * self.n_kv_heads * D * 2     # q, o; k, v
        block = attn + 3 * d * self.ffn_dim + 2 * d
        tie = self.tie_embeddings if tied is None else tied
        return V * d + self.n_layers * block + d + (0 if tie else V * d)

    def validate(self) -> "ModelConfig":
        for k in ("n_heads", "n_kv_heads", "dim", "n_layers", "ffn_dim", "vocab_size", "max_seq_len"):
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"model.{k} must be a positive integer, got {v!r}")
        if self.dim % self.n_heads:
            raise ConfigError(f"model.dim={self.dim} is not divisible by model.n_heads={self.n_heads}; pick n_heads dividing dim")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"model.n_heads={self.n_heads} is not divisible by model.n_kv_heads={self.n_kv_heads}; "
                "grouped-query attention needs n_kv_heads to divide n_heads")
        if self.head_dim % 2:
            raise ConfigError(f"head width dim/n_heads={self.head_dim} must be even for RoPE; change dim or n_heads")
        for k in ("vocab_size", "dim", "n_layers", "ffn_dim", "max_seq_len"):
            if getattr(self, k) <= 0:
                raise ConfigError(f"model.{k} must be positive, got {getattr(self, k)}")
        return self


_L3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
_L3_SMALL = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 256}

#: Named shapes. Only ``tiny`` and ``small`` are meant to train on a CPU; the rest are the shapes
#: a GPU deployment would use (``1b`` and ``8b`` are Llama 3.2 1B and Llama 3 8B).
MODEL_CONFIGS: dict[str, ModelConfig] = {
    "tiny": ModelConfig("tiny", 8192, 256, 8, 8, 4, 768, 1024, 10000.0, _L3_SMALL),       # ~10.5M params
    "small": ModelConfig("small", 8192, 384, 12, 6, 2, 1024, 1024, 10000.0, _L3_SMALL),   # ~25M params
    "100m": ModelConfig("100m", 32000, 768, 12, 12, 4, 2048, 2048, 500000.0, _L3),        # ~124M params
    "1b": ModelConfig("1b", 128256, 2048, 16, 32, 8, 8192, 8192, 500000.0, _L3, tie_embeddings=True),
    "8b": ModelConfig("8b", 128256, 4096, 32, 32, 8, 14336, 8192, 500000.0, _L3),
    "15b": ModelConfig("15b", 128256, 5120, 40, 40, 8, 17920, 8192, 500000.0, _L3),
    "100b": ModelConfig("100b", 128256, 9216, 88, 72, 8, 32768, 8192, 500000.0, _L3),       # 98.70B params
}


def model_config(name_or_mapping: Any) -> ModelConfig:
    """Resolve a named shape, or a mapping ``{name: base, field: value, ...}`` overriding one."""
    if isinstance(name_or_mapping, ModelConfig):
        return name_or_mapping.validate()
    if isinstance(name_or_mapping, str):
        if name_or_mapping not in MODEL_CONFIGS:
            raise ConfigError(f"unknown model config {name_or_mapping!r}; choose one of {sorted(MODEL_CONFIGS)}")
        return MODEL_CONFIGS[name_or_mapping].validate()
    if isinstance(name_or_mapping, dict):
        d = dict(name_or_mapping)
        base = model_config(d.pop("name", "tiny"))
        return replace(base, **_checked_fields(ModelConfig, d, "model")).validate()
    raise ConfigError(f"model must be a name or a mapping, got {type(name_or_mapping).__name__}")


@dataclass(frozen=True)
class PipelineConfig:
    """How the model is cut into stages and what crosses each boundary.

    ``layer_split``: explicit layer counts per stage (e.g. ``[3, 3, 2]``); ``None`` balances.
    ``compression_ratio``: d / b of the residual bottleneck at each boundary (1 = off).
    ``identity_rank``: width of the bottleneck's explicit identity path (``None``: b / 2).
    """

    stages: int = 1
    layer_split: Optional[list] = None
    compression_ratio: int = 1
    identity_rank: Optional[int] = None


def split_layers(n_layers: int, stages: int, layer_split: Optional[list] = None) -> list[range]:
    """Layer ranges, one per stage. ``layer_split``: explicit counts per stage (sum = n_layers);
    ``None`` balances (earlier stages take the remainder; the tail also carries the LM head).

    Raises ConfigError if the split does not fit the layer count.
    """
    if stages < 1:
        raise ConfigError(f"pipeline.stages={stages} must be >= 1")
    if layer_split is not None:
        counts = [int(c) for c in layer_split]
        if len(counts) != stages:
            raise ConfigError(f"pipeline.layer_split has {len(counts)} entries but pipeline.stages={stages}; give one count per stage")
        if sum(counts) != n_layers or min(counts) < 1:
            raise ConfigError(
                f"pipeline.layer_split={counts} must be positive counts summing to the model's {n_layers} layers")
    else:
        if stages > n_layers:
            raise ConfigError(f"pipeline.stages={stages} exceeds the model's {n_layers} layers; use at most {n_layers} stages")
        base, extra = divmod(n_layers, stages)
        counts = [base + (1 if i < extra else 0) for i in range(stages)]
    out, start = [], 0
    for c in counts:
        out.append(range(start, start + c))
        start += c
    return out


def bottleneck_dims(cfg: ModelConfig, pcfg: PipelineConfig) -> tuple[int, int]:
    """(b, r): wire width and identity rank at every boundary. ``b == d`` when the bottleneck is off.

    Raises ConfigError when d / compression_ratio is not a whole number >= 2, or r is out of [0, b].
    """
    d, ratio = cfg.dim, int(pcfg.compression_ratio)
    if ratio < 1:
        raise ConfigError(f"pipeline.compression_ratio={ratio} must be >= 1 (1 = no bottleneck)")
    if ratio == 1:
        return d, d
    if d % ratio:
        divisors = [k for k in (2, 4, 8, 16, 32, 64, 128, 256) if d % k == 0 and d // k >= 2]
        raise ConfigError(
            f"pipeline.compression_ratio={ratio} does not divide model width d={d}; "
            f"choose one of {divisors}")
    b = d // ratio
    if b < 2:
        raise ConfigError(f"pipeline.compression_ratio={ratio} leaves a bottleneck width of {b} (< 2); use at most {d // 2}")
    r = pcfg.identity_rank if pcfg.identity_rank is not None else b // 2
    if not 0 <= r <= b:
        raise ConfigError(f"pipeline.identity_rank={r} must lie in [0, b={b}]")
    return b, r


@dataclass(frozen=True)
class DataConfig:
    """``tokenizer``: a Hugging Face hub name, or ``None`` for a byte-level BPE trained on the corpus.
    ``seq_len`` in tokens; ``val_fraction`` of the packed rows is held out for validation."""

    tokenizer: Optional[str] = None
    vocab_size: int = 8192
    seq_len: int = 256
    val_fraction: float = 0.05
    hf_dataset: str = "HuggingFaceFW/fineweb-edu"
    hf_subset: Optional[str] = "sample-10BT"
    max_tokens: Optional[int] = None


#: Learning-rate schedules after the linear warmup (see :func:`iota_subnet.train.optim.lr_at`).
LR_SCHEDULES = ("cosine", "constant", "wsd")


@dataclass(frozen=True)
class TrainConfig:
    """AdamW with linear warmup, then the ``schedule``:

    * ``cosine`` (default): cosine decay to ``lr * min_lr_ratio`` at ``total_steps`` (a bounded run);
    * ``constant``: ``lr`` for ever (an open-ended run);
    * ``wsd`` (warmup-stable-decay, Hu et al. 2024, MiniCPM, arXiv 2404.06395 section 4): ``lr`` until
      ``decay_start``, then linear decay to ``lr * min_lr_ratio`` over ``decay_steps`` inner steps;
      with ``decay_start`` unset the run stays at ``lr`` until its config sets one.

    ``total_steps``: inner steps of a bounded run; ``null`` makes the run open-ended (neurons train
    until stopped; needs ``constant`` or ``wsd``).
    ``batch_size`` rows of ``data.seq_len`` tokens per optimizer step (one inner step);
    ``micro_batch_size`` rows per micro-batch (``batch_size`` must be a multiple of it).
    ``activation_checkpointing``: keep only each block's input between a micro-batch's forward and
    its backward and recompute the block in the backward (Chen et al. 2016, arXiv 1604.06174):
    about one extra block forward of compute for far less stored memory (``iota-subnet plan``).
    ``precision``: the compute precision of the run, decided here for every miner and validator
    (:data:`PRECISIONS`): ``fp32``, or ``bf16`` autocast with fp32 master weights. Validators take
    their replay tolerance from it, never from a miner's reply. A YAML config that does not set it
    gets :func:`default_precision` of its model (``bf16`` above :data:`LARGE_MODEL_PARAMS`); the
    dataclass default, for configs built in code, stays ``fp32``.
    ``compile``: a ``torch.compile`` backend for the stage (``inductor`` on GPUs; ``None`` = eager).
    ``activation_cache_mib`` / ``activation_cache_entries`` / ``activation_cache_ttl_s``: a miner's
    bound on the memory its cached forwards hold (measured, see :mod:`iota_subnet.miner.activation_cache`),
    on their number and on their age.
    ``rewarm_steps``: inner steps over which a replica whose AdamW state is younger than the run (a
    joiner or a replica synced without its own optimizer state) ramps its learning rate up to the
    schedule's (:func:`iota_subnet.train.optim.rewarm_factor`); 0 turns it off.
    """

    batch_size: int = 8
    micro_batch_size: Optional[int] = None
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 0
    checkpoint_every: int = 50
    eval_batches: int = 8
    total_steps: Optional[int] = 150
    schedule: str = "cosine"
    decay_start: Optional[int] = None
    decay_steps: int = 0
    activation_checkpointing: bool = False
    precision: str = "fp32"
    rewarm_steps: int = 10
    compile: Optional[str] = None
    activation_cache_mib: int = 512
    activation_cache_entries: int = 64
    activation_cache_ttl_s: float = 120.0

    @property
    def micro_batch(self) -> int:
        return self.micro_batch_size or self.batch_size


#: Compute precisions a run can choose (``train.precision``).
PRECISIONS = ("fp32", "bf16")
#: Models with more parameters than this train in ``bf16`` unless their config says otherwise
#: (:func:`default_precision`): fp32 activations and matmuls at that size cost twice the activation
#: memory and run at a fraction of a GPU's bf16 tensor-core rate.
LARGE_MODEL_PARAMS = 100_000_000


def default_precision(model: ModelConfig) -> str:
    """``train.precision`` of a config that does not set it: ``bf16`` for a model of more than
    :data:`LARGE_MODEL_PARAMS` parameters (:meth:`ModelConfig.param_count`), else ``fp32`` (the
    CPU-sized ``tiny`` and ``small`` shapes)."""
    return "bf16" if model.param_count() > LARGE_MODEL_PARAMS else "fp32"
#: ``train.compile`` values: torch.compile backends (``inductor`` generates kernels; ``aot_eager`` and
#: ``eager`` only trace, for testing on machines without a compiler toolchain).
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager", "cudagraphs")


@dataclass(frozen=True)
class RunConfig:
    model: ModelConfig = field(default_factory=lambda: MODEL_CONFIGS["tiny"])
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    merge: MergeConfig = field(default_factory=MergeConfig)

    def to_dict(self) -> dict:
        kind = _kind_of(self)
        return kind.to_dict(self) if kind is not None else dataclasses.asdict(self)

    def validate(self) -> "RunConfig":
        self.model.validate()
        _check_ranges(self)
        split_layers(self.model.n_layers, self.pipeline.stages, self.pipeline.layer_split)
        bottleneck_dims(self.model, self.pipeline)
        kind = _kind_of(self)
        if kind is not None:
            kind.check(self, files=False)
        if self.data.vocab_size != self.model.vocab_size:
            raise ConfigError(
                f"data.vocab_size={self.data.vocab_size} differs from model.vocab_size={self.model.vocab_size}; set them equal")
        if self.data.seq_len > self.model.max_seq_len:
            raise ConfigError(f"data.seq_len={self.data.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}")
        if self.train.batch_size % self.train.micro_batch:
            raise ConfigError(
                f"train.batch_size={self.train.batch_size} is not a multiple of train.micro_batch_size={self.train.micro_batch}")
        if self.pipeline.compression_ratio < 1:
            raise ConfigError("pipeline.compression_ratio must be >= 1 (1 turns the bottleneck off)")
        self.merge.validate()
        return self


def _checked_fields(cls, mapping: Any, section: str) -> dict:
    """Refuse unknown keys and values of the wrong type (an int where a float is expected is fine)."""
    if not isinstance(mapping, dict):
        raise ConfigError(f"section {section!r} must be a mapping of keys to values, got {mapping!r}")
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(mapping) - names)
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown} in section {section!r}; allowed: {sorted(names)}")
    hints = typing.get_type_hints(cls)
    for k, v in mapping.items():
        want = hints.get(k)
        if v is None and typing.get_origin(want) is typing.Union and type(None) in typing.get_args(want):
            continue
        base = next((t for t in typing.get_args(want) if t is not type(None)), want) if typing.get_origin(want) \
            is typing.Union else want
        base = typing.get_origin(base) or base
        ok = (isinstance(v, bool) if base is bool else
              isinstance(v, int) and not isinstance(v, bool) if base is int else
              isinstance(v, (int, float)) and not isinstance(v, bool) if base is float else
              isinstance(v, base) if isinstance(base, type) else True)
        if not ok:
            raise ConfigError(f"{section}.{k} must be {getattr(base, '__name__', base)}, got {v!r}")
    return mapping


def _check_ranges(cfg: "RunConfig") -> None:
    t, d, p = cfg.train, cfg.data, cfg.pipeline
    if t.schedule not in LR_SCHEDULES:
        raise ConfigError(f"train.schedule {t.schedule!r} unknown; choose one of {list(LR_SCHEDULES)}")
    if t.total_steps is None and t.schedule == "cosine":
        raise ConfigError("train.total_steps is null (an open-ended run) but train.schedule is cosine, which needs "
                          "an end; set train.schedule: constant or wsd, or give train.total_steps")
    if t.schedule == "wsd" and t.decay_start is not None and t.decay_steps < 1:
        raise ConfigError("train.decay_start is set but train.decay_steps is 0; give the decay's length in inner steps")
    for name, v, lo in (("train.batch_size", t.batch_size, 1), ("train.micro_batch_size", t.micro_batch, 1),
                        ("train.total_steps", 1 if t.total_steps is None else t.total_steps, 1),
                        ("train.decay_start", t.decay_start or 0, 0), ("train.decay_steps", t.decay_steps, 0),
                        ("train.eval_batches", t.eval_batches, 1),
                        ("train.warmup_steps", t.warmup_steps, 0), ("train.checkpoint_every", t.checkpoint_every, 0),
                        ("train.rewarm_steps", t.rewarm_steps, 0),
                        ("data.seq_len", d.seq_len, 1), ("data.vocab_size", d.vocab_size, 2),
                        ("pipeline.stages", p.stages, 1), ("pipeline.compression_ratio", p.compression_ratio, 1)):
        if v < lo:
            raise ConfigError(f"{name} must be >= {lo}, got {v}")
    if not t.lr > 0:
        raise ConfigError(f"train.lr must be > 0, got {t.lr}")
    if t.compile is not None and t.compile not in COMPILE_BACKENDS:
        raise ConfigError(f"train.compile={t.compile!r} unknown; use one of {list(COMPILE_BACKENDS)} or leave it unset (eager)")
    for name, v in (("train.activation_cache_mib", t.activation_cache_mib),
                    ("train.activation_cache_entries", t.activation_cache_entries),
                    ("train.activation_cache_ttl_s", t.activation_cache_ttl_s)):
        if not v > 0:
            raise ConfigError(f"{name} must be > 0, got {v}")
    if not 0 <= t.min_lr_ratio <= 1:
        raise ConfigError(f"train.min_lr_ratio must be in [0, 1], got {t.min_lr_ratio}")
    if not 0 <= d.val_fraction < 1:
        raise ConfigError(f"data.val_fraction must be in [0, 1), got {d.val_fraction}")
    if t.precision not in PRECISIONS:
        raise ConfigError(f"train.precision {t.precision!r} unknown; choose one of {list(PRECISIONS)} (bf16: autocast "
                          "with fp32 master weights, the usual GPU setting)")
    if not (0 <= t.beta1 < 1 and 0 <= t.beta2 < 1):
        raise ConfigError(f"train.beta1 and train.beta2 must be in [0, 1), got {t.beta1}, {t.beta2}")


class _Loader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that reads numbers the way people write them (YAML 1.2 floats).

    PyYAML follows YAML 1.1, where a float needs a dot: ``3e-4`` and ``1e-05`` (what ``json.dump``
    writes for ``1e-5``) would be strings. Here any decimal with an exponent is a float.
    """


_Loader.yaml_implicit_resolvers = {k: list(v) for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+
                   |[-+]?\.[0-9_]+(?:[eE][-+]?[0-9]+)?)$""", re.X),
    list("-+0123456789."))


def load_yaml(text: str) -> Any:
    """Parse YAML (or JSON) text with :class:`_Loader`: ``3e-4``, ``1e-05`` and ``.5`` are floats.
    Raises ``yaml.YAMLError`` for invalid text."""
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass


def load_config(path_or_name: str | Path, overrides: Optional[dict] = None) -> RunConfig:
    """Read a run config from a YAML file, or build one from a bare model name (``tiny``).

    ``overrides``: ``{"pipeline": {"stages": 3}, ...}`` applied on top of the file.
    A relative ``configs/<file>`` missing from the current folder is the repository's preset of that
    name (:func:`iota_subnet.config_presets.config_path`), so the commands' default works from any folder.
    Raises :class:`ConfigError` for a missing, empty or non-YAML file, unknown names or keys, or
    inconsistent values.
    """
    p = Path(config_path(path_or_name))
    raw: dict
    if p.suffix in (".yaml", ".yml") or p.exists():
        if not p.exists():
            raise ConfigError(f"config file {str(p)!r} not found; pass a path such as configs/tiny.yaml or a model name "
                              f"({', '.join(sorted(MODEL_CONFIGS))})")
        if p.is_dir():
            raise ConfigError(f"{p} is a folder; pass a config file such as {p / 'tiny.yaml'}")
        try:
            raw = load_yaml(p.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"{p} is not valid YAML: {e}") from None
        if raw is None:
            raise ConfigError(f"{p} is empty (or only comments); a config names at least its model, e.g. "
                              f"'model: tiny', or start from configs/tiny.yaml")
        if not isinstance(raw, dict):
            raise ConfigError(f"{p}: top level must be a mapping with sections model/pipeline/data/train")
    else:
        raw = {"model": str(path_or_name)}
    for sec, vals in (overrides or {}).items():
        raw.setdefault(sec, {})
        if sec == "model" and isinstance(raw[sec], str):
            raw[sec] = {"name": raw[sec]}
        raw[sec] = {**raw[sec], **vals}
    unknown = sorted(set(raw) - {"model", "pipeline", "data", "train", "merge"})
    if unknown:
        raise ConfigError(f"unknown section(s) {unknown} in config; allowed: model, pipeline, data, train, merge")
    cfg = _run_config(raw, p.parent if p.exists() else None)
    kind = _kind_of(cfg)
    if kind is not None:            # its files (a tokenizer, a dataset's fields), before any network work
        kind.check(cfg, files=True)
    return cfg


def _run_config(raw: dict, base: Optional[Path] = None) -> RunConfig:
    """A validated RunConfig from the sections of a config file (``base``: the file's folder, for
    relative paths a :class:`ModelKind` reads)."""
    data_raw = raw.get("data") or {}
    if not isinstance(data_raw, dict):
        raise ConfigError(f"section 'data' must be a mapping of keys to values, got {data_raw!r}")
    data_raw, data_cls = dict(data_raw), DataConfig
    m_raw = raw.get("model", "tiny")
    kind = next((k for key, k in MODEL_KINDS.items() if isinstance(m_raw, dict) and key in m_raw), None)
    model = kind.model(m_raw, base) if kind is not None else model_config(m_raw)
    d_kind = next((k for key, k in MODEL_KINDS.items() if key in data_raw), None)
    if d_kind is not None:
        data_raw, data_cls = d_kind.data(data_raw, base)
    data_raw.setdefault("vocab_size", model.vocab_size)
    train_raw = raw.get("train") or {}
    if isinstance(train_raw, dict) and "precision" not in train_raw:
        train_raw = {**train_raw, "precision": default_precision(model)}
    cfg = RunConfig(
        model=model,
        pipeline=PipelineConfig(**_checked_fields(PipelineConfig, raw.get("pipeline") or {}, "pipeline")),
        data=data_cls(**_checked_fields(data_cls, data_raw, "data")),
        train=TrainConfig(**_checked_fields(TrainConfig, train_raw, "train")),
        merge=MergeConfig(**_checked_fields(MergeConfig, raw.get("merge") or {}, "merge")),
    )
    if kind is not None:
        cfg = kind.resolve(cfg)
    return cfg.validate()


def config_from_dict(d: dict) -> RunConfig:
    """Inverse of :meth:`RunConfig.to_dict` (used to read a checkpoint's config)."""
    if isinstance(d.get("model"), dict) and any(key in d["model"] for key in MODEL_KINDS):
        return _run_config(d)
    return RunConfig(
        model=ModelConfig(**d["model"]), pipeline=PipelineConfig(**d["pipeline"]),
        data=DataConfig(**d["data"]), train=TrainConfig(**d["train"]),
        merge=MergeConfig(**d.get("merge", {})),
    ).validate()
