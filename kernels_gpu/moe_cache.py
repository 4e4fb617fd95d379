"""The GPU expert cache's per-layer lookup (moe_cache.cu): the routed experts' slots in one launch. The hits then run
as kernels_gpu.moe's decode on the slot pool (slot ids in place of expert ids: a pool is laid out as an expert
tensor, (n_slots + 1, n_out, row_bytes) at the same stride)."""

from __future__ import annotations

import numpy as np

from .module import get_kernel


def lookup(table, ids, wts, null_slot: int) -> tuple:
    """table cupy int32 (n_expert,) (slot or -1), ids int32 / wts float32 (n_tok, k) -> (found int32 (n_tok, k): the
    slot or -1; slots int32: the slot or null_slot; wts_hit float32: the weight, 0 for a miss)."""
    import cupy  # noqa: PLC0415

    if table.dtype != cupy.int32 or ids.dtype != cupy.int32 or wts.dtype != cupy.float32:
        raise ValueError(f"moe_cache lookup: need int32 table and ids, float32 weights; found {table.dtype}, "
                         f"{ids.dtype}, {wts.dtype}")
    if ids.shape != wts.shape or ids.ndim != 2 or not table.flags.c_contiguous:
        raise ValueError(f"moe_cache lookup: ids {ids.shape} and weights {wts.shape} must be one (n_tok, k) shape")
    ids, wts = cupy.ascontiguousarray(ids), cupy.ascontiguousarray(wts)
    found = cupy.empty(ids.shape, dtype=cupy.int32)
    slots = cupy.empty(ids.shape, dtype=cupy.int32)
    wts_hit = cupy.empty(ids.shape, dtype=cupy.float32)
    n = ids.size
    if n:
        get_kernel("moe_cache", "moe_cache_lookup")(((n + 127) // 128,), (128,), (table, ids, wts, found, slots,
                                                                                 wts_hit, np.int32(n),
                                                                                 np.int32(null_slot)))
    return found, slots, wts_hit


def add_misses(hits, cpu, found):
    """hits + cpu (cupy float32, one shape) when found (cupy int32, lookup's) has a miss, else hits: the step waited
    for the host's sum of the misses only then (graph.host_break's `needs`)."""
    import cupy  # noqa: PLC0415

    if hits.dtype != cupy.float32 or cpu.dtype != cupy.float32 or hits.shape != cpu.shape or found.dtype != cupy.int32:
        raise ValueError(f"moe_cache add_misses: need float32 sums of one shape and int32 lookups; found {hits.dtype} "
                         f"{hits.shape}, {cpu.dtype} {cpu.shape}, {found.dtype}")
    hits, cpu, found = (cupy.ascontiguousarray(a) for a in (hits, cpu, found))
    out = cupy.empty_like(hits)
    n = hits.size
    if n:
        get_kernel("moe_cache", "moe_cache_add_misses")(((n + 255) // 256,), (256,), (hits, cpu, found,
                                                                                 np.int32(found.size), out,
                                                                                 np.int32(n)))
    return out


def lookup_reference(table: np.ndarray, ids: np.ndarray, wts: np.ndarray, null_slot: int) -> tuple:
    """lookup on the host (numpy), for the tests."""
    found = table[ids].astype(np.int32)
    slots = np.where(found < 0, null_slot, found).astype(np.int32)
    return found, slots, np.where(found < 0, 0.0, wts).astype(np.float32)
