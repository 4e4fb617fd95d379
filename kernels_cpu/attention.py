"""Causal attention of a batch of queries over one layer's KV cache, read block by block from its raw storage.

Flash style: one pass over the keys in tiles of TILE, each K/V tile dequantized into an L1-sized float32 buffer,
with a running max and sum per query (online softmax; no score matrix), float32 accumulation. Masks: causal
(key position <= query position) and llama.cpp's standard sliding window (is_masked_swa: visible iff
p_query - p_key < n_swa). Optional attention sinks (gpt-oss): one logit per query head joins the softmax's
denominator after the last tile, as ggml's CPU flash attention adds it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np
from numba import njit, prange

from .kv_cache import (F16_TO_F32, KVCacheLayer, _store_kv, cache_rows, check_blocks, dequantize_rows_into,
                       kernel_table, kv_type_code, kv_views)

TILE = 32  # keys per tile: K/V tiles of TILE x head_dim f32 stay in L1
NO_SINKS = np.zeros(0, dtype=np.float32)  # the kernel's `sinks` when there are none (one array type: one compile)


@njit(cache=True, fastmath=True, parallel=True)
def _attention_kernel(q, kf, k16, k8, ki8, vf, v16, v8, vi8, code_k, code_v, positions, n_kv, scale, n_swa,
                      softcap, hpi, lut, sinks, tables, bs, seq_of, out):
    # q (n_tok, n_head, dk) f32; K and V as kv_views of u8 (rows, n_head_kv, row_bytes); positions (n_tok,) int32;
    # sinks (n_head,) f32 or (0,) for none -> out (n_tok, n_head, dv) f32. A work item is (token, kv head, hpi
    # query heads of its GQA group). Position c of query row t's sequence lives in row
    # tables[seq_of[t], c // bs] * bs + c % bs (paged caches' block tables, one row a sequence, the sequences sharing
    # one pool; a contiguous cache passes [[0]], bs = its rows and zeros, so that row = c); a tile never crosses a
    # block.
    n_tok, n_head, dk = q.shape
    n_head_kv = k8.shape[1]
    group = n_head // n_head_kv  # GQA: query head h reads kv head h // group
    n_sub = group // hpi
    dv = out.shape[2]
    for idx in prange(n_tok * n_head_kv * n_sub):
        r = idx // (n_head_kv * n_sub)
        t = r // 2 if r % 2 == 0 else n_tok - 1 - r // 2  # 0, n-1, 1, n-2, ...: causal work evens out per chunk
        hk = (idx // n_sub) % n_head_kv
        h0 = hk * group + (idx % n_sub) * hpi
        p = positions[t]
        lo = max(0, p - n_swa + 1) if n_swa > 0 else 0
        hi = min(p, n_kv - 1)
        kt = np.empty((TILE, dk), dtype=np.float32)  # (TILE, dk) dequantized K tile
        vt = np.empty((TILE, dv), dtype=np.float32)  # (TILE, dv) dequantized V tile
        st = np.empty(TILE, dtype=np.float32)  # scores of one head over the tile
        acc = np.zeros((hpi, dv), dtype=np.float32)
        m = np.zeros(hpi, dtype=np.float32)  # running max (valid after the first tile)
        s_sum = np.zeros(hpi, dtype=np.float32)  # running sum of exp(s - m)
        c0 = lo
        while c0 <= hi:
            blk = c0 // bs
            nt = min(TILE, hi + 1 - c0, (blk + 1) * bs - c0)
            row = tables[seq_of[t], blk] * bs + c0 - blk * bs
            dequantize_rows_into(kf, k16, k8, ki8, code_k, row, nt, hk, lut, kt)
            dequantize_rows_into(vf, v16, v8, vi8, code_v, row, nt, hk, lut, vt)
            for a in range(hpi):
                tmax = np.float32(-3.0e38)
                for i in range(nt):
                    s = np.float32(0.0)
                    for j in range(dk):
                        s += q[t, h0 + a, j] * kt[i, j]
                    s *= scale
                    if softcap > 0:
                        s = softcap * np.tanh(s / softcap)
                    st[i] = s
                    tmax = max(tmax, s)
                m_new = tmax if c0 == lo else max(m[a], tmax)
                alpha = np.exp(m[a] - m_new) if c0 != lo else np.float32(0.0)  # rescales what came before
                for j in range(dv):
                    acc[a, j] *= alpha
                ssum = s_sum[a] * alpha
                for i in range(nt):
                    w = np.exp(st[i] - m_new)
                    ssum += w
                    for j in range(dv):
                        acc[a, j] += w * vt[i, j]
                s_sum[a] = ssum
                m[a] = m_new
            c0 += nt
        for a in range(hpi):
            ssum = s_sum[a]
            sink_scale = np.float32(1.0)
            if sinks.shape[0] > 0 and hi >= lo:  # ggml: the sink joins the sum (and the max, if above it)
                sk = sinks[h0 + a]
                if sk > m[a]:
                    sink_scale = np.exp(m[a] - sk)
                    ssum = ssum * sink_scale + np.float32(1.0)
                else:
                    ssum = ssum + np.exp(sk - m[a])
            inv = np.float32(1.0) / ssum if ssum > 0 else np.float32(0.0)
            if sink_scale != np.float32(1.0):
                inv = inv * sink_scale
            for j in range(dv):
                out[t, h0 + a, j] = acc[a, j] * inv


def _heads_per_item(n_tok: int, n_head_kv: int, n_head: int) -> int:
    """Query heads per work item: a whole GQA group (K/V tiles dequantized once for all of them) when there are
    enough (token, kv head) items to feed every thread, else fewer, down to one head per item."""
    group = n_head // n_head_kv
    hpi = group
    while hpi > 1 and n_tok * n_head_kv * (group // hpi) < numba.get_num_threads():
        hpi -= 1
        while group % hpi:
            hpi -= 1
    return hpi


def attention(q: np.ndarray, layer: KVCacheLayer, positions: np.ndarray, scale: float, n_swa: int = 0,
              softcap: float = 0.0, n_kv: int | None = None, out: np.ndarray | None = None,
              sinks: np.ndarray | None = None) -> np.ndarray:
    """q (n_tok, n_head, head_dim_k) f32 at positions (n_tok,) -> (n_tok, n_head, head_dim_v) f32.

    softmax(softcap(scale * q.k)) . v over cache cells [0, n_kv) with the causal and, when n_swa > 0, the
    sliding-window masks; softcap 0 = none; n_kv defaults to max(positions) + 1. The batch's own K/V must
    already be stored (kv_store). GQA: query head h reads kv head h // (n_head // n_head_kv). sinks (n_head,)
    f32: head h's weights are exp(s) / (sum exp(s') + exp(sinks[h])) (the sink has no value); None = none.
    """
    if q.dtype != np.float32 or q.ndim != 3:
        raise ValueError(f"attention: q must be 3-D float32 (n_tok, n_head, head_dim), found {q.dtype} {q.shape}")
    q = np.ascontiguousarray(q)
    n_tok, n_head, head_dim = q.shape
    if head_dim != layer.head_dim_k:
        raise ValueError(f"attention: q head_dim must equal the cache's {layer.head_dim_k}, found {head_dim}")
    if n_head % layer.n_head_kv:
        raise ValueError(f"attention: n_head ({n_head}) must be a multiple of n_head_kv ({layer.n_head_kv})")
    positions = np.ascontiguousarray(positions, dtype=np.int32).reshape(-1)
    if positions.shape[0] != n_tok:
        raise ValueError(f"attention: need {n_tok} positions, found {positions.shape[0]}")
    if n_kv is None:
        n_kv = int(positions.max()) + 1 if n_tok else 0
    if not 0 <= n_kv <= layer.n_ctx:
        raise ValueError(f"attention: n_kv must lie in [0, {layer.n_ctx}], found {n_kv}")
    if n_tok and positions.min() < 0:
        raise ValueError(f"attention: positions must be >= 0, found {positions.min()}")
    if sinks is None:
        sinks = NO_SINKS
    else:  # a writable contiguous copy (n_head values): the one array type the kernel is compiled for
        sinks = np.array(sinks, dtype=np.float32).reshape(-1)
        if sinks.shape[0] != n_head or not np.all(np.isfinite(sinks)):
            raise ValueError(f"attention: sinks must be {n_head} finite float32 values, found {sinks.shape[0]}")
    check_blocks(layer, n_kv)
    if out is None:
        out = np.empty((n_tok, n_head, layer.head_dim_v), dtype=np.float32)
    elif out.shape != (n_tok, n_head, layer.head_dim_v) or out.dtype != np.float32:
        raise ValueError(f"attention: out must be float32 {(n_tok, n_head, layer.head_dim_v)}, found "
                         f"{out.dtype} {out.shape}")
    _attention_kernel(q, *kv_views(layer.k, layer.type_k), *kv_views(layer.v, layer.type_v),
                      kv_type_code(layer.type_k), kv_type_code(layer.type_v), positions, n_kv, np.float32(scale),
                      int(n_swa), np.float32(softcap), _heads_per_item(n_tok, layer.n_head_kv, n_head), F16_TO_F32,
                      sinks, *_one_table(layer, n_tok), out)
    return out


def _one_table(layer: KVCacheLayer, n_tok: int) -> tuple[np.ndarray, int, np.ndarray]:
    """The kernel's (tables, bs, seq_of) for n_tok rows of one sequence in `layer`."""
    table, bs = kernel_table(layer)
    return table.reshape(1, -1), bs, np.zeros(n_tok, dtype=np.int32)


