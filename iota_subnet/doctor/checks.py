"""The checks of ``iota-subnet doctor``: each returns :class:`Check` lines (PASS, WARN, FAIL or
SKIP, with what was seen and, unless PASS, how to fix it). :func:`run_checks` runs them in order;
checks that need an earlier result (the wallet, the chain) SKIP with the reason when it failed.

Memory (GPU, or RAM without one, against the chosen config): the plan of :mod:`iota_subnet.plan`
(the one ``iota-subnet plan`` prints and a CUDA miner enforces at start) for ``--stage`` or the stage
that needs the most memory.
"""
from __future__ import annotations

import asyncio
import importlib.metadata as md
import os
import shutil
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

PASS, WARN, FAIL, SKIP = "PASS", "WARN", "FAIL", "SKIP"


@dataclass
class Check:
    name: str
    status: str
    detail: str
    fix: str = ""

    def lines(self) -> list[str]:
        out = [f"{self.status:<5} {self.name:<13} {self.detail}"]
        if self.fix and self.status != PASS:
            out.append(f"{'':<5} {'':<13} fix: {self.fix}")
        return out


@dataclass
class DoctorOptions:
    network: str = "finney"
    chain_db: Optional[str] = None
    netuid: int = 9
    wallet_name: str = "default"
    wallet_hotkey: str = "default"
    wallet_path: str = "~/.bittensor/wallets"
    role: str = "miner"
    config: str = "configs/tiny.yaml"
    stage: Optional[int] = None
    data: Optional[str] = None
    cache_dir: Optional[str] = None
    out: str = "~/.iota-subnet"
    host: str = "0.0.0.0"
    port: int = 0
    external_ip: Optional[str] = None
    peers: list[str] = field(default_factory=list)
    bandwidth_bytes: int = 4 << 20


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


# ---------------------------------------------------------------------------------- environment
def check_python() -> Check:
    v = sys.version_info
    if v >= (3, 11):
        return Check("python", PASS, f"{sys.version.split()[0]} ({sys.executable})")
    return Check("python", FAIL, f"{sys.version.split()[0]} is older than 3.11",
                 "install Python 3.11 and recreate the environment (make setup)")


