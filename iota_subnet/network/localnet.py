"""``iota-subnet localnet``: a whole subnet on one machine, every neuron its own OS process.

1. throwaway wallets (no password) under ``OUT/wallets``; a devnet chain in ``OUT/chain.db``
   (one SQLite file; block height follows the wall clock) with subnet 9;
2. validators registered and staked (they alone hold validator permits), miners registered;
3. data and tokenizer prepared once (children load them from the shared cache);
4. miners (``--stages x --replicas``) and validators started as processes; a miner that dies is
   restarted after ``restart_delay_s`` (it resumes from its checkpoint);
5. progress shown until the validators finish ``--steps`` inner steps per lane and have set
   weights that an epoch has turned into incentive;
6. ``OUT/metrics.jsonl`` and ``OUT/summary.json`` written; every process stopped (SIGTERM, then
   SIGKILL), also on Ctrl-C.
"""
from __future__ import annotations

import asyncio
from collections import Counter
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import yaml
from loguru import logger

from iota_subnet.config import ConfigError, RunConfig, load_config
from iota_subnet.train.metrics import write_summary
from iota_subnet.utils.atomic import atomic_write_text
from iota_subnet.utils.progress import Progress
from .chaos import ChaosInjector, ChaosLog, checked_chaos

NETUID = 9


@dataclasses.dataclass
class Child:
    name: str
    kind: str                      # "miner" | "validator"
    argv: list[str]
    log: Path
    out: Path
    stage: Optional[int] = None
    proc: Optional[subprocess.Popen] = None
    restarts: int = 0
    died_at: Optional[float] = None
    started_at: Optional[float] = None      # monotonic time of the latest start
    hold_until: Optional[float] = None      # a chaos kill: restart no earlier than this
    left: bool = False                      # a chaos leave: never restarted
    started_wall: float = 0.0               # unix time of the latest start

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def status(self) -> dict:
        """Its ``status.json``, or {} while it has not written one since its latest start (a resumed
        run's folder still holds the previous process's: its ports and dashboard address are stale)."""
        p = self.out / "status.json"
        try:
            if p.stat().st_mtime < self.started_wall - 1.0:
                return {}
            return json.loads(p.read_text())
        except (OSError, ValueError):
            return {}


def resolved_config_yaml(cfg: RunConfig) -> str:
    d = cfg.to_dict()
    return yaml.safe_dump(d, sort_keys=False)


def audit_summary(statuses: list[dict]) -> dict:
    """The validators' audits (p2p): how many, how many failed, hop audits per miner per tempo (min and
    mean over the miners audited and the full tempos seen: the first and last are partial), flagged uids."""
    audits = failed = 0
    cpu = 0.0
    per: list[int] = []
    flagged: set[int] = set()
    for s in statuses:
        a = s.get("audits") or {}
        audits += int(a.get("audits", 0))
        failed += int(a.get("failed", 0))
        cpu += float(a.get("cpu_s", 0.0))
        tempos = sorted(a.get("per_tempo") or {}, key=int)
        miners = {hk for t in tempos for hk in a["per_tempo"][t]}
        for t in tempos[1:-1]:
            per += [int(a["per_tempo"][t].get(hk, 0)) for hk in miners]
        flagged |= {int(m["uid"]) for m in s.get("scores") or [] if (m.get("audits") or {}).get("flagged")}
    return {"audits": audits, "audits_failed": failed, "audits_per_miner_per_tempo_min": min(per) if per else None,
            "audits_per_miner_per_tempo_mean": sum(per) / len(per) if per else None, "flagged": sorted(flagged), "audit_cpu_s": round(cpu, 3)}


