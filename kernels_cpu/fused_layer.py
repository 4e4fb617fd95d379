"""A dense transformer layer for a few tokens (decode) in two compiled calls, `attention_half` and `ffn_half`,
instead of ~16 Python-level backend calls: the same kernels in the same order, so the results equal the op-by-op
path (`hybrid/model/arch/blocks.py` on CpuBackend) bit for bit.

Why: on a small model every op of a decode layer is a few microseconds of work, and each Python-level call costs
about as much again, more after a matmul has streamed its weights through the caches (Gemma 3 270M: ~5 ms of a
~30 ms token went to the ~270 small-op calls and the Python between them). Only the weight types of the
integer-dot families (`FAM_LEGACY`: Q8_0 activations; `FAM_K`: Q8_K) and batches below the float GEMM's
threshold take this path; the caller checks both.

Norms, RoPE and the GLU go through the op-by-op path's own choosers of their serial or parallel form
(norm.rms_norm_rows, rope.rope_apply_rows, activations.glu_rows): the two forms may round apart. Weights: uint8
(n_out, row_bytes) read-only raw blocks, `kinds`/`fams` their type codes and families (int64); an unused slot is
`empty_w` (0 rows) with output `empty_y`. Activations float32 (n_tok, n).
"""

import numpy as np
from numba import njit

from kernels_cpu import act_quant, attention, kv_cache, norm, rope, vec_dot_k, vec_dot_legacy
from kernels_cpu.activations import glu_rows
from kernels_cpu.matmul import INT_ROWS_PER_BLOCK as ROWS_PER_BLOCK
from kernels_cpu.matmul import INT_TASKS_PER_THREAD as TASKS_PER_THREAD

FAM_LEGACY, FAM_K = 1, 2


