"""What a pipeline stage is (:class:`StageSpec`), shared by the project's own stages
(:mod:`.stages`) and the ``transformers`` family stages (:mod:`.hf_pipeline`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class StageSpec:
    """What a stage is: its index, layer range, and the widths of what enters and leaves it."""

    index: int
    n_stages: int
    layers: range
    in_width: Optional[int]   # None for the head (token ids)
    out_width: Optional[int]  # None for the tail (loss)

    @property
    def is_head(self) -> bool:
        return self.index == 0

    @property
    def is_tail(self) -> bool:
        return self.index == self.n_stages - 1
