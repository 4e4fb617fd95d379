"""The Numba runtime of the CPU kernels: how many worker threads (-t defaults to the physical cores), which CPU
each one is pinned to (one per physical core, never a hyperthread sibling while cores remain; -C/--cpu-mask,
--cpu-range and --numa choose the CPUs). The kernels' compile cache is hybrid/system/compile.py's.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numba
import numpy as np
from numba import njit, prange, types

from kernels_cpu.signatures import Kernel

from hybrid.system import numa as _numa
from hybrid.system.devices import core_key, parse_cpulist, physical_core_cpus
from hybrid.errors import HybridError

# libc through symbols resolved at link time (not ctypes pointers), so the pinning kernel can be cached.
_sched_setaffinity = types.ExternalFunction("sched_setaffinity", types.intc(types.intc, types.uintp, types.voidptr))
_gettid = types.ExternalFunction("gettid", types.intc())
_sched_yield = types.ExternalFunction("sched_yield", types.intc())

_MASK_WORDS = 16  # cpu_set_t: 1024 bits
_ALLOWED: tuple[int, ...] | None = None  # the CPUs this process could use before we pinned its main thread


@dataclass(frozen=True)
class ThreadSetup:
    """Numba's workers after `setup_threads`: worker i runs as OS thread `tids[i]` on CPU `cpus[i]`."""

    n_threads: int
    cpus: tuple[int, ...]  # empty when not pinned
    tids: tuple[int, ...]
    main_tid: int
    layer: str  # numba.threading_layer(): omp, tbb or workqueue

    def describe(self) -> str:
        where = f"pinned to cpus {','.join(map(str, self.cpus))}" if self.cpus else "not pinned"
        return f"threads: {self.n_threads} ({self.layer}), {where}"


# -- which CPUs -----------------------------------------------------------------------------------------------
def allowed_cpus() -> tuple[int, ...]:
    """The CPUs this process may use, as they were before any pinning (pinning narrows the main thread's mask)."""
    global _ALLOWED  # process state by nature: the affinity the process was started with
    if _ALLOWED is None:
        _ALLOWED = tuple(sorted(os.sched_getaffinity(0)))
    return _ALLOWED


def parse_cpu_mask(text: str) -> tuple[int, ...]:
    """llama.cpp's -C: a hex mask, bit i = CPU i ('0x3', 'f0', 'FF00')."""
    t = text.strip().lower()
    t = t[2:] if t.startswith("0x") else t
    try:
        bits = int(t, 16)
    except ValueError:
        raise HybridError(f"-C/--cpu-mask takes a hex mask such as 0x3, got '{text}'") from None
    cpus = tuple(i for i in range(bits.bit_length()) if bits >> i & 1)
    if not cpus:
        raise HybridError(f"-C/--cpu-mask '{text}' selects no CPU")
    return cpus


def parse_cpu_range(text: str) -> tuple[int, ...]:
    """llama.cpp's --cpu-range: 'LO-HI' (inclusive) or one CPU number."""
    lo, sep, hi = text.strip().partition("-")
    try:
        a, b = int(lo), int(hi) if sep else int(lo)
    except ValueError:
        raise HybridError(f"--cpu-range takes LO-HI such as 0-3, got '{text}'") from None
    if a < 0 or b < a:
        raise HybridError(f"--cpu-range {text}: expected 0 <= LO <= HI")
    return tuple(range(a, b + 1))


def select_cpus(cpu_mask: str | None = None, cpu_range: str | None = None) -> tuple[int, ...]:
    """The CPUs named by -C and/or --cpu-range (together: their union, as llama.cpp), checked against the CPUs
    this process may use; () when neither is given."""
    chosen = set(parse_cpu_mask(cpu_mask) if cpu_mask else ()) | set(parse_cpu_range(cpu_range) if cpu_range else ())
    allowed = allowed_cpus()
    bad = sorted(chosen - set(allowed))
    if bad:
        raise HybridError(f"-C/--cpu-range asked for CPU {','.join(map(str, bad))} but this process may only run "
                          f"on CPU {','.join(map(str, allowed))}")
    return tuple(sorted(chosen))


def cpu_order(cpus: Sequence[int], core_of: Callable[[int], object] = core_key) -> tuple[int, ...]:
    """`cpus` in pinning order: the first CPU of every physical core, then the second siblings, and so on; so
    the first n workers land on n distinct cores whenever n <= the number of cores."""
    rounds: list[list[int]] = []
    seen: dict[object, int] = {}
    for c in cpus:
        k = core_of(c)
        i = seen.get(k, 0)
        seen[k] = i + 1
        if i == len(rounds):
            rounds.append([])
        rounds[i].append(c)
    return tuple(c for r in rounds for c in r)


