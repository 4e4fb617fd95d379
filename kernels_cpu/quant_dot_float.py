"""Matrix products for the float weight types F32, F16 and BF16, plus the fp16 bit decoding shared by the
quantized kernels (block scales are fp16).

ggml converts the activations to the weight's vec_dot_type first (F16 -> fp16, BF16 -> bf16, see
`act_quant.round_to_f16/round_to_bf16`); the products are then accumulated in float32.
"""

import numpy as np
from numba import njit, prange

# Rows handed to one parallel task: each task allocates its row scratch once.
ROWS_PER_TASK = 16

# 2**(max(e, 1) - 25) for the 5-bit fp16 exponent e: (mantissa | implicit bit) * this is the value, exactly.
_F16_POW2 = np.array([2.0 ** (max(e, 1) - 25) for e in range(32)], dtype=np.float32)
# 2**112 rebiases an fp16 exponent/mantissa moved into float32 position (fp32 bias 127 - fp16 bias 15).
_F16_REBIAS = np.float32(2.0**112)


@njit(cache=True)
def f16_bits_to_f32(h):
    """IEEE half bits (an int in [0, 65536)) -> float32, exact, subnormals/inf/nan included."""
    e = (h >> 10) & 0x1F
    m = h & 0x3FF
    if e == 31:
        v = np.float32(np.inf) if m == 0 else np.float32(np.nan)
    else:
        v = np.float32(m + (1024 if e > 0 else 0)) * _F16_POW2[e]
    return -v if h & 0x8000 else v


@njit(cache=True)
def read_f16(buf, off):
    """The little-endian fp16 stored at buf[off:off+2] (buf uint8) as float32."""
    return f16_bits_to_f32(np.int64(buf[off]) | (np.int64(buf[off + 1]) << 8))


@njit(cache=True, fastmath=True)
def dot_f32(a, b):
    """float32 dot product of two equally long 1-D float32 arrays (one flat loop: LLVM vectorizes it)."""
    acc = np.float32(0.0)
    for j in range(a.shape[0]):
        acc += a[j] * b[j]
    return acc


@njit(cache=True, fastmath=True)
def decode_row_f16(src, bits, out):
    """fp16 bits `src` (uint16, n) -> float32 `out`, where `out` is `bits` (uint32, n) viewed as float32.

    The half's exponent and mantissa are moved to float32 position as integers, then one exact multiply by
    2**112 rebiases the exponent (subnormal halves land on float32 subnormals and scale correctly).
    Both loops are flat integer/float loops, so LLVM vectorizes them.
    """
    for j in range(src.shape[0]):
        h = np.int64(src[j])
        inf_nan = (((h & 0x7C00) + 0x400) >> 15) & 1  # exponent all ones (branch-free, so it vectorizes)
        bits[j] = np.uint32(((h & 0x7FFF) << 13) | ((h & 0x8000) << 16) | (inf_nan * 0x7F800000))
    for j in range(out.shape[0]):
        out[j] = out[j] * _F16_REBIAS


@njit(cache=True, fastmath=True)
def decode_row_bf16(src, bits):
    """bf16 bits `src` (uint16, n) -> float32 bit patterns in `bits` (uint32, n): bf16 is the high half."""
    for j in range(src.shape[0]):
        bits[j] = np.uint32(src[j]) << np.uint32(16)


@njit(cache=True, parallel=True, fastmath=True)
def matmul_f32(w, x, y):
    """y[t, r] = w[r] . x[t]; w float32 (n_out, n_in), x float32 (n_tok, n_in), y float32 (n_tok, n_out)."""
    n_out = w.shape[0]
    n_tasks = (n_out + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for task in prange(n_tasks):
        for r in range(task * ROWS_PER_TASK, min(n_out, (task + 1) * ROWS_PER_TASK)):
            for t in range(x.shape[0]):
                y[t, r] = dot_f32(w[r], x[t])


@njit(cache=True, parallel=True, fastmath=True)
def matmul_f16(w, x, y):
    """w fp16 bits uint16 (n_out, n_in); x float32 (n_tok, n_in) already rounded to fp16; y (n_tok, n_out)."""
    n_out, n_in = w.shape
    n_tasks = (n_out + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for task in prange(n_tasks):
        bits = np.empty(n_in, dtype=np.uint32)
        row = bits.view(np.float32)
        for r in range(task * ROWS_PER_TASK, min(n_out, (task + 1) * ROWS_PER_TASK)):
            decode_row_f16(w[r], bits, row)  # the row is decoded once for the whole batch
            for t in range(x.shape[0]):
                y[t, r] = dot_f32(row, x[t])


@njit(cache=True, parallel=True, fastmath=True)
def matmul_bf16(w, x, y):
    """w bf16 bits uint16 (n_out, n_in); x float32 (n_tok, n_in) already rounded to bf16; y (n_tok, n_out)."""
    n_out, n_in = w.shape
    n_tasks = (n_out + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for task in prange(n_tasks):
        bits = np.empty(n_in, dtype=np.uint32)
        row = bits.view(np.float32)
        for r in range(task * ROWS_PER_TASK, min(n_out, (task + 1) * ROWS_PER_TASK)):
            decode_row_bf16(w[r], bits)
            for t in range(x.shape[0]):
                y[t, r] = dot_f32(row, x[t])
