"""CpuBackend's fused MoE FFN: kernels_cpu.moe.moe_ffn with each MoE layer's expert weights, type codes and router
gathered once (`FusedMoE`), and which layers and batches it covers (`moe_fusable`)."""

from __future__ import annotations

import numba
import numpy as np

from kernels_cpu import moe, vec_dot_legacy
from kernels_cpu.activations import GELU_F16_TABLE
from kernels_cpu.fused_layer import FAM_LEGACY
from kernels_cpu.matmul import SMALL_BATCH_TOKENS, _kernel, gemm_min_tokens, matmul
from kernels_cpu.moe_route import route_topk

from hybrid.backends.cpu_fused import _FAMILY, _GLU_OP, _vec
from hybrid.model.arch.blocks import route_layer
from hybrid.model.arch.moe import fused_moe_ok, moe_layer
from hybrid.model.arch.spec import SHARED_EXPERT, ArchSpec

_EXPERTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
_WITH_MIN = (vec_dot_legacy.Q4_1, vec_dot_legacy.Q5_1)  # legacy kinds whose GEMM adds a numpy min term


def _read_only(a: np.ndarray) -> np.ndarray:
    """A plain read-only ndarray view, no copy (one array type: one compiled moe_ffn)."""
    v = np.asarray(a).view(np.ndarray)
    v.flags.writeable = False
    return v


def _experts(w) -> tuple[np.ndarray, int, int]:
    """(raw uint8 (n_expert, n_out, row_bytes) read-only, kind code, family) of a 3-D expert tensor."""
    kernel = _kernel(w.type_name)
    n_expert, n_out, row_bytes = w.raw.shape
    if row_bytes % kernel.type_size or n_out % kernel.row_group or not w.raw.flags.c_contiguous:
        raise ValueError(f"{w.name}: expected C-contiguous whole {w.type_name} blocks in groups of "
                         f"{kernel.row_group} rows, found raw {w.raw.shape}")
    fam, kind = _FAMILY[w.type_name]
    return _read_only(w.raw), kind, fam


def _empty_experts() -> tuple[np.ndarray, int, int]:
    """An expert weight of family 0: moe_ffn's absent second matrix of the down projection."""
    return _read_only(np.empty((0, 1, 1), dtype=np.uint8)), 0, 0


_EMPTY = _empty_experts()
_NO_LOGITS = np.empty((0, 0), dtype=np.float32)  # moe_ffn multiplies the router itself
_NO_ROUTER = _read_only(np.empty((0, 0), dtype=np.float32))  # logits given: the router is not read


def moe_fusable(spec: ArchSpec, lw) -> bool:
    """Whether a layer's MoE FFN has a fused form: a GLU of CpuBackend's, and host expert tensors of the
    integer-dot types (float experts, F16/BF16/F32, go op by op)."""
    if not spec.moe or spec.ffn_act not in _GLU_OP or not all(n in lw for n in _EXPERTS):
        return False
    ws = [lw[n] for n in _EXPERTS]
    return all(w.type_name in _FAMILY and isinstance(w.raw, np.ndarray) and w.raw.ndim == 3 for w in ws)


def _biases(lw, name: str) -> np.ndarray:
    """A per-expert bias tensor (gpt-oss) as read-only float32 (n_expert, n_out), or of 0 rows where absent."""
    w = lw.get(name)
    if w is None:
        return _NO_BIAS
    return _read_only(np.ascontiguousarray(w.f32(), dtype=np.float32))


_NO_BIAS = _read_only(np.empty((0, 0), dtype=np.float32))


class _MoeLayer:
    """One MoE layer's fixed arguments of moe_ffn and moe_ffn_half."""

    def __init__(self, spec, cfg, lw) -> None:
        # plain softmax routing without biases: routed in compiled code (moe_route); else on the host as
        # blocks.route_layer, then the compiled experts (with their biases, gpt-oss)
        self.plain = fused_moe_ok(spec, cfg, lw)
        self.biases = tuple(_biases(lw, f"{n}.bias") for n in _EXPERTS)
        self.gate, self.up, self.down = (_experts(lw[n]) for n in _EXPERTS)
        self.router = lw["ffn_gate_inp"]
        f32 = self.router.type_name == "F32" and self.router.raw.ndim == 2
        # an F32 router is multiplied inside moe_ffn for few tokens; any other goes through kernels_cpu.matmul
        self.router_f32 = _read_only(self.router.raw.view(np.float32)) if f32 else None
        # moe_ffn_half's norm (plain routing only; a layer whose FFN norm has another name has no one-call form)
        self.ffn_norm = _vec(lw, "ffn_norm", cfg.n_embd) if self.plain and "ffn_norm" in lw else None
        self.eps = np.float32(cfg.f_norm_rms_eps)
        # Q4_1/Q5_1 experts: a group of SMALL_BATCH_TOKENS tokens would need the GEMM's numpy min term
        self.batch_ok = not any(fam == FAM_LEGACY and kind in _WITH_MIN
                                for _, kind, fam in (self.gate, self.up, self.down))


