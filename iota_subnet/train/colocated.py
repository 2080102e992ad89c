"""Co-located reference trainer: every stage of the bottlenecked model in one process.

Every distributed run is compared against this one: same config, same data addressing
(optimizer step k reads samples ``k * batch_size ...`` of seed ``train.seed``), same inner optimizer.
``wire_dtype`` (default ``fp32``: the activations pass between stages untouched) rounds the activation
at every stage boundary, and its gradient in the backward pass, to a network wire dtype
(:class:`~iota_subnet.train.wire_boundary.WireBoundary`; ``bf16``, ``int8``, ``fp8``), in training and
in the validation loss alike.

Outputs in ``out``: ``metrics.jsonl``, ``summary.json``, ``checkpoint.safetensors`` (atomic; resumed
automatically when present), ``config.json``.
"""
from __future__ import annotations

import contextlib
import json
import math
import signal
import sys
import time
from pathlib import Path
from typing import Optional

import torch
from loguru import logger

from iota_subnet.config import ConfigError, RunConfig, load_config
from iota_subnet.data.packing import IGNORE_INDEX
from iota_subnet.model import StagedModel, bottleneck_dims, build_stages
from iota_subnet.protocol.wire import WIRE_TORCH_DTYPES, bytes_per_token
from iota_subnet.train.checkpoint import (CheckpointError, config_fingerprint, read_checkpoint, restore,
                                          save_checkpoint, sweep_stray_temporaries)
from iota_subnet.train.metrics import MetricsLog, write_summary
from iota_subnet.train.optim import lr_at, make_optimizer, set_lr
from iota_subnet.train.precision import prepare_device
from iota_subnet.train.wire_boundary import WireBoundary
from iota_subnet.utils.atomic import atomic_write_json, atomic_write_text


