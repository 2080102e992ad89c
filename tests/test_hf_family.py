"""Pipeline stages built from transformers families (Llama, Qwen2, Qwen3, Mistral) give the same logits
as the transformers model (AutoModelForCausalLM.from_config, eval, fp32, attn_implementation="eager"
on both sides), the state dict round-trips with the original names, and bad inputs raise typed errors."""
from __future__ import annotations

import itertools
import json

import pytest
import torch

from transformers import AutoConfig, AutoModelForCausalLM, GPT2Config

from iota_subnet.model.hf_family import (
    HFFamilyError,
    StageSplitError,
    StageWeightsError,
    UnsupportedFamilyError,
    assemble_state_dict,
    build_hf_stage,
    build_hf_stages,
    layer_flops_per_token,
    layer_types,
    load_hf_config,
    load_stage_state,
    run_stages,
    split_hf_layers,
    sum_tied_grads,
)

SEQ = 32
ROPES = {
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
}
FAMILY_KW = {
    "llama": {},
    "qwen2": {},                                               # q/k/v biases are always on in Qwen2
    "qwen3": {"head_dim": 32},                                 # 4 heads x 32 = 128 != hidden 64; q/k norms
    "mistral": {"sliding_window": SEQ // 4},
    "qwen2-sliding": {"use_sliding_window": True, "sliding_window": SEQ // 4, "max_window_layers": 2},
}
RANGES = [(0, 1), (1, 4), (4, 5)]                              # 3 uneven stages of 5 layers


def _config(family: str, tied: bool, rope: str, **over):
    model_type = family.split("-")[0]
    kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=5, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=256, max_position_embeddings=64, rms_norm_eps=1e-6,
              tie_word_embeddings=tied, rope_theta=10000.0, rope_scaling=dict(ROPES[rope]))
    kw.update(FAMILY_KW[family])
    kw.update(over)
    return AutoConfig.for_model(model_type, **kw)


def _hf_model(config, seed: int = 0):
    """The transformers model with weights O(1) logits (norms and biases randomised too)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_((1.0 if "norm" in name else 0.0) + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    return model


def _staged(model, n_stages=3, layer_ranges=RANGES):
    stages = build_hf_stages(model.config, n_stages, layer_ranges=layer_ranges, attn_implementation="eager",
                             init_seed=None)
    for s in stages:
        load_stage_state(s, model)
        s.eval()
    return stages


def _ids(batch=2, seed=1):
    return torch.randint(0, 256, (batch, SEQ), generator=torch.Generator().manual_seed(seed))


def _assert_parity(ref: torch.Tensor, got: torch.Tensor) -> None:
    assert got.shape == ref.shape and got.dtype == ref.dtype == torch.float32
    tol = 1e-5 * max(1.0, ref.abs().max().item())
    assert (got - ref).abs().max().item() <= tol


@pytest.mark.parametrize("rope", sorted(ROPES))
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("family", sorted(FAMILY_KW))
def test_staged_logits_equal_transformers(family, tied, rope):
    model = _hf_model(_config(family, tied, rope))
    ids = _ids()
    stages = _staged(model)
    assert [len(s.layers) for s in stages] == [1, 3, 1]
    with torch.no_grad():
        ref = model(ids).logits
        h0 = stages[0](ids)
        h1 = stages[1](h0)
        got = stages[2](h1)
    assert h0.shape == h1.shape == (2, SEQ, 64) and got.shape == (2, SEQ, 256)
    assert ref.abs().max().item() > 1.0                                      # the tolerance is relative
    _assert_parity(ref, got)


def test_sliding_window_binds():
    """Mistral's window (a quarter of the sequence) changes the logits, so parity above tests it."""
    model = _hf_model(_config("mistral", False, "yarn"))
    wide = _hf_model(_config("mistral", False, "yarn", sliding_window=None))
    wide.load_state_dict(model.state_dict())
    ids = _ids()
    with torch.no_grad():
        a, b = model(ids).logits, wide(ids).logits
    assert torch.allclose(a[:, : SEQ // 4], b[:, : SEQ // 4], atol=1e-5)
    assert (a[:, SEQ // 2:] - b[:, SEQ // 2:]).abs().max() > 1e-2
    assert layer_types(model.config) == ["sliding_attention"] * 5
    assert layer_types(_config("qwen2-sliding", False, "yarn"))[:3] == ["full_attention", "full_attention", "sliding_attention"]


@pytest.mark.parametrize("fmt", ["rope_scaling", "rope_parameters"])
def test_config_folder_both_rope_formats(tmp_path, fmt):
    """A config.json with the older ``rope_scaling`` + top-level ``rope_theta`` and one with the current
    ``rope_parameters`` both load, give the same RoPE, and a one-stage model matches transformers."""
    raw = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 64,
           "tie_word_embeddings": False}
    if fmt == "rope_scaling":
        raw.update(rope_theta=500000.0, rope_scaling=dict(ROPES["llama3"]))
    else:
        raw.update(rope_parameters={**ROPES["llama3"], "rope_theta": 500000.0})
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = load_hf_config(tmp_path, "eager")
    assert cfg.rope_parameters == {**ROPES["llama3"], "rope_theta": 500000.0}
    for other in (raw, tmp_path / "config.json"):                   # a config.json dict or file path
        assert load_hf_config(other).rope_parameters == cfg.rope_parameters
    model = _hf_model(cfg)
    stage = build_hf_stage(tmp_path, 0, 1, attn_implementation="eager", init_seed=None).eval()
    load_stage_state(stage, model)
    ids = _ids(1)
    with torch.no_grad():
        _assert_parity(model(ids).logits, stage(ids))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_state_dict_round_trip(tied):
    model = _hf_model(_config("qwen3", tied, "yarn"))
    ref = model.state_dict()
    stages = _staged(model)
    out = assemble_state_dict(stages)
    assert list(out) == list(ref)
    for k in ref:
        assert out[k].shape == ref[k].shape and out[k].dtype == ref[k].dtype and torch.equal(out[k], ref[k]), k
    if tied:
        assert out["lm_head.weight"] is out["model.embed_tokens.weight"]
        # a safetensors file of a tied model omits lm_head.weight: the head copy comes from the embedding
        last = build_hf_stages(model.config, 3, layer_ranges=RANGES, attn_implementation="eager")[2]
        load_stage_state(last, {k: v for k, v in ref.items() if k != "lm_head.weight"})
        assert torch.equal(last.lm_head.weight, ref["model.embed_tokens.weight"])
    fresh = AutoModelForCausalLM.from_config(model.config, attn_implementation="eager").eval()
    fresh.load_state_dict(out, strict=True)
    assert (fresh.lm_head.weight is fresh.model.embed_tokens.weight) == tied
    ids = _ids(1)
    with torch.no_grad():
        _assert_parity(model(ids).logits, fresh(ids).logits)


def test_tied_copies_stay_tied_through_training():
    """Summed gradients equal the full model's gradient of the one tied tensor, and the same SGD step
    keeps the two copies bit-identical; a drifted copy is refused on export."""
    model = _hf_model(_config("llama", True, "llama3"))
    stages = _staged(model)
    for s in stages:
        s.train()
    model.train()
    ids = _ids()
    model(ids).logits.float().pow(2).mean().backward()
    run_stages(stages, ids).pow(2).mean().backward()
    sum_tied_grads(stages[0], stages[-1])
    g = model.model.embed_tokens.weight.grad
    for copy_ in (stages[0].embed_tokens.weight, stages[-1].lm_head.weight):
        assert torch.allclose(copy_.grad, g, atol=1e-6 * max(1.0, g.abs().max().item()))
    opt = torch.optim.SGD([p for s in stages for p in s.parameters()], lr=0.1)
    opt.step()
    assert torch.equal(stages[0].embed_tokens.weight, stages[-1].lm_head.weight)
    assemble_state_dict(stages)
    with torch.no_grad():
        stages[-1].lm_head.weight.add_(1e-3)
    with pytest.raises(StageWeightsError, match="sum_tied_grads"):
        assemble_state_dict(stages)


def test_seeded_init_same_on_every_host_and_tied_copies_equal():
    cfg = _config("qwen2", True, "yarn")
    a = build_hf_stages(cfg, 3, layer_ranges=RANGES, init_seed=7)
    b = build_hf_stage(cfg, 1, 3, layer_ranges=RANGES, init_seed=7)
    assert all(torch.equal(x, y) for x, y in zip(a[1].state_dict().values(), b.state_dict().values()))
    assert torch.equal(a[0].embed_tokens.weight, a[2].lm_head.weight)
    assert torch.all(a[1].layers[0].self_attn.q_proj.bias == 0) and torch.all(a[2].norm.weight == 1)
    assert run_stages(a, _ids()).shape == (2, SEQ, 256)


def test_flop_balanced_split_is_min_max_and_contiguous():
    cfg = _config("mistral", False, "yarn", num_hidden_layers=6, vocab_size=50_000)
    for n in (1, 2, 3, 6):
        rs = split_hf_layers(cfg, n, seq_len=SEQ)
        assert [r.start for r in rs] == [0] + [r.stop for r in rs[:-1]] and rs[-1].stop == 6
    cost = layer_flops_per_token(cfg, SEQ)
    head = 2 * 64 * 50_000

    def worst(counts):
        bounds = list(itertools.accumulate(counts, initial=0))
        f = [sum(cost[bounds[i]:bounds[i + 1]]) for i in range(len(counts))]
        f[-1] += head
        return max(f)

    rs = split_hf_layers(cfg, 3, seq_len=SEQ)
    best = min(worst(c) for c in itertools.product(range(1, 5), repeat=3) if sum(c) == 6)
    assert worst([len(r) for r in rs]) == best
    assert len(rs[-1]) == 1                                    # the big LM head keeps the tail short
    stages = build_hf_stages(cfg, 3, seq_len=SEQ)
    assert [s.layer_range for s in stages] == rs


def test_unsupported_family_raises_typed_error(tmp_path):
    with pytest.raises(UnsupportedFamilyError, match="gpt2.*supported: llama, mistral, qwen2, qwen3"):
        build_hf_stages(GPT2Config(n_layer=2), 2)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    with pytest.raises(ValueError, match="not supported"):
        load_hf_config(tmp_path)
    with pytest.raises(HFFamilyError, match="no config.json"):
        load_hf_config(tmp_path / "absent")
    assert issubclass(UnsupportedFamilyError, ValueError) and issubclass(StageSplitError, ValueError)


@pytest.mark.parametrize("n_stages,ranges,match", [
    (6, None, r"stages=6 must lie in \[1, 5\]"),
    (0, None, r"stages=0 must lie in \[1, 5\]"),
    (3, [(0, 2), (2, 5)], "has 2 entries but stages=3"),
    (3, [(0, 2), (3, 4), (4, 5)], r"layer_ranges\[1\]=\(3, 4\).*start at 2"),
    (3, [(0, 2), (2, 2), (2, 5)], r"must be non-empty"),
    (3, [(0, 1), (1, 2), (2, 4)], "end at layer 4 but the model has 5 layers"),
])
def test_bad_split_raises_typed_error(n_stages, ranges, match):
    with pytest.raises(StageSplitError, match=match):
        build_hf_stages(_config("llama", False, "yarn"), n_stages, layer_ranges=ranges)


def test_bad_stage_index_and_weights_raise_typed_errors():
    cfg = _config("llama", False, "yarn")
    with pytest.raises(StageSplitError, match="stage index 3"):
        build_hf_stage(cfg, 3, 3)
    stage = build_hf_stage(cfg, 1, 3, layer_ranges=RANGES)
    with pytest.raises(StageWeightsError, match="model.layers.1.*missing"):
        load_stage_state(stage, {})
    other = _hf_model(_config("llama", False, "yarn", intermediate_size=96))
    with pytest.raises(StageWeightsError, match="shape"):
        load_stage_state(stage, other)
