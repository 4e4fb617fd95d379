"""A dense transformer layer's ops for a few tokens (decode) in two compiled calls, `attention_half` and
`ffn_half`, instead of ~16 Python-level backend calls: the same kernels in the same order, so the results equal
the op-by-op path (`hybrid/arch/blocks.py` on CpuBackend) bit for bit.

Why: on a small model every op of a decode layer is a few microseconds of work, and each Python-level call costs
about as much again, more after a matmul has streamed its weights through the caches (Gemma 3 270M: ~5 ms of a
~30 ms token went to the ~270 small-op calls and the Python between them). Only the weight types of the
integer-dot families (`FAM_LEGACY`: Q8_0 activations; `FAM_K`: Q8_K) and batches below the float GEMM's
threshold take this path; the caller checks both.

Weights: uint8 (n_out, row_bytes) read-only raw blocks, `kinds`/`fams` their type codes and families (int64);
an unused slot is `empty_w` (0 rows) with output `empty_y`. Activations float32 (n_tok, n).
"""

import numpy as np
from numba import njit

from kernels_cpu import act_quant, attention, kv_cache, norm, rope, vec_dot_k, vec_dot_legacy
from kernels_cpu.activations import GLU_SERIAL_MAX_ELEMS, _glu_par, _glu_serial

FAM_LEGACY, FAM_K = 1, 2
TASKS_PER_THREAD, ROWS_PER_BLOCK = 4, 16  # kernels_cpu.matmul's INT_TASKS_PER_THREAD, INT_ROWS_PER_BLOCK


@njit(inline="always")
def _slot(w, fam, want, empty_w):
    return w if fam == want else empty_w


