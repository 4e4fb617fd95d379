"""Causal attention with the arithmetic of llama.cpp's CPU flash attention (ggml-cpu ops.cpp,
ggml_compute_forward_flash_attn_ext_f16_one_chunk), as built for x86 with AVX2 + FMA + F16C, so that logits track
llama.cpp's more closely than the plain float32 kernel in attention.py. Same API and masks as attention.attention.

Per (token, head) row, as ggml: Q converted to K's vec_dot_type (f16 K: Q rounded to fp16; q8_0/q4_0 K: Q quantized
to q8_0 by the x86 quantize_row_q8_0; f32 K: as is), one score per key with ggml's SIMD dot product (its lanes and
reduction order reproduced below), then an online softmax updated key by key in increasing cell order. With an f16 V
the accumulator VKQ is fp16 (VKQ16), each element rounded back to fp16 after every scale and multiply-add; other V
types dequantize V to f32 and accumulate in f32. out = VKQ * (1/S). No fastmath anywhere: every rounding counts.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir as llvm_ir
from numba import njit, prange, types
from numba.extending import intrinsic

from .kv_cache import (
    F16_TO_F32, NATIVE_F16, Q4_0_BYTES, Q8_0_BYTES, QK, KVCacheLayer, f16_to_f32, fp32_to_fp16_bits, kv_type_code,
    kv_views,
)

STEP = 32  # AVX2: GGML_F16_STEP = GGML_F32_STEP = 32 elements per iteration, as 4 registers (ARR) x 8 lanes (EPR)
EPR = 8


@intrinsic
def _fma(typingctx, a, b, c):
    # float32 a*b + c with one rounding (llvm.fma.f32 -> vfmadd), like _mm256_fmadd_ps
    if not (a == types.float32 and b == types.float32 and c == types.float32):
        return None

    def codegen(context, builder, sig, args):
        f32 = llvm_ir.FloatType()
        fn = builder.module.declare_intrinsic("llvm.fma", [f32], llvm_ir.FunctionType(f32, [f32, f32, f32]))
        return builder.call(fn, args)

    return types.float32(types.float32, types.float32, types.float32), codegen


@intrinsic
def _round_f16_native(typingctx, x):
    # float32 -> nearest fp16 (ties to even; overflow -> inf) -> float32: vcvtps2ph + vcvtph2ps with F16C
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.fpext(builder.fptrunc(args[0], llvm_ir.HalfType()), llvm_ir.FloatType())

    return types.float32(types.float32), codegen


@njit(cache=True)
def round_f16(x, lut):
    """float32 x rounded to the nearest fp16 value (round-to-nearest-even, as GGML_CPU_FP32_TO_FP16), as float32."""
    if NATIVE_F16:
        return _round_f16_native(x)
    return lut[fp32_to_fp16_bits(x)]


@njit(cache=True)
def _reduce_f32x8(acc):
    # GGML_F32x8_REDUCE of 4 registers x 8 lanes (acc[j*8 + l]): x0+x2, x1+x3, then x0+x1; 128-bit halves; 2 hadds
    r = np.empty(EPR, dtype=np.float32)
    for lane in range(EPR):
        r[lane] = (acc[lane] + acc[2 * EPR + lane]) + (acc[EPR + lane] + acc[3 * EPR + lane])
    t0 = r[0] + r[4]
    t1 = r[1] + r[5]
    t2 = r[2] + r[6]
    t3 = r[3] + r[7]
    return (t0 + t1) + (t2 + t3)


@njit(cache=True)
def _dot_f16(k16, c, hk, qh, acc, lut):
    # ggml_vec_dot_f16 (AVX2/F16C): element e of each 32-step goes to lane e % 32 by FMA (exact products of fp16
    # values), GGML_F32x8_REDUCE into a double, leftovers added in double, returned as float
    n = qh.shape[0]
    npart = n - n % STEP
    acc[:] = 0.0
    for base in range(0, npart, STEP):
        for j in range(STEP):
            acc[j] = _fma(f16_to_f32(k16[c, hk, base + j], lut), qh[base + j], acc[j])
    sumf = np.float64(_reduce_f32x8(acc))
    for i in range(npart, n):
        sumf += np.float64(f16_to_f32(k16[c, hk, i], lut) * qh[i])
    return np.float32(sumf)


@njit(cache=True)
def _dot_f32(kf, c, hk, qh, acc):
    # ggml_vec_dot_f32 (AVX2): same lanes and reduction as the f16 dot, but a float sum; leftovers fused (fp-contract)
    n = qh.shape[0]
    npart = n - n % STEP
    acc[:] = 0.0
    for base in range(0, npart, STEP):
        for j in range(STEP):
            acc[j] = _fma(kf[c, hk, base + j], qh[base + j], acc[j])
    sumf = _reduce_f32x8(acc)
    for i in range(npart, n):
        sumf = _fma(kf[c, hk, i], qh[i], sumf)
    return sumf


@njit(cache=True)
def _dot_q_q8_0(k8, ki8, code_k, c, hk, qq, qd, acc, lut):
    # ggml_vec_dot_q8_0_q8_0 / ggml_vec_dot_q4_0_q8_0 (AVX2): per block, lane l holds the integer sum of elements
    # 4l..4l+3 (maddubs + madd), acc[l] = fma(d_k * d_q, lane, acc[l]); then hsum_float_8
    nb = qd.shape[0]
    bytes_per_block = Q8_0_BYTES if code_k == 2 else Q4_0_BYTES
    for lane in range(EPR):
        acc[lane] = 0.0
    for b in range(nb):
        o = b * bytes_per_block
        d = f16_to_f32(np.uint16(np.int32(k8[c, hk, o]) | (np.int32(k8[c, hk, o + 1]) << 8)), lut) * qd[b]
        for lane in range(EPR):
            isum = 0
            for i in range(4 * lane, 4 * lane + 4):
                if code_k == 2:
                    kv = np.int32(ki8[c, hk, o + 2 + i])
                elif i < QK // 2:  # block_q4_0: low nibbles are elements 0..15, high nibbles 16..31
                    kv = (np.int32(k8[c, hk, o + 2 + i]) & 0xF) - 8
                else:
                    kv = (np.int32(k8[c, hk, o + 2 + i - QK // 2]) >> 4) - 8
                isum += kv * np.int32(qq[b * QK + i])
            acc[lane] = _fma(d, np.float32(isum), acc[lane])
    # hsum_float_8: high 128 + low 128, then (r0 + r2) + (r1 + r3)
    return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))


@njit(cache=True)
def quantize_q8_0_x86(x, qq, qd, lut):
    """x f32 (n,), n % 32 == 0 -> qq int8 (n,), qd f32 (n/32,) holding the fp16 scale: ggml's x86 AVX2
    quantize_row_q8_0 (id = 127/amax, round half to even), which is not the _ref (1/d, roundf) that kv_cache uses."""
    for b in range(x.shape[0] // QK):
        amax = np.float32(0.0)
        for j in range(QK):
            amax = max(amax, abs(x[b * QK + j]))
        qd[b] = round_f16(amax / np.float32(127.0), lut)
        idv = np.float32(127.0) / amax if amax != 0.0 else np.float32(0.0)
        for j in range(QK):
            r = np.rint(x[b * QK + j] * idv)
            qq[b * QK + j] = np.int8(min(max(r, np.float32(-128.0)), np.float32(127.0)))


@njit(cache=True, parallel=True)
def _attention_ggml_kernel(q, kf, k16, k8, ki8, vf, v16, v8, vi8, code_k, code_v, positions, n_kv, scale, n_swa,
                           softcap, lut, out):
    # q (n_tok, n_head, dk) f32; K and V as kv_views (n_ctx, n_head_kv, *); positions (n_tok,) int32
    # -> out (n_tok, n_head, dv) f32. A work item is one (token, query head) row, as ggml's ir.
    n_tok, n_head, dk = q.shape
    group = n_head // k8.shape[1]  # GQA: query head h reads kv head h // group
    dv = out.shape[2]
    if softcap != 0.0:
        scale = scale / softcap  # ggml pre-divides, then s = softcap * tanhf(s * scale)
    for idx in prange(n_tok * n_head):
        r = idx // n_head
        t = r // 2 if r % 2 == 0 else n_tok - 1 - r // 2  # 0, n-1, 1, n-2, ...: causal work evens out per chunk
        h = idx % n_head
        hk = h // group
        p = positions[t]
        lo = max(0, p - n_swa + 1) if n_swa > 0 else 0
        hi = min(p, n_kv - 1)
        acc = np.empty(STEP, dtype=np.float32)  # SIMD lanes of the dot product
        qh = np.empty(dk, dtype=np.float32)  # Q in K's vec_dot_type (fp16 values for f16 K)
        qq = np.empty(dk, dtype=np.int8)  # q8_0 Q for quantized K
        qd = np.empty(dk // QK, dtype=np.float32)
        if code_k == 1:
            for j in range(dk):
                qh[j] = round_f16(q[t, h, j], lut)
        elif code_k == 0:
            for j in range(dk):
                qh[j] = q[t, h, j]
        else:
            quantize_q8_0_x86(q[t, h], qq, qd, lut)
        vkq = np.zeros(dv, dtype=np.float32)  # VKQ16 (fp16 values) for f16 V, else VKQ32
        vrow = np.empty(dv, dtype=np.float32)  # V32: one dequantized V row
        m = np.float32(-np.inf)
        s_sum = np.float32(0.0)
        for c in range(lo, hi + 1):
            if code_k == 1:
                s = _dot_f16(k16, c, hk, qh, acc, lut)
            elif code_k == 0:
                s = _dot_f32(kf, c, hk, qh, acc)
            else:
                s = _dot_q_q8_0(k8, ki8, code_k, c, hk, qq, qd, acc, lut)
            s = s * scale
            if softcap != 0.0:
                s = softcap * np.tanh(s)
            ms = np.float32(1.0)  # rescales VKQ and S when s is a new maximum
            vs = np.float32(1.0)  # expf(s - M)
            if s > m:
                m_old = m
                m = s
                ms = np.exp(m_old - m)
                if code_v == 1:
                    for j in range(dv):  # ggml_vec_scale_f16: fp16(fp32(y) * ms)
                        vkq[j] = round_f16(vkq[j] * ms, lut)
                else:
                    for j in range(dv):  # ggml_vec_scale_f32
                        vkq[j] = vkq[j] * ms
            else:
                vs = np.exp(s - m)
            if code_v == 1:
                for j in range(dv):  # ggml_vec_mad_f16: fp16(fma(fp32(v), vs, fp32(y)))
                    vkq[j] = round_f16(_fma(f16_to_f32(v16[c, hk, j], lut), vs, vkq[j]), lut)
            else:
                if code_v == 0:
                    for j in range(dv):
                        vrow[j] = vf[c, hk, j]
                elif code_v == 2:  # dequantize_row_q8_0: qs * d
                    for b in range(dv // QK):
                        o = b * Q8_0_BYTES
                        d = f16_to_f32(np.uint16(np.int32(v8[c, hk, o]) | (np.int32(v8[c, hk, o + 1]) << 8)), lut)
                        for j in range(QK):
                            vrow[b * QK + j] = np.float32(vi8[c, hk, o + 2 + j]) * d
                else:  # dequantize_row_q4_0: (nibble - 8) * d
                    for b in range(dv // QK):
                        o = b * Q4_0_BYTES
                        d = f16_to_f32(np.uint16(np.int32(v8[c, hk, o]) | (np.int32(v8[c, hk, o + 1]) << 8)), lut)
                        for j in range(QK // 2):
                            x = np.int32(v8[c, hk, o + 2 + j])
                            vrow[b * QK + j] = np.float32((x & 0xF) - 8) * d
                            vrow[b * QK + QK // 2 + j] = np.float32((x >> 4) - 8) * d
                for j in range(dv):  # ggml_vec_mad_f32: fma(v, vs, y)
                    vkq[j] = _fma(vrow[j], vs, vkq[j])
            s_sum = _fma(s_sum, ms, vs)  # S = S*ms + vs: one expression, contracted to an FMA by gcc and clang
        s_inv = np.float32(0.0) if s_sum == 0.0 else np.float32(1.0) / s_sum
        for j in range(dv):
            out[t, h, j] = vkq[j] * s_inv


def attention_ggml(q: np.ndarray, layer: KVCacheLayer, positions: np.ndarray, scale: float, n_swa: int = 0,
                   softcap: float = 0.0, n_kv: int | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """q (n_tok, n_head, head_dim_k) f32 at positions (n_tok,) -> (n_tok, n_head, head_dim_v) f32.

    Same masks, GQA and defaults as kernels_cpu.attention.attention (causal, sliding window when n_swa > 0,
    softcap 0 = none, n_kv defaults to max(positions) + 1), computed with llama.cpp's CPU flash-attention arithmetic.
    """
    if q.dtype != np.float32 or q.ndim != 3:
        raise ValueError(f"attention_ggml: q must be 3-D float32 (n_tok, n_head, head_dim), found {q.dtype} {q.shape}")
    q = np.ascontiguousarray(q)
    n_tok, n_head, head_dim = q.shape
    if head_dim != layer.head_dim_k:
        raise ValueError(f"attention_ggml: q head_dim must equal the cache's {layer.head_dim_k}, found {head_dim}")
    if n_head % layer.n_head_kv:
        raise ValueError(f"attention_ggml: n_head ({n_head}) must be a multiple of n_head_kv ({layer.n_head_kv})")
    positions = np.ascontiguousarray(positions, dtype=np.int32).reshape(-1)
    if positions.shape[0] != n_tok:
        raise ValueError(f"attention_ggml: need {n_tok} positions, found {positions.shape[0]}")
    if n_kv is None:
        n_kv = int(positions.max()) + 1 if n_tok else 0
    if not 0 <= n_kv <= layer.n_ctx:
        raise ValueError(f"attention_ggml: n_kv must lie in [0, {layer.n_ctx}], found {n_kv}")
    if n_tok and positions.min() < 0:
        raise ValueError(f"attention_ggml: positions must be >= 0, found {positions.min()}")
    if out is None:
        out = np.empty((n_tok, n_head, layer.head_dim_v), dtype=np.float32)
    elif out.shape != (n_tok, n_head, layer.head_dim_v) or out.dtype != np.float32:
        raise ValueError(f"attention_ggml: out must be float32 {(n_tok, n_head, layer.head_dim_v)}, found "
                         f"{out.dtype} {out.shape}")
    _attention_ggml_kernel(q, *kv_views(layer.k, layer.type_k), *kv_views(layer.v, layer.type_v),
                           kv_type_code(layer.type_k), kv_type_code(layer.type_v), positions, n_kv,
                           np.float32(scale), int(n_swa), np.float32(softcap), F16_TO_F32, out)
    return out
