"""Model, stages and bottleneck: parity with transformers' Llama, stage equivalence, config errors."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from iota_subnet.config import MODEL_CONFIGS, ConfigError, ModelConfig, PipelineConfig, load_config, model_config
from iota_subnet.model import StagedModel, bottleneck_dims, build_model, build_stages, split_layers

# Small enough to run in a second, with GQA (4 query heads over 2 kv heads) and Llama 3.1 RoPE
# scaling whose low-frequency band is reached at T = 96 (original context 32).
CFG = ModelConfig("test", vocab_size=512, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=160,
                  max_seq_len=256, rope_theta=10000.0,
                  rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 32})


def _hf_model(cfg: ModelConfig):
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
        rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta,
        rope_scaling={"rope_type": "llama3", **cfg.rope_scaling}, max_position_embeddings=cfg.max_seq_len,
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False)
    hf_cfg._attn_implementation = "eager"
    return transformers.LlamaForCausalLM(hf_cfg).eval()


def test_logits_match_transformers_llama():
    ours = build_model(CFG, seed=1).eval()
    hf = _hf_model(CFG)
    sd = {("model." + k if not k.startswith("lm_head") else k): v for k, v in ours.state_dict().items()}
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    tokens = torch.randint(0, CFG.vocab_size, (2, 96), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = ours(tokens)
        b = hf(tokens).logits
    assert a.shape == b.shape == (2, 96, CFG.vocab_size)
    assert (a - b).abs().max().item() < 1e-4


def test_rope_scaling_changes_low_frequencies_only():
    from iota_subnet.model.llama import rope_inv_freq
    plain = rope_inv_freq(dataclasses.replace(CFG, rope_scaling=None))
    scaled = rope_inv_freq(CFG)
    assert torch.allclose(plain[:1], scaled[:1])               # highest frequency untouched
    assert (scaled <= plain).all()
    assert torch.allclose(plain[-1] / 8.0, scaled[-1])          # lowest divided by the factor


def test_chained_stages_reproduce_full_model_loss_and_gradients():
    pcfg = PipelineConfig(stages=3, compression_ratio=1)
    full = build_model(CFG, seed=3)
    stages = build_stages((CFG, pcfg), seed=99)
    full_sd = full.state_dict()
    for st in stages:
        st.load_state_dict({k: full_sd[k] for k in st.state_dict()})
    staged = StagedModel(stages)
    assert staged.param_count() == full.param_count()
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, CFG.vocab_size, (3, 40), generator=g)
    targets = torch.randint(0, CFG.vocab_size, (3, 40), generator=g)
    loss_full = full(tokens, targets)
    loss_staged = staged(tokens, targets)
    loss_full.backward()
    loss_staged.backward()
    assert torch.allclose(loss_full, loss_staged, atol=1e-6, rtol=0)
    grads_full = {n: p.grad for n, p in full.named_parameters()}
    n_checked = 0
    for st in stages:
        for n, p in st.named_parameters():
            assert torch.allclose(p.grad, grads_full[n], atol=1e-6, rtol=1e-5), n
            n_checked += 1
    assert n_checked == len(grads_full)


def test_stage_boundaries_carry_bottleneck_width_both_ways():
    pcfg = PipelineConfig(stages=3, compression_ratio=8, identity_rank=4)
    head, body, tail = build_stages((CFG, pcfg))
    b, r = bottleneck_dims(CFG, pcfg)
    assert (b, r) == (8, 4)
    tokens = torch.randint(0, CFG.vocab_size, (2, 16))
    z1 = head(tokens)
    assert z1.shape == (2, 16, b)
    z1_in = z1.detach().requires_grad_(True)
    z2 = body(z1_in)
    assert z2.shape == (2, 16, b)
    z2_in = z2.detach().requires_grad_(True)
    loss = tail(z2_in, tokens)
    loss.backward()
    assert z2_in.grad.shape == (2, 16, b)                # the activation gradient is [B, T, b] too
    z2.backward(z2_in.grad)
    assert z1_in.grad.shape == (2, 16, b) and torch.isfinite(z1_in.grad).all()
    # identity path: the first r coordinates of the residual stream cross unchanged
    h = torch.randn(2, 16, CFG.dim)
    assert torch.equal(head.bottleneck_out(h)[..., :r], h[..., :r])


def test_stage_reports_params_and_flops():
    stages = build_stages((CFG, PipelineConfig(stages=2)))
    full = build_model(CFG)
    assert sum(s.param_count() for s in stages) == full.param_count()
    assert sum(s.flops_per_token(64) for s in stages) == full.flops_per_token(64)
    assert stages[0].flops_per_token(64, training=True) == 3 * stages[0].flops_per_token(64, training=False)


def test_named_configs_have_the_advertised_sizes():
    assert 9e6 < build_model(MODEL_CONFIGS["tiny"]).param_count() < 12e6
    assert 20e6 < build_model(MODEL_CONFIGS["small"]).param_count() < 30e6
    for name in ("100m", "1b", "8b", "15b", "100b"):
        model_config(name)  # validates


@pytest.mark.parametrize("kwargs, fix", [
    (dict(stages=9), "at most 8 stages"),
    (dict(stages=3, layer_split=[2, 2, 2]), "summing to the model's 8 layers"),
    (dict(stages=2, layer_split=[8]), "one count per stage"),
])
def test_bad_split_names_the_fix(kwargs, fix):
    with pytest.raises(ConfigError, match=fix):
        build_stages((MODEL_CONFIGS["tiny"], PipelineConfig(**kwargs)))


def test_bad_bottleneck_width_names_the_fix():
    with pytest.raises(ConfigError, match="does not divide model width d=256; choose one of"):
        bottleneck_dims(MODEL_CONFIGS["tiny"], PipelineConfig(stages=2, compression_ratio=3))
    with pytest.raises(ConfigError, match="bottleneck width of 1"):
        bottleneck_dims(MODEL_CONFIGS["tiny"], PipelineConfig(stages=2, compression_ratio=256))


def test_unknown_config_names_the_choices(tmp_path):
    with pytest.raises(ConfigError, match="choose one of"):
        model_config("giant")
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: tiny\ntrain: {batchsize: 4}\n")
    with pytest.raises(ConfigError, match="unknown key"):
        load_config(bad)


def test_split_layers_balanced():
    assert [len(r) for r in split_layers(8, 3)] == [3, 3, 2]
    assert split_layers(8, 1) == [range(0, 8)]
