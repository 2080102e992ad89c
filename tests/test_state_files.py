"""Issue 12: stray temporary files swept at start (item 13), checkpoint integrity (item 15),
numbers as people write them in configs (item 16), open-ended learning-rate schedules and run
hand-over (item 2), data fingerprints and no silent fallbacks (item 9)."""
from __future__ import annotations

from dataclasses import replace
import asyncio
import json
import math
import os

import numpy as np
import pytest
import torch

from iota_subnet.devnet import create_devnet, open_devnet
from iota_subnet.config import ConfigError, load_config
from iota_subnet.data import DataError, TokenDataset, build_dataset, data_fingerprint, fingerprints
from iota_subnet.miner.options import MinerOptions, ServeOptions
from iota_subnet.miner.service import MinerService
from iota_subnet.miner.stage_worker import StageWorker
from iota_subnet.train.checkpoint import CheckpointError, read_checkpoint, save_checkpoint
from iota_subnet.train.colocated import train_colocated
from iota_subnet.train.optim import lr_at
from iota_subnet.utils.atomic import atomic_folder, sweep_temporaries
from iota_subnet.wallets import create_wallet

pytestmark = pytest.mark.timeout(180)
OVR = {"model": {"name": "tiny", "dim": 64, "n_layers": 3, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128,
                 "vocab_size": 256},
       "data": {"seq_len": 16, "vocab_size": 256},
       "pipeline": {"stages": 3, "compression_ratio": 4},
       "train": {"batch_size": 4, "micro_batch_size": 2}}

#: a co-located run small enough for a test (a BPE needs at least 258 ids)
CO_CFG = {"model": {**OVR["model"], "vocab_size": 512}, "data": {"seq_len": 16, "vocab_size": 512},
          "train": {**OVR["train"], "lr": 3e-3}}


# ------------------------------------------------------------------------- item 13: stray .tmp files

def _strays(folder, n=3):
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f".stage1.safetensors.k{i}x.tmp" for i in range(n)] + [folder / ".status.json.ab12.tmp"]
    for p in paths:
        p.write_bytes(b"\0" * 4096)
    return paths


def test_miner_start_sweeps_temporary_files_of_killed_saves(tmp_home, tmp_path):
    out = tmp_path / "miner"
    strays = _strays(out)
    keep = out / "notes.tmp"              # not an atomic-write temporary: left alone
    keep.write_text("mine")
    db = create_devnet(tmp_path / "c.db", 9, tempo=100, block_time=0.2)
    cfg = load_config("configs/tiny.yaml", OVR)
    w = create_wallet("m", "default", tmp_home / "wallets")

    async def main():
        chain = await open_devnet(db)
        await chain.register(w, 9)
        svc = MinerService(cfg, w, chain, MinerOptions(netuid=9, run_id="r", stage=1, out_dir=out,
                                                       serve=ServeOptions(host="127.0.0.1")))
        try:
            await svc.start()
            assert not any(p.exists() for p in strays) and keep.exists()
            await svc.checkpoint(wait=True)   # the write runs on its own thread: wait for it
            assert list(out.glob(".*.tmp")) == []
        finally:
            await svc.stop()
            await chain.close()
    asyncio.run(main())


def test_colocated_start_sweeps_temporary_files(tmp_path, wikitext_path, cache_dir):
    out = tmp_path / "co"
    strays = _strays(out, 2)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(json.dumps(CO_CFG))
    train_colocated(str(cfg), str(wikitext_path), 2, out, cache_dir=cache_dir, progress=False, eval_at_end=False)
    assert not any(p.exists() for p in strays)
    assert sweep_temporaries(tmp_path / "missing") == []


# ------------------------------------------------------------------------- item 15: integrity

def test_a_flipped_byte_in_tensor_data_is_refused(tmp_path):
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(4, 64)).sum().backward()
    opt.step()
    p = tmp_path / "c.safetensors"
    save_checkpoint(p, m, opt, {"step": 1})
    tensors, meta = read_checkpoint(p)
    assert meta["step"] == 1 and len(tensors) == 4 + 4 * 3
    data = p.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    start, end = header["model/0.weight"]["data_offsets"]
    for off in (8 + n + start + 5, 8 + n + end - 1):      # anywhere inside a tensor's bytes
        bad = bytearray(data)
        bad[off] ^= 0x01
        p.write_bytes(bytes(bad))
        with pytest.raises(CheckpointError, match=r"tensor 'model/0.weight' does not match its stored sha256"):
            read_checkpoint(p)
    p.write_bytes(data)
    read_checkpoint(p)


