"""The block bookkeeping every model-based proposer shares (``draft_model``, ``eagle``,
``eagle3``): its own paged KV pool, blocks handed to requests from a free list and returned when a
request finishes, is preempted or is replaced.

Block 0 is the null block (padding rows' tables point at it); a request the pool cannot hold
gets no drafts that step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxserve.core.kv_cache_utils import cdiv


@dataclasses.dataclass
class DraftSeq:
    """One request as the proposer holds it: KV for positions < ``num_computed``, and the drafts
    fed after them (positions ``num_computed + j``), kept as far as the target accepts them."""

    blocks: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0
    fed: list[int] = dataclasses.field(default_factory=list)


def pow2_buckets(top: int, start: int = 1) -> list[int]:
    """``start, 2*start, ...`` below ``top``, then ``top``."""
    out, b = [], start
    while b < top:
        out.append(b)
        b *= 2
    return [*out, top]


class DraftBlockPool:
    """``num_blocks`` blocks of ``block_size`` tokens (block 0 never handed out); each request's
    table is ``max_blocks_per_seq`` wide."""

    def __init__(self, num_blocks: int, block_size: int, max_blocks_per_seq: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self._free = list(range(num_blocks - 1, 0, -1))
        self.seqs: dict[str, DraftSeq] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def free(self, req_id: str) -> None:
        """Forget a finished, preempted or replaced request; its blocks go back to the pool."""
        seq = self.seqs.pop(req_id, None)
        if seq is not None:
            self._free.extend(reversed(seq.blocks))

    def _reserve(self, seq: DraftSeq, num_tokens: int) -> bool:
        """Blocks for ``num_tokens`` positions; False (nothing taken) when the pool is short."""
        need = cdiv(num_tokens, self.block_size) - len(seq.blocks)
        if need > len(self._free):
            return False
        for _ in range(max(need, 0)):
            seq.blocks.append(self._free.pop())
        return True

    def _tables(self, req_ids: Sequence[str | None], rows: int) -> np.ndarray:
        """Block tables ``[rows, max_blocks_per_seq]``; a None or unknown request: the null block."""
        tables = np.zeros((rows, self.max_blocks_per_seq), np.int32)
        for i, r in enumerate(req_ids):
            seq = self.seqs.get(r) if r is not None else None
            if seq is not None:
                tables[i, :len(seq.blocks)] = seq.blocks
        return tables
