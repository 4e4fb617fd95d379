"""The MoE FFN of a layer in compiled code: `moe_ffn` (the router's product, routing by kernels_cpu.moe_route, the
selected experts' gate/up, the GLU, down, and the routing-weighted sum of the experts' outputs) and `moe_ffn_half`
(that between the residual add with its norm and the residual add, for few tokens), with no Python loop over
experts or tokens. The same arithmetic as the op-by-op path (hybrid/model/arch/blocks.py moe_ffn on CpuBackend),
so the results are the same bit for bit:

- the (token, slot) pairs are grouped by expert, then token (moe_route.group_pairs); an expert's pairs are the
  batch kernels_cpu.matmul would see. A group of SMALL_BATCH_TOKENS or more goes through the float GEMM
  (gemm_f32.gemm_rows on packed panels of its tokens), a smaller one through the integer dots (rows_dot of
  vec_dot_legacy / vec_dot_k), as matmul's crossover of 64 does (with VNNI matmul keeps the types of
  INT_DOTS_VNNI on the dots at any batch: such groups then differ from the op-by-op path by float32 rounding).
  Neither one's sums depend on the other tokens in the batch.
- one parallel region per projection: gate and up of every selected expert, then down; tasks of (expert, rows)
  claimed dynamically (kernels_cpu.sched). A gate/up task computes the same rows of both and their GLU. The
  activations are quantized once a token for gate/up and once a pair for down (each expert's own GLU output), as
  ggml's vec_dot_type.
- out[t] = sum of w * down(...) over t's experts in ascending expert order, as blocks.moe_ffn's scatter_add
  (no fused multiply-add: `_weighted_sum` is compiled without fastmath).

Expert weights: (w uint8 (n_expert, n_out, row_bytes) read-only, kind, family) with kind a vec_dot_legacy or
vec_dot_k type code and family fused_layer.FAM_LEGACY or FAM_K (0: no matrix; its w has 0 experts). Q4_1/Q5_1
groups of SMALL_BATCH_TOKENS or more are not covered (the GEMM's min term is a numpy product in kernels_cpu.matmul):
the caller keeps such batches on the op-by-op path.
"""

import numpy as np
from numba import njit, prange
from numba.typed import List

from kernels_cpu import act_quant, fused_layer, gemm_f32, norm, vec_dot_k, vec_dot_legacy
from kernels_cpu.activations import _glu_serial  # the serial GLU of glu_rows, for a task's rows
from kernels_cpu.fused_layer import FAM_K, FAM_LEGACY
from kernels_cpu.matmul import INT_ROWS_PER_BLOCK, INT_TASKS_PER_THREAD, SMALL_BATCH_TOKENS
from kernels_cpu.moe_route import group_pairs, route_topk
from kernels_cpu.quant_dot_float import matmul_f32
from kernels_cpu.sched import next_task

GEMM_ROWS = gemm_f32.ROWS_PER_TASK  # rows of a GEMM task (its scratch)
NR = gemm_f32.GEMM_NR  # tokens per packed panel
PAR_MIN_ROWS = 8  # the weighted sum of this many tokens or more runs in parallel
# activations of this many values or more are quantized in parallel: a decode step's 8 pairs of a 384-wide down
# projection (3072 values, a few microseconds) took longer to wake the workers for than to quantize
PAR_MIN_VALUES = 16384


@njit(cache=True, parallel=True)
def _quantize_par(x, leg, kq):
    # no fastmath: the quantizers must round as C (act_quant); leg / kq of 0 rows are not wanted
    n, n_in = x.shape
    xf = x.reshape(x.size)
    for t in prange(n):
        if leg[0].shape[0]:
            act_quant.quantize_q8_1_token(xf, leg[0].reshape(leg[0].size), leg[1], leg[2], t, n_in)
        if kq[0].shape[0]:
            act_quant.quantize_q8_k_token(xf, kq[0].reshape(kq[0].size), kq[1], kq[2], t, n_in)


