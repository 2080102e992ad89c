"""Pipeline stages built from a ``transformers`` model family's own layer classes.

Supported families (``config.model_type``): ``llama``, ``qwen2`` (attention biases, optional
sliding-window layers), ``qwen3`` (q/k RMSNorm, ``head_dim`` free of ``hidden_size / heads``) and
``mistral`` (``sliding_window``). A stage holds a contiguous run of the family's ``DecoderLayer``
modules, built with their global layer index; stage 0 also holds ``embed_tokens``, the last stage
the final ``norm`` and ``lm_head``. Every stage holds the family's rotary embedding (non-persistent
buffers, computed from the config) and builds its own causal / sliding-window masks and position
ids as the family's ``Model.forward`` does, so only the hidden state crosses a stage boundary:

* stage 0: token ids ``[B, T]`` (int64) -> hidden ``[B, T, d]``;
* middle stages: hidden ``[B, T, d]`` -> hidden ``[B, T, d]``;
* last stage: hidden ``[B, T, d]`` -> logits ``[B, T, V]`` (a single stage: ids -> logits).

RoPE parameters come from the config object. ``transformers`` 5 keeps them in ``rope_parameters``
(with ``rope_theta`` inside); a ``config.json`` written by older versions with ``rope_scaling`` and a
top-level ``rope_theta`` is converted by the config class on load, so both formats work here.

Tied embeddings (``tie_word_embeddings``): stage 0 holds ``embed_tokens.weight`` and the last stage a
separate copy in ``lm_head.weight`` (they live on different hosts). The copies start equal (loaded
from the same tensor, or initialised from the same per-name seed) and stay equal when both stages
apply the same update: :func:`sum_tied_grads` adds the two gradients and gives the sum to both (the
in-process form of the all-reduce between the first and the last stage's holders), after which the
same optimizer step keeps the copies bit-identical. :func:`assemble_state_dict` refuses copies that
drifted apart. With one stage the head shares the embedding's parameter, as in ``transformers``.

Sources: ``transformers.models.{llama,qwen2,qwen3,mistral}.modeling_*`` (``*Model.forward``,
``*ForCausalLM.forward``, ``_init_weights``); ``transformers.masking_utils``.
"""
from __future__ import annotations

import copy
import json
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import import_module
from pathlib import Path

import torch
from transformers import AutoConfig, PreTrainedConfig
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from torch import nn

from iota_subnet.config import ConfigError

FAMILIES: dict[str, str] = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral"}
"""Supported ``model_type`` -> class-name prefix in ``transformers.models.<type>.modeling_<type>``."""

FULL, SLIDING = "full_attention", "sliding_attention"


class HFFamilyError(ConfigError):
    """A ``transformers`` model cannot be staged as asked; the message names the value and the fix."""


class UnsupportedFamilyError(HFFamilyError):
    """The config's ``model_type`` is not one of :data:`FAMILIES`."""


class StageSplitError(HFFamilyError):
    """The decoder layers cannot be split into the requested stages (count or ``layer_ranges``)."""


class StageWeightsError(HFFamilyError):
    """A state dict does not fit the stages (missing / unexpected / misshaped tensors, drifted tied copies)."""


ConfigSource = object | str | Path | Mapping
"""A config object, a ``config.json`` dict, or a local folder (or file path) holding ``config.json``."""


