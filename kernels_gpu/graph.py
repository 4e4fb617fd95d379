"""Per-token GPU work replayed as CUDA graphs (CuPy stream capture), with static inputs and eager fallback.

A step is a Python function `fn(x, pos, slots) -> cupy array` that launches kernels only: x (1, n) float32 is
the hidden state, pos (1,) int32 the position (or the int32 values the caller passes: a ragged batch's positions,
sequences and block tables), slots (2 L,) uint64 the addresses of the L KV-cache layers it
writes (kv_cache.kv_store / attention read them on the device). All three live in one device buffer per graph
that a single asynchronous copy from pinned memory fills before each run, so the graph captured once per key
(shapes, never values or cache addresses) is replayed for every token and every cache of that shape.

The first run of a key is eager (it compiles kernels and fills the graph's private memory pool, so that the
capture allocates nothing new), the second is captured; a step that cannot be captured (it raises
CaptureUnsupported, e.g. MoE routing on the host) runs eagerly from then on, and `report()` says so.

A step may hand work to the host in the middle (`host_break(fn)`: routed experts computed by the CPU beside a GPU
layer): what was launched before it must finish, then fn() runs on the host, then the launches go on. Eagerly
that is a synchronization and a call. Captured, the step stays one graph: at each break it signals the host
through a flag in page-locked host memory (host_sync.cu: a one-thread kernel writes the break's number), then
waits in a one-thread kernel until the host has written the same number into a second flag. A replay launches the
graph once; the host waits for each break's signal, runs its fn (whose inputs the graph copied to pinned memory
before the signal, and whose outputs it copies back after the wait) and answers. No launch, no stream
synchronization per break. Where the device lacks unified addressing (the kernels could not reach host memory at
the host's address), a captured step is cut at each break into pieces instead: each piece launched, synchronized,
then its fn, as eagerly. A host fn must not wait for the step's stream (it would wait for itself).

A host fn may return a callable: the host's work that the step does not read (bookkeeping). It runs after the
answer, while the GPU goes on. A break may name a device int32 array `needs`: the GPU then waits for the host only
when one of its values is negative (an expert cache's misses, which the host computes); otherwise the host's call
runs beside the rest of the step, whose kernels must then not read its results.
"""

from __future__ import annotations

import ctypes
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from gguf_io.errors import HybridError


class CaptureUnsupported(RuntimeError):
    """Raised by a step that cannot be captured into a CUDA graph (a host round trip inside it)."""


