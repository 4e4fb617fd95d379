"""The CPU kernels' compile cache: whether a run will compile (a marker per hash of the kernels' sources, Numba's
index files), and compiling a list of kernels ahead of their first call, in worker processes (one per core),
callees before their callers, each into Numba's on-disk cache, from which the calling process then loads them.

Numba keeps a function's cache as an index file and a data file per signature, each written to a temporary name
and renamed into place. Every kernel of kernels_cpu.signatures has one signature, so workers that compile different
kernels, or the same small callee for the same types, never write entries that contradict each other.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import pickle
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numba

from kernels_cpu import numba_cache_dir, sources_digest
from kernels_cpu.signatures import Kernel

from hybrid.system.threads import allowed_cpus

MAX_WORKERS = 8  # the kernels' call graph is narrow: more processes than this only add their start-up and memory


@dataclass(frozen=True)
class CompileStatus:
    """Where a `compile_kernels` call stands: `done` of `total` kernels compiled, the ones compiling now."""

    done: int
    total: int
    running: tuple[str, ...]  # kernel keys (kernels_cpu.signatures)
    elapsed_s: float
    workers: int


# -- is the cache there? ------------------------------------------------------------------------------------------
def kernel_sources_id(package: str = "kernels_cpu") -> str:
    """A hash of the kernel package's sources and the Numba version: the compile cache holds for this id."""
    d = _package_dir(package)
    h = hashlib.sha256(numba.__version__.encode() + (sources_digest(d) if d else "").encode())
    return h.hexdigest()[:16]


def kernel_cache_stale(marker_dir: Path, package: str = "kernels_cpu") -> bool:
    """True when the next kernel call will compile (slow): no run has been marked done (`mark_kernels_compiled`)
    for these sources, or Numba's cache of the package holds no index matching them (wiped)."""
    d = _package_dir(package)
    if d is None:
        return False
    if not (marker_dir / f"kernels-{kernel_sources_id(package)}.compiled").is_file():
        return True
    cache = numba_cache_dir(d)
    return os.access(cache, os.W_OK) and not any(_index_fresh(d, nbi) for nbi in cache.glob("*.nbi"))


def mark_kernels_compiled(marker_dir: Path, package: str = "kernels_cpu") -> None:
    """Remember that the kernels of these sources have been compiled once (a marker file in `marker_dir`)."""
    try:
        marker_dir.mkdir(parents=True, exist_ok=True)
        (marker_dir / f"kernels-{kernel_sources_id(package)}.compiled").touch()
    except OSError:
        pass  # a read-only cache directory only means the message shows again


def uncached(kernels: Iterable[Kernel]) -> list[Kernel]:
    """The kernels whose signature Numba's cache lacks (their next call compiles): read from the index files, with
    Numba's own key (signature, this CPU, the function's bytecode); nothing is loaded or compiled."""
    out = []
    for k in kernels:
        try:
            fn = _dispatcher(k)
            cache = fn._cache  # a cache=True dispatcher's FunctionCache
            hit = cache._index_key(k.args, fn.targetctx.codegen()) in cache._cache_file._load_index()
        except Exception:  # noqa: BLE001 - Numba's internals moved, or no cache: as if not there
            hit = False
        if not hit:
            out.append(k)
    return out


def load_cpu_target() -> None:
    """Set up Numba's CPU target in this process (its registry of implementations: ~0.4 s), as the first kernel
    call or cache load would; done while a CompilePool's workers start, it leaves the first run's longest path."""
    from numba.core.registry import cpu_target  # noqa: PLC0415

    cpu_target.target_context.refresh()


# -- compiling ahead ------------------------------------------------------------------------------------------------
def compile_kernels(kernels: Sequence[Kernel], n_workers: int, on_status: Callable[[CompileStatus], None] | None
                    = None, cpus: Sequence[int] = ()) -> list[tuple[str, str]]:
    """Compile `kernels` (callees listed before their callers, as kernels_cpu.signatures.closure gives them) into
    Numba's cache: in this process when n_workers <= 1, else in a CompilePool of that many workers. on_status
    hears every start and end. Returns (key, error) of the kernels that failed; their first call compiles them as
    it would have."""
    if not kernels:
        return []
    if min(n_workers, len(kernels)) <= 1:
        return _compile_here(kernels, on_status)
    with CompilePool(min(n_workers, len(kernels)), cpus) as pool:
        return pool.compile(kernels, on_status)


def _compile_here(kernels: Sequence[Kernel], on_status) -> list[tuple[str, str]]:
    t0, failed = time.perf_counter(), []
    for i, k in enumerate(kernels):
        if on_status:
            on_status(CompileStatus(i, len(kernels), (k.key,), time.perf_counter() - t0, 1))
        err = _compile(k)
        if err:
            failed.append((k.key, err))
    if on_status:
        on_status(CompileStatus(len(kernels), len(kernels), (), time.perf_counter() - t0, 1))
    return failed


