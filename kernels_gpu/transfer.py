"""Host <-> device copies through reusable pinned (page-locked) host buffers, and a weight stream (WeightStream).

Pageable numpy memory crosses PCIe at ~6.4 GB/s on the target machine, pinned memory at ~55 GB/s. Large
uploads go in chunks through two pinned buffers, so that filling one overlaps the DMA of the other.
"""

from __future__ import annotations

import weakref
from collections import deque

import numpy as np

SMALL_BYTES = 1 << 16  # below this a plain (pageable) copy costs no more than staging
CHUNK_BYTES = 32 << 20  # pinned staging chunk for large uploads


class PinnedStager:
    """Owns pinned staging buffers; all copies are issued on the current CuPy stream."""

    def __init__(self) -> None:
        self._bufs: list = [None, None]  # (pinned memory, np.uint8 view) for uploads, double-buffered
        self._events: list = [None, None]  # the copy that last read each upload buffer
        self._down = None  # pinned buffer for downloads

    @staticmethod
    def _pinned(nbytes: int):
        import cupy  # noqa: PLC0415

        mem = cupy.cuda.alloc_pinned_memory(nbytes)
        return mem, np.frombuffer(mem, np.uint8, nbytes)

    def _upload_buffer(self, i: int, nbytes: int) -> np.ndarray:
        if self._events[i] is not None:
            self._events[i].synchronize()  # the DMA that read this buffer before has finished
        if self._bufs[i] is None or self._bufs[i][1].nbytes < nbytes:
            self._bufs[i] = self._pinned(max(nbytes, SMALL_BYTES))
        return self._bufs[i][1][:nbytes]

    def to_device(self, x: np.ndarray):
        """numpy array (any dtype) -> cupy array of the same dtype and shape (C-contiguous)."""
        import cupy  # noqa: PLC0415

        x = np.ascontiguousarray(x)
        d = cupy.empty(x.shape, dtype=x.dtype)
        if x.nbytes < SMALL_BYTES:
            # through a private copy: x may be a view of the GGUF map whose pages a WeightStream page-locked in
            # part (a tensor across the edge of the registered span), which the driver refuses to copy from
            d.set(np.array(x, copy=True))
            return d
        src = x.reshape(-1).view(np.uint8)
        stream = cupy.cuda.get_current_stream()
        for k, off in enumerate(range(0, x.nbytes, CHUNK_BYTES)):
            n = min(CHUNK_BYTES, x.nbytes - off)
            i = k & 1
            buf = self._upload_buffer(i, n)
            buf[:] = src[off:off + n]
            cupy.cuda.runtime.memcpyAsync(d.data.ptr + off, buf.ctypes.data, n,
                                          cupy.cuda.runtime.memcpyHostToDevice, stream.ptr)
            ev = cupy.cuda.Event(disable_timing=True)
            ev.record(stream)
            self._events[i] = ev
        return d

    def to_host(self, d) -> np.ndarray:
        """cupy array -> a new numpy array (waits for the copy)."""
        import cupy  # noqa: PLC0415

        d = cupy.ascontiguousarray(d)
        if d.nbytes < SMALL_BYTES:
            return d.get()
        if self._down is None or self._down[1].nbytes < d.nbytes:
            self._down = self._pinned(d.nbytes)
        view = self._down[1][:d.nbytes].view(d.dtype).reshape(d.shape)
        d.get(out=view)  # blocking; pinned, so at full PCIe speed
        return view.copy()


STREAM_CHUNK_BYTES = 16 << 20  # granularity of a streamed weight's pageable -> pinned copy and its DMA
STREAM_PINNED = 4  # pinned chunks: the copy threads fill one while the copy engine drains the others
COPY_THREADS = 4  # threads filling one pinned chunk from pageable memory (numpy's copies release the GIL)
HOST_REGISTER_PORTABLE, HOST_REGISTER_READ_ONLY = 0x01, 0x08  # cudaHostRegister flags (the GGUF map is read-only)


def _host_unregister(rt, ptr: int, _sources: list) -> None:
    rt.hostUnregister(ptr)


