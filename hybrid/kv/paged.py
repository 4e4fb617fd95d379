"""A paged KV cache: each layer's storage is one pool of fixed-size blocks shared by every sequence, and each
sequence holds a block table (position p lives in block table[p // block_size], cell p % block_size).

`PagedKV` owns the pools (one per layer, made by the layer's backend) and the reference counts (blocks.BlockPool).
`PagedKV.sequence()` gives a `PagedCache`: a KVCache whose layers are views of the pools through the sequence's
table, so Engine.eval / eval_batch run on it unchanged; the engine asks it to `reserve` the blocks of every batch
before computing (blocks.OutOfBlocks, nothing allocated, when the pool is short). A sequence can start from blocks
another holds (`adopt`: a prompt prefix found in the prefix cache, radix.RadixCache): they are shared, one more
reference each, never written again (the sequence writes from the first position past them, a block boundary).

The CPU's and the GPU's kernels read through the table (kernels_cpu.attention; kernels_gpu.attention, which takes
the tables on the device); a split model's CPU and GPU layers share one table per sequence, each layer's pool on its
own device. Backends without `paged_kv` are refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from gguf_io import ModelConfig
from hybrid.errors import HybridError
from hybrid.kv.blocks import BlockPool
from hybrid.kv.cache import KVCache, _new_layer
from kernels_cpu.kv_cache import cache_rows

DEFAULT_BLOCK_SIZE = 64  # a multiple of the CPU attention's tile (32): whole tiles of a block, as contiguous


def supports_paging(backends: list) -> bool:
    """Whether every layer's backend reads a paged cache (CpuBackend.paged_kv, GpuBackend.paged_kv)."""
    return all(getattr(be, "paged_kv", False) for be in backends)


class PagedKV:
    def __init__(self, config: ModelConfig, backends: list, n_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE,
                 type_k: str = "f16", type_v: str = "f16"):
        if not supports_paging(backends):
            raise HybridError("a paged KV cache needs backends that read block tables (the CPU's and the GPU's)")
        self.pool = BlockPool(n_blocks, block_size)
        self.block_size, self.type_k, self.type_v = block_size, type_k, type_v
        self.layers = [_new_layer(be, config, n_blocks * block_size, type_k, type_v) for be in backends]

    @property
    def nbytes(self) -> int:
        return sum(int(layer.nbytes) for layer in self.layers)

    def copy_rows(self, src: "PagedCache", dst: "PagedCache", start: int, stop: int) -> None:
        """Positions [start, stop) of src's K/V rows into dst's (its blocks reserved): a shared prefix that ends
        inside a block, which cannot be shared by reference."""
        pos = np.arange(start, stop, dtype=np.int64)
        for a, b in zip(src.layers, dst.layers, strict=True):
            rs, rd = cache_rows(a, pos), cache_rows(b, pos)
            if isinstance(a.k, np.ndarray):
                a.k[rd] = a.k[rs]
                if a.v is not a.k:
                    a.v[rd] = a.v[rs]
            else:  # a GPU layer's pool
                from kernels_gpu.kv_cache import copy_cells  # noqa: PLC0415

                copy_cells(a, rs, rd)

    def sequence(self, n_ctx: int) -> "PagedCache":
        """An empty sequence of at most n_ctx positions (no block taken until it reserves)."""
        table = np.full(-(-n_ctx // self.block_size), -1, dtype=np.int32)
        layers = [replace(layer, table=table, block_size=self.block_size) for layer in self.layers]
        return PagedCache(n_ctx, self.type_k, self.type_v, layers, pool_of=self, table=table)


def single_sequence(config: ModelConfig, backends: list, n_ctx: int, type_k: str = "f16", type_v: str = "f16",
                    block_size: int = DEFAULT_BLOCK_SIZE) -> "PagedCache":
    """One sequence of n_ctx positions with a pool of its own, ceil(n_ctx / block_size) blocks (n_ctx cells when
    block_size divides it): the cache of `run`, `chat` and `perplexity` (Engine.new_cache), read by the same kernels
    as the server's shared pool."""
    return PagedKV(config, backends, -(-n_ctx // block_size), block_size, type_k, type_v).sequence(n_ctx)


@dataclass(eq=False)
class PagedCache(KVCache):
    pool_of: PagedKV | None = None
    table: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))  # the layers' shared table
    blocks: list[int] = field(default_factory=list)  # table[:len(blocks)], as a list

    @property
    def paged(self) -> bool:
        return True

    def reserve(self, n_tokens: int) -> None:
        """Blocks for positions [0, n_tokens): fresh ones past those held (OutOfBlocks and none taken if short)."""
        pool = self.pool_of.pool
        need = pool.blocks_for(n_tokens) - len(self.blocks)
        if need <= 0:
            return
        if len(self.blocks) + need > self.table.shape[0]:
            raise HybridError(f"{n_tokens} tokens do not fit the sequence's context of {self.n_ctx}")
        new = pool.alloc(need)
        self.table[len(self.blocks) : len(self.blocks) + need] = new
        self.blocks += new

    def adopt(self, blocks: list[int]) -> None:
        """Start an empty sequence from shared whole blocks (a cached prompt prefix): one more reference each; the
        sequence's n_past becomes their token count."""
        if self.blocks or self.n_past:
            raise HybridError("adopt: the sequence is not empty")
        if len(blocks) > self.table.shape[0]:
            raise HybridError("adopt: more blocks than the sequence's context holds")
        self.pool_of.pool.incref(blocks)
        self.blocks = list(blocks)
        self.table[: len(blocks)] = blocks
        self.n_past = len(blocks) * self.pool_of.block_size

    def release(self) -> None:
        """Let the sequence's blocks go (those shared stay with their other holders) and empty it."""
        self.pool_of.pool.decref(self.blocks)
        self.blocks = []
        self.table[:] = -1
        self.n_past = 0

    def clear(self) -> None:
        self.release()
