"""Matrix products of few tokens (decode) for the float weight types F32, F16 and BF16; kernels_cpu.matmul
sends batches of gemm_min_tokens(type) (64) or more to gemm_f32.

ggml converts the activations to the weight's vec_dot_type first (F16 -> fp16, BF16 -> bf16, see
`act_quant.round_to_f16/round_to_bf16`); the products are then accumulated in float32.
"""

import numpy as np
from numba import njit, prange

from kernels_cpu.simd import fmav_f32, hsum_f32, load_bf16x8, load_f16x8, load_f32x8, prefetch, zero_f32

# Rows handed to one parallel task of matmul_f32.
ROWS_PER_TASK = 16


@njit(cache=True, fastmath=True)
def dot_f32(a, b):
    """float32 dot product of two equally long 1-D float32 arrays (one flat loop: LLVM vectorizes it)."""
    acc = np.float32(0.0)
    for j in range(a.shape[0]):
        acc += a[j] * b[j]
    return acc


@njit(cache=True, parallel=True, fastmath=True)
def matmul_f32(w, x, y):
    """y[t, r] = w[r] . x[t]; w float32 (n_out, n_in), x float32 (n_tok, n_in), y float32 (n_tok, n_out)."""
    n_out = w.shape[0]
    n_tasks = (n_out + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for task in prange(n_tasks):
        for r in range(task * ROWS_PER_TASK, min(n_out, (task + 1) * ROWS_PER_TASK)):
            for t in range(x.shape[0]):
                y[t, r] = dot_f32(w[r], x[t])


# -- SIMD products for F16 / BF16 weights with few tokens (decode) ---------------------------------------------
F16, BF16 = 1, 2
PREFETCH_BYTES = 2048


@njit(cache=True, fastmath=True)
def dot2_half(kind, w, wo, rb, x, tail_w, tail_x):
    """Rows of 16-bit floats (F16 or BF16) at bytes wo and wo + rb of the flat bytes w . x float32 (n);
    tail_w uint8 (16) and tail_x float32 (8) are scratch for the last n % 8 elements."""
    n = x.shape[0]
    n8 = n - n % 8
    a0 = zero_f32()
    a1 = zero_f32()
    for j in range(0, n8, 8):
        prefetch(w, wo + 4 * j + PREFETCH_BYTES)  # the two adjacent rows: one stream of 4 bytes per element
        xv = load_f32x8(x, j)
        if kind == F16:
            a0 = fmav_f32(a0, load_f16x8(w, wo + 2 * j), xv)
            a1 = fmav_f32(a1, load_f16x8(w, wo + rb + 2 * j), xv)
        else:
            a0 = fmav_f32(a0, load_bf16x8(w, wo + 2 * j), xv)
            a1 = fmav_f32(a1, load_bf16x8(w, wo + rb + 2 * j), xv)
    if n8 < n:  # zero-padded copies of the tails, one more vector step
        tail_x[:] = 0.0
        tail_x[:n - n8] = x[n8:]
        for r in range(2):
            tail_w[:] = 0
            o = wo + r * rb + 2 * n8
            tail_w[:2 * (n - n8)] = w[o:o + 2 * (n - n8)]
            v = load_f16x8(tail_w, 0) if kind == F16 else load_bf16x8(tail_w, 0)
            if r == 0:
                a0 = fmav_f32(a0, v, load_f32x8(tail_x, 0))
            else:
                a1 = fmav_f32(a1, v, load_f32x8(tail_x, 0))
    return hsum_f32(a0), hsum_f32(a1)


@njit(cache=True, parallel=True, fastmath=True)
def matmul_half(w, kind, x, y, rows_per_task):
    """y[t, r] = w[r] . x[t]; w uint8 (n_out, 2 n_in) F16 or BF16 rows, x float32 (n_tok, n_in) already
    rounded to the weight's type (ggml's vec_dot_type), y float32 (n_tok, n_out). Two rows at a time."""
    n_out, row_bytes = w.shape
    n_tok = x.shape[0]
    wf = w.reshape(n_out * row_bytes)
    n_tasks = (n_out + rows_per_task - 1) // rows_per_task
    for task in prange(n_tasks):
        tail_w = np.empty(16, dtype=np.uint8)
        tail_x = np.empty(8, dtype=np.float32)
        r0 = task * rows_per_task
        r1 = min(n_out, r0 + rows_per_task)
        for t in range(n_tok):
            for r in range(r0, r1, 2):
                rb = row_bytes if r + 1 < r1 else 0
                v0, v1 = dot2_half(kind, wf, r * row_bytes, rb, x[t], tail_w, tail_x)
                y[t, r] = v0
                if rb:
                    y[t, r + 1] = v1
