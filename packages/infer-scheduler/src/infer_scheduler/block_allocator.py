"""The paged KV block allocator: a free list plus one reference count per block.

A block is free exactly when its count is 0. Every holder takes one reference: a request for each block in
its block table, the radix cache for each block it keeps. Freeing a block twice, or referencing a free one,
raises `BlockError` at once (and leaves the counts untouched) instead of corrupting the cache silently.

The per-call lists are short (a request's blocks, one tree node's pages: tens of ids), where a plain Python
loop over a list beats numpy's per-call overhead about 3x (measured: 6 us vs 19 us for 40 ids); numpy does
the whole-cache work (`refcounts`, `check`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class BlockError(RuntimeError):
    """A double free, a reference to a free block, or an allocation beyond the free blocks."""


class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._refs = [0] * num_blocks
        # A LIFO stack: recently freed blocks are handed out first; block 0 goes first on a fresh cache.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int]:
        """`n` fresh blocks with one reference each."""
        if n <= 0:
            return []
        free = self._free
        if n > len(free):
            raise BlockError(f"asked for {n} blocks, {len(free)} free")
        if n == 1:
            b = free.pop()
            self._refs[b] = 1
            return [b]
        ids = free[-n:]
        del free[-n:]
        ids.reverse()
        refs = self._refs
        for b in ids:
            refs[b] = 1
        return ids

    def incref(self, ids: Sequence[int]) -> None:
        """One more reference on each block (each must be allocated; `ids` hold no duplicates)."""
        refs = self._refs
        for i, b in enumerate(ids):
            if refs[b] <= 0:
                for u in ids[:i]:
                    refs[u] -= 1
                raise BlockError(f"incref of free block {b}")
            refs[b] += 1

    def decref(self, ids: Sequence[int]) -> int:
        """Drop one reference from each block; the ones that reach 0 go back to the free list. Returns how many."""
        refs = self._refs
        freed: list[int] = []
        for i, b in enumerate(ids):
            c = refs[b] - 1
            if c < 0:
                for u in ids[:i]:
                    refs[u] += 1
                for u in freed:
                    self._free.remove(u)
                raise BlockError(f"double free of block {b}")
            refs[b] = c
            if c == 0:
                freed.append(b)
                self._free.append(b)
        return len(freed)

    def refcount(self, block_id: int) -> int:
        return self._refs[block_id]

    def refcounts(self) -> np.ndarray:
        """A copy of every block's reference count (for invariant checks and stats)."""
        return np.asarray(self._refs, dtype=np.int64)

    def check(self) -> None:
        """The free list holds exactly the blocks with count 0, each once."""
        refs = self.refcounts()
        free = np.asarray(self._free, dtype=np.int64)
        if (refs < 0).any():
            raise BlockError("negative reference count")
        if len(np.unique(free)) != len(free):
            raise BlockError("a block is on the free list twice")
        if not np.array_equal(np.sort(free), np.flatnonzero(refs == 0)):
            raise BlockError("free list and reference counts disagree")
