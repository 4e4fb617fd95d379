"""The backend interface that `hybrid/model/arch/blocks.py`, the engine and the KV cache call, as typing.Protocols:
`Backend` (CpuBackend, GpuBackend, OffloadBackend), and the GPU-only extras `GraphDecoding` and `DeviceMemory`."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np

from hybrid.model.weights import Weight

# An activation array: numpy float32 on the CPU, cupy float32 on the current device for the GPU backends (which also
# take numpy input and move it over). Results are new arrays that support `+`, `*`, `.reshape`, `.shape` and slicing:
# blocks.py adds biases and residuals with `+` itself (there is no backend add/mul).
Array = Any


@runtime_checkable
class Backend(Protocol):
    """What every layer's backend provides; n = tokens in the batch, all activations float32."""

    name: str  # "cpu", "gpu", "gpu-offload": engine._move keeps arrays in place between two names starting "gpu"

    def matmul(self, w: Weight, x: Array) -> Array:
        """x (n, in) f32 -> (n, out) f32, straight from the raw quantized blocks of w (out, row_bytes)."""

    def matmuls(self, ws, x: Array) -> tuple:
        """Several weights times one x (q/k/v, gate/up) -> one (n, out_i) f32 result per weight, in order."""

    def get_rows(self, w: Weight, ids: np.ndarray) -> Array:
        """Embedding lookup: ids (n,) int64 on the host -> the dequantized rows (n, n_embd) f32."""

    def rms_norm(self, x: Array, w: np.ndarray, eps: float) -> Array:
        """x (n, d) f32, w (d,) f32 -> rms_norm(x) * w, (n, d) f32."""

    def add_rms_norm(self, x: Array, a: Array, w: np.ndarray, eps: float) -> tuple[Array, Array]:
        """x, a (n, d) f32, w (d,) f32 -> (x + a, rms_norm(x + a) * w): the residual add and the next norm."""

    def rms_norm_heads(self, x: Array, w: np.ndarray, eps: float) -> Array:
        """Per-head norm (QK-norm): x (n, n_head, hd) f32, w (hd,) f32 -> (n, n_head, hd) f32."""

    def rope(self, x: Array, positions: np.ndarray, n_rot: int, base: float, scale: float, mode: str,
             yarn: tuple | None = None) -> Array:
        """x (n, n_head, hd) f32 rotated at positions (n,) int32 (the first n_rot dims); mode "norm" or "neox";
        yarn (ext_factor, attn_factor, corr_lo, corr_hi) as ggml_rope_ext takes them, None for plain RoPE."""

    def scale(self, x: Array, s: float) -> Array:
        """x * s, same shape, f32."""

    def glu(self, gate: Array, up: Array, act: str) -> Array:
        """act(gate) * up, gate and up (n, n_ff) f32; act "silu" (SwiGLU), "gelu" (GeGLU) or "swiglu_oai" (gpt-oss's
        clamped form: min(gate, 7) * sigmoid(1.702 min(gate, 7)) * (clamp(up, -7, 7) + 1)) -> (n, n_ff) f32."""

    def new_kv_layer(self, n_ctx: int, n_head_kv: int, hd_k: int, hd_v: int, type_k: str, type_v: str):
        """One layer's KV storage (k, v uint8 (n_ctx, n_head_kv, row_bytes); .type_k/.type_v/.n_ctx/.nbytes)."""

    def kv_store(self, kv, il: int, k: Array, v: Array, positions: np.ndarray) -> None:
        """Store k (n, n_head_kv, hd_k) and v (n, n_head_kv, hd_v) f32 into kv.layers[il] at positions (n,) int32."""

    def attention(self, q: Array, kv, il: int, positions: np.ndarray, scale: float, n_swa: int,
                  sinks: Array | None = None) -> Array:
        """Causal attention of q (n, n_head, hd_k) f32 over kv.layers[il] -> (n, n_head, hd_v) f32 (n_swa: window);
        sinks (n_head,) f32 or None: one logit per query head added to the softmax's denominator (no value)."""

    def take_rows(self, x: Array, rows: np.ndarray) -> Array:
        """x[rows] as a contiguous (len(rows), d) f32 array; rows is a host int64 array (MoE token groups)."""

    def zeros(self, shape: tuple[int, ...]) -> Array:
        """A new float32 array of zeros of `shape` on this backend's device."""

    def scatter_add(self, out: Array, rows: np.ndarray, y: Array, weights: np.ndarray) -> None:
        """In place: out[rows] += weights[:, None] * y; rows (k,) int64 distinct, y (k, d) f32, weights (k,) f32."""

    def to_host(self, x: Array) -> np.ndarray:
        """This backend's array -> numpy (a numpy array passes through)."""

    def from_host(self, x: np.ndarray) -> Array:
        """numpy -> this backend's array (one of its own passes through)."""

    def fused_qk_norm_rope(self, q: Array, k: Array, wq: Array, wk: Array, eps: float, positions: np.ndarray,
                           n_rot: int, base: float, scale: float, mode: str, yarn: tuple | None = None):
        """(rope(rms_norm_heads(q, wq)), rope(rms_norm_heads(k, wk))) in one call (QK-norm models), or with wq and
        wk None (no QK-norm) (rope(q), rope(k)); None where this backend has no fused form (attention_block then
        runs the ops one by one)."""

    def fused_attention(self, spec, cfg, lw: dict[str, Weight], il: int, x: Array, positions: np.ndarray, kv):
        """layer_forward's attention part of x (n, n_embd) f32 (what is added to x) in one fused call, or None
        where this backend has no fused form for the layer (GPU backends: always None)."""

    def fused_ffn(self, spec, cfg, lw: dict[str, Weight], x: Array, a: Array):
        """The rest of layer_forward after the attention part a (x + a, the FFN, the residual) -> (n, n_embd) f32,
        or None where this backend has no fused form (GPU backends: always None)."""

    def fused_moe(self, spec, cfg, lw: dict[str, Weight], h: Array, residual: Array | None = None):
        """The MoE FFN of the normed h (n, n_embd) f32 (routing, the selected experts, their weighted sum) ->
        (n, n_embd) f32 in compiled kernels with no Python loop over experts, or None where this backend has no
        fused form for the layer or the batch (blocks.moe_ffn then runs the op-by-op reference). residual: when
        given ((n, n_embd) f32), the result is residual + the weighted sum."""


