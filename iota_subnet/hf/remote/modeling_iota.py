"""An iota-subnet model for Hugging Face ``transformers``
(``AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)``).

The same computation as iota-subnet's pipeline stages run one after another (``StagedModel``):
Llama-3 blocks (RMSNorm, RoPE with Llama 3.1 scaling, grouped-query attention through
``scaled_dot_product_attention``, SwiGLU; Grattafiori et al. 2024, arXiv 2407.21783) and, at each
stage boundary, the residual bottleneck (ResBM, Aboudib et al. 2026, arXiv 2604.11947)::

    z     = concat(h[..., :r], RMSNorm_e(h) @ W_e)          # [B, T, b]  what crossed the wire
    h_hat = concat(z[..., :r], 0) + z[..., r:] @ W_d        # [B, T, d]

Self-contained (torch and transformers only): the export folder works without iota-subnet. No
key/value cache: generation recomputes the whole prefix at each token (fine for the small models
trained here). Padding is not supported (``attention_mask`` must be all ones).
Parameter names: ``model.embed_tokens``, ``model.layers.{i}`` (Llama names), ``model.bottlenecks.{k}``
(boundary after stage k: ``encoder.norm``, ``encoder.proj``, ``decoder.proj``), ``model.norm``, ``lm_head``.
"""
import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_iota import IotaConfig


class IotaRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_inv_freq(config: IotaConfig) -> torch.Tensor:
    D = config.hidden_size // config.num_attention_heads
    inv_freq = 1.0 / (config.iota_rope_theta ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D))
    sc = config.iota_rope_scaling
    if not sc:
        return inv_freq
    factor, low, high = float(sc["factor"]), float(sc["low_freq_factor"]), float(sc["high_freq_factor"])
    old_ctx = float(sc["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class IotaAttention(nn.Module):
    def __init__(self, config: IotaConfig):
        super().__init__()
        d, H, K = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        self.n_heads, self.n_kv_heads, self.head_dim = H, K, d // H
        self.q_proj = nn.Linear(d, H * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, K * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, K * self.head_dim, bias=False)
        self.o_proj = nn.Linear(H * self.head_dim, d, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos.to(q.dtype) + _rotate_half(q) * sin.to(q.dtype)
        k = k * cos.to(k.dtype) + _rotate_half(k) * sin.to(k.dtype)
        if self.n_kv_heads != self.n_heads:
            rep = self.n_heads // self.n_kv_heads
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class IotaMLP(nn.Module):
    def __init__(self, config: IotaConfig):
        super().__init__()
        d, f = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class IotaDecoderLayer(nn.Module):
    def __init__(self, config: IotaConfig):
        super().__init__()
        self.input_layernorm = IotaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = IotaAttention(config)
        self.post_attention_layernorm = IotaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = IotaMLP(config)

    def forward(self, x, cos, sin):
        h = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


class IotaBottleneckEncoder(nn.Module):
    def __init__(self, config: IotaConfig):
        super().__init__()
        b, r = config.bottleneck_width, config.identity_rank
        self.r = r
        self.norm = IotaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.proj = nn.Linear(config.hidden_size, b - r, bias=False) if b > r else None

    def forward(self, h):
        z_id = h[..., : self.r]
        if self.proj is None:
            return z_id.contiguous()
        return torch.cat((z_id, self.proj(self.norm(h))), dim=-1)


class IotaBottleneckDecoder(nn.Module):
    def __init__(self, config: IotaConfig):
        super().__init__()
        b, r = config.bottleneck_width, config.identity_rank
        self.r, self.d = r, config.hidden_size
        self.proj = nn.Linear(b - r, config.hidden_size, bias=False) if b > r else None

    def forward(self, z):
        h = F.pad(z[..., : self.r], (0, self.d - self.r))
        if self.proj is not None:
            h = h + self.proj(z[..., self.r:])
        return h


class IotaBottleneck(nn.Module):
    def __init__(self, config: IotaConfig):
        super().__init__()
        self.encoder = IotaBottleneckEncoder(config)
        self.decoder = IotaBottleneckDecoder(config)

    def forward(self, h):
        return self.decoder(self.encoder(h))


class IotaPreTrainedModel(PreTrainedModel):
    config_class = IotaConfig
    base_model_prefix = "model"
    _no_split_modules = ["IotaDecoderLayer"]
    _supports_cache_class = False

    def _init_weights(self, module):
        std = 0.02
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(0.0, std)
        elif isinstance(module, nn.Embedding):
            module.weight.data.normal_(0.0, std)
        elif isinstance(module, IotaRMSNorm):
            module.weight.data.fill_(1.0)


class IotaModel(IotaPreTrainedModel):
    """Embedding, the decoder layers with a bottleneck after each stage but the last, final norm."""

    def __init__(self, config: IotaConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(IotaDecoderLayer(config) for _ in range(config.num_hidden_layers))
        split = list(config.layer_split)
        if sum(split) != config.num_hidden_layers:
            raise ValueError(f"layer_split {split} does not sum to num_hidden_layers={config.num_hidden_layers}")
        self.boundaries = [sum(split[: k + 1]) for k in range(len(split) - 1)]   # layer index after which
        compressed = int(config.compression_ratio) > 1
        self.bottlenecks = nn.ModuleDict({str(k): IotaBottleneck(config) for k in range(len(self.boundaries))}
                                         if compressed else {})
        self.norm = IotaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(self, input_ids):
        h = self.embed_tokens(input_ids)                                       # [B, T, d]
        T = h.shape[1]
        inv_freq = rope_inv_freq(self.config).to(h.device)
        freqs = torch.outer(torch.arange(T, device=h.device, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin)
            if i + 1 in self.boundaries and len(self.bottlenecks):
                h = self.bottlenecks[str(self.boundaries.index(i + 1))](h)
        return self.norm(h)


class IotaForCausalLM(IotaPreTrainedModel, GenerationMixin):
    """Logits [B, T, V] for token ids [B, T]; ``labels`` [B, T] give the mean next-token loss
    (nats/token, labels shifted inside as in ``LlamaForCausalLM``)."""

    _tied_weights_keys = []

    def __init__(self, config: IotaConfig):
        super().__init__(config)
        self.model = IotaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
        return {"input_ids": input_ids, "attention_mask": attention_mask}

    def forward(self, input_ids: Optional[torch.LongTensor] = None, attention_mask: Optional[torch.Tensor] = None,
                labels: Optional[torch.LongTensor] = None, return_dict: Optional[bool] = None, **kwargs):
        if input_ids is None:
            raise ValueError("IotaForCausalLM needs input_ids (inputs_embeds are not supported)")
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            raise ValueError("IotaForCausalLM does not support padding: attention_mask must be all ones")
        logits = self.lm_head(self.model(input_ids))                          # [B, T, V]
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                   labels[:, 1:].reshape(-1), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits)
