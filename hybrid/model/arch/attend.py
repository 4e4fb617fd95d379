"""Storing a batch's keys and values and attending to them, for one sequence's cache or a ragged batch of them."""

from __future__ import annotations

import numpy as np


def attend(be, kv, il: int, q, k, v, positions: np.ndarray, kq_scale: float, n_swa: int, sinks=None):
    """Store k, v and attend q (n, n_head, hd_k) -> (n, n_head, hd_v). kv is one sequence's KVCache, or a ragged
    batch (hybrid.kv.batch.KVBatch: it has `seqs`, each a cache and its rows of the stacked batch): then each
    sequence stores and attends through its own cache (one call for all of them where the backend has
    attend_seqs and takes the batch, else a call per sequence)."""
    seqs = getattr(kv, "seqs", None)
    if seqs is None:
        be.kv_store(kv, il, k, v, positions)
        if sinks is None:
            return be.attention(q, kv, il, positions, kq_scale, n_swa)
        return be.attention(q, kv, il, positions, kq_scale, n_swa, sinks=sinks)
    fused = getattr(be, "attend_seqs", None)  # one call for every sequence (None: the backend declines the batch)
    o = None if fused is None else fused(kv, il, q, k, v, positions, kq_scale, n_swa, sinks)
    if o is not None:
        return o
    out = be.zeros((q.shape[0], q.shape[1], v.shape[2]))
    extra = {} if sinks is None else {"sinks": sinks}
    for s in seqs:
        a, b = s.start, s.end
        be.kv_store(s.cache, il, k[a:b], v[a:b], positions[a:b])
        out[a:b] = be.attention(q[a:b], s.cache, il, positions[a:b], kq_scale, n_swa, **extra)
    return out
