"""The k largest logits of a vocabulary in one compiled pass (the sampler's top-k): a heap of the k best seen so
far, each logit compared once with its worst; then the k sorted. O(n + k log k), no copy of the logits, where
numpy's argpartition negates and partitions the whole vocabulary (262144 logits for Gemma 3: ~1.5 ms a token
against ~0.2 here). Ties go to the lower id, at the boundary too; NaN ranks below every number."""

from __future__ import annotations

import numpy as np
from numba import njit

MAX_K = 256  # above this the sort of the k is the cost: hybrid.generate.sampling.top_k uses numpy's partition


@njit(inline="always")
def _key(v):
    return -np.inf if v != v else v  # NaN below everything


@njit(inline="always")
def _worse(va, ia, vb, ib):
    """Whether (va, ia) ranks below (vb, ib): a lower value, or an equal one with a higher id."""
    return va < vb or (va == vb and ia > ib)


@njit(inline="always")
def _sift_down(hv, hi, k, j):
    """Restore the heap property below position j: every parent ranks below (is worse than) its children."""
    while True:
        c = 2 * j + 1
        if c >= k:
            return
        if c + 1 < k and _worse(hv[c + 1], hi[c + 1], hv[c], hi[c]):
            c += 1
        if not _worse(hv[c], hi[c], hv[j], hi[j]):
            return
        hv[j], hv[c] = hv[c], hv[j]
        hi[j], hi[c] = hi[c], hi[j]
        j = c


@njit(cache=True)
def top_k_ids(logits, k):
    """ids int64 (k,) of the k largest of logits (float32 (n,), 0 < k <= n), sorted descending, ties to the lower
    id."""
    n = logits.shape[0]
    hv = np.empty(k, dtype=np.float32)
    hi = np.empty(k, dtype=np.int64)
    for j in range(k):
        hv[j] = _key(logits[j])
        hi[j] = j
    for j in range(k // 2 - 1, -1, -1):
        _sift_down(hv, hi, k, j)
    for j in range(k, n):
        v = logits[j]
        if v > hv[0]:  # (an equal value has a higher id than the root's: it ranks below)
            hv[0] = v
            hi[0] = j
            _sift_down(hv, hi, k, 0)
    out = np.empty(k, dtype=np.int64)
    for m in range(k - 1, -1, -1):  # pop the worst into the last place
        out[m] = hi[0]
        hv[0], hi[0] = hv[m], hi[m]  # the heap shrinks to its first m entries
        _sift_down(hv, hi, m, 0)
    return out
