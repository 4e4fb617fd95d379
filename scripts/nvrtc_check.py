"""Compile kernels_gpu's CUDA modules with NVRTC alone, no GPU and no CuPy needed: a machine without a GPU can
catch compile errors before a device call. NVRTC comes from the `nvidia-cuda-nvrtc` wheel (unzip it anywhere):

    python3 scripts/nvrtc_check.py --lib DIR [MODULE ...]      # DIR holds libnvrtc.so.13 and its builtins

Prints each module's result and NVRTC's log; exits 1 when a module fails to compile."""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels_gpu.module import CHECK_VARIANTS, MODULES, OPTIONS, source  # noqa: E402


def compile_module(lib, name: str, arch: str, defines: tuple = ()) -> tuple[bool, str]:
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), source(name).encode(), name.encode(), 0, None, None):
        return False, "nvrtcCreateProgram failed"
    opts = [o.encode() for o in (*OPTIONS, *(f"-D{k}={v}" for k, v in defines), f"--gpu-architecture={arch}")]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return rc == 0, log.value.decode(errors="replace").strip()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("modules", nargs="*", help=f"default: all ({', '.join(MODULES)})")
    ap.add_argument("--lib", required=True, help="the folder of libnvrtc.so.13 (and libnvrtc-builtins)")
    ap.add_argument("--arch", default="compute_90", help="virtual architecture (default compute_90: Hopper)")
    ap.add_argument("--quiet", action="store_true", help="logs of failed modules only")
    args = ap.parse_args()
    os.environ["LD_LIBRARY_PATH"] = args.lib + os.pathsep + os.environ.get("LD_LIBRARY_PATH", "")
    ctypes.CDLL(str(Path(args.lib) / "libnvrtc-builtins.so.13.0"), mode=ctypes.RTLD_GLOBAL)
    lib = ctypes.CDLL(str(Path(args.lib) / "libnvrtc.so.13"))
    failed = 0
    for name in args.modules or MODULES:
        for defines in ((), *CHECK_VARIANTS.get(name, ())):  # each build compile_all() makes
            ok, log = compile_module(lib, name, args.arch, defines)
            failed += not ok
            label = name + "".join(f" -D{k}={v}" for k, v in defines)
            print(f"{label}: {'ok' if ok else 'FAILED'}")
            if log and (not ok or not args.quiet):
                print(log)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