def load_hf_config(source: ConfigSource, attn_implementation: str | None = None):
    """A ``transformers`` config of a supported family from a config object, a ``config.json`` dict, or a
    local folder holding ``config.json`` (never the hub). Returns a deep copy; ``attn_implementation``
    (``"eager"``, ``"sdpa"``, ...) is set on it when given, else kept (``"sdpa"`` when unset).

    Raises :class:`UnsupportedFamilyError` for other model types, :class:`HFFamilyError` for a missing file."""
    if isinstance(source, (str, Path)):
        path = Path(source)
        cfg_file = path / "config.json" if path.is_dir() else path
        if not cfg_file.is_file():
            raise HFFamilyError(f"no config.json at {path}; give a folder holding a transformers config.json")
        raw = json.loads(cfg_file.read_text())
        _check_family(raw.get("model_type"))
        if path.is_dir():
            config = AutoConfig.from_pretrained(str(path), local_files_only=True)
        else:
            config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    elif isinstance(source, Mapping):
        raw = dict(source)
        _check_family(raw.get("model_type"))
        config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    elif isinstance(source, PreTrainedConfig):
        _check_family(getattr(source, "model_type", None))
        config = copy.deepcopy(source)
    else:
        raise HFFamilyError(f"cannot read a transformers config from {type(source).__name__}; "
                            "give a PreTrainedConfig, a config.json dict or a folder with config.json")
    if attn_implementation is not None or config._attn_implementation is None:
        config._attn_implementation = attn_implementation or "sdpa"
    return config


def _check_family(model_type) -> str:
    if model_type not in FAMILIES:
        raise UnsupportedFamilyError(
            f"model_type={model_type!r} is not supported for pipeline stages; supported: {', '.join(sorted(FAMILIES))}. "
            "Use a model of one of these families (or add the family's layer classes to FAMILIES)")
    return model_type


def _family_classes(model_type: str) -> tuple[type, type, type]:
    """(DecoderLayer, RMSNorm, RotaryEmbedding) classes of the family."""
    prefix = FAMILIES[_check_family(model_type)]
    mod = import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    return (getattr(mod, f"{prefix}DecoderLayer"), getattr(mod, f"{prefix}RMSNorm"),
            getattr(mod, f"{prefix}RotaryEmbedding"))


def layer_types(config) -> list[str]:
    """Attention kind per decoder layer, ``"full_attention"`` or ``"sliding_attention"``, as the family's
    model picks its mask: ``config.layer_types`` (Qwen2 / Qwen3), else sliding for every layer when
    ``config.sliding_window`` is set (Mistral), else full (Llama)."""
    kinds = getattr(config, "layer_types", None)
    if kinds is not None:
        return list(kinds)[: config.num_hidden_layers]
    sliding = getattr(config, "sliding_window", None) is not None
    return [SLIDING if sliding else FULL] * config.num_hidden_layers


def layer_flops_per_token(config, seq_len: int) -> list[int]:
    """Forward FLOPs per token of each decoder layer: 2 x matmul parameters + attention scores and
    values over the context a token sees (``seq_len``, or ``sliding_window`` when smaller for a
    sliding layer), no causal halving (PaLM appendix B convention, as :func:`block_flops_per_token`)."""
    d, h, kv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    hd = getattr(config, "head_dim", None) or d // h
    params = d * h * hd * 2 + d * kv * hd * 2 + 3 * d * config.intermediate_size
    window = getattr(config, "sliding_window", None)
    out = []
    for kind in layer_types(config):
        ctx = min(seq_len, window) if kind == SLIDING and window else seq_len
        out.append(2 * params + 2 * 2 * ctx * h * hd)
    return out


