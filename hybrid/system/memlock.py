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
from hybrid.system.libc import libc
from hybrid.system.sizes import format_size

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
    return end - start if libc().madvise(start, end - start, MADV_DONTNEED) == 0 else 0


def _fmt(n: int) -> str:
    return f"{format_size(n)} ({n} bytes)"


def lock_ranges(ranges: list[tuple[int, int]]) -> LockResult:
    """madvise(MADV_WILLNEED) then mlock each range; on refusal unlock what was locked and say why in `message`."""
    lib, done = libc(), []
    needed = sum(e - s for s, e in ranges)
    for s, e in ranges:
        lib.madvise(s, e - s, MADV_WILLNEED)  # start the reads now; mlock then waits for them
        if lib.mlock(s, e - s) != 0:
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
    lib = libc()
    for s, e in result.ranges:
        lib.munlock(s, e - s)


def place_ranges(ranges: list[tuple[int, int]], mode: str) -> None:
    """Apply --numa to the ranges: their VMA policy (mbind), and prefault them (MADV_WILLNEED) under the same
    thread policy, since file pages follow the policy of the thread that reads them in."""
    pol = numa.policy_for(mode)
    if pol is None:
        return
    lib = libc()
    with numa.memory_policy(mode):
        for s, e in ranges:
            numa.mbind(s, e - s, *pol)
            lib.madvise(s, e - s, MADV_WILLNEED)


def prepare_cpu_weights(arrays: Iterable[np.ndarray], numa_mode: str = "",
                        mlock: bool = False) -> tuple[list[str], LockResult | None]:
    """--numa then --mlock on the CPU-resident weights' arrays (ModelWeights.host_arrays()). Returns the lines to
    show the user and the lock (None when --mlock is off; its ranges empty when refused)."""
    notes = []
    note = numa.numa_note(numa_mode)
    ranges = page_ranges(arrays) if (note or mlock) else []
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
