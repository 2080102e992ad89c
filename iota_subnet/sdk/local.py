"""A :class:`~iota_subnet.sdk.spec.RunSpec` trained by a local network: :func:`launch_local` starts
:class:`~iota_subnet.network.localnet.LocalNet` (every miner and validator its own OS process, a devnet
chain) in a background thread and returns a :class:`LocalRun` to watch, wait for, stop and export.

The spec is written as ``OUT/spec.yaml`` (a config-object model as ``OUT/spec-model/``) and the network is
built from it, which loads and checks the config: an invalid spec raises there (ConfigError / DataError),
in the caller's thread, before any process starts. Progress is what the localnet's own progress line
reads (:meth:`~iota_subnet.network.localnet.LocalNet.progress_stats`: the validators' ``status.json``
and the miner processes).
"""
from __future__ import annotations

import atexit
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Union

from iota_subnet.config import ConfigError
from iota_subnet.hf.export import export_run
from iota_subnet.hf.runtime import evaluate_file
from iota_subnet.network.localnet import LocalNet

from .spec import RunSpec

#: Seconds an exiting script waits for the run's neurons to stop (SIGTERM, then SIGKILL after 15 s).
STOP_AT_EXIT_S = 60.0


@dataclass(frozen=True)
class MinerProgress:
    """One miner process: ``name`` (``miner-s<stage>-r<replica>``), ``stage``, ``uid`` on the devnet
    (None until it wrote its status), ``alive``, ``weight`` (mean over validators of the latest weight
    each set for the uid; 0 before any)."""

    name: str
    stage: int
    uid: Optional[int]
    alive: bool
    weight: float


@dataclass(frozen=True)
class RunProgress:
    """A snapshot of a local run. ``steps_done`` inner steps on the slowest lane of ``steps_total``;
    ``loss`` the validators' latest training loss (nats/token; None before the first step);
    ``tokens_per_s`` trained tokens per second (sum over validators); ``miners_live`` of
    ``miners_total``; ``reroutes``; ``miners``; ``running``; ``ended``: None while running, else the
    summary's ``ended`` (``done``, ``weights late``, ``stopped``) or ``failed: <error>``;
    ``elapsed_s`` wall seconds since launch."""

    steps_done: int
    steps_total: int
    loss: Optional[float]
    tokens_per_s: float
    miners_live: int
    miners_total: int
    reroutes: int
    miners: tuple[MinerProgress, ...]
    running: bool
    ended: Optional[str]
    elapsed_s: float


