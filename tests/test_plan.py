"""The stage planner (iota_subnet.plan): FLOPs, balanced splits, measured activation memory, the CLI."""
from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

import pytest
import torch

from iota_subnet.cli import main as cli_main
from iota_subnet.config import MODEL_CONFIGS, ModelConfig, PipelineConfig, RunConfig, load_config
from iota_subnet.hardware import GIB, GPUS, parse_accelerator
from iota_subnet.model import PipelineStage, build_stages
from iota_subnet.model.llama import block_flops_per_token
from iota_subnet.plan import (balanced_layer_split, ideal_tokens_per_s, measure_activations, meta_stage, plan,
                              plan_stage, stage_flops, stage_timings)

REPO = Path(__file__).resolve().parents[1]
SMALL = ModelConfig("t", vocab_size=512, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=160, max_seq_len=128)


def _cfg(model: ModelConfig, stages: int, ratio: int, *, rows: int = 2, seq: int = 64, ckpt: bool = False,
         split=None) -> RunConfig:
    from iota_subnet.config import DataConfig, TrainConfig
    return RunConfig(model=model, pipeline=PipelineConfig(stages=stages, compression_ratio=ratio, layer_split=split),
                     data=DataConfig(vocab_size=model.vocab_size, seq_len=seq),
                     train=TrainConfig(batch_size=rows * 2, micro_batch_size=rows, activation_checkpointing=ckpt)
                     ).validate()


# ------------------------------------------------------------------------------------ compute
@pytest.mark.parametrize("name,stages,ratio", [("tiny", 3, 8), ("8b", 8, 64), ("1b", 4, 1), ("8b", 1, 1)])
def test_stage_flops_match_the_module(name, stages, ratio):
    model = MODEL_CONFIGS[name]
    pcfg = PipelineConfig(stages=stages, compression_ratio=ratio)
    for s in range(stages):
        with torch.device("meta"):
            m = PipelineStage(model, pcfg, s, init=False)
        f = stage_flops(model, pcfg, 2048 if name != "tiny" else 256, s)
        T = 2048 if name != "tiny" else 256
        assert f.forward == m.flops_per_token(T, training=False)
        assert f.train(False) == m.flops_per_token(T, training=True)
        # a checkpointed block runs again in the backward, all but its down_proj (early stop)
        recompute = block_flops_per_token(model, T) - 2 * model.dim * model.ffn_dim
        assert f.train(True) == f.train(False) + len(m.spec.layers) * recompute


def test_validator_counts_stage_flops_from_shapes():
    """The validator's compute shares of an 8b run come from the shapes (it used to build every stage on CPU)."""
    from iota_subnet.validator.scoring import stage_compute_shares, stage_flops as validator_flops
    cfg = load_config(REPO / "configs" / "8b.yaml")
    want = []
    for s in range(8):
        with torch.device("meta"):
            want.append(PipelineStage(cfg.model, cfg.pipeline, s, init=False).flops_per_token(2048))
    assert validator_flops(cfg) == want
    assert sum(stage_compute_shares(cfg)) == pytest.approx(1.0)


def _brute_force_min_max(model, stages, seq, ratio, ckpt) -> int:
    best = None
    for counts in itertools.product(range(1, model.n_layers + 1), repeat=stages):
        if sum(counts) != model.n_layers:
            continue
        pcfg = PipelineConfig(stages=stages, compression_ratio=ratio, layer_split=list(counts))
        worst = max(stage_flops(model, pcfg, seq, s).train(ckpt) for s in range(stages))
        best = worst if best is None else min(best, worst)
    return best


@pytest.mark.parametrize("ckpt", [False, True])
@pytest.mark.parametrize("vocab,stages", [(512, 3), (40000, 3), (40000, 4), (4000, 2)])
def test_balanced_split_is_optimal(vocab, stages, ckpt):
    model = dataclasses.replace(SMALL, vocab_size=vocab, n_layers=8)
    split = balanced_layer_split(model, stages, 64, compression_ratio=4, checkpointing=ckpt)
    assert sum(split) == 8 and min(split) >= 1
    pcfg = PipelineConfig(stages=stages, compression_ratio=4, layer_split=split)
    worst = max(stage_flops(model, pcfg, 64, s).train(ckpt) for s in range(stages))
    assert worst == _brute_force_min_max(model, stages, 64, 4, ckpt)
    if vocab == 40000:     # a heavy LM head: the tail gets fewer blocks than the head
        assert split[-1] < split[0]


