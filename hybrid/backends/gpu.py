"""GpuBackend: the Backend Protocol (`hybrid/backends/base.py`) on CUDA kernels (kernels_gpu) over quantized blocks.

Arrays are cupy float32 on the current device. A layer's weights are copied to the device once with `upload`
(raw quantized bytes as they are, 1-D weights as float32); `from_host` / `to_host` move activations through
pinned buffers. `decode_step` runs one token through a run of layers as a CUDA graph (kernels_gpu.graph): the
position is a device scalar and the KV-cache addresses sit in device slots, so one capture serves every token.
Imported lazily by the engine: importing this module needs no CuPy, constructing one does.
"""

from __future__ import annotations

import numpy as np

from gguf_io import quant_spec

from hybrid.model.arch.moe import moe_layer
from hybrid.model.weights import Weight

_MOE_TENSORS = ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
Q8_MEMO_ROWS = 64  # up to this many rows (kernels_gpu.matmul.MMQ_MAX_TOKENS) a norm or a decode step's attention
# also writes its output's 8-bit quantization, for the 8-bit products that read it next (one launch fewer each)


def _takes_q8(type_name: str, n_rows: int) -> bool:
    """Whether kernels_gpu.matmul multiplies n_rows rows by a weight of this type on 8-bit activations."""
    from kernels_gpu.matmul import uses_mmq, uses_q8, uses_q8t  # noqa: PLC0415

    return uses_q8(type_name, n_rows) or uses_q8t(type_name, n_rows) or uses_mmq(type_name, n_rows)


