"""One call on the GPU machine: compile every kernel module, run the GPU tests, print a micro-benchmark table.

    python3 scripts/gpu_check.py [--out DIR] [--no-tests] [--pytest-args "-x -q"]

Timings: CUDA events around CUDA-graph replays where a graph can be captured (GPU time only, launch overhead
excluded), else around a loop of plain launches; weights rotate through several copies so the 50 MB L2 cannot
hold them. The last lines printed are the table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

ROWS: list[str] = []  # the summary table, printed last


def row(text: str) -> None:
    ROWS.append(text)
    print(text, flush=True)


def section(title: str) -> None:
    print(f"\n=== {title}", flush=True)


def time_events(fn, reps: int = 20, warmup: int = 3) -> float:
    """Median seconds of fn() over reps, each between two CUDA events (includes launch gaps)."""
    import cupy

    for _ in range(warmup):
        fn()
    cupy.cuda.Device().synchronize()
    ts = []
    for _ in range(reps):
        a, b = cupy.cuda.Event(), cupy.cuda.Event()
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(cupy.cuda.get_elapsed_time(a, b) / 1e3)
    return statistics.median(ts)


def time_graph(fns, reps: int = 10) -> tuple[float, str]:
    """Seconds per call of the fns (called in turn) replayed as one CUDA graph; falls back to events."""
    import cupy

    s = cupy.cuda.Stream(non_blocking=True)
    with s:  # warm up on the capture stream: compile, and leave in its pool what the capture will allocate
        for f in fns:
            f()
    s.synchronize()
    try:
        with s:
            s.begin_capture()
            for f in fns:
                f()
            g = s.end_capture()
        g.launch(stream=s)
        s.synchronize()
        ts = []
        for _ in range(reps):
            a, b = cupy.cuda.Event(), cupy.cuda.Event()
            a.record(s)
            g.launch(stream=s)
            b.record(s)
            b.synchronize()
            ts.append(cupy.cuda.get_elapsed_time(a, b) / 1e3 / len(fns))
        return statistics.median(ts), "graph"
    except Exception as exc:  # noqa: BLE001
        print(f"  (graph capture failed: {type(exc).__name__}: {exc}; timing plain launches)")
        try:
            s.end_capture()
        except Exception:  # noqa: BLE001 - not capturing any more
            pass
        n = len(fns)
        return time_events(lambda: [f() for f in fns], reps=reps) / n, "events"


def env_info() -> None:
    import cupy

    section("environment")
    p = cupy.cuda.runtime.getDeviceProperties(0)
    print(f"device: {p['name'].decode()}  SMs {p['multiProcessorCount']}  L2 {p['l2CacheSize'] >> 20} MiB  "
          f"mem {p['totalGlobalMem'] >> 30} GiB")
    print(f"cupy {cupy.__version__}  runtime {cupy.cuda.runtime.runtimeGetVersion()}  "
          f"driver {cupy.cuda.runtime.driverGetVersion()}  python {sys.version.split()[0]}  numpy {np.__version__}")


def compile_modules() -> bool:
    from kernels_gpu.module import MODULES, get_module

    section("compile (NVRTC)")
    ok = True
    for name in MODULES:
        t0 = time.perf_counter()
        try:
            get_module(name)
            print(f"  {name:14s} ok  {time.perf_counter() - t0:6.1f} s")
        except Exception as exc:  # noqa: BLE001 - print the compiler's whole log
            ok = False
            print(f"  {name:14s} FAILED after {time.perf_counter() - t0:.1f} s\n{exc}\n")
            if hasattr(exc, "get_message"):
                print(exc.get_message())
    return ok


def run_tests(out: Path | None, extra: list[str], timeout: int) -> None:
    section("pytest")
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rfE", "--tb=short", "-p", "no:cacheprovider",
           "tests/test_kernels_gpu.py", *extra]
    print(" ".join(cmd), flush=True)
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        log = r.stdout + r.stderr
    except subprocess.TimeoutExpired as exc:
        log = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        log += f"\nTIMEOUT after {timeout} s"
    if out:
        (out / "pytest.log").write_text(log)
    lines = log.strip().splitlines()
    fails = [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))]
    print("\n".join(lines[-60:]) if len(lines) > 60 else log)
    row(f"pytest: {lines[-1] if lines else 'no output'}  ({time.perf_counter() - t0:.0f} s, {len(fails)} failed)")


def copies(make, nbytes: int, budget: int = 256 << 20) -> list:
    return [make() for _ in range(max(2, min(16, -(-budget // max(nbytes, 1)))))]


def bench_copy() -> None:
    import cupy

    section("device copy ceiling")
    a = cupy.ones(1 << 28, dtype=cupy.float32)  # 1 GiB
    b = cupy.empty_like(a)
    t = time_events(lambda: cupy.copyto(b, a), reps=10)
    row(f"d2d copy 1 GiB: {2 * a.nbytes / t / 1e9:7.0f} GB/s (read + write)")


def bench_matvec() -> None:
    import cupy

    from kernels_gpu.matmul import GPU_KERNELS, matmul, matvec_config
    from test_kernels_gpu import random_weight

    section("decode matvec: GB/s of weight bytes (GPU time from graph replay), n_tok 1")
    rng = np.random.default_rng(0)
    row(f"{'type':7s} {'4096x4096':>10s} {'14336x4096':>11s} {'4096x14336':>11s}   (GB/s, n_tok=1)")
    for name in GPU_KERNELS:
        cells = []
        for n_out, n_in in ((4096, 4096), (14336, 4096), (4096, 14336)):
            try:
                raw = random_weight(name, n_out, n_in, rng)
                ws = copies(lambda: cupy.asarray(raw), raw.nbytes)
                x = cupy.asarray(rng.standard_normal((1, n_in)).astype(np.float32))
                y = cupy.empty((1, n_out), dtype=cupy.float32)
                fns = [lambda w=w: matmul(w, name, x, out=y, path="matvec") for w in ws]
                t, _ = time_graph(fns)
                cells.append(f"{raw.nbytes / t / 1e9:7.0f}")
            except Exception as exc:  # noqa: BLE001
                cells.append("   err")
                print(f"  {name} {n_out}x{n_in}: {type(exc).__name__}: {exc}")
        row(f"{name:7s} {cells[0]:>10s} {cells[1]:>11s} {cells[2]:>11s}")

    section("matvec sweep, n_tok 1: rows per warp (r) x warps per row group (w), GB/s")
    for name in ("Q4_K", "Q6_K", "Q8_0", "Q4_0"):
        k = GPU_KERNELS[name]
        for n_out, n_in in ((4096, 4096), (14336, 4096), (1024, 4096)):
            raw = random_weight(name, n_out, n_in, rng)
            ws = copies(lambda: cupy.asarray(raw), raw.nbytes)
            x = cupy.asarray(rng.standard_normal((1, n_in)).astype(np.float32))
            y = cupy.empty((1, n_out), dtype=cupy.float32)
            cells, best = [], (0.0, "")
            for rpw in (1, 2, 4):
                for wpr in (1, 2, 4, 8):
                    fns = [lambda w=w: matmul(w, name, x, out=y, path="matvec", wpr=wpr, rpw=rpw, q8=False)
                           for w in ws]
                    gbs = raw.nbytes / time_graph(fns)[0] / 1e9
                    cells.append(f"r{rpw}w{wpr}:{gbs:4.0f}")
                    best = max(best, (gbs, f"r{rpw}w{wpr}"))
            r_auto, w_auto = matvec_config(n_out, n_in // k.block_size * k.parts)
            print(f"  {name} {n_out}x{n_in}: " + " ".join(cells))
            row(f"{name} {n_out}x{n_in}: best {best[1]} {best[0]:5.0f} GB/s; default r{r_auto}w{w_auto} "
                f"{dict(c.split(':') for c in cells)[f'r{r_auto}w{w_auto}'].strip()} GB/s")

    section("matvec, several tokens (default settings), GB/s of weight bytes")
    for name in ("Q4_K", "Q8_0", "Q6_K", "F16"):
        raw = random_weight(name, 4096, 4096, rng)
        ws = copies(lambda: cupy.asarray(raw), raw.nbytes)
        cells = []
        for n_tok in (1, 2, 3, 4, 8):
            x = cupy.asarray(rng.standard_normal((n_tok, 4096)).astype(np.float32))
            y = cupy.empty((n_tok, 4096), dtype=cupy.float32)
            fns = [lambda w=w: matmul(w, name, x, out=y, path="matvec") for w in ws]
            cells.append(f"n{n_tok}:{raw.nbytes / time_graph(fns)[0] / 1e9:5.0f}")
        row(f"{name} 4096x4096 matvec: " + " ".join(cells))

    section("matvec wall time per call from Python (launch overhead included)")
    raw = random_weight("Q4_K", 4096, 4096, rng)
    w = cupy.asarray(raw)
    x = cupy.asarray(rng.standard_normal((1, 4096)).astype(np.float32))
    for _ in range(10):
        matmul(w, "Q4_K", x)
    cupy.cuda.Device().synchronize()
    t0 = time.perf_counter()
    for _ in range(200):
        matmul(w, "Q4_K", x)
    cupy.cuda.Device().synchronize()
    row(f"Q4_K 4096x4096 n_tok=1 from Python: {(time.perf_counter() - t0) / 200 * 1e6:6.1f} us per call")


def bench_gemm() -> None:
    import cupy

    from kernels_gpu.matmul import dequantize, matmul
    from test_kernels_gpu import random_weight

    section("prefill: TFLOP/s at 512 tokens (dequantize to fp16 + cuBLAS, fp32 accumulate)")
    rng = np.random.default_rng(1)
    row(f"{'type':7s} {'4096x4096':>10s} {'14336x4096':>11s} {'4096x14336':>11s}   (TFLOP/s incl. dequant, n_tok=512)")
    for name in ("Q4_K", "Q6_K", "Q8_0", "Q4_0", "Q5_K", "IQ4_XS", "F16", "BF16", "F32"):
        cells = []
        for n_out, n_in in ((4096, 4096), (14336, 4096), (4096, 14336)):
            try:
                raw = random_weight(name, n_out, n_in, rng)
                ws = copies(lambda: cupy.asarray(raw), raw.nbytes, budget=128 << 20)
                x = cupy.asarray(rng.standard_normal((512, n_in)).astype(np.float32))
                y = cupy.empty((512, n_out), dtype=cupy.float32)
                it = iter(range(1 << 30))
                t = time_events(lambda: matmul(ws[next(it) % len(ws)], name, x, out=y, path="gemm"), reps=10)
                cells.append(f"{2 * 512 * n_out * n_in / t / 1e12:7.1f}")
            except Exception as exc:  # noqa: BLE001
                cells.append("   err")
                print(f"  {name} {n_out}x{n_in}: {type(exc).__name__}: {exc}")
        row(f"{name:7s} {cells[0]:>10s} {cells[1]:>11s} {cells[2]:>11s}")

    section("prefill parts (Q4_K 14336x4096, 512 tokens)")
    raw = random_weight("Q4_K", 14336, 4096, rng)
    w = cupy.asarray(raw)
    x = cupy.asarray(rng.standard_normal((512, 4096)).astype(np.float32))
    w16 = dequantize(w, "Q4_K", dtype=np.float16)
    t_deq = time_events(lambda: dequantize(w, "Q4_K", dtype=np.float16, out=w16), reps=10)
    x16 = x.astype(cupy.float16)
    t_mm = time_events(lambda: cupy.matmul(x16, w16.T), reps=10)
    row(f"dequant Q4_K->fp16 14336x4096: {t_deq * 1e6:7.1f} us ({(raw.nbytes + w16.nbytes) / t_deq / 1e9:5.0f} GB/s); "
        f"cupy fp16 matmul alone: {2 * 512 * 14336 * 4096 / t_mm / 1e12:6.1f} TFLOP/s")

    section("dequantize to fp16 (the GEMM path's first step), 14336x4096")
    for name in ("Q4_K", "Q6_K", "Q8_0", "Q4_0", "Q5_K", "IQ4_XS"):
        raw = random_weight(name, 14336, 4096, rng)
        w = cupy.asarray(raw)
        w16 = dequantize(w, name, dtype=np.float16)
        t = time_events(lambda: dequantize(w, name, dtype=np.float16, out=w16), reps=10)
        row(f"dequant {name:6s} -> fp16 14336x4096: {t * 1e6:7.1f} us ({(raw.nbytes + w16.nbytes) / t / 1e9:5.0f} GB/s)")

    section("crossover matvec (chunks of 8 tokens) vs gemm, Q4_K 4096x4096 / 14336x4096, us per call")
    for n_out, n_in in ((4096, 4096), (14336, 4096)):
        raw = random_weight("Q4_K", n_out, n_in, rng)
        ws = copies(lambda: cupy.asarray(raw), raw.nbytes, budget=128 << 20)
        cells = []
        for n_tok in (8, 16, 32, 64, 128):
            x = cupy.asarray(rng.standard_normal((n_tok, n_in)).astype(np.float32))
            y = cupy.empty((n_tok, n_out), dtype=cupy.float32)
            res = []
            for path in ("matvec", "gemm"):
                it = iter(range(1 << 30))
                t = time_events(lambda: matmul(ws[next(it) % len(ws)], "Q4_K", x, out=y, path=path), reps=10)
                res.append(t * 1e6)
            cells.append(f"n{n_tok}: mv {res[0]:6.1f} / gemm {res[1]:6.1f}")
        row(f"Q4_K {n_out}x{n_in}: " + "; ".join(cells))


def bench_attention() -> None:
    import cupy

    from kernels_gpu.attention import attention
    from kernels_gpu.kv_cache import alloc_kv_layer, kv_store

    section("attention, n_kv 4096, 32 heads / 8 kv heads, head_dim 128 (us, GPU time)")
    rng = np.random.default_rng(2)
    n_ctx, hkv, hd, nh = 4096, 8, 128, 32
    for t in ("f16", "q8_0", "q4_0", "f32"):
        try:
            layers = []
            for _ in range(4):  # rotate caches: one f16 cache is 16 MiB
                layer = alloc_kv_layer(n_ctx, hkv, hd, hd, t, t)
                kv = cupy.asarray(rng.standard_normal((n_ctx, hkv, hd)).astype(np.float32))
                kv_store(layer, cupy.arange(n_ctx, dtype=cupy.int32), kv, kv)
                layers.append(layer)
            q1 = cupy.asarray(rng.standard_normal((1, nh, hd)).astype(np.float32))
            p1 = cupy.asarray(np.array([n_ctx - 1], dtype=np.int32))
            o1 = cupy.empty((1, nh, hd), dtype=cupy.float32)
            fns = [lambda ly=ly: attention(q1, ly, p1, n_ctx, 0.088, 0, out=o1) for ly in layers]
            t_dec, how = time_graph(fns)
            sweep = []
            for tc, mc in ((128, 256), (256, 128), (512, 64), (1024, 64), (2048, 32)):
                fs = [lambda ly=ly: attention(q1, ly, p1, n_ctx, 0.088, 0, out=o1, target_ctas=tc, min_chunk=mc)
                      for ly in layers]
                sweep.append(f"ctas{tc}/chunk{mc}:{time_graph(fs)[0] * 1e6:5.1f}")
            print(f"  decode sweep {t}: " + " ".join(sweep))
            qp = cupy.asarray(rng.standard_normal((512, nh, hd)).astype(np.float32))
            pp = cupy.arange(n_ctx - 512, n_ctx, dtype=cupy.int32)
            op = cupy.empty((512, nh, hd), dtype=cupy.float32)
            t_pre = time_events(lambda: attention(qp, layers[0], pp, n_ctx, 0.088, 0, out=op), reps=5)
            kvb = layers[0].nbytes
            row(f"attn {t:5s}: decode 1 tok {t_dec * 1e6:7.1f} us ({kvb / t_dec / 1e9:5.0f} GB/s of K+V, {how}); "
                f"prefill 512 tok at depth 3584: {t_pre * 1e6:8.1f} us; sweep (us) " + " ".join(sweep))
        except Exception as exc:  # noqa: BLE001
            row(f"attn {t}: error {type(exc).__name__}: {exc}")
            traceback.print_exc()


def bench_transfers() -> None:
    import cupy

    from kernels_gpu.transfer import PinnedStager

    section("host <-> device")
    st = PinnedStager()
    rng = np.random.default_rng(3)
    big = rng.integers(0, 256, size=1 << 30, dtype=np.uint8)
    st.to_device(big[: 64 << 20])
    cupy.cuda.Device().synchronize()
    t0 = time.perf_counter()
    d = st.to_device(big)
    cupy.cuda.Device().synchronize()
    t_up = time.perf_counter() - t0
    t0 = time.perf_counter()
    cupy.asarray(big)
    cupy.cuda.Device().synchronize()
    t_plain = time.perf_counter() - t0
    act = rng.standard_normal((512, 4096)).astype(np.float32)
    t_from = time_events(lambda: st.to_device(act), reps=10)
    t0 = time.perf_counter()
    for _ in range(10):
        st.to_host(d[: act.nbytes])
    t_to = (time.perf_counter() - t0) / 10
    row(f"upload 1 GiB: pinned staging {big.nbytes / t_up / 1e9:5.1f} GB/s, plain cupy.asarray "
        f"{big.nbytes / t_plain / 1e9:5.1f} GB/s; 512x4096 f32 to device {t_from * 1e6:6.0f} us, to host "
        f"{t_to * 1e6:6.0f} us")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None)
    ap.add_argument("--no-tests", action="store_true")
    ap.add_argument("--pytest-args", default="")
    ap.add_argument("--test-timeout", type=int, default=330)
    args = ap.parse_args()
    env_info()
    ok = compile_modules()
    if not args.no_tests:
        run_tests(args.out, args.pytest_args.split(), args.test_timeout)
    if ok:
        for bench in (bench_copy, bench_matvec, bench_gemm, bench_attention, bench_transfers):
            try:
                bench()
            except Exception:  # noqa: BLE001 - keep going: the other tables still say something
                traceback.print_exc()
    section("summary")
    print("\n".join(ROWS))
    if args.out:
        (args.out / "summary.txt").write_text("\n".join(ROWS) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