class LocalRun:
    """A local network training a spec in a background thread (see the module docstring). Started by
    :func:`launch_local`; ``net`` is the :class:`LocalNet`, ``out`` its folder, ``config_path`` the spec's YAML."""

    def __init__(self, net: LocalNet, spec: RunSpec, config_path: Path):
        self.net, self.spec, self.config_path = net, spec, config_path
        self.out = net.out
        self.summary: Optional[dict] = None
        self.error: Optional[BaseException] = None
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, name=f"localnet {self.out.name}", daemon=True)

    def _run(self) -> None:
        try:
            self.summary = self.net.run()
        except BaseException as e:  # noqa: BLE001 - kept for wait() to raise in the caller's thread
            self.error = e

    def start(self) -> "LocalRun":
        """Start the run's thread; a script that exits while the run goes on stops every neuron first
        (:meth:`_stop_at_exit`), so no miner or validator is left running without its parent."""
        self._t0 = time.monotonic()
        self._thread.start()
        atexit.register(self._stop_at_exit)
        return self

    def _stop_at_exit(self) -> None:
        if self.running:
            self.net.request_stop()
            self._thread.join(STOP_AT_EXIT_S)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def progress(self) -> RunProgress:
        """The run now (:class:`RunProgress`); cheap (reads a few small status files)."""
        running = self.running
        p = self.net.progress_stats()
        ended = None
        if not running:
            ended = f"failed: {self.error}" if self.error is not None else (self.summary or {}).get("ended")
        return RunProgress(
            steps_done=p["steps_done"], steps_total=p["steps"], loss=p["loss"], tokens_per_s=p["tokens_per_s"],
            miners_live=p["miners_live"], miners_total=p["miners_total"], reroutes=p["reroutes"],
            miners=tuple(MinerProgress(**m) for m in p["miners"]), running=running, ended=ended,
            elapsed_s=time.monotonic() - self._t0)

    def watch(self, interval_s: float = 5.0) -> Iterator[RunProgress]:
        """Snapshots every ``interval_s`` seconds until the run ends (the last one has ``ended`` set).
        Ctrl-C while watching stops the run (every neuron, summary written) and re-raises."""
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s!r}")
        try:
            while True:
                snap = self.progress()
                yield snap
                if not snap.running:
                    return
                self._thread.join(interval_s)
        except KeyboardInterrupt:
            self.stop()
            raise

    def wait(self, timeout_s: Optional[float] = None) -> dict:
        """Block until the run ends; returns its summary (``OUT/summary.json``). Raises TimeoutError when
        it is still running after ``timeout_s``, and whatever ended the run (e.g. a validator that died)."""
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"the local run in {self.out} is still running after {timeout_s} s; "
                               "call wait() again or stop()")
        if self.error is not None:
            raise self.error
        return self.summary

    def stop(self, timeout_s: Optional[float] = None) -> Optional[dict]:
        """Stop early: every neuron stops (SIGTERM, then SIGKILL), the summary is written (``ended``:
        ``stopped``) and returned. A run that never started its loop returns None."""
        self.net.request_stop()
        if not self._thread.ident:
            return None
        return self.wait(timeout_s)

    def export(self, out: Union[str, Path], *, merged: bool = True, lane: int = 0, force: bool = False) -> Path:
        """Write the trained model as a ``transformers`` folder (``AutoModelForCausalLM.from_pretrained(out)``),
        as ``iota-subnet export --run OUT --out out [--merged]`` does (:func:`~iota_subnet.hf.export.export_run`):
        ``merged`` each stage's merged weights, else replica ``lane`` of every stage. Returns ``out``.
        Raises ValueError while the run is going, ExportError / CheckpointError as the CLI."""
        if self.running:
            raise ValueError("the run is still going: wait() (or stop()) before exporting it")
        export_run(self.out, out, lane=lane, merged=merged, force=force)
        return Path(out)

    def evaluate(self, model_dir: Union[str, Path], *, rows: Optional[int] = None, device: Optional[str] = None) -> dict:
        """Held-out loss (nats/token) and perplexity of an exported folder on the spec's data, as
        ``iota-subnet eval`` (:func:`~iota_subnet.hf.runtime.evaluate_file`; default rows: the run's own
        final evaluation's). Raises ModelFolderError / DataError."""
        return evaluate_file(model_dir, str(self.spec.data.section()["hf"]["path"]), rows=rows, device=device)


def launch_local(spec: RunSpec, *, replicas: int = 2, validators: int = 1, out: Union[str, Path] = "runs/sdk",
                 steps: Optional[int] = None, **localnet) -> LocalRun:
    """Start a local network training ``spec``: ``spec.stages`` x ``replicas`` miners and ``validators``
    validators, ``steps`` inner steps (default ``spec.steps``), everything under ``out``; ``localnet``:
    other :class:`LocalNet` arguments (``block_time``, ``tempo``, ``timeout_s``, ``device``, ``link``, ...;
    ``progress`` is off unless given). Returns the started :class:`LocalRun`. Raises ConfigError /
    DataError for an invalid spec (nothing started; ``out/spec.yaml`` holds what was refused)."""
    steps = spec.steps if steps is None else steps
    if steps is None:
        raise ConfigError("the spec is open-ended (steps=None): give launch_local(..., steps=N)")
    for k in ("stages", "replicas", "validators", "config", "data", "steps", "out"):
        if k in localnet:
            raise ConfigError(f"launch_local sets {k!r} itself (from the spec and its own arguments)")
    out = Path(out).resolve()
    path = spec.save(out / "spec.yaml")
    net = LocalNet(stages=spec.stages, replicas=replicas, validators=validators, config=str(path), data=None,
                   steps=int(steps), out=out, **{"progress": False, **localnet})
    return LocalRun(net, spec, path).start()
