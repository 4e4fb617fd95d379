"""Batched products (prefill): a block of weight rows is decoded once to float32, then multiplied with the
activations in a register-blocked float32 GEMM (`gemm_tile`: 6 rows x 16 tokens per micro-kernel, an LLVM IR
loop with 12 vector accumulators).

Like ggml, the activations are first converted to the weight type's vec_dot_type (Q8_0, Q8_K, F16, BF16);
their values (exact in float32 for Q8_0) are packed k-major in panels of 16 tokens:
    xp float32 (n_panels, n_in * 16), xp[p, 16 k + j] = x[16 p + j, k] (tokens past n_tok are zero).
Loops: parallel tasks of ROWS_PER_TASK rows; per panel, k in chunks of K_CHUNK so the panel's chunk (16 KB)
stays in L1 while the task's row tiles pass over it; the weights are decoded and read once per task.
"""

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from kernels_cpu import vec_dot_k, vec_dot_legacy
from kernels_cpu.simd import (LL_F32X8, ir_call, ir_intp, ir_ptr, ir_splat, is_f32_array, load_f16, load_f16x8,
                              load_i8x32, store_f32x8, store_scaled)

LL_F32, LL_I64 = ir.FloatType(), ir.IntType(64)

GEMM_MR, GEMM_NR = 6, 16  # rows x tokens of one micro-kernel tile: 12 accumulators of 8 lanes


@intrinsic
def gemm_tile(typingctx, w, wo, ldw, xp, xo, k_len, c):
    """c[16 i + j] += sum_{k < k_len} w[wo + i ldw + k] * xp[xo + 16 k + j] for i < 6, j < 16 (float32 arrays).

    The micro-kernel of the batched products: 6 weight rows (row-major, broadcast one value at a time) times a
    panel of 16 tokens packed k-major, in 12 vector accumulators held in registers for the whole k loop.
    """
    if not (is_f32_array(w) and is_f32_array(xp) and is_f32_array(c)
            and all(isinstance(t, types.Integer) for t in (wo, ldw, xo, k_len))):
        return None

    def codegen(context, builder, sig, args):
        w, wo, ldw, xp, xo, k_len, c = args
        ty = sig.args
        wo, ldw = ir_intp(context, builder, ty[1], wo), ir_intp(context, builder, ty[2], ldw)
        xo, k_len = ir_intp(context, builder, ty[4], xo), ir_intp(context, builder, ty[5], k_len)
        wp = ir_ptr(context, builder, ty[0], w, wo, LL_F32)
        rows = [builder.gep(wp, [builder.mul(ldw, ir.Constant(LL_I64, i))]) for i in range(GEMM_MR)]
        xpp = ir_ptr(context, builder, ty[3], xp, xo, LL_F32)
        cp = ir_ptr(context, builder, ty[6], c, ir.Constant(LL_I64, 0), LL_F32)
        cptrs = [builder.bitcast(builder.gep(cp, [ir.Constant(LL_I64, 8 * i)]), LL_F32X8.as_pointer())
                 for i in range(2 * GEMM_MR)]
        init = [builder.load(p, align=4) for p in cptrs]
        entry = builder.block
        loop = builder.append_basic_block("gemm_tile.loop")
        done = builder.append_basic_block("gemm_tile.done")
        builder.cbranch(builder.icmp_signed(">", k_len, ir.Constant(LL_I64, 0)), loop, done)

        builder.position_at_end(loop)
        k = builder.phi(LL_I64)
        acc = [builder.phi(LL_F32X8) for _ in range(2 * GEMM_MR)]
        xk = builder.gep(xpp, [builder.mul(k, ir.Constant(LL_I64, GEMM_NR))])
        x0 = builder.load(builder.bitcast(xk, LL_F32X8.as_pointer()), align=4)
        x1 = builder.load(builder.bitcast(builder.gep(xk, [ir.Constant(LL_I64, 8)]), LL_F32X8.as_pointer()), align=4)
        new = []
        for i in range(GEMM_MR):
            b = ir_splat(builder, LL_F32X8, builder.load(builder.gep(rows[i], [k]), align=4))
            new.append(ir_call(builder, "llvm.fmuladd.v8f32", LL_F32X8, [b, x0, acc[2 * i]]))
            new.append(ir_call(builder, "llvm.fmuladd.v8f32", LL_F32X8, [b, x1, acc[2 * i + 1]]))
        k1 = builder.add(k, ir.Constant(LL_I64, 1))
        loop_end = builder.block
        builder.cbranch(builder.icmp_signed("<", k1, k_len), loop, done)
        k.add_incoming(ir.Constant(LL_I64, 0), entry)
        k.add_incoming(k1, loop_end)
        for a, i0, n in zip(acc, init, new):
            a.add_incoming(i0, entry)
            a.add_incoming(n, loop_end)

        builder.position_at_end(done)
        results = []
        for i0, n in zip(init, new):
            r = builder.phi(LL_F32X8)
            r.add_incoming(i0, entry)
            r.add_incoming(n, loop_end)
            results.append(r)
        for r, p in zip(results, cptrs):
            builder.store(r, p, align=4)
        return context.get_dummy_value()
    return types.none(w, wo, ldw, xp, xo, k_len, c), codegen