@njit(cache=True)
def int_dots(x, mats, ys, empty_w, empty_y, n_threads):
    """ys[i] = x @ w_i.T for the up to three weights of mats = ((w0, w1, w2), kinds, fams) (fams[i] = 0: unused
    slot, weight empty_w, output empty_y), one driver call per family on x quantized once for it: what
    kernels_cpu.matmul.matmuls does for few tokens. Every call site passes the same types (one compile)."""
    ws, kinds, fams = mats
    n_tok, n_in = x.shape
    rows_per_block = np.int64(ROWS_PER_BLOCK)
    for fam in (FAM_LEGACY, FAM_K):
        if fams[0] != fam and fams[1] != fam and fams[2] != fam:
            continue
        a0 = ws[0] if fams[0] == fam else empty_w
        a1 = ws[1] if fams[1] == fam else empty_w
        a2 = ws[2] if fams[2] == fam else empty_w
        c0 = kinds[0] if fams[0] == fam else 0  # an unused slot's kind is 0, as matmul's padding
        c1 = kinds[1] if fams[1] == fam else 0
        c2 = kinds[2] if fams[2] == fam else 0
        o0 = ys[0] if fams[0] == fam else empty_y
        o1 = ys[1] if fams[1] == fam else empty_y
        o2 = ys[2] if fams[2] == fam else empty_y
        per_task = -(-(a0.shape[0] + a1.shape[0] + a2.shape[0]) // (n_threads * TASKS_PER_THREAD))
        per_task = -(-per_task // ROWS_PER_BLOCK) * ROWS_PER_BLOCK
        counter = np.zeros(8, dtype=np.int64)  # a fresh task counter (kernels_cpu.sched)
        if fam == FAM_LEGACY:
            qs = np.empty((n_tok, n_in), dtype=np.int8)
            d = np.empty((n_tok, n_in // 32), dtype=np.float32)
            sums = np.empty((n_tok, n_in // 32), dtype=np.float32)
            act_quant.quantize_q8_1_rows(x, qs, d, sums)
            vec_dot_legacy.matmul_q8_0_act(a0, a1, a2, c0, c1, c2, qs, d, sums, o0, o1, o2, per_task,
                                           rows_per_block, n_threads, counter)
        else:
            qs = np.empty((n_tok, n_in), dtype=np.int8)
            d = np.empty((n_tok, n_in // 256), dtype=np.float32)
            bsums = np.empty((n_tok, n_in // 16), dtype=np.int16)
            act_quant.quantize_q8_k_rows(x, qs, d, bsums)
            vec_dot_k.matmul_q8_k_act(a0, a1, a2, c0, c1, c2, qs, d, bsums, o0, o1, o2, per_task, rows_per_block,
                                      n_threads, counter)


@njit(inline="always")
def _norm(x, w, eps):
    out = np.empty_like(x)
    norm.rms_norm_rows(x, w, np.bool_(True), eps, out)  # np.bool_: no literal in the signature
    return out


@njit(cache=True)
def attention_half(n_threads, x, eps, attn_norm, qkv, out_proj, empty_w, empty_y,
                   biases, has_bias, q_norm, k_norm, has_qk_norm, n_head, n_head_kv, hd_k, hd_v,
                   cos_t, sin_t, n_rot, neox, q_scale, has_q_scale,
                   kv_k, kv_v, code_k, code_v, positions, positions64, n_kv, kq_scale, n_swa, hpi, lut,
                   kv_table, kv_bs, post_norm, has_post_norm):
    """The attention block of blocks.layer_forward: rms_norm, q/k/v (+ bias), QK-norm, RoPE, q scale, the KV
    store, attention, the output projection (and gemma3's post-attention norm) -> (n_tok, n_embd) f32.

    qkv, out_proj: int_dots' weight tuples; biases (q, k, v) f32 (unused unless has_bias); kv_k/kv_v: the layer's
    cache as kv_cache.kv_views (f32, u16, u8, i8 views) and its (table, bs) (kv_cache.kernel_table); cos_t/sin_t:
    rope tables of `positions` (int32); positions64: the rows the batch's K/V go to (int64: the positions
    themselves, or through a paged cache's table: kv_cache.cache_rows)."""
    n_tok = x.shape[0]
    h = _norm(x, attn_norm, eps)
    q = np.empty((n_tok, n_head * hd_k), dtype=np.float32)
    k = np.empty((n_tok, n_head_kv * hd_k), dtype=np.float32)
    v = np.empty((n_tok, n_head_kv * hd_v), dtype=np.float32)
    int_dots(h, qkv, (q, k, v), empty_w, empty_y, n_threads)
    if has_bias:
        q = q + biases[0]
        k = k + biases[1]
        v = v + biases[2]
    q3 = q.reshape((n_tok, n_head, hd_k))
    k3 = k.reshape((n_tok, n_head_kv, hd_k))
    v3 = v.reshape((n_tok, n_head_kv, hd_v))
    if has_qk_norm:
        qn = np.empty_like(q3)
        kn = np.empty_like(k3)
        norm.rms_norm_rows(q3.reshape((n_tok * n_head, hd_k)), q_norm, np.bool_(True), eps,
                           qn.reshape((n_tok * n_head, hd_k)))
        norm.rms_norm_rows(k3.reshape((n_tok * n_head_kv, hd_k)), k_norm, np.bool_(True), eps,
                           kn.reshape((n_tok * n_head_kv, hd_k)))
        q3, k3 = qn, kn
    rope.rope_apply_rows(q3, cos_t, sin_t, n_rot, neox, q3)
    rope.rope_apply_rows(k3, cos_t, sin_t, n_rot, neox, k3)
    if has_q_scale:
        q3 = q3 * q_scale
    kv_cache._store_kv(kv_k[2], kv_v[2], positions64, k3, v3, code_k, code_v)
    o = np.empty((n_tok, n_head, hd_v), dtype=np.float32)
    attention._attention_kernel(q3, kv_k[0], kv_k[1], kv_k[2], kv_k[3], kv_v[0], kv_v[1], kv_v[2], kv_v[3],
                                code_k, code_v, positions, n_kv, kq_scale, n_swa, np.float32(0.0), hpi, lut,
                                np.zeros(0, dtype=np.float32), kv_table.reshape((1, kv_table.shape[0])), kv_bs,
                                np.zeros(n_tok, dtype=np.int32), o)  # no softcap, no sinks; one sequence
    a = np.empty((n_tok, out_proj[0][0].shape[0]), dtype=np.float32)
    int_dots(o.reshape((n_tok, n_head * hd_v)), out_proj, (a, empty_y, empty_y), empty_w, empty_y, n_threads)
    if has_post_norm:
        a = _norm(a, post_norm, eps)
    return a


@njit(cache=True)
def ffn_half(n_threads, x, a, eps, ffn_norm, gate_up, down, empty_w, empty_y, glu_op, gelu_table, post_norm,
             has_post_norm):
    """The rest of blocks.layer_forward after the attention part a, for a dense FFN: x + a, its norm, gate/up, the
    GLU (op as kernels_cpu.activations: 0 silu, 2 gelu through the fp16 table), down (and gemma3's post-FFN norm),
    and the residual -> (n_tok, n_embd) f32. gate_up, down: int_dots' weight tuples."""
    n_tok = x.shape[0]
    x = x + a
    h = _norm(x, ffn_norm, eps)
    n_ff = gate_up[0][0].shape[0]
    g = np.empty((n_tok, n_ff), dtype=np.float32)
    u = np.empty((n_tok, n_ff), dtype=np.float32)
    int_dots(h, gate_up, (g, u, empty_y), empty_w, empty_y, n_threads)
    act = np.empty((n_tok, n_ff), dtype=np.float32)
    glu_rows(g.reshape(g.size), u.reshape(u.size), glu_op, gelu_table, act.reshape(act.size))
    f = np.empty((n_tok, down[0][0].shape[0]), dtype=np.float32)
    int_dots(act, down, (f, empty_y, empty_y), empty_w, empty_y, n_threads)
    if has_post_norm:
        f = _norm(f, post_norm, eps)
    return x + f