class LocalNet:
    def __init__(self, *, stages: int, replicas: int, validators: int, config: str, data: Optional[str], steps: int,
                 out: str | Path, block_time: float = 1.0, tempo: int = 20, restart_dead: bool = True,
                 restart_delay_s: float = 3.0, progress: Optional[bool] = None,
                 extra_miner_args: Optional[list[str]] = None, device: Optional[str] = None,
                 timeout_s: Optional[float] = None, overrides: Optional[dict] = None,
                 adversary: Optional[str] = None, extra_validator_args: Optional[list[str]] = None,
                 chaos: Optional[str] = None, chaos_duration_s: Optional[float] = None,
                 link: str = "loopback", emulate_gpu: Optional[str] = None, mfu: Optional[float] = None,
                 gpu_mem: Optional[float] = None, time_scale: float = 1.0):
        if stages < 1 or replicas < 1 or validators < 1:
            raise ConfigError("--stages, --replicas and --validators must each be >= 1")
        self.out = Path(out).resolve()
        ovr = {k: dict(v) for k, v in (overrides or {}).items()}
        ovr.setdefault("pipeline", {})["stages"] = stages
        ovr.setdefault("train", {})["total_steps"] = steps
        self.cfg = load_config(config, ovr)
        if adversary is not None:
            from iota_subnet.miner.adversary import ADVERSARY_KINDS
            if adversary not in ADVERSARY_KINDS:
                raise ConfigError(f"unknown --adversary {adversary!r}; one of {', '.join(ADVERSARY_KINDS)}")
            if adversary == "poison" and replicas < 3:
                raise ConfigError("--adversary poison needs --replicas 3 or more: a poisoning reducer is penalised "
                                  "when two other replicas of its stage prove it wrong (with two replicas either "
                                  "one could be lying)")
        if adversary == "poison" and not self.cfg.merge.enabled:
            # merge-shard poisoning needs merges: every 5 inner steps unless the config says otherwise
            ovr.setdefault("merge", {})["every_steps"] = 5
            self.cfg = load_config(config, ovr)
            logger.info("--adversary poison: merging every 5 inner steps (merge.every_steps)")
        self.stages, self.replicas, self.n_validators = stages, replicas, validators
        self.data, self.steps = data, steps
        self.block_time, self.tempo = block_time, tempo
        self.restart_dead, self.restart_delay_s = restart_dead, restart_delay_s
        self.progress = sys.stderr.isatty() if progress is None else progress
        self.extra_miner_args = extra_miner_args or []
        self.extra_validator_args = extra_validator_args or []
        #: link and accelerator emulation of every neuron (``--link``, ``--emulate-gpu``; see emulation_argv)
        self.link, self.emulation, miner_argv, validator_argv = emulation_argv(link, emulate_gpu, mfu, gpu_mem,
                                                                               time_scale)
        self.extra_miner_args = [*miner_argv, *self.extra_miner_args]
        self.extra_validator_args = [*validator_argv, *self.extra_validator_args]
        self.device = device
        self.timeout_s = timeout_s
        #: cheater-suite kind run by one replica of the middle stage (``stages // 2``, last replica); None = all honest
        self.adversary = adversary
        self.adversary_pos = (stages // 2, replicas - 1) if adversary else None
        self.children: list[Child] = []
        #: fault injection (:mod:`.chaos`): the spec, and the run time its schedule covers
        self.chaos_spec = None
        if chaos is not None:
            self.chaos_spec = checked_chaos(chaos, replicas, chaos_duration_s)
        self.chaos_duration_s = 3600.0 if chaos_duration_s is None else float(chaos_duration_s)
        self.chaos = None
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
        from iota_subnet.chain import add_stake, create_devnet
        from iota_subnet.data import build_dataset, default_source
        from iota_subnet.wallets import create_wallet

        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "logs").mkdir(exist_ok=True)
        atomic_write_text(self.config_path, resolved_config_yaml(self.cfg))
        if self.data is None:
            self.data, why = default_source()
            logger.info(f"no --data given: using {self.data} ({why})")
        tok, ds = build_dataset(self.cfg.data, self.data, allow_fallback=True)   # a local network may fall back
        atomic_write_text(self.out / "tokenizer.json", tok.to_str())   # `iota-subnet export` ships it
        logger.info(f"data ready: {ds.n_tokens:,} tokens, {ds.n_train_rows} train rows, vocab {tok.vocab_size}")
        if self.chain_db.exists():
            from iota_subnet.chain import resume_devnet
            resume_devnet(self.chain_db)   # a rerun in the same folder continues the same chain
        create_devnet(self.chain_db, NETUID, tempo=self.tempo, block_time=self.block_time, weights_rate_limit=2,
                      immunity_period=10_000, exist_ok=True, max_validators=self.n_validators,
                      max_uids=max(64, 2 * (self.stages * self.replicas + self.n_validators)))
        wallets = self.out / "wallets"
        self.val_wallets = [create_wallet(f"validator{v}", "default", wallets) for v in range(self.n_validators)]
        self.miner_wallets = {(s, r): create_wallet(f"miner-s{s}-r{r}", "default", wallets)
                              for s in range(self.stages) for r in range(self.replicas)}
        asyncio.run(self._register_all())
        for w in self.val_wallets:
            add_stake(self.chain_db, w.hotkey.ss58_address, w.coldkey.ss58_address, 1000.0, netuid=NETUID)
        self._make_children()

    async def _register_all(self) -> None:
        from iota_subnet.chain import open_chain
        chain = await open_chain("devnet", self.chain_db)
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

    def _miner_child(self, s: int, r: int, w) -> Child:
        name = f"miner-s{s}-r{r}"
        out = self.out / "miners" / name
        argv = [sys.executable, "-m", "iota_subnet.miner.main", *self._common(name), "--stage", str(s), "--out",
                str(out), "--no-register", "--data", str(self.data), "--link-control", str(out / "link-control.json"),
                "--allow-data-fallback", *self.extra_miner_args]
        if self.adversary_pos == (s, r):
            argv += ["--adversary", str(self.adversary)]
        return Child(name, "miner", argv, self.out / "logs" / f"{name}.log", out, stage=s)

    def _make_children(self) -> None:
        py = sys.executable
        for (s, r), w in self.miner_wallets.items():
            self.children.append(self._miner_child(s, r, w))
        for v, w in enumerate(self.val_wallets):
            name = f"validator{v}"
            out = self.out / "validators" / name
            argv = [py, "-m", "iota_subnet.validator.main", *self._common(name), "--out", str(out),
                    "--data", str(self.data), "--min-lanes", str(self.replicas), "--link-control",
                    str(out / "link-control.json"), "--allow-data-fallback", "--dashboard-port", "0",
                    *self.extra_validator_args]
            self.children.append(Child(name, "validator", argv, self.out / "logs" / f"{name}.log", out))

    # ---- processes -----------------------------------------------------------------------------
    def _env(self) -> dict:
        env = dict(os.environ)
        env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "IOTA_DIE_WITH_PARENT": "1",
                    "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"})
        env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2]) + os.pathsep + env.get("PYTHONPATH", "")
        return env

    def start(self, child: Child) -> None:
        child.out.mkdir(parents=True, exist_ok=True)
        logf = open(child.log, "ab")
        # a process group of its own: a terminal's SIGHUP (closed) or SIGINT (Ctrl-C) reaches only this
        # process, which stops every neuron in order and writes the summary (before, a closed terminal's
        # SIGHUP killed every neuron at once, with no checkpoint). Same session: if this process dies,
        # a neuron paused by chaos (SIGSTOP) gets SIGHUP and SIGCONT from the kernel (its group is
        # orphaned) and then its IOTA_DIE_WITH_PARENT SIGTERM; in a session of its own it stayed stopped
        child.proc = subprocess.Popen(child.argv, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      env=self._env(), process_group=0)
        logf.close()
        child.died_at = None
        child.started_at = time.monotonic()
        child.started_wall = time.time()

    # ---- fault injection (used by .chaos) ------------------------------------------------------
    def kill(self, child: Child) -> None:
        if child.alive():
            child.proc.send_signal(signal.SIGKILL)

    def pause(self, child: Child) -> None:
        if child.alive():
            child.proc.send_signal(signal.SIGSTOP)

    def resume(self, child: Child) -> None:
        if child.alive():
            child.proc.send_signal(signal.SIGCONT)

    def retire(self, child: Child) -> None:
        child.left = True
        if child.alive():
            child.proc.send_signal(signal.SIGTERM)

    def schedule_restart(self, child: Child, at: float) -> None:
        child.hold_until = at

    def set_link(self, child: Child, state: dict) -> None:
        """Partition (``{"down": true}``) or slow (``{"slow": factor}``) a neuron's links; ``{}`` heals.
        The neuron reads the file (``--link-control``) a few times a second."""
        atomic_write_text(child.out / "link-control.json", json.dumps(state))

    def add_miner(self, stage: int) -> Child:
        """A new miner registers mid-run on ``stage`` and starts (it syncs from its peers)."""
        from iota_subnet.wallets import create_wallet
        k = sum(1 for c in self.children if c.kind == "miner" and c.stage == stage)
        name = f"miner-s{stage}-r{k}"
        w = create_wallet(name, "default", self.out / "wallets")
        self.miner_wallets[(stage, k)] = w

        async def reg():
            from iota_subnet.chain import open_chain
            chain = await open_chain("devnet", self.chain_db)
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

    def stop_all(self, grace_s: float = 15.0) -> None:
        for c in self.children:
            if c.alive():
                c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for c in self.children:
            if c.proc is None:
                continue
            try:
                c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning(f"{c.name} did not stop in {grace_s:.0f}s: killing it")
                c.proc.kill()
                c.proc.wait()

    def miner(self, name: str) -> Child:
        return next(c for c in self.children if c.name == name)

    # ---- monitoring ----------------------------------------------------------------------------
    def validator_status(self) -> list[dict]:
        return [c.status() for c in self.children if c.kind == "validator"]

    def _supervise(self) -> None:
        now = time.monotonic()
        for c in self.children:
            if c.alive() or c.proc is None:
                continue
            if c.left:
                continue
            if c.died_at is None:
                c.died_at = now
                logger.warning(f"{c.name} exited with code {c.proc.returncode}; see {c.log}")
                if c.kind == "validator" and c.hold_until is None:
                    raise RuntimeError(f"{c.name} died (exit code {c.proc.returncode}); see {c.log}")
            elif c.hold_until is not None:
                if now >= c.hold_until:
                    c.hold_until = None
                    c.restarts += 1
                    logger.info(f"restarting {c.name} (restart #{c.restarts})")
                    self.start(c)
            elif self.restart_dead and c.kind == "miner" and now - c.died_at >= self.restart_delay_s:
                c.restarts += 1
                logger.info(f"restarting {c.name} (restart #{c.restarts})")
                self.start(c)

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
            from iota_subnet.chain import halt_devnet
            try:
                block = halt_devnet(self.chain_db)
                logger.info(f"devnet halted at block {block} (rerunning in {self.out} resumes it)")
            except Exception as e:  # noqa: BLE001 - never mask the run's own outcome
                logger.warning(f"could not halt the devnet: {e}")

    def _ready(self, st: list[dict]) -> int:
        """Neurons up: miners that serve (their status.json names a port), validators driving lanes."""
        n = sum(1 for s in st if s.get("lanes"))
        for c in self.children:
            if c.kind == "miner" and c.alive():
                n += bool(c.status().get("port"))
        return n

    def request_stop(self) -> None:
        """Ask a running :meth:`run` (in another thread) to stop early: it summarises and stops every process."""
        self._stop_requested.set()

    def _stop_on_signals(self) -> Callable[[], None]:
        """In the main thread, SIGTERM, SIGHUP and SIGINT (``kill``, a closed terminal, Ctrl-C) stop
        the run as :meth:`request_stop` does: every neuron is stopped (SIGTERM, then SIGKILL after 15 s)
        and the summary written. Before, they ended this process at once and left every miner and
        validator running, orphaned. A second Ctrl-C skips the summary (the neurons are still
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

    def _progress_line(self, st: list[dict]) -> str:
        live = sum(1 for c in self.children if c.kind == "miner" and c.alive())
        tok_s = sum(s.get("tokens_per_s") or 0 for s in st)
        losses = [s["loss"] for s in st if s.get("loss") is not None]
        loss = f"{sum(losses) / len(losses):.3f}" if losses else "-"
        reroutes = sum(s.get("reroutes", 0) for s in st)
        return (f"loss {loss} tok/s {tok_s:.0f} miners {live}/{self.stages * self.replicas} "
                f"reroutes {reroutes}")

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
        from iota_subnet.chain import metagraph_rows
        try:
            return asyncio.run(metagraph_rows(self.chain_db, NETUID))
        except Exception as e:  # noqa: BLE001 - a busy database is retried next second
            logger.debug(f"metagraph read failed: {e}")
            return []

    def adversary_uids(self) -> list[int]:
        if not self.adversary_pos:
            return []
        s, r = self.adversary_pos
        try:
            return [int(json.loads((self.miner(f"miner-s{s}-r{r}").out / "status.json").read_text())["uid"])]
        except (OSError, ValueError, KeyError, TypeError, StopIteration):
            return []

    # ---- results -------------------------------------------------------------------------------
    def summarize(self, wall_s: float) -> dict:
        st = self.validator_status()
        B, T = self.cfg.train.batch_size, self.cfg.data.seq_len
        rows = []
        for c in self.children:
            if c.kind == "validator" and (c.out / "metrics.jsonl").exists():
                for line in (c.out / "metrics.jsonl").read_text().splitlines():
                    try:
                        rows.append(json.loads(line))
                    except ValueError:
                        pass
        by_step: dict[int, list[dict]] = {}
        for r in rows:
            if r.get("loss") is not None:
                by_step.setdefault(int(r["step"]), []).append(r)
        n_lanes = max((len(v) for v in by_step.values()), default=0)
        metrics = []
        for k in sorted(by_step):
            rs = by_step[k]
            metrics.append({"step": k, "tokens": (k + 1) * B * T * n_lanes,
                            "loss": sum(r["loss"] for r in rs) / len(rs), "lr": rs[0].get("lr"),
                            "elapsed_s": max(r["elapsed_s"] for r in rs), "lanes": len(rs)})
        atomic_write_text(self.out / "metrics.jsonl", "".join(json.dumps(m) + "\n" for m in metrics))
        tokens = sum(s.get("tokens", 0) for s in st)
        train_s = max((s.get("train_s") or 0 for s in st), default=0) or None
        wire = sum(s.get("wire_bytes", 0) for s in st)
        validator_bytes = sum(s.get("validator_bytes", 0) for s in st)
        last = metrics[-10:]
        chain_rows = {r["uid"]: r for r in self.metagraph()}
        miners = []
        work: dict[int, dict] = {}
        for s in st:
            for u, m in (s.get("miners") or {}).items():
                w = work.setdefault(int(u), {"work": 0.0, "hotkey": m.get("hotkey"), "stage": m.get("stage")})
                w["work"] += float(m.get("work", 0))
        miner_bytes, busy, uptime = 0, [], []
        for c in self.children:
            if c.kind != "miner":
                continue
            try:
                ms = json.loads((c.out / "status.json").read_text())
            except (OSError, ValueError):
                ms = {}
            dp = ms.get("dataplane") or {}
            hop = dp.get("hop_client") or {}
            miner_bytes += int(hop.get("bytes_sent", 0)) + int(hop.get("header_bytes_sent", 0)) \
                + int(hop.get("bytes_received", 0)) + int(hop.get("header_bytes_received", 0))
            if ms.get("uptime_s"):
                busy.append(float(dp.get("busy_s", 0.0)))
                uptime.append(float(ms["uptime_s"]))
            uid = ms.get("uid")
            ch = chain_rows.get(uid, {})
            miners.append({"name": c.name, "uid": uid, "hotkey": ms.get("hotkey"), "stage": c.stage,
                           "work": work.get(uid, {}).get("work", 0.0), "inner_step": ms.get("inner_step"),
                           "incentive": ch.get("incentive", 0.0), "emission": ch.get("emission", 0.0),
                           "restarts": c.restarts, "merge": ms.get("merge"),
                           # mean over validators of the latest weight each set for this uid
                           "weight": (sum(float((v.get("last_weights") or {}).get(str(uid), 0.0)) for v in st)
                                      / len(st)) if st else 0.0,
                           "adversary": ms.get("adversary")})
        vals = [{"name": c.name, "uid": s.get("uid"), "hotkey": s.get("hotkey"),
                 "dividends": chain_rows.get(s.get("uid"), {}).get("dividends", 0.0),
                 "weights_set_blocks": s.get("weights_set_blocks", []), "val_loss": s.get("val_loss")}
                for c, s in zip([c for c in self.children if c.kind == "validator"], st)]
        val_losses = [s["val_loss"] for s in st if s.get("val_loss") is not None]
        summary = {
            "stages": self.stages, "replicas": self.replicas, "validators": self.n_validators, "steps": self.steps,
            "ended": self.ended, "steps_done": self._steps_done(st),
            "tokens": tokens, "tokens_per_s": tokens / train_s if train_s else None,
            "final_loss": sum(m["loss"] for m in last) / len(last) if last else None, "final_loss_window": 10,
            "val_loss": sum(val_losses) / len(val_losses) if val_losses else None,
            "wire_bytes": wire, "wire_bytes_per_token": wire / tokens if tokens else None,
            "validator_bytes": validator_bytes,
            "validator_bytes_per_token": validator_bytes / tokens if tokens else None,
            "miner_bytes": miner_bytes, "miner_bytes_per_token": miner_bytes / tokens if tokens else None,
            # mean over miners of compute-busy seconds / seconds of the run (status uptime)
            "stage_utilisation": (sum(b / max(train_s or u, 1e-9) for b, u in zip(busy, uptime)) / len(busy))
            if busy else None,
            "verification_bytes": sum(s.get("verification_bytes", 0) for s in st),
            "verification_bytes_by_path": dict(sum((Counter(s.get("verification_bytes_by_path") or {}) for s in st),
                                                   Counter())),
            "audits": audit_summary(st),
            "reroutes": sum(s.get("reroutes", 0) for s in st), "failures": sum(s.get("failures", 0) for s in st),
            "compression_ratio": self.cfg.pipeline.compression_ratio, "lanes": n_lanes,
            "miner_restarts": sum(c.restarts for c in self.children), "wall_s": round(wall_s, 1),
            "train_s": train_s,
            "merge": {"every_steps": self.cfg.merge.every_steps, "every_blocks": self.cfg.merge.every_blocks,
                      "merges_applied": sum((m.get("merge") or {}).get("merges", 0) for m in miners),
                      "mismatch_reports": sum((m.get("merge") or {}).get("mismatch_reports", 0) for m in miners)},
            "adversary": self.adversary, "adversary_uids": self.adversary_uids(),
            "link": self.link, "emulation": self.emulation,
            "miners": miners, "validators_detail": vals, "chain_db": str(self.chain_db),
        }
        if self.chaos is not None:
            summary["chaos"] = {**self.chaos.log.summary(), **self._sample_accounting()}
        write_summary(self.out / "summary.json", summary)
        return summary

    def _sample_accounting(self) -> dict:
        """From the validators' state: micro-batches lost, and samples (rows of ``(lane, step, index)``)
        trained more than once or never, over the steps driven (each lane's ``steps_done``; the whole
        ``--steps`` when the run finished). ``samples_unconfirmed``: samples counted trained on the
        head's word (its inner step was past them when a restarted validator resumed: trained with that
        validator's earlier tickets, whose receipts were lost), not by receipts."""
        from iota_subnet.validator.state import ValidatorState
        seen: dict[tuple, int] = {}
        lost = unconfirmed = 0
        for c in self.children:
            if c.kind != "validator" or not (c.out / "validator.sqlite").exists():
                continue
            st = ValidatorState(c.out / "validator.sqlite")
            try:
                for row in st.microbatch_log():
                    key = (row["lane"], row["step"], row["idx"])
                    if row["ok"]:
                        seen[key] = seen.get(key, 0) + 1
                        unconfirmed += not row["microbatch_id"]      # no ticket of its own: no receipts
                    else:
                        lost += 1
            finally:
                st.close()
        lanes = {k[0] for k in seen} or set(range(self.replicas))
        micro = self.cfg.train.batch_size // self.cfg.train.micro_batch
        # the steps each lane was driven through (all of them, unless the run was stopped early)
        driven: dict[int, int] = {}
        for st in self.validator_status():
            for lane, n in (st.get("steps_done") or {}).items():
                driven[int(lane)] = driven.get(int(lane), 0) + int(n)
        expected = {(l, k, m) for l in lanes for k in range(min(self.steps, driven.get(l, self.steps)))
                    for m in range(micro)}
        return {"microbatches_lost": lost,
                "samples_repeated": sum(n - 1 for n in seen.values() if n > 1) * self.cfg.train.micro_batch,
                "samples_skipped": len(expected - set(seen)) * self.cfg.train.micro_batch,
                "samples_unconfirmed": unconfirmed * self.cfg.train.micro_batch}