@runtime_checkable
class GraphDecoding(Protocol):
    """Optional (GpuBackend only): one decode token through a run of layers as a CUDA graph. The engine tests for it
    with hasattr(be, "decode_step"); backends without it run the layers eagerly."""

    use_graphs: bool  # False: eager launches (reported by graph_report)

    def decode_step(self, key, kv_layers: dict, fn, x: np.ndarray, position: int, paged=None,
                    beside=None, head: int | None = None) -> np.ndarray:
        """fn(x (1, n_embd) f32, positions (1,) int32, both on the device) over the layers kv_layers covers;
        captured once per hashable key and replayed; beside() runs on the host while the GPU computes; returns
        fn's result on the host (its first `head` values, flat, where head is given)."""

    def logits_and_ids(self, logits):
        """A decode step's output: each row's argmax id, then the logits, one flat float32 array."""

    def gather_rows(self, x, rows):
        """x[rows] (rows: device int32 indices, read when the kernel runs): a mixed batch's rows for the output."""

    def captures_products(self, type_names, n_rows: int) -> bool:
        """Whether products of n_rows rows by weights of these GGML types can join a captured step (a mixed batch
        runs through decode_step only then)."""

    def graph_report(self) -> str:
        """How decode steps ran: graphs captured and replayed, or eager launches and why."""

    @property
    def graph_fallback(self) -> bool:
        """True when some decode step had to run eagerly."""


@runtime_checkable
class DeviceMemory(Protocol):
    """Optional (GpuBackend only): placement on the device, called by Engine._offload and op offload."""

    device: Any  # the cupy.cuda.Device, used as a context manager
    # backends.host_experts.HostExperts: runs GPU layers whose routed experts stay in RAM (-ot, --n-cpu-moe); the
    # engine sets its min_batch (--no-op-offload: 0) and page-locks the experts (register); benches read its stats
    host_experts: Any

    def free_bytes(self) -> int:
        """Free device memory now, plus what the memory pool holds unused, in bytes."""

    def limit_memory(self, nbytes: int) -> None:
        """Cap the device memory pool at nbytes: past it allocations raise OutOfMemoryError."""

    def upload(self, weight: Weight) -> Weight:
        """A copy of weight on the device: matrices as raw uint8 blocks, 1-D tensors as float32."""

    def alloc_like(self, weight: Weight) -> Weight:
        """An uninitialized device buffer of weight's uploaded size (placeholder weights for `hybrid probe`)."""


@runtime_checkable
class RoutingObservable(Protocol):
    """Optional (CpuBackend, GpuBackend; OffloadBackend reads its GPU's): the routing trace's hook.
    Engine.observe_routing sets it on the backends that have it (hasattr) and clears it after; blocks.moe_ffn and the
    fused MoE forms tell it each MoE layer's routing."""

    routing_observer: Any  # a model.arch.moe.RoutingObserver, or None (the default: nothing recorded)


OPTIONAL_PROTOCOLS: tuple[type, ...] = (GraphDecoding, DeviceMemory, RoutingObservable)

__all__ = ["Array", "Backend", "DeviceMemory", "GraphDecoding", "OPTIONAL_PROTOCOLS", "RoutingObservable"]
