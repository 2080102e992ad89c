"""Co-located trainer on real text: metrics, learning, resume, checkpoint safety, clear errors."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from iota_subnet.config import ConfigError
from iota_subnet.train.checkpoint import CheckpointError, read_checkpoint
from iota_subnet.train.colocated import train_colocated

OVR = {"model": {"name": "tiny", "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128,
                 "vocab_size": 512},
       "data": {"seq_len": 32, "vocab_size": 512},
       "pipeline": {"stages": 2, "compression_ratio": 4},
       "train": {"batch_size": 8, "micro_batch_size": 4, "lr": 1e-2, "warmup_steps": 2, "eval_batches": 2}}


def _train(tmp, wikitext_path, cache_dir, steps, out="run", ovr=OVR, **kw):
    return train_colocated("configs/tiny.yaml", str(wikitext_path), steps, tmp / out, cache_dir=cache_dir,
                           overrides=ovr, progress=False, **kw)


def test_trains_and_writes_metrics(tmp_path, wikitext_path, cache_dir):
    s = _train(tmp_path, wikitext_path, cache_dir, 30)
    rows = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(30))
    assert all({"step", "tokens", "loss", "lr", "elapsed_s"} <= set(r) for r in rows)
    assert rows[-1]["tokens"] == 30 * 8 * 32
    assert abs(rows[0]["loss"] - 6.24) < 0.3                 # ~ln(512) at the start
    assert s["final_loss"] < rows[0]["loss"] - 0.7            # it learns
    for k in ("tokens_per_s", "final_loss", "val_loss", "params", "compression_ratio"):
        assert s[k] is not None
    assert s["compression_ratio"] == 4 and s["val_loss"] < rows[0]["loss"]


def test_wire_dtype_rounds_every_boundary_forward_and_backward(tmp_path, wikitext_path, cache_dir):
    """``wire_dtype`` puts the activation at the stage boundary (and its gradient) through the wire
    format: fp8 moves the losses a little, not much; the summary names it and its bytes per token."""
    ref = _train(tmp_path, wikitext_path, cache_dir, 2, out="fp32")
    s = _train(tmp_path, wikitext_path, cache_dir, 2, out="fp8", wire_dtype="fp8")
    ref_rows, rows = ([json.loads(l) for l in (tmp_path / o / "metrics.jsonl").read_text().splitlines()]
                      for o in ("fp32", "fp8"))
    assert (ref["wire_dtype"], ref["wire_bytes_per_token"]) == ("fp32", 16 * 4)   # b = 64 / 4
    assert (s["wire_dtype"], s["wire_bytes_per_token"]) == ("fp8", 16 + 4)        # 1 byte a value + a float32 scale
    for a, b in zip(ref_rows, rows):
        assert a["loss"] != b["loss"] and abs(a["loss"] - b["loss"]) < 0.05, (a, b)
    assert abs(s["val_loss"] - ref["val_loss"]) < 0.05
    with pytest.raises(ConfigError, match="wire dtype"):
        _train(tmp_path, wikitext_path, cache_dir, 2, out="bad", wire_dtype="fp9")


def test_resume_continues_exactly(tmp_path, wikitext_path, cache_dir):
    straight = _train(tmp_path, wikitext_path, cache_dir, 6, out="straight", eval_at_end=False)
    with pytest.raises(KeyboardInterrupt):   # interrupted after step 4 of 6 (same path as Ctrl-C)
        _train(tmp_path, wikitext_path, cache_dir, 6, out="resumed", checkpoint_every=2, eval_at_end=False,
               stop_after=4)
    _, meta = read_checkpoint(tmp_path / "resumed" / "checkpoint.safetensors")
    assert meta["step"] == 4
    _train(tmp_path, wikitext_path, cache_dir, 6, out="resumed", eval_at_end=False)
    a = [json.loads(l) for l in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(l) for l in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in b] == list(range(6))
    for ra, rb in zip(a, b):
        assert ra["loss"] == pytest.approx(rb["loss"], abs=1e-5)
    assert straight["last_step_loss"] == pytest.approx(b[-1]["loss"], abs=1e-5)


def test_truncated_checkpoint_is_refused_and_never_replaces_the_good_one(tmp_path, wikitext_path, cache_dir):
    _train(tmp_path, wikitext_path, cache_dir, 2, eval_at_end=False)
    ckpt = tmp_path / "run" / "checkpoint.safetensors"
    good = ckpt.read_bytes()
    # a save that dies half-way (disk full, kill) leaves the previous checkpoint intact
    from iota_subnet.utils.atomic import atomic_write_with

    def half_then_fail(tmp):
        with open(tmp, "wb") as f:
            f.write(good[:100])
        raise OSError("disk full")
    with pytest.raises(OSError, match="disk full"):
        atomic_write_with(ckpt, half_then_fail)
    assert not [p for p in ckpt.parent.iterdir() if p.name.endswith(".tmp")]
    assert ckpt.read_bytes() == good
    # a truncated file (copied by hand, say) gives a clear error naming the fix
    ckpt.write_bytes(good[: len(good) // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        _train(tmp_path, wikitext_path, cache_dir, 4, eval_at_end=False)


def test_checkpoint_from_another_config_is_refused(tmp_path, wikitext_path, cache_dir):
    _train(tmp_path, wikitext_path, cache_dir, 2, eval_at_end=False)
    other = {**OVR, "pipeline": {"stages": 2, "compression_ratio": 2}}
    with pytest.raises(CheckpointError, match="another config"):
        _train(tmp_path, wikitext_path, cache_dir, 4, ovr=other, eval_at_end=False)


def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "iota_subnet.cli", *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd)


@pytest.mark.parametrize("args, needle", [
    (["--config", "giant", "--data", "x.txt"], "unknown model config 'giant'"),
    (["--config", "configs/tiny.yaml", "--data", "/nonexistent/corpus.txt"], "does not exist"),
    (["--config", "configs/nope.yaml"], "not found"),
])
def test_cli_errors_name_the_fix(tmp_path, args, needle):
    r = _cli("train-colocated", *args, "--steps", "1", "--out", str(tmp_path / "o"))
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr


def test_cli_empty_data_file(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    r = _cli("train-colocated", "--config", "configs/tiny.yaml", "--data", str(empty), "--steps", "1",
             "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "no text" in r.stderr.lower(), r.stderr


def test_rerunning_a_finished_run_changes_nothing(tmp_path, wikitext_path, cache_dir):
    first = _train(tmp_path, wikitext_path, cache_dir, 3)
    ckpt = tmp_path / "run" / "checkpoint.safetensors"
    before = (ckpt.read_bytes(), (tmp_path / "run" / "summary.json").read_text())
    again = _train(tmp_path, wikitext_path, cache_dir, 3)
    assert again == first
    assert (ckpt.read_bytes(), (tmp_path / "run" / "summary.json").read_text()) == before
    with pytest.raises(CheckpointError, match="past --steps 2"):
        _train(tmp_path, wikitext_path, cache_dir, 2)


@pytest.mark.parametrize("text, needle", [
    ("model: tiny\npipeline: 3\n", "must be a mapping"),
    ("model: tiny\ntrain: {lr: fast}\n", "train.lr must be float"),
    ("model: tiny\ntrain: {batch_size: 0}\n", "train.batch_size must be >= 1"),
    ("model: {name: tiny, n_heads: 0}\n", "model.n_heads must be a positive integer"),
    ("model: tiny\ndata: {val_fraction: 1.5}\n", "data.val_fraction must be in"),
    ("model: tiny\ntrain: {lr: [\n", "not valid YAML"),
    ("", "is empty"),
    ("# only a comment\n\n", "is empty"),
])
def test_bad_config_values_name_the_problem(tmp_path, text, needle):
    from iota_subnet.config import ConfigError, load_config
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError, match=needle.replace("[", r"\[").replace(".", r"\.")):
        load_config(p)
