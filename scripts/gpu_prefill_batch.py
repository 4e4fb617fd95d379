#!/usr/bin/env python3
"""Where a server's prefill step goes on the GPU: Engine.eval_batch of B prompts of L tokens each (paged caches of
one pool, as `hybrid serve -np N` admits a wave of requests) at each micro-batch size -ub, its ms and tokens/s, and
how much of it the host spent launching (the rest it waited in the device-to-host copies of the logits, one a
micro-batch that ends a prompt). The host's time includes any wait inside a launch or an upload, so it is also
measured with the GPU held busy by a spin kernel (the launches queue behind it): the host's time alone, and the
GPU's time alone for the work queued (events), both up to the first copy (the first micro-batch that ends a
prompt). Where the host alone takes longer than the GPU alone, the step is bound by the launches from Python.
Then a profile of one step at the first -ub (host functions by own and by cumulative time).

    python3 scripts/gpu_prefill_batch.py MODEL [--ubatch 512,2048] [--shapes 1x256,8x256] [--reps 3] [-ngl all]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import numpy as np


# holds the GPU for a number of nanoseconds (one thread, the global timer)
SPIN = r"""extern "C" __global__ void spin(unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--ubatch", default="512,2048")
    ap.add_argument("--shapes", default="1x256,8x256", help="BxL: B prompts of L tokens in one eval_batch")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("-ngl", default="all")
    ap.add_argument("--profile-rows", type=int, default=25)
    a = ap.parse_args()

    from hybrid.backends.gpu import GpuBackend  # noqa: PLC0415
    from hybrid.engine import Engine, EngineParams  # noqa: PLC0415
    from hybrid.kv.paged import PagedKV  # noqa: PLC0415

    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    waited = [0.0, 0]  # seconds inside GpuBackend.to_host, its calls
    first: dict = {}  # a held step's first device -> host copy: when the host got there, an event recorded there
    to_host = GpuBackend.to_host

    def timed_to_host(self, x):
        if "armed" in first and "t" not in first:
            first["t"] = time.perf_counter()
            first["ev"] = self._cupy.cuda.Event()
            first["ev"].record()
        t0 = time.perf_counter()
        try:
            return to_host(self, x)
        finally:
            waited[0] += time.perf_counter() - t0
            waited[1] += 1

    GpuBackend.to_host = timed_to_host
    rng = np.random.default_rng(0)
    print("| -ub | prompts x tokens | ms a step | tokens/s | host launching ms | waiting for the GPU ms | "
          "device -> host copies | held: host alone ms | held: GPU alone ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for i, ub in enumerate(int(u) for u in a.ubatch.split(",")):
        e = Engine.load(a.model, EngineParams(n_ctx=16384, n_batch=max(2048, ub), n_ubatch=ub, n_gpu_layers=a.ngl))
        cap = max(n for _, n in shapes) + 64
        kv = PagedKV(e.config, e.backends, max(b for b, _ in shapes) * cap // 64 + 16, 64, e.params.type_k,
                     e.params.type_v)

        def wave(b: int, n: int) -> list:
            """b fresh paged sequences of the pool, each with n random prompt tokens: eval_batch's argument."""
            return [(rng.integers(3, e.config.n_vocab, n), kv.sequence(cap)) for _ in range(b)]

        def step(b: int, n: int) -> tuple[float, float, int]:
            batch = wave(b, n)
            waited[:] = [0.0, 0]
            t0 = time.perf_counter()
            e.eval_batch(batch)
            wall = time.perf_counter() - t0
            for _, s in batch:
                s.release()
            return wall, waited[0], waited[1]

        def held(b: int, n: int, hold_ms: float) -> tuple[float, float]:
            """The step launched while a spin kernel holds the GPU for hold_ms: the host's time to its first
            device -> host copy alone, and the GPU's time for the work launched by then alone (events from the
            end of the spin to that copy), both of the first micro-batch that ends a prompt."""
            import cupy  # noqa: PLC0415

            batch = wave(b, n)
            spin = cupy.RawKernel(SPIN, "spin")
            spin((1,), (1,), (np.uint64(hold_ms * 1e6),))
            e0 = cupy.cuda.Event()
            e0.record()
            first.clear()
            first["armed"] = True
            t0 = time.perf_counter()
            e.eval_batch(batch)
            host = 1000 * (first["t"] - t0)
            gpu = cupy.cuda.get_elapsed_time(e0, first["ev"])
            first.clear()
            for _, s in batch:
                s.release()
            return host, gpu

        for b, n in shapes:
            step(b, n)  # warm-up: compiles, fills the pools
            runs = sorted((step(b, n) for _ in range(a.reps)), key=lambda r: r[0])
            wall, wait, copies = runs[len(runs) // 2]
            hold = max(300.0, 4000 * wall)
            host, gpu = held(b, n, hold) if a.ngl != "0" else (float("nan"), float("nan"))
            # a host that reached the copy only after the spin ended waited inside a launch (a full queue)
            host_cell = ("-" if host != host else f"{host:.1f}" if host < 0.9 * hold else f"blocked ({host:.0f})")
            print(f"| {ub} | {b} x {n} | {1000 * wall:.1f} | {b * n / wall:.0f} | {1000 * (wall - wait):.1f} | "
                  f"{1000 * wait:.1f} | {copies} | {host_cell} | {'-' if gpu != gpu else f'{gpu:.1f}'} |", flush=True)
        if i == 0:
            b, n = shapes[-1]
            pr = cProfile.Profile()
            pr.enable()
            step(b, n)
            pr.disable()
            for key in ("tottime", "cumulative"):
                s = io.StringIO()
                pstats.Stats(pr, stream=s).sort_stats(key).print_stats(a.profile_rows)
                print(f"\nprofile of one step of {b} x {n} tokens at -ub {ub}, by {key}:")
                print("\n".join(line[:170] for line in s.getvalue().splitlines() if line.strip()))
        e.close()
        del e, kv


if __name__ == "__main__":
    main()
