"""A radix tree of cached prompt prefixes over paged KV blocks (SGLang's radix cache, in whole blocks).

Edges are runs of tokens whose length is a multiple of the block size, each node holding the blocks of its edge
(one reference each, taken at insert). `match(tokens)` finds the longest cached prefix, rounded down to whole
blocks; a request `lock`s the matched node (and with it the path to the root) while it uses the blocks, and
`unlock`s it when done. When space runs out, `evict` frees unlocked leaves, least recently used first; a parent
whose children are all gone becomes a leaf and a candidate in turn. An insert that shares part of an edge splits
the edge at the last whole block they share.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from hybrid.kv.blocks import BlockPool


@dataclass(eq=False)
class RadixNode:
    key: tuple[int, ...] = ()  # the edge's tokens (whole blocks)
    blocks: list[int] = field(default_factory=list)  # one per block of the edge
    parent: RadixNode | None = None
    children: dict[tuple[int, ...], RadixNode] = field(default_factory=dict)  # by their first block's tokens
    lock: int = 0  # requests using this node or a descendant
    last_use: int = 0


@dataclass
class RadixStats:
    queries: int = 0
    hits: int = 0  # queries that matched at least one block
    hit_tokens: int = 0
    evicted_blocks: int = 0


class RadixCache:
    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.bs = pool.block_size
        self.root = RadixNode()
        self.stats = RadixStats()
        self._clock = itertools.count(1)

    @property
    def n_blocks(self) -> int:
        """Blocks the tree holds a reference to."""
        return sum(len(n.blocks) for n in self._nodes())

    def match(self, tokens) -> tuple[int, list[int], RadixNode]:
        """(matched tokens, their blocks, the deepest matched node) for the longest cached whole-block prefix."""
        node, blocks, n = self.root, [], 0
        now = next(self._clock)
        self.stats.queries += 1
        for child, k, whole in self._path(tokens):
            blocks += child.blocks[:k]
            n += k * self.bs
            child.last_use = now
            node = child if whole else self._split(child, k)
        if n:
            self.stats.hits += 1
            self.stats.hit_tokens += n
        return n, blocks, node

    def peek(self, tokens) -> int:
        """The tokens match() would find, without touching the tree (no split, no use, no count)."""
        return sum(k for _, k, _ in self._path(tokens)) * self.bs

    def _path(self, tokens):
        """The edges the longest cached whole-block prefix of tokens follows from the root: (child, k, whole) for
        each, k of its blocks shared, whole when that is all of them (the walk goes on below it, else it ends)."""
        tokens = tuple(tokens)
        node, n = self.root, 0
        while n + self.bs <= len(tokens):
            child = node.children.get(tokens[n : n + self.bs])
            if child is None:
                return
            k = self._common_blocks(child.key, tokens[n:])
            whole = k == len(child.blocks)
            yield child, k, whole  # (match may split a partly shared child: the walk ends there)
            if not whole:
                return
            n += k * self.bs
            node = child

    def insert(self, tokens, blocks: list[int]) -> RadixNode:
        """Cache the whole blocks of `tokens` (blocks[i] holds tokens[i*bs:(i+1)*bs]); the blocks not cached yet get
        one more reference (the tree's). Returns the node that ends the inserted prefix."""
        n_full = min(len(tokens) // self.bs, len(blocks))
        tokens = tuple(tokens[: n_full * self.bs])
        node, n = self.root, 0
        now = next(self._clock)
        while n < len(tokens):
            child = node.children.get(tokens[n : n + self.bs])
            if child is None:
                new = RadixNode(tokens[n:], list(blocks[n // self.bs : n_full]), node, last_use=now)
                self.pool.incref(new.blocks)
                node.children[new.key[: self.bs]] = new
                return new
            k = self._common_blocks(child.key, tokens[n:])
            child.last_use = now
            if k < len(child.blocks):
                child = self._split(child, k)
            node = child
            n += k * self.bs
        return node

    def lock(self, node: RadixNode) -> None:
        while node is not None:
            node.lock += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        while node is not None:
            if node.lock <= 0:
                raise ValueError("unlock of a node that is not locked")
            node.lock -= 1
            node = node.parent

    def evict(self, n_blocks: int) -> int:
        """Free at least n_blocks blocks from unlocked leaves, least recently used first (fewer when everything
        left is locked); returns how many the pool got back. A leaf whose blocks all have other holders too (a
        running sequence's prompt) stays: dropping it would free nothing and lose the entry."""
        heap = [(n.last_use, id(n), n) for n in self._nodes() if not n.children and not n.lock and n is not self.root]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < n_blocks:
            _, _, node = heapq.heappop(heap)
            if node.blocks and (self.pool.ref[node.blocks] > 1).all():
                continue
            freed += len(self.pool.decref(node.blocks))
            self.stats.evicted_blocks += len(node.blocks)
            parent = node.parent
            del parent.children[node.key[: self.bs]]
            if parent is not self.root and not parent.children and not parent.lock:
                heapq.heappush(heap, (parent.last_use, id(parent), parent))
        return freed

    def evictable(self) -> int:
        """At most the blocks evict() could give back now: those of unlocked nodes that nothing else holds (an
        upper bound: such a node under a leaf that evict keeps stays too)."""
        return sum(int((self.pool.ref[n.blocks] == 1).sum()) for n in self._nodes()
                   if n is not self.root and not n.lock)

    def _common_blocks(self, key: tuple, tokens: tuple) -> int:
        """Whole blocks at the start of key that tokens repeats."""
        k = 0
        while (k + 1) * self.bs <= min(len(key), len(tokens)) and \
                key[k * self.bs : (k + 1) * self.bs] == tokens[k * self.bs : (k + 1) * self.bs]:
            k += 1
        return k

    def _split(self, node: RadixNode, k: int) -> RadixNode:
        """Cut node's edge after k blocks: a new parent holds the first k, node keeps the rest. Returns the parent."""
        cut = k * self.bs
        top = RadixNode(node.key[:cut], node.blocks[:k], node.parent, lock=node.lock, last_use=node.last_use)
        node.parent.children[node.key[: self.bs]] = top
        node.key, node.blocks, node.parent = node.key[cut:], node.blocks[k:], top
        top.children[node.key[: self.bs]] = node
        return top

    def _nodes(self):
        stack = [self.root]
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())
