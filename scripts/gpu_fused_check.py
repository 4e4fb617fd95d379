"""matmul_many (fused q/k/v and gate/up) and the staged Q6_K q8 matvec on the GPU: checked vs float64, then timed.

    python3 scripts/gpu_fused_check.py [--no-sweep] [--no-prefill]

1. Correctness vs float64 dequantize(W) @ x (the project's reference dequantizers), odd and Llama-8B shapes:
   one token (nmse vs the q8 activations the kernels see < NMSE_MATVEC, vs exact x < NMSE_MATVEC_Q8), prefill of
   16 and 512 tokens (< NMSE_GEMM_F16, first 64 token rows), the Q6_K matvec float / old q8 / new q8.
2. Speed, weights beyond the 50 MB L2 (copies rotate): one token as CUDA-graph replays timed by CUDA events;
   prefill (cuBLAS) by CUDA events around plain launches. The markdown table is printed last. Exits 1 on a failure.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts"))

QKV = (("Q4_K", "Q4_K", "Q4_K"), (4096, 1024, 1024), 4096)
QKV_MIXED = (("Q4_K", "Q4_K", "Q6_K"), (4096, 1024, 1024), 4096)  # Q4_K_M: attn_v in Q6_K in half the layers
GATE_UP = (("Q4_K", "Q4_K"), (14336, 14336), 4096)
ODD = [(("Q4_K", "Q4_K", "Q6_K"), (300, 37, 45), 768), (("Q6_K", "Q6_K"), (1001, 33), 1280),
       (("Q4_K",) * 4, (129, 1, 64, 4099), 512)]
Q6 = [(4096, 14336), (1024, 4096), (14336, 4096), (333, 3840), (128256, 4096)]  # (n_out, n_in), Q6_K matvec
TABLE: list[str] = []


def check() -> bool:
    import cupy

    import kernels_gpu.matmul as km
    from gguf_io.quants import QUANTS
    from kernels_gpu.matmul import matmul, matmul_many, matvec_q8, q8_1_reference, quantize_q8_1
    from test_kernels_gpu import NMSE_GEMM_F16, NMSE_MATVEC, NMSE_MATVEC_Q8, nmse, random_weight

    deq: dict[int, np.ndarray] = {}  # id(raw) -> float64 dequantize(raw), made once (seconds for 14336 x 4096)

    def ref_matmul(raw, t, x):
        if id(raw) not in deq:
            deq[id(raw)] = QUANTS[t].dequantize(raw).astype(np.float64)
        return x.astype(np.float64) @ deq[id(raw)].T

    def ref_matmul_q8(raw, t, x):  # on the activations the q8 kernels see
        q, d = q8_1_reference(x)
        return ref_matmul(raw, t, (q.astype(np.float64).reshape(*d.shape, 32) * d[..., None]).reshape(x.shape))

    print(f"\n=== correctness (nmse limits: q8 vs q8-ref {NMSE_MATVEC:g}, q8 vs exact {NMSE_MATVEC_Q8:g}, "
          f"gemm {NMSE_GEMM_F16:g})", flush=True)
    ok = True
    rng = np.random.default_rng(11)
    km.Q8_AUTO, saved = frozenset({"Q4_K", "Q6_K"}), km.Q8_AUTO  # both q8 kernels in the fused launches
    try:
        for types, n_outs, n_in in ODD + [QKV, QKV_MIXED, GATE_UP]:
            raws = [random_weight(t, n, n_in, rng) for t, n in zip(types, n_outs)]
            deq.clear()  # ids of freed weights come back
            ws = [cupy.asarray(r) for r in raws]
            for n_tok in (1, 16, 512):
                x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
                for stack in ((None,) if n_tok == 1 else (True, False)):
                    ys = matmul_many(ws, list(types), cupy.asarray(x), stack=stack)
                    for y, raw, t in zip(ys, raws, types):
                        y = y.get()[:64]
                        fin = bool(np.isfinite(y).all())
                        x = x[:64]
                        if n_tok == 1:
                            e1, e2 = nmse(y, ref_matmul_q8(raw, t, x)), nmse(y, ref_matmul(raw, t, x))
                            bad = not fin or e1 >= NMSE_MATVEC or (raw.shape[0] >= 37 and e2 >= NMSE_MATVEC_Q8)
                            what = f"q8-ref {e1:.1e} exact {e2:.1e}"
                        else:
                            e1 = nmse(y, ref_matmul(raw, t, x))
                            bad, what = not fin or e1 >= NMSE_GEMM_F16, f"gemm {e1:.1e}"
                        ok &= not bad
                        print(f"  many {'+'.join(map(str, n_outs))}x{n_in} {t} n={raw.shape[0]} tok={n_tok} "
                              f"stack={stack}: {what}{'   <-- FAIL' if bad else ''}", flush=True)
        for n_out, n_in in Q6:
            raw = random_weight("Q6_K", n_out, n_in, rng)
            x = rng.standard_normal((1, n_in)).astype(np.float32)
            w, xd = cupy.asarray(raw), cupy.asarray(x)
            xq, xm = quantize_q8_1(xd)
            deq.clear()  # ids of freed weights come back
            ref, ref8 = ref_matmul(raw, "Q6_K", x), ref_matmul_q8(raw, "Q6_K", x)
            y_f = matmul(w, "Q6_K", xd, path="matvec", q8=False).get()
            line = f"  Q6_K {n_out}x{n_in}: float vs exact {nmse(y_f, ref):.1e}"
            bad = nmse(y_f, ref) >= NMSE_MATVEC
            for kernel in ("warp", "staged"):
                y = cupy.full((1, n_out), np.nan, dtype=cupy.float32)
                matvec_q8(w, "Q6_K", xq, xm, y, kernel=kernel)
                y = y.get()
                e1, e2 = nmse(y, ref8), nmse(y, ref)
                bad |= not np.isfinite(y).all() or e1 >= NMSE_MATVEC or e2 >= NMSE_MATVEC_Q8
                line += f" | {kernel} vs q8-ref {e1:.1e} vs exact {e2:.1e}"
            ok &= not bad
            print(line + ("   <-- FAIL" if bad else ""), flush=True)
    finally:
        km.Q8_AUTO = saved
    print("CORRECTNESS: " + ("ok" if ok else "FAILED"), flush=True)
    return ok


def copies(raws_dev, min_bytes: int = 256 << 20) -> list:
    """[set of weights] rotated so that the L2 holds none: enough copies for >= min_bytes in all."""
    one = sum(w.nbytes for w in raws_dev)
    n = max(2, min(16, -(-min_bytes // one)))
    return [raws_dev] + [[w.copy() for w in raws_dev] for _ in range(n - 1)]


def bench_decode(sweep: bool) -> None:
    import cupy

    import kernels_gpu.matmul as km
    from gpu_check import time_graph
    from gpu_matvec_check import device_weight
    from kernels_gpu.matmul import matmul, matmul_many, matvec_q8, quantize_q8_1

    print("\n=== one token: separate matmuls (x quantized once, as GpuBackend.matmul) vs one matmul_many", flush=True)
    saved = km.Q8_AUTO
    try:
        for label, (types, n_outs, n_in) in (("qkv", QKV), ("qkv mixed (v Q6_K)", QKV_MIXED), ("gate/up", GATE_UP)):
            base = [device_weight(t, n, n_in, 7 + i) for i, (t, n) in enumerate(zip(types, n_outs))]
            sets = copies(base)
            x = cupy.asarray(np.random.default_rng(1).standard_normal((1, n_in)).astype(np.float32))
            mb = sum(w.nbytes for w in base) / 1e6

            def separate(ws):
                act = quantize_q8_1(x)
                return [matmul(w, t, x, q8_act=act) for w, t in zip(ws, types)]

            km.Q8_AUTO = saved  # the baseline: what runs today (Q8_AUTO as set in kernels_gpu/matmul.py)
            t_sep = time_graph([lambda ws=ws: separate(ws) for ws in sets])[0]
            t_many = time_graph([lambda ws=ws: matmul_many(ws, list(types), x) for ws in sets])[0]
            shape = f"{'+'.join(map(str, n_outs))}x{n_in}"
            TABLE.append(f"| decode {label}, Q8_AUTO {'/'.join(sorted(saved))} | {'/'.join(sorted(set(types)))} | "
                         f"{shape} | {t_sep * 1e6:.1f} us ({mb / t_sep / 1e3:.0f} GB/s) | {t_many * 1e6:.1f} us "
                         f"({mb / t_many / 1e3:.0f} GB/s) | {t_sep / t_many:.2f}x |")
            print(TABLE[-1], flush=True)
            km.Q8_AUTO = frozenset({"Q4_K", "Q6_K"})
            if "Q6_K" in types and "Q6_K" not in saved:  # and with Q6_K on the q8 path too
                t_sep8 = time_graph([lambda ws=ws: separate(ws) for ws in sets])[0]
                t_many8 = time_graph([lambda ws=ws: matmul_many(ws, list(types), x) for ws in sets])[0]
                TABLE.append(f"| decode {label}, Q8_AUTO Q4_K/Q6_K | {'/'.join(sorted(set(types)))} | {shape} | "
                             f"{t_sep8 * 1e6:.1f} us ({mb / t_sep8 / 1e3:.0f} GB/s) | {t_many8 * 1e6:.1f} us "
                             f"({mb / t_many8 / 1e3:.0f} GB/s) | {t_sep / t_many8:.2f}x vs today |")
                print(TABLE[-1], flush=True)
            if sweep and len(set(types)) == 1:
                xq, xm = quantize_q8_1(x)
                kern = km.Q8_KERNEL[types[0]]
                cells, best = [], (0.0, "")
                for rpw in ((1, 2) if kern == "staged" else (1, 2, 4)):
                    for wpr in ((1, 2, 4) if kern == "staged" else (1, 2, 4, 8)):
                        t = time_graph([lambda ws=ws: matmul_many(ws, list(types), x, q8_act=(xq, xm), wpr=wpr,
                                                                  rpw=rpw) for ws in sets])[0]
                        cells.append(f"r{rpw}w{wpr}:{mb / t / 1e3:4.0f}")
                        best = max(best, (mb / t / 1e3, f"r{rpw}w{wpr}"))
                print(f"  sweep of the fused launch alone (GB/s): {' '.join(cells)}  best {best[1]}", flush=True)
            del sets, base
            cupy.get_default_memory_pool().free_all_blocks()

        print("\n=== Q6_K one-token matvec: float kernel vs old q8 ('warp') vs new q8 ('staged')", flush=True)
        for n_out, n_in in Q6[:3]:
            base = device_weight("Q6_K", n_out, n_in, 3)
            ws = [s[0] for s in copies([base])]
            x = cupy.asarray(np.random.default_rng(2).standard_normal((1, n_in)).astype(np.float32))
            y = cupy.empty((1, n_out), dtype=cupy.float32)
            xq, xm = quantize_q8_1(x)
            mb = base.nbytes / 1e6
            t_f = time_graph([lambda w=w: matmul(w, "Q6_K", x, out=y, path="matvec", q8=False) for w in ws])[0]
            t_w = time_graph([lambda w=w: matvec_q8(w, "Q6_K", xq, xm, y, kernel="warp") for w in ws])[0]
            t_s = time_graph([lambda w=w: matvec_q8(w, "Q6_K", xq, xm, y, kernel="staged") for w in ws])[0]
            t_q = time_graph([lambda: quantize_q8_1(x) for _ in ws])[0]
            TABLE.append(f"| decode Q6_K matvec | Q6_K | {n_out}x{n_in} | float {t_f * 1e6:.1f} us "
                         f"({mb / t_f / 1e3:.0f} GB/s); old q8 {t_w * 1e6:.1f} us ({mb / t_w / 1e3:.0f}) | new q8 "
                         f"{t_s * 1e6:.1f} us ({mb / t_s / 1e3:.0f} GB/s) + quantize {t_q * 1e6:.1f} us | "
                         f"{t_f / t_s:.2f}x float, {t_w / t_s:.2f}x old q8 |")
            print(TABLE[-1], flush=True)
            if sweep:
                cells, best = [], (0.0, "")
                for rpw in (1, 2):
                    for wpr in (1, 2, 4):
                        t = time_graph([lambda w=w: matvec_q8(w, "Q6_K", xq, xm, y, wpr=wpr, rpw=rpw,
                                                              kernel="staged") for w in ws])[0]
                        cells.append(f"r{rpw}w{wpr}:{mb / t / 1e3:4.0f}")
                        best = max(best, (mb / t / 1e3, f"r{rpw}w{wpr}"))
                print(f"  sweep of the staged kernel (GB/s): {' '.join(cells)}  best {best[1]} "
                      f"(default {km.q8s_config(n_out, n_in // 256)})", flush=True)
            del ws, base
            cupy.get_default_memory_pool().free_all_blocks()
    finally:
        km.Q8_AUTO = saved


def bench_prefill(n_tok: int = 512) -> None:
    import cupy

    from gpu_check import time_events
    from gpu_matvec_check import device_weight
    from kernels_gpu.matmul import matmul, matmul_many

    print(f"\n=== prefill of {n_tok} tokens: separate matmuls vs matmul_many (shared fp16 x; stacked GEMM)", flush=True)
    for label, (types, n_outs, n_in) in (("qkv", QKV), ("qkv mixed (v Q6_K)", QKV_MIXED), ("gate/up", GATE_UP)):
        base = [device_weight(t, n, n_in, 7 + i) for i, (t, n) in enumerate(zip(types, n_outs))]
        sets = copies(base)
        x = cupy.asarray(np.random.default_rng(1).standard_normal((n_tok, n_in)).astype(np.float32))
        flop = 2.0 * n_tok * n_in * sum(n_outs)
        rot = [0]

        def run(fn):
            def step():
                ws = sets[rot[0] % len(sets)]
                rot[0] += 1
                return fn(ws)
            return time_events(lambda: [step() for _ in range(len(sets))], reps=10) / len(sets)

        t_sep = run(lambda ws: [matmul(w, t, x) for w, t in zip(ws, types)])
        t_shared = run(lambda ws: matmul_many(ws, list(types), x, stack=False))
        t_stack = run(lambda ws: matmul_many(ws, list(types), x, stack=True))
        TABLE.append(f"| prefill {n_tok} {label} | {'/'.join(sorted(set(types)))} | "
                     f"{'+'.join(map(str, n_outs))}x{n_in} | {t_sep * 1e3:.3f} ms ({flop / t_sep / 1e12:.0f} TFLOP/s) "
                     f"| shared x16 {t_shared * 1e3:.3f} ms ({flop / t_shared / 1e12:.0f}); stacked "
                     f"{t_stack * 1e3:.3f} ms ({flop / t_stack / 1e12:.0f} TFLOP/s) | "
                     f"{t_sep / t_shared:.2f}x shared, {t_sep / t_stack:.2f}x stacked |")
        print(TABLE[-1], flush=True)
        sets = base = None  # free the copies before the next set
        cupy.get_default_memory_pool().free_all_blocks()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-sweep", action="store_true", help="skip the rows-per-warp x warps-per-row sweeps")
    ap.add_argument("--no-prefill", action="store_true")
    args = ap.parse_args()
    import cupy

    p = cupy.cuda.runtime.getDeviceProperties(0)
    print(f"device: {p['name'].decode()}  SMs {p['multiProcessorCount']}  L2 {p['l2CacheSize'] >> 20} MiB")
    t0 = time.perf_counter()
    ok = check()
    print(f"(check: {time.perf_counter() - t0:.1f} s)")
    t0 = time.perf_counter()
    bench_decode(not args.no_sweep)
    if not args.no_prefill:
        bench_prefill()
    print(f"(bench: {time.perf_counter() - t0:.1f} s)")
    print("\n| what | types | shape | separate / baseline | fused / new | speedup |\n|---|---|---|---|---|---|")
    print("\n".join(TABLE))
    if not ok:
        print("FAILED: nmse above tolerance (see the correctness lines above)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