@njit(cache=True)
def int_dots(x, w0, w1, w2, k0, k1, k2, f0, f1, f2, y0, y1, y2, empty_w, empty_y, n_threads):
    """y_i = x @ w_i.T for up to three weights (f_i = 0: unused), one driver call per family on x quantized once
    for it: what kernels_cpu.matmul.matmuls does below GEMM_MIN_TOKENS."""
    for fam in (FAM_LEGACY, FAM_K):
        if f0 != fam and f1 != fam and f2 != fam:
            continue
        a0, a1, a2 = _slot(w0, f0, fam, empty_w), _slot(w1, f1, fam, empty_w), _slot(w2, f2, fam, empty_w)
        c0 = k0 if f0 == fam else 0  # an unused slot's kind is 0, as matmul's padding
        c1 = k1 if f1 == fam else 0
        c2 = k2 if f2 == fam else 0
        o0 = y0 if f0 == fam else empty_y
        o1 = y1 if f1 == fam else empty_y
        o2 = y2 if f2 == fam else empty_y
        per_task = -(-(a0.shape[0] + a1.shape[0] + a2.shape[0]) // (n_threads * TASKS_PER_THREAD))
        per_task = -(-per_task // ROWS_PER_BLOCK) * ROWS_PER_BLOCK
        n_tok, n_in = x.shape
        if fam == FAM_LEGACY:
            qs = np.empty((n_tok, n_in), dtype=np.int8)
            d = np.empty((n_tok, n_in // 32), dtype=np.float32)
            act_quant.quantize_q8_0_rows(x, qs, d)
            vec_dot_legacy.matmul_q8_0_act(a0, a1, a2, c0, c1, c2, qs, d, o0, o1, o2, per_task, ROWS_PER_BLOCK,
                                           n_threads, np.zeros(8, dtype=np.int64))  # a fresh task counter (sched)
        else:
            qs = np.empty((n_tok, n_in), dtype=np.int8)
            d = np.empty((n_tok, n_in // 256), dtype=np.float32)
            bsums = np.empty((n_tok, n_in // 16), dtype=np.int16)
            act_quant.quantize_q8_k_rows(x, qs, d, bsums)
            vec_dot_k.matmul_q8_k_act(a0, a1, a2, c0, c1, c2, qs, d, bsums, o0, o1, o2, per_task, ROWS_PER_BLOCK,
                                      n_threads, np.zeros(8, dtype=np.int64))  # a fresh task counter (sched)


@njit(inline="always")
def _norm(x, w, eps):
    out = np.empty_like(x)
    norm.rms_norm_rows(x, w, True, eps, out)
    return out


@njit(cache=True)
def attention_half(n_threads, x, eps, attn_norm, ws, kinds, fams, empty_w, empty_y,
                   biases, has_bias, q_norm, k_norm, has_qk_norm, n_head, n_head_kv, hd_k, hd_v,
                   cos_t, sin_t, n_rot, neox, q_scale, has_q_scale,
                   kv_k, kv_v, code_k, code_v, positions, n_kv, kq_scale, n_swa, hpi, lut,
                   post_norm, has_post_norm):
    """The attention block of blocks.layer_forward: rms_norm, q/k/v (+ bias), QK-norm, RoPE, q scale, the KV
    store, attention, the output projection (and gemma3's post-attention norm) -> (n_tok, n_embd) f32.

    ws (q, k, v, output) weights; biases (q, k, v) f32 (unused unless has_bias); kv_k/kv_v: the layer's cache
    (kv_cache.kv_views of k and v, then the raw u8 array); cos_t/sin_t: rope tables of `positions`."""
    n_tok = x.shape[0]
    h = _norm(x, attn_norm, eps)
    q = np.empty((n_tok, n_head * hd_k), dtype=np.float32)
    k = np.empty((n_tok, n_head_kv * hd_k), dtype=np.float32)
    v = np.empty((n_tok, n_head_kv * hd_v), dtype=np.float32)
    int_dots(h, ws[0], ws[1], ws[2], kinds[0], kinds[1], kinds[2], fams[0], fams[1], fams[2], q, k, v,
             empty_w, empty_y, n_threads)
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
        norm.rms_norm_rows(q3.reshape((n_tok * n_head, hd_k)), q_norm, True, eps,
                                     qn.reshape((n_tok * n_head, hd_k)))
        norm.rms_norm_rows(k3.reshape((n_tok * n_head_kv, hd_k)), k_norm, True, eps,
                                     kn.reshape((n_tok * n_head_kv, hd_k)))
        q3, k3 = qn, kn
    rope.rope_apply_rows(q3, cos_t, sin_t, n_rot, neox, q3)
    rope.rope_apply_rows(k3, cos_t, sin_t, n_rot, neox, k3)
    if has_q_scale:
        q3 = q3 * q_scale
    kv_cache._store_kv(kv_k[2], kv_v[2], positions, k3, v3, code_k, code_v)
    o = np.empty((n_tok, n_head, hd_v), dtype=np.float32)
    attention._attention_kernel(q3, kv_k[0], kv_k[1], kv_k[2], kv_k[3], kv_v[0], kv_v[1], kv_v[2], kv_v[3],
                                code_k, code_v, positions, n_kv, kq_scale, n_swa, np.float32(0.0), hpi, lut, o)
    a = np.empty((n_tok, ws[3].shape[0]), dtype=np.float32)
    int_dots(o.reshape((n_tok, n_head * hd_v)), ws[3], empty_w, empty_w, kinds[3], 0, 0, fams[3], 0, 0, a,
             empty_y, empty_y, empty_w, empty_y, n_threads)
    if has_post_norm:
        a = _norm(a, post_norm, eps)
    return a


@njit(cache=True)
def ffn_half(n_threads, x, a, eps, ffn_norm, ws, kinds, fams, empty_w, empty_y, glu_op, gelu_table, post_norm,
             has_post_norm):
    """The rest of blocks.layer_forward after the attention block a: x + a, its norm, gate/up, the GLU (op as
    kernels_cpu.activations: 0 silu, 2 gelu through the fp16 table), down (and gemma3's post-FFN norm), and the
    residual -> (n_tok, n_embd) f32. ws: (gate, up, down)."""
    n_tok = x.shape[0]
    x = x + a
    h = _norm(x, ffn_norm, eps)
    n_ff = ws[0].shape[0]
    g = np.empty((n_tok, n_ff), dtype=np.float32)
    u = np.empty((n_tok, n_ff), dtype=np.float32)
    int_dots(h, ws[0], ws[1], empty_w, kinds[0], kinds[1], 0, fams[0], fams[1], 0, g, u, empty_y, empty_w,
             empty_y, n_threads)
    act = np.empty((n_tok, n_ff), dtype=np.float32)
    if g.size <= GLU_SERIAL_MAX_ELEMS:
        _glu_serial(g.reshape(g.size), u.reshape(u.size), glu_op, gelu_table, act.reshape(act.size))
    else:
        _glu_par(g.reshape(g.size), u.reshape(u.size), glu_op, gelu_table, act.reshape(act.size))
    f = np.empty((n_tok, ws[2].shape[0]), dtype=np.float32)
    int_dots(act, ws[2], empty_w, empty_w, kinds[2], 0, 0, fams[2], 0, 0, f, empty_y, empty_y, empty_w, empty_y,
             n_threads)
    if has_post_norm:
        f = _norm(f, post_norm, eps)
    return x + f
