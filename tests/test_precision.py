"""Precision defaults (bf16 above 100M parameters), TF32 on a CUDA device, the fp32-at-scale warning,
and the 100b shape (configs/100b.yaml, the H200)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from loguru import logger

from iota_subnet.cli import main as cli_main
from iota_subnet.config import (LARGE_MODEL_PARAMS, MODEL_CONFIGS, PipelineConfig, RunConfig, bottleneck_dims,
                                default_precision, load_config)
from iota_subnet.hardware import GIB, GPUS, parse_accelerator
from iota_subnet.model import PipelineStage
from iota_subnet.train.precision import fp32_at_scale_warning, prepare_device

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------ defaults
@pytest.mark.parametrize("name", ["tiny", "small", "100m", "1b", "8b", "100b"])
def test_param_count_is_the_modules(name):
    """ModelConfig.param_count (arithmetic) equals the one-stage model's count (built on meta)."""
    cfg = MODEL_CONFIGS[name]
    with torch.device("meta"):
        m = PipelineStage(cfg, PipelineConfig(stages=1), 0, init=False)
    assert cfg.param_count() == m.param_count()


def test_large_configs_train_in_bf16_small_ones_in_fp32():
    for name in ("1b", "8b", "100b"):
        assert load_config(REPO / "configs" / f"{name}.yaml").train.precision == "bf16", name
    for name in ("tiny", "small", "tiny_dp2", "tiny_dp3", "tiny_merge"):
        assert load_config(REPO / "configs" / f"{name}.yaml").train.precision == "fp32", name
    assert RunConfig().train.precision == "fp32"                     # built in code: the dataclass default
    assert default_precision(MODEL_CONFIGS["small"]) == "fp32" and default_precision(MODEL_CONFIGS["100m"]) == "bf16"
    assert MODEL_CONFIGS["small"].param_count() < LARGE_MODEL_PARAMS < MODEL_CONFIGS["100m"].param_count()


def test_explicit_precision_wins_and_absent_follows_the_size(tmp_path):
    assert load_config("8b").train.precision == "bf16"                  # a bare name: no train section
    assert load_config("tiny").train.precision == "fp32"
    p = tmp_path / "big.yaml"
    p.write_text("model: 8b\ndata: {seq_len: 2048}\ntrain: {batch_size: 8}\n")
    assert load_config(p).train.precision == "bf16"
    p.write_text("model: 8b\ndata: {seq_len: 2048}\ntrain: {batch_size: 8, precision: fp32}\n")
    assert load_config(p).train.precision == "fp32"
    p.write_text("model: tiny\ntrain: {precision: bf16}\n")
    assert load_config(p).train.precision == "bf16"
    over = load_config(REPO / "configs" / "8b.yaml", {"train": {"precision": "fp32"}})
    assert over.train.precision == "fp32"


# ------------------------------------------------------------------------------------ the device
@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda.is_available() says True; the TF32 flags are restored afterwards."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


@pytest.fixture
def warnings_logged():
    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(str(m)), level="WARNING", format="{message}")
    try:
        yield lines
    finally:
        logger.remove(sink)


def test_tf32_follows_the_precision_on_cuda(fake_cuda):
    bf16 = load_config(REPO / "configs" / "1b.yaml")
    fp32 = load_config(REPO / "configs" / "tiny.yaml")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    assert prepare_device("cuda", bf16) == torch.device("cuda")
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    # fp32 runs are verified against IEEE fp32 (replay 1e-3, hop audit 1e-4): TF32 off
    prepare_device("cuda:0", fp32)
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    # a CPU device is left alone
    torch.backends.cuda.matmul.allow_tf32 = True
    assert prepare_device("cpu", fp32) == torch.device("cpu") and torch.backends.cuda.matmul.allow_tf32


def test_no_tf32_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    old = torch.backends.cuda.matmul.allow_tf32
    prepare_device("cuda", load_config(REPO / "configs" / "1b.yaml"))
    assert torch.backends.cuda.matmul.allow_tf32 == old


def test_fp32_at_scale_on_cuda_warns_with_the_fix(fake_cuda, warnings_logged):
    big = load_config(REPO / "configs" / "1b.yaml", {"train": {"precision": "fp32"}})
    prepare_device("cuda", big)
    (line,) = [w for w in warnings_logged if "train.precision" in w]
    assert "fp32" in line and "1.24B" in line and "train.precision: bf16" in line
    warnings_logged.clear()
    prepare_device("cuda", load_config(REPO / "configs" / "1b.yaml"))            # bf16: no warning
    prepare_device("cuda", load_config(REPO / "configs" / "tiny.yaml"))          # small fp32: no warning
    prepare_device("cpu", big)                                                   # not on CUDA: no warning
    assert not [w for w in warnings_logged if "train.precision" in w]
    assert fp32_at_scale_warning(big, torch.device("cpu")) is None


def test_plan_measures_activations_at_the_run_precision():
    from iota_subnet.plan import plan_stage
    bf16 = load_config(REPO / "configs" / "8b.yaml")
    fp32 = load_config(REPO / "configs" / "8b.yaml", {"train": {"precision": "fp32"}})
    a, b = plan_stage(bf16, 3, 80 * GIB), plan_stage(fp32, 3, 80 * GIB)
    assert a.precision == "bf16" and b.precision == "fp32"
    assert b.weight_copy_bytes_per_microbatch == 0 < a.weight_copy_bytes_per_microbatch
    # without checkpointing fp32 keeps fp32 activations (more) but no bf16 weight copies
    assert b.activation_bytes_no_checkpointing != a.activation_bytes_no_checkpointing
    assert a.state_bytes == b.state_bytes


# ------------------------------------------------------------------------------------ 100b, H200
def test_100b_config_is_a_100b_model_in_16_stages():
    cfg = load_config(REPO / "configs" / "100b.yaml")
    assert cfg.model.name == "100b" and cfg.pipeline.stages == 16 and cfg.pipeline.compression_ratio == 144
    assert cfg.model.dim == 9216 and cfg.data.vocab_size == 128256 and cfg.data.seq_len == 2048
    assert cfg.train.precision == "bf16" and cfg.train.activation_checkpointing
    n = cfg.model.param_count(tied=False)
    assert abs(n - 100e9) / 100e9 < 0.05 and n == 98_700_420_096
    assert bottleneck_dims(cfg.model, cfg.pipeline) == (64, 32)              # 9216 / 144 = 64 on the wire
    with torch.device("meta"):
        staged = sum(PipelineStage(cfg.model, cfg.pipeline, s, init=False).param_count() for s in range(16))
    d = cfg.model.dim
    assert staged == n + 15 * (2 * d * 32 + d)           # + encoder (norm, d x 32) and decoder (32 x d) per boundary


def test_h200_is_known():
    h200 = parse_accelerator("h200")
    assert h200 is GPUS["h200"] and h200.peak_flops == 989e12
    assert 139 * GIB <= h200.memory_bytes <= 141 * GIB       # "141 GB": CUDA reports 140.4 GiB


def test_plan_accepts_100b_on_h200(capsys):
    rc = cli_main(["plan", "--config", str(REPO / "configs" / "100b.yaml"), "--stages", "16", "--gpu-mem", "141",
                   "--json"])
    rows = json.loads(capsys.readouterr().out)
    assert rc == 0 and [r["stage"] for r in rows] == list(range(16))
    assert all(r["fits"] and r["precision"] == "bf16" and r["activation_checkpointing"] for r in rows)
    assert sum(r["params"] for r in rows) > 98e9
    assert max(r["total_bytes"] for r in rows) == rows[0]["total_bytes"] < 141 * GIB   # the embedding's stage