class CompilePool:
    """min(n_workers, MAX_WORKERS) worker processes, free to run on `cpus` (default: every CPU this process may
    use, whatever its pinned threads), that compile kernels into Numba's cache. They start at once, so they can
    import Numba while the caller does other work; `compile` feeds them one kernel at a time over pipes (pickled),
    each once its callees in the list are done, the longest chain of callers (in Kernel.cost_s) first."""

    def __init__(self, n_workers: int, cpus: Sequence[int] = ()) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([*_package_roots(), os.environ.get("PYTHONPATH", "")])}
        self._procs = []
        for _ in range(max(1, min(n_workers, MAX_WORKERS))):
            try:
                self._procs.append(subprocess.Popen([sys.executable, "-m", "hybrid.system.compile"],
                                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                    stderr=subprocess.DEVNULL, env=env))
            except OSError:  # no process to be had: fewer workers (none: the first calls compile everything)
                break
        self.n = len(self._procs)
        self._replies: queue.Queue = queue.Queue()
        for w, p in enumerate(self._procs):
            if hasattr(os, "sched_setaffinity"):  # a child starts on its parent thread's CPUs: often one, pinned
                try:
                    os.sched_setaffinity(p.pid, tuple(cpus) or allowed_cpus())
                except OSError:
                    pass  # it ended already: its reader thread says so
            threading.Thread(target=_read_replies, args=(w, p.stdout, self._replies), daemon=True).start()
        self._idle = list(range(self.n))

    def __enter__(self) -> CompilePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """End the workers. Between kernels they hold nothing half written (Numba renames each file into place)."""
        for p in self._procs:
            if p.poll() is None:
                p.kill()
            p.wait()
            p.stdin.close()

    def compile(self, kernels: Sequence[Kernel], on_status: Callable[[CompileStatus], None] | None = None
                ) -> list[tuple[str, str]]:
        """As compile_kernels, in these workers."""
        kernels = list(kernels)
        index = {k.key: i for i, k in enumerate(kernels)}
        needs = [{index[c] for c in k.calls if c in index} for k in kernels]
        callers: list[list[int]] = [[] for _ in kernels]
        for i, deps in enumerate(needs):
            for d in deps:
                callers[d].append(i)
        path = [0.0] * len(kernels)  # seconds from a kernel's start to the end of its longest chain of callers
        for i in reversed(range(len(kernels))):  # callers come after their callees
            path[i] = kernels[i].cost_s + max((path[c] for c in callers[i]), default=0.0)

        def status() -> None:
            if on_status:
                on_status(CompileStatus(len(done), len(kernels), tuple(kernels[i].key for i in running.values()),
                                        time.perf_counter() - t0, self.n))

        t0, done, failed = time.perf_counter(), set(), []
        running: dict[int, int] = {}  # worker -> kernel
        waiting = list(range(len(kernels)))
        while waiting or running:
            ready = sorted((i for i in waiting if needs[i] <= done), key=lambda i: (-path[i], i))
            for i in ready[:len(self._idle)]:
                w = self._idle.pop(0)
                try:
                    pickle.dump(kernels[i], self._procs[w].stdin)
                    self._procs[w].stdin.flush()
                except OSError:  # it ended: its reader thread says so
                    continue
                running[w] = i
                waiting.remove(i)
            status()
            if not running:  # the workers ended: the first calls compile the rest
                failed += [(kernels[i].key, _DIED) for i in waiting]
                break
            w, err = self._replies.get()
            if w not in running:  # ended while idle
                if w in self._idle:
                    self._idle.remove(w)
                continue
            i = running.pop(w)
            done.add(i)  # a failed kernel too: its callers compile it themselves
            if err is not None:
                failed.append((kernels[i].key, err))
            if err != _DIED:
                self._idle.append(w)
        status()
        return failed


_DIED = "the worker process ended"


def _read_replies(w: int, stream, replies: queue.Queue) -> None:
    while True:
        try:
            err = pickle.load(stream)
        except Exception:  # noqa: BLE001 - EOF: the worker ended (or crashed) before replying
            replies.put((w, _DIED))
            return
        replies.put((w, err))


def _serve() -> None:
    """A worker: read kernels (pickled) from stdin until it closes, compile each, answer None or the error. The
    replies go to a copy of stdout, so that anything printed while compiling goes where stderr goes."""
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    stdin = sys.stdin.buffer
    while True:
        try:
            k = pickle.load(stdin)
        except EOFError:
            return
        pickle.dump(_compile(k), out)
        out.flush()


def _compile(k: Kernel) -> str | None:
    try:
        _dispatcher(k).compile(k.args)
    except Exception as exc:  # noqa: BLE001 - reported to the caller; the first call compiles it instead
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return None


def _dispatcher(k: Kernel):
    return getattr(importlib.import_module(k.module), k.name)


def _package_roots() -> list[str]:
    """The folders this process imports hybrid and kernels_cpu from (a worker must load the same files)."""
    roots = []
    for pkg in ("kernels_cpu", "hybrid"):
        d = _package_dir(pkg)
        if d is not None and str(d.parent) not in roots:
            roots.append(str(d.parent))
    return roots


def _package_dir(package: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _index_fresh(pkg_dir: Path, nbi: Path) -> bool:
    """Whether a Numba index file (a pickled version, then a pickle of (source stamp, overloads)) matches its
    source: a sha256 of the file since numba 0.61, (mtime, size) before."""
    src = pkg_dir / (nbi.name.split(".", 1)[0] + ".py")
    try:
        with open(nbi, "rb") as f:
            if pickle.load(f) != numba.__version__:
                return False
            stamp, _ = pickle.loads(f.read())
        st = src.stat()
        return stamp in (hashlib.sha256(src.read_bytes()).digest(), (st.st_mtime, st.st_size))
    except Exception:  # noqa: BLE001 - unreadable or foreign index: as if absent
        return False


if __name__ == "__main__":
    _serve()
