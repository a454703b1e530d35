"""The worker's persistent block table, as vLLM v1's InputBatch keeps it: one int32 row per live sequence slot.

Rebuilding a step's [B, max_blocks_per_seq] table from every sequence's Python list cost O(context) per step
(7 ms at batch 256 and 32k tokens on the dev VM). Here a plan's diff writes only what changed (a new
sequence's blocks once, a continuing one's new block ids), and a step takes its rows from this table with one
slice (its slots contiguous, the common case: live sequences keep the lowest free slots) or one fancy index.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence as Seq

import numpy as np

from infer_worker.domain.sequence import ScheduledSeq, Sequence


class BlockTable:
    """Rows of block ids (-1 past a sequence's blocks), one per live sequence; `Sequence.slot` names its row.

    A free row is all -1, so `add` writes only the new sequence's blocks. The table grows (rows doubled, columns
    to the widest sequence or `reserve`) instead of taking limits the worker service does not know."""

    def __init__(self, max_blocks_per_seq: int = 0, rows: int = 64) -> None:
        self.blocks = np.full((rows, max_blocks_per_seq), -1, dtype=np.int32)
        self.num_blocks = np.zeros(rows, dtype=np.int64)
        self._owner: list[Sequence | None] = [None] * rows
        self._free = list(range(rows))  # a heap: the lowest free slot first keeps live rows packed (contiguous)
        # When each row last changed (add / append): a device copy of the table sends only rows newer than its own.
        self.version = np.zeros(rows, dtype=np.int64)
        self._clock = 0

    @property
    def num_live(self) -> int:
        return len(self._owner) - len(self._free)

    def holds(self, seq: Sequence) -> bool:
        return 0 <= seq.slot < len(self._owner) and self._owner[seq.slot] is seq

    def add(self, seq: Sequence) -> None:
        """Give `seq` a fresh row holding its block ids (a re-admitted sequence is a new Sequence: a new row)."""
        if self.holds(seq):
            raise ValueError(f"sequence {seq.seq_id} already holds row {seq.slot}")
        if not self._free:
            self._grow_rows()
        slot = heapq.heappop(self._free)
        n = len(seq.block_ids)
        self.reserve(n)
        self.blocks[slot, :n] = seq.block_ids
        self.num_blocks[slot] = n
        self._owner[slot] = seq
        seq.slot = slot
        self._touch(slot)

    def append(self, seq: Sequence, block_ids: Seq[int]) -> None:
        """Write the blocks `seq` just got after those its row holds."""
        k = len(block_ids)
        if not k:
            return
        slot = seq.slot
        if not self.holds(seq):
            raise ValueError(f"sequence {seq.seq_id} holds no row of this table")
        n = int(self.num_blocks[slot])
        self.reserve(n + k)
        self.blocks[slot, n:n + k] = block_ids
        self.num_blocks[slot] = n + k
        self._touch(slot)

    def _touch(self, slot: int) -> None:
        self._clock += 1
        self.version[slot] = self._clock

    def remove(self, seq: Sequence) -> None:
        """Free the row of a finished, aborted, preempted or failed sequence (nothing if it holds none)."""
        if not self.holds(seq):
            return
        slot = seq.slot
        self.blocks[slot, :self.num_blocks[slot]] = -1
        self.num_blocks[slot] = 0
        self._owner[slot] = None
        heapq.heappush(self._free, slot)
        seq.slot = -1

    def reserve(self, width: int) -> None:
        """At least `width` columns (a copy of the table when it widens; after the first step only on errors)."""
        rows, cols = self.blocks.shape
        if width <= cols:
            return
        wider = np.full((rows, width), -1, dtype=np.int32)
        wider[:, :cols] = self.blocks
        self.blocks = wider

    def _grow_rows(self) -> None:
        rows, cols = self.blocks.shape
        more = max(rows, 1)
        self.blocks = np.concatenate([self.blocks, np.full((more, cols), -1, dtype=np.int32)])
        self.num_blocks = np.concatenate([self.num_blocks, np.zeros(more, dtype=np.int64)])
        self.version = np.concatenate([self.version, np.zeros(more, dtype=np.int64)])
        self._owner += [None] * more
        for slot in range(rows, rows + more):
            heapq.heappush(self._free, slot)

    def rows(self, slots: np.ndarray) -> np.ndarray:
        """The rows of `slots` in that order: a view when they are contiguous and ascending, else a copy. A view
        changes with the next plan's diff, so a step's consumers copy it at launch (they do: into staging)."""
        first = contiguous_start(slots)
        return self.blocks[slots] if first is None else self.blocks[first:first + len(slots)]


def contiguous_start(slots: np.ndarray) -> int | None:
    """slots[0] when `slots` are consecutive ascending integers (their rows are one slice), else None."""
    n = len(slots)
    if n and slots[-1] - slots[0] == n - 1 and (n == 1 or bool((np.diff(slots) == 1).all())):
        return int(slots[0])
    return None


class ScheduledBatch(list[ScheduledSeq]):
    """A step's scheduled sequences and the block table whose rows they hold (executors pass it on as a list;
    prepare_step reads the rows from it instead of the sequences' lists)."""

    __slots__ = ("table",)

    def __init__(self, items: Iterable[ScheduledSeq], table: BlockTable) -> None:
        super().__init__(items)
        self.table = table
