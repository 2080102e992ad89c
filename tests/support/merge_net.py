"""Real MinerService replicas of one stage on a devnet, merging over signed HTTP on 127.0.0.1."""
from __future__ import annotations

import asyncio

import torch

from iota_subnet.devnet import add_stake, create_devnet, open_devnet
from iota_subnet.config import load_config
from iota_subnet.miner.service import MinerService
from iota_subnet.sim.adversary import adversary_parts
from iota_subnet.wallets import create_wallet

from support.miners import local_miner


RUN = "merge-run"


OVR = {"model": {"name": "tiny", "dim": 64, "n_layers": 3, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128,
                 "vocab_size": 256},
       "data": {"seq_len": 16, "vocab_size": 256},
       "pipeline": {"stages": 3, "compression_ratio": 4},
       "train": {"batch_size": 4, "micro_batch_size": 2},
       "merge": {"every_steps": 2, "join_timeout_s": 3.0, "phase_timeout_s": 3.0, "max_attempts": 2,
                 "outer_lr": 0.7, "outer_momentum": 0.9,
                 "sync_chunk_numel": 4096, "max_concurrent_transfers": 1}}


def flat(svc):
    return torch.cat([p.detach().reshape(-1) for p in svc.worker.module.parameters()])


class Net:
    def __init__(self, tmp, stage=1, ovr=OVR, **miner_kw):
        """``miner_kw``: more :class:`MinerService` arguments for every replica (e.g. ``audit_window``)."""
        self.tmp, self.stage, self.miner_kw = tmp, stage, miner_kw
        self.db = tmp / "chain.db"
        create_devnet(self.db, 9, tempo=50, block_time=0.5, weights_rate_limit=1, max_validators=1)
        self.cfg = load_config("configs/tiny.yaml", ovr)
        self.svcs: list[MinerService] = []

    async def start(self, n, adversary_last=None, parts=None):
        """``n`` replicas; the last cheats in the way ``adversary_last``; ``parts``: index -> MinerParts."""
        self.chain = await open_devnet(self.db)
        self.val = create_wallet("val", "default", self.tmp / "wallets")
        await self.chain.register(self.val, 9)
        add_stake(self.db, self.val.hotkey.ss58_address, self.val.coldkey.ss58_address, 100.0)
        for i in range(n):
            await self.add(adversary_last if i == n - 1 else None, parts=(parts or {}).get(i))

    async def add(self, adversary=None, parts=None):
        """Start one more replica; ``adversary``: a cheater-suite kind, else ``parts`` (None: honest)."""
        if adversary:
            parts = adversary_parts(adversary, self.cfg)
        i = len(self.svcs)
        w = create_wallet(f"m{i}", "default", self.tmp / "wallets")
        await self.chain.register(w, 9)
        svc = local_miner(self.cfg, w, self.chain, netuid=9, run_id=RUN, stage=self.stage, out_dir=self.tmp / f"m{i}",
                          parts=parts, allow_data_fallback=True, **self.miner_kw)
        await svc.start()
        self.svcs.append(svc)
        for s in self.svcs:
            await s.refresh(force=True) if s is svc else None
            s.view.last_refresh = 0
            await s.refresh()
        return svc

    async def close(self):
        for s in self.svcs:
            try:
                await s.stop()
            except Exception:  # noqa: BLE001 - already stopped
                pass
        await self.chain.close()


def train_locally(svc, k):
    """Stand-in for inner steps on different data: move every replica's weights differently (and
    count the tokens such steps would have trained: a replica weighs in a merge by its work)."""
    svc.worker.trained_tokens += 64
    g = torch.Generator().manual_seed(10 + k)
    with torch.no_grad():
        for p in svc.worker.module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 1e-3)


async def merge_epoch(svcs, epoch):
    """Merge ``epoch`` on every replica, as at the inner step that closes it ((epoch + 1) x H)."""
    for s in svcs:
        s.worker.inner_step = max(s.worker.inner_step, (epoch + 1) * s.cfg.merge.every_steps)
        s.merging.start_merge(epoch)
    await asyncio.gather(*(s.merging.task for s in svcs))
    return [s.merge.history[-1] for s in svcs]
