"""Numba kernels of the CPU backend.

Numba's on-disk cache (`cache=True`) keys each function by its own source file only, yet a compiled kernel
carries the machine code of every kernel it calls from other files, and their constant arrays. After an edit or an
upgrade that changes a callee's file but not the caller's, the cache would run the old callee. So on import, the
cache is checked against one hash of all this package's sources and deleted when they changed, before anything
compiles, wherever Numba keeps it (`numba_cache_dir`): a reinstall or an upgrade reuses it exactly when the
kernels' sources are the same.
"""

import hashlib
from pathlib import Path


def sources_digest(pkg: Path) -> str:
    """One sha256 of the names and contents of a package's .py files."""
    h = hashlib.sha256()
    for src in sorted(pkg.glob("*.py")):
        h.update(src.name.encode() + b"\0" + src.read_bytes())
    return h.hexdigest()


def numba_cache_dir(pkg: Path) -> Path:
    """Where Numba caches the functions of pkg's modules, as it chooses for each function: $NUMBA_CACHE_DIR's
    folder for pkg when set, else pkg/__pycache__ when it is writable, else the user-wide cache's folder for pkg."""
    from numba.core import caching  # noqa: PLC0415 - Numba's own locators, in its order

    impl = getattr(caching, "CacheImpl", None) or getattr(caching, "_CacheImpl", None)
    for cls in getattr(impl, "_locator_classes", ()):
        try:
            locator = cls.from_function(sources_digest, str(pkg / "__init__.py"))  # any function: its file is pkg's
        except Exception:  # noqa: BLE001 - a locator that cannot serve here (an unwritable folder)
            continue
        if locator is not None:
            return Path(locator.get_cache_path())
    return pkg / "__pycache__"


def drop_stale_cache(pkg: Path) -> bool:
    """Delete the Numba cache files of pkg (`numba_cache_dir`) unless they were made from pkg's present sources (a
    stamp file there holds the hash of the sources they came from). Returns whether it deleted them."""
    cache, digest = numba_cache_dir(pkg), sources_digest(pkg)
    stamp = cache / "numba-sources.sha256"
    try:
        if stamp.read_text() == digest:
            return False
    except OSError:
        pass
    try:
        for f in cache.glob("*.nb[ic]"):
            f.unlink()
        cache.mkdir(parents=True, exist_ok=True)
        stamp.write_text(digest)
    except OSError:
        return False  # a cache folder that is not ours to write: Numba then compiles without saving
    return True


drop_stale_cache(Path(__file__).parent)