def test_a_miner_with_a_corrupt_checkpoint_does_not_load_it(tmp_path):
    cfg = load_config("configs/tiny.yaml", OVR)
    w = StageWorker(cfg, 1)
    p = tmp_path / "stage1.safetensors"
    w.save(p)
    data = bytearray(p.read_bytes())
    data[-7] ^= 0x10
    p.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="sha256"):
        StageWorker(cfg, 1).load(p)


# ------------------------------------------------------------------------- item 16: numbers

def test_exponent_numbers_are_read_and_a_saved_config_reproduces_the_run(tmp_path):
    p = tmp_path / "run.yaml"
    p.write_text("model: {name: tiny, norm_eps: 1e-5}\ntrain:\n  lr: 3e-4\n  weight_decay: 1E-1\n  beta2: .95\n")
    cfg = load_config(p)
    assert cfg.train.lr == 3e-4 and cfg.train.weight_decay == 0.1 and cfg.train.beta2 == 0.95
    assert cfg.model.norm_eps == 1e-5
    saved = tmp_path / "config.json"                     # what train-colocated writes
    saved.write_text(json.dumps(cfg.to_dict()))
    assert '"norm_eps": 1e-05' in saved.read_text()
    assert load_config(saved) == cfg
    with pytest.raises(ConfigError, match="train.lr must be float"):
        (tmp_path / "bad.yaml").write_text("train: {lr: fast}\n")
        load_config(tmp_path / "bad.yaml")


def test_colocated_writes_a_config_json_that_loads_back(tmp_path, wikitext_path, cache_dir):
    out = tmp_path / "co"
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(json.dumps({**CO_CFG, "train": {**OVR["train"], "lr": 3e-4, "weight_decay": 1e-2}}))
    train_colocated(str(cfg), str(wikitext_path), 1, out, cache_dir=cache_dir, progress=False, eval_at_end=False)
    assert load_config(out / "config.json") == load_config(cfg)


# ------------------------------------------------------------------------- item 2: continuous runs

def test_open_ended_schedules():
    base = load_config("configs/tiny.yaml").train
    const = load_config("configs/tiny.yaml", {"train": {"schedule": "constant", "total_steps": None,
                                                        "warmup_steps": 10}}).train
    assert lr_at(4, None, const) == pytest.approx(const.lr * 5 / 10)
    assert lr_at(10, None, const) == lr_at(10**7, None, const) == const.lr
    wsd = load_config("configs/tiny.yaml", {"train": {"schedule": "wsd", "total_steps": None, "warmup_steps": 10,
                                                      "decay_start": 1000, "decay_steps": 100}}).train
    assert lr_at(999, None, wsd) == wsd.lr
    assert lr_at(1050, None, wsd) == pytest.approx(wsd.lr * (1 + wsd.min_lr_ratio) / 2)
    assert lr_at(1100, None, wsd) == lr_at(5000, None, wsd) == pytest.approx(wsd.lr * wsd.min_lr_ratio)
    stable = load_config("configs/tiny.yaml", {"train": {"schedule": "wsd", "total_steps": None}}).train
    assert lr_at(10**6, None, stable) == stable.lr          # no decay until the run sets one
    # bounded runs keep their cosine over total_steps
    assert lr_at(base.total_steps - 1, base.total_steps, base) == pytest.approx(base.lr * base.min_lr_ratio)
    with pytest.raises(ConfigError, match="open-ended.*constant or wsd"):
        load_config("configs/tiny.yaml", {"train": {"total_steps": None}})
    with pytest.raises(ConfigError, match="schedule"):
        load_config("configs/tiny.yaml", {"train": {"schedule": "linear"}})
    with pytest.raises(ConfigError, match="decay_steps"):
        load_config("configs/tiny.yaml", {"train": {"schedule": "wsd", "decay_start": 10}})


