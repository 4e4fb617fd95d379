"""What this machine offers: physical cores, CPU features, RAM, NUMA nodes, memlock limit, GPUs.

Pure queries, no printing; `probe_machine()` returns a frozen `MachineInfo` the CLI renders.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

_FEATURES = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8")


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    total_bytes: int
    free_bytes: int
    compute_capability: str


@dataclass(frozen=True)
class MachineInfo:
    cpu_model: str
    logical_cores: int
    physical_cores: int
    cpu_features: tuple[str, ...]
    ram_total_bytes: int
    ram_available_bytes: int
    numa_nodes: tuple[tuple[int, tuple[int, ...]], ...]  # (node id, its cpus)
    memlock_soft: int  # bytes, -1 = unlimited
    memlock_hard: int
    gpus: tuple[GpuInfo, ...] = field(default_factory=tuple)
    gpu_error: str = ""  # why no GPU is usable, when none is


def _cpuinfo(path: Path = Path("/proc/cpuinfo")) -> tuple[str, set[str]]:
    model, flags = "unknown", set()
    try:
        for line in path.read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and model == "unknown":
                model = value.strip()
            elif key == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return model, flags


def parse_cpulist(text: str) -> tuple[int, ...]:
    """'0-3,8,10-11' -> (0, 1, 2, 3, 8, 10, 11)."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return tuple(cpus)


def numa_nodes(root: Path = Path("/sys/devices/system/node")) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """NUMA nodes and their CPUs; one node with every CPU where sysfs says nothing."""
    nodes = []
    for d in sorted(root.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        try:
            nodes.append((int(d.name[4:]), parse_cpulist((d / "cpulist").read_text())))
        except (OSError, ValueError):
            continue
    return tuple(nodes) or ((0, tuple(range(os.cpu_count() or 1))),)


def core_key(cpu: int) -> tuple[str, str]:
    """(package, core) of a logical CPU: siblings of one physical core share it."""
    base = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
    try:
        return (base / "physical_package_id").read_text().strip(), (base / "core_id").read_text().strip()
    except OSError:
        return "?", str(cpu)


def physical_core_cpus(cpus: Iterable[int] | None = None) -> tuple[int, ...]:
    """One logical CPU per physical core (the first sibling of each) among `cpus` (default: this thread's
    affinity)."""
    seen, chosen = set(), []
    for cpu in sorted(os.sched_getaffinity(0)) if cpus is None else cpus:
        key = core_key(cpu)
        if key not in seen:
            seen.add(key)
            chosen.append(cpu)
    return tuple(chosen)


def probe_gpus() -> tuple[tuple[GpuInfo, ...], str]:
    """Usable CUDA devices through CuPy, or () and the reason there are none."""
    try:
        import cupy  # noqa: PLC0415 - optional dependency, imported lazily
    except ImportError:
        return (), "CuPy is not installed (pip install 'hybrid[cuda13]' or '[cuda12]')"
    try:
        gpus = []
        for i in range(cupy.cuda.runtime.getDeviceCount()):
            with cupy.cuda.Device(i):
                props = cupy.cuda.runtime.getDeviceProperties(i)
                free, total = cupy.cuda.runtime.memGetInfo()
                name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
                gpus.append(GpuInfo(i, name, int(total), int(free), f"{props['major']}.{props['minor']}"))
        return tuple(gpus), "" if gpus else "no CUDA device found"
    except Exception as exc:  # noqa: BLE001 - any CUDA failure means "no usable GPU"; the reason is reported
        return (), f"CUDA is not usable: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"


def probe_machine(with_gpu: bool = True) -> MachineInfo:
    model, flags = _cpuinfo()
    vm = psutil.virtual_memory()
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    gpus, gpu_error = probe_gpus() if with_gpu else ((), "not probed")
    return MachineInfo(
        cpu_model=model,
        logical_cores=os.cpu_count() or 1,
        # psutil counts the machine's cores, not this thread's affinity (narrowed to one CPU once pinned)
        physical_cores=psutil.cpu_count(logical=False) or len(physical_core_cpus()),
        cpu_features=tuple(f for f in _FEATURES if f in flags),
        ram_total_bytes=int(vm.total),
        ram_available_bytes=int(vm.available),
        numa_nodes=numa_nodes(),
        memlock_soft=-1 if soft == resource.RLIM_INFINITY else int(soft),
        memlock_hard=-1 if hard == resource.RLIM_INFINITY else int(hard),
        gpus=gpus,
        gpu_error=gpu_error,
    )
