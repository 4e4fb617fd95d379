"""CUDA kernels (`.cu` sources compiled once through NVRTC by `module.py`) and their small CuPy launchers.

Importing this package needs no CuPy: every launcher imports cupy when it runs. `available()` says whether a
usable CUDA device is there.
"""

from __future__ import annotations

from .matmul import GPU_KERNELS, MATVEC_MAX_TOKENS, GpuKernel, gpu_kernel

__all__ = ["GPU_KERNELS", "MATVEC_MAX_TOKENS", "GpuKernel", "available", "gpu_kernel"]


def available() -> bool:
    """True when CuPy imports and sees at least one CUDA device."""
    try:
        import cupy  # noqa: PLC0415

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - no CuPy, no driver, no device: all mean "not available"
        return False
