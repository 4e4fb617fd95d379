"""CpuBackend: the Backend Protocol (`hybrid/backends/base.py`) on Numba kernels over quantized blocks."""

from __future__ import annotations

import numpy as np

from gguf_io import quant_spec
from kernels_cpu import activations, attention, get_rows, kv_cache, norm, rope
from kernels_cpu.matmul import matmul, matmuls

from hybrid.backends.cpu_fused import FusedLayers, fusable
from hybrid.backends.cpu_moe import FusedMoE
from hybrid.backends.cpu_whole import WholeLayers
from hybrid.model.weights import Weight


class CpuBackend:
    name = "cpu"
    paged_kv = True  # its attention reads a paged cache (hybrid.kv.paged) through the block table
    routing_observer = None  # a model.arch.moe.RoutingObserver (Engine.observe_routing): hears every MoE routing

    def __init__(self, fused: bool = True) -> None:
        # fused: run a decode layer in two compiled calls (cpu_fused); False: every op a call of its own
        self.fused = fused
        self._fused = FusedLayers()
        self._moe = FusedMoE()
        self._whole = WholeLayers(self._fused, self._moe)
        # cos/sin tables of the batch being evaluated, per (n_rot, base, scale): every layer rotates q and k at
        # the same positions, so they are computed once per eval step, not twice a layer; a new batch of
        # positions replaces them
        self._rope_positions = b""
        self._seq_rows: tuple = (None, None)  # (the ragged batch, its sequences' cache rows): attend_seqs' memo
        self._rope_tables: dict[tuple, rope.RopeTables] = {}

    def fused_attention(self, spec, cfg, lw: dict[str, Weight], il: int, x: np.ndarray, positions: np.ndarray, kv):
        """blocks.layer_forward's attention part in one compiled call, bit for bit, where the layer allows it
        (cpu_fused.fusable); else None."""
        if not (self.fused and fusable(spec, lw, x.shape[0])):
            return None
        if hasattr(kv, "seqs"):  # a ragged batch (kv.batch.KVBatch): attention per sequence, op by op; the layer's
            self._fused.prepare(spec, cfg, lw, il)  # arguments are still gathered so that its FFN half is fused
            return None
        return self._fused.attention(spec, cfg, lw, il, x, positions, kv, self._tables)

    def fused_layer(self, spec, cfg, lw: dict[str, Weight], il: int, x: np.ndarray, positions: np.ndarray, kv):
        """A whole MoE layer of blocks.layer_forward in one compiled call (cpu_whole: kernels_cpu.moe.moe_layer_at,
        attention_half then moe_ffn_half), bit for bit, where both halves have their one-call forms and the layer no
        sandwich norm; else None (layer_forward then runs fused_attention and fused_ffn)."""
        if not self.fused or self.routing_observer is not None:  # (an observer: the call hides its routing)
            return None
        return self._whole(spec, cfg, lw, il, x, positions, kv, self._tables)

    def fused_ffn(self, spec, cfg, lw: dict[str, Weight], x: np.ndarray, a: np.ndarray):
        """The rest of blocks.layer_forward after the attention part a (x + a, the FFN and the residual) in one
        compiled call, bit for bit, where the layer allows it (cpu_fused.ffn_fusable; MoE: cpu_moe); else None."""
        if not self.fused:
            return None
        if spec.moe:
            return self._moe.ffn_half(spec, cfg, lw, x, a, self.routing_observer)
        return self._fused.ffn(spec, cfg, lw, x, a)

    def fused_moe(self, spec, cfg, lw: dict[str, Weight], h: np.ndarray, residual: np.ndarray | None = None):
        """blocks.moe_ffn in compiled code (cpu_moe, kernels_cpu.moe): the routing, the selected experts and their
        weighted sum (plus residual where given), where the layer's experts have integer-dot types
        (cpu_moe.moe_fusable); else None."""
        if not self.fused:
            return None
        out = self._moe(spec, cfg, lw, h, self.routing_observer)
        return out if out is None or residual is None else residual + out

    def _tables(self, positions: np.ndarray, n_rot: int, base: float, scale: float,
                yarn: tuple | None = None) -> rope.RopeTables:
        """cos/sin of positions (int32), computed once per batch of positions and rope parameters (yarn: see
        rope)."""
        key_pos = positions.tobytes()
        if key_pos != self._rope_positions:
            self._rope_positions, self._rope_tables = key_pos, {}
        key = (n_rot, base, scale, yarn)
        tables = self._rope_tables.get(key)
        if tables is None:
            ext = {} if yarn is None else dict(ext_factor=yarn[0], attn_factor=yarn[1], corr_dims=yarn[2:])
            tables = self._rope_tables[key] = rope.rope_tables(positions, n_rot, base, scale, **ext)
        return tables

    def matmul(self, w: Weight, x: np.ndarray) -> np.ndarray:
        """x (n, in) f32 -> (n, out) f32, straight from the raw blocks of w."""
        return matmul(w.raw, w.type_name, np.ascontiguousarray(x, dtype=np.float32))

    def matmuls(self, ws, x: np.ndarray) -> tuple:
        """Several weights times one x (q/k/v, gate/up) -> one (n, out_i) f32 result per weight."""
        return tuple(matmuls([(w.raw, w.type_name) for w in ws], np.ascontiguousarray(x, dtype=np.float32)))

    def get_rows(self, w: Weight, ids: np.ndarray) -> np.ndarray:
        """Embedding lookup: dequantize only the requested rows -> (n, n_embd) f32 (compiled for the common types,
        kernels_cpu.get_rows; the numpy reference for the rest: the same values)."""
        ids = np.asarray(ids, dtype=np.int64)
        rows = get_rows.get_rows(w.raw, w.type_name, ids) if isinstance(w.raw, np.ndarray) else None
        return rows if rows is not None else quant_spec(w.type_name).dequantize(w.raw[ids])

    def rms_norm(self, x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
        return norm.rms_norm(np.ascontiguousarray(x, dtype=np.float32), w, eps)

    def add_rms_norm(self, x: np.ndarray, a: np.ndarray, w: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
        """(x + a, rms_norm(x + a) * w): the residual add and the next norm."""
        total = x + a
        return total, self.rms_norm(total, w, eps)

    def fused_qk_norm_rope(self, q, k, wq, wk, eps: float, positions, n_rot: int, base: float, scale: float,
                           mode: str, yarn: tuple | None = None) -> None:
        """None: the CPU's QK-norm models run the four ops (or the fused layer, kernels_cpu.fused_layer)."""
        return None

    def rms_norm_heads(self, x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
        return norm.rms_norm_heads(np.ascontiguousarray(x, dtype=np.float32), w, eps)

    def rope(self, x: np.ndarray, positions: np.ndarray, n_rot: int, base: float, scale: float, mode: str,
             yarn: tuple | None = None) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        positions = np.ascontiguousarray(positions, dtype=np.int32).reshape(-1)
        return rope.rope_apply(x, self._tables(positions, n_rot, base, scale, yarn), mode, out=x)

    def scale(self, x: np.ndarray, s: float) -> np.ndarray:
        return x * np.float32(s)

    def glu(self, gate: np.ndarray, up: np.ndarray, act: str) -> np.ndarray:
        if act == "silu":
            return activations.swiglu(gate, up)
        if act == "swiglu_oai":
            return activations.swiglu_oai(np.asarray(gate, dtype=np.float32), np.asarray(up, dtype=np.float32))
        # llama.cpp's CPU GELU goes through an fp16 lookup table; so do we, to track its outputs.
        return activations.geglu(gate, up, f16_table=True)

    def new_kv_layer(self, n_ctx: int, n_head_kv: int, hd_k: int, hd_v: int, type_k: str, type_v: str):
        return kv_cache.alloc_kv_layer(n_ctx, n_head_kv, hd_k, hd_v, type_k, type_v)

    def attend_seqs(self, kv, il: int, q: np.ndarray, k: np.ndarray, v: np.ndarray, positions: np.ndarray,
                    scale: float, n_swa: int, sinks: np.ndarray | None = None) -> np.ndarray:
        """kv_store and attention for a ragged batch (hybrid.kv.batch.KVBatch), each sequence through its own cache,
        in one call (blocks.attend's per-sequence loop without the wrappers' Python for each sequence)."""
        layers, spans = [s.cache.layers[il] for s in kv.seqs], [(s.start, s.end) for s in kv.seqs]
        if self._seq_rows[0] is not kv:  # the sequences' cache rows of this step, once for all the layers
            self._seq_rows = (kv, attention.seq_rows(layers, spans, positions))
        return attention.attention_seqs(q, k, v, layers, spans, positions, scale, n_swa, sinks, rows=self._seq_rows[1])

    def kv_store(self, kv, il: int, k: np.ndarray, v: np.ndarray, positions: np.ndarray) -> None:
        kv_cache.kv_store(kv.layers[il], positions, k, v)

    def attention(self, q: np.ndarray, kv, il: int, positions: np.ndarray, scale: float, n_swa: int,
                  sinks: np.ndarray | None = None) -> np.ndarray:
        if sinks is None:
            return attention.attention(np.ascontiguousarray(q), kv.layers[il], positions, scale, n_swa)
        return attention.attention(np.ascontiguousarray(q), kv.layers[il], positions, scale, n_swa,
                                   sinks=np.asarray(sinks, dtype=np.float32))

    def take_rows(self, x: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """x[rows] as a contiguous (len(rows), n) array; rows is a host int64 array."""
        return np.ascontiguousarray(x[rows])

    def zeros(self, shape: tuple[int, ...]) -> np.ndarray:
        return np.zeros(shape, dtype=np.float32)

    def scatter_add(self, out: np.ndarray, rows: np.ndarray, y: np.ndarray, weights: np.ndarray) -> None:
        """out[rows] += weights[:, None] * y (rows are distinct)."""
        out[rows] += weights[:, None] * y

    def to_host(self, x):
        return x

    def from_host(self, x: np.ndarray) -> np.ndarray:
        return x
