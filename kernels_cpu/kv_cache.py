"""KV cache storage of one layer: K/V rows per position kept as raw ggml-layout bytes (f32, f16, q8_0, q4_0).

Quantized rows follow ggml's blocks of 32 along head_dim (block_q8_0: d fp16, qs[32] int8; block_q4_0: d fp16,
qs[16] nibbles), written by quantizers bit-exact with ggml's quantize_row_q8_0_ref / quantize_row_q4_0_ref.
Cell c holds position c (one sequence). `dequantize_rows_into` is how attention reads a tile of rows.
"""

from __future__ import annotations

import math
import platform
from dataclasses import dataclass

import numpy as np
from llvmlite import binding as llvm_binding
from llvmlite import ir as llvm_ir
from numba import njit, types
from numba.extending import intrinsic

from gguf_io.kv_types import KV_TYPES, kv_row_bytes, kv_type

# Codes f32 0, f16 1, q8_0 2, q4_0 3; block sizes from gguf_io's table, as constants (Numba freezes globals).
QK = KV_TYPES["q8_0"].block  # elements per q8_0 / q4_0 block (32)
Q8_0_BYTES = KV_TYPES["q8_0"].block_bytes  # block_q8_0: d (fp16), qs[32] (int8)
Q4_0_BYTES = KV_TYPES["q4_0"].block_bytes  # block_q4_0: d (fp16), qs[16] (low nibbles: elements 0..15, high: 16..31)
assert KV_TYPES["q4_0"].block == QK

# fp16 bits -> float32, exact; kernels take it as an argument (Numba cannot read float16 arrays).
F16_TO_F32 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


def _native_f16() -> bool:
    # LLVM lowers half -> float to one instruction with x86 F16C or on arm64; elsewhere to a libcall
    try:
        return bool(llvm_binding.get_host_cpu_features().get("f16c")) or platform.machine() in ("aarch64", "arm64")
    except Exception:  # noqa: BLE001 - feature query unavailable: use the table
        return False


NATIVE_F16 = _native_f16()


@intrinsic
def _half_bits_to_f32(typingctx, h):
    # LLVM: fpext (bitcast i16 -> half) -> float; exact, and vectorizes to vcvtph2ps
    if h != types.uint16:
        return None

    def codegen(context, builder, sig, args):
        return builder.fpext(builder.bitcast(args[0], llvm_ir.HalfType()), llvm_ir.FloatType())

    return types.float32(types.uint16), codegen


@njit(cache=True, fastmath=True)
def f16_to_f32(h, lut):
    """fp16 bits (uint16) -> float32, exact: the CPU instruction where there is one, else lut (F16_TO_F32)."""
    if NATIVE_F16:
        return _half_bits_to_f32(h)
    return lut[h]


def kv_type_code(type_name: str) -> int:
    """Kernel code of a KV cache type name ("f32", "f16", "q8_0", "q4_0", any case); a ValueError for others."""
    return kv_type(type_name).code


@dataclass(frozen=True)
class KVCacheLayer:
    """One layer's cache: k, v uint8 (rows, n_head_kv, row_bytes), ggml-layout rows. Contiguous (table None): row c
    holds position c. Paged (a view of a shared pool, hybrid.kv.paged): position c lives in row
    table[c // block_size] * block_size + c % block_size, table being the sequence's block ids (int32, -1 where no
    block is allocated yet; its owner fills it in place, so every layer's view sees the same table)."""

    type_k: str
    type_v: str
    head_dim_k: int
    head_dim_v: int
    k: np.ndarray  # uint8 (rows, n_head_kv, kv_row_bytes(type_k, head_dim_k))
    v: np.ndarray  # uint8 (rows, n_head_kv, kv_row_bytes(type_v, head_dim_v))
    table: np.ndarray | None = None  # int32 (max blocks of the sequence,): paged; None: contiguous
    block_size: int = 0

    @property
    def n_ctx(self) -> int:
        """Positions the layer can address: its rows, or a paged sequence's table times the block size."""
        return self.k.shape[0] if self.table is None else self.table.shape[0] * self.block_size

    @property
    def n_head_kv(self) -> int:
        return self.k.shape[1]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + (0 if self.v is self.k else self.v.nbytes)  # MLA: v is k