def check_packages() -> Check:
    from packaging.requirements import Requirement
    try:
        reqs = md.requires("iota-subnet") or []
    except md.PackageNotFoundError:
        return Check("packages", FAIL, "iota-subnet is not installed in this environment", "pip install -e .")
    bad, seen = [], []
    for raw in reqs:
        r = Requirement(raw)
        if r.marker is not None and not r.marker.evaluate({"extra": ""}):
            continue
        try:
            v = md.version(r.name)
        except md.PackageNotFoundError:
            bad.append(f"{r.name} missing")
            continue
        if r.specifier and not r.specifier.contains(v, prereleases=True):
            bad.append(f"{r.name} {v} (needs {r.specifier})")
        if r.name in ("torch", "bittensor", "transformers"):
            seen.append(f"{r.name} {v}")
    try:
        import torch
        seen.append(f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU build of torch")
    except ImportError:
        pass
    if bad:
        return Check("packages", FAIL, "; ".join(bad), "pip install -e . (inside this virtual environment)")
    return Check("packages", PASS, f"{len(reqs)} requirements met; " + ", ".join(seen))


def memory_plan(cfg: Any, stage: Optional[int], mem_bytes: int) -> Any:
    """The :class:`iota_subnet.plan.StagePlan` on ``mem_bytes`` of ``stage``, or of the stage that
    needs the most memory (built on the meta device: nothing is allocated)."""
    from iota_subnet.plan import plan_stage
    stages = [int(stage)] if stage is not None else range(cfg.pipeline.stages)
    return max((plan_stage(cfg, s, mem_bytes) for s in stages), key=lambda p: p.total_bytes)


def _ram_bytes() -> Optional[int]:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _ram_available_bytes() -> Optional[int]:
    """``MemAvailable`` of /proc/meminfo (bytes): what a new process can use without swapping."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None             # no /proc (not Linux): the check falls back to installed RAM
    return None


def check_compute(o: DoctorOptions, cfg: Any) -> list[Check]:
    if cfg is None:
        return [Check("gpu", SKIP, "no usable config (see the config line)")]
    if o.role == "validator":
        return [Check("gpu", SKIP, "validators hold no weights: no GPU needed")]
    import torch
    fix = ("turn on train.activation_checkpointing, use more pipeline stages or a smaller micro_batch_size, or a "
           "device with more memory (`iota-subnet plan` shows the table)")
    if torch.cuda.is_available():
        i = torch.cuda.current_device()
        total = torch.cuda.get_device_properties(i).total_memory
        p = memory_plan(cfg, o.stage, total)
        return [Check("gpu", PASS if p.fits else FAIL,
                      f"{torch.cuda.get_device_name(i)} with {_gib(total)}; stage {p.stage} of {cfg.model.name} "
                      f"({p.params / 1e6:.1f}M parameters) plans {_gib(p.total_bytes)}, up to "
                      f"{p.microbatches_in_flight_max} micro-batches in flight (needs {p.microbatches_in_flight_needed})",
                      fix)]
    out = []
    ram = _ram_bytes()
    p = memory_plan(cfg, o.stage, ram or (1 << 40))
    plan = (f"stage {p.stage} of {cfg.model.name}: {p.params / 1e6:.1f}M parameters, plans {_gib(p.total_bytes)} "
            "on a GPU (CUDA reserve included)")
    out.append(Check("gpu", SKIP, "no CUDA GPU visible (torch.cuda.is_available() is False): training runs on the "
                     f"CPU, which suits only tiny or small configs; {plan}",
                     "on a GPU host install a CUDA build of torch (TORCH_SPEC=torch make setup)"))
    if ram is not None:
        need = p.total_bytes - p.reserve_bytes          # no CUDA context on the CPU
        free = _ram_available_bytes()
        have = ram if free is None else free
        st = PASS if have >= need * 1.5 else (WARN if have >= need else FAIL)
        out.append(Check("memory", st, f"{_gib(ram)} RAM" + ("" if free is None else f", {_gib(free)} available now")
                         + f", for a CPU plan of {_gib(need)}",
                         fix + "; or stop what holds the memory now" if free is not None and free < need <= ram
                         else fix))
    return out


def check_disk(o: DoctorOptions, cfg: Any) -> Check:
    p = Path(o.out).expanduser()
    while not p.exists() and p != p.parent:
        p = p.parent
    free = shutil.disk_usage(p).free
    need = 2 << 30
    if cfg is not None and o.role == "miner":
        params = memory_plan(cfg, o.stage, 1 << 40).params
        need += params * (12 * 2 + 8)      # checkpoint (weights + Adam) twice during a write, merge state
    st = PASS if free >= 2 * need else (WARN if free >= need else FAIL)
    return Check("disk", st, f"{_gib(free)} free at {p} (needs ~{_gib(need)} for checkpoints and caches)",
                 f"free space under {p} or pass --out on a larger disk")


def load_run_config(o: DoctorOptions) -> tuple[Any, Check]:
    from iota_subnet.config import ConfigError, load_config
    try:
        cfg = load_config(o.config)
    except ConfigError as e:
        return None, Check("config", FAIL, str(e), "pass --config with the run's YAML config")
    except OSError as e:
        return None, Check("config", FAIL, f"{o.config}: {e}", "pass --config with the run's YAML config")
    return cfg, Check("config", PASS, f"{o.config}: model {cfg.model.name}, {cfg.pipeline.stages} stages, "
                      f"ratio {cfg.pipeline.compression_ratio}")


def check_data(o: DoctorOptions, cfg: Any) -> Check:
    if cfg is None:
        return Check("data", SKIP, "no usable config")
    if not o.data:
        return Check("data", SKIP, "no --data given: pass the run's text source to check the tokenizer and data "
                     "fingerprints")
    from iota_subnet.data import DataError, build_dataset, describe
    try:
        t0 = time.monotonic()
        tok, ds = build_dataset(cfg.data, o.data, Path(o.cache_dir) if o.cache_dir else None)
    except DataError as e:
        return Check("data", FAIL, str(e), "fix --data (a .txt/.jsonl/.parquet file or folder, hf://...)")
    return Check("data", PASS, f"tokenizer {tok.name} fingerprint {tok.fingerprint} ({tok.vocab_size} ids); data "
                 f"{describe(ds.spec)}: {ds.n_tokens:,} tokens, {ds.n_train_rows} train / {ds.n_val_rows} held-out "
                 f"rows ({time.monotonic() - t0:.1f} s); peers of the run must show the same fingerprint")


def check_wallet(o: DoctorOptions) -> tuple[Any, Check]:
    from iota_subnet.wallets import WalletError, load_wallet
    base = Path(o.wallet_path).expanduser() / o.wallet_name
    if not base.is_dir():
        return None, Check("wallet", FAIL, f"no wallet {o.wallet_name!r} under {Path(o.wallet_path).expanduser()}",
                           f"btcli wallet new_coldkey --wallet {o.wallet_name} (or pass --wallet-name / "
                           "--wallet-path of an existing wallet)")
    try:
        w = load_wallet(o.wallet_name, o.wallet_hotkey, o.wallet_path)
    except WalletError as e:
        return None, Check("wallet", FAIL, str(e).split("; ")[0], str(e).split("; ", 1)[-1])
    cold = base / "coldkeypub.txt"
    note = "" if cold.exists() else " (no coldkeypub.txt: coldkey-signed commands will ask for the coldkey)"
    return w, Check("wallet", PASS, f"{o.wallet_name}/{o.wallet_hotkey}: hotkey {w.hotkey.ss58_address}{note}")


def check_external_address(o: DoctorOptions) -> Check:
    """The --external-ip the neuron would publish: refused off the devnet when no one could reach it."""
    from iota_subnet.config import ConfigError
    from iota_subnet.neuron_common import check_external_ip
    try:
        ip = check_external_ip(o.network, o.external_ip)
    except ConfigError as e:
        return Check("external-ip", FAIL, str(e).split("; ")[0], "; ".join(str(e).split("; ")[1:]))
    return Check("external-ip", PASS, f"{ip} (published on {o.network})")


def check_port(o: DoctorOptions, own_axon: Optional[str]) -> Check:
    if not o.port:
        return Check("port", SKIP, "--port 0 (any free port) always binds; miners publish a fixed port",
                     "pass the --port you will serve on")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((o.host, o.port))
            return Check("port", PASS, f"{o.host}:{o.port} is free")
        except OSError as e:
            ext = o.external_ip or "127.0.0.1"
            if own_axon and own_axon.endswith(f":{o.port}"):
                return Check("port", PASS, f"{o.host}:{o.port} is in use by this hotkey's running neuron "
                             f"(served on chain as {own_axon})")
            return Check("port", FAIL, f"{o.host}:{o.port} is in use ({e.strerror}) and not by this hotkey's "
                         f"neuron at {ext}:{o.port}", "stop what uses it or choose another --port")


# ---------------------------------------------------------------------------------- chain
async def chain_checks(o: DoctorOptions, wallet: Any) -> tuple[list[Check], Optional[str], list[str]]:
    """Chain reachability and latency, registration, stake / permit, clock skew. Returns the
    checks, this hotkey's served axon (or None) and the other neurons' served endpoints."""
    from bittensor import http_auth

    from iota_subnet.chain import ChainError
    from iota_subnet.entry.chain import open_network_chain
    out: list[Check] = []
    t0 = time.perf_counter()
    try:
        chain = await asyncio.wait_for(open_network_chain(o.network, o.chain_db), timeout=30)
        block = await asyncio.wait_for(chain.block(), timeout=30)
    except (ChainError, OSError, asyncio.TimeoutError, Exception) as e:  # noqa: BLE001 - any failure means unreachable
        out.append(Check("chain", FAIL, f"{o.network}: unreachable ({type(e).__name__}: {e})"[:300],
                         "check --network (finney, test, local, ws://host:port, or devnet with --chain-db) and "
                         "the connection"))
        for n in ("registration", "stake", "clock"):
            out.append(Check(n, SKIP, "needs the chain"))
        return out, None, []
    try:
        lat = time.perf_counter() - t0
        t1 = time.perf_counter()
        await chain.block()
        rtt = time.perf_counter() - t1
        st = PASS if rtt < 1.0 else WARN
        out.append(Check("chain", st, f"{o.network}: block {block}, read latency {rtt * 1e3:.0f} ms "
                         f"(connect {lat * 1e3:.0f} ms)", "use a closer subtensor endpoint (--network ws://...)"))
        own_axon, peers = None, []
        try:
            graph = await chain.metagraph(o.netuid)
        except ChainError as e:
            out.append(Check("registration", FAIL, str(e), f"check --netuid ({o.netuid})"))
            graph = None
        hk = wallet.hotkey.ss58_address if wallet is not None else None
        if graph is not None:
            me = next((n for n in graph.neurons if n.hotkey == hk), None) if hk else None
            from iota_subnet.chain.interface import served_endpoint
            peers = [e for n in graph.neurons if n.hotkey != hk and (e := served_endpoint(n.axon))]
            if wallet is None:
                out.append(Check("registration", SKIP, "needs the wallet"))
                out.append(Check("stake", SKIP, "needs the wallet"))
            elif me is None:
                out.append(Check("registration", FAIL, f"hotkey {hk} is not registered on netuid {o.netuid} "
                                 f"({o.network})", f"iota-subnet register --netuid {o.netuid} --wallet-name "
                                 f"{o.wallet_name} --wallet-hotkey {o.wallet_hotkey} --network {o.network}"))
                out.append(Check("stake", SKIP, "needs a registered hotkey"))
            else:
                own_axon = served_endpoint(me.axon)
                out.append(Check("registration", PASS, f"uid {me.uid} on netuid {o.netuid}"
                                 + (f", serving {own_axon}" if own_axon else ", no axon served yet")))
                stake = me.total_stake.rao / 1e9
                if o.role == "validator":
                    st = PASS if bool(me.validator_permit) else FAIL
                    out.append(Check("stake", st, f"{stake:,.2f} staked; validator permit: "
                                     f"{'yes' if me.validator_permit else 'no'}",
                                     "stake to this hotkey (btcli stake add) until it is among the top validators "
                                     "by stake, then wait for the next epoch"))
                else:
                    out.append(Check("stake", PASS, f"{stake:,.2f} staked (miners need no stake)"))
        try:
            ts = await chain.timestamp()
            bt_s = await chain.block_seconds()
            skew = time.time() - ts - bt_s / 2      # the head block's time lags ours by up to a block time
            allowed = http_auth.DEFAULT_ALLOWED_SKEW
            st = PASS if abs(skew) <= allowed + bt_s / 2 else (WARN if abs(skew) <= 30 else FAIL)
            out.append(Check("clock", st, f"{skew:+.2f} s against chain time (head block {ts:.1f}, block time "
                             f"{bt_s:g} s; signed requests allow {allowed:g} s)",
                             "synchronise the clock (systemd-timesyncd or chrony)"))
        except NotImplementedError as e:
            out.append(Check("clock", SKIP, str(e)))
        return out, own_axon, peers
    finally:
        await chain.close()


# ---------------------------------------------------------------------------------- peers
def _is_local(endpoint: str) -> bool:
    host = endpoint.rpartition(":")[0].strip("[]")
    return host in ("127.0.0.1", "localhost", "::1") or host.startswith("127.")


async def peer_checks(o: DoctorOptions, discovered: list[str]) -> list[Check]:
    from iota_subnet.transport.probe import ask_reach, measure_bandwidth
    explicit = list(o.peers)
    peers = explicit or [p for p in discovered if not _is_local(p)]
    if not peers:
        why = ("the only peers on chain are on this machine (127.0.0.1): reachability from outside and bandwidth "
               "cannot be measured here" if discovered else "no peer to ask (none serves on chain)")
        return [Check("reachability", SKIP, why, "pass --peer HOST:PORT of a running neuron elsewhere"),
                Check("bandwidth", SKIP, why, "pass --peer HOST:PORT of a running neuron elsewhere")]
    out = []
    if not o.port:
        out.append(Check("reachability", SKIP, "--port 0: nothing fixed to reach", "pass --port"))
    else:
        server = None
        try:
            try:
                server = await asyncio.start_server(lambda r, w: w.close(), o.host, o.port)
            except OSError:
                server = None          # in use: by our running neuron (see the port line); ask about it
            res, errors = None, []
            for p in peers[:3]:
                try:
                    res = await ask_reach(p, o.port)
                    break
                except Exception as e:  # noqa: BLE001 - try the next peer
                    errors.append(f"{p}: {type(e).__name__}: {e}")
            if res is None:
                out.append(Check("reachability", SKIP, "no peer answered /ops/reach (" + "; ".join(errors)[:200] + ")",
                                 "pass --peer HOST:PORT of a running neuron"))
            elif res.get("reachable"):
                seen = res.get("address", "")
                note = ""
                if o.external_ip and not seen.startswith(o.external_ip + ":"):
                    note = f"; the peer sees you as {seen}, --external-ip says {o.external_ip}"
                out.append(Check("reachability", WARN if note else PASS,
                                 f"reachable directly: {p} reached {seen}{note}",
                                 "publish the address peers see (--external-ip)"))
            else:
                out.append(Check("reachability", FAIL,
                                 f"relay only: {p} could not reach {res.get('address')} ({res.get('error')}); behind a "
                                 "NAT or a firewall, a miner started with --relay auto is reached through the run's "
                                 "relays (it opens no port)",
                                 f"forward TCP port {o.port} on the router to this machine (and open it in the "
                                 "firewall) to be dialled directly, or start the miner with --relay auto"))
        finally:
            if server is not None:
                server.close()
                await server.wait_closed()
    try:
        b = await measure_bandwidth(peers[0], o.bandwidth_bytes)
        st = PASS if b["mbit_s"] >= 10 else WARN
        out.append(Check("bandwidth", st, f"from {peers[0]}: {b['mbit_s']:.1f} Mbit/s ({b['bytes']:,} B in "
                         f"{b['seconds']:.2f} s), round trip {b['rtt_ms']:.0f} ms",
                         "a faster link, or a higher compression ratio (fewer bytes per activation)"))
    except Exception as e:  # noqa: BLE001
        out.append(Check("bandwidth", SKIP, f"{peers[0]} did not serve /ops/bandwidth ({type(e).__name__}: {e})"[:250],
                         "pass --peer HOST:PORT of a running neuron"))
    return out


# ---------------------------------------------------------------------------------- all
def run_checks(o: DoctorOptions) -> list[Check]:
    checks = [check_python(), check_packages()]
    cfg, c = load_run_config(o)
    checks.append(c)
    checks += check_compute(o, cfg)
    checks.append(check_disk(o, cfg))
    wallet, c = check_wallet(o)
    checks.append(c)

    async def network() -> tuple[list[Check], Optional[str], list[str]]:
        cs, own, peers = await chain_checks(o, wallet)
        cs.append(check_external_address(o))
        cs.append(check_port(o, own))
        cs += await peer_checks(o, peers)
        return cs, own, peers

    cs, _, _ = asyncio.run(network())
    checks += cs
    checks.append(check_data(o, cfg))
    return checks