@dataclass(frozen=True)
class BatchRows:
    """Where a ragged batch's K/V go (attention_seqs' `rows`, the same for every layer of a model: one table a
    sequence): each sequence's cache rows, and, when the sequences are paged views of one pool whose rows fill the
    batch in order, what one call for all of them takes: every row's cache row, the tables (a row each, -1 past a
    table's end) and each batch row's sequence."""

    per_seq: list
    rows: np.ndarray | None = None
    tables: np.ndarray | None = None
    seq_of: np.ndarray | None = None


def seq_rows(layers: list[KVCacheLayer], spans: list[tuple[int, int]], positions: np.ndarray) -> BatchRows:
    """attention_seqs' `rows` for the sequences (their layers, their rows [a, b) of the batch) at `positions`, their
    blocks checked."""
    pos = np.asarray(positions, dtype=np.int64).reshape(-1)
    per_seq = []
    for layer, (a, b) in zip(layers, spans, strict=True):
        if a < b:
            check_blocks(layer, int(pos[a:b].max()) + 1)
        per_seq.append(cache_rows(layer, pos[a:b]))
    first = layers[0]
    one_pool = first.table is not None and all(x.table is not None and x.k is first.k and x.block_size ==
                                               first.block_size for x in layers)
    if not one_pool or [a for a, _ in spans] != [0] + [b for _, b in spans[:-1]] or spans[-1][1] != pos.shape[0]:
        return BatchRows(per_seq)
    tables = np.full((len(layers), max(x.table.shape[0] for x in layers)), -1, dtype=np.int32)
    for i, x in enumerate(layers):
        tables[i, : x.table.shape[0]] = x.table
    seq_of = np.repeat(np.arange(len(layers), dtype=np.int32), [b - a for a, b in spans])
    return BatchRows(per_seq, np.concatenate(per_seq), tables, seq_of)


