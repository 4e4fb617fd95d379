"""`matmul(w_raw, type_name, x)`: the CPU matrix product on weights kept in their raw GGML blocks; `matmuls` for
several weights times the same x (q/k/v, gate/up), in one parallel pass where their types allow.

One explicit `KERNELS` entry per GGML type; anything else raises `UnsupportedQuantType` (no silent fallback).
Like ggml, the activations are first converted to the weight type's vec_dot_type (`CpuKernel.vec_dot_type`).
Few tokens (decode): SIMD integer dot products on the raw blocks (`vec_dot_legacy`, `vec_dot_k`; for Q8_0, Q6_K and
the X8 layouts of Q4_0/Q5_0/Q8_0/Q4_K 4 tokens a pass over the weights, bit-equal to a token at a time); a batch
of `gemm_min_tokens(type)` or more (prefill; 64 tokens, or never for the types whose dots win with VNNI): rows
decoded to float32 once per block of rows and a register-blocked float32 GEMM (`gemm_f32`). Both compute ggml's
sums over the same quantized values (integer block sums scaled in float32, or float32 products of the exactly
decoded values): they differ only in float32 rounding.
"""

import functools
import sys
from dataclasses import dataclass
from typing import Callable

import numba
import numpy as np

from gguf_io.errors import UnsupportedQuantType
from kernels_cpu import act_quant, gemm_f32, quant_dot_float, sched, simd_x8, vec_dot_iq, vec_dot_k, vec_dot_legacy


@dataclass(frozen=True)
class CpuKernel:
    """How the CPU multiplies by one GGML type: block geometry, activation type and the runner."""

    name: str
    block_size: int  # elements per block
    type_size: int  # bytes per block
    vec_dot_type: str  # what the activations are converted to: "F32", "F16", "BF16", "Q8_0", "Q8_K"
    run: Callable[[np.ndarray, np.ndarray, np.ndarray, bool], None]  # (w_raw, x 2-D, y 2-D, gemm) fills y
    row_group: int = 1  # the rows come in groups of this many (repacked layouts)


# Batches of fewer tokens than this are decode-sized: the fused per-layer kernels (hybrid.backends.cpu_fused,
# cpu_whole, cpu_moe) take them in one call through the integer dots, and kernels_cpu.moe sends an expert's group of
# this many or more to the float GEMM. The same on every host; not the matmul crossover below (gemm_min_tokens).
SMALL_BATCH_TOKENS = 64
# The matmul crossover: batches of at least gemm_min_tokens(type) tokens go through the float32 GEMM (weights
# decoded once per row block), smaller ones through the integer dots on the raw blocks. Without VNNI (measured on
# Zen 3): the dots cost ~0.1 ms per token for a 2048 x 640 Q5_0 or 640 x 2048 Q4_K/Q6_K matrix, the GEMM ~0.65 ms
# flat up to 16 tokens (one padded panel): the speed crossover is 6-9 tokens. We switch at 64 there: the integer path
# is llama.cpp's own arithmetic (int8 activation x quantized weight, summed exactly), the GEMM sums the same
# products in float32; they differ by ~1e-6 relative per product, which a small model amplifies through later 8-bit
# activation roundings (measured on Gemma 3 270M: with the GEMM from 8 tokens, a 13-token prompt's greedy output
# left llama.cpp's at step 5). Short prompts and decode follow llama.cpp exactly; long prefills (compute-bound; the
# GEMM was 2x faster on the Zen 3) take the GEMM.
GEMM_MIN_TOKENS_AVX2 = SMALL_BATCH_TOKENS
# With VNNI (kernels_cpu.simd_x8.has_vnni) the integer dots of these types outran the GEMM at every batch measured,
# 32 to 512 tokens (2-core Zen 5, 2 threads, `python3 scripts/bench_crossover.py`; integer / GEMM time: 0.27-0.56
# for the X8 layouts of Q4_K, Q5_0, Q4_0 and Q8_0 on the demo model's and Llama 1B's shapes, 0.66-0.81 Q6_K, flat
# in the batch, 1024 and 2048 tokens included; 0.62-0.76 IQ4_XS_X8 and MXFP4_X8 at 64 and 512 tokens on 2048 x
# 2048): they never take the GEMM there.
# The other types keep GEMM_MIN_TOKENS_AVX2: Q4_K in the file's layout is level (0.85-1.10), the file layouts of
# the legacy types and the other K- and IQ-quants are 1.1-8x slower through their dots.
INT_DOTS_VNNI = frozenset({"Q4_K_X8", "Q5_0_X8", "Q4_0_X8", "Q8_0_X8", "IQ4_XS_X8", "MXFP4_X8", "Q6_K"})
NEVER = sys.maxsize  # a crossover no batch reaches
INT_ROWS_PER_BLOCK = 16  # integer dots: rows that stay in L1 while every token of a small batch passes
# Integer dots: the rows of one call are split into about this many tasks a thread, claimed dynamically (as ggml's
# chunks): contiguous runs long enough for the prefetchers (16-row tasks claimed in turn by 2 threads streamed
# 8192 x 2048 Q4_K 1.3x slower than a static split), yet a late core takes fewer of them (on the 16-core GPU host
# the dynamic claim read Q4_K at 71-84 GB/s where the static split read 47-66).
INT_TASKS_PER_THREAD = 4


