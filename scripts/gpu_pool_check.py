#!/usr/bin/env python3
"""Whether CuPy's memory pool thrashes under a VRAM budget: pp and tg runs of llama-bench's tests with every
device allocation counted (cudaMalloc calls and their bytes, through cupy.cuda.memory_hook), with the budget and
without it, in one process each (the budget is the pool's cap from the load on).

    python3 scripts/gpu_pool_check.py -m MODEL [-ngl 99] [-ncmoe 0] [--vram-budget 24GiB] [-p 512] [-n 32] [-r 3]

CuPy's pool frees every cached block (cudaFree, which synchronizes the device) and allocates again whenever a new
block would pass its cap (SingleDeviceMemoryPool._try_malloc), so a budget that leaves the batch's scratch no
cached block of the right size costs every batch cudaMalloc / cudaFree pairs. Non-zero cudaMalloc counts in the
timed runs (after the warm-up) are that. Run it twice, with --vram-budget and with --vram-budget "" (none)."""

from __future__ import annotations

import cupy

from bench_paged_kv import engine_args, load
from hybrid.tools.bench import run_bench, tests_from


class Counter(cupy.cuda.memory_hook.MemoryHook):
    """cudaMalloc calls (alloc_*) and pool requests (malloc_*) while active."""

    name = "hybrid_pool_counter"

    def __init__(self):
        self.cuda_mallocs = self.cuda_bytes = self.pool_mallocs = 0

    def alloc_preprocess(self, **kw):
        self.cuda_mallocs += 1
        self.cuda_bytes += kw["mem_size"]

    def malloc_preprocess(self, **kw):
        self.pool_mallocs += 1


def main() -> None:
    a = engine_args(__doc__.splitlines()[0], ngl="99", n_gen=32, reps=3, vram_budget="24GiB").parse_args()
    engine, _ = load(a, a.n_prompt + a.n_gen + 64)
    pool = cupy.get_default_memory_pool()
    print(f"budget {a.vram_budget or 'none'}: pool cap {pool.get_limit() / 2**30:.2f} GiB, "
          f"held {pool.total_bytes() / 2**30:.2f} GiB after the load")
    for test in tests_from([a.n_prompt], [a.n_gen], []):
        list(run_bench(engine, [test], 1))  # warm-up and one run: first-use allocations
        c = Counter()
        with c:
            result = next(run_bench(engine, [test], a.repetitions, warmup=False))
        print(f"{test.name}: {result.avg_ts:.1f} t/s; over {a.repetitions} runs: {c.cuda_mallocs} cudaMalloc "
              f"({c.cuda_bytes / 2**20:.1f} MiB), {c.pool_mallocs} pool requests; pool holds "
              f"{pool.total_bytes() / 2**30:.2f} GiB, {pool.used_bytes() / 2**30:.2f} GiB in use")
    engine.close()


if __name__ == "__main__":
    main()