ROWS_PER_TASK = 48  # a multiple of GEMM_MR
K_CHUNK = 256
LEGACY, K_QUANT, FLOAT = 0, 1, 2  # weight families; kinds within FLOAT:
F32, F16, BF16 = 0, 1, 2


@njit(cache=True, fastmath=True)
def decode_row(family, kind, wf, wo, n_in, out, oo):
    """Row at byte wo of the flat weight bytes -> float32 out[oo:oo + n_in]."""
    if family == LEGACY:
        vec_dot_legacy.decode_row_f32(kind, wf, wo, n_in // 32, out, oo)
    elif family == K_QUANT:
        vec_dot_k.decode_row_f32(kind, wf, wo, n_in // 256, out, oo)
    elif kind == F32:
        src = wf[wo:wo + 4 * n_in].view(np.float32)
        for j in range(n_in):
            out[oo + j] = src[j]
    elif kind == F16:
        n8 = n_in - n_in % 8
        for j in range(0, n8, 8):
            store_f32x8(out, oo + j, load_f16x8(wf, wo + 2 * j))
        for j in range(n8, n_in):
            out[oo + j] = load_f16(wf, wo + 2 * j)
    else:
        src = wf[wo:wo + 2 * n_in].view(np.uint16)
        bits = out[oo:oo + n_in].view(np.uint32)
        for j in range(n_in):
            bits[j] = np.uint32(src[j]) << np.uint32(16)


@njit(cache=True, parallel=True, fastmath=True)
def gemm(w, family, kind, xp, n_tok, y, n_threads):
    """y[t, r] = row r of w . x[t] for t < n_tok; w uint8 (n_out, row_bytes) raw rows of (family, kind),
    xp the packed activations (module docstring), y float32 (n_tok, n_out); n_threads: numba.get_num_threads()
    (an argument: calling it in here would keep Numba from caching this function)."""
    n_out, row_bytes = w.shape
    n_panels = xp.shape[0]
    n_in = xp.shape[1] // GEMM_NR
    wf = w.reshape(n_out * row_bytes)
    xpf = xp.reshape(xp.size)
    n_tasks = (n_out + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    n_workers = max(1, min(n_threads, n_tasks))
    for worker in prange(n_workers):  # tasks dealt round-robin; scratch allocated once per worker
        wd = np.empty(ROWS_PER_TASK * n_in, dtype=np.float32)  # the task's rows, decoded
        c = np.empty(ROWS_PER_TASK * GEMM_NR, dtype=np.float32)
        for task in range(worker, n_tasks, n_workers):
            r0 = task * ROWS_PER_TASK
            gemm_rows(family, kind, wf, row_bytes, n_in, r0, min(ROWS_PER_TASK, n_out - r0), xpf, 0, n_panels, n_tok,
                      y, wd, c)


@njit(inline="always")
def gemm_rows(family, kind, wf, row_bytes, n_in, r0, nr, xpf, p0, n_panels, n_tok, y, wd, c):
    """One task of `gemm`: y[t, r0 + i] = row r0 + i of the flat weight bytes wf . x[t] for i < nr (<= ROWS_PER_TASK),
    t < n_tok, x the n_panels packed panels of xpf from panel p0; wd float32 (ROWS_PER_TASK * n_in) and c float32
    (ROWS_PER_TASK * GEMM_NR) are scratch. A (row, token)'s sum does not depend on the task, panel or other tokens:
    callers that split the rows or group the tokens otherwise (kernels_cpu.moe) get the same bits."""
    n_tiles = (nr + GEMM_MR - 1) // GEMM_MR
    for i in range(nr):
        decode_row(family, kind, wf, (r0 + i) * row_bytes, n_in, wd, i * n_in)
    wd[nr * n_in:] = 0.0
    for p in range(n_panels):
        c[:] = 0.0
        po = (p0 + p) * n_in * GEMM_NR
        for k0 in range(0, n_in, K_CHUNK):
            kl = min(K_CHUNK, n_in - k0)
            for tile in range(n_tiles):
                gemm_tile(wd, tile * GEMM_MR * n_in + k0, n_in, xpf, po + k0 * GEMM_NR, kl,
                          c[tile * GEMM_MR * GEMM_NR:])
        t0 = p * GEMM_NR
        for i in range(nr):
            for j in range(min(GEMM_NR, n_tok - t0)):
                y[t0 + j, r0 + i] = c[i * GEMM_NR + j]


@njit(cache=True, parallel=True, fastmath=True)
def pack_q8(qs, d, block):
    """Q8 activations (qs int8 (n_tok, n_in), d float32 (n_tok, n_in / block)) -> packed float32 panels.
    Per 32 columns: each token's values are made with vector ops into a 16 x 32 scratch, then transposed."""
    n_tok, n_in = qs.shape
    n_panels = (n_tok + GEMM_NR - 1) // GEMM_NR
    xp = np.empty((n_panels, n_in * GEMM_NR), dtype=np.float32)
    qf = qs.reshape(qs.size)
    tokens = np.arange(n_tok)
    for p in prange(n_panels):
        pack_panel(xp, p, qf, d, block, n_in, tokens, p * GEMM_NR, min(GEMM_NR, n_tok - p * GEMM_NR))
    return xp


@njit(inline="always")
def pack_panel(xp, p, qf, d, block, n_in, src, first, nt):
    """Panel p of xp in pack_q8's layout: the Q8 rows src[first + j] (j < nt) of the flat activations qf (rows of
    n_in int8, scales d per `block` values), the panel's other GEMM_NR - nt columns zero."""
    tmp = np.zeros(GEMM_NR * 32, dtype=np.float32)
    zero = np.float32(0.0)
    for k0 in range(0, n_in, 32):
        for j in range(nt):
            t = src[first + j]
            db = d[t, k0 // block]
            store_scaled(tmp, 32 * j, load_i8x32(qf, t * n_in + k0), db, zero, db, zero)
        for kk in range(32):
            for j in range(GEMM_NR):
                xp[p, (k0 + kk) * GEMM_NR + j] = tmp[32 * j + kk]


@njit(cache=True, parallel=True)
def pack_f32(x):
    """float32 activations (n_tok, n_in) -> packed float32 panels."""
    n_tok, n_in = x.shape
    n_panels = (n_tok + GEMM_NR - 1) // GEMM_NR
    xp = np.zeros((n_panels, n_in * GEMM_NR), dtype=np.float32)
    for p in prange(n_panels):
        for j in range(min(GEMM_NR, n_tok - p * GEMM_NR)):
            t = p * GEMM_NR + j
            for k in range(n_in):
                xp[p, k * GEMM_NR + j] = x[t, k]
    return xp
