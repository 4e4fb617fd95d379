"""The runtime GPU cache of hot experts (--moe-cache) for GPU layers whose routed experts stay in RAM (host_experts).

Per cached layer, a slot pool per projection on the device, (n_slots + 1, n_out, row_bytes) uint8 at the file's
expert stride (the last slot all zeros), and one device table lookup[layer, expert] -> slot or -1. A step of a few
tokens (a decode token, a speculative check) of such a layer, routed on the device:

1. one launch (kernels_gpu.moe_cache.lookup) gives each routed expert its slot, or the zero slot and weight 0 on a
   miss; kernels_gpu.moe's decode then runs every pair on the pools (the misses' products are exactly 0), the
   hits' weighted sum stays on the GPU;
2. h, the routing and the lookup cross to pinned memory; in the host break (kernels_gpu.graph) the CPU runs only the
   missed experts (ids (n_tok, m), padded with weight-0 experts for a few-token batch) with the CPU MoE kernel;
3. its sum crosses back and the two partial sums are added (kernels_gpu.moe_cache.add_misses).
When every expert of the step hit, the GPU does not wait for the host at all (host_break's `needs`: the lookup) and
step 3 adds nothing: the host's call then only keeps the book, beside the step.

Admission (one token only; book.py decides, under the cap): after the host break's answer (the step goes on
meanwhile), each evicted expert's table entry is set to -1 on the step's stream, then the copies of the new experts
start on a copy stream of their own, after that (an event), straight from the page-locked pages of the model file;
the table entry of a copy is written (on the step's stream, so it is ordered before every later lookup) at a later
host break that finds the copy's event done. Nothing waits for a copy. A table write is a 4-byte copy from a
constant pinned array (-1, or the slot's id). The GPU's hit kernels run beside the CPU's misses in a captured step
(graph.host_break's `beside`: between the signal to the host and the wait for it), after the host call in an eager
one.
"""

from __future__ import annotations

import time
import weakref

import numpy as np

from hybrid.backends.host_experts import EXPERT_TENSORS, _Pinned
from hybrid.backends.moe_cache.book import CacheBook
from hybrid.model.weights import Weight
from hybrid.plan.moe_cache import MoeCachePlan

MAX_TOKENS = 8  # as kernels_gpu.matmul.MATVEC_MAX_TOKENS: the id kernels' batch (a bigger one takes the plain path)


def cacheable(he, spec, lw: dict[str, Weight]) -> str:
    """Why layer lw's experts cannot be cached ("" when they can): the GPU's id kernels need quantized experts
    without biases and a GLU of kernels_gpu.ops, the uploads need the expert pages locked (HostExperts.register)."""
    from kernels_gpu import moe  # noqa: PLC0415
    from kernels_gpu.ops import GLU_ACTS  # noqa: PLC0415

    ws = [lw[n] for n in EXPERT_TENSORS]
    if any(f"{n}.bias" in lw for n in EXPERT_TENSORS):
        return "experts with biases (the GPU's expert kernels add none)"
    if not all(moe.supported(w.type_name) for w in ws):
        return f"expert types {', '.join(sorted({w.type_name for w in ws}))} (no GPU id kernels)"
    if spec.ffn_act not in GLU_ACTS:
        return f"GLU {spec.ffn_act}"
    if not all(he._locked(w.raw) for w in ws):
        return "expert pages not page-locked (uploads would block the step)"
    return ""


