"""Family-specific cheats: a ``transformers`` family stage computed without the part that makes the
family what it is, to show that a validator's exact replay (:mod:`iota_subnet.audit.replay`) tells
it from honest work.

``drop-bias``       (Qwen2) attention without the q/k/v projection biases (the weights still hold them).
``skip-qk-norm``    (Qwen3) attention without the per-head RMSNorm of queries and keys (``q_norm`` /
                    ``k_norm``; their weights stay in ``/state``).
``full-attention``  (Mistral, or Qwen2 / Qwen3 with sliding layers) every layer attends causally over
                    the whole sequence instead of its ``sliding_window`` (cheaper for a fused kernel
                    without window support; binds only when the sequence is longer than the window).

Each is a *twin* of the miner's :class:`~iota_subnet.model.hf_family.HFStage` (:func:`twisted_stage`):
a structural copy sharing every parameter and buffer with the stage, with the family part replaced
through public module attributes (``nn.Module`` children, ``layer_kinds``, the twin's own copy of the
``transformers`` config). The cheating worker (:class:`~iota_subnet.sim.adversary.CheatingStageWorker`)
computes forward and backward with the twin, so its gradients land in its real weights and its
optimizer, commitments and ``/state`` are those of an honest miner; only its hops differ.

Two of the generic cheats (:mod:`iota_subnet.sim.adversary`) are twins on a family stage too
(:data:`TWIN_KINDS`; the project's own stages do them in place), family-agnostic:

``lazy``            the twin holds every other decoder layer of the stage (the 2nd, 4th, ...; none when
                    the stage holds one, so a middle stage passes its input through and the last stage
                    computes ``lm_head(norm(x))``); the layers it keeps train, the others get no gradient.
``precision``       the twin's last decoder layer has no MLP (its residual stream passes it by); the
                    worker also computes under bf16 autocast whatever the run says.

Limit of ``drop-bias``: it changes the output only where the biases are not 0. From a scratch init
(biases 0) the cheater's own biases never train (the twin gives them no gradient), so it computes
exactly what an honest miner computes with its committed weights and its hops pass replay until its
biases change (a replica merge brings the others' trained biases in; a pretrained checkpoint has them
from the start). What it skips then is the biases' training, and the update audit takes the committed
gradient (zero for them, listed in the commitment's ``no_grad``) as given, so that alone is not caught.

Sources: ``transformers.models.{qwen2,qwen3,mistral}.modeling_*`` (``*Attention.__init__`` /
``forward``); ``transformers.masking_utils``. Qwen3: Yang et al. 2025, "Qwen3 Technical Report", sec. 2
(QK-Norm); Mistral: Jiang et al. 2023, "Mistral 7B", sec. 2 (sliding window attention).
"""
from __future__ import annotations

import copy
import itertools

import torch
from torch import nn

from iota_subnet.config import ConfigError, RunConfig
from iota_subnet.model.hf_family import FULL, SLIDING, HFStage, layer_types

#: family-specific kind -> the ``model_type`` s it applies to
FAMILY_KINDS: dict[str, tuple[str, ...]] = {"drop-bias": ("qwen2",), "skip-qk-norm": ("qwen3",),
                                           "full-attention": ("mistral", "qwen2", "qwen3")}
#: generic cheats a family stage does with a twin (any family; see the module docstring)
TWIN_KINDS = ("lazy", "precision")


def on_twin(kind: str, stage: nn.Module) -> bool:
    """True when cheat ``kind`` on ``stage`` computes with :func:`twisted_stage`'s twin: a family
    cheat, or a kind of :data:`TWIN_KINDS` on a ``transformers`` family stage (an :class:`HFStage`)."""
    return kind in FAMILY_KINDS or (kind in TWIN_KINDS and isinstance(stage, HFStage))


def check_family_kind(kind: str, cfg: RunConfig) -> None:
    """Raises :class:`ConfigError` unless the run's model is a ``transformers`` family ``kind`` applies
    to (``full-attention``: with at least one sliding-window layer)."""
    families = FAMILY_KINDS[kind]
    hf = getattr(cfg.model, "hf", None)
    if hf is None:
        raise ConfigError(f"--adversary {kind} cheats on a transformers family ({', '.join(families)}); "
                          f"give the run a model.hf of one of them")
    tcfg = cfg.model.transformers_config()
    if tcfg.model_type not in families:
        raise ConfigError(f"--adversary {kind} applies to {', '.join(families)}, not {tcfg.model_type!r}; "
                          f"pick a kind of this family or another model")
    if kind == "full-attention" and SLIDING not in layer_types(tcfg):
        raise ConfigError(f"--adversary full-attention needs sliding-window layers; this {tcfg.model_type} has "
                          "none (set sliding_window, and for qwen2 / qwen3 use_sliding_window)")


def _unbiased(lin: nn.Linear) -> nn.Linear:
    """A bias-free :class:`nn.Linear` sharing ``lin``'s weight [out, in]."""
    out = nn.Linear(lin.in_features, lin.out_features, bias=False, device="meta")
    out.weight = lin.weight
    return out


class NoMLP(nn.Module):
    """In place of a decoder layer's MLP: zeros of the input's shape and dtype ``[B, T, d]``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(x)


def twisted_stage(stage: nn.Module, kind: str) -> nn.Module:
    """A twin of ``stage`` (an :class:`~iota_subnet.model.hf_family.HFStage`) sharing its parameters
    and buffers (the same tensor objects: gradients of the twin's forward accumulate into ``stage``),
    computing as cheat ``kind`` (see the module docstring). Same inputs and outputs as ``stage``.
    Raises ``ValueError`` for another kind."""
    if kind not in FAMILY_KINDS and kind not in TWIN_KINDS:
        raise ValueError(f"{kind!r} is not a cheat done with a twin; one of {', '.join((*FAMILY_KINDS, *TWIN_KINDS))}")
    memo = {id(t): t for t in itertools.chain(stage.parameters(), stage.buffers())}
    twin = copy.deepcopy(stage, memo)          # modules and config copied, tensors shared
    if kind == "lazy":
        keep = range(1, len(twin.layers), 2)
        twin.layers = nn.ModuleList([twin.layers[i] for i in keep])
        twin.layer_kinds = [twin.layer_kinds[i] for i in keep]
        return twin
    if kind == "precision":
        twin.layers[-1].mlp = NoMLP()
        return twin
    for layer in twin.layers:
        attn = layer.self_attn
        if kind == "drop-bias":
            attn.q_proj, attn.k_proj, attn.v_proj = (_unbiased(attn.q_proj), _unbiased(attn.k_proj),
                                                     _unbiased(attn.v_proj))
        elif kind == "skip-qk-norm":
            attn.q_norm, attn.k_norm = nn.Identity(), nn.Identity()
        elif hasattr(attn, "sliding_window"):
            attn.sliding_window = None
    if kind == "full-attention":
        twin.layer_kinds = [FULL] * len(twin.layer_kinds)
        twin.config.sliding_window = None       # Mistral's attention reads it from its (the twin's) config
    return twin