def split_hf_layers(config, stages: int, *, seq_len: int = 2048,
                    layer_ranges: Sequence | None = None) -> list[range]:
    """Decoder-layer ranges, one per stage.

    ``layer_ranges``: explicit ``(start, stop)`` pairs or ranges, contiguous from 0 to
    ``num_hidden_layers``, each non-empty, one per stage (uneven splits allowed). ``None``: the
    contiguous split minimising the largest stage's forward FLOPs per token (:func:`layer_flops_per_token`
    plus the LM head's ``2 d V`` on the last stage; the embedding lookup counts 0); among equal maxima
    the later stages take fewer layers. Raises :class:`StageSplitError` naming the fix."""
    n = config.num_hidden_layers
    if not 1 <= stages <= n:
        raise StageSplitError(f"stages={stages} must lie in [1, {n}] (one decoder layer per stage at least); "
                              f"use at most {n} stages or a model with more layers")
    if layer_ranges is not None:
        rs = [r if isinstance(r, range) else range(*tuple(r)) for r in layer_ranges]
        if len(rs) != stages:
            raise StageSplitError(f"layer_ranges has {len(rs)} entries but stages={stages}; give one (start, stop) per stage")
        start = 0
        for i, r in enumerate(rs):
            if r.step != 1 or r.start != start or r.stop <= r.start:
                raise StageSplitError(
                    f"layer_ranges[{i}]=({r.start}, {r.stop}) must be non-empty and start at {start}; the ranges "
                    f"must cover layers 0..{n} contiguously, e.g. {[(k, k + 1) for k in range(min(n, 3))]}...")
            start = r.stop
        if start != n:
            raise StageSplitError(f"layer_ranges end at layer {start} but the model has {n} layers; the last stop must be {n}")
        return rs
    cost = layer_flops_per_token(config, seq_len)
    head = 2 * config.hidden_size * config.vocab_size
    prefix = [0]
    for c in cost:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[s][j]: smallest max-stage cost placing layers [0, j) on stages 0..s; cut[s][j]: start of stage s.
    best = [[inf] * (n + 1) for _ in range(stages)]
    cut = [[0] * (n + 1) for _ in range(stages)]
    for j in range(1, n + 1):
        best[0][j] = prefix[j] + (head if stages == 1 else 0)
    for s in range(1, stages):
        extra = head if s == stages - 1 else 0
        for j in range(s + 1, n + 1):
            for k in range(j - 1, s - 1, -1):              # later k first: ties keep later stages short
                v = max(best[s - 1][k], prefix[j] - prefix[k] + extra)
                if v < best[s][j]:
                    best[s][j], cut[s][j] = v, k
    bounds, j = [n], n
    for s in range(stages - 1, 0, -1):
        j = cut[s][j]
        bounds.append(j)
    bounds.append(0)
    bounds.reverse()
    return [range(bounds[i], bounds[i + 1]) for i in range(stages)]


class HFStage(nn.Module):
    """Stage ``index`` of ``n_stages`` of a ``transformers`` family model, holding decoder layers ``layers``.

    Parameter names are the ``transformers`` ones without the ``model.`` prefix and with stage-local
    layer indices (``layers.0.self_attn.q_proj.weight`` is global layer ``layers.start``);
    :meth:`hf_name` maps them. Forward: see the module docstring for shapes; ``position_ids``
    ``[1 or B, T]`` default to ``0..T-1``, as in the family's model without a cache."""

    def __init__(self, config, index: int, n_stages: int, layers: range) -> None:
        super().__init__()
        layer_cls, norm_cls, rope_cls = _family_classes(config.model_type)
        self.config, self.index, self.n_stages, self.layer_range = config, index, n_stages, layers
        self.is_first, self.is_last = index == 0, index == n_stages - 1
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        d, v = config.hidden_size, config.vocab_size
        self.embed_tokens = nn.Embedding(v, d, config.pad_token_id) if self.is_first else None
        self.layers = nn.ModuleList([layer_cls(config, i) for i in layers])
        self.layer_kinds = [layer_types(config)[i] for i in layers]
        self.rotary_emb = rope_cls(config=config)
        self.norm = norm_cls(d, eps=config.rms_norm_eps) if self.is_last else None
        self.lm_head = nn.Linear(d, v, bias=False) if self.is_last else None
        if self.is_first and self.is_last and self.tied:
            self.lm_head.weight = self.embed_tokens.weight

    def hf_name(self, local: str) -> str:
        """The ``transformers`` ``*ForCausalLM`` state-dict name of a parameter name of this stage."""
        if local.startswith("layers."):
            i, rest = local[len("layers."):].split(".", 1)
            return f"model.layers.{self.layer_range.start + int(i)}.{rest}"
        if local.startswith("lm_head."):
            return local
        return "model." + local

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed_tokens(x) if self.embed_tokens is not None else x
        if position_ids is None:
            position_ids = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        masks = {}
        for kind in set(self.layer_kinds):
            fn = create_sliding_window_causal_mask if kind == SLIDING else create_causal_mask
            masks[kind] = fn(config=self.config, inputs_embeds=h, attention_mask=None, cache=None,
                             position_ids=position_ids)
        rope = self.rotary_emb(h, position_ids)
        for layer, kind in zip(self.layers, self.layer_kinds):
            h = layer(h, attention_mask=masks[kind], position_ids=position_ids, position_embeddings=rope)
        if self.is_last:
            h = self.lm_head(self.norm(h))
        return h


