"""The argument types each CPU kernel is compiled for, and the kernels each one calls: what lets a first run compile
them ahead of their first call, several at a time and callees first, into Numba's on-disk cache.

Every caller passes one set of types per kernel (raw weights as read-only uint8 views, C-contiguous float32
activations, int64 sizes and codes), so each kernel here has one signature: the one its first call compiles.
`tests/test_compile.py` holds this table to what a warm-up really compiles.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from numba import types as nt


@dataclass(frozen=True)
class Kernel:
    """The compiled function `module.name` for the argument types `args`; `calls`: the keys of the kernels here
    that it calls (compiled first, its own compile then loads them from the cache)."""

    module: str
    name: str
    args: tuple
    calls: tuple[str, ...] = ()
    cost_s: float = 0.3  # about how long its compile takes, its callees cached (orders a parallel compile)

    @property
    def key(self) -> str:
        return f"{self.module.rsplit('.', 1)[-1]}.{self.name}"


def _c(dtype, ndim: int, readonly: bool = False) -> nt.Array:
    return nt.Array(dtype, ndim, "C", readonly=readonly)


I32, I64, F32, BOOL = nt.int32, nt.int64, nt.float32, nt.boolean
F32_1, F32_2, F32_3 = _c(F32, 1), _c(F32, 2), _c(F32, 3)
RO_F32_1 = _c(F32, 1, readonly=True)  # norm weights and biases (views of the file, or read-only copies)
RAW_1, RAW_2 = _c(nt.uint8, 1, readonly=True), _c(nt.uint8, 2, readonly=True)  # raw weight blocks
U8_1, U8_3 = _c(nt.uint8, 1), _c(nt.uint8, 3)
I8_1, I8_2, I16_1, I16_2 = _c(nt.int8, 1), _c(nt.int8, 2), _c(nt.int16, 1), _c(nt.int16, 2)
I32_1, I64_1 = _c(I32, 1), _c(I64, 1)
KV_VIEWS = (F32_3, _c(nt.uint16, 3), U8_3, _c(nt.int8, 3))  # kv_cache.kv_views of one cache tensor
MATS = nt.Tuple((nt.UniTuple(RAW_2, 3), I64_1, I64_1))  # fused_layer.int_dots' (weights, kinds, families)

_LEGACY_DOT2 = ("q4_0", "q5_0", "q8_0", "iq4_nl", "mxfp4")
_LEGACY_DOT2_MIN = ("q4_1", "q5_1")  # with block_q8_1's sums
_K_DOT2 = ("q4_k", "q6_k", "q5_k", "q2_k", "q3_k", "iq4_xs")
_IQ_DOT2 = ("iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m")  # vec_dot_iq, Q8_K activations
_ROWS_LEGACY = (I64, RAW_1, I64, I64, I64, I8_1, F32_1, F32_1, F32_1, I64)
_ROWS_K = (I64, RAW_1, I64, I64, I64, I8_1, F32_1, I16_1, F32_1, I64)
_DRIVER = (RAW_2, RAW_2, RAW_2, I64, I64, I64)  # three weights and their type codes
_TASKS = (I64, I64, I64, I64_1)  # rows per task, rows per block, threads, the task counter
_TOK4, _TOK2 = (I64,) * 4, (I64,) * 2  # the tokens of a multi-token dot


def _kernels() -> tuple[Kernel, ...]:
    k = [
        # integer dots, legacy types (Q8_0 activations)
        Kernel("kernels_cpu.legacy_x8", "dot8_q4_0_x8", (RAW_1, I64, I8_1, F32_1, I64, F32_1, I64)),
        Kernel("kernels_cpu.legacy_x8", "dot8_q5_0_x8", (RAW_1, I64, I8_1, F32_1, I64, F32_1, I64)),
        Kernel("kernels_cpu.mxfp4_x8", "dot8_mxfp4_x8", (RAW_1, I64, I8_1, F32_1, I64, F32_1, I64)),
        Kernel("kernels_cpu.q8_0_x8", "dot8_q8_0_x8", (RAW_1, I64, I8_1, F32_1, I64, F32_1, I64)),
        *(Kernel("kernels_cpu.vec_dot_legacy", f"dot2_{t}", (RAW_1, I64, I64, I8_1, F32_1, I64)) for t in _LEGACY_DOT2),
        *(Kernel("kernels_cpu.vec_dot_legacy", f"dot2_{t}", (RAW_1, I64, I64, I8_1, F32_1, F32_1, I64))
          for t in _LEGACY_DOT2_MIN),
        Kernel("kernels_cpu.vec_dot_legacy", "rows_dot", _ROWS_LEGACY,
               ("legacy_x8.dot8_q4_0_x8", "legacy_x8.dot8_q5_0_x8", "mxfp4_x8.dot8_mxfp4_x8", "q8_0_x8.dot8_q8_0_x8",
                *(f"vec_dot_legacy.dot2_{t}" for t in _LEGACY_DOT2 + _LEGACY_DOT2_MIN))),
        # 4 (and 2) tokens a pass over the weights, for small batches
        *(Kernel("kernels_cpu.legacy_x8", f"dot8x4_{t}_x8", (RAW_1, I64, I8_1, F32_1, *_TOK4, I64, F32_1, I64, I64))
          for t in ("q4_0", "q5_0")),
        *(Kernel("kernels_cpu.legacy_x8", f"dot8x2_{t}_x8", (RAW_1, I64, I8_1, F32_1, *_TOK2, I64, F32_1, I64, I64))
          for t in ("q4_0", "q5_0")),
        Kernel("kernels_cpu.q8_0_x8", "dot8x4_q8_0_x8", (RAW_1, I64, I8_1, F32_1, *_TOK4, I64, F32_1, I64, I64)),
        Kernel("kernels_cpu.q8_0_x8", "dot8x2_q8_0_x8", (RAW_1, I64, I8_1, F32_1, *_TOK2, I64, F32_1, I64, I64)),
        Kernel("kernels_cpu.vec_dot_legacy", "dot2x4_q8_0",
               (RAW_1, I64, I64, I8_1, F32_1, *_TOK4, I64, F32_1, I64, I64)),
        Kernel("kernels_cpu.vec_dot_legacy", "dot2x2_q8_0",
               (RAW_1, I64, I64, I8_1, F32_1, *_TOK2, I64, F32_1, I64, I64)),
        Kernel("kernels_cpu.vec_dot_legacy", "rows_dot4",
               (I64, RAW_1, I64, I64, I64, I8_1, F32_1, *_TOK4, F32_1, I64, I64),
               ("legacy_x8.dot8x4_q4_0_x8", "legacy_x8.dot8x4_q5_0_x8", "legacy_x8.dot8x2_q4_0_x8",
                "legacy_x8.dot8x2_q5_0_x8", "q8_0_x8.dot8x4_q8_0_x8", "q8_0_x8.dot8x2_q8_0_x8",
                "vec_dot_legacy.dot2x4_q8_0", "vec_dot_legacy.dot2x2_q8_0")),
        Kernel("kernels_cpu.vec_dot_legacy", "matmul_q8_0_act",
               (*_DRIVER, I8_2, F32_2, F32_2, F32_2, F32_2, F32_2, *_TASKS),
               ("vec_dot_legacy.rows_dot", "vec_dot_legacy.rows_dot4")),
        Kernel("kernels_cpu.act_quant", "quantize_q8_1_rows", (F32_2, I8_2, F32_2, F32_2)),
        # integer dots, K-quants (Q8_K activations)
        Kernel("kernels_cpu.q4_k_x8", "dot8_q4_k_x8", (RAW_1, I64, I8_1, F32_1, I16_1, I64, F32_1, I64)),
        Kernel("kernels_cpu.iq4_xs_x8", "dot8_iq4_xs_x8", (RAW_1, I64, I8_1, F32_1, I64, F32_1, I64)),
        *(Kernel("kernels_cpu.vec_dot_k", f"dot2_{t}", (RAW_1, I64, I64, I8_1, F32_1, I16_1, I64)) for t in _K_DOT2),
        *(Kernel("kernels_cpu.vec_dot_iq", f"dot2_{t}", (RAW_1, I64, I64, I8_1, F32_1, I16_1, I64)) for t in _IQ_DOT2),
        Kernel("kernels_cpu.vec_dot_iq", "rows_dot", _ROWS_K, tuple(f"vec_dot_iq.dot2_{t}" for t in _IQ_DOT2)),
        Kernel("kernels_cpu.vec_dot_k", "rows_dot", _ROWS_K,
               ("q4_k_x8.dot8_q4_k_x8", "iq4_xs_x8.dot8_iq4_xs_x8", *(f"vec_dot_k.dot2_{t}" for t in _K_DOT2),
                "vec_dot_iq.rows_dot")),
        Kernel("kernels_cpu.q4_k_x8", "dot8x4_q4_k_x8", (RAW_1, I64, I8_1, F32_1, I16_1, *_TOK4, I64, F32_1, I64, I64)),
        Kernel("kernels_cpu.q4_k_x8", "dot8x2_q4_k_x8", (RAW_1, I64, I8_1, F32_1, I16_1, *_TOK2, I64, F32_1, I64, I64)),
        Kernel("kernels_cpu.k_tokens", "dot2x4_q6_k", (RAW_1, I64, I64, I8_1, F32_1, *_TOK4, I64, F32_1, I64, I64)),
        Kernel("kernels_cpu.k_tokens", "dot2x2_q6_k", (RAW_1, I64, I64, I8_1, F32_1, *_TOK2, I64, F32_1, I64, I64)),
        Kernel("kernels_cpu.k_tokens", "rows_dot4",
               (BOOL, RAW_1, I64, I64, I64, I8_1, F32_1, I16_1, *_TOK4, F32_1, I64, I64),
               ("q4_k_x8.dot8x4_q4_k_x8", "q4_k_x8.dot8x2_q4_k_x8", "k_tokens.dot2x4_q6_k", "k_tokens.dot2x2_q6_k")),
        Kernel("kernels_cpu.vec_dot_k", "matmul_q8_k_act",
               (*_DRIVER, I8_2, F32_2, I16_2, F32_2, F32_2, F32_2, *_TASKS),
               ("vec_dot_k.rows_dot", "k_tokens.rows_dot4")),
        Kernel("kernels_cpu.act_quant", "quantize_q8_k_rows", (F32_2, I8_2, F32_2, I16_2)),
        # the sampler's top-k (every generating command)
        Kernel("kernels_cpu.topk", "top_k_ids", (F32_1, I64)),
        # the ops around them
        *(Kernel("kernels_cpu.norm", n, (F32_2, RO_F32_1, BOOL, F32, F32_2))
          for n in ("_rms_norm_rows_serial", "_rms_norm_rows_par")),
        Kernel("kernels_cpu.norm", "rms_norm_rows", (F32_2, RO_F32_1, BOOL, F32, F32_2),
               ("norm._rms_norm_rows_serial", "norm._rms_norm_rows_par")),
        Kernel("kernels_cpu.rope", "_rope_cache", (I32, I64, F32, F32, F32_1, F32, F32, F32, F32, F32_1, F32_1)),
        Kernel("kernels_cpu.rope", "_rope_tables", (I32_1, I64, F32, F32, F32_1, F32, F32, F32, F32, F32_2, F32_2),
               ("rope._rope_cache",)),
        *(Kernel("kernels_cpu.rope", n, (F32_3, F32_2, F32_2, I64, BOOL, F32_3))
          for n in ("_rope_apply_serial", "_rope_apply_par")),
        Kernel("kernels_cpu.rope", "rope_apply_rows", (F32_3, F32_2, F32_2, I64, BOOL, F32_3),
               ("rope._rope_apply_serial", "rope._rope_apply_par")),
        Kernel("kernels_cpu.kv_cache", "quantize_row_q8_0", (F32_1, U8_1)),
        Kernel("kernels_cpu.kv_cache", "quantize_row_q4_0", (F32_1, U8_1)),
        Kernel("kernels_cpu.kv_cache", "_store_rows", (U8_3, I64_1, F32_3, I64),
               ("kv_cache.quantize_row_q8_0", "kv_cache.quantize_row_q4_0")),
        Kernel("kernels_cpu.kv_cache", "_store_kv", (U8_3, U8_3, I64_1, F32_3, F32_3, I64, I64),
               ("kv_cache._store_rows",)),
        Kernel("kernels_cpu.kv_cache", "dequantize_rows_into", (*KV_VIEWS, I64, I64, I64, I64, F32_1, F32_2)),
        Kernel("kernels_cpu.attention", "_attention_kernel",
               (F32_3, *KV_VIEWS, *KV_VIEWS, I64, I64, I32_1, I64, F32, I64, F32, I64, F32_1, F32_1, _c(I32, 2), I64,
                I32_1, F32_3),
               ("kv_cache.dequantize_rows_into",)),
        *(Kernel("kernels_cpu.activations", n, (F32_1, F32_1, I64, F32_1, F32_1)) for n in ("_glu_serial", "_glu_par")),
        Kernel("kernels_cpu.activations", "glu_rows", (F32_1, F32_1, I64, F32_1, F32_1),
               ("activations._glu_serial", "activations._glu_par")),
        # a dense layer of a few tokens in two calls (fused_layer)
        Kernel("kernels_cpu.fused_layer", "int_dots", (F32_2, MATS, nt.UniTuple(F32_2, 3), RAW_2, F32_2, I64),
               ("act_quant.quantize_q8_1_rows", "vec_dot_legacy.matmul_q8_0_act", "act_quant.quantize_q8_k_rows",
                "vec_dot_k.matmul_q8_k_act")),
        Kernel("kernels_cpu.fused_layer", "attention_half",
               (I64, F32_2, F32, RO_F32_1, MATS, MATS, RAW_2, F32_2, nt.UniTuple(RO_F32_1, 3), BOOL, RO_F32_1,
                RO_F32_1, BOOL, I64, I64, I64, I64, F32_2, F32_2, I64, BOOL, F32, BOOL, nt.Tuple(KV_VIEWS),
                nt.Tuple(KV_VIEWS), I64, I64, I32_1, I64_1, I64, F32, I64, I64, F32_1, I32_1, I64, RO_F32_1, BOOL),
               ("norm.rms_norm_rows", "fused_layer.int_dots", "rope.rope_apply_rows", "kv_cache._store_kv",
                "attention._attention_kernel")),
        Kernel("kernels_cpu.fused_layer", "ffn_half",
               (I64, F32_2, F32_2, F32, RO_F32_1, MATS, MATS, RAW_2, F32_2, I64, F32_1, RO_F32_1, BOOL),
               ("norm.rms_norm_rows", "fused_layer.int_dots", "activations.glu_rows")),
        # the embedding lookup (get_rows)
        Kernel("kernels_cpu.get_rows", "_h2f", (nt.uint8, nt.uint8)),
        *(Kernel("kernels_cpu.get_rows", n, (RAW_1, I64, F32_1, I64), ("get_rows._h2f",))
          for n in ("_q4_k_block", "_q6_k_block")),
        Kernel("kernels_cpu.get_rows", "_q8_0_x8_row", (RAW_1, I64, I64, I64, F32_1), ("get_rows._h2f",)),
        Kernel("kernels_cpu.get_rows", "_decode_row", (I64, RAW_2, I64_1, I64, I64, F32_2, I64),
               ("get_rows._h2f", "get_rows._q4_k_block", "get_rows._q6_k_block", "get_rows._q8_0_x8_row")),
        *(Kernel("kernels_cpu.get_rows", n, (I64, RAW_2, I64_1, I64, I64, F32_2), ("get_rows._decode_row",))
          for n in ("_decode_rows", "_decode_rows_parallel")),
        # the 8-row interleaved layouts made at load (hybrid/backends/repack.py)
        Kernel("kernels_cpu.legacy_x8", "_repack_groups", (RAW_1, I64, BOOL, U8_1)),
        Kernel("kernels_cpu.q8_0_x8", "_repack_groups", (RAW_1, I64, U8_1)),
        Kernel("kernels_cpu.q4_k_x8", "_repack_groups", (RAW_1, I64, U8_1)),
        Kernel("kernels_cpu.mxfp4_x8", "_repack_groups", (RAW_1, I64, U8_1)),
        Kernel("kernels_cpu.iq4_xs_x8", "_repack_groups", (RAW_1, I64, U8_1)),
    ]
    return tuple(k)


# Seconds each compile took on the 2-core Zen 4 guest of docs/BENCHMARKS.md, its callees cached (the rest: the
# default). A parallel compile starts the longest chains of these first.
_COMPILE_S = {
    "legacy_x8.dot8_q4_0_x8": 0.9, "legacy_x8.dot8_q5_0_x8": 0.9, "vec_dot_k.dot2_q2_k": 0.6,
    "vec_dot_k.dot2_q3_k": 0.6, "vec_dot_legacy.rows_dot": 0.5, "vec_dot_k.rows_dot": 0.7,
    "vec_dot_legacy.matmul_q8_0_act": 1.9, "vec_dot_k.matmul_q8_k_act": 2.5, "act_quant.quantize_q8_1_rows": 0.6,
    "act_quant.quantize_q8_k_rows": 0.9, "norm._rms_norm_rows_par": 0.6, "rope._rope_apply_par": 1.3,
    "rope.rope_apply_rows": 0.6, "kv_cache._store_rows": 0.7, "kv_cache.dequantize_rows_into": 0.6,
    "attention._attention_kernel": 4.4, "activations._glu_par": 0.4, "fused_layer.int_dots": 2.1,
    "fused_layer.attention_half": 4.6, "fused_layer.ffn_half": 2.7, "legacy_x8._repack_groups": 1.1,
    "q4_k_x8._repack_groups": 0.8, "rope._rope_tables": 0.1, "rope._rope_cache": 0.2,
}
KERNELS: dict[str, Kernel] = {k.key: replace(k, cost_s=_COMPILE_S.get(k.key, k.cost_s)) for k in _kernels()}

# what each path of the CPU backend calls (hybrid/backends/cpu_kernels.py picks them for a model)
FUSED_ATTENTION = "fused_layer.attention_half"
FUSED_FFN = "fused_layer.ffn_half"
INT_DOTS = {"Q8_0": ("act_quant.quantize_q8_1_rows", "vec_dot_legacy.matmul_q8_0_act"),  # by vec_dot_type
            "Q8_K": ("act_quant.quantize_q8_k_rows", "vec_dot_k.matmul_q8_k_act")}
RMS_NORM = "norm.rms_norm_rows"
GET_ROWS = ("get_rows._decode_rows", "get_rows._decode_rows_parallel")  # a few rows; a prompt's, on the threads
ROPE_TABLES = "rope._rope_tables"
TOP_K = "topk.top_k_ids"
REPACK = {"Q4_0": "legacy_x8._repack_groups", "Q5_0": "legacy_x8._repack_groups", "Q8_0": "q8_0_x8._repack_groups",
          "Q4_K": "q4_k_x8._repack_groups",
          "MXFP4": "mxfp4_x8._repack_groups", "IQ4_XS": "iq4_xs_x8._repack_groups"}


def closure(keys: Iterable[str]) -> tuple[Kernel, ...]:
    """The kernels named by `keys` and every kernel they call, each once, callees before their callers."""
    seen: dict[str, Kernel] = {}

    def visit(key: str) -> None:
        if key not in seen:
            k = KERNELS[key]
            for c in k.calls:
                visit(c)
            seen[key] = k

    for key in keys:
        visit(key)
    return tuple(seen.values())
