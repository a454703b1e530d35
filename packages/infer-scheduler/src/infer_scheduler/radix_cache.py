"""The RadixTree prefix cache over token ids, page aligned (one KV block = one page of `page_size` tokens).

Every edge holds a whole number of pages: `key` (tokens) and `blocks` (one block id per page). Children are
keyed by their first page, so two siblings never share a first page. The tree holds one allocator reference
on each of its blocks. A request that uses a path `lock`s its last node (the lock counts up to the root);
only unlocked leaves are evicted, least recently used first, and only when blocks are needed. An unlocked
node's blocks are held by the tree alone, so evicting it frees them: `num_evictable_blocks` is exact.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from itertools import count

from infer_scheduler.block_allocator import BlockAllocator


class RadixNode:
    __slots__ = ("children", "parent", "key", "blocks", "lock_ref", "last_access")

    def __init__(self, key: list[int], blocks: list[int], parent: RadixNode | None) -> None:
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.parent = parent
        self.key = key
        self.blocks = blocks
        self.lock_ref = 0
        self.last_access = 0

    def __repr__(self) -> str:
        return f"RadixNode(tokens={len(self.key)}, blocks={self.blocks}, lock={self.lock_ref})"


def _by_access(node: RadixNode) -> int:
    return node.last_access


class RadixCache:
    def __init__(self, allocator: BlockAllocator, page_size: int) -> None:
        self.allocator = allocator
        self.page_size = page_size
        self.root = RadixNode([], [], None)
        self.root.lock_ref = 1  # never evicted
        self._clock = count(1)
        self.num_cached_blocks = 0
        self.num_evictable_blocks = 0
        self._evictable_leaves: set[RadixNode] = set()  # unlocked leaves: what eviction picks from

    # ------------------------------------------------------------------ lookup / insert

    def match(self, tokens: Sequence[int], max_tokens: int | None = None) -> tuple[list[int], RadixNode]:
        """The blocks of the longest cached page-aligned prefix of `tokens[:max_tokens]`, and its last node.

        Splits a node when the match ends inside it, so the returned node covers exactly the match."""
        ps = self.page_size
        if not isinstance(tokens, list):
            tokens = list(tokens)
        n = len(tokens) if max_tokens is None else min(len(tokens), max_tokens)
        n -= n % ps
        node, pos, blocks, now = self.root, 0, [], next(self._clock)
        while pos < n:
            child = node.children.get(tuple(tokens[pos:pos + ps]))
            if child is None:
                break
            k = self._common(child.key, tokens, pos, n)
            if k < len(child.key):
                child = self._split(child, k)
            child.last_access = now
            blocks.extend(child.blocks)
            pos += k
            node = child
        return blocks, node

    def insert(self, tokens: Sequence[int], blocks: Sequence[int], own_only: bool = False) -> RadixNode | None:
        """Cache `tokens` (page aligned, `len(blocks)` pages) and return the node that ends at its last page.

        Pages already cached keep the tree's blocks (the caller's duplicates stay the caller's); each newly
        cached block gets one tree reference. With `own_only`, nothing is added (None is returned) if a page
        already cached on the path holds another block than the caller's."""
        ps = self.page_size
        if not isinstance(tokens, list):
            tokens = list(tokens)
        n = len(blocks) * ps
        if len(tokens) < n:
            raise ValueError(f"insert: {len(tokens)} tokens for {len(blocks)} pages of {ps}")
        node, pos, now = self.root, 0, next(self._clock)
        while pos < n:
            first = tuple(tokens[pos:pos + ps])
            child = node.children.get(first)
            if child is None:
                new = RadixNode(tokens[pos:n], list(blocks[pos // ps:]), node)
                new.last_access = now
                node.children[first] = new
                self._evictable_leaves.discard(node)
                self._evictable_leaves.add(new)
                self.allocator.incref(new.blocks)
                self.num_cached_blocks += len(new.blocks)
                self.num_evictable_blocks += len(new.blocks)
                return new
            k = self._common(child.key, tokens, pos, n)
            if k < len(child.key):
                child = self._split(child, k)
            if own_only and child.blocks != blocks[pos // ps:(pos + k) // ps]:
                return None
            child.last_access = now
            pos += k
            node = child
        return node

    def _common(self, key: list[int], tokens: list[int], pos: int, end: int) -> int:
        """Length of the common page-aligned prefix of `key` and `tokens[pos:end]` (the first page matches)."""
        ps = self.page_size
        m = min(len(key), end - pos)
        if (key if m == len(key) else key[:m]) == tokens[pos:pos + m]:  # the usual case: one C-level compare
            return m - m % ps
        k = ps
        while k < m and key[k:k + ps] == tokens[pos + k:pos + k + ps]:
            k += ps
        return min(k, m - m % ps)

    def _split(self, child: RadixNode, k: int) -> RadixNode:
        """Cut `child` after `k` tokens; the new upper part is returned (same lock count, same access time)."""
        ps = self.page_size
        parent = child.parent
        assert parent is not None and 0 < k < len(child.key) and k % ps == 0
        upper = RadixNode(child.key[:k], child.blocks[:k // ps], parent)
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        parent.children[tuple(child.key[:ps])] = upper
        child.key = child.key[k:]
        child.blocks = child.blocks[k // ps:]
        child.parent = upper
        upper.children[tuple(child.key[:ps])] = child
        return upper

    # ------------------------------------------------------------------ lock / unlock

    def lock(self, node: RadixNode) -> None:
        n: RadixNode | None = node
        while n is not None and n is not self.root:
            if n.lock_ref == 0:
                self.num_evictable_blocks -= len(n.blocks)
                self._evictable_leaves.discard(n)
            n.lock_ref += 1
            n = n.parent

    def unlock(self, node: RadixNode) -> None:
        n: RadixNode | None = node
        while n is not None and n is not self.root:
            if n.lock_ref <= 0:
                raise RuntimeError(f"unlock of an unlocked node {n!r}")
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self.num_evictable_blocks += len(n.blocks)
                if not n.children:
                    self._evictable_leaves.add(n)
            n = n.parent

    # ------------------------------------------------------------------ eviction

    def evict(self, num_blocks: int) -> int:
        """Free at least `num_blocks` blocks (if that many are evictable) from unlocked leaves, LRU first."""
        if num_blocks <= 0 or self.num_evictable_blocks == 0:
            return 0
        leaves = self._evictable_leaves
        order = sorted(leaves, key=_by_access)  # C-level sort: cheaper than a heap of every leaf
        exposed: list[tuple[int, int, RadixNode]] = []  # parents that became leaves, as a small heap
        tie = count()
        i, freed, ps = 0, 0, self.page_size
        while freed < num_blocks:
            if exposed and (i >= len(order) or exposed[0][0] <= order[i].last_access):
                leaf = heapq.heappop(exposed)[2]
            elif i < len(order):
                leaf = order[i]
                i += 1
            else:
                break
            leaves.discard(leaf)
            parent = leaf.parent
            assert parent is not None
            del parent.children[tuple(leaf.key[:ps])]
            freed += self.allocator.decref(leaf.blocks)
            self.num_cached_blocks -= len(leaf.blocks)
            self.num_evictable_blocks -= len(leaf.blocks)
            leaf.parent = None
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                leaves.add(parent)
                heapq.heappush(exposed, (parent.last_access, next(tie), parent))
        return freed

    def _leaves(self) -> list[RadixNode]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self.root:
                out.append(node)
        return out

    # ------------------------------------------------------------------ introspection (tests, stats)

    def cached_blocks(self) -> list[int]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            out.extend(node.blocks)
            stack.extend(node.children.values())
        return out

    def check(self) -> None:
        """Structural invariants: page alignment, sibling keys, lock counts, block totals."""
        ps = self.page_size
        total = evictable = 0
        stack = [self.root]
        while stack:
            node = stack.pop()
            if node is not self.root:
                assert len(node.key) > 0 and len(node.key) == len(node.blocks) * ps, node
                assert node.lock_ref >= sum(c.lock_ref for c in node.children.values()), node
                total += len(node.blocks)
                evictable += len(node.blocks) if node.lock_ref == 0 else 0
                # evictable <=> freeable: an unlocked node's blocks are the tree's alone, a locked one's are shared
                refs = [self.allocator.refcount(b) for b in node.blocks]
                assert all(r == 1 for r in refs) if node.lock_ref == 0 else all(r >= 2 for r in refs), (node, refs)
            for first, child in node.children.items():
                assert child.parent is node and tuple(child.key[:ps]) == first
                stack.append(child)
        assert total == self.num_cached_blocks, (total, self.num_cached_blocks)
        assert evictable == self.num_evictable_blocks, (evictable, self.num_evictable_blocks)
        want = {n for n in self._leaves() if n.lock_ref == 0}
        assert want == self._evictable_leaves, "the evictable-leaf set is stale"