def test_shipped_configs_use_the_balanced_split():
    for name, stages, ratio in (("8b", 8, 64), ("1b", 4, 64), ("100b", 16, 144)):
        cfg = load_config(REPO / "configs" / f"{name}.yaml")
        p = cfg.pipeline
        assert p.stages == stages and p.compression_ratio == ratio and cfg.data.seq_len == 2048
        assert p.layer_split == balanced_layer_split(cfg.model, stages, 2048, compression_ratio=ratio,
                                                     checkpointing=cfg.train.activation_checkpointing,
                                                     rows=cfg.train.micro_batch)
        assert cfg.model.vocab_size == cfg.data.vocab_size == 128256


def test_ideal_tokens_per_s_by_hand():
    """8b, 8 stages, A100 at MFU 0.5: replicas / (seconds per token of the slowest stage)."""
    cfg = load_config(REPO / "configs" / "8b.yaml")
    acc = GPUS["a100"]
    tim = stage_timings(cfg, acc, 0.5)
    T = 2048
    blk = block_flops_per_token(cfg.model, T)
    # stage 0: 5 blocks + encoder (2 x d x (b - r)); checkpointing adds one block forward but its down_proj
    fwd0 = 5 * blk + 2 * 4096 * 32
    assert tim[0].forward_s == pytest.approx(fwd0 / 156e12)
    assert tim[0].backward_s == pytest.approx((2 * fwd0 + 5 * (blk - 2 * 4096 * 14336)) / 156e12)
    P0 = meta_stage(cfg, 0).param_count()
    assert tim[0].step_s == pytest.approx(P0 * 28 / acc.memory_bandwidth)
    # the tail (2 blocks + LM head): its chunked cross-entropy runs the head a fourth time
    head = 2 * 4096 * 128256
    fwd7 = 2 * blk + 2 * 4096 * 32 + head
    assert tim[7].backward_s == pytest.approx((2 * fwd7 + 2 * (blk - 2 * 4096 * 14336) + head) / 156e12)
    tokens_step = cfg.train.batch_size * T
    slowest = max(t.per_token(tokens_step) for t in tim)
    assert tim[0].per_token(tokens_step) == slowest          # 5 blocks and the embedding's optimizer step
    assert ideal_tokens_per_s(tim, 2, tokens_step) == pytest.approx(2 / slowest)
    # about 17,700 tokens/s per replica: 156 TFLOP/s over ~8.8 GFLOP per token
    assert 16_000 < ideal_tokens_per_s(tim, 1, tokens_step) < 19_000
    # without recomputation the same stage is faster
    assert ideal_tokens_per_s(stage_timings(cfg, acc, 0.5, False), 1, tokens_step) > \
        ideal_tokens_per_s(tim, 1, tokens_step) * 1.2


