"""A GPU layer whose routed experts stay in host memory (-ot '...ffn_.*_exps=CPU', --cpu-moe, --n-cpu-moe).

The GPU computes the layer's attention, norms and router and routes the tokens (kernels_gpu.moe.route_with). Then:
- a batch of fewer than `min_batch` tokens (decode, short prompts): the normed hidden state, the expert ids and
  their weights cross to pinned host memory once, the CPU runs the selected experts in its compiled MoE kernel
  (kernels_cpu.moe.moe_experts, threads over experts and rows, no Python loop over experts), and the weighted sum
  crosses back once. Inside a decode step this is a host break of the CUDA graph (kernels_gpu.graph): the pieces
  before and after it stay captured.
- a bigger batch (prefill): only the experts the batch routes to are uploaded from host memory, a chunk of experts
  at a time, and multiplied on the GPU's tensor cores (kernels_gpu.moe_upload; kernels_gpu.moe.prefill's
  dequantize-and-GEMM where those kernels cannot take the experts), as llama.cpp's op offload does for
  GGML_OP_MUL_MAT_ID; `min_batch` is llama.cpp's rule, n_expert / n_expert_used * 32 tokens, at most 256
  (offload_min_batch).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numba
import numpy as np

from kernels_cpu import moe as cpu_moe_kernels
from kernels_cpu.activations import GELU_F16_TABLE

from hybrid.backends.cpu_fused import _GLU_OP
from hybrid.backends.cpu_moe import _EMPTY, _biases, _experts, moe_fusable
from hybrid.backends.repack import BASE_TYPE, byte_permutation
from hybrid.errors import UnsupportedPlacement
from hybrid.model.arch.moe import moe_layer
from hybrid.model.weights import Weight
from hybrid.plan.placement import HOST_STAGING_SLOTS, POOL_UNIT, staging_slot_bytes

EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
OFFLOAD_TOKENS_PER_EXPERT = 32  # llama.cpp: a MUL_MAT_ID is offloaded at >= 32 tokens per used expert on average
OFFLOAD_MAX_MIN_BATCH = 256  # ... but never asks for more tokens than this (offload_min_batch)
STAGING_SLOTS = HOST_STAGING_SLOTS  # device slots of a batch's uploads: one read by the kernels, two filled ahead


def offload_min_batch(n_expert: int, n_expert_used: int) -> int:
    """The smallest batch whose routed experts are uploaded and run on the GPU: llama.cpp's op offload rule for
    MUL_MAT_ID (n_expert / n_expert_used * 32 tokens), at most OFFLOAD_MAX_MIN_BATCH tokens: a batch that big routes
    to nearly every expert of a layer (gpt-oss-120b, 4 of 128: all but (1 - 4/128)^256 = 0.03% of them), so the
    CPU would stream every expert too, and the GPU's copy of them costs no more than that read."""
    return max(1, min(OFFLOAD_MAX_MIN_BATCH, n_expert * OFFLOAD_TOKENS_PER_EXPERT // max(1, n_expert_used)))


def has_host_experts(lw: dict[str, Weight]) -> bool:
    """Whether this layer's routed-expert matrices are host (numpy) arrays."""
    return all(n in lw and isinstance(lw[n].raw, np.ndarray) for n in EXPERT_TENSORS)


def check_host_experts(spec, cfg, lw: dict[str, Weight]) -> None:
    """UnsupportedPlacement unless this GPU layer's routed experts can stay in RAM: expert types and a GLU of the
    CPU's compiled MoE kernel (any routing: plain softmax on the device, the gated forms on the host)."""
    if spec.ffn_act not in _GLU_OP:
        raise UnsupportedPlacement(f"{cfg.arch}: routed experts in RAM need a GLU of the CPU's MoE kernel "
                                   f"({', '.join(_GLU_OP)}), not {spec.ffn_act}")
    if not moe_fusable(spec, lw):
        w = lw["ffn_gate_exps"]
        raise UnsupportedPlacement(f"{w.name}: routed experts of type {w.type_name} have no CPU MoE kernel; keep them on "
                             f"the GPU (drop the override or --n-cpu-moe)")


def file_type(type_name: str) -> str:
    """The GGML type whose GPU kernels an expert tensor's upload uses: the file's, for a layout the CPU repacked by
    moving bytes only (backends/repack.py repack_host_experts: put back in place on the GPU, kernels_gpu.unrepack)."""
    return BASE_TYPE[type_name] if type_name in BASE_TYPE and byte_permutation(BASE_TYPE[type_name]) is not None \
        else type_name


def dequantize_upload(rows, type_name: str, out, perms: dict) -> None:
    """fp16 `out` of uploaded expert rows (cupy uint8 (n, row_bytes)) of type_name, a file type or a permuting
    repacked layout (its bytes put back in place first; perms caches the permutations on the device by type)."""
    import cupy  # noqa: PLC0415

    from kernels_gpu.matmul import dequantize, gpu_kernel  # noqa: PLC0415
    from kernels_gpu.unrepack import unrepack_x8  # noqa: PLC0415

    base = file_type(type_name)
    if base != type_name:
        perm = perms.get(base)
        if perm is None:
            perm = perms[base] = cupy.asarray(byte_permutation(base))
        rows = unrepack_x8(rows, perm, gpu_kernel(base).type_size)
    dequantize(rows, base, dtype=np.float16, out=out)


def upload_dequantizer(gpu, w: Weight, perms: dict):
    """kernels_gpu.moe.prefill's dequantizer for the host expert tensor w: experts [e0, e1) uploaded through the
    GPU backend's pinned stager (one contiguous slice of the host tensor), then dequantized to fp16 into `out`."""

    def dequant(e0: int, e1: int, out) -> None:
        part = w.raw[e0:e1]  # (e1 - e0, n_out, row_bytes)
        dev = gpu.upload(Weight(w.name, w.type_name, part.shape, part)).raw
        dequantize_upload(dev.reshape(-1, part.shape[2]), w.type_name, out, perms)

    return dequant


@dataclass
class HostExpertStats:
    cpu_batches: int = 0  # batches whose experts the CPU ran
    cpu_tokens: int = 0
    cpu_seconds: float = 0.0  # wall time of the CPU's expert calls (the GPU waits meanwhile)
    gpu_batches: int = 0  # batches whose used experts were uploaded to the GPU
    uploaded_bytes: int = 0  # expert bytes uploaded for them
    last_upload_bytes: int = 0  # of the last such batch (--verbose)


class _Pinned:
    """Page-locked host buffers of one (layer, batch size): h, ids, weights (or the router's logits) in; the
    experts' sum out."""

    def __init__(self, n_tok: int, n_embd: int, n_used: int, n_expert: int) -> None:
        import cupy  # noqa: PLC0415

        def buf(shape, dtype):
            nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
            mem = cupy.cuda.alloc_pinned_memory(max(nbytes, 1))
            return mem, np.frombuffer(mem, dtype, int(np.prod(shape))).reshape(shape)

        self._mems = []
        for name, shape, dtype in (("h", (n_tok, n_embd), np.float32), ("ids", (n_tok, n_used), np.int32),
                                   ("w", (n_tok, n_used), np.float32), ("out", (n_tok, n_embd), np.float32),
                                   ("logits", (n_tok, n_expert), np.float32)):
            mem, arr = buf(shape, dtype)
            self._mems.append(mem)
            setattr(self, name, arr)


class HostExperts:
    """Runs the MoE FFN of GPU layers whose experts are in host memory (see the module docstring). One per
    GpuBackend; `min_batch` None: llama.cpp's rule per layer (offload_min_batch); 0: never upload experts
    (--no-op-offload: every batch's experts on the CPU)."""

    def __init__(self, gpu, min_batch: int | None = None) -> None:
        self.gpu = gpu
        self.min_batch = min_batch
        self.stats = HostExpertStats()
        self._pinned: dict[tuple[int, int], _Pinned] = {}  # (id of the layer's gate tensor, n_tok) -> buffers
        self._layers: dict[int, tuple] = {}  # id of the gate tensor -> (its Weight, the CPU kernel's arguments)
        self._spans: list[tuple[int, int]] = []  # host spans page-locked by register()
        self._ring = None  # kernels_gpu.transfer.CopyRing: batches' uploads straight from the locked pages
        self.cache = None  # backends.moe_cache.runtime.ExpertCache (--moe-cache): hot experts in GPU slots
        self._perms: dict = {}  # file type -> its repacked layout's byte permutation on the device (unrepack)

    def register(self, layers: list[dict[str, Weight]]) -> str:
        """Page-lock the host expert tensors of `layers` in place (those not locked yet), so a big batch's uploads
        read them by DMA at full PCIe speed, on a copy stream, ahead of their use (else each run is staged through
        pinned buffers by the host). Returns "" when registered, else why not. They stay locked (resident, as with
        --mlock) while this object lives."""
        import weakref  # noqa: PLC0415

        from kernels_gpu.transfer import register_spans, unregister_spans  # noqa: PLC0415

        arrays = [lw[n].raw for lw in layers for n in EXPERT_TENSORS
                  if isinstance(lw[n].raw, np.ndarray) and not self._locked(lw[n].raw)]
        if not arrays:
            return "" if self._spans else "no experts in RAM"
        spans, why = register_spans(arrays, self._spans)
        self._spans = self._spans + spans  # a second call (op offload's CPU layers) adds its own
        weakref.finalize(self, unregister_spans, spans, arrays)  # the arrays (the map) outlive the lock
        return why

    def _locked(self, a: np.ndarray) -> bool:
        """Whether the locked spans (disjoint) cover all of a's bytes."""
        lo, hi = int(a.ctypes.data), int(a.ctypes.data) + a.nbytes
        for s, e in sorted(self._spans):
            if s <= lo < e:
                lo = e
        return lo >= hi

    def threshold(self, cfg) -> int | None:
        if self.min_batch == 0:
            return None
        return self.min_batch or offload_min_batch(cfg.n_expert, cfg.n_expert_used)

    def __call__(self, spec, cfg, lw: dict[str, Weight], h):
        """The MoE FFN of the normed h (n_tok, n_embd) f32 on the GPU -> (n_tok, n_embd) f32 on the GPU.

        The tokens are routed on the device (kernels_gpu.moe.route_with: plain softmax and the gated forms, with
        the router's and the selection biases; GpuBackend.moe_layers). A routing the device kernels lack is routed
        on the host by blocks.route_layer inside the CPU's call (the router's logits cross instead of ids and
        weights), and its experts always run on the CPU."""
        from kernels_gpu import moe  # noqa: PLC0415

        h = self.gpu._dev(h)
        logits = self.gpu.matmul(lw["ffn_gate_inp"], h)
        ws = [lw[n] for n in EXPERT_TENSORS]
        limit = self.threshold(cfg)
        layer = self.gpu.moe_layers.get(spec, cfg, lw)
        if layer is None:
            return self._on_cpu(spec, cfg, lw, h, None, None, logits)
        ids, wts = moe.route_with(logits, layer.router)
        self.gpu.report_routing(lw, ids, wts)  # a routing trace's (GpuBackend.routing_observer), when one listens
        if limit is not None and h.shape[0] >= limit and all(moe.supported(file_type(w.type_name)) for w in ws):
            return self.run_uploaded(spec, lw, h, ids, wts, ws)
        return self._on_cpu(spec, cfg, lw, h, ids, wts)

    def run_uploaded(self, spec, lw, h, ids, wts, ws):
        """The experts of a routed batch (h, ids, wts on the GPU) run on the GPU, only those the batch uses uploaded
        from host memory: by DMA from the locked pages (register) ahead of the kernels, else staged through pinned
        buffers a run at a time. Also op offload's way for the CPU layers' experts (backends/offload.py)."""
        from kernels_gpu import moe  # noqa: PLC0415

        from hybrid.backends.gpu_moe import bias_rows  # noqa: PLC0415

        s = self.stats
        before = s.uploaded_bytes
        shapes = tuple(tuple(w.shape[1:]) for w in ws)
        # the experts' bias rows (gpt-oss) stay in RAM with them: a few MB a layer, uploaded for the batch
        biases = tuple(None if b is None else self.gpu.from_host(np.ascontiguousarray(b, dtype=np.float32))
                       for b in (bias_rows(lw, f"{n}.bias") for n in EXPERT_TENSORS))
        if all(self._locked(w.raw) for w in ws):
            out = self._prefill_direct(spec, h, ids, wts, ws, shapes, biases)
        else:  # staged through pinned buffers by the host, a run at a time
            out = moe.prefill(h, ids, wts, shapes,
                              tuple(self._counted(upload_dequantizer(self.gpu, w, self._perms), w) for w in ws),
                              spec.ffn_act,
                              biases=biases)
        s.gpu_batches += 1
        s.last_upload_bytes = s.uploaded_bytes - before
        return out

    def _prefill_direct(self, spec, h, ids, wts, ws, shapes, biases):
        """The experts of a routed batch copied from the locked pages on a CopyRing's stream, ahead of the kernels
        that read them: on the tensor cores (kernels_gpu.moe_upload: chunks of used experts, each copied into half
        a run's slot, two chunks in flight) where moe_mma takes the experts, else moe.prefill with each run of used
        experts in a slot, STAGING_SLOTS runs ahead of the dequantize-and-GEMM kernels (gate's runs, then up's,
        then down's). The slots take the VRAM the plan reserves (HOST_STAGING_SLOTS runs) either way."""
        from kernels_gpu import moe, moe_upload  # noqa: PLC0415

        per = [w.raw[0].nbytes for w in ws]
        need = staging_slot_bytes(shapes, max(per), ws[0].raw.shape[0])
        experts = tuple((w.raw, w.type_name) for w in ws)
        half = need // 2 // POOL_UNIT * POOL_UNIT  # six of these take no more than the plan's three runs
        if all(w.type_name == file_type(w.type_name) for w in ws) and not moe_upload.why_not(experts, half):
            ring = self._ring_of(half, 2 * STAGING_SLOTS)
            cached = None if self.cache is None else self.cache.resident(ws[0])  # its slots need no upload
            out, copied = moe_upload.prefill_uploaded(h, ids, wts, experts, spec.ffn_act, ring, biases,
                                                      cached=cached)
            self.stats.uploaded_bytes += copied
            return out
        ring = self._ring_of(need, STAGING_SLOTS)

        def prefetch(runs) -> None:
            ring.start([((i, e0), [(int(w.raw.ctypes.data) + e0 * per[i], (e1 - e0) * per[i])])
                        for i, w in enumerate(ws) for e0, e1, _, _ in runs])

        def dequant_of(i: int, w: Weight):
            row_bytes = w.raw.shape[2]

            def dequant(e0: int, e1: int, out) -> None:
                slot, view = ring.take((i, e0))
                dequantize_upload(view.reshape(-1, row_bytes), w.type_name, out, self._perms)
                ring.release(slot)
                self.stats.uploaded_bytes += (e1 - e0) * per[i]

            return dequant

        try:
            return moe.prefill(h, ids, wts, shapes, tuple(dequant_of(i, w) for i, w in enumerate(ws)), spec.ffn_act,
                               prefetch=prefetch, biases=biases)
        except BaseException:
            ring.reset()
            raise

    def _ring_of(self, slot_bytes: int, n_slots: int):
        """The CopyRing of big batches' uploads, (re)made when it lacks the slots asked for (one ring at a time:
        together the slots take the VRAM the plan reserves)."""
        from kernels_gpu.transfer import CopyRing  # noqa: PLC0415

        r = self._ring
        if r is None or r.slot_bytes < slot_bytes or r.n_slots != n_slots:
            self._ring = None
            self._ring = CopyRing(slot_bytes, n_slots)
        return self._ring

    def _counted(self, dequant, w: Weight):
        per_expert = w.raw[0].nbytes

        def run(e0: int, e1: int, out) -> None:
            dequant(e0, e1, out)
            self.stats.uploaded_bytes += (e1 - e0) * per_expert

        return run

    def _on_cpu(self, spec, cfg, lw, h, ids, wts, logits=None):
        """The CPU runs the experts: h and the routing (ids and wts, or the router's logits to route on the host)
        to pinned memory, a host break, the sum back to the GPU. With an expert cache (--moe-cache), a step it serves
        runs its hits on the GPU and only the misses here (backends/moe_cache/runtime.py)."""
        import cupy  # noqa: PLC0415

        row = None if self.cache is None or logits is not None else self.cache.row(lw, h.shape[0])
        if row is not None:
            return self.cache.run(self, spec, cfg, lw, h, ids, wts, row)
        n_tok, n_embd = h.shape
        args = self._cpu_args(spec, cfg, lw)
        key = (id(lw["ffn_gate_exps"]), n_tok)
        buf = self._pinned.get(key)
        if buf is None:
            buf = self._pinned[key] = _Pinned(n_tok, n_embd, cfg.n_expert_used, cfg.n_expert)
        stream = cupy.cuda.get_current_stream()
        d2h = cupy.cuda.runtime.memcpyDeviceToHost
        copies = [(h, buf.h)] + ([(cupy.ascontiguousarray(ids), buf.ids), (cupy.ascontiguousarray(wts), buf.w)]
                                 if logits is None else [(cupy.ascontiguousarray(logits), buf.logits)])
        for src, dst in copies:
            cupy.cuda.runtime.memcpyAsync(dst.ctypes.data, src.data.ptr, dst.nbytes, d2h, stream.ptr)
        route = None if logits is None else self._host_route(spec, cfg, lw)
        observer = self.gpu.routing_observer

        def experts() -> None:
            t0 = time.perf_counter()
            if route is not None:
                r_ids, r_w = route(buf.logits.copy())
                buf.ids[...], buf.w[...] = r_ids, r_w
                if observer is not None:
                    observer.routed(moe_layer(lw), r_ids, r_w)
            buf.out[...] = args(buf.h, buf.ids, buf.w)
            s = self.stats
            s.cpu_seconds += time.perf_counter() - t0
            s.cpu_batches += 1
            s.cpu_tokens += n_tok

        self.gpu.host_call(experts)
        out = cupy.empty((n_tok, n_embd), dtype=cupy.float32)
        cupy.cuda.runtime.memcpyAsync(out.data.ptr, buf.out.ctypes.data, buf.out.nbytes,
                                      cupy.cuda.runtime.memcpyHostToDevice, stream.ptr)
        return out

    def _cpu_args(self, spec, cfg, lw):
        """fn(h, ids int32, weights) -> the experts' weighted sum, on the CPU, for this layer."""
        return self._cached(lw, "experts", lambda: self._make_cpu_fn(spec, lw))

    def _host_route(self, spec, cfg, lw):
        """fn(logits host f32 (n, n_expert)) -> (ids, weights): blocks.route_layer with host copies of the layer's
        routing tensors (the router's bias, exp_probs_b), made once (the first, eager run of a decode step)."""
        return self._cached(lw, "route", lambda: self._make_route(spec, cfg, lw))

    def _cached(self, lw, what: str, make):
        gate = lw["ffn_gate_exps"]
        hit = self._layers.get((id(gate), what))
        if hit is None or hit[0] is not gate:
            hit = self._layers[(id(gate), what)] = (gate, make())
        return hit[1]

    @staticmethod
    def _make_route(spec, cfg, lw):
        from hybrid.model.arch.blocks import route_layer  # noqa: PLC0415

        host = {n: Weight(lw[n].name, lw[n].type_name, lw[n].shape, _host(lw[n].raw))
                for n in ("ffn_gate_inp.bias", "exp_probs_b.bias") if n in lw}
        return lambda logits: route_layer(spec, cfg, host, logits)

    @staticmethod
    def _make_cpu_fn(spec, lw):
        g, u, d = (_experts(lw[n]) for n in EXPERT_TENSORS)
        op = _GLU_OP[spec.ffn_act]
        biases = tuple(_bias_rows(lw, f"{n}.bias") for n in EXPERT_TENSORS)

        def run(h: np.ndarray, ids: np.ndarray, w: np.ndarray) -> np.ndarray:
            return cpu_moe_kernels.moe_experts_biased(numba.get_num_threads(), h, ids.astype(np.int64),
                                                      np.ascontiguousarray(w, dtype=np.float32), g, u, d, _EMPTY,
                                                      op, GELU_F16_TABLE, *biases)

        return run


def _host(raw) -> np.ndarray:
    """A tensor's data on the host (a GPU layer's small routing tensors were uploaded with it)."""
    return raw.get() if hasattr(raw, "get") and not isinstance(raw, np.ndarray) else np.asarray(raw)


def _bias_rows(lw, name: str) -> np.ndarray:
    """cpu_moe's per-expert bias rows (float32 (n_expert, n_out) read-only, or 0 rows), from the host."""
    if name not in lw:
        return _biases(lw, name)
    w = lw[name]
    return _biases({name: Weight(w.name, w.type_name, w.shape, _host(w.raw))}, name)