class ExpertCache:
    """Slot pools, the device table, the copy stream and the book of the cached layers (see the module docstring).
    layers: model layer index -> its weights (host expert tensors)."""

    def __init__(self, layers: dict[int, dict[str, Weight]], n_expert: int, top_k: int, n_slots: int,
                 policy: str, max_inserts: int | None) -> None:
        import cupy  # noqa: PLC0415

        order = sorted(layers)
        self.n_slots = n_slots
        self.book = CacheBook(tuple(order), n_expert, top_k, n_slots, policy, max_inserts,
                              tuple(sum(layers[il][n].raw[0].nbytes for n in EXPERT_TENSORS) for il in order))
        self._rows = {id(layers[il]["ffn_gate_exps"]): r for r, il in enumerate(order)}
        # per row: ((pool, type), ...) for gate, up, down, and the host tensors the uploads read
        self.pools = [tuple((cupy.zeros((n_slots + 1,) + layers[il][n].raw.shape[1:], dtype=cupy.uint8),
                             layers[il][n].type_name) for n in EXPERT_TENSORS) for il in order]
        self._host = [tuple(layers[il][n].raw for n in EXPERT_TENSORS) for il in order]
        self.table = cupy.full((len(order), n_expert), -1, dtype=cupy.int32)
        self._stream = cupy.cuda.Stream(non_blocking=True)
        self._consts_mem = cupy.cuda.alloc_pinned_memory(4 * (n_slots + 1))
        self._consts = np.frombuffer(self._consts_mem, np.int32, n_slots + 1)
        self._consts[:n_slots] = np.arange(n_slots)  # constants: never written again (async copies read them)
        self._consts[n_slots] = -1
        self._found: dict[tuple[int, int], tuple] = {}  # (row, n_tok) -> pinned int32 (n_tok, k) of the lookups
        self._bufs: dict[tuple[int, int], _Pinned] = {}  # (row, n_tok) -> pinned h, ids, weights in, the sum out
        done = weakref.finalize(self, self._stream.synchronize)  # no copy left reading the locked pages
        done.atexit = False  # at exit the CUDA context may be gone first; nothing in flight matters then

    def row(self, lw: dict[str, Weight], n_tok: int) -> int | None:
        """The row of layer lw when this step of n_tok tokens is served from the cache, else None."""
        row = self._rows.get(id(lw["ffn_gate_exps"]))
        return row if row is not None and n_tok <= MAX_TOKENS else None

    def resident(self, gate: Weight):
        """(the device table's row, the pools (gate, up, down)) of the layer whose host gate tensor is `gate`, or
        None: a prompt batch's uploads read the cached experts from their slots (kernels_gpu.moe_upload). The row
        lists only copies already validated, and a slot being refilled was taken out of it on the decode step's
        stream, which every step ends by synchronizing; prompt batches admit nothing."""
        row = self._rows.get(id(gate))
        return None if row is None else (self.table[row], tuple(pool for pool, _ in self.pools[row]))

    def run(self, he, spec, cfg, lw: dict[str, Weight], h, ids, wts, row: int):
        """The experts of h (n_tok, n_embd) routed to ids / wts (cupy (n_tok, k)): the hits on the GPU, the misses
        on the CPU in he's host break (see the module docstring) -> (n_tok, n_embd) f32 on the GPU."""
        import cupy  # noqa: PLC0415

        from kernels_gpu import moe, moe_cache  # noqa: PLC0415

        n_tok, n_embd = h.shape
        k = ids.shape[1]
        ids = cupy.ascontiguousarray(ids, dtype=cupy.int32)
        wts = cupy.ascontiguousarray(wts, dtype=cupy.float32)
        found, slots, wts_hit = moe_cache.lookup(self.table[row], ids, wts, self.n_slots)
        gate, up, down = self.pools[row]
        part = []  # the hits' weighted sum, on the GPU beside the CPU's misses where the step allows
        buf = self._bufs.get((row, n_tok))
        if buf is None:
            buf = self._bufs[(row, n_tok)] = _Pinned(n_tok, n_embd, k, cfg.n_expert)
        fbuf = self._pinned_found(row, n_tok, k)
        stream = cupy.cuda.get_current_stream()
        d2h = cupy.cuda.runtime.memcpyDeviceToHost
        for src, dst in ((h, buf.h), (ids, buf.ids), (wts, buf.w), (found, fbuf)):
            cupy.cuda.runtime.memcpyAsync(dst.ctypes.data, src.data.ptr, dst.nbytes, d2h, stream.ptr)
        args = he._cpu_args(spec, cfg, lw)

        def experts():
            t0 = time.perf_counter()
            miss = fbuf < 0  # what the GPU's lookup missed: the CPU's share, the step waits for it
            s = he.stats
            if miss.any():
                buf.out[...] = args(buf.h, *missed(buf.ids, buf.w, miss))
                s.cpu_batches += 1
                s.cpu_tokens += n_tok
            s.cpu_seconds += time.perf_counter() - t0
            return book  # the bookkeeping, after the answer: the step reads none of it

        def book() -> None:
            self._validate(stream)
            if n_tok == 1:
                self._upload(row, self.book.decode(row, buf.ids[0], fbuf[0])[1], stream)
            else:
                self.book.batch(fbuf)

        # every expert a hit: the GPU goes on without the host (the host's call and book run beside the step)
        he.gpu.host_call(experts, beside=lambda: part.append(moe._decode(h, slots, wts_hit, gate, up, down,
                                                                          spec.ffn_act)), needs=found)
        out = cupy.empty((n_tok, n_embd), dtype=cupy.float32)
        cupy.cuda.runtime.memcpyAsync(out.data.ptr, buf.out.ctypes.data, buf.out.nbytes,
                                      cupy.cuda.runtime.memcpyHostToDevice, stream.ptr)
        return moe_cache.add_misses(part[0], out, found)

    def _pinned_found(self, row: int, n_tok: int, k: int) -> np.ndarray:
        import cupy  # noqa: PLC0415

        hit = self._found.get((row, n_tok))
        if hit is None:
            mem = cupy.cuda.alloc_pinned_memory(4 * n_tok * k)
            hit = self._found[(row, n_tok)] = (mem, np.frombuffer(mem, np.int32, n_tok * k).reshape(n_tok, k))
        return hit[1]

    def _set(self, row: int, expert: int, const: int, stream) -> None:
        """table[row, expert] = self._consts[const] (a slot's id, or -1 at n_slots), ordered on `stream`."""
        import cupy  # noqa: PLC0415

        rt = cupy.cuda.runtime
        rt.memcpyAsync(self.table.data.ptr + 4 * (row * self.table.shape[1] + expert),
                       self._consts.ctypes.data + 4 * const, 4, rt.memcpyHostToDevice, stream.ptr)

    def _validate(self, stream) -> None:
        """The uploads whose copies are done enter the table (on the step's stream, before the next lookups)."""
        if self.book.in_flight:
            for row, expert, slot in self.book.settle(lambda ev: ev.done):
                self._set(row, expert, slot, stream)

    def _upload(self, row: int, ups: list[tuple[int, int, int]], stream) -> None:
        """Start the book's uploads of a step: the victims out of the table on the step's stream, then the experts'
        copies on the copy stream after it; their event goes to the book (validated later by _validate)."""
        if not ups:
            return
        import cupy  # noqa: PLC0415

        rt = cupy.cuda.runtime
        for _, _, victim in ups:
            if victim >= 0:
                self._set(row, victim, self.n_slots, stream)
        evicted = cupy.cuda.Event(disable_timing=True)
        evicted.record(stream)
        self._stream.wait_event(evicted)  # no later lookup of the step's stream can find a victim's slot
        for expert, slot, _ in ups:
            for (pool, _), host in zip(self.pools[row], self._host[row]):
                per = host[0].nbytes
                rt.memcpyAsync(pool.data.ptr + slot * per, int(host.ctypes.data) + expert * per, per,
                               rt.memcpyHostToDevice, self._stream.ptr)
        copied = cupy.cuda.Event(disable_timing=True)
        copied.record(self._stream)
        self.book.issued(copied, row, ups)

    def wait(self) -> None:
        """Wait for the copies in flight and enter them in the table (tests; nothing needs it at run time)."""
        import cupy  # noqa: PLC0415

        self._stream.synchronize()
        stream = cupy.cuda.get_current_stream()
        self._validate(stream)
        stream.synchronize()