@functools.cache
def _host_vnni() -> bool:
    return simd_x8.host_vnni()  # the target's features do not change in a process


def gemm_min_tokens(type_name: str) -> int:
    """This host's crossover for a `type_name` weight: batches of this many tokens or more take the float32 GEMM."""
    return NEVER if type_name in INT_DOTS_VNNI and _host_vnni() else GEMM_MIN_TOKENS_AVX2


def _float_runner(kind, convert, small):
    def run(w, x, y, gemm):
        xc = convert(x)
        if gemm:
            gemm_f32.gemm(w, gemm_f32.FLOAT, kind, gemm_f32.pack_f32(xc), x.shape[0], y, numba.get_num_threads())
        else:
            small(w, xc, y)

    return run


def _small_f32(w, x, y):
    quant_dot_float.matmul_f32(w.view(np.float32), x, y)


def _small_f16(w, x, y):
    quant_dot_float.matmul_half(w, quant_dot_float.F16, x, y, INT_ROWS_PER_BLOCK)


def _small_bf16(w, x, y):
    # ggml's vec_dot_type for BF16 is BF16: the activations are rounded to bf16 too (act_quant.round_to_bf16).
    quant_dot_float.matmul_half(w, quant_dot_float.BF16, x, y, INT_ROWS_PER_BLOCK)


