"""CPU thread count for the Numba kernels: -t defaults to the number of physical cores."""

from __future__ import annotations

import numba

from .devices import physical_core_cpus


def default_threads() -> int:
    return max(1, len(physical_core_cpus()))


def configure_threads(n_threads: int) -> int:
    """Set Numba's worker count (at most its pool size); returns the count in effect."""
    n = n_threads if n_threads > 0 else default_threads()
    n = max(1, min(n, numba.config.NUMBA_NUM_THREADS))
    numba.set_num_threads(n)
    return n
