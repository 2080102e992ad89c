"""A whole p2p network in one process for tests: a devnet chain, real MinerServices (each on its own
signed HTTP server on 127.0.0.1) and a real ValidatorService, all on a small model and real text."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Callable, Optional

from iota_subnet.devnet import add_stake, create_devnet, open_devnet
from iota_subnet.config import load_config
from iota_subnet.data import build_dataset
from iota_subnet.miner.service import MinerService
from iota_subnet.sim.adversary import adversary_parts
from iota_subnet.validator.service import ValidatorOptions, ValidatorService
from iota_subnet.wallets import create_wallet

from support.miners import local_miner

NETUID = 9
RUN = "p2p-test"
#: a 3-stage model small enough for many tests on 2 cores; 2 micro-batches of 2 rows x 32 tokens per step
OVR = {"model": {"name": "tiny", "dim": 64, "n_layers": 3, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128,
                 "vocab_size": 512},
       "data": {"seq_len": 32, "vocab_size": 512},
       "pipeline": {"stages": 3, "compression_ratio": 4},
       "train": {"batch_size": 4, "micro_batch_size": 2, "warmup_steps": 1, "total_steps": 40, "lr": 3e-3,
                 "eval_batches": 2}}

_DATASETS: dict = {}


def dataset(cfg, wikitext: Path, cache: Path):
    key = (repr(cfg.data), str(wikitext))
    if key not in _DATASETS:
        # a transformers run names its own data (data.hf), read from the config
        source = None if getattr(cfg.data, "hf", None) is not None else str(wikitext)
        _DATASETS[key] = build_dataset(cfg.data, source, cache)[1]
    return _DATASETS[key]


class P2PNet:
    """``stages`` x ``replicas`` MinerServices + one ValidatorService (p2p) on a devnet in ``tmp``.
    ``config``: a run config file to use as it is (e.g. a ``transformers`` family's) instead of
    ``configs/tiny.yaml`` with :data:`OVR` and ``overrides``."""

    def __init__(self, tmp: Path, wikitext: Path, cache: Path, *, replicas: int = 2, overrides: Optional[dict] = None,
                 validators: int = 1, config: Optional[Path] = None):
        self.tmp, self.cache = tmp, cache
        ovr = {k: dict(v) for k, v in OVR.items()}
        for k, v in (overrides or {}).items():
            ovr.setdefault(k, {}).update(v)
        self.cfg = load_config(config, overrides) if config is not None else load_config("configs/tiny.yaml", ovr)
        self.ds = dataset(self.cfg, wikitext, cache)
        self.db = create_devnet(tmp / "chain.db", NETUID, tempo=6, block_time=0.2, weights_rate_limit=1,
                                immunity_period=0, max_validators=validators)
        wp = tmp / "wallets"
        self.vals = [create_wallet(f"vali{v}", "default", wp) for v in range(validators)]
        self.replicas = replicas
        self.stages = self.cfg.pipeline.stages
        self.miner_wallets = {(s, r): create_wallet(f"m{s}{r}", "default", wp)
                              for r in range(replicas) for s in range(self.stages)}
        self.miners: dict[tuple[int, int], MinerService] = {}
        self.validators: list[ValidatorService] = []
        self.chain = None

    async def start(self, adversaries: Optional[dict] = None, per_miner: Optional[Callable[[int, int], dict]] = None,
                    **miner_kw) -> None:
        """Register everyone and start the miners; ``adversaries``: (stage, replica) -> adversary kind;
        ``per_miner(stage, replica)``: more :meth:`start_miner` arguments for that miner."""
        self.chain = await open_devnet(self.db)
        for w in self.vals:
            await self.chain.register(w, NETUID)
            add_stake(self.db, w.hotkey.ss58_address, w.coldkey.ss58_address, 100.0, netuid=NETUID)
        for w in self.miner_wallets.values():
            await self.chain.register(w, NETUID)
        for (s, r) in self.miner_wallets:
            kind = (adversaries or {}).get((s, r))
            await self.start_miner(s, r, **miner_kw, **({"parts": adversary_parts(kind, self.cfg)} if kind else {}),
                                   **(per_miner(s, r) if per_miner else {}))

    async def start_miner(self, s: int, r: int, **kw) -> MinerService:
        m = local_miner(self.cfg, self.miner_wallets[(s, r)], self.chain, netuid=NETUID, run_id=RUN, stage=s,
                        out_dir=self.tmp / f"miner-{s}-{r}", register=False, metagraph_refresh_s=0.5,
                        dataset=self.ds, **kw)
        await m.start()
        self.miners[(s, r)] = m
        return m

    def options(self, v: int = 0, **kw) -> ValidatorOptions:
        base = dict(network="devnet", chain_db=str(self.db), netuid=NETUID, steps=3, out=str(self.tmp / f"vali{v}"),
                    run_id=RUN, sync_interval_s=0.5, status_interval_s=0.2, weights_check_s=0.3, hop_timeout_s=10,
                    audit_timeout_s=10, audit_retry_s=(0.5, 1.0),
                    exit_when_done=True, wait_miners_s=30, min_lanes=self.replicas, host="127.0.0.1",
                    clasp_interval_s=0, stall_s=5.0)
        base.update(kw)
        return ValidatorOptions.from_flat(**base)

    def validator(self, v: int = 0, **kw) -> ValidatorService:
        svc = ValidatorService(self.options(v, **kw), wallet=self.vals[v], chain=self.chain, cfg=self.cfg,
                               dataset=self.ds)
        self.validators.append(svc)
        return svc

    def status(self, v: int = 0) -> dict:
        return json.loads((self.tmp / f"vali{v}" / "status.json").read_text())

    async def close(self) -> None:
        for m in self.miners.values():
            try:
                await m.stop()
            except Exception:  # noqa: BLE001 - a miner a test already stopped
                pass
        if self.chain is not None:
            await self.chain.close()


def run(coro, timeout: float = 240):
    return asyncio.run(asyncio.wait_for(coro, timeout))


#: the miner that cheats in cheater runs: the middle stage's second replica
ADV = (1, 1)


async def cheater_run(tmp_path, wikitext_path, cache_dir, kind: str, steps: int = 14, config=None):
    """A :class:`P2PNet` (3 x 2, the run ``config`` or tiny) whose :data:`ADV` miner cheats as ``kind``,
    driven by one validator for ``steps`` steps (audits every 0.5 s); returns the validator, the cheater,
    the honest miners' uids and the network's status."""
    net = P2PNet(tmp_path, wikitext_path, cache_dir, config=config)
    await net.start(adversaries={ADV: kind})
    try:
        vali = net.validator(steps=steps, audit_interval_s=0.5, hop_timeout_s=4, audit_timeout_s=4)
        assert await vali.run() == 0
        adv = net.miners[ADV]
        honest = {m.uid for k, m in net.miners.items() if k != ADV}
        return vali, adv, honest, net.status()
    finally:
        await net.close()