def alloc_kv_layer(n_ctx: int, n_head_kv: int, head_dim_k: int, head_dim_v: int | None = None,
                   type_k: str = "f16", type_v: str = "f16") -> KVCacheLayer:
    """A zeroed KVCacheLayer of n_ctx cells (head_dim_v defaults to head_dim_k)."""
    head_dim_v = head_dim_k if head_dim_v is None else head_dim_v
    type_k, type_v = type_k.lower(), type_v.lower()
    k = np.zeros((n_ctx, n_head_kv, kv_row_bytes(type_k, head_dim_k)), dtype=np.uint8)
    v = np.zeros((n_ctx, n_head_kv, kv_row_bytes(type_v, head_dim_v)), dtype=np.uint8)
    return KVCacheLayer(type_k, type_v, head_dim_k, head_dim_v, k, v)


IDENTITY_TABLE = np.zeros(1, dtype=np.int32)  # a contiguous cache's table for the kernels (with bs = its rows); never
# written (writable all the same: the kernels' one table type)


def kernel_table(layer: KVCacheLayer) -> tuple[np.ndarray, int]:
    """(table, bs) of the attention kernel: a paged layer's own, or [0] and its row count (row = position)."""
    if layer.table is None:
        return IDENTITY_TABLE, max(1, layer.k.shape[0])
    return layer.table, layer.block_size