def _seed_for(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2 ** 63)


@torch.no_grad()
def init_stage_weights(stage: HFStage, seed: int = 0) -> None:
    """Initialise a stage as ``transformers``' ``_init_weights`` does (linear and embedding weights
    N(0, ``initializer_range``), biases 0, RMSNorm weights 1, the padding row 0), each tensor from a
    generator seeded by ``seed`` and its ``transformers`` name, so any stage initialises alone and the
    same on every host; a tied head draws from the embedding's name, so the two copies start equal."""
    std = getattr(stage.config, "initializer_range", 0.02)
    for local, p in stage.named_parameters():
        name = stage.hf_name(local)
        if stage.tied and name == "lm_head.weight":
            name = "model.embed_tokens.weight"
        if p.ndim == 1:
            p.fill_(1.0 if "norm" in local.rsplit(".", 2)[-2] else 0.0)
            continue
        g = torch.Generator().manual_seed(_seed_for(seed, name))
        w = torch.empty(p.shape, dtype=torch.float32).normal_(0.0, std, generator=g)
        pad = stage.config.pad_token_id
        if name == "model.embed_tokens.weight" and pad is not None:
            w[pad] = 0.0
        p.copy_(w)


def build_hf_stage(config: ConfigSource, index: int, n_stages: int, *, seq_len: int = 2048,
                   layer_ranges: Sequence | None = None, attn_implementation: str | None = None,
                   init_seed: int | None = 0) -> HFStage:
    """One stage (what one miner holds). ``config``: see :func:`load_hf_config`; the layer split is
    :func:`split_hf_layers`; ``init_seed`` None keeps PyTorch's module defaults (weights to be loaded).
    Raises :class:`HFFamilyError` subclasses (unsupported family, bad split, ``index`` out of range)."""
    cfg = load_hf_config(config, attn_implementation)
    ranges = split_hf_layers(cfg, n_stages, seq_len=seq_len, layer_ranges=layer_ranges)
    if not 0 <= index < n_stages:
        raise StageSplitError(f"stage index {index} must lie in [0, {n_stages - 1}]")
    stage = HFStage(cfg, index, n_stages, ranges[index])
    if init_seed is not None:
        init_stage_weights(stage, init_seed)
    return stage


def build_hf_stages(config: ConfigSource, n_stages: int, **kw) -> list[HFStage]:
    """All ``n_stages`` stages (keywords as :func:`build_hf_stage`), each with its own copy of the config."""
    cfg = load_hf_config(config, kw.pop("attn_implementation", None))
    split_hf_layers(cfg, n_stages, seq_len=kw.get("seq_len", 2048), layer_ranges=kw.get("layer_ranges"))
    return [build_hf_stage(cfg, i, n_stages, **kw) for i in range(n_stages)]


def run_stages(stages: Sequence[HFStage], ids: torch.Tensor) -> torch.Tensor:
    """Token ids ``[B, T]`` through every stage in order -> logits ``[B, T, V]`` (a single-process pipeline)."""
    h = ids
    for s in stages:
        h = s(h)
    return h


