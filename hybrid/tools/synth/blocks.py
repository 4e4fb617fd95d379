"""Random quantized blocks with sane scales: synthetic weights written directly in any registered GGML type.

Each block starts as random bytes (every quant bit pattern is valid); then its scale fields are overwritten
so that the dequantized values have mean ~0, a chosen std, and no NaN/inf. Per chunk of a tensor the
generator is `np.random.default_rng([seed, crc32(name), chunk])`: fast (raw PCG64 words) and deterministic.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from functools import cache, partial
from typing import Callable

import numpy as np

from gguf_io.ggml_types import GGML_TYPE_IDS, GGML_TYPES
from gguf_io.quants import QUANTS

CHUNK_BYTES = 16 << 20  # bytes generated at a time (also the unit of determinism: part of the seed)
_F16 = np.dtype("<f2")


def _k4_scales(b: np.ndarray) -> None:
    # Q4_K/Q5_K scales[12] at bytes 4..16 (get_scale_min_k4): 8 six-bit scales sc in 32..63 and mins m == sc.
    # bytes 0..3 of scales: sc[j] (bit 5 set) | high bits of sc[j+4] (bit 7 set); bytes 4..7 the same for m;
    # bytes 8..11: low nibble of sc[j+4] and of m[j+4] (equal).
    w = b.view("<u4")  # type_size 144 / 176: bytes 4..16 are words 1..3 (whole words: faster than byte slices)
    w[:, 1] |= np.uint32(0xA0A0A0A0)
    w[:, 2] = w[:, 1]
    w[:, 3] = (w[:, 3] & np.uint32(0x0F0F0F0F)) * np.uint32(0x11)


def _q2_k_scales(b: np.ndarray) -> None:
    # block_q2_K scales[16] at 0..16: scale (low nibble) == min (high nibble), in 8..15
    b[:, 0:16] = ((b[:, 0:16] & np.uint8(7)) | np.uint8(8)) * np.uint8(0x11)


def _q3_k_scales(b: np.ndarray) -> None:
    # block_q3_K scales[12] at 96..108; the high 2 bits of each six-bit scale (bytes 104..107) are 00 or 11,
    # so sc - 32 is in -32..-17 or 16..31: no tiny scales, random signs.
    b[:, 104:108] = (b[:, 104:108] & np.uint8(0x55)) * np.uint8(3)


def _q6_k_scales(b: np.ndarray) -> None:
    # block_q6_K scales[16] (int8) at 192..208: 32..63
    b[:, 192:208] = (b[:, 192:208] & np.uint8(0x1F)) | np.uint8(0x20)


def _iq4_xs_scales(b: np.ndarray) -> None:
    # block_iq4_xs scales_h (u16) at 2..4: the high 2 bits of each ls are 00 or 11 (|ls - 32| >= 16)
    w = b.view("<u2")
    w[:, 1] = (w[:, 1] & np.uint16(0x5555)) * np.uint16(3)


@dataclass(frozen=True)
class BlockRecipe:
    """Where a block type keeps its fp16 scale `d` (and min), and how to make its other scale fields sane."""

    d_offset: int
    min_offset: int | None = None
    min_ratio: float = 0.0  # min = min_ratio * d, centres the unsigned quants (dmin for K-quants, m for Q4_1/Q5_1)
    signed_d: bool = False  # random sign of d: a zero mean for the symmetric types
    fix_scales: Callable[[np.ndarray], None] | None = None
    e8m0: bool = False  # d is an e8m0 exponent byte, d = 2**(byte - 128) (block_mxfp4), not an fp16 field


RECIPES: dict[str, BlockRecipe] = {
    "Q4_0": BlockRecipe(0, signed_d=True),
    "Q4_1": BlockRecipe(0, 2, -7.5),
    "Q5_0": BlockRecipe(0, signed_d=True),
    "Q5_1": BlockRecipe(0, 2, -15.5),
    "Q8_0": BlockRecipe(0, signed_d=True),
    "IQ4_NL": BlockRecipe(0, signed_d=True),
    "Q2_K": BlockRecipe(80, 82, 1.5, fix_scales=_q2_k_scales),
    "Q3_K": BlockRecipe(108, signed_d=True, fix_scales=_q3_k_scales),
    "Q4_K": BlockRecipe(0, 2, 7.5, fix_scales=_k4_scales),
    "Q5_K": BlockRecipe(0, 2, 15.5, fix_scales=_k4_scales),
    "Q6_K": BlockRecipe(208, signed_d=True, fix_scales=_q6_k_scales),
    "IQ4_XS": BlockRecipe(0, signed_d=True, fix_scales=_iq4_xs_scales),
    "MXFP4": BlockRecipe(0, e8m0=True),
}
FLOAT_TYPES = ("F32", "F16", "BF16")
SUPPORTED_TYPES = FLOAT_TYPES + tuple(RECIPES)

# Per-block factor of d, picked by a random byte: |f| in [0.75, 1.25), so blocks differ a little.
_FACTOR = (0.75 + np.arange(256, dtype=np.float64) / 512.0)
_SIGNED_FACTOR = _FACTOR * np.where(np.arange(256) & 1, -1.0, 1.0)


def _fix_blocks(b: np.ndarray, type_name: str, d_scale: float) -> None:
    """Overwrite the scale fields of random blocks `b` (n, type_size) uint8 in place; d = d_scale * factor."""
    r = RECIPES[type_name]
    if r.e8m0:  # powers of two 2**e0 or 2**(e0 + 1) around d_scale, mixed per block so the mean of d**2 is
        # d_scale**2 (the random byte there picks; the codes carry the signs)
        e0 = np.floor(np.log2(d_scale)) if d_scale > 0 else -128.0
        p_up = (d_scale**2 / 4.0**e0 - 1.0) / 3.0
        up = b[:, r.d_offset] < np.uint8(min(255, round(256 * p_up)))
        b[:, r.d_offset] = np.clip(e0 + 128 + up, 0, 254).astype(np.uint8)
        return
    w = b.view("<u2")  # every other type_size is even and every fp16 field is at an even offset
    idx = b[:, r.d_offset]  # the random low byte of d picks the factor
    d = (_SIGNED_FACTOR if r.signed_d else _FACTOR) * d_scale  # 256 candidate values of d
    if r.min_offset is not None:
        w[:, r.min_offset // 2] = (d * r.min_ratio).astype(_F16).view("<u2")[idx]
    w[:, r.d_offset // 2] = d.astype(_F16).view("<u2")[idx]
    if r.fix_scales is not None:
        r.fix_scales(b)


def _raw_bytes(rng: np.random.Generator, n: int) -> np.ndarray:
    """`n` random bytes (writable uint8), straight from the bit generator's 64-bit words."""
    return rng.bit_generator.random_raw(-(-n // 8)).view(np.uint8)[:n]


@cache
def unit_d_scale(type_name: str) -> float:
    """The d that gives dequantized values of std 1 (measured once on 4096 blocks with the reference dequantizer)."""
    ts = GGML_TYPES[GGML_TYPE_IDS[type_name]].type_size
    b = _raw_bytes(np.random.default_rng(12345), 4096 * ts).reshape(4096, ts)
    _fix_blocks(b, type_name, 1.0)
    return 1.0 / float(QUANTS[type_name].dequantize(b).std())


def _to_float_type(vals: np.ndarray, type_name: str) -> np.ndarray:
    """float32 values -> F32 / F16 / BF16 (BF16 as uint16: the high half, rounded to nearest even)."""
    if type_name == "F16":
        return vals.astype(_F16)
    if type_name == "BF16":
        u = vals.view("<u4")
        return ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype("<u2")
    return vals


def _float_chunk(rng: np.random.Generator, type_name: str, n: int, std: float, mean: float) -> np.ndarray:
    """n draws of N(mean, std) as the bytes of a float type."""
    if n <= 65536:  # small tensors (norms, biases): direct draws
        return _to_float_type((rng.standard_normal(n) * std + mean).astype("<f4"), type_name).view(np.uint8)
    # large ones by lookup: 65536 normal values indexed by random uint16s (far faster than n normal draws)
    table = _to_float_type((rng.standard_normal(65536) * std + mean).astype("<f4"), type_name)
    return table[_raw_bytes(rng, 2 * n).view("<u2")].view(np.uint8)


def chunk_jobs(seed: int, name: str, type_name: str, n_elements: int, std: float,
               mean: float = 0.0) -> list[Callable[[], np.ndarray]]:
    """The bytes of a random tensor as independent jobs, one per chunk (each returns a uint8 array; run them in
    any order or on threads, concatenate in order): quantized blocks whose dequantized values have mean ~0 and
    std ~`std`, or for F32/F16/BF16 normal draws N(mean, std). Deterministic in (seed, name, type, size)."""
    if type_name not in SUPPORTED_TYPES:
        raise ValueError(f"cannot generate {type_name}; supported: {', '.join(SUPPORTED_TYPES)}")
    t = GGML_TYPES[GGML_TYPE_IDS[type_name]]
    if type_name not in FLOAT_TYPES and mean != 0.0:
        raise ValueError(f"{name}: a non-zero mean needs a float type, not {type_name}")
    if n_elements % t.block_size:
        raise ValueError(f"{name}: {n_elements} elements are not whole {type_name} blocks of {t.block_size}")
    crc = zlib.crc32(name.encode("utf-8"))
    per_chunk = max(1, CHUNK_BYTES // t.type_size)  # blocks per chunk
    n_blocks = n_elements // t.block_size
    d_scale = 0.0 if type_name in FLOAT_TYPES else std * unit_d_scale(type_name)

    def job(k: int, nb: int) -> np.ndarray:
        rng = np.random.default_rng([seed, crc, k])
        if type_name in FLOAT_TYPES:
            return _float_chunk(rng, type_name, nb, std, mean)
        b = _raw_bytes(rng, nb * t.type_size).reshape(nb, t.type_size)
        _fix_blocks(b, type_name, d_scale)
        return b

    return [partial(job, k, min(per_chunk, n_blocks - start)) for k, start in enumerate(range(0, n_blocks, per_chunk))]


def random_tensor(seed: int, name: str, type_name: str, n_elements: int, std: float, mean: float = 0.0) -> np.ndarray:
    """The whole tensor's bytes at once (flat uint8), for tests and small tensors; see `chunk_jobs`."""
    return np.concatenate([job().reshape(-1) for job in chunk_jobs(seed, name, type_name, n_elements, std, mean)])