class FusedMoE:
    """Runs the MoE FFNs of a CpuBackend's layers (see `moe_fusable`)."""

    def __init__(self) -> None:
        self._layers: dict[int, tuple[object, _MoeLayer | None]] = {}  # id(lw) -> (lw, its arguments or None)

    def _layer(self, spec: ArchSpec, cfg, lw) -> _MoeLayer | None:
        hit = self._layers.get(id(lw))
        if hit is None or hit[0] is not lw:
            hit = self._layers[id(lw)] = (lw, _MoeLayer(spec, cfg, lw) if moe_fusable(spec, lw) else None)
        return hit[1]

    def __call__(self, spec: ArchSpec, cfg, lw, h: np.ndarray, observer=None) -> np.ndarray | None:
        """blocks.moe_ffn of the normed h (n_tok, n_embd) f32 -> (n_tok, n_embd) f32, or None where the layer or
        the batch has no fused form. observer (a model.arch.moe.RoutingObserver) hears the routing."""
        L = self._layer(spec, cfg, lw)
        n_tok = h.shape[0]
        if L is None or n_tok == 0 or (n_tok >= SMALL_BATCH_TOKENS and not L.batch_ok):
            return None
        h = np.ascontiguousarray(h, dtype=np.float32)
        if observer is not None or not L.plain:
            return self._two_steps(spec, cfg, lw, L, h, observer)
        if n_tok < gemm_min_tokens("F32") and L.router_f32 is not None:  # where matmul's F32 product is matmul_f32
            logits, router = _NO_LOGITS, L.router_f32  # the router's product inside moe_ffn
        else:
            logits = matmul(L.router.raw, L.router.type_name, h)  # (n_tok, n_expert)
            router = _NO_ROUTER
        return moe.moe_ffn(numba.get_num_threads(), h, logits, router, cfg.n_expert_used, spec.moe_norm_weights,
                           L.gate, L.up, L.down, _EMPTY, _GLU_OP[spec.ffn_act], GELU_F16_TABLE)

    def _two_steps(self, spec: ArchSpec, cfg, lw, L: _MoeLayer, h: np.ndarray, observer) -> np.ndarray:
        """The routing, then the experts, in two calls: for routing other than plain softmax (blocks.route_layer on
        the host, as the op-by-op path), and while an observer listens (it hears the ids and weights the routing
        produced). kernels_cpu.matmul's router product (moe_ffn's own for few tokens), the routing, then
        moe_experts_biased on them: the same numbers as moe_ffn or the op-by-op path, bit for bit."""
        logits = matmul(L.router.raw, L.router.type_name, h)  # (n_tok, n_expert)
        if L.plain:
            ids, weights = route_topk(logits, cfg.n_expert_used, spec.moe_norm_weights)
        else:
            ids, weights = route_layer(spec, cfg, lw, logits)
            ids = np.ascontiguousarray(ids, dtype=np.int64)
            weights = np.ascontiguousarray(weights, dtype=np.float32)
        if observer is not None:
            observer.routed(moe_layer(lw), ids, weights)
        return moe.moe_experts_biased(numba.get_num_threads(), h, ids, weights, L.gate, L.up, L.down, _EMPTY,
                                      _GLU_OP[spec.ffn_act], GELU_F16_TABLE, *L.biases)

    def ffn_half(self, spec: ArchSpec, cfg, lw, x: np.ndarray, a: np.ndarray, observer=None) -> np.ndarray | None:
        """The rest of blocks.layer_forward after the attention part a (x + a, its norm, the MoE FFN, the residual)
        in one compiled call for a batch of few tokens and an F32 router; else None (blocks.layer_forward then
        runs it, and the MoE FFN through __call__; so too while an observer listens: the call hides its routing)."""
        tail = self.half_args(spec, cfg, lw, x.shape[0], observer)
        if tail is None:
            return None
        return moe.moe_ffn_half(numba.get_num_threads(), np.ascontiguousarray(x, dtype=np.float32),
                                np.ascontiguousarray(a, dtype=np.float32), *tail)

    def half_args(self, spec: ArchSpec, cfg, lw, n_tok: int, observer=None) -> tuple | None:
        """moe_ffn_half's arguments after a (moe_layer's after the attention part's) for a batch of n_tok tokens, or
        None where it has no one-call form (see ffn_half)."""
        L = self._layer(spec, cfg, lw)
        if (L is None or L.ffn_norm is None or L.router_f32 is None or not 0 < n_tok < SMALL_BATCH_TOKENS
                or SHARED_EXPERT[0] in lw or observer is not None):
            return None  # (a shared expert is blocks.moe_ffn's to add)
        return (L.eps, L.ffn_norm, L.router_f32, cfg.n_expert_used, spec.moe_norm_weights, L.gate, L.up, L.down,
                _EMPTY, _GLU_OP[spec.ffn_act], GELU_F16_TABLE)