@njit(cache=True)
def _acts(x, want_leg, want_k):
    """x float32 (n, n_in) quantized per row as the families want: leg = Q8_1's (qs, d, s), kq = Q8_K's
    (qs, d, bsums) (act_quant's arrays; 0 rows where not wanted)."""
    n, n_in = x.shape
    nl, nk = n if want_leg else 0, n if want_k else 0
    leg = (np.empty((nl, n_in), dtype=np.int8), np.empty((nl, n_in // 32), dtype=np.float32),
           np.empty((nl, n_in // 32), dtype=np.float32))
    kq = (np.empty((nk, n_in), dtype=np.int8), np.empty((nk, n_in // 256), dtype=np.float32),
          np.empty((nk, n_in // 16), dtype=np.int16))
    if n >= 2 and n * n_in >= PAR_MIN_VALUES:  # the same arithmetic either way (act_quant's per-token code)
        _quantize_par(x, leg, kq)
    else:
        if want_leg:
            act_quant.quantize_q8_1_rows(x, leg[0], leg[1], leg[2])
        if want_k:
            act_quant.quantize_q8_k_rows(x, kq[0], kq[1], kq[2])
    return leg, kq


@njit(cache=True, parallel=True, fastmath=True)
def _pack(qs, d, block, src, panels):
    """gemm_f32.pack_q8's panels of gathered tokens: panel P holds the rows src[panels[P, 0] + j] of the Q8
    activations (qs, d) for j < panels[P, 1] (the rest zero) -> float32 (n_panels, n_in * NR)."""
    n_in = qs.shape[1]
    xp = np.empty((panels.shape[0], n_in * NR), dtype=np.float32)
    qf = qs.reshape(qs.size)
    for pp in prange(panels.shape[0]):
        gemm_f32.pack_panel(xp, pp, qf, d, block, n_in, src, panels[pp, 0], panels[pp, 1])
    return xp


@njit(cache=True)
def _plan(used, offsets, n_out, n_threads):
    """The tasks of one projection of matrices of n_out rows -> (tasks int64 (n_tasks, 3): expert, first
    row, end row, the same rows of every matrix; panels int64 (n_panels, 2): first pair and token count of each
    GEMM panel; panel0 int64 (n_expert,): an expert's first panel). GEMM tasks (GEMM_ROWS rows) come first, the
    longest; the dot tasks split the small groups' rows into about INT_TASKS_PER_THREAD a thread, in whole blocks
    of INT_ROWS_PER_BLOCK."""
    n_expert = offsets.shape[0] - 1
    panel0 = np.zeros(n_expert, dtype=np.int64)
    dot_rows, n_gemm, n_panels = 0, 0, 0
    for e in used:
        cnt = offsets[e + 1] - offsets[e]
        if cnt >= SMALL_BATCH_TOKENS:
            n_gemm += (n_out + GEMM_ROWS - 1) // GEMM_ROWS
            panel0[e] = n_panels
            n_panels += (cnt + NR - 1) // NR
        else:
            dot_rows += n_out
    per = -(-dot_rows // (n_threads * INT_TASKS_PER_THREAD))
    per = max(1, -(-per // INT_ROWS_PER_BLOCK)) * INT_ROWS_PER_BLOCK
    n_dot = 0
    for e in used:
        if offsets[e + 1] - offsets[e] < SMALL_BATCH_TOKENS:
            n_dot += (n_out + per - 1) // per
    tasks = np.empty((n_gemm + n_dot, 3), dtype=np.int64)
    panels = np.empty((n_panels, 2), dtype=np.int64)
    i, j = 0, n_gemm
    for e in used:
        off, cnt = offsets[e], offsets[e + 1] - offsets[e]
        big = cnt >= SMALL_BATCH_TOKENS
        step = GEMM_ROWS if big else per
        for r0 in range(0, n_out, step):
            k = i if big else j
            tasks[k, 0], tasks[k, 1], tasks[k, 2] = e, r0, min(n_out, r0 + step)
            if big:
                i += 1
            else:
                j += 1
        if big:
            for p in range((cnt + NR - 1) // NR):
                panels[panel0[e] + p, 0] = off + p * NR
                panels[panel0[e] + p, 1] = min(NR, cnt - p * NR)
    return tasks, panels, panel0


@njit(inline="always")
def _rows(mat, f, e, r0, r1, off, cnt, src, leg, kq, xp_leg, xp_k, panel0, y, wd, c):
    """y[p, r0:r1] = rows r0..r1 of expert e's matrix of mat (flat bytes f) . the activations of row src[p], for
    the pairs p of e (off, cnt): the float GEMM for a group of SMALL_BATCH_TOKENS or more, else the integer dots."""
    kind, fam = mat[1], mat[2]
    n_out, rb = mat[0].shape[1], mat[0].shape[2]
    n_in = kq[0].shape[1] if fam == FAM_K else leg[0].shape[1]
    wf = f[e * n_out * rb:(e + 1) * n_out * rb]
    if cnt >= SMALL_BATCH_TOKENS:
        xp = xp_k if fam == FAM_K else xp_leg
        gemm_f32.gemm_rows(gemm_f32.K_QUANT if fam == FAM_K else gemm_f32.LEGACY, kind, wf, rb, n_in, r0, r1 - r0,
                           xp.reshape(xp.size), panel0[e], (cnt + NR - 1) // NR, cnt, y[off:off + cnt], wd, c)
    else:
        # blocks of rows stay in L1 while the group passes; one token (decode) reads them once: one call
        step = INT_ROWS_PER_BLOCK if cnt > 1 else r1 - r0
        for b0 in range(r0, r1, step):
            b1 = min(r1, b0 + step)
            for p in range(off, off + cnt):
                t = src[p]
                if fam == FAM_K:
                    vec_dot_k.rows_dot(kind, wf, rb, b0, b1, kq[0][t], kq[1][t], kq[2][t], y[p], n_in // 256)
                else:
                    vec_dot_legacy.rows_dot(kind, wf, rb, b0, b1, leg[0][t], leg[1][t], leg[2][t], y[p], n_in // 32)


@njit(inline="always")
def _add_bias(y, bias, e, r0, r1, off, cnt):
    """y[p, r0:r1] += bias[e, r0:r1] for the pairs p of expert e (bias of 0 rows: none), as numpy's float32 add."""
    if bias.shape[0]:
        for p in range(off, off + cnt):
            for r in range(r0, r1):
                y[p, r] += bias[e, r]


@njit(cache=True, parallel=True, fastmath=True)
def _project(n_threads, tasks, mat_a, mat_b, y_a, y_b, act, glu_op, table, offsets, src, leg, kq, xp_leg, xp_k,
             panel0, counter, bias_a, bias_b):
    """The parallel region of one projection: y_a[p] = expert e's mat_a . the activations of row src[p] for every
    pair p of e, and where mat_b is a matrix (family != 0) y_b[p] likewise and act[p] = glu(y_a[p], y_b[p]) (the
    GLU of the same rows, as activations.glu_rows computes it), over `tasks` (_plan) claimed dynamically. (Claiming
    a task ahead and prefetching the start of its rows did not pay on the Zen 4 guest: the hardware prefetcher
    finds a new stream by itself.)"""
    n_tasks = tasks.shape[0]
    two = mat_b[2] != 0
    fa, fb = mat_a[0].reshape(mat_a[0].size), mat_b[0].reshape(mat_b[0].size)  # linear byte offsets
    n_in = max(leg[0].shape[1], kq[0].shape[1])
    n_scratch = GEMM_ROWS * n_in if xp_leg.shape[0] + xp_k.shape[0] else 0
    for _ in prange(max(1, min(n_threads, n_tasks))):  # one claimer a thread
        wd = np.empty(n_scratch, dtype=np.float32)  # a GEMM task's rows, decoded
        c = np.empty(GEMM_ROWS * NR, dtype=np.float32)
        task = next_task(counter)
        while task < n_tasks:
            e, r0, r1 = tasks[task, 0], tasks[task, 1], tasks[task, 2]
            off, cnt = offsets[e], offsets[e + 1] - offsets[e]
            _rows(mat_a, fa, e, r0, r1, off, cnt, src, leg, kq, xp_leg, xp_k, panel0, y_a, wd, c)
            _add_bias(y_a, bias_a, e, r0, r1, off, cnt)
            if two:
                _rows(mat_b, fb, e, r0, r1, off, cnt, src, leg, kq, xp_leg, xp_k, panel0, y_b, wd, c)
                _add_bias(y_b, bias_b, e, r0, r1, off, cnt)
                for p in range(off, off + cnt):
                    _glu_serial(y_a[p, r0:r1], y_b[p, r0:r1], glu_op, table, act[p, r0:r1])
            task = next_task(counter)


@njit(cache=True)
def _projection(n_threads, x, src, offsets, used, mat_a, mat_b, y_a, y_b, act, glu_op, table, bias_a, bias_b):
    """y_a[p] = expert e's mat_a . x[src[p]] (+ bias_a[e]) for every pair p of every used expert e; where mat_b is a
    matrix (family != 0), y_b[p] likewise (+ bias_b[e]) and act[p] = glu(y_a[p], y_b[p]) (glu_op, table:
    activations.glu_rows'); a bias of 0 rows is none."""
    fam_a, fam_b = mat_a[2], mat_b[2]
    leg, kq = _acts(x, fam_a == FAM_LEGACY or fam_b == FAM_LEGACY, fam_a == FAM_K or fam_b == FAM_K)
    tasks, panels, panel0 = _plan(used, offsets, mat_a[0].shape[1], n_threads)
    xp_leg = np.empty((0, 0), dtype=np.float32)
    xp_k = np.empty((0, 0), dtype=np.float32)
    if panels.shape[0]:
        if leg[0].shape[0]:
            xp_leg = _pack(leg[0], leg[1], 32, src, panels)
        if kq[0].shape[0]:
            xp_k = _pack(kq[0], kq[1], 256, src, panels)
    counter = np.zeros(8, dtype=np.int64)  # a fresh task counter (kernels_cpu.sched)
    _project(n_threads, tasks, mat_a, mat_b, y_a, y_b, act, glu_op, table, offsets, src, leg, kq, xp_leg, xp_k,
             panel0, counter, bias_a, bias_b)


@njit(inline="always")
def _weighted_row(ids, weights, pair_of, d, out, t):
    n_used = ids.shape[1]
    order = np.empty(n_used, dtype=np.int64)  # t's slots by ascending expert (blocks.moe_ffn's order)
    for k in range(n_used):
        j = k
        while j > 0 and ids[t, order[j - 1]] > ids[t, k]:
            order[j] = order[j - 1]
            j -= 1
        order[j] = k
    row = out[t]
    row[:] = 0.0
    for k in order:
        p, w = pair_of[t, k], weights[t, k]
        for j in range(row.shape[0]):
            row[j] += w * d[p, j]


@njit(cache=True, parallel=True)
def _weighted_sum_par(ids, weights, pair_of, d, out):
    for t in prange(ids.shape[0]):
        _weighted_row(ids, weights, pair_of, d, out, t)


@njit(cache=True)
def _weighted_sum(ids, weights, pair_of, d, out):
    """out[t] = sum over t's slots k, in ascending expert order, of weights[t, k] * d[pair_of[t, k]]: each term
    rounded to float32, then added (no fastmath, no fused multiply-add), as numpy's out[rows] += w[:, None] * y."""
    if ids.shape[0] >= PAR_MIN_ROWS:
        _weighted_sum_par(ids, weights, pair_of, d, out)
    else:
        for t in range(ids.shape[0]):
            _weighted_row(ids, weights, pair_of, d, out, t)


_NO_BIAS = np.empty((0, 0), dtype=np.float32)


@njit(cache=True)
def moe_experts(n_threads, h, ids, weights, gate, up, down, empty, glu_op, table):
    """The experts of a routed batch: h float32 (n_tok, n_embd), ids int64 / weights float32 (n_tok, n_used) ->
    float32 (n_tok, n_embd). gate, up, down: expert weights (module docstring); empty: an expert weight of family
    0; glu_op: kernels_cpu.activations' (0 silu, 2 gelu through the fp16 table `table`, 3 swiglu_oai)."""
    return moe_experts_biased(n_threads, h, ids, weights, gate, up, down, empty, glu_op, table, _NO_BIAS, _NO_BIAS,
                              _NO_BIAS)


@njit(cache=True)
def moe_experts_biased(n_threads, h, ids, weights, gate, up, down, empty, glu_op, table, bias_gate, bias_up,
                       bias_down):
    """moe_experts with per-expert biases added to each projection's output (gpt-oss): bias_* float32
    (n_expert, n_out) or of 0 rows (none), added as blocks.moe_ffn adds them (a float32 add after the product)."""
    n_expert, n_ff = gate[0].shape[0], gate[0].shape[1]
    n_embd = down[0].shape[1]
    offsets, pair_tok, pair_of, used = group_pairs(ids, n_expert)
    n_pairs = pair_tok.shape[0]
    g = np.empty((n_pairs, n_ff), dtype=np.float32)  # pairs in group order
    u = np.empty((n_pairs, n_ff), dtype=np.float32)
    act = np.empty((n_pairs, n_ff), dtype=np.float32)
    _projection(n_threads, h, pair_tok, offsets, used, gate, up, g, u, act, glu_op, table, bias_gate, bias_up)
    d = np.empty((n_pairs, n_embd), dtype=np.float32)
    none = np.empty((0, 0), dtype=np.float32)
    _projection(n_threads, act, np.arange(n_pairs), offsets, used, down, empty, d, none, none, glu_op, table,
                bias_down, _NO_BIAS)
    out = np.empty((h.shape[0], n_embd), dtype=np.float32)
    _weighted_sum(ids, weights, pair_of, d, out)
    return out


@njit(cache=True)
def moe_ffn(n_threads, h, logits, router, n_used, normalize, gate, up, down, empty, glu_op, table):
    """blocks.moe_ffn of the normed h float32 (n_tok, n_embd) -> (n_tok, n_embd): router logits float32
    (n_tok, n_expert) given, or, when logits has another number of rows, router float32 (n_expert, n_embd) times h
    here (quant_dot_float.matmul_f32: kernels_cpu.matmul's F32 product below gemm_min_tokens("F32")); then
    moe_route.route_topk and moe_experts."""
    if logits.shape[0] != h.shape[0]:
        logits = np.empty((h.shape[0], router.shape[0]), dtype=np.float32)
        matmul_f32(router, h, logits)
    ids, weights = route_topk(logits, n_used, normalize)
    return moe_experts(n_threads, h, ids, weights, gate, up, down, empty, glu_op, table)


@njit(cache=True)
def moe_ffn_half(n_threads, x, a, eps, ffn_norm, router, n_used, normalize, gate, up, down, empty, glu_op, table):
    """The rest of blocks.layer_forward after the attention part a for an MoE layer of few tokens, as
    fused_layer.ffn_half for a dense one: x + a, its norm (ffn_norm f32 (n_embd,)), moe_ffn with the router
    (float32 (n_expert, n_embd)) multiplied here, and the residual -> (n_tok, n_embd) f32."""
    x = x + a
    h = np.empty_like(x)
    norm.rms_norm_rows(x, ffn_norm, np.bool_(True), eps, h)
    no_logits = np.empty((0, 0), dtype=np.float32)
    return x + moe_ffn(n_threads, h, no_logits, router, n_used, normalize, gate, up, down, empty, glu_op, table)


@njit(cache=True)
def moe_layer(n_threads, x, cos_t, sin_t, n_rot, positions, positions64, n_kv, hpi, kv_k, kv_v, code_k, code_v,
              kv_table, kv_bs, eps, attn_norm, qkv, out_proj, empty_w, empty_y, biases, has_bias, q_norm, k_norm,
              has_qk_norm, n_head, n_head_kv, hd_k, hd_v, neox, q_scale, has_q_scale, kq_scale, n_swa, lut, ffn_norm,
              router, n_used, normalize, gate, up, down, empty, glu_op, table):
    """A whole MoE layer of few tokens in one call: fused_layer.attention_half (without a post-attention norm) then
    moe_ffn_half (its arguments from ffn_norm on) -> (n_tok, n_embd) f32. The arguments that change with the
    batch come first (the caller keeps the rest, a layer's, as one tuple). One call instead of two: each costs
    tens of microseconds to make after the weights' streams have swept the caches. kv_table, kv_bs: the cache's
    block table and block size (kv_cache.kernel_table: a paged sequence's, or [0] and the rows of a contiguous
    cache); positions64 are the rows the batch's K/V go to."""
    a = fused_layer.attention_half(n_threads, x, eps, attn_norm, qkv, out_proj, empty_w, empty_y, biases, has_bias,
                                   q_norm, k_norm, has_qk_norm, n_head, n_head_kv, hd_k, hd_v, cos_t, sin_t, n_rot,
                                   neox, q_scale, has_q_scale, kv_k, kv_v, code_k, code_v, positions, positions64,
                                   n_kv, kq_scale, n_swa, hpi, lut, kv_table, kv_bs, q_norm, np.bool_(False))
    return moe_ffn_half(n_threads, x, a, eps, ffn_norm, router, n_used, normalize, gate, up, down, empty, glu_op,
                        table)


@njit(cache=True)
def layer_list(own):
    """A typed List holding one layer's own arguments of moe_layer (kv_k .. table) -> the List. Made and grown in
    compiled code: a List made from Python compiles its methods in every process."""
    layers = List()
    layers.append(own)
    return layers


@njit(cache=True)
def add_layer(layers, own):
    """Append a layer's own arguments to layer_list's List -> its index."""
    layers.append(own)
    return len(layers) - 1


@njit(cache=True)
def moe_layer_at(n_threads, x, cos_t, sin_t, n_rot, positions, positions64, n_kv, hpi, layers, il):
    """moe_layer with the layer's own arguments (kv_k .. table) at index il of the typed List layers (layer_list):
    a call unboxes one List instead of some 35 arrays and tuples (after the weights' streams have swept the
    caches, a 44-argument call cost 20-30 us to enter and leave, a layer's Python as much again)."""
    return moe_layer(n_threads, x, cos_t, sin_t, n_rot, positions, positions64, n_kv, hpi, *layers[il])
