"""The C library, one handle with the prototypes hybrid calls (mlock, munlock, madvise, syscall, sched_getcpu)."""

from __future__ import annotations

import ctypes
from functools import cache


@cache
def libc() -> ctypes.CDLL:
    """The process's libc (errno kept for ctypes.get_errno), its prototypes set once."""
    lib = ctypes.CDLL(None, use_errno=True)
    for name in ("mlock", "munlock", "madvise"):
        fn = getattr(lib, name)
        fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t) + ((ctypes.c_int,) if name == "madvise" else ())
        fn.restype = ctypes.c_int
    lib.syscall.restype = ctypes.c_long
    lib.sched_getcpu.restype = ctypes.c_int
    return lib
