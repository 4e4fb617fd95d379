"""--numa distribute|isolate|numactl: which nodes the CPU-resident weights' pages and the worker threads use.

Memory policies go through the raw syscalls (set_mempolicy, get_mempolicy, mbind) via ctypes, so libnuma is not
needed. On a one-node machine every mode is a no-op, and `numa_note` says so.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from hybrid.system.devices import numa_nodes
from hybrid.system.libc import libc
from hybrid.errors import HybridError

Nodes = tuple[tuple[int, tuple[int, ...]], ...]  # (node id, its cpus), as devices.numa_nodes()

NUMA_MODES = ("distribute", "isolate", "numactl")
MPOL_DEFAULT, MPOL_PREFERRED, MPOL_BIND, MPOL_INTERLEAVE = 0, 1, 2, 3
_SYSCALLS = {  # asm/unistd_64.h and asm-generic/unistd.h
    "x86_64": {"mbind": 237, "set_mempolicy": 238, "get_mempolicy": 239},
    "aarch64": {"mbind": 235, "get_mempolicy": 236, "set_mempolicy": 237},
}
_MASK_WORDS = 17  # 1088 bits: more than MAX_NUMNODES (1024) on any distribution kernel
_MAXNODE = 64 * (_MASK_WORDS - 1) + 1  # the kernel reads maxnode - 1 bits


def check_mode(mode: str) -> str:
    """'' (off) or one of NUMA_MODES; anything else is a HybridError naming the choices."""
    if mode and mode not in NUMA_MODES:
        raise HybridError(f"unknown --numa mode '{mode}': choose one of {', '.join(NUMA_MODES)}")
    return mode


def _syscall(name: str, *args) -> int:
    nr = _SYSCALLS.get(platform.machine(), {}).get(name)
    if nr is None:
        raise OSError(errno.ENOSYS, f"{name}: no syscall number known for {platform.machine()}")
    ctypes.set_errno(0)
    rc = libc().syscall(ctypes.c_long(nr), *args)
    if rc < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{name}: {os.strerror(e)}")
    return rc


def _nodemask(nodes: Sequence[int]):
    mask = (ctypes.c_ulong * _MASK_WORDS)()
    for n in nodes:
        mask[n // 64] |= 1 << (n % 64)
    return mask


def set_mempolicy(mode: int, nodes: Sequence[int] = ()) -> None:
    """The calling thread's policy for the pages it allocates from now on (MPOL_DEFAULT: local node)."""
    mask = _nodemask(nodes) if nodes else None
    _syscall("set_mempolicy", ctypes.c_int(mode), mask, ctypes.c_ulong(_MAXNODE if nodes else 0))


def get_mempolicy() -> tuple[int, tuple[int, ...]]:
    """The calling thread's policy: (mode, nodes)."""
    mode, mask = ctypes.c_int(), _nodemask(())
    _syscall("get_mempolicy", ctypes.byref(mode), mask, ctypes.c_ulong(_MAXNODE), None, ctypes.c_ulong(0))
    nodes = tuple(i for i in range(64 * _MASK_WORDS) if mask[i // 64] >> (i % 64) & 1)
    return mode.value, nodes


def mbind(addr: int, length: int, mode: int, nodes: Sequence[int], flags: int = 0) -> None:
    """Set the policy of the pages [addr, addr + length) (addr page-aligned). /proc/self/numa_maps shows it.

    For file mappings the kernel places page-cache pages by the policy of the thread that faults them in, so
    callers also set the thread policy while they prefault (see `memory_policy`)."""
    _syscall("mbind", ctypes.c_void_p(addr), ctypes.c_ulong(length), ctypes.c_int(mode), _nodemask(nodes),
             ctypes.c_ulong(_MAXNODE), ctypes.c_uint(flags))


def current_node(nodes: Nodes | None = None) -> int:
    """The node of the CPU this thread runs on now."""
    nodes = nodes if nodes is not None else numa_nodes()
    cpu = libc().sched_getcpu()
    return next((n for n, cpus in nodes if cpu in cpus), nodes[0][0])


def policy_for(mode: str, nodes: Nodes | None = None) -> tuple[int, tuple[int, ...]] | None:
    """(MPOL_*, node ids) for the weights under `mode`, or None when nothing is to be done (off, numactl, one node)."""
    nodes = nodes if nodes is not None else numa_nodes()
    if check_mode(mode) in ("", "numactl") or len(nodes) < 2:
        return None
    if mode == "distribute":
        return MPOL_INTERLEAVE, tuple(n for n, _ in nodes)
    return MPOL_BIND, (current_node(nodes),)


def numa_note(mode: str, nodes: Nodes | None = None) -> str | None:
    """One line for the user when `mode` is set: what it does here (a no-op on a one-node machine)."""
    nodes = nodes if nodes is not None else numa_nodes()
    if not check_mode(mode):
        return None
    if len(nodes) < 2:
        n, cpus = nodes[0]
        return f"numa: one NUMA node here (node{n}: {len(cpus)} cpus); --numa {mode} changes nothing"
    if mode == "numactl":
        return "numa: numactl: threads use the CPUs and memory policy numactl gave this process"
    if mode == "distribute":
        return (f"numa: distribute: weights interleaved over nodes {','.join(str(n) for n, _ in nodes)}, "
                "threads spread over them (pages already in the page cache stay where they are: "
                "drop caches first, `echo 3 > /proc/sys/vm/drop_caches`)")
    return f"numa: isolate: weights and threads on node {current_node(nodes)}"


@contextmanager
def memory_policy(mode: str, nodes: Nodes | None = None) -> Iterator[None]:
    """Within the block, pages this thread allocates (anonymous memory, page cache it faults in) follow `mode`;
    the previous policy comes back afterwards. A no-op where `policy_for` is None."""
    pol = policy_for(mode, nodes)
    if pol is None:
        yield
        return
    old_mode, old_nodes = get_mempolicy()
    set_mempolicy(*pol)
    try:
        yield
    finally:
        set_mempolicy(old_mode, old_nodes if old_mode != MPOL_DEFAULT else ())


def thread_cpus(mode: str, cpus: Sequence[int], nodes: Nodes | None = None) -> list[int]:
    """`cpus` (in preference order) rearranged for `mode`: distribute alternates nodes, isolate keeps the current
    node's CPUs; unchanged for off/numactl or one node."""
    nodes = nodes if nodes is not None else numa_nodes()
    cpus = list(cpus)
    if check_mode(mode) in ("", "numactl") or len(nodes) < 2:
        return cpus
    node_of = {c: n for n, cs in nodes for c in cs}
    if mode == "isolate":
        here = current_node(nodes)
        return [c for c in cpus if node_of.get(c) == here] or cpus
    per_node: dict[int, list[int]] = {}
    for c in cpus:
        per_node.setdefault(node_of.get(c, -1), []).append(c)
    queues = list(per_node.values())
    out: list[int] = []
    while any(queues):
        for q in queues:
            if q:
                out.append(q.pop(0))
    return out
