"""KV blocks of requests: the allocator plus (optionally) the radix prefix cache, seen per request.

A request holds one reference on every block of its block table (shared prefix blocks included) and keeps
the radix node that ends its cached prefix locked. Allocation takes free blocks first and evicts unlocked
cache leaves (LRU) only when the free list is short. With `enable_prefix_caching = false` there is no tree:
nothing is matched, nothing is kept, released blocks go straight back to the free list.

A hybrid model (linear-attention layers) also gives each running request one state slot (`state_slots.py`):
taken at admission (`take_slot`), given back by `release` with the blocks. Its prefix caching is off: a state is
valid only at the exact end of the tokens it has seen, which a page-aligned prefix match does not respect.
"""

from __future__ import annotations

import numpy as np

from infer_scheduler.block_allocator import BlockAllocator
from infer_scheduler.radix_cache import RadixCache, RadixNode
from infer_scheduler.request import NO_STATE_SLOT, Request
from infer_scheduler.state_slots import StateSlotPool


class KvCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_state_slots: int = 0) -> None:
        """`num_state_slots` > 0: the model has state layers, with that many slots (prefix caching must be off)."""
        if num_state_slots and enable_prefix_caching:
            raise ValueError("prefix caching cannot serve a model with state slots (linear-attention layers)")
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self.cache: RadixCache | None = RadixCache(self.allocator, block_size) if enable_prefix_caching else None
        self.slots: StateSlotPool | None = StateSlotPool(num_state_slots) if num_state_slots else None
        # An eviction sorts every evictable leaf by last access (the cache keeps them in a set: no tree walk), so it
        # frees at least this many blocks at once, amortising that sort over them.
        self.evict_batch = max(1, num_blocks // 64)

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    @property
    def num_cached(self) -> int:
        """Blocks held by the radix cache alone (unlocked, evictable): free + cached + held by requests = total.

        Blocks of a locked path are also in a running request's table and count as in use, not as cached."""
        return self.cache.num_evictable_blocks if self.cache is not None else 0

    @property
    def num_available(self) -> int:
        """Blocks an allocation can get now: free ones plus unlocked cached ones (evicted on demand)."""
        free = self.allocator.num_free
        return free + self.cache.num_evictable_blocks if self.cache is not None else free

    # ------------------------------------------------------------------ admission

    def match(self, req: Request) -> int:
        """Attach the longest cached page-aligned prefix to a request being admitted; returns its length.

        At most `len(token_ids) - 1` tokens match: the last known token is always computed, since its
        logits are needed to sample the next one (a full-prompt hit recomputes one token). A request held at its
        last token while its grammar compiles matches one token fewer, so that its admission computes something."""
        assert not req.block_ids and req.cache_node is None, req
        if self.cache is None:
            return 0
        blocks, node = self.cache.match(req.cache_tokens, len(req.token_ids) - 1 - req.awaits_grammar)
        self.cache.lock(node)
        self.allocator.incref(blocks)
        req.cache_node = node
        req.block_ids = blocks
        req.cache_len = n = len(blocks) * self.block_size
        return n

    def take_slot(self, req: Request) -> bool:
        """Give an admitted request its state slot (a no-op without state layers); False when none is free."""
        if self.slots is None:
            return True
        if not self.slots.num_free:
            return False
        assert req.state_slot == NO_STATE_SLOT, req
        req.state_slot = self.slots.take()
        return True

    # ------------------------------------------------------------------ growth

    def grow(self, req: Request, num_new_blocks: int) -> list[int] | None:
        """Append `num_new_blocks` blocks to the request's table (evicting cache if needed); None if too few."""
        if num_new_blocks <= 0:
            return []
        alloc = self.allocator
        short = num_new_blocks - alloc.num_free
        if short > 0:
            if self.cache is None or self.cache.num_evictable_blocks < short:
                return None
            self.cache.evict(min(max(short, self.evict_batch), self.cache.num_evictable_blocks))
        new = alloc.allocate(num_new_blocks)
        req.block_ids.extend(new)
        return new

    # ------------------------------------------------------------------ caching and release

    def cache_computed(self, req: Request, final: bool = False, upto: int | None = None) -> None:
        """Insert the request's computed full pages into the tree.

        While the request runs (`final=False`) it then locks the new end node instead of the old one — but only
        when every page the tree already has on that path is the request's own block: if another request cached
        some of these pages first (both prefilled the same prefix at once), locking that path would pin the other
        copy, which this request does not use, so its pages stay private until it finishes. `final=True` (finish,
        preemption) inserts without locking; `release` then drops the request's lock and blocks."""
        cache = self.cache
        if cache is None:
            return
        ps = self.block_size
        computed = req.num_computed if upto is None else min(upto, req.num_computed)  # upto: steps that have run
        pages = min(min(computed, req.num_known) // ps, len(req.block_ids))  # never a PENDING token
        if pages * ps <= req.cache_len:
            return
        node = cache.insert(req.cache_tokens, req.block_ids[:pages], own_only=not final)
        if final or node is None:
            return
        cache.lock(node)
        if req.cache_node is not None:
            cache.unlock(req.cache_node)  # type: ignore[arg-type]
        req.cache_node = node
        req.cache_len = pages * ps

    def release(self, req: Request, keep_in_cache: bool = True) -> None:
        """Give back every block of the request (its computed pages stay cached when `keep_in_cache`)."""
        if keep_in_cache:
            self.cache_computed(req, final=True)
        node = req.cache_node
        if node is not None and self.cache is not None:
            assert isinstance(node, RadixNode)
            self.cache.unlock(node)
        self.allocator.decref(req.block_ids)
        req.block_ids = []
        req.cache_node = None
        req.cache_len = 0
        if req.state_slot != NO_STATE_SLOT:
            assert self.slots is not None
            self.slots.free(req.state_slot)
            req.state_slot = NO_STATE_SLOT

    # ------------------------------------------------------------------ invariants (tests)

    def check(self, holders: list[Request]) -> None:
        """Every block's count equals (held by the tree) + (number of requests holding it); free list exact."""
        self.allocator.check()
        expected = np.zeros(self.allocator.num_blocks, dtype=np.int64)
        if self.cache is not None:
            self.cache.check()
            cached = self.cache.cached_blocks()
            assert len(set(cached)) == len(cached), "a block is cached twice"
            np.add.at(expected, np.asarray(cached, dtype=np.int64), 1)
        for req in holders:
            assert len(set(req.block_ids)) == len(req.block_ids), f"{req} holds a block twice"
            np.add.at(expected, np.asarray(req.block_ids, dtype=np.int64), 1)
        if self.slots is not None:
            self.slots.check([req.state_slot for req in holders if req.state_slot != NO_STATE_SLOT])
        else:
            assert all(req.state_slot == NO_STATE_SLOT for req in holders), "a state slot without state layers"
        got = self.allocator.refcounts()
        bad = np.flatnonzero(got != expected)
        assert len(bad) == 0, f"counts off for blocks {bad[:10].tolist()}: {got[bad[:10]]} != {expected[bad[:10]]}"
