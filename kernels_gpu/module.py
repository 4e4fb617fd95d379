"""Compiles the `.cu` sources of this package once per process and device, through a cached `cupy.RawModule`.

A module is a list of source files concatenated as text (common.cu first: NVRTC has no standard headers); a name
in GENERATED is source text made by a Python function instead of a file (the IQ grids, from gguf_io).
CuPy also keeps the compiled binaries in its on-disk kernel cache, so later processes load them at once.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

from . import iq_tables

HERE = Path(__file__).resolve().parent

# module name -> the source files it is made of, in order
MODULES: dict[str, tuple[str, ...]] = {
    "matvec_legacy": ("common.cu", "matvec_common.cu", "moe_mma.cu", "matvec_legacy.cu"),
    "matvec_k": ("common.cu", "matvec_common.cu", "moe_mma.cu", "matvec_k.cu"),
    "matvec_iq": ("common.cu", "matvec_common.cu", "moe_mma.cu", "iq_grids.cu", "matvec_iq.cu"),
    "matvec_q8": ("common.cu", "matvec_q8.cu", "matvec_q8_staged.cu", "matvec_mmq.cu", "matvec_mmq_q6k.cu"),
    "matvec_float": ("common.cu", "matvec_float.cu", "matvec_float_entries.cu"),
    "ops": ("common.cu", "ops.cu"),
    "kv": ("common.cu", "kv.cu"),
    "attention": ("common.cu", "attention.cu", "attention_mma.cu"),
    "moe": ("common.cu", "matvec_float.cu", "moe.cu"),  # moe_router_route: the float matvec's body
    "moe_cache": ("common.cu", "moe_cache.cu"),
    "unrepack": ("common.cu", "unrepack.cu"),
    "host_sync": ("common.cu", "host_sync.cu"),
}

# source "files" made by code: name -> a function returning the text
GENERATED: dict[str, Callable[[], str]] = {"iq_grids.cu": iq_tables.cuda_source}

# NVRTC optimizes by default (-O3 is an nvcc flag it rejects); no fast math: expf/sincosf/division stay IEEE-exact
OPTIONS = ("--std=c++17",)


def source(name: str) -> str:
    """The full source text of module `name` (what NVRTC compiles)."""
    try:
        files = MODULES[name]
    except KeyError:
        raise ValueError(f"unknown GPU kernel module {name!r}; known: {', '.join(MODULES)}") from None
    return "\n".join(f"// ---- {f}\n" + (GENERATED[f]() if f in GENERATED else (HERE / f).read_text()) for f in files)


@lru_cache(maxsize=None)
def _module(name: str, defines: tuple[tuple[str, int], ...], device_id: int):
    import cupy  # noqa: PLC0415 - lazy: this package imports without CuPy

    options = OPTIONS + tuple(f"-D{k}={v}" for k, v in defines)
    with cupy.cuda.Device(device_id):
        mod = cupy.RawModule(code=source(name), options=options)
        mod.compile()  # compile now, so errors surface here and not at the first launch
    return mod


def get_module(name: str, defines: tuple[tuple[str, int], ...] = ()):
    """The compiled `cupy.RawModule` of `name` (with `-Dkey=value` defines) for the current device."""
    import cupy  # noqa: PLC0415

    return _module(name, tuple(defines), cupy.cuda.runtime.getDevice())


@lru_cache(maxsize=None)
def _function(module: str, kernel: str, defines: tuple[tuple[str, int], ...], device_id: int):
    return _module(module, defines, device_id).get_function(kernel)


def get_kernel(module: str, kernel: str, defines: tuple[tuple[str, int], ...] = ()):
    """The `cupy.RawKernel` `kernel` (an extern "C" name) of module `module` built with `defines`, cached."""
    import cupy  # noqa: PLC0415

    return _function(module, kernel, tuple(defines), cupy.cuda.runtime.getDevice())


# variants compiled by compile_all() besides each module's default build (attention: one kernel per variant)
CHECK_VARIANTS: dict[str, tuple[tuple[tuple[str, int], ...], ...]] = {
    "attention": ((("ATT_E", 4), ("ATT_HPC", 4)), (("ATT_E", 8), ("ATT_HPC", 4)), (("ATT_E", 3), ("ATT_HPC", 8)),
                  (("ATTP_D", 128),), (("ATTP_D", 256),), (("ATTM_D", 64),), (("ATTM_D", 128),)),
    **{m: ((("MOE_MMA", 1),),) for m in ("matvec_legacy", "matvec_k", "matvec_iq")},  # moe_mma.cu's entries
}


def compile_all() -> dict[str, str | None]:
    """Compile every module (and CHECK_VARIANTS) now; {module: None if it compiled, else the compiler's message}."""
    result: dict[str, str | None] = {}
    for name in MODULES:
        try:
            get_module(name)
            for defines in CHECK_VARIANTS.get(name, ()):
                get_module(name, defines)
            result[name] = None
        except Exception as exc:  # noqa: BLE001 - report every module's compiler log, not just the first
            result[name] = f"{type(exc).__name__}: {exc}"
    return result