def load_stage_state(stage: HFStage, source: nn.Module | Mapping[str, torch.Tensor]) -> None:
    """Copy this stage's slice of a full ``transformers`` model (or its state dict, e.g. read from
    safetensors, where a tied model may lack ``lm_head.weight``) into ``stage``; a tied head takes
    ``model.embed_tokens.weight``. Raises :class:`StageWeightsError` on a missing or misshaped tensor."""
    sd = source.state_dict() if isinstance(source, nn.Module) else source
    own = stage.state_dict()
    picked = {}
    for local, t in own.items():
        name = stage.hf_name(local)
        if name not in sd and stage.tied and name == "lm_head.weight":
            name = "model.embed_tokens.weight"
        if name not in sd:
            raise StageWeightsError(f"{name!r} (stage {stage.index} {local!r}) is missing from the source state dict; "
                                    "give the full model's state dict of the same config")
        if tuple(sd[name].shape) != tuple(t.shape):
            raise StageWeightsError(f"{name!r} has shape {tuple(sd[name].shape)} but stage {stage.index} expects "
                                    f"{tuple(t.shape)}; the source was built from another config")
        picked[local] = sd[name]
    stage.load_state_dict(picked, strict=True)


def assemble_state_dict(stages: Sequence[HFStage], *, check_tied: bool = True) -> dict[str, torch.Tensor]:
    """The full ``*ForCausalLM`` state dict, ``transformers`` names and order, from all stages (detached
    tensors sharing the stages' storage). Tied: ``lm_head.weight`` is the same tensor object as
    ``model.embed_tokens.weight`` (stage 0's copy); with ``check_tied`` the last stage's copy must equal it.
    Raises :class:`StageWeightsError` for stages that do not cover the model once, in order, or drifted copies."""
    stages = sorted(stages, key=lambda s: s.index)
    n = stages[0].n_stages if stages else 0
    if [s.index for s in stages] != list(range(n)) or any(s.n_stages != n for s in stages):
        raise StageWeightsError(f"got stages {[s.index for s in stages]}; give every stage 0..{n - 1} of one pipeline once")
    out: dict[str, torch.Tensor] = {}
    head = None
    for s in stages:
        for local, t in s.state_dict(keep_vars=False).items():
            name = s.hf_name(local)
            if name == "lm_head.weight":
                head = t
                continue
            out[name] = t.detach()
    last = stages[-1]
    if last.tied:
        emb = out["model.embed_tokens.weight"]
        if check_tied and head is not emb and not torch.equal(head, emb):
            diff = (head.float() - emb.float()).abs().max().item()
            raise StageWeightsError(f"the last stage's tied lm_head copy differs from stage 0's embedding by up to {diff:g}; "
                                    "sum the copies' gradients each step (sum_tied_grads) so they stay equal")
        out["lm_head.weight"] = emb
    else:
        out["lm_head.weight"] = head.detach()
    return out


@torch.no_grad()
def sum_tied_grads(first: HFStage, last: HFStage) -> None:
    """Tied embeddings across stages: set both copies' gradients (stage 0's ``embed_tokens.weight``,
    the last stage's ``lm_head.weight``) to their sum, the gradient of the one shared tensor. No-op when
    untied or when one stage holds both (they are one parameter there)."""
    if not first.tied or first is last:
        return
    e, h = first.embed_tokens.weight, last.lm_head.weight
    if e.grad is None and h.grad is None:
        return
    g = (e.grad if e.grad is not None else 0) + (h.grad.to(e.device) if h.grad is not None else 0)
    e.grad = g.clone()
    h.grad = g.to(h.device).clone()


@dataclass(frozen=True)
class StageSummary:
    """What a stage holds: ``layers`` (global decoder-layer range), ``flops_per_token`` (forward, see
    :func:`layer_flops_per_token`, LM head included on the last stage) and ``params`` (count)."""
    index: int
    layers: range
    flops_per_token: int
    params: int


def summarize(stages: Sequence[HFStage], seq_len: int = 2048) -> list[StageSummary]:
    """One :class:`StageSummary` per stage, in order."""
    out = []
    for s in stages:
        f = sum(layer_flops_per_token(s.config, seq_len)[i] for i in s.layer_range)
        if s.is_last:
            f += 2 * s.config.hidden_size * s.config.vocab_size
        out.append(StageSummary(s.index, s.layer_range, f, sum(p.numel() for p in s.parameters())))
    return out