# ------------------------------------------------------------------------------------ memory
def _real_saved_bytes(module: torch.nn.Module, x: torch.Tensor, targets=None) -> int:
    """Bytes of distinct non-parameter storages saved for backward in a real CPU forward."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    params.update(t.untyped_storage().data_ptr() for t in module._cos_sin(x.shape[1], x.device))
    seen: dict[int, int] = {}
    keep = []

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr not in seen:
            seen[ptr] = t.untyped_storage().nbytes()
            keep.append(t)
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(x, targets) if targets is not None else module(x)
    for t in (x, out):
        if t.dtype.is_floating_point and t.dim() == 3 and t.untyped_storage().data_ptr() not in seen:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_meta_measurement_equals_real_cpu_bytes(stage):
    """On meta the plan measures exactly what a real CPU forward keeps (fp32, no autocast; SDPA on CPU
    takes its flash kernel, which saves what the planner's flash stand-in saves)."""
    cfg = _cfg(MODEL_CONFIGS["tiny"], 3, 8, rows=4, seq=256)
    torch.manual_seed(0)
    real = PipelineStage(cfg.model, cfg.pipeline, stage).train()
    spec = real.spec
    x = (torch.randint(0, 8192, (4, 256)) if spec.is_head
         else torch.randn(4, 256, spec.in_width).requires_grad_(True))
    tgt = torch.randint(0, 8192, (4, 256)) if spec.is_tail else None
    want = _real_saved_bytes(real, x, tgt)
    got = measure_activations(meta_stage(cfg, stage), 4, 256, checkpointing=False, autocast_bf16=False)
    assert got.saved_bytes == want
    if stage == 1:   # issue 11: the cache counted 256 KiB for an entry whose graph held 78 MiB
        assert 40 * 2**20 < got.saved_bytes < 100 * 2**20


def test_checkpointing_keeps_block_inputs_only():
    cfg = _cfg(MODEL_CONFIGS["tiny"], 3, 8, rows=4, seq=256)
    m = meta_stage(cfg, 1)
    full = measure_activations(m, 4, 256, checkpointing=False)
    light = measure_activations(m, 4, 256, checkpointing=True)
    n_blocks = len(m.spec.layers)
    block_input = 4 * 256 * cfg.model.dim * 4                     # fp32 residual stream
    assert light.saved_bytes >= n_blocks * block_input
    assert light.saved_bytes < full.saved_bytes / 5
    # a checkpointed block re-materialises its own full saved set in the backward
    assert full.largest_block_bytes > block_input
    assert n_blocks * full.largest_block_bytes > 0.9 * full.saved_bytes      # the blocks hold most of it


def test_autocast_keeps_a_bf16_copy_of_the_weights_per_microbatch():
    """Under autocast every micro-batch in flight holds bf16 copies of the stage's matrices (2 bytes per
    matmul parameter) unless the blocks are checkpointed."""
    cfg = _cfg(MODEL_CONFIGS["tiny"], 3, 8, rows=4, seq=256)
    m = meta_stage(cfg, 1)
    matrices = sum(p.numel() for p in m.parameters() if p.dim() == 2)
    full = measure_activations(m, 4, 256, checkpointing=False)
    assert full.weight_copy_bytes == 2 * matrices
    light = measure_activations(m, 4, 256, checkpointing=True)
    bottleneck = sum(p.numel() for n, p in m.named_parameters() if "bottleneck" in n and p.dim() == 2)
    assert light.weight_copy_bytes == 2 * bottleneck


def test_flash_attention_drops_the_probability_matrix():
    cfg = _cfg(MODEL_CONFIGS["tiny"], 3, 8, rows=4, seq=256)
    m = meta_stage(cfg, 1)
    math_path = measure_activations(m, 4, 256, checkpointing=False, autocast_bf16=False, flash_attention=False)
    flash = measure_activations(m, 4, 256, checkpointing=False, autocast_bf16=False, flash_attention=True)
    H, T, n = cfg.model.n_heads, 256, len(m.spec.layers)
    probs = n * 4 * H * T * T * 4                                  # [B, H, T, T] fp32 per block
    assert math_path.saved_bytes - flash.saved_bytes >= probs * 0.9


def test_activation_checkpointing_gives_the_same_gradients():
    cfg = _cfg(MODEL_CONFIGS["tiny"], 3, 8, rows=2, seq=64)
    torch.manual_seed(3)
    a = PipelineStage(cfg.model, cfg.pipeline, 1).train()
    b = PipelineStage(cfg.model, cfg.pipeline, 1, checkpointing=True).train()
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 64, 32)
    outs = []
    for m in (a, b):
        xi = x.clone().requires_grad_(True)
        out = m(xi)
        out.pow(2).mean().backward()
        outs.append((out.detach(), xi.grad, [p.grad.clone() for p in m.parameters()]))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.allclose(outs[0][1], outs[1][1], atol=1e-6)
    assert all(torch.allclose(g, h, atol=1e-6) for g, h in zip(outs[0][2], outs[1][2]))
    # a RunConfig turns it on for every stage the trainer builds
    assert all(s.checkpointing for s in build_stages(_cfg(MODEL_CONFIGS["tiny"], 3, 8, ckpt=True)))


