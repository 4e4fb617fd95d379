"""CpuBackend's fused layers: a layer of a few tokens in two compiled calls (kernels_cpu.fused_layer's
attention_half and ffn_half), with each layer's weights, type codes and norms gathered once."""

from __future__ import annotations

import numba
import numpy as np

from gguf_io import ModelConfig
from kernels_cpu import fused_layer
from kernels_cpu.activations import GELU_F16_TABLE
from kernels_cpu.attention import _heads_per_item
from kernels_cpu.kv_cache import F16_TO_F32, cache_rows, check_blocks, kernel_table, kv_type_code, kv_views
from kernels_cpu.matmul import _EMPTY_W, _EMPTY_Y, _INT_FAMILIES, SMALL_BATCH_TOKENS, _kernel, _prepare
from kernels_cpu.rope import ROPE_MODES

from hybrid.model.arch.blocks import rope_params
from hybrid.model.arch.spec import ArchSpec

_FAMILY = {name: (fused_layer.FAM_LEGACY if fam == "Q8_0" else fused_layer.FAM_K, code)
           for fam, (codes, _) in _INT_FAMILIES.items() for name, code in codes.items()}
_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output")
_FFN_MATRICES = ("ffn_gate", "ffn_up", "ffn_down")
_GLU_OP = {"silu": 0, "gelu": 2, "swiglu_oai": 3}  # gelu through ggml's fp16 table, as CpuBackend.glu
_NONE = np.zeros(1, dtype=np.float32)  # an absent norm or bias (never read)
_NONE.flags.writeable = False


def _vec(lw, name: str, n: int) -> np.ndarray:
    """A norm or bias vector as a read-only float32 array (one array type: one compiled attention_half)."""
    w = np.ascontiguousarray(lw[name].raw, dtype=np.float32).reshape(-1).view()
    if w.shape[0] != n:
        raise ValueError(f"{name}: expected {n} values, found {w.shape[0]}")
    w.flags.writeable = False
    return w


def _matrix(w) -> tuple[np.ndarray, int, int]:
    """(raw blocks as a read-only plain ndarray, family, kind code) of a matrix, checked as matmul checks it."""
    kernel = _kernel(w.type_name)
    n_in = w.raw.shape[-1] // kernel.type_size * kernel.block_size
    _, raw, _, _ = _prepare(w.raw, w.type_name, np.empty((1, n_in), dtype=np.float32))
    return (raw, *_FAMILY[w.type_name])


def _mats(*mats) -> tuple:
    """int_dots' ((w0, w1, w2), kinds, fams) for up to three _matrix results; unused slots are empty (family 0)."""
    pad = [(_EMPTY_W, 0, 0)] * (3 - len(mats))
    ws, fams, kinds = zip(*mats, *pad)
    return tuple(ws), np.array(kinds, dtype=np.int64), np.array(fams, dtype=np.int64)


class _Layer:
    """One layer's fixed arguments of attention_half / ffn_half."""

    def __init__(self, spec: ArchSpec, cfg: ModelConfig, lw, il: int) -> None:
        base, fscale, n_swa = rope_params(cfg, il)
        kq_scale, q_scale = cfg.f_attention_scale, 1.0
        if not spec.q_scale_in_attention:  # gemma3 scales q before attention and uses a unit kq scale
            q_scale, kq_scale = kq_scale, 1.0
        self.rope = (cfg.n_rot, base, fscale)
        self.scales = np.float32(q_scale), np.float32(kq_scale), int(n_swa)
        self.eps = np.float32(cfg.f_norm_rms_eps)
        q, k, v, o = (_matrix(lw[n]) for n in _MATRICES)
        self.qkv, self.out_proj = _mats(q, k, v), _mats(o)
        n_q, n_kv = cfg.n_head * cfg.n_embd_head_k, cfg.n_head_kv * cfg.n_embd_head_k
        n_v = cfg.n_head_kv * cfg.n_embd_head_v
        self.biases = tuple(_vec(lw, f"{t}.bias", n) if spec.qkv_bias else _NONE
                            for t, n in (("attn_q", n_q), ("attn_k", n_kv), ("attn_v", n_v)))
        hd = cfg.n_embd_head_k
        self.q_norm = _vec(lw, "attn_q_norm", hd) if spec.qk_norm else _NONE
        self.k_norm = _vec(lw, "attn_k_norm", hd) if spec.qk_norm else _NONE
        self.attn_norm = _vec(lw, "attn_norm", cfg.n_embd)
        self.post_attn = _vec(lw, "post_attention_norm", cfg.n_embd) if spec.sandwich_norm else _NONE
        self.ffn = None  # gate_up, down, ffn_norm, post_ffw: where the FFN is fusable too
        if ffn_fusable(spec, lw):
            gate, up, down = (_matrix(lw[n]) for n in _FFN_MATRICES)
            self.ffn = (_mats(gate, up), _mats(down), _vec(lw, "ffn_norm", cfg.n_embd),
                        _vec(lw, "post_ffw_norm", cfg.n_embd) if spec.sandwich_norm else _NONE)


