"""One-token decode matvec on the GPU: the q8 (dp4a) kernels vs the float kernels, checked and timed.

    python3 scripts/gpu_matvec_check.py [--no-sweep]

1. Correctness, per Q8_MATVEC type on odd shapes: nmse vs float64 dequantize(W) @ x on the activations the kernel
   sees (q8_1_reference; must be < NMSE_MATVEC) and on the exact activations (< NMSE_MATVEC_Q8). Exits 1 if any fails.
2. Speed on weights larger than the 50 MB L2 (copies rotate, timed as CUDA-graph replays with CUDA events):
   old (float activations) vs new (quantize_q8_1 + dp4a matvec, Q8_KERNEL's design: Q6_K "staged"), GB/s of
   weight bytes, then a sweep of rows per warp x warps per row group of the new kernel, and the matvec time of
   one Llama-8B Q4_K_M token. scripts/gpu_fused_check.py compares the Q6_K designs.
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

# (type, n_out, n_in, calls in one Llama-8B Q4_K_M decode token), as scripts/decode_profile.py lists them
SHAPES = [("Q4_K", 14336, 4096, 64), ("Q4_K", 4096, 4096, 64), ("Q4_K", 4096, 14336, 16),
          ("Q4_K", 1024, 4096, 48), ("Q6_K", 4096, 14336, 16), ("Q6_K", 1024, 4096, 16),
          ("Q6_K", 128256, 4096, 1)]
CHECK_SHAPES = [(1, 256), (37, 768), (300, 1280), (1001, 1280), (4099, 512), (333, 4096), (4096, 14336)]


def check() -> bool:
    import cupy

    from gguf_io.quants import QUANTS
    from kernels_gpu.matmul import Q8_MATVEC, matmul, q8_1_reference
    from test_kernels_gpu import NMSE_MATVEC, NMSE_MATVEC_Q8, nmse, random_weight

    print(f"\n=== correctness (limits: vs q8 activations {NMSE_MATVEC:g}, vs exact activations {NMSE_MATVEC_Q8:g})")
    ok = True
    rng = np.random.default_rng(1)
    for name in Q8_MATVEC:
        worst_q8, worst_exact, worst_old = 0.0, 0.0, 0.0
        for n_out, n_in in CHECK_SHAPES:
            raw = random_weight(name, n_out, n_in, rng)
            x = rng.standard_normal((1, n_in)).astype(np.float32)
            w = cupy.asarray(raw)
            out = cupy.full((1, n_out), np.nan, dtype=cupy.float32)
            y = matmul(w, name, cupy.asarray(x), out=out, path="matvec", q8=True).get()
            y_old = matmul(w, name, cupy.asarray(x), path="matvec", q8=False).get()
            wd = QUANTS[name].dequantize(raw).astype(np.float64)  # (n_out, n_in)
            q, d = q8_1_reference(x)
            x8 = (q.astype(np.float64).reshape(-1, 32) * d.reshape(-1, 1).astype(np.float64)).reshape(x.shape)
            ref, ref_q8 = x.astype(np.float64) @ wd.T, x8 @ wd.T
            e_q8, e_exact, e_old = nmse(y, ref_q8), nmse(y, ref), nmse(y_old, ref)
            bad = not np.isfinite(y).all() or e_q8 >= NMSE_MATVEC or (n_out >= 37 and e_exact >= NMSE_MATVEC_Q8)
            print(f"  {name} {n_out:6d}x{n_in:<6d} nmse new vs q8-ref {e_q8:.2e}  new vs exact {e_exact:.2e}  "
                  f"old vs exact {e_old:.2e}{'   <-- FAIL' if bad else ''}")
            ok &= not bad
            worst_q8 = max(worst_q8, e_q8)
            worst_exact = max(worst_exact, e_exact if n_out >= 37 else 0.0)
            worst_old = max(worst_old, e_old)
        print(f"  {name}: worst nmse new vs q8-ref {worst_q8:.2e}, new vs exact {worst_exact:.2e} "
              f"(old vs exact {worst_old:.2e})")
    print("CORRECTNESS: " + ("ok" if ok else "FAILED"), flush=True)
    return ok


def device_weight(name: str, n_out: int, n_in: int, seed: int):
    """A random (n_out, row_bytes) uint8 weight made on the device, fp16 scale fields sane (as random_weight)."""
    import cupy

    from gguf_io.quants import QUANTS
    from test_kernels_gpu import FP16_FIELDS

    spec = QUANTS[name]
    n = n_out * n_in // spec.block_size
    cupy.random.seed(seed)
    raw = cupy.random.randint(0, 256, size=(n, spec.type_size), dtype=cupy.int32).astype(cupy.uint8)
    for off, s in zip(FP16_FIELDS[name], (0.05, 0.02)):
        raw[:, off:off + 2] = cupy.random.uniform(-s, s, n).astype(cupy.float16).view(cupy.uint8).reshape(n, 2)
    return raw.reshape(n_out, -1)


def rotating_copies(name: str, n_out: int, n_in: int, seed: int) -> list:
    """device_weight and copies of it, >= 256 MB in all (2 to 16): timed in turn, none is in the 50 MB L2."""
    w1 = device_weight(name, n_out, n_in, seed)
    return [w1] + [w1.copy() for _ in range(max(2, min(16, -(-(256 << 20) // w1.nbytes))) - 1)]


def bench(sweep: bool) -> None:
    import cupy

    from gpu_check import time_graph
    from kernels_gpu.matmul import (Q6S_WARPS, Q8_KERNEL, Q8_MATVEC, gpu_kernel, matmul, matvec_q8, q8_config,
                                    q8s_config, quantize_q8_1)

    print("\n=== speed: GB/s of weight bytes, one token, CUDA-graph replay over rotating copies (> L2)")
    head = (f"{'type':5s} {'shape':>12s} {'MB':>6s} | {'old us':>7s} {'GB/s':>5s} | {'new us':>7s} {'GB/s':>5s} "
            f"{'speedup':>7s} | {'kernel us':>9s} {'quant us':>8s} | {'cfg':>5s}")
    rows, token = [], [0.0, 0.0]
    best_rows = []
    for i, (name, n_out, n_in, calls) in enumerate(SHAPES):
        ws = rotating_copies(name, n_out, n_in, i)
        w1 = ws[0]
        x = cupy.asarray(np.random.default_rng(i).standard_normal((1, n_in)).astype(np.float32))
        y = cupy.empty((1, n_out), dtype=cupy.float32)
        t_old = time_graph([lambda w=w: matmul(w, name, x, out=y, path="matvec", q8=False) for w in ws])[0]
        t_new = time_graph([lambda w=w: matmul(w, name, x, out=y, path="matvec", q8=True) for w in ws])[0]
        xq, xm = quantize_q8_1(x)
        t_kern = time_graph([lambda w=w: matvec_q8(w, name, xq, xm, y) for w in ws])[0]
        t_quant = time_graph([lambda: quantize_q8_1(x) for _ in ws])[0]
        mb = w1.nbytes / 1e6
        n_blocks = n_in // gpu_kernel(name).block_size
        r, wp = (q8s_config(n_out, n_blocks) if Q8_KERNEL[name] == "staged"
                 else q8_config(n_out, n_blocks * Q8_MATVEC[name]))
        rows.append(f"{name:5s} {f'{n_out}x{n_in}':>12s} {mb:6.1f} | {t_old * 1e6:7.1f} {mb / t_old / 1e3:5.0f} | "
                    f"{t_new * 1e6:7.1f} {mb / t_new / 1e3:5.0f} {t_old / t_new:6.2f}x | {t_kern * 1e6:9.1f} "
                    f"{t_quant * 1e6:8.1f} | r{r}w{wp}")
        print(rows[-1], flush=True)
        token[0] += calls * t_old
        token[1] += calls * t_new
        if sweep:
            cells, best = [], (0.0, "")
            for rpw in (1, 2, 4):
                for wpr in (1, 2, 4, 8):
                    if Q8_KERNEL[name] == "staged" and (rpw > 2 or wpr > Q6S_WARPS):
                        continue  # the staged kernel: 1-2 rows a warp, Q6S_WARPS warps a CTA
                    t = time_graph([lambda w=w: matvec_q8(w, name, xq, xm, y, wpr=wpr, rpw=rpw) for w in ws])[0]
                    cells.append(f"r{rpw}w{wpr}:{mb / t / 1e3:4.0f}")
                    best = max(best, (mb / t / 1e3, f"r{rpw}w{wpr}"))
            print(f"  sweep (kernel only, GB/s): {' '.join(cells)}")
            best_rows.append(f"{name:5s} {f'{n_out}x{n_in}':>12s}: best {best[1]} {best[0]:5.0f} GB/s, "
                             f"default r{r}w{wp} {mb / t_kern / 1e3:5.0f} GB/s")
        del ws, w1
        cupy.get_default_memory_pool().free_all_blocks()
    print("\n" + head + "\n" + "-" * len(head) + "\n" + "\n".join(rows))
    if best_rows:
        print("\nsweep of the q8 kernel (rows per warp r, warps per row group w):\n" + "\n".join(best_rows))
    print(f"\nLlama-8B Q4_K_M token, quantized matvecs only (calls x time above): old {token[0] * 1e3:.2f} ms, "
          f"new {token[1] * 1e3:.2f} ms ({token[0] / token[1]:.2f}x)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-sweep", action="store_true", help="skip the rows-per-warp x warps-per-row sweep")
    args = ap.parse_args()
    import cupy

    p = cupy.cuda.runtime.getDeviceProperties(0)
    print(f"device: {p['name'].decode()}  SMs {p['multiProcessorCount']}  L2 {p['l2CacheSize'] >> 20} MiB")
    t0 = time.perf_counter()
    ok = check()
    print(f"(check: {time.perf_counter() - t0:.1f} s)")
    t0 = time.perf_counter()
    bench(not args.no_sweep)
    print(f"(bench: {time.perf_counter() - t0:.1f} s)")
    if not ok:
        print("FAILED: q8 matvec nmse above tolerance (see the correctness lines above)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
