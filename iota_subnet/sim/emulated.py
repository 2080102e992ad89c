"""An emulated accelerator behind the :class:`~iota_subnet.miner.stage_worker.StageWorker` interface
(``--emulate-gpu a100|h100|4090|<FLOP/s>``): EMULATION, no training.

:class:`EmulatedStageWorker` holds no weights (its module lives on the ``meta`` device: shapes only).
A forward or backward returns tensors of the real shapes and wire dtype of the emulated config (so
the bytes on the wire are real) after sleeping as long as the stage would compute on the emulated
device: FLOPs of the stage for the micro-batch's tokens / (peak x MFU) x time scale, the backward
taking 2 x the forward plus, with activation checkpointing, the recomputed block forwards
(:func:`iota_subnet.plan.stage_timing`, the same figures as the bench's ``ideal_tokens_per_s``).
An inner step sleeps as long as a fused AdamW pass over the stage's state takes at the device's
memory bandwidth. The loss is ln(vocab), that of a uniform prediction: nothing learns.

A miner's entry point (``--emulate-gpu``) builds its service with :func:`emulated_parts`: the
:class:`~iota_subnet.miner.parts.MinerParts` whose worker is an :class:`EmulatedStageWorker`
(``has_weights`` False: the miner neither checkpoints its weights nor audits it) and whose merge
engine is a :class:`~iota_subnet.sim.virtual_merge.VirtualMergeEngine`: the stage merges with its
replicas at its real sizes, a small real proxy (``merge_module``, a
:class:`~iota_subnet.sim.virtual_merge.ProxyStage`) whose messages charge the emulated links the
bytes of the real stage (:mod:`iota_subnet.sim.virtual_merge` says what is virtual and modelled).

Beside compute, the update store (with ``--audit-window`` K > 0) and the checkpoint writes are
MODELLED (:mod:`iota_subnet.sim.emulated_costs`, virtual payloads: byte counts of the stage's real
sizes, nothing held, hashed or written): an inner step also waits for the previous step's modelled
hashing and spill and sleeps the device -> host copy of what the real store copies; a checkpoint
sleeps its snapshot on the compute thread and its sha256 + disk write on the writer thread. Their
counters are :meth:`EmulatedStageWorker.modelled` (``status.json``'s ``modelled``).

Memory is kept honest with the planner (:func:`iota_subnet.plan.plan_stage`, computed for the emulated
device): a stage that does not fit is refused at construction (:class:`~iota_subnet.config.ConfigError`
with the plan), and a forward that would hold more micro-batches in flight than fit is refused with
:class:`InFlightLimitExceeded` (``BUSY``, 503: retry after backwards have freed memory).

Sleeps block the calling thread (the miner's single compute thread, like a GPU stream). Only sleeping
and filling small tensors runs on the host, so many emulated miners share a few CPU cores; with
``time_scale`` > 1 everything (compute here, links in :mod:`iota_subnet.transport.shaping`) runs that
many times slower on the wall clock and ``busy_s`` / wall time stays the stage utilisation.
"""
from __future__ import annotations

import hashlib
import json
import math
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
from loguru import logger

from iota_subnet.config import ConfigError, RunConfig
from iota_subnet.hardware import DEFAULT_MFU, Accelerator, check_mfu, parse_accelerator
from iota_subnet.miner.parts import MinerParts
from iota_subnet.miner.stage_worker import UnknownMicrobatch
from iota_subnet.plan import StagePlan, meta_stage, require_fit, stage_flops, stage_timing
from iota_subnet.protocol import Outcome, ProtocolError
from iota_subnet.sim.emulated_costs import ModelledIo
from iota_subnet.utils.atomic import atomic_write_json

from .virtual_merge import MAX_PROXY, ProxyStage, VirtualMergeEngine, VirtualPayload
from .virtual_sync import make_virtual_snapshot_donor


class InFlightLimitExceeded(ProtocolError):
    """A forward would hold more micro-batches than the emulated device's memory allows (BUSY, 503)."""

    def __init__(self, stage: int, limit: int, plan: StagePlan):
        super().__init__(Outcome.BUSY, f"emulated stage {stage} already holds {limit} micro-batches in flight, all "
                                       f"that fit in {plan.gpu_mem_bytes / 2**30:.0f} GiB "
                                       f"({plan.activation_bytes_per_microbatch:,} B each); retry after a backward")
        self.limit = limit


