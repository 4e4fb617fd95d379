"""MoE routing in compiled code: the router's softmax and top-k (`route_topk`, hybrid.model.arch.blocks.route bit
for bit), and the (token, slot) pairs grouped by expert (`group_pairs`), the order in which kernels_cpu.moe runs them.

blocks.route takes the softmax in float64 (exp of the float32 differences, a left-to-right sum, the quotient
rounded to float32 once) and the renormalizing sum too, as ggml sums in double; the n_used largest p (ties: the
lower expert index first, its stable argsort of -p), renormalized when asked with the sum clamped at
6.103515625e-5 (llama.cpp). Here the same operations in the same order, exp from libm: it and numpy's float64 exp
differ in the last bit of a double now and then, which the rounding to float32 hides (none in 1e8 draws; the odds are
about 2**-29 a value). No fastmath: every operation rounds as in C.
"""

import numpy as np
from numba import njit

MOE_SUM_MIN = np.float32(6.103515625e-5)  # llama.cpp's clamp of the renormalizing sum (2**-14)


@njit(cache=True)
def route_topk(logits, n_used, normalize):
    """logits float32 (n_tok, n_expert) -> (ids int64 (n_tok, n_used), weights float32 (n_tok, n_used)), each
    token's experts in order of falling p (equal p: lower index first)."""
    n_tok, n_expert = logits.shape
    ids = np.empty((n_tok, n_used), dtype=np.int64)
    weights = np.empty((n_tok, n_used), dtype=np.float32)
    e = np.empty(n_expert, dtype=np.float64)
    p = np.empty(n_expert, dtype=np.float32)
    taken = np.empty(n_expert, dtype=np.bool_)
    for t in range(n_tok):
        m = logits[t, 0]
        for j in range(1, n_expert):
            m = max(m, logits[t, j])
        s = 0.0
        for j in range(n_expert):
            e[j] = np.exp(np.float64(logits[t, j] - m))
            s += e[j]
        for j in range(n_expert):
            p[j] = np.float32(e[j] / s)
            taken[j] = False
        total = 0.0
        for k in range(n_used):
            best = -1
            for j in range(n_expert):  # strictly greater: the first of equal p wins
                if not taken[j] and (best < 0 or p[j] > p[best]):
                    best = j
            taken[best] = True
            ids[t, k] = best
            weights[t, k] = p[best]
            total += np.float64(p[best])
        if normalize:
            denom = max(np.float32(total), MOE_SUM_MIN)
            for k in range(n_used):
                weights[t, k] = weights[t, k] / denom
    return ids, weights


@njit(cache=True)
def group_pairs(ids, n_expert):
    """The (token, slot) pairs of ids int64 (n_tok, n_used) sorted by expert, then token (blocks.moe_ffn's order:
    np.nonzero(ids == e) per expert) -> (offsets int64 (n_expert + 1,): expert e's pairs are
    offsets[e]..offsets[e + 1]; pair_tok int64 (n_pairs,): each pair's token; pair_of int64 (n_tok, n_used): where
    pair (t, slot) went; used int64: the experts with pairs, ascending)."""
    n_tok, n_used = ids.shape
    counts = np.zeros(n_expert, dtype=np.int64)
    for t in range(n_tok):
        for k in range(n_used):
            counts[ids[t, k]] += 1
    offsets = np.zeros(n_expert + 1, dtype=np.int64)
    n_busy = 0
    for e in range(n_expert):
        offsets[e + 1] = offsets[e] + counts[e]
        n_busy += counts[e] > 0
    used = np.empty(n_busy, dtype=np.int64)
    i = 0
    for e in range(n_expert):
        if counts[e]:
            used[i] = e
            i += 1
    fill = offsets[:n_expert].copy()
    pair_tok = np.empty(n_tok * n_used, dtype=np.int64)
    pair_of = np.empty((n_tok, n_used), dtype=np.int64)
    for t in range(n_tok):
        for k in range(n_used):
            e = ids[t, k]
            pair_tok[fill[e]] = t
            pair_of[t, k] = fill[e]
            fill[e] += 1
    return offsets, pair_tok, pair_of, used