def test_plan_fits_and_in_flight_bound():
    cfg = _cfg(MODEL_CONFIGS["tiny"], 3, 8, rows=4, seq=256)
    big = plan_stage(cfg, 1, 4 * GIB, reserve_bytes=0)
    free = 4 * GIB - big.state_bytes - big.workspace_bytes
    assert big.microbatches_in_flight_max == free // big.activation_bytes_per_microbatch
    assert big.rows_in_flight == 4 * big.microbatches_in_flight_max and big.fits
    assert big.activation_cache_bound_bytes == big.microbatches_in_flight_max * big.activation_bytes_per_microbatch
    assert big.state_bytes == 16 * big.params and big.microbatches_in_flight_needed == 2   # 1F1B: S - stage
    # just too small for the two micro-batches 1F1B needs at stage 1
    tight = big.state_bytes + big.workspace_bytes + 2 * big.activation_bytes_per_microbatch - 1
    p = plan_stage(cfg, 1, tight, reserve_bytes=0)
    assert not p.fits and p.microbatches_in_flight_max == 1
    # the tail never holds micro-batches between calls
    tail = plan_stage(cfg, 2, 4 * GIB, reserve_bytes=0)
    assert not tail.holds_microbatches and tail.rows_in_flight == 4 and tail.activation_cache_bound_bytes == 0
    # merging keeps the anchor and the outer momentum in host memory, not on the accelerator
    merged = dataclasses.replace(cfg, merge=dataclasses.replace(cfg.merge, every_steps=10))
    mp = plan_stage(merged, 1, 4 * GIB)
    assert mp.state_bytes == 16 * big.params and mp.merge_bytes == 8 * big.params
    off = dataclasses.replace(cfg, merge=dataclasses.replace(cfg.merge, every_steps=0))
    assert plan_stage(off, 1, 4 * GIB).merge_bytes == 0


def test_plan_auto_checkpointing_only_where_needed():
    cfg = _cfg(MODEL_CONFIGS["tiny"], 3, 8, rows=4, seq=256)
    off = plan(cfg, 4 * GIB, checkpointing=False, reserve_bytes=0)
    mem = max(off[1].total_bytes, off[2].total_bytes)      # stages 1 and 2 fit without, stage 0 does not
    assert off[0].total_bytes > mem
    got = plan(cfg, mem, auto_checkpointing=True, reserve_bytes=0)
    assert got[0].activation_checkpointing and all(p.fits for p in got)
    assert not got[1].activation_checkpointing and not got[2].activation_checkpointing


def test_plan_with_other_stage_count_rebalances():
    cfg = load_config(REPO / "configs" / "8b.yaml")
    ps = plan(cfg, 80 * GIB, stages=4)
    assert len(ps) == 4
    assert [p.layers[1] - p.layers[0] for p in ps] == balanced_layer_split(cfg.model, 4, 2048, compression_ratio=64,
                                                                           checkpointing=True, rows=1)


# ------------------------------------------------------------------------------------ CLI
FIELDS = {"stage", "params", "state_bytes", "activation_bytes_per_microbatch", "rows_in_flight",
          "activation_checkpointing", "total_bytes", "fits"}


@pytest.mark.parametrize("name,stages,mem", [("8b", 8, 80), ("1b", 4, 24)])
def test_plan_cli_acceptance(name, stages, mem, capsys):
    rc = cli_main(["plan", "--config", str(REPO / "configs" / f"{name}.yaml"), "--stages", str(stages),
                   "--gpu-mem", str(mem), "--json"])
    rows = json.loads(capsys.readouterr().out)
    assert rc == 0 and len(rows) == stages and [r["stage"] for r in rows] == list(range(stages))
    for r in rows:
        assert FIELDS <= set(r)
        assert r["fits"] and r["total_bytes"] <= mem * GIB and r["activation_checkpointing"] is True
        assert r["rows_in_flight"] >= r["microbatches_in_flight_needed"]
    assert sum(r["params"] for r in rows) > (7.5e9 if name == "8b" else 1.2e9)


def test_plan_cli_table_and_errors(capsys):
    rc = cli_main(["plan", "--config", str(REPO / "configs" / "1b.yaml"), "--gpu-mem", "8"])
    out = capsys.readouterr().out
    assert rc == 1 and "NO" in out and "do not fit" in out           # 8 GiB: the head does not fit
    assert cli_main(["plan", "--config", str(REPO / "configs" / "1b.yaml"), "--stages", "40"]) == 2
    assert cli_main(["plan", "--config", str(REPO / "configs" / "1b.yaml"), "--gpu", "rtx9"]) == 2
    assert parse_accelerator("4090").memory_bytes == 24 * GIB


