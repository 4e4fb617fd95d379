"""OffloadBackend: a CPU-resident layer run on the GPU for one big batch (op offload, hybrid/backends/op_offload.py).

Every op is the GpuBackend's; the matrices are not on the GPU, so matmul multiplies pieces streamed from host
memory (the same kernels_gpu.matmul as a GPU-resident weight). The layer's KV cache stays in host memory: the
new K/V rows are stored there by the CPU (as a CPU layer stores them), and attention uploads the cells in use
to a transient GPU cache of the same layout for the GPU's attention kernel.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from hybrid.model.weights import Weight

CPU_ATTENTION_MAX_ROWS = 16  # a ragged batch of at most this many rows attends on the CPU (a decode batch)


class OffloadBackend:
    name = "gpu-offload"

    def __init__(self, gpu, cpu, weights) -> None:
        """gpu: GpuBackend; cpu: CpuBackend (the KV cache); weights: an OpOffload (pieces(w), piece(w, r0, r1))."""
        self.gpu, self.cpu, self._weights = gpu, cpu, weights

    @property
    def routing_observer(self):
        """The GPU's (blocks.moe_ffn's op-by-op routing asks the backend for it)."""
        return self.gpu.routing_observer

    def _dev(self, x):
        import cupy  # noqa: PLC0415

        return cupy.ascontiguousarray(self.gpu.from_host(x), dtype=cupy.float32)

    def matmul(self, w: Weight, x):
        """x (n, in) f32 -> (n, out) f32 on the GPU; w's rows stream from host memory piece by piece."""
        import cupy as cp  # noqa: PLC0415

        from kernels_gpu.matmul import matmul  # noqa: PLC0415

        if isinstance(w.raw, cp.ndarray):
            return self.gpu.matmul(w, x)
        x = self._dev(x)
        ranges = self._weights.pieces(w)
        if len(ranges) == 1:
            with self._weights.piece(w, *ranges[0]) as dev:
                return matmul(dev, w.type_name, x)
        y = cp.empty(x.shape[:-1] + (w.raw.shape[0],), dtype=cp.float32)
        for r0, r1 in ranges:
            with self._weights.piece(w, r0, r1) as dev:
                y[..., r0:r1] = matmul(dev, w.type_name, x)
        return y

    def matmuls(self, ws, x) -> tuple:
        """Several weights times one x (q/k/v, gate/up): each streams on its own, as matmul."""
        return tuple(self.matmul(w, x) for w in ws)

    def kv_store(self, kv, il: int, k, v, positions) -> None:
        """The new rows go to the layer's cache in host memory, quantized by the CPU as a CPU layer's are."""
        self.cpu.kv_store(kv, il, self.gpu.to_host(k), self.gpu.to_host(v), positions)

    def attend_seqs(self, kv, il: int, q, k, v, positions, scale: float, n_swa: int, sinks=None):
        """A decode batch's store and attention (a ragged batch of at most CPU_ATTENTION_MAX_ROWS rows) on the CPU,
        in the host cache itself: its queries, keys and values cross, not the sequences' caches. None (attend's
        per-sequence calls, uploading the cells) for bigger batches, whose attention is worth the GPU."""
        if q.shape[0] > CPU_ATTENTION_MAX_ROWS:
            return None
        host = self.gpu.to_host
        o = self.cpu.attend_seqs(kv, il, host(q), host(k), host(v), np.asarray(positions), scale, n_swa,
                                 None if sinks is None else host(sinks))
        return self.gpu.from_host(o)

    def attention(self, q, kv, il: int, positions, scale: float, n_swa: int, sinks=None):
        """Attention over the host cache: positions [0, max(positions)] uploaded as they are (same ggml rows; a paged
        cache's gathered through its table)."""
        layer = kv.layers[il]
        p = np.asarray(positions)
        extra = {} if sinks is None else {"sinks": sinks}  # no sinks: the calls as they always were
        if not self._gpu_attention(layer):  # head sizes the GPU kernel lacks: the CPU's attention
            if sinks is not None:
                extra["sinks"] = self.gpu.to_host(sinks)
            o = self.cpu.attention(self.gpu.to_host(q), kv, il, positions, scale, n_swa, **extra)
            return self.gpu.from_host(o)
        from kernels_cpu.kv_cache import cache_rows  # noqa: PLC0415
        from kernels_gpu.kv_cache import GpuKVCacheLayer  # noqa: PLC0415

        n_kv = int(p.max()) + 1 if p.size else 0
        rows = slice(0, n_kv) if layer.table is None else cache_rows(layer, np.arange(n_kv, dtype=np.int64))
        dev = GpuKVCacheLayer(layer.type_k, layer.type_v, layer.head_dim_k, layer.head_dim_v,  # positions' rows,
                              self.gpu.from_host(np.ascontiguousarray(layer.k[rows])),  # in order (paged:
                              self.gpu.from_host(np.ascontiguousarray(layer.v[rows])))  # gathered through the table)
        return self.gpu.attention(q, SimpleNamespace(layers={il: dev}), il, positions, scale, n_swa, **extra)

    @staticmethod
    def _gpu_attention(layer) -> bool:
        from kernels_gpu.attention import ATT_E  # noqa: PLC0415

        d = layer.head_dim_k
        return d == layer.head_dim_v and d % 32 == 0 and d // 32 in ATT_E

    def new_kv_layer(self, n_ctx: int, n_head_kv: int, hd_k: int, hd_v: int, type_k: str, type_v: str):
        return self.cpu.new_kv_layer(n_ctx, n_head_kv, hd_k, hd_v, type_k, type_v)

    # ---- the rest is the GPU's
    def get_rows(self, w: Weight, ids):
        return self.gpu.get_rows(w, ids)

    def rms_norm(self, x, w, eps: float):
        return self.gpu.rms_norm(x, w, eps)

    def add_rms_norm(self, x, a, w, eps: float):
        return self.gpu.add_rms_norm(x, a, w, eps)

    def rms_norm_heads(self, x, w, eps: float):
        return self.gpu.rms_norm_heads(x, w, eps)

    def rope(self, x, positions, n_rot: int, base: float, scale: float, mode: str, yarn: tuple | None = None):
        return self.gpu.rope(x, positions, n_rot, base, scale, mode, yarn)

    def fused_qk_norm_rope(self, q, k, wq, wk, eps: float, positions, n_rot: int, base: float, scale: float,
                           mode: str, yarn: tuple | None = None):
        return self.gpu.fused_qk_norm_rope(q, k, wq, wk, eps, positions, n_rot, base, scale, mode, yarn)

    def scale(self, x, s: float):
        return self.gpu.scale(x, s)

    def glu(self, gate, up, act: str):
        return self.gpu.glu(gate, up, act)

    def take_rows(self, x, rows: np.ndarray):
        return self.gpu.take_rows(x, rows)

    def zeros(self, shape: tuple[int, ...]):
        return self.gpu.zeros(shape)

    def scatter_add(self, out, rows: np.ndarray, y, weights: np.ndarray) -> None:
        self.gpu.scatter_add(out, rows, y, weights)

    def to_host(self, x) -> np.ndarray:
        return self.gpu.to_host(x)

    def from_host(self, x):
        return self.gpu.from_host(x)

    def fused_attention(self, spec, cfg, lw, il: int, x, positions: np.ndarray, kv) -> None:
        """No fused attention here: blocks.layer_forward runs the ops one by one."""
        return None

    def fused_ffn(self, spec, cfg, lw, x, a) -> None:
        """No fused FFN here either."""
        return None

    def fused_moe(self, spec, cfg, lw, h, residual=None):
        """The MoE FFN of a big batch as the GpuBackend's prefill (kernels_gpu.moe): the router streams as a matrix,
        routing runs on the GPU (every routing its kernels know: GpuBackend.moe_layers), and only the experts the
        batch uses are uploaded from host memory (HostExperts.run_uploaded), a run of experts at a time, with their
        bias rows where they have them. None for float experts (no id kernels) and for a GLU or routing
        the device lacks (blocks.moe_ffn runs those op by op)."""
        from kernels_gpu import moe  # noqa: PLC0415

        layer = self.gpu.moe_layers.get(spec, cfg, lw)
        if layer is None:
            return None
        ws = [lw[n] for n in ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")]
        if not all(moe.supported(w.type_name) for w in ws[1:]):
            return None
        x = self._dev(h)
        ids, wts = moe.route_with(self.matmul(ws[0], x), layer.router)
        self.gpu.report_routing(lw, ids, wts)  # a routing trace's, when one listens
        # the used experts uploaded as for a GPU layer's experts in RAM: by DMA from their locked pages where the
        # engine page-locked them (Engine.load), else staged through pinned buffers
        out = self.gpu.host_experts.run_uploaded(spec, lw, x, ids, wts, ws[1:])
        return out if residual is None else self._dev(residual) + out