def _int_tasking(ws) -> tuple[int, int, int]:
    """(rows per task, rows per block, threads) of one integer-dot call over the weights ws."""
    n_threads = numba.get_num_threads()
    per_task = -(-sum(w.shape[0] for w in ws) // (n_threads * INT_TASKS_PER_THREAD))
    return -(-per_task // INT_ROWS_PER_BLOCK) * INT_ROWS_PER_BLOCK, INT_ROWS_PER_BLOCK, n_threads  # whole blocks


def _empty_slot() -> tuple[np.ndarray, np.ndarray]:
    """A weight of 0 rows and its output: an unused slot of the integer-dot kernels (never indexed)."""
    w = np.empty((0, 1), dtype=np.uint8)
    w.flags.writeable = False
    return w, np.empty((1, 0), dtype=np.float32)


_EMPTY_W, _EMPTY_Y = _empty_slot()  # read-only constants, shared by every call


def _int_slots(ws, kinds, ys):
    """Up to three (weight, kind, y) for one integer-dot call; unused slots are weights of 0 rows."""
    pad = 3 - len(ws)
    return (*ws, *(_EMPTY_W,) * pad), (*kinds, *(0,) * pad), (*ys, *(_EMPTY_Y,) * pad)


def _legacy_dots(ws, kinds, x, ys):
    """Integer dots of up to three legacy-type weights with x (n_tok, n_in), quantized to Q8_0 once for all."""
    qs, d, sums = act_quant.quantize_q8_1(x)  # Q8_0's qs and d, and block_q8_1's s for the types with a min
    (w0, w1, w2), (k0, k1, k2), (y0, y1, y2) = _int_slots(ws, kinds, ys)
    vec_dot_legacy.matmul_q8_0_act(w0, w1, w2, k0, k1, k2, qs, d, sums, y0, y1, y2, *_int_tasking(ws),
                                   sched.new_counter())


def _k_dots(ws, kinds, x, ys):
    """Integer dots of up to three K-quant weights with x (n_tok, n_in), quantized to Q8_K once for all."""
    qs, d, bsums = act_quant.quantize_q8_k(x)
    (w0, w1, w2), (k0, k1, k2), (y0, y1, y2) = _int_slots(ws, kinds, ys)
    vec_dot_k.matmul_q8_k_act(w0, w1, w2, k0, k1, k2, qs, d, bsums, y0, y1, y2, *_int_tasking(ws),
                              sched.new_counter())


def _legacy_runner(kind):
    with_min = kind in (vec_dot_legacy.Q4_1, vec_dot_legacy.Q5_1)

    def run(w, x, y, gemm):
        if gemm:
            qs, d, sums = act_quant.quantize_q8_1(x)
            gemm_f32.gemm(w, gemm_f32.LEGACY, kind, gemm_f32.pack_q8(qs, d, 32), x.shape[0], y,
                          numba.get_num_threads())
            if with_min:
                _q8_1_min_term(w, qs, d, sums, y)
        else:
            _legacy_dots((w,), (kind,), x, (y,))

    return run


def _q8_1_min_term(w, qs, d, sums, y):
    """The GEMM multiplies Q4_1/Q5_1 rows (d_w q + m) by the activations d_x q8, so its min term is m d_x sum(q8);
    ggml's is m s with block_q8_1's s = fp16(d_x sum(q8)) (d_x unrounded): y += (s - d_x sum(q8)) . m per block.
    w: uint8 (n_out, nb * type_size) with the fp16 min at bytes 2-3 of each block; y: (n_tok, n_out) float32."""
    n_tok, n_in = qs.shape
    nb = n_in // 32
    mins = np.ascontiguousarray(w.reshape(w.shape[0], nb, -1)[:, :, 2:4]).view(np.float16)[..., 0]  # (n_out, nb)
    q_sums = qs.reshape(n_tok, nb, 32).sum(axis=2, dtype=np.int32).astype(np.float32)
    _add_products(np.ascontiguousarray((sums - d * q_sums).T, dtype=np.float32), mins.astype(np.float32), y)


@numba.njit(cache=True, parallel=True)
def _add_products(a_t, b, y):
    """y += a_t.T @ b.T (a_t (k, n_tok), b (n_out, k) float32) on numba's threads: numpy's `@` would start OpenBLAS's
    own threads, whose spinning after the call starves numba's next parallel region on the same cores (pp64 of a
    Q4_1 model at 2 threads on 2 cores: 52 tokens/s against 354 with OpenBLAS held to one thread). The sums run
    over the tokens' row of a_t (vectorized, each in j order)."""
    k, n_tok = a_t.shape
    for o in numba.prange(b.shape[0]):
        acc = np.zeros(n_tok, dtype=np.float32)
        for j in range(k):
            bj = b[o, j]
            for t in range(n_tok):
                acc[t] += a_t[j, t] * bj
        for t in range(n_tok):
            y[t, o] += acc[t]


def _k_runner(kind):
    def run(w, x, y, gemm):
        if gemm:
            qs, d, _ = act_quant.quantize_q8_k(x)
            gemm_f32.gemm(w, gemm_f32.K_QUANT, kind, gemm_f32.pack_q8(qs, d, 256), x.shape[0], y,
                          numba.get_num_threads())
        else:
            _k_dots((w,), (kind,), x, (y,))

    return run


# the integer-dot families matmuls() fuses: vec_dot_type -> (kind code of each type, the call)
_INT_FAMILIES = {
    "Q8_0": ({"Q4_0": vec_dot_legacy.Q4_0, "Q4_1": vec_dot_legacy.Q4_1, "Q5_0": vec_dot_legacy.Q5_0,
              "Q5_1": vec_dot_legacy.Q5_1, "Q8_0": vec_dot_legacy.Q8_0, "IQ4_NL": vec_dot_legacy.IQ4_NL,
              "MXFP4": vec_dot_legacy.MXFP4, "Q4_0_X8": vec_dot_legacy.Q4_0_X8, "Q5_0_X8": vec_dot_legacy.Q5_0_X8,
              "MXFP4_X8": vec_dot_legacy.MXFP4_X8,
              "Q8_0_X8": vec_dot_legacy.Q8_0_X8},
             _legacy_dots),
    "Q8_K": ({"Q2_K": vec_dot_k.Q2_K, "Q3_K": vec_dot_k.Q3_K, "Q4_K": vec_dot_k.Q4_K, "Q5_K": vec_dot_k.Q5_K,
              "Q6_K": vec_dot_k.Q6_K, "IQ4_XS": vec_dot_k.IQ4_XS, "Q4_K_X8": vec_dot_k.Q4_K_X8,
              "IQ4_XS_X8": vec_dot_k.IQ4_XS_X8,
              "IQ2_XXS": vec_dot_iq.IQ2_XXS, "IQ2_XS": vec_dot_iq.IQ2_XS, "IQ2_S": vec_dot_iq.IQ2_S,
              "IQ3_XXS": vec_dot_iq.IQ3_XXS, "IQ3_S": vec_dot_iq.IQ3_S, "IQ1_S": vec_dot_iq.IQ1_S,
              "IQ1_M": vec_dot_iq.IQ1_M}, _k_dots),
}


_L, _K, _I, _G = vec_dot_legacy, vec_dot_k, vec_dot_iq, gemm_f32
KERNELS: dict[str, CpuKernel] = {
    "F32": CpuKernel("F32", 1, 4, "F32", _float_runner(_G.F32, lambda x: x, _small_f32)),
    "F16": CpuKernel("F16", 1, 2, "F16", _float_runner(_G.F16, act_quant.round_to_f16, _small_f16)),
    "BF16": CpuKernel("BF16", 1, 2, "BF16", _float_runner(_G.BF16, act_quant.round_to_bf16, _small_bf16)),
    # Q4_1/Q5_1 use Q8_1 in ggml: Q8_0's qs and d, and s (fp16 of d * sum(qs)) for the min term; the legacy family
    # quantizes to Q8_1 once for all its types (the signed ones read qs and d only).
    "Q4_0": CpuKernel("Q4_0", 32, 18, "Q8_0", _legacy_runner(_L.Q4_0)),
    "Q4_1": CpuKernel("Q4_1", 32, 20, "Q8_0", _legacy_runner(_L.Q4_1)),
    "Q5_0": CpuKernel("Q5_0", 32, 22, "Q8_0", _legacy_runner(_L.Q5_0)),
    "Q5_1": CpuKernel("Q5_1", 32, 24, "Q8_0", _legacy_runner(_L.Q5_1)),
    "Q8_0": CpuKernel("Q8_0", 32, 34, "Q8_0", _legacy_runner(_L.Q8_0)),
    "IQ4_NL": CpuKernel("IQ4_NL", 32, 18, "Q8_0", _legacy_runner(_L.IQ4_NL)),
    "Q2_K": CpuKernel("Q2_K", 256, 84, "Q8_K", _k_runner(_K.Q2_K)),
    "Q3_K": CpuKernel("Q3_K", 256, 110, "Q8_K", _k_runner(_K.Q3_K)),
    "Q4_K": CpuKernel("Q4_K", 256, 144, "Q8_K", _k_runner(_K.Q4_K)),
    "Q5_K": CpuKernel("Q5_K", 256, 176, "Q8_K", _k_runner(_K.Q5_K)),
    "Q6_K": CpuKernel("Q6_K", 256, 210, "Q8_K", _k_runner(_K.Q6_K)),
    "IQ4_XS": CpuKernel("IQ4_XS", 256, 136, "Q8_K", _k_runner(_K.IQ4_XS)),
    "MXFP4": CpuKernel("MXFP4", 32, 17, "Q8_0", _legacy_runner(_L.MXFP4)),
    "IQ2_XXS": CpuKernel("IQ2_XXS", 256, 66, "Q8_K", _k_runner(_I.IQ2_XXS)),
    "IQ2_XS": CpuKernel("IQ2_XS", 256, 74, "Q8_K", _k_runner(_I.IQ2_XS)),
    "IQ2_S": CpuKernel("IQ2_S", 256, 82, "Q8_K", _k_runner(_I.IQ2_S)),
    "IQ3_XXS": CpuKernel("IQ3_XXS", 256, 98, "Q8_K", _k_runner(_I.IQ3_XXS)),
    "IQ3_S": CpuKernel("IQ3_S", 256, 110, "Q8_K", _k_runner(_I.IQ3_S)),
    "IQ1_S": CpuKernel("IQ1_S", 256, 50, "Q8_K", _k_runner(_I.IQ1_S)),
    "IQ1_M": CpuKernel("IQ1_M", 256, 56, "Q8_K", _k_runner(_I.IQ1_M)),
}

# Layouts of our own that hybrid.repack makes at load from a GGML type (the rows of a matrix interleaved by 8 for
# the integer dots; the float GEMM decodes them to the same floats as the original type). Not GGML types: no file
# holds them, and the GPU never sees them.
REPACKED: dict[str, CpuKernel] = {
    "Q4_0_X8": CpuKernel("Q4_0_X8", 32, 18, "Q8_0", _legacy_runner(_L.Q4_0_X8), row_group=8),
    "Q5_0_X8": CpuKernel("Q5_0_X8", 32, 22, "Q8_0", _legacy_runner(_L.Q5_0_X8), row_group=8),
    "Q8_0_X8": CpuKernel("Q8_0_X8", 32, 34, "Q8_0", _legacy_runner(_L.Q8_0_X8), row_group=8),
    "Q4_K_X8": CpuKernel("Q4_K_X8", 256, 148, "Q8_K", _k_runner(_K.Q4_K_X8), row_group=8),
    "MXFP4_X8": CpuKernel("MXFP4_X8", 32, 17, "Q8_0", _legacy_runner(_L.MXFP4_X8), row_group=8),
    "IQ4_XS_X8": CpuKernel("IQ4_XS_X8", 256, 138, "Q8_K", _k_runner(_K.IQ4_XS_X8), row_group=8),
}


def _kernel(type_name) -> CpuKernel:
    try:
        return KERNELS[type_name] if type_name in KERNELS else REPACKED[type_name]
    except (KeyError, TypeError):
        raise UnsupportedQuantType(
            f"no CPU matmul kernel for GGML type {type_name!r}; supported: {', '.join(KERNELS)}"
        ) from None


def _check_array(name, a, dtype, ndims):
    if not isinstance(a, np.ndarray):
        raise ValueError(f"{name} must be a numpy array, got {type(a).__name__}")
    if a.dtype != dtype:
        raise ValueError(f"{name} must have dtype {np.dtype(dtype).name}, got {a.dtype}")
    if a.ndim not in ndims:
        raise ValueError(f"{name} must have {' or '.join(map(str, ndims))} dimensions, got shape {a.shape}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous (shape {a.shape}, strides {a.strides})")


def _prepare(w_raw, type_name, x):
    """Checks one weight against x -> (kernel, w_raw as a read-only plain ndarray, n_out, n_in)."""
    kernel = _kernel(type_name)
    _check_array("w_raw", w_raw, np.uint8, (2,))
    # A plain read-only ndarray view, no copy: model weights are read-only memmaps, and one array type
    # means each kernel is compiled once (Numba types read-only and writable arrays apart).
    w_raw = np.asarray(w_raw).view(np.ndarray)
    w_raw.flags.writeable = False
    n_out, row_bytes = w_raw.shape
    if row_bytes == 0 or row_bytes % kernel.type_size:
        raise ValueError(
            f"w_raw rows of {row_bytes} bytes are not whole {type_name} blocks of {kernel.type_size} bytes"
        )
    if n_out % kernel.row_group:
        raise ValueError(f"a {type_name} matrix holds whole groups of {kernel.row_group} rows, found {n_out} rows")
    n_in = row_bytes // kernel.type_size * kernel.block_size
    if x.shape[-1] != n_in:
        raise ValueError(f"x has {x.shape[-1]} features but the {type_name} weight rows hold {n_in}")
    return kernel, w_raw, n_out, n_in


def matmul(w_raw, type_name, x, out=None, gemm_from=None):
    """y = x @ W.T with W kept in its raw GGML blocks.

    w_raw: uint8 (n_out, row_bytes), C-contiguous, rows of `type_name` blocks (a memmap view is fine);
    x: float32 (n_tok, n_in) or (n_in,); out: optional float32 (n_tok, n_out) or (n_out,) to fill.
    gemm_from: batches of this many tokens or more take the float GEMM (None: the host's, gemm_min_tokens).
    Returns y float32 (n_tok, n_out), or (n_out,) for a 1-D x.
    Raises UnsupportedQuantType for a type without a kernel, ValueError for bad dtypes, layouts or shapes.
    """
    _check_array("x", x, np.float32, (1, 2))
    kernel, w_raw, n_out, n_in = _prepare(w_raw, type_name, x)
    x2 = np.asarray(x).reshape(-1, n_in)  # (n_tok, n_in)
    y_shape = (n_out,) if x.ndim == 1 else (x2.shape[0], n_out)
    if out is None:
        out = np.empty(y_shape, dtype=np.float32)
    else:
        _check_array("out", out, np.float32, (x.ndim,))
        if out.shape != y_shape:
            raise ValueError(f"out has shape {out.shape}, expected {y_shape}")
    if n_out and x2.shape[0]:
        gemm = x2.shape[0] >= (gemm_min_tokens(type_name) if gemm_from is None else gemm_from)
        kernel.run(w_raw, x2, np.asarray(out).reshape(-1, n_out), gemm)
    return out


def matmuls(weights, x, gemm_from=None) -> list[np.ndarray]:
    """[x @ W.T for (W, type) in weights]: several weights times the same x (q/k/v, gate/up).

    weights: sequence of (w_raw, type_name) as matmul's; x: float32 (n_tok, n_in), C-contiguous; gemm_from as
    matmul's. Returns float32 (n_tok, n_out_i) arrays, equal to matmul's one by one. The weights whose batch takes
    the integer dots and whose types share an integer activation type (Q8_0: the legacy types; Q8_K: the K-quants)
    are multiplied in one parallel pass, up to three at a time, on x quantized once; the rest go one by one.
    """
    _check_array("x", x, np.float32, (2,))
    prepared = [_prepare(w_raw, type_name, x) for w_raw, type_name in weights]
    n_tok = x.shape[0]
    outs = [np.empty((n_tok, n_out), dtype=np.float32) for _, _, n_out, _ in prepared]
    if n_tok == 0:
        return outs
    groups: dict[str, list[int]] = {}
    gemm = [n_tok >= (gemm_min_tokens(k.name) if gemm_from is None else gemm_from) for k, _, _, _ in prepared]
    for i, (kernel, _, n_out, _) in enumerate(prepared):
        fused = not gemm[i] and kernel.vec_dot_type in _INT_FAMILIES and n_out
        groups.setdefault(kernel.vec_dot_type if fused else f"one {i}", []).append(i)
    for family, idx in groups.items():
        if family not in _INT_FAMILIES:
            for i in idx:
                if outs[i].size:
                    prepared[i][0].run(prepared[i][1], x, outs[i], gemm[i])
            continue
        codes, dots = _INT_FAMILIES[family]
        for c in range(0, len(idx), 3):
            part = idx[c:c + 3]
            dots(tuple(prepared[i][1] for i in part), tuple(codes[prepared[i][0].name] for i in part), x,
                 tuple(outs[i] for i in part))
    return outs