class EmulationError(RuntimeError):
    """An operation that needs real weights (state snapshots, syncs) asked of an emulated stage."""


@dataclass(frozen=True)
class Emulation:
    """The emulated device, the MFU it is assumed to reach, and the wall-clock slow-down."""

    accelerator: Accelerator
    mfu: float = DEFAULT_MFU
    time_scale: float = 1.0
    #: the largest merge proxy (values) of an emulated stage (:class:`~iota_subnet.sim.virtual_merge.VirtualPayload`)
    max_proxy: int = MAX_PROXY

    def __post_init__(self):
        check_mfu(self.mfu)
        if not self.time_scale > 0:
            raise ConfigError(f"--time-scale {self.time_scale!r} must be > 0")
        if not (isinstance(self.max_proxy, int) and self.max_proxy >= 1):
            raise ConfigError(f"max_proxy {self.max_proxy!r} must be an integer >= 1")

    def to_json(self) -> dict:
        return {"emulation": True, "accelerator": self.accelerator.to_json(), "mfu": self.mfu,
                "time_scale": self.time_scale}

    def __str__(self) -> str:
        a = self.accelerator
        return (f"EMULATED {a.name} ({a.peak_flops / 1e12:.1f} TFLOP/s bf16 at MFU {self.mfu:g}, "
                f"{a.memory_bytes / 2**30:.0f} GiB), time scale x{self.time_scale:g}")


def emulation_from_args(gpu: Optional[str], mfu: float = DEFAULT_MFU, time_scale: float = 1.0,
                        gpu_mem_gib: Optional[float] = None) -> Optional[Emulation]:
    """``--emulate-gpu``, ``--mfu``, ``--time-scale``, ``--gpu-mem`` -> :class:`Emulation` (None without a GPU)."""
    if not gpu:
        return None
    return Emulation(parse_accelerator(gpu, gpu_mem_gib), mfu, time_scale)


@dataclass
class _InFlight:
    created: float
    tokens: int
    in_shape: tuple
    out_shape: tuple
    version: int
    step: int
    merges: int
    accumulate: bool = True


class EmulatedStore:
    """The micro-batches an emulated stage holds between forward and backward, with the bytes the
    plan says each keeps on the device. Same ``stats()`` / ``bytes`` / ``evictions`` as
    :class:`~iota_subnet.miner.activation_cache.ActivationCache`; entries expire after ``ttl_s``."""

    def __init__(self, bytes_per_entry: int, max_entries: int, ttl_s: float, clock: Callable[[], float]):
        self.bytes_per_entry, self.max_entries, self.ttl_s, self._clock = bytes_per_entry, max_entries, ttl_s, clock
        self._d: "OrderedDict[str, _InFlight]" = OrderedDict()
        self.evictions = {"ttl": 0, "bytes": 0, "replaced": 0}

    @property
    def bytes(self) -> int:
        return len(self._d) * self.bytes_per_entry

    def expire(self) -> None:
        now = self._clock()
        while self._d:
            k, e = next(iter(self._d.items()))
            if now - e.created <= self.ttl_s:
                break
            del self._d[k]
            self.evictions["ttl"] += 1

    def put(self, key: str, entry: _InFlight) -> None:
        self._d[key] = entry

    def pop(self, key: str) -> Optional[_InFlight]:
        return self._d.pop(key, None)

    def __len__(self) -> int:
        return len(self._d)

    def __contains__(self, key: str) -> bool:
        return key in self._d

    def stats(self) -> dict:
        return {"entries": len(self._d), "bytes": self.bytes, "max_bytes": self.max_entries * self.bytes_per_entry,
                "max_entries": self.max_entries, "ttl_s": self.ttl_s, "evictions": dict(self.evictions),
                "emulated": True}


