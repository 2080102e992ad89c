"""``iota-subnet localnet``: a whole subnet on one machine, every neuron its own OS process.

1. throwaway wallets (no password) under ``OUT/wallets``; a devnet chain in ``OUT/chain.db``
   (one SQLite file; block height follows the wall clock) with subnet 9;
2. validators registered and staked (they alone hold validator permits), miners registered;
3. data and tokenizer prepared once (children load them from the shared cache);
4. miners (``--stages x --replicas``; ``--stages`` defaults to the config's ``pipeline.stages``) and
   validators (every one with ``--wire-dtype`` when given) started as processes; a miner that dies is
   restarted after ``restart_delay_s`` (it resumes from its checkpoint);
5. progress shown until the validators finish ``--steps`` inner steps per lane and have set
   weights that an epoch has turned into incentive;
6. ``OUT/metrics.jsonl`` and ``OUT/summary.json`` written; every process stopped (SIGTERM, then
   SIGKILL), also on Ctrl-C.
"""
from __future__ import annotations

import asyncio
import json
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import yaml
from loguru import logger

from iota_subnet.config import ConfigError, RunConfig
from iota_subnet.utils.atomic import atomic_write_text
from iota_subnet.utils.progress import Progress
from iota_subnet.sim.chaos import ChaosInjector, ChaosLog, checked_chaos
from .localnet_args import (adversary_positions, devnet_block_time, emulation_argv, localnet_config, relay_rate_argv,
                             role_links, wire_dtype_argv)
from .localnet_join import JoinAt, parse_join_at
from .localnet_summary import RunSummary
from .processes import Child, NeuronProcesses

NETUID = 9


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the OS's choice)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def resolved_config_yaml(cfg: RunConfig) -> str:
    d = cfg.to_dict()
    return yaml.safe_dump(d, sort_keys=False)


