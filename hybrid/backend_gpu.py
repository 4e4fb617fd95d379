"""GpuBackend: the backend interface of `hybrid/arch/blocks.py` on CUDA kernels (kernels_gpu) over quantized blocks.

Arrays are cupy float32 on the current device. A layer's weights are copied to the device once with `upload`
(raw quantized bytes as they are, 1-D weights as float32); `from_host` / `to_host` move activations through
pinned buffers. Imported lazily by the engine: importing this module needs no CuPy, constructing one does.
"""

from __future__ import annotations

import numpy as np

from gguf_io import quant_spec

from .weights import Weight


class GpuBackend:
    name = "gpu"

    def __init__(self, device: int = 0) -> None:
        import cupy  # noqa: PLC0415

        from kernels_gpu.transfer import PinnedStager  # noqa: PLC0415

        self._cupy = cupy
        self.device = cupy.cuda.Device(device)
        self.device.use()
        self._stager = PinnedStager()
        self._pos_key: bytes | None = None  # positions of the last call, on the device
        self._pos_dev = None

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

    def _positions(self, positions: np.ndarray):
        """positions (n,) -> cupy int32, re-used while the same positions come back (4 ops per layer use them)."""
        if isinstance(positions, self._cupy.ndarray):
            return self._cupy.ascontiguousarray(positions, dtype=self._cupy.int32)
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
        from kernels_gpu.matmul import matmul  # noqa: PLC0415

        if not isinstance(w.raw, self._cupy.ndarray):
            raise ValueError(f"weight {w.name} is not on the GPU: GpuBackend.upload it first")
        return matmul(w.raw, w.type_name, self._dev(x))

    def get_rows(self, w: Weight, ids):
        """Embedding lookup: dequantize only the requested rows -> (n, n_embd) f32 (on the GPU when w is)."""
        ids = np.asarray(ids, dtype=np.int64)
        if not isinstance(w.raw, self._cupy.ndarray):
            return quant_spec(w.type_name).dequantize(w.raw[ids])
        from kernels_gpu.matmul import dequantize  # noqa: PLC0415

        return dequantize(w.raw, w.type_name, rows=self._cupy.asarray(ids.astype(np.int32)))

    def rms_norm(self, x, w, eps: float):
        from kernels_gpu import ops  # noqa: PLC0415

        return ops.rms_norm(self._dev(x), w, eps)

    def rms_norm_heads(self, x, w, eps: float):
        from kernels_gpu import ops  # noqa: PLC0415

        return ops.rms_norm_heads(self._dev(x), w, eps)

    def rope(self, x, positions, n_rot: int, base: float, scale: float, mode: str):
        from kernels_gpu import ops  # noqa: PLC0415

        return ops.rope(self._dev(x), self._positions(positions), n_rot, base, scale, mode)

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
        p = np.asarray(positions) if not isinstance(positions, self._cupy.ndarray) else positions.get()
        if p.size and (int(p.min()) < 0 or int(p.max()) >= layer.n_ctx):
            raise ValueError(f"kv_store: positions must lie in [0, {layer.n_ctx}), found [{p.min()}, {p.max()}]")
        kv_store(layer, self._positions(positions), self._dev(k), self._dev(v))

    def attention(self, q, kv, il: int, positions, scale: float, n_swa: int):
        from kernels_gpu.attention import attention  # noqa: PLC0415

        p = np.asarray(positions) if not isinstance(positions, self._cupy.ndarray) else positions.get()
        if p.size and int(p.min()) < 0:
            raise ValueError(f"attention: positions must be >= 0, found {p.min()}")
        n_kv = int(p.max()) + 1 if p.size else 0
        return attention(self._dev(q), kv.layers[il], self._positions(positions), n_kv, scale, n_swa)

    def take_rows(self, x, rows: np.ndarray):
        """x[rows] as a contiguous (len(rows), n) cupy array; rows is a host int64 array."""
        return self._cupy.ascontiguousarray(x[self._cupy.asarray(rows)])

    def zeros(self, shape: tuple[int, ...]):
        return self._cupy.zeros(shape, dtype=self._cupy.float32)

    def scatter_add(self, out, rows: np.ndarray, y, weights: np.ndarray) -> None:
        """out[rows] += weights[:, None] * y (rows are distinct)."""
        cp = self._cupy
        out[cp.asarray(rows)] += cp.asarray(weights, dtype=cp.float32)[:, None] * y

    def to_host(self, x) -> np.ndarray:
        """cupy -> numpy (a numpy array passes through)."""
        if isinstance(x, np.ndarray):
            return x
        return self._stager.to_host(x)

    def from_host(self, x):
        """numpy -> cupy through a pinned buffer (a cupy array passes through)."""
        if isinstance(x, self._cupy.ndarray):
            return x
        return self._stager.to_device(np.asarray(x))
