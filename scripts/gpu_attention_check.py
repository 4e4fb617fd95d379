#!/usr/bin/env python3
"""Checks the tiled prefill attention (attn_prefill_d*) against float64 and times it against the flash-decoding
kernel, and glu_f32x4 against glu_f32, at Llama-3-8B prefill shapes (512 tokens, 32/8 heads of 128).

    python3 scripts/gpu_attention_check.py        # exits 1 if a case is over its tolerance
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

NMSE_ATTN = 1e-9  # as tests/test_kernels_gpu.py


def ref_attention(q, kk, vv, pos, scale, n_swa):
    """float64, vectorized over heads: q (n, H, d), cache values (n_ctx, Hkv, d) -> (n, H, d)."""
    n, H, d = q.shape
    g = H // kk.shape[1]
    out = np.zeros((n, H, d))
    kh = np.repeat(kk, g, axis=1).transpose(1, 0, 2)  # (H, n_ctx, d)
    vh = np.repeat(vv, g, axis=1).transpose(1, 0, 2)
    for t in range(n):
        p = int(pos[t])
        lo = max(0, p - n_swa + 1) if n_swa > 0 else 0
        s = np.einsum("hcd,hd->hc", kh[:, lo:p + 1], q[t].astype(np.float64)) * scale
        w = np.exp(s - s.max(axis=1, keepdims=True))
        out[t] = np.einsum("hc,hcd->hd", w / w.sum(axis=1, keepdims=True), vh[:, lo:p + 1])
    return out


def cache_values(raw, type_name, hd):
    from gguf_io.quants import QUANTS

    if type_name == "f16":
        v = raw.view(np.float16)
    elif type_name == "f32":
        v = raw.view(np.float32)
    else:
        v = QUANTS[type_name.upper()].dequantize(raw)
    return v.astype(np.float64).reshape(raw.shape[0], raw.shape[1], hd)


def check() -> bool:
    import cupy

    from kernels_gpu.attention import attention
    from kernels_gpu.kv_cache import alloc_kv_layer, kv_store

    rng = np.random.default_rng(0)
    ok = True
    print("correctness (prefill kernel vs float64; old kernel alongside)")
    print(f"{'kv':>5} {'heads':>6} {'hd':>4} {'n_tok':>5} {'pos0':>5} {'swa':>4} {'nmse new':>10} {'nmse old':>10}")
    for type_kv in ("f16", "q8_0", "q4_0"):
        for n_head, n_head_kv in ((32, 8), (4, 2)):
            for hd in (128, 256):
                for n_tok, pos0, n_swa in ((16, 0, 0), (100, 37, 0), (512, 0, 0), (512, 200, 0), (100, 300, 64)):
                    if (n_head == 32 and hd == 256 and n_tok == 512 and pos0 == 200):
                        continue  # keeps the float64 reference's time down
                    n_ctx = pos0 + n_tok + 5
                    layer = alloc_kv_layer(n_ctx, n_head_kv, hd, hd, type_kv, type_kv)
                    k = rng.standard_normal((n_ctx, n_head_kv, hd)).astype(np.float32)
                    v = rng.standard_normal((n_ctx, n_head_kv, hd)).astype(np.float32)
                    kv_store(layer, cupy.arange(n_ctx, dtype=cupy.int32), cupy.asarray(k), cupy.asarray(v))
                    pos = np.arange(pos0, pos0 + n_tok, dtype=np.int32)
                    q = (rng.standard_normal((n_tok, n_head, hd)) * 2).astype(np.float32)
                    scale = 1.0 / np.sqrt(hd)
                    qd, pd = cupy.asarray(q), cupy.asarray(pos)
                    out = cupy.full(q.shape, np.nan, dtype=cupy.float32)
                    y = attention(qd, layer, pd, pos0 + n_tok, scale, n_swa, out=out, prefill=True).get()
                    y_old = attention(qd, layer, pd, pos0 + n_tok, scale, n_swa, prefill=False).get()
                    ref = ref_attention(q, cache_values(layer.k.get(), type_kv, hd),
                                        cache_values(layer.v.get(), type_kv, hd), pos, scale, n_swa)
                    e_new = float(np.sum((y - ref) ** 2) / np.sum(ref ** 2)) if np.isfinite(y).all() else np.inf
                    e_old = float(np.sum((y_old - ref) ** 2) / np.sum(ref ** 2))
                    bad = not e_new < NMSE_ATTN
                    ok &= not bad
                    print(f"{type_kv:>5} {n_head:>3}/{n_head_kv:<2} {hd:>4} {n_tok:>5} {pos0:>5} {n_swa:>4} "
                          f"{e_new:10.2e} {e_old:10.2e}{'   <-- FAIL' if bad else ''}")
    return ok


def timed(fn, reps: int = 20) -> float:
    """ms a call, CUDA events, after 3 warm-up calls."""
    import cupy

    for _ in range(3):
        fn()
    cupy.cuda.Device().synchronize()
    a, b = cupy.cuda.Event(), cupy.cuda.Event()
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    b.synchronize()
    return cupy.cuda.get_elapsed_time(a, b) / reps


def bench() -> None:
    import cupy

    from kernels_gpu import ops
    from kernels_gpu.attention import attention
    from kernels_gpu.kv_cache import alloc_kv_layer, kv_store

    rng = np.random.default_rng(1)
    n_tok, n_head, n_head_kv, hd = 512, 32, 8, 128
    print("\ntiming (ms a call, CUDA events; Llama-3-8B shapes, 512 tokens)")
    print(f"{'op':<34} {'old':>8} {'new':>8} {'speedup':>8}")
    for type_kv in ("f16", "q8_0", "q4_0"):
        for pos0 in (0, 512):
            n_ctx = pos0 + n_tok
            layer = alloc_kv_layer(n_ctx, n_head_kv, hd, hd, type_kv, type_kv)
            kv = cupy.asarray(rng.standard_normal((n_ctx, n_head_kv, hd)), cupy.float32)
            kv_store(layer, cupy.arange(n_ctx, dtype=cupy.int32), kv, kv)
            q = cupy.asarray(rng.standard_normal((n_tok, n_head, hd)), cupy.float32)
            pos = cupy.arange(pos0, pos0 + n_tok, dtype=cupy.int32)
            out = cupy.empty_like(q)
            t_old = timed(lambda: attention(q, layer, pos, n_ctx, 0.088, out=out, prefill=False))
            t_new = timed(lambda: attention(q, layer, pos, n_ctx, 0.088, out=out, prefill=True))
            print(f"{'attention ' + type_kv + ' pos ' + str(pos0) + '..':<34} {t_old:8.3f} {t_new:8.3f} "
                  f"{t_old / t_new:7.2f}x")
    for act in ("silu",):
        g = cupy.asarray(rng.standard_normal((n_tok, 14336)), cupy.float32)
        u = cupy.asarray(rng.standard_normal((n_tok, 14336)), cupy.float32)
        o = cupy.empty_like(g)
        t_old = timed(lambda: ops.glu(g, u, act, out=o, vec=False))
        t_new = timed(lambda: ops.glu(g, u, act, out=o, vec=True))
        print(f"{'glu ' + act + ' 512x14336':<34} {t_old:8.3f} {t_new:8.3f} {t_old / t_new:7.2f}x")
    x = cupy.asarray(rng.standard_normal((n_tok, 4096)), cupy.float32)
    w = cupy.asarray(rng.standard_normal(4096), cupy.float32)
    print(f"{'rms_norm 512x4096 (unchanged)':<34} {timed(lambda: ops.rms_norm(x, w, 1e-5)):8.3f}")
    xq = cupy.asarray(rng.standard_normal((n_tok, n_head, hd)), cupy.float32)
    pos = cupy.arange(n_tok, dtype=cupy.int32)
    print(f"{'rope 512x32x128 (unchanged)':<34} {timed(lambda: ops.rope(xq, pos, 128, 5e5)):8.3f}")
    layer = alloc_kv_layer(n_tok, n_head_kv, hd, hd, "f16", "f16")
    kk = cupy.asarray(rng.standard_normal((n_tok, n_head_kv, hd)), cupy.float32)
    print(f"{'kv_store f16 k+v (unchanged)':<34} {timed(lambda: kv_store(layer, pos, kk, kk)):8.3f}")
    t0 = time.perf_counter()
    for _ in range(100):
        ops.rms_norm(x, w, 1e-5)
    cupy.cuda.Device().synchronize()
    print(f"{'rms_norm host+launch, 100 calls':<34} {1000 * (time.perf_counter() - t0) / 100:8.3f} (wall ms a call)")


def main() -> None:
    t0 = time.perf_counter()
    ok = check()
    bench()
    print(f"\n{'OK' if ok else 'FAILED'} in {time.perf_counter() - t0:.1f} s")
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