def check_blocks(layer: KVCacheLayer, n_kv: int) -> None:
    """ValueError unless positions [0, n_kv) of a paged layer all have blocks (what attention reads); a contiguous
    layer: nothing to check."""
    if layer.table is not None and n_kv and (layer.table[: -(-n_kv // layer.block_size)] < 0).any():
        raise ValueError(f"attention: positions [0, {n_kv}) of a paged cache are not all in allocated blocks")


def cache_rows(layer: KVCacheLayer, positions: np.ndarray) -> np.ndarray:
    """The rows (int64) that hold `positions` (int64) of a layer: the positions themselves for a contiguous cache; for
    a paged one through its table, ValueError where a position has no block (or lies past the table)."""
    if layer.table is None:
        return positions
    bs = layer.block_size
    blk = positions // bs
    if positions.size and (positions.min() < 0 or blk.max() >= layer.table.shape[0] or
                           (layer.table[blk] < 0).any()):
        raise ValueError(f"kv_store: positions must lie in the sequence's allocated blocks (block size {bs}, "
                         f"{int((layer.table >= 0).sum())} allocated), found {positions.min()}..{positions.max()}")
    return layer.table[blk].astype(np.int64) * bs + positions % bs


def kv_store(layer: KVCacheLayer, positions: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
    """Write k (n_tok, n_head_kv, head_dim_k) and v (n_tok, n_head_kv, head_dim_v) f32 at positions (n_tok,)."""
    positions = np.asarray(positions, dtype=np.int64).reshape(-1)
    n_tok = positions.shape[0]
    for name, x, hd in (("k", k, layer.head_dim_k), ("v", v, layer.head_dim_v)):
        if x.shape != (n_tok, layer.n_head_kv, hd):
            raise ValueError(f"kv_store: {name} must be {(n_tok, layer.n_head_kv, hd)}, found {x.shape}")
    # one compiled call checks the cells and stores both (decode stores one row a layer: Python overhead is most
    # of the cost); nothing is written when a position is out of range
    bad = _store_kv(layer.k, layer.v, cache_rows(layer, positions), np.ascontiguousarray(k, dtype=np.float32),
                    np.ascontiguousarray(v, dtype=np.float32), kv_type_code(layer.type_k), kv_type_code(layer.type_v))
    if bad >= 0:
        raise ValueError(f"kv_store: positions must lie in [0, {layer.n_ctx}), found {positions[bad]}")


@intrinsic
def _f32_to_half_bits(typingctx, x):
    # LLVM: fptrunc float -> half, bitcast to i16: round-to-nearest-even, overflow to inf (vcvtps2ph with F16C),
    # as GGML_FP32_TO_FP16 and numpy's astype(float16)
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.fptrunc(args[0], llvm_ir.HalfType()), llvm_ir.IntType(16))

    return types.uint16(types.float32), codegen


@njit(cache=True)
def f32_to_f16_bits(x):
    """float32 -> IEEE half bits, round-to-nearest-even: the CPU instruction where there is one."""
    if NATIVE_F16:
        return _f32_to_half_bits(x)
    return fp32_to_fp16_bits(x)


@njit(cache=True)
def _store_rows(dst, positions, x, code):
    # x f32 (n_tok, n_head_kv, head_dim) -> dst[positions[t], h] u8 rows of type `code`
    n_tok, n_head, hd = x.shape
    for t in range(n_tok):
        c = positions[t]
        for h in range(n_head):
            if code == 0:
                row = dst[c, h].view(np.float32)
                for j in range(hd):
                    row[j] = x[t, h, j]
            elif code == 1:
                row = dst[c, h].view(np.uint16)
                for j in range(hd):
                    row[j] = f32_to_f16_bits(x[t, h, j])
            elif code == 2:
                quantize_row_q8_0(x[t, h], dst[c, h])
            else:
                quantize_row_q4_0(x[t, h], dst[c, h])


@njit(cache=True)
def _store_kv(k_dst, v_dst, positions, k, v, code_k, code_v):
    # -> -1 after storing k and v, or the index of the first position outside the cache (nothing stored)
    for t in range(positions.shape[0]):
        if positions[t] < 0 or positions[t] >= k_dst.shape[0]:
            return t
    _store_rows(k_dst, positions, k, code_k)
    _store_rows(v_dst, positions, v, code_v)
    return -1


def kv_read(layer: KVCacheLayer, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
    """Dequantized cells [start, stop): (k (n, n_head_kv, head_dim_k), v (n, n_head_kv, head_dim_v)) f32."""
    if not 0 <= start <= stop <= layer.n_ctx:
        raise ValueError(f"kv_read: need 0 <= start <= stop <= {layer.n_ctx}, found [{start}, {stop})")
    k = np.empty((stop - start, layer.n_head_kv, layer.head_dim_k), dtype=np.float32)
    v = np.empty((stop - start, layer.n_head_kv, layer.head_dim_v), dtype=np.float32)
    rows = slice(start, stop) if layer.table is None else cache_rows(layer, np.arange(start, stop, dtype=np.int64))
    _dequantize_rows(*kv_views(np.ascontiguousarray(layer.k[rows]), layer.type_k), kv_type_code(layer.type_k),
                     F16_TO_F32, k)
    _dequantize_rows(*kv_views(np.ascontiguousarray(layer.v[rows]), layer.type_v), kv_type_code(layer.type_v),
                     F16_TO_F32, v)
    return k, v


# ---- quantizers: no fastmath, so that divisions and products round exactly as ggml's C does ----

@njit(cache=True)
def fp32_to_fp16_bits(x):
    """float32 -> IEEE half bits (uint16), round-to-nearest-even like GGML_FP32_TO_FP16 / numpy."""
    sign = 0x8000 if math.copysign(1.0, x) < 0 else 0  # keeps -0.0 (q4_0's d = -0.0 / 8 of a zero block)
    a = abs(x)
    if a != a:
        return np.uint16(0x7E00)
    if a >= np.float32(65520.0):  # halfway between 65504 and 2^16 rounds (to even) to infinity
        return np.uint16(sign | 0x7C00)
    if a < np.float32(6.103515625e-05):  # below 2^-14: subnormal half, units of 2^-24
        return np.uint16(sign | int(np.rint(a * np.float32(16777216.0))))
    m, e = math.frexp(a)  # a = m * 2^e, m in [0.5, 1)
    q = int(np.rint(m * np.float32(2048.0)))  # 1024..2048; 2048 carries into the exponent
    return np.uint16(sign | (((e + 14) << 10) + q - 1024))


@njit(cache=True)
def _roundf(x):
    # C roundf (half away from zero), computed as gguf.quants.np_roundf does
    a = abs(x)
    fl = np.floor(a)
    r = int(fl + np.floor(np.float32(2.0) * (a - fl)))
    return -r if x < 0 else r


@njit(cache=True)
def quantize_row_q8_0(x, out):
    """x f32 (n,), n % 32 == 0 -> out u8 (n // 32 * 34,): block_q8_0 as ggml's quantize_row_q8_0_ref."""
    for b in range(x.shape[0] // QK):
        o = b * Q8_0_BYTES
        amax = np.float32(0.0)
        for j in range(QK):
            amax = max(amax, abs(x[b * QK + j]))
        d = amax / np.float32(127.0)
        idv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
        h = f32_to_f16_bits(d)
        out[o] = h & 0xFF
        out[o + 1] = h >> 8
        for j in range(QK):
            out[o + 2 + j] = _roundf(x[b * QK + j] * idv) & 0xFF  # int8 two's complement


@njit(cache=True)
def quantize_row_q4_0(x, out):
    """x f32 (n,), n % 32 == 0 -> out u8 (n // 32 * 18,): block_q4_0 as ggml's quantize_row_q4_0_ref."""
    for b in range(x.shape[0] // QK):
        o = b * Q4_0_BYTES
        amax = np.float32(0.0)
        vmax = np.float32(0.0)  # the signed value of largest magnitude (first one on ties)
        for j in range(QK):
            v = x[b * QK + j]
            if amax < abs(v):
                amax = abs(v)
                vmax = v
        d = vmax / np.float32(-8.0)
        idv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
        h = f32_to_f16_bits(d)
        out[o] = h & 0xFF
        out[o + 1] = h >> 8
        for j in range(QK // 2):
            x0 = x[b * QK + j] * idv
            x1 = x[b * QK + QK // 2 + j] * idv
            q0 = min(15, int(x0 + np.float32(8.5)))
            q1 = min(15, int(x1 + np.float32(8.5)))
            out[o + 2 + j] = q0 | (q1 << 4)


# ---- row readers (attention dequantizes a small tile of rows at a time into an L1-sized buffer) ----
# A cache is passed as typed views of its raw bytes, `kv_views`: (f32, u16, u8, i8) (n_ctx, n_head_kv, *),
# the unused ones being tiny dummies. Indexing them directly (not `row.view(...)` per row) keeps loops vectorized.

def kv_views(raw: np.ndarray, type_name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """raw u8 (n, n_head_kv, row_bytes) -> (f32, u16, u8, i8) views for the row readers."""
    code = kv_type_code(type_name)
    f32 = raw.view(np.float32) if code == 0 else np.zeros((1, 1, 1), np.float32)
    u16 = raw.view(np.uint16) if code == 1 else np.zeros((1, 1, 1), np.uint16)
    return f32, u16, raw, raw.view(np.int8)


@njit(cache=True, fastmath=True)
def _scale_at(u8, c, h, o, lut):
    # the fp16 scale d of the block at byte o of cache row [c, h] (little-endian)
    return f16_to_f32(np.uint16(np.int32(u8[c, h, o]) | (np.int32(u8[c, h, o + 1]) << 8)), lut)


@njit(cache=True, fastmath=True)
def dequantize_rows_into(f32, u16, u8, i8, code, c0, n, h, lut, dst):
    """dst[i, :] = dequant(cache row [c0 + i, h]) for i < n: cache views of type `code`, dst f32 (>= n, head_dim)."""
    d = dst.shape[1]
    if code == 0:
        for i in range(n):
            for j in range(d):
                dst[i, j] = f32[c0 + i, h, j]
    elif code == 1:
        for i in range(n):
            for j in range(d):
                dst[i, j] = f16_to_f32(u16[c0 + i, h, j], lut)
    elif code == 2:
        nb = u8.shape[2] // Q8_0_BYTES
        qk = d // nb  # == QK, but a runtime trip count: LLVM vectorizes the loop instead of fully unrolling it
        for i in range(n):
            for b in range(nb):
                o = b * Q8_0_BYTES
                sc = _scale_at(u8, c0 + i, h, o, lut)
                for j in range(qk):
                    dst[i, b * qk + j] = sc * np.float32(i8[c0 + i, h, o + 2 + j])
    else:
        nb = u8.shape[2] // Q4_0_BYTES
        hq = d // nb // 2  # == QK // 2, at runtime (as above)
        for i in range(n):
            for b in range(nb):
                o = b * Q4_0_BYTES
                sc = _scale_at(u8, c0 + i, h, o, lut)
                for j in range(hq):
                    dst[i, b * QK + j] = sc * np.float32((np.int32(u8[c0 + i, h, o + 2 + j]) & 0xF) - 8)
                for j in range(hq):
                    dst[i, b * QK + hq + j] = sc * np.float32((np.int32(u8[c0 + i, h, o + 2 + j]) >> 4) - 8)


@njit(cache=True, fastmath=True)
def _dequantize_rows(f32, u16, u8, i8, code, lut, out):
    # cache views (n, n_head_kv, *) -> out f32 (n, n_head_kv, head_dim)
    for h in range(out.shape[1]):
        tmp = np.empty((out.shape[0], out.shape[2]), dtype=np.float32)
        dequantize_rows_into(f32, u16, u8, i8, code, 0, out.shape[0], h, lut, tmp)
        out[:, h, :] = tmp
