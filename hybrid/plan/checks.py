"""The rest of the tuning checklist for `hybrid probe`: threads, mlock, NUMA, PCIe link, VRAM used by others.

Each check returns a `Check` (name, status, detail, recommended value); nothing prints.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from hybrid.system.devices import MachineInfo
from hybrid.system.sizes import format_size


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # "ok", "warn", "info"
    detail: str
    value: str = ""  # what to put on the command line, if anything


def threads_check(machine: MachineInfo, sweep: dict[int, float] | None) -> Check:
    """-t: the physical core count, or the fastest count of a measured decode sweep {threads: tokens/s}."""
    if not sweep:
        return Check("threads", "info", f"{machine.physical_cores} physical cores "
                     f"({machine.logical_cores} logical): -t {machine.physical_cores}", str(machine.physical_cores))
    best = max(sweep, key=sweep.get)
    parts = ", ".join(f"-t {t}: {v:.2f} t/s" for t, v in sorted(sweep.items()))
    return Check("threads", "ok", f"decode on the CPU layers: {parts}; fastest -t {best}", str(best))


def thread_sweep(engine, counts: list[int], n_tokens: int = 3) -> dict[int, float]:
    """Decode speed of the loaded engine (tokens/s) at each thread count; a short measurement, not a benchmark."""
    import numba  # noqa: PLC0415

    out = {}
    for t in counts:
        numba.set_num_threads(t)
        cache = engine.new_cache(64)
        engine.eval([engine.tokenizer.bos_id or 0], cache)  # warm-up
        t0 = time.perf_counter()
        for i in range(n_tokens):
            engine.eval([i + 10], cache)
        out[t] = n_tokens / (time.perf_counter() - t0)
    return out


def mlock_check(machine: MachineInfo, cpu_bytes: int) -> Check:
    if machine.memlock_soft < 0:
        return Check("mlock", "ok", "RLIMIT_MEMLOCK is unlimited: --mlock will keep the CPU layers in RAM", "--mlock")
    limit, need = format_size(machine.memlock_soft), format_size(cpu_bytes)
    if machine.memlock_soft >= cpu_bytes:
        return Check("mlock", "ok", f"RLIMIT_MEMLOCK {limit} >= {need} of CPU weights", "--mlock")
    return Check("mlock", "warn", f"--mlock needs {need} but RLIMIT_MEMLOCK is {limit}: "
                 "raise it with `ulimit -l unlimited` or memlock in /etc/security/limits.conf")


def numa_check(machine: MachineInfo) -> Check:
    n = len(machine.numa_nodes)
    if n <= 1:
        return Check("numa", "info", "one NUMA node: --numa distribute does not apply")
    return Check("numa", "warn", f"{n} NUMA nodes: --numa distribute interleaves the CPU weights and spreads threads",
                 "--numa distribute")


def gpu_link_checks(device: int = 0) -> list[Check]:
    """PCIe generation/width (current vs max) and VRAM used by other processes, through NVML when available."""
    try:
        import pynvml  # noqa: PLC0415 - nvidia-ml-py, optional
    except ImportError:
        return [Check("pcie", "info", "NVML not available (pip install nvidia-ml-py): PCIe link not checked")]
    try:
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(device)
        cur_g, max_g = pynvml.nvmlDeviceGetCurrPcieLinkGeneration(h), pynvml.nvmlDeviceGetMaxPcieLinkGeneration(h)
        cur_w, max_w = pynvml.nvmlDeviceGetCurrPcieLinkWidth(h), pynvml.nvmlDeviceGetMaxPcieLinkWidth(h)
        link = Check("pcie", "ok" if (cur_g, cur_w) == (max_g, max_w) else "warn",
                     f"PCIe gen {cur_g} x{cur_w} (max gen {max_g} x{max_w})"
                     + ("" if (cur_g, cur_w) == (max_g, max_w) else ": the link is below its maximum (idle "
                        "power saving lowers the generation; a narrower width means a slot or riser problem)"))
        others = 0
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
            if proc.pid != os.getpid() and proc.usedGpuMemory:
                others += int(proc.usedGpuMemory)
        vram = Check("vram", "ok" if others == 0 else "warn", f"VRAM used by other processes: {format_size(others)}")
        return [link, vram]
    except Exception as exc:  # noqa: BLE001 - NVML errors vary by driver; report and go on
        return [Check("pcie", "info", f"NVML query failed: {exc}")]
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass
