from __future__ import annotations

import pytest

from infer_scheduler.block_allocator import BlockAllocator
from infer_scheduler.radix_cache import RadixCache

PS = 4


def setup(num_blocks: int = 32) -> tuple[BlockAllocator, RadixCache]:
    a = BlockAllocator(num_blocks)
    return a, RadixCache(a, PS)


def cache_seq(a: BlockAllocator, c: RadixCache, tokens: list[int]):
    """Allocate blocks for a sequence's full pages, insert them, drop the caller's references (like a finish)."""
    blocks = a.allocate(len(tokens) // PS)
    node = c.insert(tokens, blocks)
    a.decref(blocks)
    return blocks, node


def test_empty_match_and_page_alignment():
    a, c = setup()
    blocks, node = c.match(list(range(10)))
    assert blocks == [] and node is c.root
    blocks, _ = cache_seq(a, c, list(range(10)))  # 2 full pages: tokens 0..7
    assert len(blocks) == 2 and c.num_cached_blocks == 2
    got, _ = c.match(list(range(10)))
    assert got == blocks
    got, _ = c.match(list(range(7)))  # only the first full page can match
    assert got == blocks[:1]
    got, _ = c.match(list(range(12)), max_tokens=7)
    assert got == blocks[:1]
    c.check()


def test_partial_match_splits_the_node():
    a, c = setup()
    blocks, _ = cache_seq(a, c, list(range(12)))
    other = list(range(8)) + [99, 98, 97, 96]
    got, node = c.match(other)
    assert got == blocks[:2]
    assert node.blocks == blocks[:2] and len(node.children) == 1
    c.check()
    # a diverging branch shares the first two pages
    b2 = a.allocate(3)
    c.insert(other, b2)
    a.decref(b2)
    assert c.num_cached_blocks == 4  # 3 + the new page; the shared pages keep the tree's blocks
    assert a.refcount(b2[0]) == 0 and a.refcount(b2[2]) == 1
    c.check()


def test_insert_of_cached_pages_keeps_the_tree_blocks():
    a, c = setup()
    blocks, _ = cache_seq(a, c, list(range(8)))
    dup = a.allocate(2)
    node = c.insert(list(range(8)), dup)
    assert node.blocks == blocks
    assert a.refcount(dup[0]) == 1  # still only the caller's
    a.decref(dup)
    a.check()
    c.check()


def test_lock_protects_from_eviction():
    a, c = setup()
    blocks, node = cache_seq(a, c, list(range(8)))
    c.lock(node)
    assert c.num_evictable_blocks == 0
    assert c.evict(10) == 0
    c.unlock(node)
    assert c.num_evictable_blocks == 2
    assert c.evict(1) == 2  # the whole leaf goes
    assert a.num_free == 32 and c.num_cached_blocks == 0
    with pytest.raises(RuntimeError):
        c.unlock(node)
    c.check()


def test_lru_evicts_the_oldest_leaf_first_and_only_when_asked():
    a, c = setup()
    old, _ = cache_seq(a, c, [1] * 8)
    new, _ = cache_seq(a, c, [2] * 8)
    c.match([1] * 8)  # touch: [1]* is now the most recent
    assert c.evict(0) == 0 and c.num_cached_blocks == 4
    assert c.evict(1) == 2
    assert c.match([1] * 8)[0] == old and c.match([2] * 8)[0] == []
    c.check()


def test_eviction_climbs_to_parents_once_they_become_leaves():
    a, c = setup()
    cache_seq(a, c, list(range(12)))
    cache_seq(a, c, list(range(8)) + [50, 51, 52, 53])  # split: shared 2 pages + two 1-page leaves
    assert c.num_cached_blocks == 4
    assert c.evict(4) == 4
    assert c.num_cached_blocks == 0 and a.num_free == 32
    c.check()


def test_locked_descendant_keeps_its_ancestors():
    a, c = setup()
    cache_seq(a, c, list(range(8)))
    _, deep = cache_seq(a, c, list(range(16)))
    c.lock(deep)
    assert c.num_evictable_blocks == 0
    assert c.evict(100) == 0
    c.unlock(deep)
    c.check()


def test_own_only_insert_refuses_a_path_cached_with_other_blocks():
    a, c = setup()
    theirs, _ = cache_seq(a, c, list(range(8)))
    mine = a.allocate(3)
    assert c.insert(list(range(12)), mine, own_only=True) is None  # pages 0-1 are cached with other blocks
    assert c.num_cached_blocks == 2 and a.refcount(mine[2]) == 1
    node = c.insert(list(range(12)), theirs + mine[2:], own_only=True)  # the path is ours: extended
    assert node is not None and node.blocks == [mine[2]] and a.refcount(mine[2]) == 2
    a.decref(mine)  # the caller lets go: its duplicates are freed, its new page stays cached
    assert a.refcount(mine[0]) == 0 and a.refcount(mine[2]) == 1
    c.check()
