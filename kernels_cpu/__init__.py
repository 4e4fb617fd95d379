"""Numba kernels of the CPU backend.

Numba's on-disk cache (`cache=True`, in this package's __pycache__) keys each function by its own source file
only, yet a compiled kernel carries the machine code of every kernel it calls from other files, and their
constant arrays. After an edit or an upgrade that changes a callee's file but not the caller's, the cache would
run the old callee. So on import, the cache is checked against one hash of all this package's sources and
deleted when they changed, before anything compiles.
"""

import hashlib
from pathlib import Path


def sources_digest(pkg: Path) -> str:
    """One sha256 of the names and contents of a package's .py files."""
    h = hashlib.sha256()
    for src in sorted(pkg.glob("*.py")):
        h.update(src.name.encode() + b"\0" + src.read_bytes())
    return h.hexdigest()


def drop_stale_cache(pkg: Path) -> bool:
    """Delete the Numba cache files in pkg/__pycache__ unless they were made from pkg's present sources (a
    stamp file there holds the hash of the sources they came from). Returns whether it deleted them."""
    cache, digest = pkg / "__pycache__", sources_digest(pkg)
    stamp = cache / "numba-sources.sha256"
    try:
        if stamp.read_text() == digest:
            return False
    except OSError:
        pass
    try:
        for f in cache.glob("*.nb[ic]"):
            f.unlink()
        cache.mkdir(exist_ok=True)
        stamp.write_text(digest)
    except OSError:
        return False  # a read-only install: Numba caches under the user's cache directory instead (not checked)
    return True


drop_stale_cache(Path(__file__).parent)
