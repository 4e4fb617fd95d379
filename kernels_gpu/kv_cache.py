"""KV cache storage of one layer in GPU memory: the same ggml-layout rows as kernels_cpu/kv_cache.py.

k, v: cupy uint8 (n_cells, n_head_kv, row_bytes). Contiguous: cell c holds position c. Paged (a view of a pool
shared by many sequences, hybrid.kv.paged): position p of the sequence lives in cell table[p // block_size] *
block_size + p % block_size, as kernels_cpu.kv_cache's paged layers; the kernels take the tables on the device
(`PagedArgs`). Types f32, f16, q8_0, q4_0 (blocks of 32 along head_dim; block_q8_0: d fp16, qs[32]; block_q4_0:
d fp16, qs[16]), written by kv.cu.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from gguf_io.kv_types import kv_row_bytes, kv_type

from .module import get_kernel


def kv_type_code(type_name: str) -> int:
    """Kernel code of a KV cache type name (kv.cu / attention.cu switch on it); a ValueError for others."""
    return kv_type(type_name).code


@dataclass(frozen=True)
class GpuKVCacheLayer:
    """One layer's cache on the GPU: k, v cupy uint8 (n_ctx, n_head_kv, row_bytes), ggml-layout rows."""

    type_k: str
    type_v: str
    head_dim_k: int
    head_dim_v: int
    k: object  # cupy uint8 (n_cells, n_head_kv, kv_row_bytes(type_k, head_dim_k))
    v: object  # cupy uint8 (n_cells, n_head_kv, kv_row_bytes(type_v, head_dim_v))
    table: np.ndarray | None = None  # host int32 (max blocks of the sequence,): a paged view; None: contiguous
    block_size: int = 0

    @property
    def n_ctx(self) -> int:
        """Positions the layer can address: its cells, or a paged sequence's table times the block size."""
        return self.k.shape[0] if self.table is None else self.table.shape[0] * self.block_size

    @property
    def n_head_kv(self) -> int:
        return self.k.shape[1]

    @property
    def nbytes(self) -> int:
        return int(self.k.nbytes + (0 if self.v is self.k else self.v.nbytes))  # MLA: v is k

    @cached_property
    def graph_key(self) -> tuple:
        """What a captured decode graph depends on: the shapes and types (not the addresses)."""
        return self.k.shape, self.v.shape, self.type_k, self.type_v

    @cached_property
    def ptrs(self) -> tuple[int, int]:
        """The device addresses of k and v (fixed for the layer's life), for a decode graph's slots."""
        return self.k.data.ptr, self.v.data.ptr


@dataclass(frozen=True)
class PagedArgs:
    """The block tables of paged sequences on the device, for kv_store and attention: tables (n_seq, tbl_w) int32
    (block ids; -1 where none), seq_of (n_tok,) int32 the sequence of each token (None: every token is of sequence
    0), block_size."""

    tables: object
    seq_of: object
    block_size: int

    @property
    def width(self) -> int:
        return int(self.tables.shape[-1])

    def args(self) -> tuple:
        """The kernels' trailing (tables, seq_of, tbl_w, bs) arguments."""
        null = np.uint64(0)
        return (self.tables, null if self.seq_of is None else self.seq_of, np.int32(self.width),
                np.int32(self.block_size))

    def one(self, s: int) -> "PagedArgs":
        """Sequence s alone (its table row; no seq_of)."""
        return PagedArgs(self.tables[s:s + 1], None, self.block_size)


NO_TABLES = (np.uint64(0), np.uint64(0), np.int32(0), np.int32(1))  # a contiguous cache: cell = position


def copy_cells(layer: GpuKVCacheLayer, src: np.ndarray, dst: np.ndarray) -> None:
    """Cells src (host int64) of the layer's k and v copied to cells dst (a shared prefix's partial block)."""
    import cupy  # noqa: PLC0415

    s, d = cupy.asarray(src), cupy.asarray(dst)
    layer.k[d] = layer.k[s]
    if layer.v is not layer.k:
        layer.v[d] = layer.v[s]


def alloc_kv_layer(n_ctx: int, n_head_kv: int, head_dim_k: int, head_dim_v: int | None = None,
                   type_k: str = "f16", type_v: str = "f16") -> GpuKVCacheLayer:
    """A zeroed GpuKVCacheLayer of n_ctx cells (head_dim_v defaults to head_dim_k)."""
    import cupy  # noqa: PLC0415

    head_dim_v = head_dim_k if head_dim_v is None else head_dim_v
    type_k, type_v = str(type_k).lower(), str(type_v).lower()
    k = cupy.zeros((n_ctx, n_head_kv, kv_row_bytes(type_k, head_dim_k)), dtype=cupy.uint8)
    v = cupy.zeros((n_ctx, n_head_kv, kv_row_bytes(type_v, head_dim_v)), dtype=cupy.uint8)
    return GpuKVCacheLayer(type_k, type_v, head_dim_k, head_dim_v, k, v)


def kv_store(layer: GpuKVCacheLayer, positions, k, v, slots: tuple[int, int] | None = None,
             paged: PagedArgs | None = None) -> None:
    """Write k (n_tok, n_head_kv, head_dim_k) and v (n_tok, n_head_kv, head_dim_v) f32 (cupy) at cells =
    positions (cupy int32 (n_tok,), values already checked to lie in [0, n_ctx)).
    slots: device addresses of two uint64 slots holding the addresses of layer.k and layer.v (read by the kernels
    when they run): a CUDA graph captured with slots serves any cache of this layer's shape.
    paged: the cells through block tables (layer.k / layer.v being the pool), the blocks already allocated."""
    import cupy  # noqa: PLC0415

    n_tok = positions.shape[0]
    for name, x, hd in (("k", k, layer.head_dim_k), ("v", v, layer.head_dim_v)):
        if x.shape != (n_tok, layer.n_head_kv, hd):
            raise ValueError(f"kv_store: {name} must be {(n_tok, layer.n_head_kv, hd)}, found {x.shape}")
    if n_tok == 0:
        return
    k = cupy.ascontiguousarray(k, dtype=cupy.float32)
    v = cupy.ascontiguousarray(v, dtype=cupy.float32)
    i32 = np.int32
    dk, dv, indirect = (layer.k, layer.v, 0) if slots is None else (np.uint64(slots[0]), np.uint64(slots[1]), 1)
    threads = n_tok * layer.n_head_kv * max(layer.head_dim_k, layer.head_dim_v)  # a value a thread (quantized
    # types: a warp a block of 32); k in grid row 0, v in row 1: one launch
    get_kernel("kv", "kv_store_kv")(((threads + 255) // 256, 2), (256,),
                                    (k, v, positions, dk, dv, i32(n_tok), i32(layer.n_head_kv), i32(layer.head_dim_k),
                                     i32(layer.head_dim_v), i32(kv_type_code(layer.type_k)),
                                     i32(kv_type_code(layer.type_v)), i32(indirect),
                                     *(NO_TABLES if paged is None else paged.args())))