class GpuBackend:
    name = "gpu"
    paged_kv = True  # kv_store and attention read a paged cache (hybrid.kv.paged) through block tables
    routing_observer = None  # a model.arch.moe.RoutingObserver (Engine.observe_routing): hears every MoE routing

    def __init__(self, device: int = 0) -> None:
        import cupy  # noqa: PLC0415

        from kernels_gpu.transfer import PinnedStager  # noqa: PLC0415

        self._cupy = cupy
        self.device = cupy.cuda.Device(device)
        self.device.use()
        self._stager = PinnedStager()
        self._pos_key: bytes | None = None  # positions of the last call, on the device
        self._pos_dev = None
        self.use_graphs = True  # decode_step: capture and replay CUDA graphs (False: eager launches, reported)
        self._graphs = None  # kernels_gpu.graph.GraphRunner, made at the first decode_step
        self._slots: dict[int, tuple[int, int]] = {}  # during a decode step: layer -> device slots of its k, v
        self._paged = None  # during a decode step over paged caches: its kv_cache.PagedArgs (device tables)
        self._tables: tuple = (None, None)  # (host tables and seq_of bytes, their PagedArgs): eager steps' memo
        self._batch: tuple = (None, None)  # (a ragged batch, _batch_rows' answer): once for a step's layers
        self._q8_memo = None  # (x, its quantize_q8_1): the last one-token input quantized for a q8 matvec
        self._yarn: dict[tuple, tuple] = {}  # rope arguments -> (device angle factors, magnitude) for YaRN
        # GPU layers whose routed experts stay in host memory (-ot, --n-cpu-moe): backends/host_experts.py
        from hybrid.backends.gpu_moe import DeviceMoeLayers  # noqa: PLC0415
        from hybrid.backends.host_experts import HostExperts  # noqa: PLC0415

        self.host_experts = HostExperts(self)
        self.moe_layers = DeviceMoeLayers(self.from_host)  # each MoE layer's routing and biases for kernels_gpu.moe

    # ---- placement helpers
    def free_bytes(self) -> int:
        """Free device memory now (cudaMemGetInfo), plus what CuPy's pool holds unused."""
        free, _ = self._cupy.cuda.runtime.memGetInfo()
        return int(free) + int(self._cupy.get_default_memory_pool().free_bytes())

    def limit_memory(self, nbytes: int) -> None:
        """Cap what CuPy's pool may hold (weights, KV cache, scratch): past it allocations raise OutOfMemoryError."""
        self._cupy.get_default_memory_pool().set_limit(size=int(nbytes))

    def upload(self, weight: Weight) -> Weight:
        """A copy of `weight` whose raw data lives on the GPU: quantized/float matrices as their raw bytes
        (uint8, same shape), 1-D tensors (norms, biases) as float32."""
        raw = weight.raw
        if isinstance(raw, self._cupy.ndarray):
            return weight
        with self.device:
            dev = self._stager.to_device(np.asarray(raw))
        return Weight(weight.name, weight.type_name, weight.shape, dev)

    def alloc_like(self, weight: Weight) -> Weight:
        """An uninitialized device buffer of `weight`'s uploaded size (what `hybrid probe` allocates instead of
        uploading the real bytes)."""
        cp = self._cupy
        raw = weight.raw
        dtype = cp.float32 if raw.ndim == 1 else cp.uint8
        shape = raw.shape if raw.ndim == 1 else raw.shape[:-1] + (raw.shape[-1] * raw.dtype.itemsize,)
        with self.device:
            return Weight(weight.name, weight.type_name, weight.shape, cp.empty(shape, dtype=dtype))

    # ---- decode steps as CUDA graphs
    def decode_step(self, key, kv_layers: dict, fn, x: np.ndarray, position: int, paged=None,
                    beside=None, head: int | None = None) -> np.ndarray:
        """One decode token (or a speculative check's few) through a run of layers on this GPU: fn(x, positions)
        -> cupy array launches the work (x (n, n_embd) float32 and positions (n,) int32 on the device, from
        `position` on; layer il's cache is kv_layers[il]).

        x (host) crosses once, with the position and the cache addresses, in one asynchronous copy from pinned
        memory; the work is captured as a CUDA graph at the second call of a key (shape-relevant: the run of
        layers, the cache's shape and types) and replayed from then on, for any position and any cache of that
        shape; eager launches when use_graphs is False or capture is impossible (graph_report() says why).
        paged: for paged caches (kv_layers are views of pools), (positions (n,), seq_of (n,), tables (n_seq, w),
        block_size) on the host: the rows' positions, sequences and the sequences' block tables cross with x and
        serve the step's kv_store and attention (a ragged decode batch: one token of each of n sequences); the
        pools' addresses cross in the slots as a cache's do, so a graph serves any pool of that shape (each `run`
        makes its own, Engine.new_cache). A fifth item, last (n_seq,) on the host, makes it a mixed batch (prompt
        chunks among the sequences, rows ordered by sequence): the rows' composition joins the key, and fn is called
        as fn(x, positions, rows) with `last` on the device, the rows it keeps for the output. beside(): host work
        run while the GPU computes the step (GraphRunner.run). Returns fn's result on the host (with head: its
        first `head` values only, flat)."""
        from kernels_gpu.graph import GraphRunner  # noqa: PLC0415

        from kernels_gpu.kv_cache import PagedArgs  # noqa: PLC0415

        ils = sorted(kv_layers)
        layers = [kv_layers[il] for il in ils]
        sig = (tuple(ils), tuple(layer.graph_key for layer in layers))
        ptrs = [p for layer in layers for p in layer.ptrs]
        if paged is not None:
            pos_h, seq_h, tab_h, bs = paged[:4]
            last_h = paged[4] if len(paged) > 4 else None
            n, shape = len(pos_h), tab_h.shape
            # a mixed batch's composition (each sequence's rows) sets its kernels: part of the key
            sig += (("paged", shape, bs, None if last_h is None else tuple(np.bincount(seq_h).tolist())),)
            parts = [pos_h, seq_h, tab_h.reshape(-1)] + ([] if last_h is None else [last_h])
            position = np.concatenate(parts).astype(np.int32)

        def step(xd, pos, slots):
            base = slots.data.ptr  # the caches' (or pools') addresses, read through the slots when the kernels run
            self._slots = {il: (base + 16 * j, base + 16 * j + 8) for j, il in enumerate(ils)}
            if paged is not None:  # positions, sequences and tables from the step's inputs
                end = 2 * n + shape[0] * shape[1]
                self._paged = PagedArgs(pos[2 * n:end].reshape(shape), pos[n:2 * n], bs)
                try:
                    return fn(xd, pos[:n]) if last_h is None else fn(xd, pos[:n], pos[end:])
                finally:
                    self._paged, self._slots = None, {}
            n_tok = xd.shape[0]  # a speculative check's tokens sit at pos, pos + 1, ... (computed on the device)
            positions = pos if n_tok == 1 else pos + self._cupy.arange(n_tok, dtype=self._cupy.int32)
            try:
                return fn(xd, positions)
            finally:
                self._slots = {}

        with self.device:
            if self._graphs is None:
                self._graphs = GraphRunner()
            # an observer copies each layer's routing to the host, mid-step: eager steps (a graph captured without
            # it would replay without telling it)
            self._graphs.enabled = self.use_graphs and self.routing_observer is None
            return self._graphs.run((key, sig), step, x, position, ptrs, beside, head)

    def graph_report(self) -> str:
        """How decode steps ran: CUDA graphs captured and replayed, or eager launches and why."""
        return self._graphs.report() if self._graphs is not None else "no decode steps yet"

    @property
    def graph_fallback(self) -> bool:
        """True when some decode step had to run eagerly (capture impossible, or graphs turned off)."""
        return self._graphs is not None and self._graphs.fallback

    @staticmethod
    def captures_products(type_names, n_rows: int) -> bool:
        """Whether products of n_rows rows by weights of these GGML types can join a captured step: rows the
        matvec kernels take (up to 8), or the tensor-core kernel's (uses_mmq); not the dequantize + cuBLAS GEMM,
        which CuPy refuses inside a stream capture."""
        from kernels_gpu.matmul import MATVEC_MAX_TOKENS, uses_mmq  # noqa: PLC0415

        return n_rows <= MATVEC_MAX_TOKENS or all(uses_mmq(t, n_rows) for t in type_names)

    def host_call(self, fn, beside=None, needs=None) -> None:
        """Run fn() on the host once the work launched so far has finished: inside a decode step a host break of
        its CUDA graph (kernels_gpu.graph), else a synchronization of the current stream, then the call. beside()
        launches GPU work independent of fn, run beside it where the step allows (graph.host_break). fn must not
        wait for the current stream; it may return a callable, run after the step has its answer. needs: a device
        int32 array; inside a captured step the GPU waits for fn only when one of its values is negative."""
        if self._graphs is not None and self._graphs.active:
            self._graphs.host_break(fn, beside, needs)
            return
        from kernels_gpu.graph import call_now  # noqa: PLC0415

        call_now(self._cupy.cuda.get_current_stream(), fn, beside)

    def report_routing(self, lw, ids, wts) -> None:
        """Tell routing_observer (when set) the device routing ids, wts (cupy (n_tok, k)) of the MoE layer of
        weights lw, copied to the host; a decode step runs eagerly meanwhile (decode_step)."""
        observer = self.routing_observer
        if observer is not None:
            observer.routed(moe_layer(lw), self._cupy.asnumpy(ids), self._cupy.asnumpy(wts))

    def _no_capture(self, what: str) -> None:
        if self._graphs is not None and self._graphs.capturing:
            from kernels_gpu.graph import CaptureUnsupported  # noqa: PLC0415

            raise CaptureUnsupported(f"not capturable: {what}")

    def _positions(self, positions: np.ndarray):
        """positions (n,) -> cupy int32, re-used while the same positions come back (4 ops per layer use them)."""
        if isinstance(positions, self._cupy.ndarray):
            return self._cupy.ascontiguousarray(positions, dtype=self._cupy.int32)
        self._no_capture("positions from the host")
        p = np.ascontiguousarray(positions, dtype=np.int32).reshape(-1)
        key = p.tobytes()
        if key != self._pos_key:
            self._pos_dev = self._cupy.asarray(p)
            self._pos_key = key
        return self._pos_dev

    def _dev(self, x):
        cp = self._cupy
        if isinstance(x, cp.ndarray):
            return cp.ascontiguousarray(x, dtype=cp.float32)
        return self.from_host(np.ascontiguousarray(x, dtype=np.float32))

    # ---- the backend interface
    def matmul(self, w: Weight, x):
        """x (n, in) f32 -> (n, out) f32, straight from the raw blocks of w (uploaded)."""
        from kernels_gpu.matmul import matmul, quantize_q8_1  # noqa: PLC0415

        if not isinstance(w.raw, self._cupy.ndarray):
            raise ValueError(f"weight {w.name} is not on the GPU: GpuBackend.upload it first")
        xd = self._dev(x)
        if xd.ndim != 2 or not _takes_q8(w.type_name, xd.shape[0]):
            return matmul(w.raw, w.type_name, xd)
        # 8-bit activations: x quantized by the kernel that made it (a norm, attention: _q8_of), or, one token,
        # quantized here once for every weight it meets in a row (q, k, v; gate, up), as the blocks call matmul on
        # the same array; several tokens without one: matmul quantizes (with the tensor cores' packing)
        q8 = self._q8_of(x)
        if q8 is None and xd.shape[0] == 1:
            q8 = quantize_q8_1(xd)
            self._q8_memo = (x, q8)
        return matmul(w.raw, w.type_name, xd, q8_act=q8)

    def _q8_of(self, x):
        """The memo's 8-bit quantization of x (a decode row), or None: the memo holds an array and its
        quantize_q8_1, made by the last matmul or by the kernel that wrote the array (a norm, attention); it is
        x's when x is that array or a contiguous view of all of its memory (the memo keeps the array, so no other
        array can take that memory meanwhile)."""
        memo = self._q8_memo
        if memo is None:
            return None
        a = memo[0]
        if a is x or (isinstance(x, self._cupy.ndarray) and x.size == a.size and x.dtype == a.dtype
                      and x.data.ptr == a.data.ptr and x.flags.c_contiguous and a.flags.c_contiguous):
            return memo[1]
        return None

    def matmuls(self, ws, x) -> tuple:
        """Several weights times one x (q/k/v, gate/up) -> one (n, out_i) f32 result per weight, with fewer launches
        (kernels_gpu.matmul.matmul_many): one token, one q8 launch over all rows of a type; prefill, one fp16 x and
        one stacked GEMM (up to GEMM_STACK_ELEMENTS)."""
        from kernels_gpu.matmul import matmul_many, quantize_q8_1  # noqa: PLC0415

        for w in ws:
            if not isinstance(w.raw, self._cupy.ndarray):
                raise ValueError(f"weight {w.name} is not on the GPU: GpuBackend.upload it first")
        xd = self._dev(x)
        q8_act = None
        if xd.ndim == 2 and any(_takes_q8(w.type_name, xd.shape[0]) for w in ws):
            q8_act = self._q8_of(x)  # as matmul: x quantized once, also for a later matmul of the same x
            if q8_act is None and xd.shape[0] == 1:
                q8_act = quantize_q8_1(xd)
                self._q8_memo = (x, q8_act)
        return matmul_many([w.raw for w in ws], [w.type_name for w in ws], xd, q8_act=q8_act)

    def get_rows(self, w: Weight, ids):
        """Embedding lookup: dequantize only the requested rows -> (n, n_embd) f32 (on the GPU when w is)."""
        ids = np.asarray(ids, dtype=np.int64)
        if not isinstance(w.raw, self._cupy.ndarray):
            return quant_spec(w.type_name).dequantize(w.raw[ids])
        from kernels_gpu.matmul import dequantize  # noqa: PLC0415

        return dequantize(w.raw, w.type_name, rows=self._cupy.asarray(ids.astype(np.int32)))

    def rms_norm(self, x, w, eps: float):
        """rms_norm(x) * w; up to Q8_MEMO_ROWS rows (decode steps, mixed steps) are also quantized to 8 bits in the
        same kernel, for the 8-bit products that take them next (the memo of matmul/matmuls)."""
        from kernels_gpu import ops  # noqa: PLC0415

        xd = self._dev(x)
        if xd.ndim == 2 and 1 <= xd.shape[0] <= Q8_MEMO_ROWS:
            fused = ops.rms_norm_q8(xd, w, eps)
            if fused is not None:
                out, self._q8_memo = fused[0], fused
                return out
        return ops.rms_norm(xd, w, eps)

    def add_rms_norm(self, x, a, w, eps: float):
        """(x + a, rms_norm(x + a) * w): the residual add and the next norm, one kernel (a decode row's norm also
        quantized to 8 bits there, as rms_norm's)."""
        from kernels_gpu import ops  # noqa: PLC0415

        xd, ad = self._dev(x), self._dev(a)
        if xd.ndim == 2 and 1 <= xd.shape[0] <= Q8_MEMO_ROWS:
            fused = ops.rms_norm_q8(xd, w, eps, a=ad)
            if fused is not None:
                total, out, q8 = fused
                self._q8_memo = (out, q8)
                return total, out
        return ops.add_rms_norm(xd, ad, w, eps)

    def rms_norm_heads(self, x, w, eps: float):
        from kernels_gpu import ops  # noqa: PLC0415

        return ops.rms_norm_heads(self._dev(x), w, eps)

    def rope(self, x, positions, n_rot: int, base: float, scale: float, mode: str, yarn: tuple | None = None):
        from kernels_gpu import ops  # noqa: PLC0415

        if yarn is None:
            return ops.rope(self._dev(x), self._positions(positions), n_rot, base, scale, mode)
        from kernels_gpu.rope_yarn import rope_yarn, yarn_factors  # noqa: PLC0415

        key = (n_rot, base, scale, yarn)
        if key not in self._yarn:  # made eagerly (a decode step's first call is never captured)
            self._no_capture("YaRN tables from the host")
            factors, mscale = yarn_factors(n_rot, base, scale, yarn)
            self._yarn[key] = (self._cupy.asarray(factors), mscale)
        factors, mscale = self._yarn[key]
        return rope_yarn(self._dev(x), self._positions(positions), factors, mscale, mode)

    def fused_qk_norm_rope(self, q, k, wq, wk, eps: float, positions, n_rot: int, base: float, scale: float,
                           mode: str, yarn: tuple | None = None):
        """QK-norm and RoPE of q and k in one kernel (ops.qk_norm_rope; wq, wk None: RoPE alone, ops.rope_qk), None
        with YaRN (rope_yarn's tables)."""
        from kernels_gpu import ops  # noqa: PLC0415

        if yarn is not None:
            return None
        if wq is None:  # no QK-norm: both ropes in one launch
            return ops.rope_qk(self._dev(q), self._dev(k), self._positions(positions), n_rot, base, scale, mode)
        return ops.qk_norm_rope(self._dev(q), self._dev(k), wq, wk, eps, self._positions(positions), n_rot, base,
                                scale, mode)

    def scale(self, x, s: float):
        from kernels_gpu import ops  # noqa: PLC0415

        return ops.scale(self._dev(x), s)

    def glu(self, gate, up, act: str):
        from kernels_gpu import ops  # noqa: PLC0415

        return ops.glu(self._dev(gate), self._dev(up), act)

    def new_kv_layer(self, n_ctx: int, n_head_kv: int, hd_k: int, hd_v: int, type_k: str, type_v: str):
        from kernels_gpu.kv_cache import alloc_kv_layer  # noqa: PLC0415

        with self.device:
            return alloc_kv_layer(n_ctx, n_head_kv, hd_k, hd_v, type_k, type_v)

    def kv_store(self, kv, il: int, k, v, positions) -> None:
        from kernels_gpu.kv_cache import kv_store  # noqa: PLC0415

        layer = kv.layers[il]
        if isinstance(positions, self._cupy.ndarray):  # a decode step: the engine checked the position
            kv_store(layer, positions, self._dev(k), self._dev(v), self._slots.get(il), paged=self._paged)
            return
        p = np.asarray(positions)
        if p.size and (int(p.min()) < 0 or int(p.max()) >= layer.n_ctx):
            raise ValueError(f"kv_store: positions must lie in [0, {layer.n_ctx}), found [{p.min()}, {p.max()}]")
        paged = self._one_table(layer, p)
        kv_store(layer, self._positions(positions), self._dev(k), self._dev(v), paged=paged)

    def attention(self, q, kv, il: int, positions, scale: float, n_swa: int, sinks=None):
        from kernels_gpu.attention import attention, attention_q8  # noqa: PLC0415

        layer = kv.layers[il]
        extra = {} if sinks is None else {"sinks": self._dev(sinks)}  # no sinks: the call as it always was
        if isinstance(positions, self._cupy.ndarray):
            # a decode step: the grid follows the cache size, the kernel reads the keys in use from the positions;
            # the output is quantized to 8 bits where the splits are merged, for the output projection
            qd = self._dev(q)
            paged = self._paged
            if paged is not None:
                extra["paged"] = paged
            n_kv = layer.n_ctx if paged is None else paged.width * paged.block_size
            out, q8 = attention_q8(qd, layer, positions, n_kv, scale, n_swa, dynamic=True,
                                   slots=self._slots.get(il), q8=qd.shape[0] <= Q8_MEMO_ROWS,
                                   **extra)
            if q8 is not None:
                self._q8_memo = (out, q8)
            return out
        p = np.asarray(positions)
        if p.size and int(p.min()) < 0:
            raise ValueError(f"attention: positions must be >= 0, found {p.min()}")
        n_kv = int(p.max()) + 1 if p.size else 0
        paged = self._one_table(layer, p)
        return attention(self._dev(q), layer, self._positions(positions), n_kv, scale, n_swa, paged=paged, **extra)

    def attend_seqs(self, kv, il: int, q, k, v, positions, scale: float, n_swa: int, sinks=None):
        """kv_store and attention for a ragged batch (hybrid.kv.batch.KVBatch) whose sequences are paged views of
        one pool: one store and one attention launch for all of them (a sequence of PREFILL_MIN_TOK rows or more
        makes it a launch a sequence, each taking the tiled prefill kernel where it can). None for other batches
        (blocks.attend then stores and attends sequence by sequence)."""
        from kernels_gpu.attention import PREFILL_MIN_TOK, attention  # noqa: PLC0415
        from kernels_gpu.kv_cache import PagedArgs, kv_store  # noqa: PLC0415

        paged = self._paged
        if paged is not None:  # a decode step: its tables are inputs of the graph
            self.kv_store(kv.seqs[0].cache, il, k, v, positions)
            if all(s.end - s.start < PREFILL_MIN_TOK for s in kv.seqs):
                return self.attention(q, kv.seqs[0].cache, il, positions, scale, n_swa, sinks)
            return self._attend_mixed(kv, il, q, positions, scale, n_swa, sinks)
        layers = [s.cache.layers[il] for s in kv.seqs]
        rows = self._batch_rows(kv, layers, positions)
        if rows is None:
            return None
        paged, spans = rows
        layer, p = layers[0], np.asarray(positions)
        kd, vd, qd = self._dev(k), self._dev(v), self._dev(q)
        pos = self._positions(p)
        kv_store(layer, pos, kd, vd, paged=paged)
        extra = {} if sinks is None else {"sinks": self._dev(sinks)}
        if max(b - a for a, b in spans) < PREFILL_MIN_TOK:
            return attention(qd, layer, pos, int(p.max()) + 1, scale, n_swa, paged=paged, **extra)
        out = self._cupy.empty((qd.shape[0], qd.shape[1], vd.shape[2]), dtype=self._cupy.float32)
        for a, b, s in _attention_runs(spans, PREFILL_MIN_TOK):  # a chunk alone, or a run of short sequences
            one = paged.one(s) if s is not None else PagedArgs(paged.tables, paged.seq_of[a:b], paged.block_size)
            attention(qd[a:b], layer, pos[a:b], int(p[a:b].max()) + 1, scale, n_swa, out=out[a:b], paged=one,
                      **extra)
        return out

    def _attend_mixed(self, kv, il: int, q, positions, scale: float, n_swa: int, sinks):
        """Attention of a mixed batch inside a decode step (graph inputs: positions and tables on the device): each
        run of consecutive short sequences in one launch of the flash-decoding kernel (its rows' own sequences and
        positions), each prompt chunk of PREFILL_MIN_TOK rows or more in the tiled prefill kernel over its
        sequence's table, its key range and splits' shares read from the positions on the device (the grid follows
        the table's size, so one capture serves every position)."""
        from kernels_gpu.attention import ATTP_D, PREFILL_MIN_TOK, attention, attention_q8  # noqa: PLC0415
        from kernels_gpu.kv_cache import PagedArgs  # noqa: PLC0415

        paged, layer = self._paged, kv.seqs[0].cache.layers[il]
        n_kv = paged.width * paged.block_size
        qd = self._dev(q)
        tiled = PREFILL_MIN_TOK if qd.shape[2] in ATTP_D else qd.shape[0] + 1  # rows a chunk takes the tiled kernel
        out = self._cupy.empty(qd.shape, dtype=self._cupy.float32)
        slots = self._slots.get(il)
        extra = {} if sinks is None else {"sinks": self._dev(sinks)}
        for a, b, s in _attention_runs([(r.start, r.end) for r in kv.seqs], tiled):
            if s is not None:
                attention(qd[a:b], layer, positions[a:b], n_kv, scale, n_swa, out=out[a:b], slots=slots, prefill=True,
                          paged=paged.one(s), **extra)
            else:
                attention_q8(qd[a:b], layer, positions[a:b], n_kv, scale, n_swa, out=out[a:b], dynamic=True,
                             slots=slots, paged=PagedArgs(paged.tables, paged.seq_of[a:b], paged.block_size), **extra)
        return out

    def _batch_rows(self, kv, layers, positions):
        """(PagedArgs of the batch's tables and rows' sequences on the device, the sequences' row spans) where kv's
        sequences are paged views of one pool filling the batch in order, else None; made once a step (the
        layers share the tables) and kept while they come back the same."""
        from kernels_cpu.attention import seq_rows  # noqa: PLC0415 - the host side of the CPU's one-call batches
        from kernels_gpu.kv_cache import PagedArgs  # noqa: PLC0415

        if self._batch[0] is kv:
            return self._batch[1]
        spans = [(s.start, s.end) for s in kv.seqs]
        answer = None
        rows = None if layers[0].table is None else seq_rows(layers, spans, np.asarray(positions))  # blocks checked
        if rows is not None and rows.tables is not None:
            key = ("batch", rows.tables.shape, layers[0].block_size, rows.tables.tobytes(), rows.seq_of.tobytes())
            if self._tables[0] != key:
                self._no_capture("block tables from the host")
                cp = self._cupy
                self._tables = (key, PagedArgs(cp.asarray(rows.tables), cp.asarray(rows.seq_of),
                                               layers[0].block_size))
            answer = (self._tables[1], spans)
        self._batch = (kv, answer)
        return answer

    def _one_table(self, layer, positions: np.ndarray):
        """A paged layer's table on the device (PagedArgs of one sequence), its blocks for `positions` checked;
        None for a contiguous layer."""
        if layer.table is None:
            return None
        from kernels_cpu.kv_cache import check_blocks  # noqa: PLC0415
        from kernels_gpu.kv_cache import PagedArgs  # noqa: PLC0415

        if positions.size:
            check_blocks(layer, int(positions.max()) + 1)  # every key's block exists
        key = ("one", layer.block_size, layer.table.tobytes())
        if self._tables[0] != key:
            self._no_capture("a block table from the host")
            self._tables = (key, PagedArgs(self._cupy.asarray(layer.table.reshape(1, -1)), None, layer.block_size))
        return self._tables[1]

    def logits_and_ids(self, logits):
        """logits (n, n_vocab) -> one flat float32 array: each row's argmax id (ops.argmax_rows), then the logits;
        a decode step's output, of which the host may copy the ids alone (decode_step's head)."""
        from kernels_gpu import ops  # noqa: PLC0415

        logits = self._dev(logits)
        n = logits.shape[0]
        out = self._cupy.empty(n + logits.size, dtype=self._cupy.float32)
        ops.argmax_rows(logits, out=out[:n])
        out[n:] = logits.reshape(-1)
        return out

    def gather_rows(self, x, rows):
        """x[rows] as a contiguous array, rows a device int32 array (read when the kernel runs: capturable)."""
        return self._cupy.take(x, rows, axis=0)

    def take_rows(self, x, rows: np.ndarray):
        """x[rows] as a contiguous (len(rows), n) cupy array; rows is a host int64 array."""
        self._no_capture("rows chosen on the host")
        return self._cupy.ascontiguousarray(x[self._cupy.asarray(rows)])

    def zeros(self, shape: tuple[int, ...]):
        return self._cupy.zeros(shape, dtype=self._cupy.float32)

    def scatter_add(self, out, rows: np.ndarray, y, weights: np.ndarray) -> None:
        """out[rows] += weights[:, None] * y (rows are distinct)."""
        self._no_capture("rows chosen on the host")
        cp = self._cupy
        out[cp.asarray(rows)] += cp.asarray(weights, dtype=cp.float32)[:, None] * y

    def to_host(self, x) -> np.ndarray:
        """cupy -> numpy (a numpy array passes through)."""
        if isinstance(x, np.ndarray):
            return x
        self._no_capture("a device -> host copy inside the step (e.g. MoE routing on the host)")
        return self._stager.to_host(x)

    def from_host(self, x):
        """numpy -> cupy through a pinned buffer (a cupy array passes through)."""
        if isinstance(x, self._cupy.ndarray):
            return x
        self._no_capture("a host -> device copy inside the step")
        return self._stager.to_device(np.asarray(x))

    def fused_attention(self, spec, cfg, lw, il: int, x, positions: np.ndarray, kv) -> None:
        """No fused attention on the GPU: blocks.layer_forward runs the ops one by one (they are launched, not called
        from Python one by one, once the decode step is a captured graph)."""
        return None

    def fused_ffn(self, spec, cfg, lw, x, a) -> None:
        """No fused FFN here either."""
        return None

    def fused_moe(self, spec, cfg, lw, h, residual=None):
        """The MoE FFN as MUL_MAT_ID (kernels_gpu.moe): routing on the device (plain softmax and the gated forms:
        sigmoid, the selection bias, groups, a scale, gpt-oss's softmax of the selected with the router's and the
        experts' biases) and the selected experts read in place, no host synchronization for a decode batch (so MoE
        layers stay inside the decode CUDA graph). Experts kept in host memory (-ot, --n-cpu-moe) run through
        self.host_experts (backends/host_experts.py). None where the experts are of a float type (no id kernels) or
        the device lacks the layer's GLU or routing (blocks.moe_ffn then runs op by op, routed on the host).
        residual: when given, the result is residual + the experts' sum (one kernel with the sum for resident
        experts)."""
        from kernels_gpu import moe  # noqa: PLC0415

        from hybrid.backends.host_experts import has_host_experts  # noqa: PLC0415

        ws = [lw[n] for n in _MOE_TENSORS]
        if isinstance(ws[0].raw, self._cupy.ndarray) and has_host_experts(lw):
            out = self.host_experts(spec, cfg, lw, h)  # the router here, the experts in RAM (any routing)
            return out if residual is None else self._dev(residual) + out
        if not all(isinstance(w.raw, self._cupy.ndarray) for w in ws):
            return None
        if not all(moe.supported(w.type_name) for w in ws[1:]):
            return None
        layer = self.moe_layers.get(spec, cfg, lw)
        if layer is None or layer.host_biases:
            return None
        router, gate, up, down = ((w.raw, w.type_name) for w in ws)
        on_route = None if self.routing_observer is None else (lambda ids, wts: self.report_routing(lw, ids, wts))
        return moe.moe_ffn(self._dev(h), router, gate, up, down, layer.router, spec.ffn_act, on_route,
                           layer.biases, None if residual is None else self._dev(residual),
                           self._q8_of(h))  # h's q8 quantization where its norm made it (rms_norm_q8)


def _attention_runs(spans: list[tuple[int, int]], tiled: int) -> list[tuple[int, int, int | None]]:
    """A ragged batch's attention launches: (first row, end row, sequence) for each sequence of `tiled` rows or more
    (the tiled prefill kernel over its table), (first row, end row, None) for each run of consecutive shorter ones
    (one launch of the decode kernel, each row through its own sequence's table); empty sequences are skipped."""
    out: list[tuple[int, int, int | None]] = []
    for i, (a, b) in enumerate(spans):
        if b - a >= tiled:
            out.append((a, b, i))
        elif a < b and out and out[-1][2] is None and out[-1][1] == a:
            out[-1] = (out[-1][0], b, None)
        elif a < b:
            out.append((a, b, None))
    return out