class LocalNet(NeuronProcesses, RunSummary):
    """A whole subnet on one machine (see the module docstring): its setup, its neurons, the run and
    its summary (:mod:`.processes`, :mod:`.localnet_summary`; arguments checked in :mod:`.localnet_args`)."""

    def __init__(self, *, stages: Optional[int] = None, replicas: int, validators: int, config: str,
                 data: Optional[str], steps: int, out: str | Path, block_time: float = 1.0, tempo: int = 20,
                 restart_dead: bool = True, restart_delay_s: float = 3.0, progress: Optional[bool] = None,
                 extra_miner_args: Optional[list[str]] = None, device: Optional[str] = None,
                 timeout_s: Optional[float] = None, overrides: Optional[dict] = None,
                 adversary: Optional[str] = None, extra_validator_args: Optional[list[str]] = None,
                 chaos: Optional[str] = None, chaos_duration_s: Optional[float] = None,
                 link: str = "loopback", emulate_gpu: Optional[str] = None, mfu: Optional[float] = None,
                 gpu_mem: Optional[float] = None, time_scale: float = 1.0, wire_dtype: Optional[str] = None,
                 home_replicas: int = 0, relays: int = 0, relay_fault: Optional[str] = None, spares: int = 0,
                 validator_link: Optional[str] = None, relay_link: Optional[str] = None,
                 relay_rate: Optional[float] = None, join_at: Optional[str] = None):
        self.cfg = localnet_config(config, overrides, stages=stages, replicas=replicas, validators=validators,
                                   steps=steps, adversary=adversary)
        self.out = Path(out).resolve()
        #: stages: ``stages`` when given, else the config's own ``pipeline.stages``
        self.stages, self.replicas, self.n_validators = self.cfg.pipeline.stages, replicas, validators
        self.data, self.steps = data, steps
        self.tempo = tempo
        self.restart_dead, self.restart_delay_s = restart_dead, restart_delay_s
        self.progress = sys.stderr.isatty() if progress is None else progress
        self.extra_miner_args = extra_miner_args or []
        self.extra_validator_args = extra_validator_args or []
        #: each role's link (``--link`` for all, ``--validator-link``, ``--relay-link``; see role_links)
        self.links = role_links(link, validator_link, relay_link, relays=int(relays), home_replicas=int(home_replicas))
        #: link (the default, every miner's) and accelerator emulation (``--emulate-gpu``; see emulation_argv)
        self.link, self.emulation, miner_argv, validator_argv = emulation_argv(
            link, emulate_gpu, mfu, gpu_mem, time_scale, validator_link=self.links["validator"])
        self.time_scale = float(time_scale)
        #: seconds per block: ``--block-time`` in emulated seconds, and the devnet's wall block time
        #: (x ``time_scale`` when emulated: a tempo is a tempo of emulated time; see devnet_block_time)
        self.block_time_emulated = float(block_time)
        self.block_time = devnet_block_time(block_time, self.time_scale, self.emulation is not None)
        self.extra_miner_args = [*miner_argv, *self.extra_miner_args]
        #: wire dtype of activations and gradients between miners, given to every validator (None: theirs, bf16)
        self.wire_dtype = wire_dtype
        self.extra_validator_args = [*validator_argv, *wire_dtype_argv(wire_dtype), *self.extra_validator_args]
        self.device = device
        self.timeout_s = timeout_s
        #: the last ``home_replicas`` replicas of every stage are reached only through relays (``--relay
        #: auto``), which every validator hosts (``--relay-host``)
        if not 0 <= int(home_replicas) <= replicas:
            raise ConfigError(f"--home-replicas must be between 0 and --replicas ({replicas}), got {home_replicas}")
        self.home_replicas = int(home_replicas)
        #: standalone relays (``iota-subnet relay``) the home miners attach to (0: the validators relay);
        #: ``relay_fault``: relay 0 misbehaves so (:mod:`iota_subnet.sim.relay_faults`)
        self.n_relays, self.relay_fault = int(relays), relay_fault
        if self.n_relays and not self.home_replicas:
            raise ConfigError("--relays needs --home-replicas: nobody would attach to them")
        if self.relay_fault and not self.n_relays:
            raise ConfigError("--relay-fault needs --relays")
        self.relay_wallets: list = []
        self.relay_ports: list[int] = []
        #: ``--relay-rate``: per relayed miner, emulated bytes per second (None: no cap), and its flags
        self.relay_rate = relay_rate
        rate_validator, self.relay_rate_args = relay_rate_argv(relay_rate, relays=self.n_relays,
                                                               home_replicas=self.home_replicas, time_scale=time_scale)
        if self.home_replicas and not self.n_relays:
            self.extra_validator_args = [*self.extra_validator_args, "--relay-host", *rate_validator]
        #: ``--adversary``: the cheater-suite or bad-output kinds, ``(stage, replica) -> kind`` (empty: all
        #: honest; see :func:`~.localnet_args.adversary_positions`)
        self.adversary = adversary
        self.adversary_pos = adversary_positions(adversary, self.stages, replicas)
        #: replicas per stage that validators keep as spares (they drive ``replicas - spares`` lanes)
        if not 0 <= int(spares) < replicas:
            raise ConfigError(f"--spares must be between 0 and --replicas - 1 ({replicas - 1}), got {spares}")
        self.lanes = replicas - int(spares)
        if spares:
            self.extra_validator_args = [*self.extra_validator_args, "--lanes", str(self.lanes)]
        self.val_wallets: list = []            # built by :meth:`prepare`
        self.miner_wallets: dict = {}          # (stage, replica) -> wallet, built by :meth:`prepare`
        self.children: list[Child] = []
        #: fault injection (:mod:`iota_subnet.sim.chaos`): the spec, and the run time its schedule covers
        self.chaos_spec = None
        if chaos is not None:
            self.chaos_spec = checked_chaos(chaos, replicas, chaos_duration_s)
        self.chaos_duration_s = 3600.0 if chaos_duration_s is None else float(chaos_duration_s)
        self.chaos = None
        #: ``--join-at STEP[:STAGE]``: one fresh miner joins mid-run (:mod:`.localnet_join`; None: none)
        at = parse_join_at(join_at, stages=self.stages, steps=steps)
        self.join_at = None if at is None else JoinAt(*at, time_scale=self.time_scale)
        self.dashboards: dict[str, str] = {}   # validator name -> its dashboard URL, once it serves one
        self._stop_requested = threading.Event()
        #: how the run ended, in the summary: "done" (every step trained, weights landed), "weights late"
        #: (trained, weights did not land in time), "stopped" (a signal or request_stop before the end)
        self.ended = "done"
        self._cleaning_up = False       # run's final clean-up has begun: signals no longer interrupt it
        self.run_id = f"localnet-{self.cfg.model.name}"
        self.chain_db = self.out / "chain.db"
        self.config_path = self.out / "config.yaml"

    # ---- setup ---------------------------------------------------------------------------------
    def prepare(self) -> None:
        from iota_subnet.devnet import add_stake, create_devnet
        from iota_subnet.data import build_dataset, default_source
        from iota_subnet.wallets import create_wallet

        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "logs").mkdir(exist_ok=True)
        atomic_write_text(self.config_path, resolved_config_yaml(self.cfg))
        if self.data is None and getattr(self.cfg.data, "hf", None) is None:   # data.hf: the config names it
            self.data, why = default_source()
            logger.info(f"no --data given: using {self.data} ({why})")
        tok, ds = build_dataset(self.cfg.data, self.data, allow_fallback=True)   # a local network may fall back
        atomic_write_text(self.out / "tokenizer.json", tok.to_str())   # `iota-subnet export` ships it
        logger.info(f"data ready: {ds.n_tokens:,} tokens, {ds.n_train_rows} train rows, vocab {tok.vocab_size}")
        if self.chain_db.exists():
            from iota_subnet.devnet import resume_devnet
            resume_devnet(self.chain_db)   # a rerun in the same folder continues the same chain
        create_devnet(self.chain_db, NETUID, tempo=self.tempo, block_time=self.block_time, weights_rate_limit=2,
                      immunity_period=10_000, exist_ok=True, max_validators=self.n_validators,
                      max_uids=max(64, 2 * (self.stages * self.replicas + self.n_validators)))
        wallets = self.out / "wallets"
        self.val_wallets = [create_wallet(f"validator{v}", "default", wallets) for v in range(self.n_validators)]
        self.miner_wallets = {(s, r): create_wallet(f"miner-s{s}-r{r}", "default", wallets)
                              for s in range(self.stages) for r in range(self.replicas)}
        self.relay_wallets = [create_wallet(f"relay{i}", "default", wallets) for i in range(self.n_relays)]
        self.relay_ports = [free_port() for _ in range(self.n_relays)]
        asyncio.run(self._register_all())
        for w in self.val_wallets:
            add_stake(self.chain_db, w.hotkey.ss58_address, w.coldkey.ss58_address, 1000.0, netuid=NETUID)
        self._make_children()

    async def _register_all(self) -> None:
        from iota_subnet.devnet import open_devnet
        chain = await open_devnet(self.chain_db)
        try:
            for w in [*self.val_wallets, *self.miner_wallets.values()]:
                await chain.register(w, NETUID)
        finally:
            await chain.close()

    def _common(self, wallet_name: str) -> list[str]:
        a = ["--wallet-name", wallet_name, "--wallet-hotkey", "default", "--wallet-path", str(self.out / "wallets"),
             "--network", "devnet", "--chain-db", str(self.chain_db), "--netuid", str(NETUID),
             "--config", str(self.config_path), "--run-id", self.run_id, "--steps", str(self.steps),
             "--host", "127.0.0.1", "--external-ip", "127.0.0.1", "--threads", "1"]
        if self.device:
            a += ["--device", self.device]
        return a

    def _data_args(self) -> list[str]:
        """``--data`` for the neurons (none when the config names a ``datasets`` dataset, ``data.hf``)."""
        return [] if self.data is None else ["--data", str(self.data)]

    def _miner_child(self, s: int, r: int, w) -> Child:
        name = f"miner-s{s}-r{r}"
        out = self.out / "miners" / name
        argv = [sys.executable, "-m", "iota_subnet.entry.miner", *self._common(name), "--stage", str(s), "--out",
                str(out), "--no-register", *self._data_args(), "--link-control", str(out / "link-control.json"),
                "--allow-data-fallback", *self.extra_miner_args]
        if (s, r) in self.adversary_pos:
            argv += ["--adversary", self.adversary_pos[(s, r)]]
        if self.replicas - self.home_replicas <= r < self.replicas:    # a miner joined mid-run (r >= replicas): direct
            if self.n_relays:
                for rw, port in zip(self.relay_wallets, self.relay_ports):
                    argv += ["--relay", f"{rw.hotkey.ss58_address}@127.0.0.1:{port}"]
            else:
                argv += ["--relay", "auto"]
        return Child(name, "miner", argv, self.out / "logs" / f"{name}.log", out, stage=s)

    def _make_children(self) -> None:
        py = sys.executable
        for (s, r), w in self.miner_wallets.items():
            self.children.append(self._miner_child(s, r, w))
        for v, w in enumerate(self.val_wallets):
            name = f"validator{v}"
            out = self.out / "validators" / name
            argv = [py, "-m", "iota_subnet.entry.validator", *self._common(name), "--out", str(out),
                    *self._data_args(), "--min-lanes", str(self.replicas), "--link-control",
                    str(out / "link-control.json"), "--allow-data-fallback", "--dashboard-port", "0",
                    *self.extra_validator_args]
            self.children.append(Child(name, "validator", argv, self.out / "logs" / f"{name}.log", out))
        self.children.extend(self._relay_children())

    def _relay_children(self) -> list[Child]:
        """The standalone relays, on fixed ports the home miners were told (only registered hotkeys attach)."""
        out = []
        for i, (w, port) in enumerate(zip(self.relay_wallets, self.relay_ports)):
            name = f"relay{i}"
            argv = [sys.executable, "-m", "iota_subnet.entry.relay", "--wallet-name", name, "--wallet-path",
                    str(self.out / "wallets"), "--network", "devnet", "--chain-db", str(self.chain_db), "--netuid",
                    str(NETUID), "--host", "127.0.0.1", "--port", str(port), "--out", str(self.out / "relays" / name),
                    "--sync-interval", "2", "--link", self.links["relay"], "--time-scale", repr(self.time_scale),
                    *self.relay_rate_args]
            if i == 0 and self.relay_fault:
                argv += ["--fault", self.relay_fault]
            out.append(Child(name, "relay", argv, self.out / "logs" / f"{name}.log", self.out / "relays" / name))
        return out

    def add_miner(self, stage: int) -> Child:
        """A new miner registers mid-run on ``stage`` and starts (it syncs from its peers)."""
        from iota_subnet.wallets import create_wallet
        k = sum(1 for c in self.children if c.kind == "miner" and c.stage == stage)
        name = f"miner-s{stage}-r{k}"
        w = create_wallet(name, "default", self.out / "wallets")
        self.miner_wallets[(stage, k)] = w

        async def reg():
            from iota_subnet.devnet import open_devnet
            chain = await open_devnet(self.chain_db)
            try:
                await chain.register(w, NETUID)
            finally:
                await chain.close()
        asyncio.run(reg())
        child = self._miner_child(stage, k, w)
        self.children.append(child)
        self.start(child)
        logger.info(f"{name} joined stage {stage}")
        return child

    def run(self) -> dict:
        """Set up, run to completion and return the summary. Always stops every process."""
        t_setup = time.monotonic()
        self.prepare()
        logger.info(f"devnet {self.chain_db}: {self.n_validators} validator(s), "
                    f"{self.stages} stages x {self.replicas} replicas; logs in {self.out / 'logs'}")
        bar = startup = None
        restore = self._stop_on_signals()
        try:
            for c in self.children:
                self.start(c)
            t0 = time.monotonic()
            startup = Progress(len(self.children), "localnet start-up", "neuron", tty=self.progress, log_every_s=5)
            last_log = 0.0
            done_at = None
            while True:
                time.sleep(1.0)
                self._supervise()
                if self.chaos_spec is not None and self.chaos is None and startup.closed:
                    self._start_chaos()          # the schedule's clock starts once every neuron serves
                if self.chaos is not None and not all(s.get("done") for s in self.validator_status()):
                    self.chaos.tick()
                st = self.validator_status()
                if self.join_at is not None and startup.closed:
                    self.join_at.tick(self, self._steps_done(st), t0)
                self._announce_dashboards(st)
                if not startup.closed:
                    startup.set(self._ready(st))
                    if startup.done >= startup.total:
                        startup.close()
                if startup.closed and bar is None and self.progress:
                    from tqdm import tqdm
                    bar = tqdm(total=self.steps, desc="localnet", unit="step", dynamic_ncols=True)
                steps_done = self._steps_done(st)
                line = self._progress_line(st)
                if bar is not None:
                    bar.n = steps_done
                    bar.set_postfix_str(line)
                    bar.refresh()
                elif time.monotonic() - last_log > 10:
                    logger.info(f"step {steps_done}/{self.steps} {line}")
                    last_log = time.monotonic()
                if all(s.get("done") for s in st):
                    done_at = done_at or time.monotonic()
                    if self._weights_landed(st):
                        break
                    if time.monotonic() - done_at > 6 * self.tempo * self.block_time + 60:
                        logger.warning("training done but weights/incentive did not land in time; summarising anyway")
                        self.ended = "weights late"
                        break
                if self._stop_requested.is_set():
                    logger.info(f"stop requested at step {steps_done}/{self.steps}: summarising and stopping every neuron")
                    self.ended = "weights late" if done_at else "stopped"     # every step trained: not early
                    break
                if self.timeout_s and time.monotonic() - t0 > self.timeout_s:
                    raise TimeoutError(f"localnet did not finish within {self.timeout_s:.0f}s")
            wall_s = time.monotonic() - t_setup
            self.stop_all()        # every neuron writes its final status (merges, steps) as it stops
            summary = self.summarize(wall_s)
        finally:
            self._cleaning_up = True            # from here a Ctrl-C changes nothing (see _stop_on_signals)
            if bar is not None:
                bar.close()
            if startup is not None:
                startup.close()
            try:
                for c in self.children:          # nothing stays stopped (SIGSTOP) or held back
                    if c.alive():
                        c.proc.send_signal(signal.SIGCONT)
                self.stop_all()
                self._halt_chain()
                if self.chaos is not None:
                    self.chaos.log.close()
            finally:
                restore()
        return summary

    def _start_chaos(self) -> None:
        self.chaos = ChaosInjector(self, self.chaos_spec, ChaosLog(self.out / "chaos.jsonl"), self.chaos_duration_s)
        logger.info(f"chaos: {len(self.chaos.pending)} faults scheduled over the next {self.chaos_duration_s:.0f} s "
                    f"(seed {self.chaos_spec.seed}); log in {self.out / 'chaos.jsonl'}")

    def _halt_chain(self) -> None:
        """The network is gone: stop the devnet's clock so later reads show it as the run left it."""
        if self.chain_db.exists():
            from iota_subnet.devnet import halt_devnet
            try:
                block = halt_devnet(self.chain_db)
                logger.info(f"devnet halted at block {block} (rerunning in {self.out} resumes it)")
            except Exception as e:  # noqa: BLE001 - never mask the run's own outcome
                logger.warning(f"could not halt the devnet: {e}")

    def _ready(self, st: list[dict]) -> int:
        """Neurons up: miners that serve (their status.json names a port), validators driving lanes."""
        n = sum(1 for s in st if s.get("lanes"))
        for c in self.children:
            if c.kind in ("miner", "relay") and c.alive():
                n += bool(c.status().get("port"))
        return n

    def request_stop(self) -> None:
        """Ask a running :meth:`run` (in another thread) to stop early: it summarises and stops every process."""
        self._stop_requested.set()

    def _stop_on_signals(self) -> Callable[[], None]:
        """In the main thread, SIGTERM, SIGHUP and SIGINT (``kill``, a closed terminal, Ctrl-C) stop
        the run as :meth:`request_stop` does: every neuron is stopped (SIGTERM, then SIGKILL after 15 s)
        and the summary written. With the default handlers they would end this process at once and leave
        every miner and validator running, orphaned. A second Ctrl-C skips the summary (the neurons are still
        stopped, in ``run``'s clean-up); later signals, and any once that clean-up has begun, change
        nothing (raising there could cut it short). Returns the function that restores the handlers."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None

        def on_signal(signum, _frame):
            name = signal.Signals(signum).name
            if self._stop_requested.is_set():
                if signum == signal.SIGINT and not self._cleaning_up:
                    self._cleaning_up = True        # one KeyboardInterrupt: the next press is only logged
                    raise KeyboardInterrupt
                logger.warning(f"signal {name}: already stopping every neuron")
                return
            logger.warning(f"signal {name}: stopping every neuron" + (
                " and writing the summary (Ctrl-C again: stop them without it)" if signum == signal.SIGINT else ""))
            self._stop_requested.set()
        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}

        def restore() -> None:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return restore

    def _announce_dashboards(self, st: list[dict]) -> None:
        """Print each validator's dashboard address once it serves one (``--dashboard-port 0``)."""
        names = [c.name for c in self.children if c.kind == "validator"]
        for name, s in zip(names, st):
            url = s.get("dashboard")
            if url and self.dashboards.get(name) != url:
                self.dashboards[name] = url
                logger.info(f"{name} dashboard: {url}")
                print(f"dashboard ({name}): {url}", file=sys.stderr, flush=True)   # stdout: --json results only

    @staticmethod
    def _steps_done(st: list[dict]) -> int:
        """Inner steps completed on the slowest lane, over all validators (they split each lane's steps)."""
        per_lane: dict[str, int] = {}
        for s in st:
            for lane, n in (s.get("steps_done") or {}).items():
                per_lane[lane] = per_lane.get(lane, 0) + int(n)
        return min(per_lane.values()) if per_lane else 0

    def progress_stats(self, st: Optional[list[dict]] = None) -> dict:
        """What the run's progress line shows, as numbers, from the validators' ``status.json`` (``st``:
        :meth:`validator_status`, read when not given) and the miner processes: ``steps_done`` (slowest
        lane, :meth:`_steps_done`) of ``steps``; ``loss`` (mean of the validators' latest training loss,
        nats/token; None before the first step); ``tokens_per_s`` (sum over validators); ``miners_live`` of
        ``miners_total``; ``reroutes``; ``miners``: one dict per miner process (``name``, ``stage``,
        ``uid`` from its status, None before it wrote one; ``alive``; ``weight``: mean over validators of
        the latest weight each set for the uid, 0 before any)."""
        st = self.validator_status() if st is None else st
        losses = [s["loss"] for s in st if s.get("loss") is not None]
        miners = []
        for c in self.children:
            if c.kind != "miner":
                continue
            uid = c.status().get("uid")
            weight = (sum(float((v.get("last_weights") or {}).get(str(uid), 0.0)) for v in st) / len(st)) \
                if st and uid is not None else 0.0
            miners.append({"name": c.name, "stage": c.stage, "uid": uid, "alive": c.alive(), "weight": weight})
        return {"steps_done": self._steps_done(st), "steps": self.steps,
                "loss": sum(losses) / len(losses) if losses else None,
                "tokens_per_s": float(sum(s.get("tokens_per_s") or 0 for s in st)),
                "miners_live": sum(m["alive"] for m in miners), "miners_total": self.stages * self.replicas,
                "reroutes": sum(s.get("reroutes", 0) for s in st), "miners": miners}

    def _progress_line(self, st: list[dict]) -> str:
        p = self.progress_stats(st)
        loss = "-" if p["loss"] is None else f"{p['loss']:.3f}"
        return (f"loss {loss} tok/s {p['tokens_per_s']:.0f} miners {p['miners_live']}/{p['miners_total']} "
                f"reroutes {p['reroutes']}")

    def _weights_landed(self, st: list[dict]) -> bool:
        """Each validator set weights after it finished, and an epoch has paid incentive since."""
        rows = self.metagraph()
        if not rows:
            return False
        for s in st:
            if not s.get("weights_set_blocks") or s["weights_set_blocks"][-1] < s.get("done_block", 0):
                return False
        worked = {int(u) for s in st for u, m in (s.get("miners") or {}).items() if m.get("work", 0) > 0}
        worked -= set(self.adversary_uids())
        by_uid = {r["uid"]: r for r in rows}
        return bool(worked) and all(by_uid.get(u, {}).get("incentive", 0) > 0 for u in worked)

    def metagraph(self) -> list[dict]:
        from iota_subnet.devnet import metagraph_rows
        try:
            return asyncio.run(metagraph_rows(self.chain_db, NETUID))
        except Exception as e:  # noqa: BLE001 - a busy database is retried next second
            logger.debug(f"metagraph read failed: {e}")
            return []

    def adversary_uids(self) -> list[int]:
        uids = []
        for s, r in sorted(self.adversary_pos):
            try:
                uids.append(int(json.loads((self.miner(f"miner-s{s}-r{r}").out / "status.json").read_text())["uid"]))
            except (OSError, ValueError, KeyError, TypeError, StopIteration):
                pass        # not started or not serving yet: not counted
        return uids


def run_localnet(**kw) -> dict:
    return LocalNet(**kw).run()
