"""Numba's workers: thread count, CPU choice (-C, --cpu-range, --numa order) and pinning one per physical core,
checked in /proc/<pid>/task/*/status; and the first-run compile check."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hybrid.system.devices import physical_core_cpus
from hybrid.errors import HybridError
from hybrid.system.numa import thread_cpus
from hybrid.system.threads import (allowed_cpus, cpu_order, default_threads, parse_cpu_mask, parse_cpu_range,
                                  select_cpus)

ROOT = Path(__file__).resolve().parents[1]

# Pins in a child process: pinning narrows the main thread's mask, which pytest's later subprocesses would inherit.
PIN = textwrap.dedent("""
    import json, os, sys
    from hybrid.system.threads import select_cpus, setup_threads, thread_affinity
    s = setup_threads(int(sys.argv[1]), select_cpus(None, sys.argv[2] or None))
    tasks = {t: thread_affinity(int(t)) for t in os.listdir("/proc/self/task")}
    print(json.dumps({"n": s.n_threads, "cpus": s.cpus, "tids": s.tids, "main": s.main_tid, "layer": s.layer,
                      "tasks": tasks}))
""")


def pinned(n_threads: int = 0, cpu_range: str = "", **env: str) -> dict:
    r = subprocess.run([sys.executable, "-c", PIN, str(n_threads), cpu_range], cwd=ROOT, capture_output=True,
                       text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT), **env})
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.splitlines()[-1])


def test_parse_cpu_mask_and_range():
    assert parse_cpu_mask("0x3") == (0, 1)
    assert parse_cpu_mask("F0") == (4, 5, 6, 7)
    assert parse_cpu_range("2-4") == (2, 3, 4)
    assert parse_cpu_range("1") == (1,)
    for bad in ("0x0", "zz"):
        with pytest.raises(HybridError, match="cpu-mask"):
            parse_cpu_mask(bad)
    for bad in ("3-1", "a-b"):
        with pytest.raises(HybridError, match="cpu-range"):
            parse_cpu_range(bad)


def test_select_cpus_union_and_bounds():
    cpus = allowed_cpus()
    assert select_cpus() == ()
    assert select_cpus(hex(1 << cpus[0]), f"{cpus[-1]}-{cpus[-1]}") == tuple(sorted({cpus[0], cpus[-1]}))
    with pytest.raises(HybridError, match="may only run on"):
        select_cpus(None, "100000-100001")


def test_cpu_order_puts_one_cpu_per_core_before_siblings():
    # 4 cores x 2 hyperthreads, numbered as Linux on Intel (sibling of cpu i is i + 4) and as on AMD (2i, 2i+1)
    assert cpu_order(range(8), core_of=lambda c: c % 4) == (0, 1, 2, 3, 4, 5, 6, 7)
    assert cpu_order(range(8), core_of=lambda c: c // 2) == (0, 2, 4, 6, 1, 3, 5, 7)
    assert cpu_order([2, 3, 6, 7], core_of=lambda c: c % 4) == (2, 3, 6, 7)


def test_numa_distribute_alternates_nodes():
    nodes = ((0, (0, 1, 4, 5)), (1, (2, 3, 6, 7)))
    order = cpu_order(range(8), core_of=lambda c: c % 4)
    assert thread_cpus("distribute", order, nodes) == [0, 2, 1, 3, 4, 6, 5, 7]
    assert thread_cpus("", order, nodes) == list(order)
    assert thread_cpus("distribute", order, ((0, tuple(range(8))),)) == list(order)  # one node: unchanged


def test_default_threads_is_physical_cores():
    # among the CPUs the process started with: an engine loaded in this process earlier pinned the main thread
    assert default_threads() == len(physical_core_cpus(allowed_cpus()))


@pytest.mark.parametrize("layer", ["default", "workqueue"])
def test_workers_pinned_one_per_physical_core(layer):
    env = {} if layer == "default" else {"NUMBA_THREADING_LAYER": layer}
    r = pinned(**env)
    cores = set(physical_core_cpus())
    assert r["n"] == min(len(cores), len(allowed_cpus()))
    assert len(set(r["tids"])) == r["n"]
    for tid, cpu in zip(r["tids"], r["cpus"]):
        assert r["tasks"][str(tid)] == [cpu], (tid, r["tasks"])  # exactly one CPU each
    assert len(set(r["cpus"])) == r["n"] and set(r["cpus"]) <= cores  # distinct physical cores, no siblings
    assert r["tasks"][str(r["main"])] == [r["cpus"][0]]  # the main thread runs Python between kernels
    if r["layer"] == "omp":
        assert r["tids"][0] == r["main"]  # OpenMP's thread 0 is the main thread


def test_cpu_range_single_cpu_gives_one_thread():
    cpu = allowed_cpus()[0]
    r = pinned(0, f"{cpu}-{cpu}")
    assert r["n"] == 1 and r["cpus"] == [cpu] and r["tids"] == [r["main"]]
    assert r["tasks"][str(r["main"])] == [cpu]