class EmulatedStageWorker:
    """A stage on an emulated accelerator; the interface of :class:`StageWorker` (see the module docstring).

    ``wire_dtype``: dtype of the activations and gradients it returns (the wire format: bf16 by
    default). ``clock`` / ``sleep``: injectable for tests. ``audit_window``: the miner's
    ``--audit-window`` (K inner steps; 0: no update store), for the MODELLED update store and
    checkpoint writes (:attr:`io`, :mod:`iota_subnet.sim.emulated_costs`). Raises :class:`ConfigError`
    (with the plan table) when the stage does not fit the emulated device.
    """

    emulated = True
    #: no real weights: nothing to checkpoint or audit (merges run on the proxy, ``merge_module``)
    has_weights = False
    #: no update commitments (see StageWorker.updates)
    updates = None

    def __init__(self, cfg: RunConfig, stage: int, emulation: Emulation, *, total_steps: Optional[int] = None,
                 wire_dtype: torch.dtype = torch.bfloat16, ttl_s: float = 120.0, plan: Optional[StagePlan] = None,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                 audit_window: int = 0):
        self.cfg, self.stage, self.emulation = cfg, stage, emulation
        self.module = meta_stage(cfg, stage)                 # shapes only, no memory
        self.spec = self.module.spec
        acc = emulation.accelerator
        self.plan = plan if plan is not None else require_fit(cfg, stage, acc.memory_bytes,
                                                              device_name=f"the emulated {acc.name}")
        ckpt = self.plan.activation_checkpointing
        self.timing = stage_timing(stage_flops(cfg.model, cfg.pipeline, cfg.data.seq_len, stage),
                                   self.plan.params, acc, emulation.mfu, ckpt)
        self.wire_dtype = wire_dtype
        self.width_out = self.spec.out_width
        self.width_in = self.spec.in_width
        self._clock, self._sleep = clock, sleep
        self.cache = EmulatedStore(self.plan.activation_bytes_per_microbatch, self.plan.microbatches_in_flight_max,
                                   ttl_s, clock)
        self.micro_per_step = cfg.train.batch_size // cfg.train.micro_batch
        #: as StageWorker.auto_step: the data plane turns it off and calls :meth:`step` itself
        self.auto_step = True
        self.total_steps = int(total_steps or cfg.train.total_steps)
        self.inner_step = 0
        self.version = 0
        self.last_skip: tuple[int, int] = (0, 0)     # as StageWorker.last_skip
        self.recomputes = 0
        self.pending = 0
        self.forwards = self.backwards = 0
        self.tokens = 0
        self.trained_tokens = 0             # tokens accumulated into (emulated) weights: merge work
        self.lock = threading.RLock()
        self.last_weights_step = 0
        self.merges = 0
        self.last_weights_merges = 0
        self.precision = "bf16"
        self.busy_s = 0.0
        self.refused = 0
        self.loss = math.log(cfg.model.vocab_size)
        self.seq_len = cfg.data.seq_len
        #: as StageWorker.lane: the lane it trains in (never handed one: emulated stages take no lane over)
        self.lane: Optional[int] = None
        #: what merges read and write (None: the run does not merge): a proxy of the stage's parameters
        #: whose merge messages stand for the stage's real bytes (:mod:`iota_subnet.sim.virtual_merge`)
        self.merge_module: Optional[ProxyStage] = None
        #: the proxy's optimizer, for the interface only (a state sync clears its gradients; it never steps)
        self.opt: Optional[torch.optim.Optimizer] = None
        if cfg.merge.enabled:
            payload = VirtualPayload.for_stage(self.module.param_count(), cfg.merge, max_proxy=emulation.max_proxy,
                                               time_scale=emulation.time_scale)
            self.merge_module = ProxyStage(payload, seed=cfg.train.seed + 1000 * stage)
            self.opt = torch.optim.SGD(self.merge_module.parameters(), lr=0.0)
        #: MODELLED update store and checkpoint writes (virtual payloads of the stage's real sizes)
        self.io = ModelledIo(self.module, self.plan.params, int(audit_window))
        self._merges_at_step = 0            # weights replaced since the last step: merges != this

    # ---- time ----------------------------------------------------------------------------------
    def _compute(self, seconds: float) -> None:
        """Occupy the (emulated) device for ``seconds`` of emulated time."""
        wall = seconds * self.emulation.time_scale
        if wall > 0:
            self._sleep(wall)
        self.busy_s += wall

    def _now(self) -> float:
        """Emulated seconds (the clock / the time scale)."""
        return self._clock() / self.emulation.time_scale

    def _payload(self, mb_id: str, shape: tuple) -> torch.Tensor:
        h = hashlib.blake2b(mb_id.encode(), digest_size=2).digest()
        return torch.full(shape, (int.from_bytes(h, "big") % 2000 - 1000) / 1e4, dtype=self.wire_dtype)

    def _check_input(self, x: torch.Tensor) -> tuple[int, int]:
        if self.spec.is_head:
            if x.dtype not in (torch.int64, torch.int32) or x.dim() != 2:
                raise TypeError(f"stage 0 takes token ids (int64 [B, T]), got {x.dtype} {tuple(x.shape)}")
        elif x.dim() != 3 or x.shape[-1] != self.width_in:
            raise ValueError(f"stage {self.stage} takes activations [B, T, {self.width_in}], got {tuple(x.shape)}")
        B, T = int(x.shape[0]), int(x.shape[1])
        if T != self.seq_len:
            raise ValueError(f"stage {self.stage} emulates {self.seq_len}-token rows, got {T}")
        return B, T

    # ---- compute -------------------------------------------------------------------------------
    def forward(self, mb_id: str, x: torch.Tensor, targets: Optional[torch.Tensor] = None, *,
                train: bool = True, accumulate: bool = True) -> dict:
        """As :meth:`StageWorker.forward` (same shapes; activations in the wire dtype; with
        ``accumulate=False`` the backward computes only the input gradient). Raises
        :class:`InFlightLimitExceeded` when the micro-batch would not fit in the device's memory."""
        with self.lock:
            B, T = self._check_input(x)
            if self.spec.is_tail and targets is None:
                raise ValueError("the tail stage needs targets")
            tokens = B * T
            step, merges = self.inner_step, self.merges
            res: dict = {"weights_step": step, "weights_merges": merges, "emulated": True}
            if not train:
                self._compute(self.timing.forward_s * tokens)
                if self.spec.is_tail:
                    res["loss"] = self.loss
                else:
                    res["activations"] = self._payload(mb_id, (B, T, self.width_out))
                return res
            if self.spec.is_tail:       # forward, then its backward at once (as the real tail)
                self.forwards += 1
                back = self.timing.backward_s if accumulate else self.timing.input_backward_s
                self._compute((self.timing.forward_s + back) * tokens)
                res["loss"] = self.loss
                if not self.spec.is_head:
                    res["grad"] = self._payload(mb_id + "/grad", (B, T, self.width_in))
                if accumulate:
                    self._count_backward(tokens)
                else:
                    self.tokens += tokens
                return res
            self.cache.expire()
            replaced = self.cache.pop(mb_id) is not None        # a repeated forward replaces the held one
            if replaced:
                self.cache.evictions["replaced"] += 1
            if len(self.cache) >= self.cache.max_entries:
                self.refused += 1
                raise InFlightLimitExceeded(self.stage, self.cache.max_entries, self.plan)
            self._compute(self.timing.forward_s * tokens)
            self.forwards += 1
            out_shape = (B, T, self.width_out)
            self.cache.put(mb_id, _InFlight(self._clock(), tokens, tuple(x.shape), out_shape, self.version, step,
                                            merges, accumulate))
            res["activations"] = self._payload(mb_id, out_shape)
            return res

    def backward(self, mb_id: str, grad: torch.Tensor, accumulate: Optional[bool] = None) -> Optional[torch.Tensor]:
        """As :meth:`StageWorker.backward`: dL/d(input) [B, T, b] in the wire dtype, None for the head;
        ``accumulate=False`` overrides the forward's choice (input gradient only). Raises
        UnknownMicrobatch (never seen or expired) or ValueError (wrong gradient shape)."""
        with self.lock:
            self.cache.expire()
            entry = self.cache.pop(mb_id)
            if entry is None:
                raise UnknownMicrobatch(mb_id)
            if tuple(grad.shape) != entry.out_shape:
                self.cache.put(mb_id, entry)
                raise ValueError(f"gradient shape {tuple(grad.shape)} != activation shape {entry.out_shape}")
            if accumulate is False:
                entry.accumulate = False
            back = self.timing.backward_s if entry.accumulate else self.timing.input_backward_s
            seconds = back * entry.tokens
            if entry.version != self.version:       # weights changed: the real worker recomputes the forward
                self.recomputes += 1
                seconds += self.timing.forward_s * entry.tokens
                self.last_weights_step, self.last_weights_merges = self.inner_step, self.merges
            else:
                self.last_weights_step, self.last_weights_merges = entry.step, entry.merges
            self._compute(seconds)
            if entry.accumulate:
                self._count_backward(entry.tokens)
            else:                                   # served without training on it: input gradient only
                self.tokens += entry.tokens
            if self.spec.is_head:
                return None
            return self._payload(mb_id + "/grad", (entry.in_shape[0], entry.in_shape[1], self.width_in))

    def _count_backward(self, tokens: int) -> None:
        self.backwards += 1
        self.tokens += int(tokens)
        self.trained_tokens += int(tokens)
        self.pending += 1
        if self.auto_step and self.pending >= self.micro_per_step:
            self.step()

    def drop(self, mb_id: str) -> bool:
        """Forget a held micro-batch (it died downstream). True if one was held."""
        with self.lock:
            return self.cache.pop(mb_id) is not None

    def skip_to(self, step: int) -> int:
        """As :meth:`StageWorker.skip_to`: jump the inner step forward; returns the steps skipped."""
        with self.lock:
            skipped = max(0, int(step) - self.inner_step)
            if skipped:
                self.pending = 0
                # as the real store: a (skipped) commitment of the last step jumped over, MODELLED
                self._compute(self.io.before_step(self._now(), self.merges != self._merges_at_step, skipped=True))
                self.io.after_step(self._now())
                self._merges_at_step = self.merges
                self.last_skip = (self.inner_step, int(step))
                self.inner_step = int(step)
                self.version += 1
            return skipped

    def step(self) -> None:
        """One emulated inner optimizer step (memory-bound AdamW pass), with the MODELLED update
        store's wait and device -> host copies before it (:meth:`ModelledIo.before_step`); the merge
        proxy, when there is one, moves by a small draw seeded by the step and the tokens trained (a
        non-zero pseudo-gradient)."""
        with self.lock:
            self._compute(self.io.before_step(self._now(), self.merges != self._merges_at_step))
            self._compute(self.timing.step_s)
            if self.merge_module is not None:
                self.merge_module.drift(self.inner_step, tag=self.trained_tokens)
            self.io.after_step(self._now())
            self._merges_at_step = self.merges
            self.inner_step += 1
            self.version += 1
            self.pending = 0

    def weights_replaced(self) -> None:
        with self.lock:
            self.version += 1
            self.merges += 1

    # ---- state ---------------------------------------------------------------------------------
    def meta(self) -> dict:
        return {"step": self.inner_step, "merges": self.merges, "stage": self.stage, "forwards": self.forwards,
                "backwards": self.backwards, "tokens": self.tokens, "trained_tokens": self.trained_tokens,
                "busy_s": round(self.busy_s, 3),
                "emulated_busy_s": round(self.busy_s / self.emulation.time_scale, 3),
                "refused_in_flight": self.refused, "max_in_flight": self.cache.max_entries,
                "emulation": self.emulation.to_json(), "saved_at": time.time()}

    @staticmethod
    def _state_path(path: str | Path) -> Path:
        return Path(str(path) + ".emulated.json")

    def snapshot(self) -> dict:
        """As :meth:`StageWorker.snapshot`: what a checkpoint holds (here only the step counters), after
        the MODELLED snapshot's device -> host time on this (the compute) thread."""
        with self.lock:
            held = self.io.holds_state(self.merges != self._merges_at_step)
            s = self.io.checkpoints.snapshot(held)
            if s > 0:
                self._sleep(s * self.emulation.time_scale)
            return {**self.meta(), "modelled_from_update_store": held}

    def write_snapshot(self, snap: dict, path: str | Path) -> Path:
        """As :meth:`StageWorker.write_snapshot`: after the MODELLED write (wait for the update store's
        copies, sha256 and disk time of the real file's bytes; a sleep on the calling thread, the
        checkpoint writer's), atomically write a :meth:`snapshot` next to ``path``."""
        held = bool(snap.get("modelled_from_update_store"))
        s = self.io.checkpoints.write(self.io.seal_wait(self._now(), held))
        if s > 0:
            self._sleep(s * self.emulation.time_scale)
        return atomic_write_json(self._state_path(path), snap)

    def modelled(self) -> dict:
        """The MODELLED update store and checkpoints (:meth:`ModelledIo.status`), for ``status.json``."""
        return self.io.status(self._now())

    def save(self, path: str | Path) -> Path:
        """Atomically write the step counters (there are no weights) next to ``path``."""
        return self.write_snapshot(self.snapshot(), path)

    def load(self, path: str | Path) -> bool:
        """Resume the step counters saved by :meth:`save`. Returns True: an emulated stage has no
        weights to fetch from peers, whether or not counters were found."""
        p = self._state_path(path)
        if p.exists():
            try:
                meta = json.loads(p.read_text())
                with self.lock:
                    self.inner_step = int(meta["step"])
                    self.forwards, self.backwards = int(meta["forwards"]), int(meta["backwards"])
                    self.tokens = int(meta["tokens"])
                    self.trained_tokens = int(meta.get("trained_tokens", self.tokens))
                logger.info(f"emulated stage {self.stage}: resumed at inner step {self.inner_step}")
            except (ValueError, KeyError, TypeError) as e:
                logger.warning(f"ignoring emulated state {p}: {e}")
        return True

    def state_bytes(self, with_optimizer: bool = False) -> bytes:
        raise EmulationError("an emulated stage has no weights to snapshot")

    def describe(self) -> str:
        """One log line: what the emulated stage holds and how long a micro-batch takes."""
        toks = self.cfg.train.micro_batch * self.seq_len
        ckpt = "with" if self.plan.activation_checkpointing else "without"
        return (f"{self.emulation}: stage {self.stage}, {self.plan.params:,} params, up to {self.cache.max_entries} "
                f"micro-batches in flight ({ckpt} activation checkpointing), forward "
                f"{self.timing.forward_s * toks * 1e3:.1f} ms + backward {self.timing.backward_s * toks * 1e3:.1f} ms "
                f"per {toks}-token micro-batch (emulated time)")