def pick_device(device: Optional[str] = None) -> torch.device:
    if device:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def autocast_ctx(device: torch.device, precision: str = "fp32"):
    """The run's compute precision (``train.precision``): ``bf16`` autocast (fp32 master weights) on
    any device, or plain fp32."""
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def split_rows(dataset, split: str, seed: int, start: int, n: int,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``dataset``'s rows of ``split`` on ``device`` as inputs ``[n, T]`` and targets ``[n, T]``; with a
    loss mask (``data.hf.mask_field``) the unmarked targets are ``-100`` (not trained, as on the network's
    tail; :meth:`~iota_subnet.data.packing.TokenDataset.target_batch`)."""
    rows = dataset.split_batch(split, seed, start, n).to(device)
    targets = dataset.target_batch(split, seed, start, n).to(device) if dataset.has_loss_mask else rows
    return rows[:, :-1], targets[:, 1:]


@torch.no_grad()
def evaluate(model: StagedModel, dataset, cfg: RunConfig, device: torch.device) -> float:
    """Mean validation loss (nats per trained target) over up to ``train.eval_batches`` micro-batches of
    held-out rows: each micro-batch's mean weighted by its trained targets (all of them without a loss
    mask), i.e. the mean over every target, as ``iota-subnet eval`` and the network's final evaluation."""
    model.eval()
    mb = cfg.train.micro_batch
    n_batches = max(1, min(cfg.train.eval_batches, dataset.n_val_rows // mb or 1))
    total, count = 0.0, 0
    for i in range(n_batches):
        x, y = split_rows(dataset, "val", 0, i * mb, mb, device)
        if x.shape[0] == 0:
            break
        n = int((y != IGNORE_INDEX).sum())
        with autocast_ctx(device, cfg.train.precision):
            total += float(model(x, y)) * n
        count += n
    model.train()
    return total / max(1, count)


def config_summary(cfg: RunConfig) -> str:
    return (f"model={cfg.model.name} d={cfg.model.dim} layers={cfg.model.n_layers} stages={cfg.pipeline.stages} "
            f"ratio={cfg.pipeline.compression_ratio}")


def train_colocated(config: str | Path | RunConfig, data: Optional[str], steps: int, out: str | Path, *,
                    seed: Optional[int] = None, device: Optional[str] = None, progress: Optional[bool] = None,
                    cache_dir: Optional[Path] = None, overrides: Optional[dict] = None,
                    checkpoint_every: Optional[int] = None, eval_at_end: bool = True,
                    stop_after: Optional[int] = None, allow_data_fallback: bool = False,
                    wire_dtype: str = "fp32") -> dict:
    """Train the staged model in one process for ``steps`` optimizer steps; returns the summary dict.

    ``stop_after``: behave as if interrupted once that step is reached (checkpoint, then raise
    KeyboardInterrupt): the same path as Ctrl-C. ``wire_dtype``: the stage boundaries' wire format
    (see the module docstring); the summary gives it and ``wire_bytes_per_token`` (one boundary).
    Raises ConfigError / DataError / CheckpointError with messages that name the fix.
    """
    from iota_subnet.data import build_dataset, describe  # heavy imports kept off the CLI start-up path

    cfg = config if isinstance(config, RunConfig) else load_config(config, overrides)
    if steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {steps}")
    if wire_dtype not in WIRE_TORCH_DTYPES:
        raise ConfigError(f"wire dtype {wire_dtype!r} is not one of {tuple(WIRE_TORCH_DTYPES)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    sweep_stray_temporaries(out)          # leftovers of a save killed half-way
    seed = cfg.train.seed if seed is None else seed
    dev = prepare_device(pick_device(device), cfg)      # TF32 by train.precision on CUDA
    tok, dataset = build_dataset(cfg.data, data, cache_dir, allow_fallback=allow_data_fallback)
    stages = build_stages(cfg, seed=seed)
    model = StagedModel(stages, None if wire_dtype == "fp32" else WireBoundary(wire_dtype)).to(dev)
    opt = make_optimizer(model, cfg.train)
    fp = config_fingerprint(cfg.model, cfg.pipeline)
    ckpt = out / "checkpoint.safetensors"
    start = 0
    eval_only = False
    if ckpt.exists():
        tensors, meta = read_checkpoint(ckpt)
        meta.setdefault("config_summary", "")
        restore(model, opt, tensors, meta, expect_fingerprint=fp, path=str(ckpt))
        if meta.get("tokenizer") and meta["tokenizer"] != tok.fingerprint:
            raise CheckpointError(f"{ckpt} was trained with another tokenizer; use the same data/tokenizer or a new --out")
        start = int(meta["step"])
        if start > steps:
            raise CheckpointError(f"{ckpt} is at step {start}, past --steps {steps}; pass --steps {start} or more, "
                                  "or a new --out")
        if start == steps:
            logger.info(f"{out} already holds a finished run of {steps} steps; nothing to do")
            done = out / "summary.json"
            if done.exists():
                return json.loads(done.read_text())
            eval_only = True
        logger.info(f"resuming from {ckpt} at step {start}")
    atomic_write_json(out / "config.json", cfg.to_dict())
    atomic_write_text(out / "tokenizer.json", tok.to_str())     # `iota-subnet export` ships it with the model
    metrics = MetricsLog(out / "metrics.jsonl", resume_step=start)
    elapsed0 = metrics.last_elapsed_s
    B, mb, T = cfg.train.batch_size, cfg.train.micro_batch, cfg.data.seq_len
    n_micro = B // mb
    params = model.param_count()
    b, _ = bottleneck_dims(cfg.model, cfg.pipeline)
    every = checkpoint_every if checkpoint_every is not None else cfg.train.checkpoint_every
    logger.info(f"co-located training: {config_summary(cfg)} params={params:,} tokens/step={B * T} "
                f"steps={start}->{steps} device={dev} data={describe(dataset.spec)}")

    def _save(step: int) -> None:
        save_checkpoint(ckpt, model, opt, {"step": step, "config_fingerprint": fp, "config_summary": config_summary(cfg),
                                           "tokenizer": tok.fingerprint, "seed": seed})

    stop = {"flag": False}

    def _on_sigint(signum, frame):
        stop["flag"] = True
        logger.warning("interrupt: finishing this step, saving a checkpoint, then stopping")

    old_handler = signal.signal(signal.SIGINT, _on_sigint) if _main_thread() else None
    show = sys.stderr.isatty() if progress is None else progress
    bar = None
    if show:
        from tqdm import tqdm
        bar = tqdm(total=steps, initial=start, desc="train", unit="step", dynamic_ncols=True)
    t0 = time.perf_counter()
    trained_tokens = 0
    step = start
    try:
        for step in range(start, steps):
            lr = lr_at(step, steps, cfg.train)
            set_lr(opt, lr)
            loss_sum = 0.0
            for m in range(n_micro):
                x, y = split_rows(dataset, "train", seed, step * B + m * mb, mb, dev)
                with autocast_ctx(dev, cfg.train.precision):
                    loss = model(x, y)
                (loss / n_micro).backward()
                loss_sum += float(loss.detach())
            # Each stage clips its own gradient norm, exactly as a miner holding that stage does.
            gnorm = math.sqrt(sum(float(torch.nn.utils.clip_grad_norm_(st.parameters(), cfg.train.grad_clip)) ** 2
                                  for st in model.stages))
            opt.step()
            opt.zero_grad(set_to_none=True)
            trained_tokens += B * T
            loss_v = loss_sum / n_micro
            if not math.isfinite(loss_v):
                raise FloatingPointError(f"loss became {loss_v} at step {step}; lower train.lr or check the data")
            metrics.write({"step": step, "tokens": (step + 1) * B * T, "loss": loss_v, "lr": lr,
                           "grad_norm": gnorm, "elapsed_s": round(elapsed0 + time.perf_counter() - t0, 3)})
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{loss_v:.3f}", lr=f"{lr:.2e}",
                                tok_s=f"{trained_tokens / (time.perf_counter() - t0):.0f}")
            elif step % 10 == 0 or step == steps - 1:
                logger.info(f"step {step} loss {loss_v:.4f} lr {lr:.2e} "
                            f"tok/s {trained_tokens / (time.perf_counter() - t0):.0f}")
            if every and (step + 1) % every == 0 and step + 1 < steps:
                _save(step + 1)
            if stop["flag"] or (stop_after is not None and step + 1 >= stop_after):
                _save(step + 1)
                raise KeyboardInterrupt
        train_s = time.perf_counter() - t0
        if not eval_only:
            _save(steps)
    finally:
        if bar is not None:
            bar.close()
        metrics.close()
        if old_handler is not None:
            signal.signal(signal.SIGINT, old_handler)
    val_loss = evaluate(model, dataset, cfg, dev) if eval_at_end else None
    summary = {
        "steps": steps, "tokens": steps * B * T, "tokens_per_s": trained_tokens / train_s if trained_tokens else None,
        "final_loss": metrics.final_loss(), "last_step_loss": metrics.rows[-1]["loss"] if metrics.rows else None,
        "val_loss": val_loss, "params": params, "compression_ratio": cfg.pipeline.compression_ratio,
        "bottleneck_width": b, "wire_dtype": wire_dtype, "wire_bytes_per_token": bytes_per_token(wire_dtype, b),
        "stages": cfg.pipeline.stages, "flops_per_token": model.flops_per_token(T),
        "device": str(dev), "data": describe(dataset.spec), "vocab_size": tok.vocab_size,
        "elapsed_s": metrics.last_elapsed_s, "final_loss_window": min(10, len(metrics.rows)),
    }
    write_summary(out / "summary.json", summary)
    tps = summary["tokens_per_s"]
    logger.info(f"done: final_loss {summary['final_loss']} val_loss {val_loss if val_loss is None else round(val_loss, 4)} "
                f"tokens/s {'-' if tps is None else round(tps)} -> {out}")
    return summary


def _main_thread() -> bool:
    import threading
    return threading.current_thread() is threading.main_thread()
