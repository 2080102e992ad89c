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


# ---------------------------------------------------------------------------------------------- GPU hot path
def test_gqa_runs_inside_sdpa_without_kv_copies(monkeypatch):
    """K/V reach SDPA with their K heads (``enable_gqa``), no [B, H, T, D] copies; same result as
    expanding K and V by hand (the transformers parity test above covers the whole model)."""
    import torch.nn.functional as F

    from iota_subnet.model import llama
    assert llama.SDPA_GQA                                       # torch 2.13 has enable_gqa
    attn = llama.Attention(CFG)
    x = torch.randn(2, 24, CFG.dim)
    cos, sin = llama.rope_cos_sin(CFG, 24)
    seen = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        seen.append((q.shape[1], k.shape[1], v.shape[1], kw.get("enable_gqa", False)))
        return real(q, k, v, **kw)
    monkeypatch.setattr(llama.F, "scaled_dot_product_attention", spy)
    y = attn(x, cos, sin)
    assert seen == [(CFG.n_heads, CFG.n_kv_heads, CFG.n_kv_heads, True)]
    monkeypatch.setattr(llama, "SDPA_GQA", False)               # the fallback for older torch
    y_old = attn(x, cos, sin)
    assert seen[-1] == (CFG.n_heads, CFG.n_heads, CFG.n_heads, False)
    assert torch.allclose(y, y_old, atol=1e-6)


def test_tail_cross_entropy_is_chunked_and_exact():
    """The tail never holds [rows x T, vocab] fp32 logits: forward and backward run chunk by chunk
    (every op output is recorded); loss and gradients equal the unchunked computation."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from iota_subnet.model import PipelineStage
    pcfg = PipelineConfig(stages=2, compression_ratio=1)
    torch.manual_seed(0)
    plain = PipelineStage(CFG, pcfg, 1)
    chunk_tokens = 16
    chunked = PipelineStage(CFG, pcfg, 1, ce_chunk_bytes=chunk_tokens * CFG.vocab_size * 4)
    chunked.load_state_dict(plain.state_dict())
    x = torch.randn(2, 48, CFG.dim, requires_grad=True)
    y = torch.randint(0, CFG.vocab_size, (2, 48))
    ref = plain(x, y)
    ref.backward()
    gx, gw = x.grad.clone(), plain.lm_head.weight.grad.clone()
    x.grad = None

    class Largest(TorchDispatchMode):
        biggest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in (out if isinstance(out, (list, tuple)) else (out,)):
                if (isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == CFG.vocab_size
                        and tuple(t.shape) != (CFG.dim, CFG.vocab_size)):      # not the LM head weight (transposed)
                    Largest.biggest = max(Largest.biggest, t.numel())
            return out
    with Largest():
        loss = chunked(x, y)
        loss.backward()
    assert Largest.biggest == chunk_tokens * CFG.vocab_size < 2 * 48 * CFG.vocab_size
    assert torch.allclose(loss, ref, rtol=1e-6, atol=1e-6)
    assert torch.allclose(x.grad, gx, atol=1e-6) and torch.allclose(chunked.lm_head.weight.grad, gw, atol=1e-6)


def test_activation_checkpointing_same_gradients_less_saved_memory():
    from iota_subnet.miner.activation_cache import SavedTensorMeter
    from iota_subnet.model import PipelineStage
    pcfg = PipelineConfig(stages=3, compression_ratio=1)
    torch.manual_seed(0)
    plain = PipelineStage(CFG, pcfg, 1)
    ckpt = PipelineStage(CFG, pcfg, 1, checkpointing=True)
    ckpt.load_state_dict(plain.state_dict())
    x = torch.randn(2, 64, CFG.dim)
    held = {}
    for name, m in (("plain", plain), ("ckpt", ckpt)):
        inp = x.clone().requires_grad_(True)
        meter = SavedTensorMeter(m, "cpu")
        with meter.measure(inputs=inp) as mm:
            out = m(inp)
        held[name] = meter.finish(mm, out)
        out.pow(2).sum().backward()
        held[name + "_grad"] = inp.grad
    assert torch.allclose(held["plain_grad"], held["ckpt_grad"], atol=1e-5)
    for (n, p), q in zip(plain.named_parameters(), ckpt.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-5), n
    # 1 block: its input, the RoPE tables and the output, against every intermediate of the block
    assert held["ckpt"] * 4 < held["plain"], held


def test_compiled_stage_matches_eager():
    """``train.compile``: the stage runs through torch.compile (``aot_eager`` here: no compiler
    toolchain needed; ``inductor`` on GPUs) with the eager results, forward and backward."""
    from iota_subnet.miner import StageWorker
    ovr = {"model": {"name": "tiny", "dim": 64, "n_layers": 3, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128,
                     "vocab_size": 256},
           "data": {"seq_len": 16, "vocab_size": 256}, "pipeline": {"stages": 3, "compression_ratio": 4},
           "train": {"batch_size": 4, "micro_batch_size": 2}}
    compiled = StageWorker(load_config("configs/tiny.yaml", {**ovr, "train": {**ovr["train"], "compile": "aot_eager"}}), 1)
    eager = StageWorker(load_config("configs/tiny.yaml", ovr), 1)
    assert compiled.compiled is not None and eager.compiled is None
    x = torch.randn(2, 16, 16)
    a, b = compiled.forward("m", x)["activations"], eager.forward("m", x)["activations"]
    g = torch.randn_like(a)
    assert torch.allclose(a, b, atol=1e-6) and torch.allclose(compiled.backward("m", g), eager.backward("m", g), atol=1e-6)
    with pytest.raises(ConfigError, match="train.compile"):
        load_config("configs/tiny.yaml", {"train": {"compile": "turbo"}})
