"""The memory options of the CPU-resident weights: --numa placement of their pages, then --mlock (MADV_WILLNEED,
then mlock on their page-aligned ranges). A too-low RLIMIT_MEMLOCK is a one-line warning, never an error."""

from __future__ import annotations

import ctypes
import mmap
import os
import resource
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from hybrid.system import numa
from hybrid.model.weights import ModelWeights

MADV_WILLNEED = 3
MADV_DONTNEED = 4
PAGE = mmap.PAGESIZE


@dataclass(frozen=True)
class LockResult:
    ranges: tuple[tuple[int, int], ...]  # the [start, end) ranges now locked
    needed_bytes: int
    message: str = ""  # a warning when the lock was refused

    @property
    def locked_bytes(self) -> int:
        return sum(e - s for s, e in self.ranges)


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    for name in ("mlock", "munlock", "madvise"):
        fn = getattr(libc, name)
        fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t) + ((ctypes.c_int,) if name == "madvise" else ())
        fn.restype = ctypes.c_int
    return libc


def cpu_arrays(weights: ModelWeights) -> list[np.ndarray]:
    """The host arrays of every weight still on the CPU (GPU-resident ones are skipped)."""
    ws = [weights.token_embd, weights.output, weights.output_norm, *(w for lw in weights.layers for w in lw.values())]
    return [w.raw for w in ws if isinstance(w.raw, np.ndarray)]


def page_ranges(arrays: Iterable[np.ndarray]) -> list[tuple[int, int]]:
    """The page-aligned address ranges [start, end) the arrays' bytes occupy, sorted, overlaps and neighbours merged."""
    spans = []
    for a in arrays:
        if a.nbytes:
            addr = a.__array_interface__["data"][0]
            spans.append((addr // PAGE * PAGE, -(-(addr + a.nbytes) // PAGE) * PAGE))
    merged: list[tuple[int, int]] = []
    for s, e in sorted(spans):
        if merged and s <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], e))
        else:
            merged.append((s, e))
    return merged


def release_pages(a: np.ndarray) -> int:
    """madvise(MADV_DONTNEED) the whole pages inside a's bytes (file pages leave this process's resident set,
    anonymous ones are freed); the caller no longer reads them. Returns the bytes released."""
    addr = a.__array_interface__["data"][0]
    start, end = -(-addr // PAGE) * PAGE, (addr + a.nbytes) // PAGE * PAGE
    if end <= start:
        return 0
    return end - start if _libc().madvise(start, end - start, MADV_DONTNEED) == 0 else 0


def _fmt(n: int) -> str:
    return f"{n / 2**20:.1f} MiB ({n} bytes)"


def lock_ranges(ranges: list[tuple[int, int]]) -> LockResult:
    """madvise(MADV_WILLNEED) then mlock each range; on refusal unlock what was locked and say why in `message`."""
    libc, done = _libc(), []
    needed = sum(e - s for s, e in ranges)
    for s, e in ranges:
        libc.madvise(s, e - s, MADV_WILLNEED)  # start the reads now; mlock then waits for them
        if libc.mlock(s, e - s) != 0:
            err = ctypes.get_errno()
            unlock(LockResult(tuple(done), needed))
            return LockResult((), needed, _refusal(needed, err))
        done.append((s, e))
    return LockResult(tuple(done), needed)


def _refusal(needed: int, err: int) -> str:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    limit = "unlimited" if soft == resource.RLIM_INFINITY else _fmt(soft)
    return (f"warning: --mlock: locking the weights needs {_fmt(needed)} but RLIMIT_MEMLOCK is {limit} "
            f"({os.strerror(err)}); raise it with `ulimit -l unlimited` (or a `memlock` line in "
            f"/etc/security/limits.conf, e.g. `* - memlock unlimited`, then log in again); continuing without mlock")


def unlock(result: LockResult) -> None:
    libc = _libc()
    for s, e in result.ranges:
        libc.munlock(s, e - s)


def place_ranges(ranges: list[tuple[int, int]], mode: str) -> None:
    """Apply --numa to the ranges: their VMA policy (mbind), and prefault them (MADV_WILLNEED) under the same
    thread policy, since file pages follow the policy of the thread that reads them in."""
    pol = numa.policy_for(mode)
    if pol is None:
        return
    libc = _libc()
    with numa.memory_policy(mode):
        for s, e in ranges:
            numa.mbind(s, e - s, *pol)
            libc.madvise(s, e - s, MADV_WILLNEED)


def prepare_cpu_weights(weights: ModelWeights, numa_mode: str = "",
                        mlock: bool = False) -> tuple[list[str], LockResult | None]:
    """--numa then --mlock on the CPU-resident weights. Returns the lines to show the user and the lock (None
    when --mlock is off; its ranges empty when refused)."""
    notes = []
    note = numa.numa_note(numa_mode)
    ranges = page_ranges(cpu_arrays(weights)) if (note or mlock) else []
    if note:
        notes.append(note)
        try:
            place_ranges(ranges, numa_mode)
        except OSError as exc:
            notes.append(f"warning: --numa {numa_mode}: the memory policy was refused ({exc}); continuing without it")
    lock = None
    if mlock:
        lock = lock_ranges(ranges)
        notes.append(lock.message or f"mlock: {_fmt(lock.locked_bytes)} of weights locked in RAM")
    return notes, lock