def make_emulated_worker(cfg: RunConfig, stage: int, emulation: Emulation, *,
                         total_steps: Optional[int] = None, audit_window: int = 0) -> tuple[EmulatedStageWorker, int]:
    """An :class:`EmulatedStageWorker` and how many micro-batches it can keep waiting for their backward
    (its memory plan's bound). ``audit_window``: the miner's (K steps of the modelled update store).
    Raises :class:`ConfigError` when the stage does not fit the device."""
    w = EmulatedStageWorker(cfg, stage, emulation, total_steps=total_steps, audit_window=audit_window)
    logger.warning(f"EMULATION, no training: {w.describe()}")
    return w, w.cache.max_entries


def emulated_parts(emulation: Emulation) -> MinerParts:
    """The parts of a miner on the emulated accelerator ``emulation`` (``--emulate-gpu``): an
    :class:`EmulatedStageWorker` merged by a :class:`~iota_subnet.sim.virtual_merge.VirtualMergeEngine`
    (virtual payloads of the stage's real sizes) whose state sync donor is a
    :class:`~iota_subnet.sim.virtual_sync.VirtualSnapshotDonor`; its status says ``emulation``."""
    def make_worker(svc, stage: int) -> tuple[EmulatedStageWorker, int]:
        return make_emulated_worker(svc.cfg, stage, emulation, total_steps=svc.total_steps,
                                    audit_window=svc.audit_window)
    return MinerParts(make_worker=make_worker, make_merge_engine=VirtualMergeEngine,
                      make_snapshot_donor=make_virtual_snapshot_donor,
                      status={"emulation": emulation.to_json()})
