"""Paged KV-cache bookkeeping: a pool of fixed-size blocks with reference counts, and block tables per sequence.

The cells of a block hold `block_size` consecutive positions of one sequence. A block may be shared (a common
prompt prefix: several tables and the prefix tree, `radix.RadixCache`, hold it, its reference count says how
many); it returns to the free list when the last holder lets it go. Allocation is all or nothing: OutOfBlocks
leaves the pool as it was, so a scheduler can preempt and retry. This module only counts; the cells themselves
live in the KV cache's arrays, indexed by block id.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from hybrid.errors import HybridError


class OutOfBlocks(HybridError):
    """Not enough free KV blocks for the request (nothing was allocated)."""


class BlockPool:
    def __init__(self, n_blocks: int, block_size: int):
        if n_blocks < 1 or block_size < 1:
            raise ValueError(f"a block pool needs n_blocks >= 1 and block_size >= 1, got {n_blocks}, {block_size}")
        self.n_blocks, self.block_size = n_blocks, block_size
        self.ref = np.zeros(n_blocks, dtype=np.int32)
        self._free: deque[int] = deque(range(n_blocks))

    @property
    def n_free(self) -> int:
        return len(self._free)

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def alloc(self, n: int) -> list[int]:
        """n fresh blocks, each with one reference; OutOfBlocks (and nothing taken) if fewer are free."""
        if n > len(self._free):
            raise OutOfBlocks(f"{n} KV blocks wanted, {len(self._free)} of {self.n_blocks} free")
        ids = [self._free.popleft() for _ in range(n)]
        self.ref[ids] = 1
        return ids

    def incref(self, ids) -> None:
        ids = list(ids)
        if ids and (self.ref[ids] <= 0).any():
            raise ValueError(f"incref of a free block: {[i for i in ids if self.ref[i] <= 0]}")
        np.add.at(self.ref, ids, 1)

    def decref(self, ids) -> list[int]:
        """Drop one reference from each block; those that reach 0 go back to the free list (returned)."""
        freed = []
        for i in ids:
            if self.ref[i] <= 0:
                raise ValueError(f"decref of a free block {i}")
            self.ref[i] -= 1
            if self.ref[i] == 0:
                self._free.append(i)
                freed.append(i)
        return freed


@dataclass
class BlockTable:
    """One sequence's blocks in order; position p lives in blocks[p // block_size] at cell p % block_size."""

    blocks: list[int] = field(default_factory=list)
    n_tokens: int = 0


class BlockManager:
    """Block tables of the running sequences over one pool (the same table serves a split model's CPU and GPU
    layers: each side indexes its own arrays with it)."""

    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.tables: dict[object, BlockTable] = {}

    def allocate(self, seq, n_tokens: int, prefix: list[int] = ()) -> BlockTable:
        """A table for seq's first n_tokens, starting with the shared blocks `prefix` (a prefix-cache hit: whole
        blocks, one more reference each), fresh blocks for the rest."""
        if seq in self.tables:
            raise ValueError(f"sequence {seq!r} already has blocks")
        prefix = list(prefix)
        if len(prefix) * self.pool.block_size > n_tokens:
            raise ValueError("the shared prefix is longer than the sequence")
        fresh = self.pool.alloc(self.pool.blocks_for(n_tokens) - len(prefix))
        self.pool.incref(prefix)
        table = self.tables[seq] = BlockTable(prefix + fresh, n_tokens)
        return table

    def append(self, seq, n_new: int) -> BlockTable:
        """Room for n_new more tokens (a decode step, a prompt chunk, a speculative check)."""
        t = self.tables[seq]
        need = self.pool.blocks_for(t.n_tokens + n_new) - len(t.blocks)
        if need > 0:
            t.blocks += self.pool.alloc(need)
        t.n_tokens += n_new
        return t

    def truncate(self, seq, n_tokens: int) -> None:
        """Keep the first n_tokens (a speculative rollback): whole blocks past them are let go."""
        t = self.tables[seq]
        if n_tokens > t.n_tokens:
            raise ValueError(f"truncate to {n_tokens} tokens of a sequence of {t.n_tokens}")
        keep = self.pool.blocks_for(n_tokens)
        self.pool.decref(t.blocks[keep:])
        del t.blocks[keep:]
        t.n_tokens = n_tokens

    def free(self, seq) -> None:
        """The sequence is done (or preempted): its references go; shared blocks stay with their other holders."""
        t = self.tables.pop(seq)
        self.pool.decref(t.blocks)