def physical_cores(cpus: Sequence[int] | None = None) -> tuple[int, ...]:
    """One CPU per physical core among `cpus` (default: the CPUs this process may use)."""
    return physical_core_cpus(allowed_cpus() if cpus is None else cpus)


def default_threads(cpus: Sequence[int] | None = None) -> int:
    return max(1, len(physical_cores(cpus)))


# -- pinning ----------------------------------------------------------------------------------------------------
@njit(parallel=True, cache=True)
def _pin_workers(masks, done, tids, rcs, n_iter, max_spin):
    """Each worker pins itself once (sched_setaffinity(0) = the calling thread) to masks[its id], records its
    OS thread id, then spins until every worker has done so, so no worker runs another's iterations."""
    n = done.shape[0]
    for _ in prange(n_iter):
        w = numba.get_thread_id()
        if w < n and done[w] == 0:
            rcs[w] = _sched_setaffinity(0, masks.shape[1] * 8, masks[w].ctypes)
            tids[w] = _gettid()
            done[w] = 1
        spins = 0
        while spins < max_spin:
            s = 0
            for k in range(n):
                s += done[k]
            if s >= n:
                break
            _sched_yield()  # an external call: also keeps LLVM from hoisting the loads out of the loop
            spins += 1


# _pin_workers' one signature, so that a first run compiles it with the kernels (hybrid/system/compile.py)
PIN_KERNEL = Kernel("hybrid.system.threads", "_pin_workers",
                    (types.Array(types.uint64, 2, "C"), *(types.Array(types.int64, 1, "C"),) * 3, types.int64,
                     types.int64), cost_s=1.0)


def pin_threads(cpus: Sequence[int], attempts: int = 20) -> ThreadSetup:
    """Pin Numba worker i (of numba.get_num_threads()) to cpus[i % len(cpus)] and the main thread to cpus[0];
    HybridError when a worker never ran or the kernel refused a CPU."""
    n = numba.get_num_threads()
    want = np.array([cpus[i % len(cpus)] for i in range(n)], dtype=np.int64)
    masks = np.zeros((n, _MASK_WORDS), dtype=np.uint64)
    for i, c in enumerate(want):
        masks[i, c // 64] = np.uint64(1) << np.uint64(c % 64)
    done, tids, rcs = (np.zeros(n, dtype=np.int64) for _ in range(3))
    for _ in range(attempts):  # a worker that missed every iteration is caught on the next try
        _pin_workers(masks, done, tids, rcs, 8 * n, 200_000)
        if done.all():
            break
    if not done.all():
        raise HybridError(f"could not pin every Numba worker: {int(done.sum())} of {n} ran the pinning loop")
    if (rcs != 0).any():
        bad = [int(want[i]) for i in range(n) if rcs[i] != 0]
        raise HybridError(f"sched_setaffinity refused CPUs {bad} (a cgroup cpuset narrower than the mask?)")
    main = threading.get_native_id()
    if main not in tids:  # workqueue/tbb: the main thread waits and runs the Python parts; keep it on cpus[0]
        os.sched_setaffinity(0, {int(cpus[0])})
    return ThreadSetup(n, tuple(int(c) for c in want), tuple(int(t) for t in tids), main, numba.threading_layer())


def setup_threads(n_threads: int = 0, cpus: Sequence[int] = (), numa: str = "", pin: bool = True) -> ThreadSetup:
    """Set Numba's worker count (0 = one per physical core among the chosen CPUs, at most Numba's pool) and pin
    each worker to its own CPU: `cpus` (default: every CPU this process may use) in `cpu_order`, rearranged by
    --numa (distribute alternates nodes, isolate keeps the current node)."""
    order = _numa.thread_cpus(numa, cpu_order(tuple(cpus) or allowed_cpus()))
    n = n_threads if n_threads > 0 else default_threads(order)
    n = max(1, min(n, numba.config.NUMBA_NUM_THREADS))
    numba.set_num_threads(n)
    if not pin or not hasattr(os, "sched_setaffinity"):  # affinity is a Linux call
        return ThreadSetup(n, (), (), threading.get_native_id(), "")
    return pin_threads(order)


def thread_affinity(tid: int) -> tuple[int, ...]:
    """The CPUs OS thread `tid` of this process may run on (Cpus_allowed_list in /proc)."""
    for line in Path(f"/proc/self/task/{tid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return parse_cpulist(line.split(":", 1)[1])
    return ()