def test_a_stage_of_an_open_ended_run_trains_past_any_bound(tmp_path):
    cfg = load_config("configs/tiny.yaml", {**OVR, "train": {**OVR["train"], "schedule": "constant",
                                                             "total_steps": None, "warmup_steps": 1}})
    from iota_subnet.model import bottleneck_dims
    b, _ = bottleneck_dims(cfg.model, cfg.pipeline)
    w = StageWorker(cfg, 2)                                   # the tail: its forward runs its backward
    assert w.total_steps is None
    for k in range(3):
        for m in range(2):
            w.forward(f"k{k}m{m}", torch.randn(2, 16, b), torch.randint(0, 256, (2, 16)), train=True)
    assert w.inner_step == 3
    assert w.opt.param_groups[0]["lr"] == cfg.train.lr


def test_a_miner_hands_its_folder_over_to_a_new_run_epoch(tmp_home, tmp_path):
    db = create_devnet(tmp_path / "c.db", 9, tempo=100, block_time=0.2)
    cfg = load_config("configs/tiny.yaml", OVR)
    w = create_wallet("m", "default", tmp_home / "wallets")
    out = tmp_path / "m"

    async def main():
        chain = await open_devnet(db)
        await chain.register(w, 9)
        try:
            opts = MinerOptions(netuid=9, run_id="r", stage=1, out_dir=out, serve=ServeOptions(host="127.0.0.1"))
            svc = MinerService(cfg, w, chain, opts)
            await svc.start()
            svc.worker.inner_step = 42
            await svc.stop()                                   # checkpoint at step 42 of epoch 0
            again = MinerService(cfg, w, chain, opts)
            await again.start()
            assert again.worker.inner_step == 42               # same run: resumes
            await again.stop()
            new = MinerService(cfg, w, chain, replace(opts, run_epoch=1))
            await new.start()
            assert new.worker.inner_step == 0                  # a new run starts clean
            await new.stop()
        finally:
            await chain.close()
    asyncio.run(main())
    old = list((out / "previous").glob("r-e0-*"))
    assert len(old) == 1 and (old[0] / "stage1.safetensors").exists()
    assert read_checkpoint(old[0] / "stage1.safetensors")[1]["step"] == 42


# ------------------------------------------------------------------------- item 9: fingerprints

def test_data_fingerprint_tracks_the_tokens(wikitext_path, cache_dir):
    from iota_subnet.config import DataConfig
    tok, ds = build_dataset(DataConfig(vocab_size=300, seq_len=32), str(wikitext_path), cache_dir)
    fp = fingerprints(tok, ds)
    assert len(fp.tokenizer) == 16 and len(fp.data) == 16
    again = TokenDataset.from_tokens(np.array(ds.tokens), 32, 0.05)
    assert data_fingerprint(again) == fp.data                  # same tokens and rows: same fingerprint
    changed = np.array(ds.tokens)
    changed[len(changed) // 2] += 1
    assert data_fingerprint(TokenDataset.from_tokens(changed, 32, 0.05)) != fp.data
    assert data_fingerprint(TokenDataset.from_tokens(np.array(ds.tokens), 33, 0.05)) != fp.data


def test_no_silent_data_fallback_when_the_hub_is_unreachable(cache_dir):
    from iota_subnet.config import DataConfig
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    with pytest.raises(DataError, match="--data PATH.*--allow-data-fallback"):
        build_dataset(DataConfig(vocab_size=300, seq_len=32, max_tokens=20_000), None, cache_dir)
    tok, ds = build_dataset(DataConfig(vocab_size=300, seq_len=32, max_tokens=20_000), None, cache_dir,
                            allow_fallback=True)
    assert ds.spec == "stdlib://python" and math.isfinite(float(ds.n_tokens))


def test_atomic_folder_replaces_the_old_folder_whole_or_not_at_all(tmp_path):
    out = tmp_path / "export"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_folder(out, "export-") as tmp:
            (tmp / "new.txt").write_text("new")
            raise RuntimeError("killed half-way")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]          # no temporary left
    assert sorted(p.name for p in out.iterdir()) == ["old.txt"]             # the old folder untouched
    with atomic_folder(out, "export-") as tmp:
        (tmp / "new.txt").write_text("new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
    assert sorted(p.name for p in out.iterdir()) == ["new.txt"]
