"""The ``merge`` section of a run config (:class:`MergeConfig`): merging the replicas of a stage
(:mod:`iota_subnet.merge`). Re-exported by :mod:`iota_subnet.config`; every error is a
:class:`~iota_subnet.errors.ConfigError` whose message says how to fix it.
"""
from __future__ import annotations

from dataclasses import dataclass

from iota_subnet.errors import ConfigError

MERGE_QUANTIZATIONS = ("none", "bf16", "int8", "topk")
#: ``merge.gather_quantization`` values besides ``same`` (``sparse``: the mean of top-k contributions).
GATHER_QUANTIZATIONS = ("none", "bf16", "int8", "sparse")


@dataclass(frozen=True)
class MergeConfig:
    """Merging the replicas of a stage (DiLoCo outer step over a butterfly all-reduce; see
    :mod:`iota_subnet.merge`).

    ``every_steps``: merge after every H inner steps (0: never by steps); ``every_blocks``: merge
    every M chain blocks (0: never by blocks). Both 0 turns merging off. On by default (H = 10): R
    replicas of a stage that never merge train R unrelated models.
    ``outer_lr`` / ``outer_momentum`` / ``nesterov``: the outer SGD applied to the mean pseudo-gradient.
    Default: plain averaging (lr 1.0, no momentum), measured better than the DiLoCo settings (arXiv
    2311.08105: lr 0.7, Nesterov momentum 0.9, tuned for H in the hundreds) with H = 10 and 15 merges
    on ``tiny``: val loss 5.635 vs 5.956 (docs/BENCHMARKS.md, "Merging").
    ``quantization``: merge payloads as ``none`` (fp32), ``bf16`` or ``int8`` (per-block absmax scales
    over ``int8_block`` values); accumulation is always fp32. ``gather_quantization``: the encoding of
    the reduced mean pseudo-gradient each reducer serves in the gather (``same``: as ``quantization``;
    or one of its values). A reducer rounds its mean to that encoding before its outer step and before
    hashing, so every replica applies the same rounded mean bit for bit (int8 gather: 1.02 bytes per
    value instead of 4).
    ``quantization: topk`` (SparseLoCo, arXiv 2508.15706; :mod:`iota_subnet.merge.sparse`): each
    replica sends, per block of ``topk_chunk`` values, the ``topk_density`` share of largest
    magnitudes (``k = round(density x chunk)``) as ``topk_bits``-bit codes, and keeps the rest in an
    error-feedback accumulator (``e = error_feedback x e + delta - sent``, per replica, across
    merges); the gather (``same``, or ``sparse``) serves the mean as int8 values with one scale per
    block, sparse or dense, whichever is smaller.
    ``join_timeout_s``: how long a replica waits at a merge boundary for its peers;
    ``phase_timeout_s``: the fixed part of each all-reduce phase's deadline, to which the time the
    phase's payload takes at a 64 kbit/s floor rate is added (:mod:`iota_subnet.merge.deadlines`: the
    transports report bytes as they move, so a transfer still moving is never cut; the deadline only
    bounds a peer that trickles); a transfer is cut when no byte of it moved for
    ``progress_timeout_s`` (default 10 s: a stopped or dead peer costs one progress timeout; a live
    one streaming a 4 MB chunk shows bytes every few hundred milliseconds whatever its rate).
    ``assumed_uplink_bps``: the declared uplink (default 10 Mbit/s), used only for a transport that
    reports no bytes inside a message (deadline ``phase_timeout_s + 2 x bytes / rate``). ``max_attempts``: tries per epoch before the
    merge is abandoned (retried next epoch). ``min_work_steps``: inner steps a replica must have done
    since the last merge to weigh in the mean by default. ``max_concurrent_transfers``: state-sync
    requests a donor serves at once (others get BUSY); ``sync_chunk_numel``: values per state-sync chunk;
    ``sync_window``: state-sync chunk requests a joiner keeps in flight over all its donors (each donor
    at most its ``max_concurrent_transfers``); to fetch at link rate it must cover the bandwidth-delay
    product, ``sync_window x 4 x sync_chunk_numel >= rate x round trip`` (docs/BENCHMARKS.md, "State
    sync at link rate").
    ``chunk_numel``: values per merge message (a shard travels as chunks of at most this many values,
    reduced as they stream in; a multiple of ``int8_block``). ``overlap``: keep training while the
    merge runs and apply the merged weights plus the local progress made meanwhile (the overlapped
    outer step of Streaming DiLoCo, arXiv 2501.18512, section 2.3); off, the replica's lane pauses for
    the merge.
    """

    every_steps: int = 10
    every_blocks: int = 0
    outer_lr: float = 1.0
    outer_momentum: float = 0.0
    nesterov: bool = True
    quantization: str = "none"
    gather_quantization: str = "same"
    int8_block: int = 256
    topk_density: float = 1 / 128
    topk_bits: int = 2
    topk_chunk: int = 4096
    error_feedback: float = 0.95
    join_timeout_s: float = 30.0
    phase_timeout_s: float = 30.0
    assumed_uplink_bps: float = 10e6
    progress_timeout_s: float = 10.0
    max_attempts: int = 2
    min_work_steps: int = 1
    max_concurrent_transfers: int = 2
    sync_chunk_numel: int = 1 << 20
    sync_window: int = 8
    chunk_numel: int = 1 << 22
    overlap: bool = False

    @property
    def enabled(self) -> bool:
        return self.every_steps > 0 or self.every_blocks > 0

    @property
    def gather_quant(self) -> str:
        """The gather's encoding: ``gather_quantization``, or ``quantization`` when that is ``same``."""
        if self.gather_quantization == "sparse" or (self.gather_quantization == "same" and self.quantization == "topk"):
            return f"sparse-{self.topk_chunk}"
        return self.quantization if self.gather_quantization == "same" else self.gather_quantization

    @property
    def topk_k(self) -> int:
        """Values sent per block of ``topk_chunk`` with ``quantization: topk``."""
        return max(1, min(self.topk_chunk, round(self.topk_density * self.topk_chunk)))

    @property
    def scatter_quant(self) -> str:
        """The scatter's wire mode (``MergePayload.quant``): ``quantization``, or for ``topk`` the mode
        naming k, block and bits (:func:`iota_subnet.merge.sparse.topk_mode`), so peers with other
        settings are refused."""
        if self.quantization == "topk":
            return f"topk-{self.topk_k}-{self.topk_chunk}-{self.topk_bits}"
        return self.quantization

    def validate(self) -> "MergeConfig":
        for k in ("every_steps", "every_blocks", "min_work_steps"):
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ConfigError(f"merge.{k} must be an integer >= 0 (0 = off), got {v!r}")
        if not (isinstance(self.outer_lr, (int, float)) and 0 < self.outer_lr <= 10):
            raise ConfigError(f"merge.outer_lr must be in (0, 10], got {self.outer_lr!r} (DiLoCo uses 0.7)")
        if not (isinstance(self.outer_momentum, (int, float)) and 0 <= self.outer_momentum < 1):
            raise ConfigError(f"merge.outer_momentum must be in [0, 1), got {self.outer_momentum!r} (DiLoCo uses 0.9)")
        if self.quantization not in MERGE_QUANTIZATIONS:
            raise ConfigError(f"merge.quantization {self.quantization!r} unknown; choose one of {list(MERGE_QUANTIZATIONS)}")
        if self.gather_quantization not in ("same",) + GATHER_QUANTIZATIONS:
            raise ConfigError(f"merge.gather_quantization {self.gather_quantization!r} unknown; choose one of "
                              f"{['same', *GATHER_QUANTIZATIONS]}")
        if not (isinstance(self.topk_density, (int, float)) and 0 < self.topk_density <= 1):
            raise ConfigError(f"merge.topk_density must be in (0, 1], got {self.topk_density!r} (SparseLoCo: 1/128 "
                              f"to 1/32)")
        if self.topk_bits not in (2, 4, 8):
            raise ConfigError(f"merge.topk_bits must be 2, 4 or 8, got {self.topk_bits!r}")
        if not (isinstance(self.error_feedback, (int, float)) and 0 <= self.error_feedback <= 1):
            raise ConfigError(f"merge.error_feedback must be in [0, 1] (the accumulator's decay), got "
                              f"{self.error_feedback!r}")
        if (not isinstance(self.topk_chunk, int) or isinstance(self.topk_chunk, bool)
                or not 16 <= self.topk_chunk <= 32767):
            raise ConfigError(f"merge.topk_chunk must be an integer in [16, 32767] (positions travel as int16), "
                              f"got {self.topk_chunk!r}")
        if not isinstance(self.int8_block, int) or self.int8_block < 16:
            raise ConfigError(f"merge.int8_block must be an integer >= 16, got {self.int8_block!r}")
        for k in ("join_timeout_s", "phase_timeout_s", "progress_timeout_s", "assumed_uplink_bps"):
            if not (isinstance(getattr(self, k), (int, float)) and getattr(self, k) > 0):
                raise ConfigError(f"merge.{k} must be a positive number (seconds, bit/s), got {getattr(self, k)!r}")
        for k in ("max_attempts", "max_concurrent_transfers", "sync_chunk_numel", "sync_window", "chunk_numel"):
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"merge.{k} must be an integer >= 1, got {v!r}")
        if self.chunk_numel % self.int8_block:
            raise ConfigError(f"merge.chunk_numel={self.chunk_numel} must be a multiple of merge.int8_block="
                              f"{self.int8_block} (e.g. {max(1, self.chunk_numel // self.int8_block) * self.int8_block})")
        if self.quantization == "topk" or self.gather_quantization == "sparse":
            if self.chunk_numel % self.topk_chunk:
                raise ConfigError(f"merge.chunk_numel={self.chunk_numel} must be a multiple of merge.topk_chunk="
                                  f"{self.topk_chunk} with quantization topk or gather_quantization sparse")
        return self