def emulation_argv(link: str, emulate_gpu: Optional[str], mfu: Optional[float], gpu_mem: Optional[float],
                   time_scale: float) -> tuple[str, Optional[dict], list[str], list[str]]:
    """Check ``--link`` / ``--emulate-gpu`` / ``--mfu`` / ``--gpu-mem`` / ``--time-scale`` (ConfigError) and
    turn them into (link, emulation summary or None, miner argv, validator argv). Emulated miners hold no
    weights, so the validator's replays and CLASP probes are turned off with them."""
    from iota_subnet.hardware import DEFAULT_MFU
    from iota_subnet.miner.emulated import emulation_from_args
    from iota_subnet.transport.shaping import parse_link
    spec = parse_link(link)
    emu = emulation_from_args(emulate_gpu, DEFAULT_MFU if mfu is None else mfu, time_scale, gpu_mem)
    if emu is None and (mfu is not None or gpu_mem is not None):
        raise ConfigError("--mfu and --gpu-mem describe an emulated GPU: add --emulate-gpu")
    if not time_scale > 0:
        raise ConfigError(f"--time-scale {time_scale!r} must be > 0")
    common = ["--link", str(spec), "--time-scale", repr(float(time_scale))]
    miner, validator = list(common), list(common)
    if emu is not None:
        miner += ["--emulate-gpu", str(emulate_gpu), "--mfu", repr(emu.mfu)]
        if gpu_mem is not None:
            miner += ["--gpu-mem", repr(float(gpu_mem))]
        validator += ["--clasp-interval", "0", "--no-audits"]
    return str(spec), (emu.to_json() if emu is not None else None), miner, validator


def run_localnet(**kw) -> dict:
    return LocalNet(**kw).run()