def attention_seqs(q: np.ndarray, k: np.ndarray, v: np.ndarray, layers: list[KVCacheLayer],
                   spans: list[tuple[int, int]], positions: np.ndarray, scale: float, n_swa: int = 0,
                   sinks: np.ndarray | None = None, rows: BatchRows | None = None) -> np.ndarray:
    """kv_store then attention for a ragged batch of sequences: rows [a, b) of q (n, n_head, dk), k, v (n, n_head_kv,
    d) and positions belong to the sequence whose cache is layers[i] for spans[i] = (a, b). The compiled kernels are
    called directly, with what the batch shares (checks, codes, views, sinks) done once: for decode steps of several
    sequences the wrappers' Python is most of attention's cost. Each sequence's rows equal kv_store + attention on
    its own cache, bit for bit. rows: seq_rows' of these layers and positions (a caller's memo for a step's other
    layers), else computed here. Paged sequences of one pool take one store and one attention call for all of them
    (one parallel region a layer instead of one a sequence; each row's outputs as alone)."""
    q = np.ascontiguousarray(q, dtype=np.float32)
    k, v = np.ascontiguousarray(k, dtype=np.float32), np.ascontiguousarray(v, dtype=np.float32)
    n, n_head, _ = q.shape
    pos32 = np.ascontiguousarray(positions, dtype=np.int32).reshape(-1)
    pos64 = pos32.astype(np.int64)
    if pos32.shape[0] != n or k.shape[0] != n or v.shape[0] != n:
        raise ValueError(f"attention_seqs: q, k, v and positions must have one row count, found {n}, {k.shape[0]}, "
                         f"{v.shape[0]}, {pos32.shape[0]}")
    first = layers[0]
    if q.shape[2] != first.head_dim_k or n_head % first.n_head_kv or any(
            (x.type_k, x.type_v, x.head_dim_k, x.head_dim_v, x.n_head_kv) !=
            (first.type_k, first.type_v, first.head_dim_k, first.head_dim_v, first.n_head_kv) for x in layers):
        raise ValueError("attention_seqs: the sequences' caches must share types and shapes with q")
    code_k, code_v = kv_type_code(first.type_k), kv_type_code(first.type_v)
    if sinks is None:
        sinks = NO_SINKS
    else:
        sinks = np.array(sinks, dtype=np.float32).reshape(-1)
        if sinks.shape[0] != n_head or not np.all(np.isfinite(sinks)):
            raise ValueError(f"attention_seqs: sinks must be {n_head} finite float32 values, found {sinks.shape[0]}")
    out = np.empty((n, n_head, first.head_dim_v), dtype=np.float32)
    if rows is None:
        rows = seq_rows(layers, spans, pos64)
    if rows.tables is not None:  # one pool: one call each
        bad = _store_kv(first.k, first.v, rows.rows, k, v, code_k, code_v)
        if bad >= 0:
            raise ValueError(f"kv_store: positions must lie in [0, {first.n_ctx}), found {pos64[bad]}")
        _attention_kernel(q, *kv_views(first.k, first.type_k), *kv_views(first.v, first.type_v), code_k, code_v,
                          pos32, int(pos32.max()) + 1, np.float32(scale), int(n_swa), np.float32(0.0),
                          _heads_per_item(n, first.n_head_kv, n_head), F16_TO_F32, sinks, rows.tables,
                          first.block_size, rows.seq_of, out)
        return out
    for layer, (a, b), r in zip(layers, spans, rows.per_seq, strict=True):
        if a == b:
            continue
        bad = _store_kv(layer.k, layer.v, r, k[a:b], v[a:b], code_k, code_v)
        if bad >= 0:
            raise ValueError(f"kv_store: positions must lie in [0, {layer.n_ctx}), found {pos64[a + bad]}")
        n_kv = int(pos32[a:b].max()) + 1
        _attention_kernel(q[a:b], *kv_views(layer.k, first.type_k), *kv_views(layer.v, first.type_v), code_k,
                          code_v, pos32[a:b], n_kv, np.float32(scale), int(n_swa),
                          np.float32(0.0), _heads_per_item(b - a, first.n_head_kv, n_head), F16_TO_F32, sinks,
                          *_one_table(layer, b - a), out[a:b])
    return out