def missed(ids: np.ndarray, w: np.ndarray, miss: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The CPU's share of a step: ids / w (n_tok, k) and miss (n_tok, k) bool -> (ids, w) (n_tok, m) with m the most
    misses of a token, each token's misses first (in routing order), padded with its other experts at weight 0."""
    if miss.shape[0] == 1:  # a decode token: its misses, nothing to pad
        sel = miss[0]
        return ids[:, sel], w[:, sel]
    m = int(miss.sum(axis=1).max())
    order = np.argsort(~miss, axis=1, kind="stable")[:, :m]
    sel = np.take_along_axis(miss, order, 1)
    return (np.ascontiguousarray(np.take_along_axis(ids, order, 1)),
            np.where(sel, np.take_along_axis(w, order, 1), np.float32(0.0)).astype(np.float32))


def attach_expert_cache(gpu, plan: MoeCachePlan, layers: dict[int, dict[str, Weight]], spec, cfg, policy: str,
                        max_inserts: int | None) -> str:
    """Give gpu.host_experts the cache `plan` sized (over `layers`, the engine's weights of its layers) when any
    layer can be cached; returns the one line to tell the user (the plan's note when it is off, what was made, or
    why not)."""
    if not plan.on:
        return plan.note
    he = gpu.host_experts
    why = {il: cacheable(he, spec, layers[il]) for il in plan.layers}
    ok = {il: layers[il] for il, w in why.items() if not w}
    if not ok:
        return f"moe cache off: {next(iter(why.values()))}"
    with gpu.device:
        he.cache = ExpertCache(ok, cfg.n_expert, cfg.n_expert_used, plan.slots, policy, max_inserts)
    skipped = sorted(set(plan.layers) - set(ok))
    cap = "no cap" if max_inserts is None else f"at most {max_inserts} uploads a layer a step"
    line = f"{plan.note}; policy {policy}, {cap}"
    return line + (f"; not layers {skipped} ({why[skipped[0]]})" if skipped else "")


def expert_cache(engine) -> ExpertCache | None:
    """The engine's expert cache (on a GPU backend's host_experts), or None."""
    for b in (*engine.backends, engine.output_backend):
        he = getattr(b, "host_experts", None)
        if he is not None and getattr(he, "cache", None) is not None:
            return he.cache
    return None