def _align(n: int, a: int = 256) -> int:
    return -(-n // a) * a


HOST_WAIT_S = 120.0  # a host break gives up after this long (the host waiting for the GPU, or the GPU for the host)
GPU_CLOCK_HZ = 2.0e9  # clock64() ticks a second, at most (the GPU's wait is at least HOST_WAIT_S)
_READY, _DONE, _TIMED_OUT = 0, 32, 64  # int32 offsets of the flags in their page-locked buffer (own cache lines)
_RELEASE = 1 << 30  # DONE at this value lets every remaining wait of a replay through (after a failed host call)


def call_now(stream, fn, beside=None) -> None:
    """A host break outside a captured step: wait for `stream`, run fn() on the host, then launch beside() (GPU work
    independent of fn) and run the callable fn returned, if any."""
    stream.synchronize()
    after = fn()
    if beside is not None:
        beside()
    if after is not None:
        after()


class HostBreakError(HybridError, RuntimeError):
    """A replayed step's host break failed: the GPU never signalled it, or waited past HOST_WAIT_S for the host."""


@dataclass
class _Entry:
    pool: object  # cupy.cuda.MemoryPool private to this key: its scratch is never handed to other code
    inbuf: object  # cupy uint8: [x float32 (1, n) | pos int32 (n_ints,) | slots uint64 (2 L)], filled by one copy
    x: object
    pos: object
    slots: object
    n_slots: int
    graph: object = None  # the last piece (the whole step when it has no host break)
    pieces: list = field(default_factory=list)  # [(graph or None, host fn)]: the host calls in order; with a graph,
    # a piece launched before its call (the split form); with None, `graph` signals and waits at each (one graph)
    out: object = None
    runs: int = 0
    reason: str | None = None  # why this key runs eagerly (None: it is captured, or will be)


@dataclass
class GraphStats:
    captured: int = 0
    replays: int = 0
    eager: int = 0  # eager runs: first runs of a key, disabled graphs, or steps that cannot be captured
    capture_ms: float = 0.0
    reasons: dict = field(default_factory=dict)  # reason -> eager runs for it
    # replays with host breaks, in seconds of host wall time: launching the graph (or the pieces before each break),
    # waiting for the GPU to reach each break, and the host calls (scripts/offload_decode_profile.py)
    pieces: int = 0  # host breaks replayed
    piece_launch_s: float = 0.0
    piece_wait_s: float = 0.0
    host_s: float = 0.0
    after_s: float = 0.0  # the host fns' work after their answers (the callables they return)


class GraphRunner:
    """Runs decode steps on its own stream, captured once per key and replayed (see the module docstring)."""

    def __init__(self, max_graphs: int = 16, one_graph: bool = True) -> None:
        """one_graph=False: host breaks always cut a captured step into pieces (the form without unified
        addressing; scripts/offload_decode_profile.py compares the two)."""
        import cupy  # noqa: PLC0415

        self._cp = cupy
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.enabled = True  # False: every step runs eagerly (reported as such)
        self.capturing = False  # True while a step is being captured: host round trips must raise
        self.active = False  # True while a step runs (eager or captured): host_break applies to it
        self._pieces: list | None = None  # while capturing: the pieces captured so far
        self.max_graphs = max_graphs
        self.stats = GraphStats()
        self._entries: OrderedDict = OrderedDict()
        self._h_in: np.ndarray | None = None  # pinned staging for the input buffer
        self._h_in_mem = None
        self._h_out: np.ndarray | None = None  # pinned landing for the output
        self._h_out_mem = None
        self._ready = cupy.cuda.Event(disable_timing=True)
        # the flags of in-graph host breaks (host_sync.cu), or None: breaks cut the graph into pieces
        self._flags, self._flags_ptr, self._sync = self._host_flags() if one_graph else (None, 0, None)

    def _host_flags(self):
        """(int32 flags over page-locked memory, its address, (signal, wait) kernels), or (None, 0, None) where the
        device cannot read host memory at the host's address (no unified addressing)."""
        cp = self._cp
        dev = cp.cuda.Device()
        if not cp.cuda.runtime.getDeviceProperties(dev.id).get("unifiedAddressing", 0):
            return None, 0, None
        from .module import get_kernel  # noqa: PLC0415 - compiled now: not while a capture runs

        nbytes = 4 * (_TIMED_OUT + 32)
        try:
            ptr = cp.cuda.runtime.hostAlloc(nbytes, 1 | 2)  # cudaHostAllocPortable | cudaHostAllocMapped
        except cp.cuda.runtime.CUDARuntimeError:  # no mapped host memory here: the split form
            return None, 0, None
        self._flags_mem = _HostAlloc(ptr)
        flags = np.ctypeslib.as_array((ctypes.c_int32 * (nbytes // 4)).from_address(ptr))
        flags[:] = 0
        return flags, ptr, tuple(get_kernel("host_sync", k) for k in ("host_signal", "host_wait",
                                                                       "host_wait_if_negative"))

    # ---- pinned host buffers
    def _pinned(self, nbytes: int, which: str) -> np.ndarray:
        buf = getattr(self, f"_h_{which}")
        if buf is None or buf.nbytes < nbytes:
            mem = self._cp.cuda.alloc_pinned_memory(max(nbytes, 1 << 16))
            setattr(self, f"_h_{which}_mem", mem)
            buf = np.frombuffer(mem, np.uint8, max(nbytes, 1 << 16))
            setattr(self, f"_h_{which}", buf)
        return buf[:nbytes]

    def _new_entry(self, x_shape: tuple[int, ...], n_slots: int, n_ints: int) -> _Entry:
        cp = self._cp
        nx = int(np.prod(x_shape)) * 4
        off_pos = _align(nx)
        off_slots = off_pos + _align(4 * n_ints)
        end = off_slots + 8 * max(n_slots, 1)
        inbuf = cp.zeros(end, dtype=cp.uint8)
        return _Entry(cp.cuda.MemoryPool(), inbuf, inbuf[:nx].view(cp.float32).reshape(x_shape),
                      inbuf[off_pos:off_pos + 4 * n_ints].view(cp.int32), inbuf[off_slots:end].view(cp.uint64),
                      n_slots)

    # ---- one step
    def run(self, key, fn, x: np.ndarray, position, slot_ptrs: list[int], beside=None,
            head: int | None = None) -> np.ndarray:
        """fn's result for hidden state x (host, (1, n) float32) at `position` (an int, or an int32 array that fn
        reads as its pos), with the KV-cache addresses slot_ptrs in the slots; key names everything shape-relevant
        of fn (its graph is reused for equal keys). beside(): host work run once the step is launched, before
        waiting for it (it must not use the step's stream). head: only the result's first `head` values cross
        back (flat)."""
        cp = self._cp
        x = np.ascontiguousarray(x, dtype=np.float32)
        ints = np.ascontiguousarray(np.atleast_1d(np.asarray(position, dtype=np.int32)).reshape(-1))
        key = (key, x.shape, len(slot_ptrs), ints.size)
        e = self._entries.get(key)
        if e is None:
            e = self._entries[key] = self._new_entry(x.shape, len(slot_ptrs), ints.size)
            while len(self._entries) > self.max_graphs:
                _, old = self._entries.popitem(last=False)
                old.graph = old.out = None
                old.pieces = []
                old.pool.free_all_blocks()
        else:
            self._entries.move_to_end(key)
        st = self.stream
        # after whatever the legacy stream queued before (a new cache's memset, a prefill)
        self._ready.record(cp.cuda.Stream.null)
        st.wait_event(self._ready)
        # one host -> device copy: x, the position and the cache addresses
        h = self._pinned(e.inbuf.nbytes, "in")
        h[: x.nbytes] = x.reshape(-1).view(np.uint8)
        off_pos = e.pos.data.ptr - e.inbuf.data.ptr
        h[off_pos:off_pos + ints.nbytes] = ints.view(np.uint8)
        if e.n_slots:
            off_slots = e.slots.data.ptr - e.inbuf.data.ptr
            h[off_slots:off_slots + 8 * e.n_slots] = np.asarray(slot_ptrs, dtype=np.uint64).view(np.uint8)
        cp.cuda.runtime.memcpyAsync(e.inbuf.data.ptr, h.ctypes.data, e.inbuf.nbytes,
                                    cp.cuda.runtime.memcpyHostToDevice, st.ptr)
        captured_now = False
        if e.graph is None and e.reason is None and e.runs > 0 and self.enabled:
            captured_now = self._capture(e, fn)
        if e.graph is not None and self.enabled:
            if e.pieces and e.pieces[0][0] is None:
                self._replay_breaks(e)
            else:
                self._replay_pieces(e, skip=len(e.pieces) if captured_now else 0)
                e.graph.launch(st)
            out = e.out
            self.stats.replays += 1
        else:
            with st, cp.cuda.using_allocator(e.pool.malloc):
                self.active = True
                try:
                    out = cp.ascontiguousarray(fn(e.x, e.pos, e.slots), dtype=cp.float32)
                finally:
                    self.active = False
            self.stats.eager += 1
            why = e.reason or ("graphs disabled" if not self.enabled and e.runs > 0 else "first run of a shape")
            self.stats.reasons[why] = self.stats.reasons.get(why, 0) + 1
        e.runs += 1
        size = out.size if head is None else min(head, out.size)
        ho = self._pinned(4 * size, "out")
        cp.cuda.runtime.memcpyAsync(ho.ctypes.data, out.data.ptr, 4 * size, cp.cuda.runtime.memcpyDeviceToHost,
                                    st.ptr)
        if beside is not None:
            beside()
        st.synchronize()
        self.check_breaks()
        got = ho.view(np.float32)[:size]
        return got.copy() if head is not None else got.reshape(out.shape).copy()

    def _replay_pieces(self, e: _Entry, skip: int) -> None:
        """The split form's pieces and host calls, in order (the first `skip` ran during the capture)."""
        s, st = self.stats, self.stream
        for g, host_fn in e.pieces[skip:]:
            t0 = time.perf_counter()
            g.launch(st)
            t1 = time.perf_counter()
            st.synchronize()
            t2 = time.perf_counter()
            after = host_fn()
            t3 = time.perf_counter()
            if after is not None:
                after()
            s.piece_launch_s += t1 - t0
            s.piece_wait_s += t2 - t1
            s.host_s += t3 - t2
            s.after_s += time.perf_counter() - t3
        s.pieces += len(e.pieces) - skip

    def _replay_breaks(self, e: _Entry) -> None:
        """One launch of a graph with in-graph host breaks, then each break's host call when the GPU signals it.
        A failing call (or a wait past HOST_WAIT_S) releases the graph's remaining waits, lets it finish, and
        raises; a GPU that gave up waiting for the host is reported after the step (HostBreakError)."""
        s, st, f = self.stats, self.stream, self._flags
        f[_READY] = f[_DONE] = f[_TIMED_OUT] = 0  # the stream is idle: every run ends with its synchronization
        t0 = time.perf_counter()
        e.graph.launch(st)
        s.piece_launch_s += time.perf_counter() - t0
        try:
            for k, (_, host_fn) in enumerate(e.pieces, 1):
                t1 = time.perf_counter()
                spins = 0
                while f[_READY] < k:
                    spins += 1
                    if not spins & 0xFFFF and time.perf_counter() - t1 > HOST_WAIT_S:
                        raise HostBreakError(f"the GPU did not reach host break {k} of a decode step within "
                                             f"{HOST_WAIT_S:.0f} s")
                t2 = time.perf_counter()
                after = host_fn()
                f[_DONE] = k
                t3 = time.perf_counter()
                if after is not None:
                    after()
                s.piece_wait_s += t2 - t1
                s.host_s += t3 - t2
                s.after_s += time.perf_counter() - t3
        except BaseException:
            f[_DONE] = _RELEASE
            st.synchronize()
            raise
        s.pieces += len(e.pieces)

    def check_breaks(self) -> None:
        """After a step's synchronization: HostBreakError if the GPU gave up waiting for a host call (the step's
        result went on with stale values)."""
        if self._flags is not None and self._flags[_TIMED_OUT]:
            self._flags[_TIMED_OUT] = 0
            raise HostBreakError(f"a host call of a decode step took longer than {HOST_WAIT_S:.0f} s; the step's "
                                 f"result is invalid")

    def host_break(self, fn, beside=None, needs=None) -> None:
        """Within a step: wait for what was launched so far, run fn() on the host, go on (see the module
        docstring). Outside a capture, a synchronization of the step's stream and the call. beside(), when given,
        launches GPU work that neither feeds fn nor reads its results: in the one-graph form it runs while the
        host calls fn; otherwise it is launched after the call. fn may return a callable, run after the answer.
        needs (cupy int32, contiguous, computed before the break): in the one-graph form the GPU waits for the
        host's answer only when one of its values is negative."""
        st = self.stream
        if not self.capturing:
            call_now(st, fn, beside)
            return
        if self._sync is not None:  # one graph: signal break k, wait for the host's k (nothing runs now)
            k = np.int32(len(self._pieces) + 1)
            signal, wait, wait_if = self._sync
            ptr = self._flags_ptr
            signal((1,), (1,), (np.uint64(ptr + 4 * _READY), k))
            if beside is not None:
                beside()
            flags = (np.uint64(ptr + 4 * _DONE), k, np.uint64(ptr + 4 * _TIMED_OUT),
                     np.int64(HOST_WAIT_S * GPU_CLOCK_HZ))
            if needs is None:
                wait((1,), (1,), flags)
            else:
                wait_if((1,), (1,), flags + (needs, np.int32(needs.size)))
            self._pieces.append((None, fn))
            return
        g = st.end_capture()  # the piece so far: launched now (the host call needs its results), kept for replays
        if hasattr(g, "upload"):
            g.upload(st)
        g.launch(st)
        st.synchronize()
        after = fn()
        if after is not None:
            after()
        self._pieces.append((g, fn))
        st.begin_capture()
        if beside is not None:
            beside()

    def _capture(self, e: _Entry, fn) -> bool:
        """Capture fn as e's graph (and its host breaks); True when it did (in the split form, its pieces before the
        last one have run; in the one-graph form nothing has)."""
        cp = self._cp
        st = self.stream
        t0 = time.perf_counter()
        err: BaseException | None = None
        graph = out = None
        with st, cp.cuda.using_allocator(e.pool.malloc):
            self.capturing = self.active = True
            self._pieces = []
            try:
                st.begin_capture()
            except Exception as exc:  # noqa: BLE001 - reported, then eager
                self.capturing = self.active = False
                e.reason = f"capture could not start ({type(exc).__name__}: {exc})"
                return False
            try:
                out = cp.ascontiguousarray(fn(e.x, e.pos, e.slots), dtype=cp.float32)
            except Exception as exc:  # noqa: BLE001 - end the capture first, then report
                err = exc
            self.capturing = self.active = False
            try:
                g = st.end_capture()
            except Exception as exc:  # noqa: BLE001
                g = None
                err = err or exc
            if err is None:
                try:
                    if hasattr(g, "upload"):
                        g.upload(st)
                    graph = g
                except Exception as exc:  # noqa: BLE001
                    err = exc
        pieces, self._pieces = self._pieces, None
        if err is not None:
            e.reason = (str(err) if isinstance(err, CaptureUnsupported)
                        else f"capture failed ({type(err).__name__}: {err})")
            return False
        e.graph, e.pieces, e.out = graph, pieces, out
        self.stats.captured += 1
        self.stats.capture_ms += 1000 * (time.perf_counter() - t0)
        return True

    def report(self) -> str:
        """One line: how decode steps ran (graphs replayed, or eager launches and why)."""
        s = self.stats
        fallbacks = {k: v for k, v in s.reasons.items() if k != "first run of a shape"}
        parts = []
        if s.captured or s.replays:
            parts.append(f"CUDA graphs: {s.captured} captured ({s.capture_ms:.0f} ms), {s.replays} replays")
        if s.eager:
            parts.append(f"{s.eager} eager runs")
        line = ", ".join(parts) or "no decode steps yet"
        if fallbacks:
            line += "; EAGER FALLBACK: " + "; ".join(f"{k} ({v} runs)" for k, v in fallbacks.items())
        return line

    @property
    def fallback(self) -> bool:
        """True when some decode step ran eagerly for a reason other than being the first run of its shape."""
        return any(k != "first run of a shape" for k in self.stats.reasons)


class _HostAlloc:
    """Owns a cudaHostAlloc block: freed with this object (the flags' buffer of a GraphRunner)."""

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def __del__(self) -> None:
        try:
            import cupy  # noqa: PLC0415

            cupy.cuda.runtime.freeHost(self.ptr)
        except Exception:  # noqa: BLE001, S110 - at exit the CUDA context may be gone first
            pass
