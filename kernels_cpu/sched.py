"""Dynamic work sharing for the parallel decode kernels: each worker claims the next task from a shared atomic
counter (as ggml's threadpool claims chunks), so a core that runs late (another process, an interrupt, a VM
neighbour) takes fewer tasks instead of holding every other core at the end of a statically split loop.

    counter = new_counter()                           # n_threads = numba.get_num_threads(), from Python
    for _ in prange(max(1, min(n_threads, n_tasks))):  # (inside a cached kernel it is a dynamic global)
        task = next_task(counter)
        while task < n_tasks:
            ...
            task = next_task(counter)
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from kernels_cpu.simd import ir_ptr

_I64 = ir.IntType(64)


@intrinsic
def next_task(typingctx, counter):
    """counter[0] += 1, atomically (monotonic: the tasks' data need no ordering); returns the old value."""
    if not (isinstance(counter, types.Array) and counter.dtype == types.int64):
        return None

    def codegen(context, builder, sig, args):
        p = ir_ptr(context, builder, sig.args[0], args[0], ir.Constant(_I64, 0), _I64)
        return builder.atomic_rmw("add", p, ir.Constant(_I64, 1), "monotonic")
    return types.int64(counter), codegen


def new_counter() -> np.ndarray:
    """A fresh task counter (one int64, 0): one per parallel call."""
    return np.zeros(8, dtype=np.int64)  # a whole cache line, shared with nothing else
