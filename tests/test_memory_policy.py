"""--no-mmap, --mlock and --numa on the CPU-resident weights: what one machine can check of each."""

from __future__ import annotations

import ctypes
import os
import re
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gguf_io import open_gguf
from hybrid.system import numa
from hybrid.system.devices import numa_nodes
from hybrid.engine import Engine, EngineParams
from hybrid.system.memlock import PAGE, lock_ranges, page_ranges, prepare_cpu_weights, unlock

ROOT = Path(__file__).resolve().parents[1]
CAP_IPC_LOCK, PR_CAPBSET_DROP = 14, 24


@pytest.fixture(scope="module")
def model(fixtures_dir) -> Path:
    return fixtures_dir / "arch" / "llama-q4_k_m.gguf"


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def _has_cap(cap: int) -> bool:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> cap & 1)
    return False


def test_no_mmap_reads_the_same_bytes(model):
    with open_gguf(model) as a, open_gguf(model, use_mmap=False) as b:
        assert isinstance(a.mmap, np.memmap) and not isinstance(b.mmap, np.memmap)
        assert not b.mmap.flags.writeable
        for name in a.tensors:
            assert np.array_equal(a.tensor_data(name), b.tensor_data(name))


def test_no_mmap_engine_gives_the_mmap_logits(model):
    tokens = [1, 450, 4996, 17354, 1701]
    logits = []
    for use_mmap in (True, False):
        engine = Engine.load(model, EngineParams(n_ctx=64, use_mmap=use_mmap))
        try:
            assert isinstance(engine.gguf.mmap, np.memmap) == use_mmap
            logits.append(engine.eval(tokens, engine.new_cache(), logits_from=0))
        finally:
            engine.close()
    np.testing.assert_array_equal(logits[0], logits[1])


def test_page_ranges_align_and_merge():
    buf = np.zeros(8 * PAGE, dtype=np.uint8)
    base = -(-buf.ctypes.data // PAGE) * PAGE - buf.ctypes.data  # offset of the first page boundary
    a, b, c = buf[base + 10 : base + 20], buf[base + PAGE + 5 : base + 2 * PAGE + 1], buf[base + 5 * PAGE :][:1]
    start = buf.ctypes.data + base
    assert page_ranges([b, a, c]) == [(start, start + 3 * PAGE), (start + 5 * PAGE, start + 6 * PAGE)]


def test_mlock_locks_the_weights(model):
    with open_gguf(model) as f:
        ranges = page_ranges([f.mmap])
        need = sum(e - s for s, e in ranges)
        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        if not _has_cap(CAP_IPC_LOCK) and soft != resource.RLIM_INFINITY and soft < need + _status_kib("VmLck") * 1024:
            pytest.skip(f"RLIMIT_MEMLOCK {soft} bytes < {need} and no CAP_IPC_LOCK: raise `ulimit -l` to test this")
        before = _status_kib("VmLck")
        res = lock_ranges(ranges)
        try:
            assert res.message == "" and res.locked_bytes == need
            assert _status_kib("VmLck") - before >= need // 1024
        finally:
            unlock(res)
        assert _status_kib("VmLck") == before


def _drop_ipc_lock_and_limit():
    """Child-side: without CAP_IPC_LOCK (gone after exec once dropped from the bounding set) the limit applies."""
    if os.geteuid() == 0:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_CAPBSET_DROP, CAP_IPC_LOCK, 0, 0, 0) != 0:
            os._exit(77)
    _, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (64 * 1024, hard))


def test_mlock_refused_warns_and_the_run_goes_on(model):
    r = subprocess.run([sys.executable, "-m", "hybrid", "run", str(model), "-p", "hi", "-n", "2", "--temp", "0",
                        "--mlock", "--no-display-prompt"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       preexec_fn=_drop_ipc_lock_and_limit)
    if r.returncode == 77:
        pytest.skip("cannot drop CAP_IPC_LOCK here (no CAP_SETPCAP)")
    assert r.returncode == 0, r.stderr
    warn = [line for line in r.stderr.splitlines() if line.startswith("warning: --mlock")]
    assert len(warn) == 1, r.stderr
    assert "RLIMIT_MEMLOCK is 64.0 KiB (65536 bytes)" in warn[0] and "ulimit -l" in warn[0]
    assert "limits.conf" in warn[0] and "continuing without mlock" in warn[0]
    assert re.search(r"needs [\d.]+ [KMG]iB \(\d+ bytes\)", warn[0])  # the bytes needed


def test_numa_on_one_node_says_it_is_a_no_op(model):
    if len(numa_nodes()) > 1:
        pytest.skip("a multi-node machine: the no-op path does not apply")
    with open_gguf(model) as f:
        from hybrid.model.weights import load_weights
        from gguf_io import ModelConfig

        notes, lock = prepare_cpu_weights(load_weights(f, ModelConfig.from_gguf(f)).host_arrays(), "distribute")
    assert lock is None and len(notes) == 1 and "one NUMA node" in notes[0] and "changes nothing" in notes[0]
    assert numa.policy_for("distribute") is None


def _numa_maps_line(addr: int) -> str:
    maps = Path("/proc/self/numa_maps")
    if not maps.exists():
        pytest.skip("no /proc/self/numa_maps (kernel without CONFIG_NUMA)")
    return next((line for line in maps.read_text().splitlines() if int(line.split()[0], 16) == addr), "")


@pytest.mark.parametrize("mode,word", [(numa.MPOL_INTERLEAVE, "interleave:0"), (numa.MPOL_BIND, "bind:0")])
def test_mbind_policy_shows_in_numa_maps(model, mode, word):
    with open_gguf(model) as f:
        (s, e), = page_ranges([f.mmap])
        numa.mbind(s, e - s, mode, (0,))
        assert word in _numa_maps_line(s)


def test_memory_policy_applies_and_restores():
    before = numa.get_mempolicy()
    two_nodes = ((0, (0,)), (0, (1,)))  # node 0 twice: a "multi-node" layout every NUMA kernel accepts
    with numa.memory_policy("distribute", two_nodes):
        assert numa.get_mempolicy() == (numa.MPOL_INTERLEAVE, (0,))
    assert numa.get_mempolicy() == before
