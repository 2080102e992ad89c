"""Host memory, disk and device -> host traffic of one stage's miner (part of ``iota-subnet plan``).

Every holder of host memory a real miner has, in bytes, for a stage of P parameters (fp32 values),
the audit window K (inner steps and weights versions kept) and R replicas of the stage:

* **update store** (:mod:`iota_subnet.miner.update_store`, spilling): one step's copies until they are
  hashed and on disk: the state after the step and its gradient, ``16 P`` (``20 P`` after the weights
  were replaced: the weights before the step are copied again; ``28 P`` at a process's first step,
  when nothing else below is held yet), plus the Merkle trees of every kept copy (64 bytes per
  committed row or column). Disk: ``(16 K + 12) P``. Device -> host per inner step: ``16 P``;
* **hop store** (:mod:`iota_subnet.miner.hop_store`): weights versions are the update store's copies
  (shared, on disk) except the first after a weights replacement: ``4 P`` while it is hashed, then on
  disk; plus the hops it keeps (``max_hops`` micro-batches: received and sent wire tensors, the
  gradient received, bf16, ~6 tensors of ``rows x T x width``);
* **merge state, steady** (:mod:`iota_subnet.merge.engine`): anchor and outer momentum, ``8 P``; with
  ``merge.quantization: topk`` also the error feedback (``4 P``, :mod:`iota_subnet.merge.sparse`);
* **merge state, transient** (during a merge): the pseudo-gradient and its dequantized copy (one of
  them without payload quantization), the new anchor and momentum, the means of the two shards it
  reduces (``2 P / R``) and the streaming windows (``(STREAM_WINDOW + 1)`` chunks per contributor of
  each reduced shard); with ``merge.overlap`` also the weights read at the start (``4 P``); with
  ``topk`` the next error feedback while the attempt runs (``4 P``);
* **merge-audit copies** (:mod:`iota_subnet.merge.claims`): written straight to disk (``4 P (1 + 2 / R)``
  per kept merge epoch on disk, none in memory);
* **checkpoint snapshot** (:mod:`iota_subnet.miner.checkpoints`): with the update store on (a miner
  with audits), a checkpoint is written from the store's copies of the state after the last inner
  step (:class:`~iota_subnet.miner.step_state.StepState`, on disk once spilled), so it holds only the
  state the store does not copy: the stage's non-parameter state (buffers) and AdamW's ``step``
  counts (4 bytes per parameter tensor), ``≈ 0``; without the update store a
  :class:`~iota_subnet.train.snapshot.StateSnapshot` of weights and both moments, ``12 P``, while the
  checkpoint is written. Either way the file is written streamed (no serialised copy in memory);
* **sync donor snapshot** (:mod:`iota_subnet.merge.sync`): the merge anchor and momentum by
  reference (no bytes of its own; the pair it holds while a merge builds the next one is the
  transient's "new anchor and momentum"), plus, while a joiner fetches a snapshot a merge has
  replaced, that old anchor and momentum (``8 P``, at most one kept): counted in the peak; and the
  last :data:`REPLAY_MERGES` merges' mean pseudo-gradients in the gather's encoding, kept for
  replicas that replay them (:mod:`iota_subnet.merge.replay`; a sparse gather at its dense int8
  bound).

Peak: steady + checkpoint snapshot + the larger of the training phase (update store + hop store)
and the merge phase (merge transient), because the miner waits for the update store's last copies
to reach the disk before a merge starts (:meth:`~iota_subnet.miner.update_store.UpdateStore.settle`);
with ``merge.overlap`` training runs during the merge and the two phases are added; plus the sync
donor's replaced snapshot (a joiner may fetch one at any time).

Audit window: :data:`DEFAULT_AUDIT_WINDOW_S` seconds; versions ``K = max(2, ceil(window / step))``
for the stage's inner-step time on :data:`WINDOW_ACCELERATOR` at :data:`~iota_subnet.hardware.DEFAULT_MFU`.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

from iota_subnet.config import RunConfig, bottleneck_dims
from iota_subnet.hardware import GPUS, DEFAULT_MFU

#: The audit window validators can rely on, in seconds of training.
DEFAULT_AUDIT_WINDOW_S = 40.0
#: The device whose step time turns the window into versions when none is given.
WINDOW_ACCELERATOR = "h100"
#: Bytes of a Merkle tree per committed row or column (32-byte leaf + inner nodes).
TREE_BYTES_PER_ROW = 64
#: Hops a hop store keeps at most (:class:`~iota_subnet.miner.hop_store.HopStore` ``max_hops``).
HOP_STORE_MAX_HOPS = 1024
#: Chunks per contributor a reducer buffers beyond the one being reduced (:data:`iota_subnet.merge.engine.STREAM_WINDOW`).
MERGE_STREAM_WINDOW = 2
#: Merge epochs kept for merge audits (:data:`iota_subnet.protocol.audit.MERGE_AUDIT_KEEP_EPOCHS`).
MERGE_AUDIT_EPOCHS = 4
#: merges a sync donor keeps for replay (:data:`iota_subnet.merge.sync.REPLAY_KEEP`)
REPLAY_MERGES = 4
#: Device -> host copy rate assumed for costs (bytes/s): PCIe 4 x16 into pinned memory, 25 GB/s
#: (``scripts/bench_costs.py --pcie-gbps``; the emulated miners' modelled copies, :mod:`iota_subnet.sim.emulated_costs`).
PCIE_D2H_BYTES_PER_S = 25e9
#: Sustained disk write rate assumed for costs (bytes/s): one NVMe drive, 2 GB/s (``bench_costs.py --disk-gbps``).
DISK_WRITE_BYTES_PER_S = 2e9
#: sha256 throughput of one core assumed for costs (bytes/s; :mod:`iota_subnet.audit.merkle` says 1-2 GB/s).
SHA256_BYTES_PER_S = 1.5e9


def update_store_bytes(P: int, K: int) -> dict[str, int]:
    """The update store's bounds for P parameters and K kept steps (spilling; trees not included):
    host memory in steady training (``host``), after a weights replacement (``host_replaced``), at
    the first step (``host_first``), on disk (``disk``), device -> host per step (``d2h``), and
    without spilling (``host_unspilled``, all kept copies in memory)."""
    return {"host": 16 * P, "host_replaced": 20 * P, "host_first": 28 * P, "disk": (16 * K + 12) * P,
            "d2h": 16 * P, "host_unspilled": (16 * K + 12) * P}


def committed_rows(shapes: list[tuple[int, ...]]) -> tuple[int, int]:
    """(rows, columns) a commitment hashes: rows of every parameter (1-D: one), columns of matrices
    (the token embedding's too, an upper bound)."""
    rows = sum(int(s[0]) if len(s) >= 2 else 1 for s in shapes)
    cols = sum(int(s[1]) for s in shapes if len(s) >= 2)
    return rows, cols


def audit_window_versions(step_s: float, window_s: float = DEFAULT_AUDIT_WINDOW_S) -> int:
    """Versions (inner steps) that cover ``window_s`` seconds at ``step_s`` seconds per step (>= 2)."""
    return max(2, math.ceil(window_s / max(step_s, 1e-9)))


@dataclass(frozen=True)
class HostPlan:
    """Host bytes of one stage's miner (see the module docstring); all ``*_bytes`` in bytes."""

    audit_window_s: float
    audit_window_versions: int
    inner_step_s: float
    update_store_bytes: int
    update_store_unspilled_bytes: int
    hop_store_bytes: int
    merge_steady_bytes: int
    merge_transient_bytes: int
    merge_audit_bytes: int
    #: the checkpoint's own host copies: buffers + optimizer step counts with the update store on,
    #: ``12 P`` + those without (a host snapshot)
    checkpoint_snapshot_bytes: int
    sync_donor_bytes: int
    peak_bytes: int
    peak_unspilled_bytes: int
    disk_bytes: int
    d2h_bytes_per_step: int

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def host_plan(cfg: RunConfig, stage: int, P: int, shapes: list[tuple[int, ...]], train_flops_per_token: int, *,
              window_s: float = DEFAULT_AUDIT_WINDOW_S, versions: Optional[int] = None,
              replicas: int = 2, accelerator: str = WINDOW_ACCELERATOR, mfu: float = DEFAULT_MFU,
              state_extra_bytes: int = 0, update_store: bool = True) -> HostPlan:
    """The :class:`HostPlan` of ``stage`` (``P`` parameters of ``shapes``, ``train_flops_per_token``
    from :func:`iota_subnet.plan.stage_flops`). ``versions``: K (default: from ``window_s`` and the
    inner-step time on ``accelerator`` at ``mfu``); ``replicas``: R of the stage;
    ``state_extra_bytes``: bytes of the stage's state_dict entries that are not parameters (buffers);
    ``update_store``: checkpoints are written from the update store's copies (a miner with audits)."""
    acc = GPUS[accelerator]
    tokens = cfg.train.batch_size * cfg.data.seq_len
    step_s = tokens * train_flops_per_token / (acc.peak_flops * mfu)
    K = int(versions) if versions is not None else audit_window_versions(step_s, window_s)
    u = update_store_bytes(P, K)
    rows, cols = committed_rows(shapes)
    copies = 3 * (K + 1) + K                               # distinct copies of K kept steps
    trees = TREE_BYTES_PER_ROW * (copies * rows + 2 * (K + 1) * cols)
    update = u["host_replaced"] + trees
    width = bottleneck_dims(cfg.model, cfg.pipeline)[0] if cfg.pipeline.stages > 1 else cfg.model.dim
    hops = HOP_STORE_MAX_HOPS * 6 * cfg.train.micro_batch * cfg.data.seq_len * width * 2
    hop = 4 * P + hops
    R = max(1, int(replicas))
    m = cfg.merge
    if m.enabled:
        feedback = 4 * P if m.quantization == "topk" else 0
        steady = 8 * P + feedback
        quantized = m.quantization != "none"
        chunks = 2 * R * (MERGE_STREAM_WINDOW + 1) * m.chunk_numel * 4
        transient = (4 * P * (1 + int(quantized)) + 8 * P + 8 * P // R + chunks + (4 * P if m.overlap else 0)
                     + feedback)
        merge_audit = 0
        merge_disk = MERGE_AUDIT_EPOCHS * (4 * P + 8 * P // R)
        gather_bpv = {"none": 4.0, "bf16": 2.0}.get(m.gather_quant, 1.0 + 4.0 / max(1, m.int8_block))
        donor = 8 * P + int(REPLAY_MERGES * gather_bpv * P)
    else:
        steady = transient = merge_audit = merge_disk = donor = 0
    ckpt = int(state_extra_bytes) + 4 * len(shapes) + (0 if update_store else 12 * P)
    train_phase, merge_phase = update + hop, transient + merge_audit
    phases = train_phase + merge_phase if (m.enabled and m.overlap) else max(train_phase, merge_phase)
    peak = steady + ckpt + phases + donor
    unspilled = u["host_unspilled"] + trees + 4 * P + hops       # before spilling: all kept copies in memory
    merge_audit_unspilled = merge_disk
    peak_unspilled = steady + ckpt + unspilled + transient + merge_audit_unspilled + donor
    return HostPlan(audit_window_s=float(window_s), audit_window_versions=K, inner_step_s=step_s,
                    update_store_bytes=update, update_store_unspilled_bytes=u["host_unspilled"] + trees,
                    hop_store_bytes=hop, merge_steady_bytes=steady, merge_transient_bytes=transient,
                    merge_audit_bytes=merge_audit, checkpoint_snapshot_bytes=ckpt, sync_donor_bytes=donor,
                    peak_bytes=peak, peak_unspilled_bytes=peak_unspilled, disk_bytes=u["disk"] + merge_disk,
                    d2h_bytes_per_step=u["d2h"])