def fusable(spec: ArchSpec, lw, n_tok: int) -> bool:
    """Whether the attention part of a layer of n_tok tokens can take the fused path: a decode-sized batch (below
    SMALL_BATCH_TOKENS: the integer dots), q, k, v and the output projection of integer-dot types, and neither attention
    sinks nor an output bias (gpt-oss: attention_half has neither)."""
    if not 0 < n_tok < SMALL_BATCH_TOKENS or spec.attn_sinks or spec.o_bias or spec.mla:
        return False  # (an MLA layer has no attn_q/k/v: deepseek2's decode on the CPU goes op by op)
    return all(n in lw and lw[n].type_name in _FAMILY and lw[n].raw.ndim == 2 for n in _MATRICES)


def ffn_fusable(spec: ArchSpec, lw) -> bool:
    """Whether a layer's FFN can take the fused path too (on top of `fusable`): dense, a GLU of CpuBackend's, and
    gate/up/down of integer-dot types."""
    if spec.moe or spec.ffn_act not in _GLU_OP:
        return False
    return all(lw[n].type_name in _FAMILY and lw[n].raw.ndim == 2 for n in _FFN_MATRICES)


class FusedLayers:
    """Runs fusable layers (see `fusable`, `ffn_fusable`) for a CpuBackend; the caller checks `fusable`."""

    def __init__(self) -> None:
        self._layers: dict[int, tuple[object, _Layer]] = {}  # id(lw) -> (lw, its arguments)
        # what every layer of an eval step shares (positions checked and converted, n_kv, threads, heads per
        # attention work item), and the views of the last KV cache's layers: Python between the compiled calls
        # runs slowly after the weights' streams have swept the caches, so it is done once, not per layer
        self._step: tuple = ()
        self._kv, self._kv_views = None, {}

    def _layer(self, spec, cfg, lw, il) -> _Layer:
        hit = self._layers.get(id(lw))
        if hit is None or hit[0] is not lw:
            hit = self._layers[id(lw)] = (lw, _Layer(spec, cfg, lw, il))
        return hit[1]

    def prepare(self, spec, cfg, lw, il: int) -> None:
        """Gather layer il's arguments without running it (a ragged batch's attention runs op by op; ffn then
        finds them)."""
        self._layer(spec, cfg, lw, il)

    def _positions(self, cfg: ModelConfig, positions: np.ndarray, layer) -> tuple:
        """(positions int32, the rows they go to int64, n_kv, threads, heads per item) of a batch, checked against
        the cache layer's n_ctx (and a paged layer's blocks: the rows through its table, shared by every layer)."""
        pos = np.ascontiguousarray(positions, dtype=np.int32).reshape(-1)
        n_threads = numba.get_num_threads()  # in the key: `hybrid bench -t 1,2` changes it between steps
        n_ctx = layer.n_ctx
        key = (pos.tobytes(), n_ctx, n_threads, None if layer.table is None else layer.table.tobytes())
        if self._step and self._step[0] == key:
            return self._step[1]
        if pos.min() < 0 or pos.max() >= n_ctx:
            bad = pos[(pos < 0) | (pos >= n_ctx)][0]
            raise ValueError(f"kv_store: positions must lie in [0, {n_ctx}), found {bad}")
        n_kv = int(pos.max()) + 1
        check_blocks(layer, n_kv)
        shared = (pos, cache_rows(layer, pos.astype(np.int64)), n_kv, n_threads,
                  _heads_per_item(pos.shape[0], cfg.n_head_kv, cfg.n_head))
        self._step = (key, shared)
        return shared

    def _views(self, kv, il: int) -> tuple:
        """(k views, v views, k type code, v type code, the layer, (table, bs)) of layer il of the KV cache kv."""
        if self._kv is not kv:
            self._kv, self._kv_views = kv, {}
        layer = kv.layers[il]
        hit = self._kv_views.get(il)
        if hit is None or hit[0] is not layer:
            hit = self._kv_views[il] = (layer, (*kv_views(layer.k, layer.type_k),), (*kv_views(layer.v, layer.type_v),),
                                        kv_type_code(layer.type_k), kv_type_code(layer.type_v), layer,
                                        kernel_table(layer))
        return hit[1:]

    def attention(self, spec: ArchSpec, cfg: ModelConfig, lw, il: int, x: np.ndarray, positions: np.ndarray, kv,
                  rope_tables) -> np.ndarray:
        """The attention part of blocks.layer_forward of x (n_tok, n_embd) f32 (what it adds to x), bit for bit;
        rope_tables(positions, n_rot, base, scale) gives the backend's cached cos/sin tables."""
        n_threads, cos, sin, n_rot, pos, pos64, n_kv, hpi, k_views, v_views, code_k, code_v = self.step_args(
            spec, cfg, lw, il, positions, kv, rope_tables)
        (eps, attn_norm, qkv, out_proj, empty_w, empty_y, biases, has_bias, q_norm, k_norm, has_qk_norm, n_head,
         n_head_kv, hd_k, hd_v, neox, q_scale, has_q_scale, kq_scale, n_swa, lut) = self.layer_args(spec, cfg, lw, il)
        L = self._layer(spec, cfg, lw, il)
        table, bs = self._views(kv, il)[5]
        return fused_layer.attention_half(
            n_threads, np.ascontiguousarray(x, dtype=np.float32), eps, attn_norm, qkv, out_proj, empty_w, empty_y,
            biases, has_bias, q_norm, k_norm, has_qk_norm, n_head, n_head_kv, hd_k, hd_v, cos, sin, n_rot, neox,
            q_scale, has_q_scale, k_views, v_views, code_k, code_v, pos, pos64, n_kv, kq_scale, n_swa, hpi, lut,
            table, bs, L.post_attn, spec.sandwich_norm)

    def step_args(self, spec: ArchSpec, cfg: ModelConfig, lw, il: int, positions: np.ndarray, kv,
                  rope_tables) -> tuple:
        """What attention_half's arguments take from the batch and the cache: (threads, cos, sin, n_rot, positions
        int32, the rows they go to int64, n_kv, heads per item, k views, v views, k type code, v type code)."""
        L = self._layer(spec, cfg, lw, il)
        k_views, v_views, code_k, code_v, layer, _ = self._views(kv, il)
        pos, pos64, n_kv, n_threads, hpi = self._positions(cfg, positions, layer)
        tables = rope_tables(pos, *L.rope)
        return n_threads, tables.cos, tables.sin, tables.n_rot, pos, pos64, n_kv, hpi, k_views, v_views, code_k, code_v

    def layer_args(self, spec: ArchSpec, cfg: ModelConfig, lw, il: int) -> tuple:
        """attention_half's arguments of layer il that no batch changes (kernels_cpu.moe.moe_layer's order, from
        eps to the f16 table; the post-attention norm left out)."""
        L = self._layer(spec, cfg, lw, il)
        if cfg.rope_type not in ROPE_MODES:
            raise ValueError(f"rope: mode must be one of {sorted(ROPE_MODES)}, found {cfg.rope_type!r}")
        q_scale, kq_scale, n_swa = L.scales
        return (L.eps, L.attn_norm, L.qkv, L.out_proj, _EMPTY_W, _EMPTY_Y, L.biases, spec.qkv_bias, L.q_norm, L.k_norm,
                spec.qk_norm, cfg.n_head, cfg.n_head_kv, cfg.n_embd_head_k, cfg.n_embd_head_v, cfg.rope_type == "neox",
                q_scale, not spec.q_scale_in_attention, kq_scale, n_swa, F16_TO_F32)

    def ffn(self, spec: ArchSpec, cfg: ModelConfig, lw, x: np.ndarray, a: np.ndarray) -> np.ndarray | None:
        """The rest of blocks.layer_forward after the attention part a (x + a, the FFN, the residual), bit for bit;
        None where the layer's FFN is not fusable (ffn_fusable) or the batch is not (fusable)."""
        if not fusable(spec, lw, x.shape[0]):
            return None
        hit = self._layers.get(id(lw))  # the attention part made it (no il here)
        if hit is None or hit[0] is not lw or hit[1].ffn is None:
            return None
        L = hit[1]
        gate_up, down, ffn_norm, post_ffw = L.ffn
        n_threads = self._step[1][3] if self._step else numba.get_num_threads()
        return fused_layer.ffn_half(n_threads, np.ascontiguousarray(x, dtype=np.float32),
                                    np.ascontiguousarray(a, dtype=np.float32), L.eps, ffn_norm, gate_up, down,
                                    _EMPTY_W, _EMPTY_Y, _GLU_OP[spec.ffn_act], GELU_F16_TABLE, post_ffw,
                                    spec.sandwich_norm)
