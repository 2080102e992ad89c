"""Small things many tests share: a tiny model override, hotkey wallets and learnable pattern data."""
from __future__ import annotations

from pathlib import Path

import bittensor as bt
import torch


OVR = {"model": {"name": "tiny", "dim": 64, "n_layers": 3, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128,
                 "vocab_size": 256},
       "data": {"seq_len": 16, "vocab_size": 256},
       "pipeline": {"stages": 3, "compression_ratio": 4},
       "train": {"batch_size": 4, "micro_batch_size": 2, "warmup_steps": 1, "total_steps": 20, "lr": 3e-3,
                 "eval_batches": 2}}


def make_wallet(root: Path, name: str) -> bt.Wallet:
    w = bt.Wallet(name=name, hotkey="default", path=str(root))
    w.create_new_coldkey(use_password=False, overwrite=True, suppress=True)
    w.create_new_hotkey(use_password=False, overwrite=True, suppress=True)
    return w


class PatternData:
    """A learnable stand-in for TokenDataset: arithmetic progressions mod vocab (row = f(seed, index))."""

    def __init__(self, vocab: int, seq_len: int):
        self.vocab, self.seq_len = vocab, seq_len
        self.calls: list[tuple[int, int, int]] = []

    def _rows(self, seed: int, start: int, n: int) -> torch.Tensor:
        out = []
        for i in range(start, start + n):
            g = torch.Generator().manual_seed(seed * 1_000_003 + i)
            off = int(torch.randint(0, self.vocab, (1,), generator=g))
            stride = int(torch.randint(1, 3, (1,), generator=g))
            out.append((off + stride * torch.arange(self.seq_len + 1)) % self.vocab)
        return torch.stack(out).long()

    def batch(self, seed: int, start: int, n: int) -> torch.Tensor:
        self.calls.append((seed, start, n))
        return self._rows(seed, start, n)

    def val_batch(self, start: int, n: int) -> torch.Tensor:
        return self._rows(999, start, n)

    has_loss_mask = False

    def split_batch(self, split: str, seed: int, start: int, n: int) -> torch.Tensor:
        return self.batch(seed, start, n) if split == "train" else self.val_batch(start, n)

    def target_batch(self, split: str, seed: int, start: int, n: int) -> torch.Tensor:
        """No loss mask: the targets are the rows themselves."""
        return self.split_batch(split, seed, start, n)