def test_require_fit_refuses_with_the_plan_table():
    from iota_subnet.config import ConfigError
    from iota_subnet.plan import require_fit
    cfg = load_config(REPO / "configs" / "8b.yaml")
    assert require_fit(cfg, 3, 80 * GIB, device_name="NVIDIA A100-SXM4-80GB").fits
    with pytest.raises(ConfigError, match="(?s)stage 0 does not fit NVIDIA RTX 4090.*state GiB.*NO.*more stages"):
        require_fit(cfg, 0, 24 * GIB, device_name="NVIDIA RTX 4090")


# ------------------------------------------------------------------------------------ FLOPs executed
def _counted_flops_per_token(stage: PipelineStage, rows: int, T: int) -> float:
    """FLOPs per token torch dispatches in one training forward + backward of the tail ``stage``
    (``FlopCounterMode``: matmuls and attention, as the plan counts)."""
    from torch.utils.flop_counter import FlopCounterMode
    dev = next(stage.parameters()).device
    x = torch.randn(rows, T, stage.spec.in_width, device=dev, requires_grad=True)
    y = torch.randint(0, stage.cfg.vocab_size, (rows, T), device=dev)
    fc = FlopCounterMode(display=False)
    with fc:
        stage(x, y).backward()
    return fc.get_total_flops() / (rows * T)


def test_tail_flops_match_what_torch_executes(monkeypatch):
    """A real CPU tail with checkpointing, its cross-entropy chunked: the plan's training FLOPs per
    token are what FlopCounterMode counts (the LM head runs 4 times; a checkpointed block recomputes
    all but its down_proj). Attention takes SDPA's math path, whose matmuls the counter sees."""
    import iota_subnet.model.stages as stages_mod
    from torch.nn.attention import SDPBackend, sdpa_kernel
    model = dataclasses.replace(SMALL, vocab_size=2048)
    rows, T = 2, 64
    chunk_bytes = 4 * model.vocab_size * 48                      # 48 tokens a chunk: 3 chunks of 128 tokens
    monkeypatch.setattr(stages_mod, "CE_CHUNK_BYTES", chunk_bytes)
    pcfg = PipelineConfig(stages=2, compression_ratio=4)
    torch.manual_seed(0)
    tail = PipelineStage(model, pcfg, 1, checkpointing=True, ce_chunk_bytes=chunk_bytes).train()
    with sdpa_kernel(SDPBackend.MATH):
        counted = _counted_flops_per_token(tail, rows, T)
    f = stage_flops(model, pcfg, T, 1, rows)
    assert f.head_recompute == 2 * model.dim * model.vocab_size
    assert f.train(True) == pytest.approx(counted, rel=0.02)
    # model FLOPs alone (no rows: no head recomputation) miss the head's fourth run
    assert stage_flops(model, pcfg, T, 1).train(True) < 0.9 * counted
    # one chunk: nothing is recomputed at the head
    assert stage_flops(model, pcfg, 16, 1, 1).head_recompute == 0


@pytest.mark.parametrize("name", ["8b", "100b"])
def test_shipped_tail_flops_match_what_torch_executes(name):
    """The tails of configs/8b.yaml and configs/100b.yaml on ``meta`` (real shapes, no memory): the
    plan's training FLOPs per token equal FlopCounterMode's, with checkpointing on and off."""
    cfg = load_config(REPO / "configs" / f"{name}.yaml")
    s = cfg.pipeline.stages - 1
    for ckpt in (True, False):
        with torch.device("meta"):
            tail = PipelineStage(cfg.model, cfg.pipeline, s, init=False, checkpointing=ckpt).train()
        counted = _counted_flops_per_token(tail, 1, cfg.data.seq_len)
        f = stage_flops(cfg.model, cfg.pipeline, cfg.data.seq_len, s, cfg.train.micro_batch)
        assert f.train(ckpt) == pytest.approx(counted, rel=1e-3)
        assert f.head_recompute > 0