class WeightStream:
    """Uploads host byte arrays (pageable, e.g. views of the GGUF memmap) into a ring of device slots ahead of
    their use, so that reading the next weights overlaps the kernels on the current one.

    A worker thread takes the arrays of a batch in order; for each it waits for a free slot, copies the bytes
    into pinned chunks (COPY_THREADS threads; pageable memory crosses PCIe 8x slower than pinned) and queues
    the chunks' DMA on a non-blocking stream of its own. The consumer, per array in the same order: take() ->
    slot (the current stream now waits for that slot's DMA, the host does not), view(slot, nbytes), launch the
    kernels reading it, release(slot) (the slot is refilled only after those kernels, ordered by an event).
    Slots are allocated once, from CuPy's pool (capped at the VRAM budget): an overrun is its OutOfMemoryError.
    """

    def __init__(self, slot_bytes: int, n_slots: int = 3, chunk_bytes: int = STREAM_CHUNK_BYTES,
                 n_pinned: int = STREAM_PINNED, copy_threads: int = COPY_THREADS) -> None:
        import queue  # noqa: PLC0415
        from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415

        import cupy  # noqa: PLC0415

        if slot_bytes < 1 or n_slots < 2 or chunk_bytes < 1 or n_pinned < 1:
            raise ValueError(f"need slot_bytes >= 1, n_slots >= 2, chunk_bytes >= 1, n_pinned >= 1; found "
                             f"{slot_bytes}, {n_slots}, {chunk_bytes}, {n_pinned}")
        self._cp, self._queue = cupy, queue
        self.slot_bytes = int(slot_bytes)
        self._device = cupy.cuda.Device()  # the current one
        self._slots = [cupy.empty(self.slot_bytes, dtype=cupy.uint8) for _ in range(n_slots)]
        self._filled = [cupy.cuda.Event(disable_timing=True) for _ in range(n_slots)]  # DMA into the slot done
        self._read = [cupy.cuda.Event(disable_timing=True) for _ in range(n_slots)]  # kernels reading it done
        self._chunk = int(chunk_bytes)
        self._pinned = [PinnedStager._pinned(self._chunk) for _ in range(n_pinned)]
        self._drained = [cupy.cuda.Event(disable_timing=True) for _ in range(n_pinned)]  # DMA out of chunk done
        self._next_chunk = 0
        self._stream = cupy.cuda.Stream(non_blocking=True)  # never waits for the compute on the null stream
        self._pool = ThreadPoolExecutor(copy_threads, "hybrid-stream-copy") if copy_threads > 1 else None
        self._n_copy = max(1, copy_threads)
        self._free = queue.SimpleQueue()  # slots the worker may fill (None: stop)
        self._done = queue.SimpleQueue()  # (slot, error) per array, in order
        self._taken: set[int] = set()
        self._thread = None
        self._stopping = False
        self._registered: tuple[int, int] | None = None  # host span page-locked by register(): (start, end)
        self.direct_bytes = 0  # bytes uploaded straight from registered memory (the rest went through pinned chunks)
        self._reset_free()

    def _reset_free(self) -> None:
        self._free, self._done = self._queue.SimpleQueue(), self._queue.SimpleQueue()
        for s in range(len(self._slots)):
            self._free.put(s)

    def start(self, sources: list[np.ndarray]) -> None:
        """Begin streaming `sources` (1-D uint8 host arrays of <= slot_bytes each), in the order they will be
        taken. Stops a previous batch first."""
        import threading  # noqa: PLC0415

        self.stop()
        for src in sources:
            if src.ndim != 1 or src.dtype != np.uint8 or src.nbytes > self.slot_bytes:
                raise ValueError(f"a streamed source must be 1-D uint8 of <= {self.slot_bytes} bytes, found "
                                 f"{src.dtype} {src.shape}")
        if not sources:
            return
        self._thread = threading.Thread(target=self._run, args=(list(sources),), name="hybrid-weight-stream",
                                        daemon=True)
        self._thread.start()

    def register(self, sources: list[np.ndarray]) -> str:
        """Page-lock the host span of `sources` in place (cudaHostRegister, read-only where the device allows it)
        so that their uploads read it directly at full PCIe speed, with no copy into pinned chunks; the pages stay
        resident, as with --mlock, until close(). Returns "" when registered, else why not (the stream then
        stages every upload through its pinned chunks)."""
        if self._registered is not None or not sources:
            return "" if self._registered is not None else "nothing to register"
        lo = min(_page_span(s)[0] for s in sources)
        hi = max(_page_span(s)[1] for s in sources)
        why = _host_register(lo, hi)
        if not why:
            self._registered = (lo, hi)
            # unregistered by close(), or when the stream is collected; the finalizer holds the sources, so the
            # mapping under the registered pages cannot be unmapped (and its addresses reused) before that
            self._unregister = weakref.finalize(self, _host_unregister, self._cp.cuda.runtime, lo, list(sources))
        return why

    def take(self) -> int:
        """The slot holding the next source; the current stream waits for its upload (the host does not)."""
        if self._thread is None:
            raise RuntimeError("WeightStream.take: no batch is streaming (start() first)")
        slot, error = self._done.get()
        if error is not None:
            raise error
        self._cp.cuda.get_current_stream().wait_event(self._filled[slot])
        self._taken.add(slot)
        return slot

    def view(self, slot: int, nbytes: int):
        """The first nbytes of a slot: cupy uint8 (nbytes,)."""
        return self._slots[slot][:nbytes]

    def release(self, slot: int) -> None:
        """Give a slot back once the kernels reading it are launched on the current stream."""
        self._read[slot].record(self._cp.cuda.get_current_stream())
        self._taken.discard(slot)
        self._free.put(slot)

    def stop(self) -> None:
        """End the batch (also after an error): stop and join the worker, wait for its queued copies."""
        if self._thread is None:
            return
        self._stopping = True
        self._free.put(None)
        self._thread.join()
        for slot in list(self._taken):  # taken but not released (an error on the way): after what was launched
            self.release(slot)
        self._stream.synchronize()  # no DMA in flight into a slot or out of a pinned chunk
        self._thread, self._stopping = None, False
        self._reset_free()

    def close(self) -> None:
        """Stop, and drop the slots, the pinned chunks and the copy threads."""
        self.stop()
        if self._pool is not None:
            self._pool.shutdown()
        if self._registered is not None:
            self._unregister()
            self._registered = None
        self._slots, self._pinned = [], []

    # ---- the worker thread
    def _run(self, sources: list[np.ndarray]) -> None:
        try:
            with self._device:
                for src in sources:
                    slot = self._free.get()
                    if slot is None or self._stopping:
                        return
                    self._stream.wait_event(self._read[slot])  # the kernels that read this slot before are done
                    self._upload(src, self._slots[slot].data.ptr)
                    self._filled[slot].record(self._stream)
                    self._done.put((slot, None))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, raised by its take()
            self._done.put((None, exc))

    def _upload(self, src: np.ndarray, dst_ptr: int) -> None:
        cp = self._cp
        reg, ptr = self._registered, int(src.ctypes.data)
        if reg is not None and reg[0] <= ptr and ptr + src.nbytes <= reg[1]:  # page-locked in place: DMA reads it
            cp.cuda.runtime.memcpyAsync(dst_ptr, ptr, src.nbytes, cp.cuda.runtime.memcpyHostToDevice,
                                        self._stream.ptr)
            self.direct_bytes += src.nbytes
            return
        for off in range(0, src.nbytes, self._chunk):
            n = min(self._chunk, src.nbytes - off)
            j = self._next_chunk
            self._next_chunk = (j + 1) % len(self._pinned)
            self._drained[j].synchronize()  # the DMA that last read this pinned chunk is done
            buf = self._pinned[j][1][:n]
            self._copy(buf, src[off:off + n])
            cp.cuda.runtime.memcpyAsync(dst_ptr + off, buf.ctypes.data, n, cp.cuda.runtime.memcpyHostToDevice,
                                        self._stream.ptr)
            self._drained[j].record(self._stream)

    def _copy(self, dst: np.ndarray, src: np.ndarray) -> None:
        n = dst.nbytes
        if self._pool is None or n < (1 << 20):
            np.copyto(dst, src)
            return
        per = -(-n // self._n_copy)  # ceil(n / threads)
        step = -(-per // 4096) * 4096  # in whole pages
        parts = [self._pool.submit(np.copyto, dst[a:a + step], src[a:a + step]) for a in range(0, n, step)]
        for p in parts:
            p.result()


class CopyRing:
    """Host -> device copies from page-locked host memory into a ring of `n_slots` device slots, on a copy stream of
    their own, issued ahead of their use: start(sources) issues the first n_slots copies at once; take() hands out
    the next source's slot (the current stream waits for its copy, the host does not); release(slot), once the
    kernels reading it are launched, lets the copy of a later source into that slot start after them. So the copy
    engine fills the next slots while the kernels work on the current one, and nothing blocks the host."""

    def __init__(self, slot_bytes: int, n_slots: int = 3) -> None:
        import cupy  # noqa: PLC0415

        self._cp = cupy
        self.slot_bytes = int(slot_bytes)
        self._stream = cupy.cuda.Stream(non_blocking=True)
        self._slots = [cupy.empty(self.slot_bytes, dtype=cupy.uint8) for _ in range(n_slots)]
        self._filled = [cupy.cuda.Event(disable_timing=True) for _ in range(n_slots)]
        self._read = [cupy.cuda.Event(disable_timing=True) for _ in range(n_slots)]
        self._free: deque[int] = deque(range(n_slots))
        self._pending: deque[tuple[object, list, int]] = deque()  # (key, pieces, bytes) not yet issued
        self._issued: deque[tuple[object, int, int]] = deque()  # (key, slot, bytes) in order of use
        self.copied_bytes = 0

    @property
    def n_slots(self) -> int:
        return len(self._slots)

    def start(self, sources: list[tuple[object, list[tuple[int, int]]]]) -> None:
        """sources: (key, pieces) in the order take() will ask for them; pieces [(host pointer into page-locked
        memory, bytes)] are copied back to back into the source's slot."""
        if self._pending or self._issued:
            raise RuntimeError("CopyRing.start: the previous batch was not taken whole")
        for key, pieces in sources:
            n = sum(size for _, size in pieces)
            if n > self.slot_bytes:
                raise ValueError(f"CopyRing: a source of {n} bytes exceeds the slot of {self.slot_bytes}")
            self._pending.append((key, pieces, n))
        self._issue()

    def _issue(self) -> None:
        cp = self._cp
        while self._free and self._pending:
            slot = self._free.popleft()
            key, pieces, n = self._pending.popleft()
            self._stream.wait_event(self._read[slot])  # the kernels that read the slot before are done
            at = self._slots[slot].data.ptr
            for ptr, size in pieces:
                cp.cuda.runtime.memcpyAsync(at, ptr, size, cp.cuda.runtime.memcpyHostToDevice, self._stream.ptr)
                at += size
            self._filled[slot].record(self._stream)
            self._issued.append((key, slot, n))
            self.copied_bytes += n

    def take(self, key) -> tuple[int, object]:
        """(slot, cupy uint8 view of its bytes) of the next source, which must be `key`."""
        got, slot, n = self._issued.popleft()
        if got != key:
            raise RuntimeError(f"CopyRing.take: asked for {key!r}, the next source is {got!r}")
        self._cp.cuda.get_current_stream().wait_event(self._filled[slot])
        return slot, self._slots[slot][:n]

    def release(self, slot: int) -> None:
        self._read[slot].record(self._cp.cuda.get_current_stream())
        self._free.append(slot)
        self._issue()

    def reset(self) -> None:
        """Drop what was not taken (after an error), once the copies in flight are done."""
        self._stream.synchronize()
        self._free.extend(s for _, s, _ in self._issued)
        self._pending.clear()
        self._issued.clear()


def register_spans(arrays: list[np.ndarray], locked: list[tuple[int, int]] = ()) -> tuple[list[tuple[int, int]], str]:
    """Page-lock the pages under `arrays` in place (cudaHostRegister, read-only where the device allows it), as
    merged page-aligned spans, less the spans `locked` already holds (a page is registered once): ([(start, end)]
    registered, "" or why some were not). The caller unregisters them (unregister_spans) and must keep the arrays'
    memory mapped until then."""
    merged: list[list[int]] = []
    for lo, hi in sorted(_page_span(a) for a in arrays if a.nbytes):
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    for s, e in locked:  # cut the spans already registered out of the new ones
        merged = [part for lo, hi in merged for part in ([lo, min(hi, s)], [max(lo, e), hi]) if part[0] < part[1]]
    done, why = [], ""
    for lo, hi in merged:
        failed = _host_register(lo, hi)
        if failed:
            why = failed
        else:
            done.append((lo, hi))
    return done, why


def _page_span(a: np.ndarray) -> tuple[int, int]:
    """[start, end) of the whole pages under array a's bytes."""
    import mmap  # noqa: PLC0415

    page = mmap.PAGESIZE
    ptr = int(a.ctypes.data)
    return ptr - ptr % page, -(-(ptr + a.nbytes) // page) * page


def _host_register(lo: int, hi: int) -> str:
    """cudaHostRegister of the pages [lo, hi), read-only where the device allows it, else plain: "" when it is
    registered, else the driver's reason."""
    import cupy  # noqa: PLC0415

    rt = cupy.cuda.runtime
    why = ""
    for flags in (HOST_REGISTER_PORTABLE | HOST_REGISTER_READ_ONLY, HOST_REGISTER_PORTABLE):
        try:
            rt.hostRegister(lo, hi - lo, flags)
        except rt.CUDARuntimeError as exc:
            why = str(exc)
            continue
        return ""
    return why


def unregister_spans(spans: list[tuple[int, int]], _keep: object = None) -> None:
    """Undo register_spans (`_keep`: what a finalizer holds alive until then, e.g. the arrays of the map)."""
    import cupy  # noqa: PLC0415

    for lo, _ in spans:
        cupy.cuda.runtime.hostUnregister(lo)
