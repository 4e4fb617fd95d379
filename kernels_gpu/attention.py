"""Launcher of attention.cu: causal (and sliding-window) attention over a GpuKVCacheLayer, flash style.

The keys are split across CTAs when (tokens x kv heads) alone would leave the GPU idle (decode), and the splits'
partial softmax states are merged by attn_combine (flash-decoding). Batches of PREFILL_MIN_TOK tokens or more
go to attn_prefill_d* (64-row query tiles x 64-key tiles in shared memory) when head_dim allows it. Every kernel
takes optional attention sinks (gpt-oss: one logit per query head in the softmax's denominator), and paged caches
(kv_cache.PagedArgs: the keys read through block tables; a ragged batch of several sequences in the decode kernel).
"""

from __future__ import annotations

import numpy as np

from .kv_cache import NO_TABLES, GpuKVCacheLayer, PagedArgs, kv_type_code
from .matmul import q8_empty
from .module import get_kernel

ATT_THREADS = 128  # 4 warps (ATT_WARPS in attention.cu)
ATT_E = (1, 2, 3, 4, 6, 8)  # head_dim / 32 values with a compiled kernel
TARGET_CTAS = 1024  # enough CTAs to fill 132 SMs several times
MIN_CHUNK = 64  # keys per split at least (sets the number of splits)
DYNAMIC_MIN_CHUNK = 16  # a graph launch's splits take this many keys at least: a short context spreads over a few
# splits (16 keys: one pass of the 4 warps) instead of one CTA walking 64 keys in 4 dependent passes
PREFILL_MIN_TOK = 16  # batches this large (and not dynamic) take the tiled prefill kernel; 0 turns it off
PREFILL_SPLIT_CTAS = 132  # the prefill kernel splits the keys when its row tiles x KV heads are fewer (one H200
# wave): a 64-token chunk of Llama-8B at position 8000 is 32 CTAs walking 125 key tiles each, one after the other
PREFILL_SPLIT_MIN_KEYS = 4 * 64  # keys a split at least (4 key tiles)
ATTP_THREADS = 256  # attn_prefill_d*: 16 x 16 threads
ATTP_BQ = ATTP_BK = 64  # query rows and keys a tile (ATTP_BQ, ATTP_BK in attention.cu)
ATTP_D = (64, 128, 192, 256)  # head_dim values of the prefill kernel
PREFILL_MMA = True  # the prefill kernel of an f16 cache on the tensor cores (attention_mma.cu) where head_dim allows
ATTM_D = (64, 128)  # head_dim values of attn_mma_d*
ATTM_THREADS = 128
ATTM_BQ = ATTM_BK = 64


def mma_smem_bytes(d: int) -> int:
    """Dynamic shared memory of attn_mma_d{d}: the Q and K tiles (rows padded by 8 halves) and V transposed, f16."""
    return 2 * (ATTM_BQ * (d + 8) + ATTM_BK * (d + 8) + d * (ATTM_BK + 8))


def uses_mma(d: int, type_k: str, type_v: str) -> bool:
    """Whether the tiled prefill of head_dim d over a cache of these types runs on the tensor cores (attn_mma_d*)."""
    return PREFILL_MMA and d in ATTM_D and type_k == type_v == "f16"


def prefill_smem_bytes(d: int) -> int:
    """Dynamic shared memory of attn_prefill_d{d}: Q tile, K tile (or P), V tile, float32."""
    return 4 * (d * ATTP_BQ + max(d * ATTP_BK, ATTP_BQ * (ATTP_BK + 4)) + ATTP_BK * d)


def _prefill_kernel(d: int, mma: bool = False):
    if mma:
        fn, smem = get_kernel("attention", f"attn_mma_d{d}", (("ATTM_D", d),)), mma_smem_bytes(d)
    else:
        fn, smem = get_kernel("attention", f"attn_prefill_d{d}", (("ATTP_D", d),)), prefill_smem_bytes(d)
    if fn.max_dynamic_shared_size_bytes < smem:  # past 48 KiB needs the opt-in attribute
        fn.max_dynamic_shared_size_bytes = smem
    return fn, smem


def _partials(rows: int, n_splits: int, d: int) -> tuple:
    """attn_combine's inputs for `rows` (token, head) rows of n_splits key splits: (max, sum) and the unnormalized
    P V, float32 on the device; nullptrs when the keys are not split."""
    import cupy  # noqa: PLC0415

    if n_splits == 1:
        return np.uint64(0), np.uint64(0)
    return (cupy.empty((rows * n_splits * 2,), dtype=cupy.float32),
            cupy.empty((rows * n_splits * d,), dtype=cupy.float32))


def _heads_per_cta(group: int, e: int) -> int:
    cap = 4 if e > 4 else 8  # HPC * E <= 32 accumulators per lane
    hpc = 1
    while hpc < group and hpc < cap:
        hpc *= 2
    return hpc


def attention(q, layer: GpuKVCacheLayer, positions, n_kv: int, scale: float, n_swa: int = 0, out=None,
              target_ctas: int = TARGET_CTAS, min_chunk: int = MIN_CHUNK, dynamic: bool = False,
              slots: tuple[int, int] | None = None, prefill: bool | None = None, sinks=None,
              paged: PagedArgs | None = None, splits: int | None = None, mma: bool | None = None):
    """See attention_q8 (this is its output alone)."""
    return attention_q8(q, layer, positions, n_kv, scale, n_swa, out, target_ctas, min_chunk, dynamic, slots,
                        prefill, sinks, paged=paged, splits=splits, mma=mma)[0]


def attention_q8(q, layer: GpuKVCacheLayer, positions, n_kv: int, scale: float, n_swa: int = 0, out=None,
                 target_ctas: int = TARGET_CTAS, min_chunk: int = MIN_CHUNK, dynamic: bool = False,
                 slots: tuple[int, int] | None = None, prefill: bool | None = None, sinks=None, q8: bool = False,
                 paged: PagedArgs | None = None, splits: int | None = None, mma: bool | None = None):
    """q (n_tok, n_head, head_dim) f32 (cupy) at positions (cupy int32 (n_tok,)) over cache cells [0, n_kv)
    -> (n_tok, n_head, head_dim) f32: softmax(scale q.k) v with causal and sliding-window (n_swa > 0) masks.
    The batch's own K/V must be stored first. head_dim_k must equal head_dim_v (a multiple of 32, <= 256).
    target_ctas / min_chunk steer the split of the keys across CTAs (tuning knobs).
    dynamic=True: the launch geometry depends on n_kv (pass the cache size) and not on the positions, whose
    values the kernel reads from the device to size its key chunks (ascending positions): one CUDA graph
    captured with it is right for every position. slots: as kv_cache.kv_store's (the cache read through them).
    prefill: True / False force the tiled prefill kernel / the flash-decoding kernel; None picks the prefill
    kernel for n_tok >= PREFILL_MIN_TOK (not dynamic, head_dim in ATTP_D). sinks: (n_head,) f32 (cupy, or numpy
    copied over) or None: head h's weights are exp(s) / (sum exp(s') + exp(sinks[h])).
    Returns (out, q8_out): q8_out, where q8 is asked and the keys were split (attn_combine runs), is the output's
    8-bit quantization ((xq, xm) as quantize_q8_1's of out as (n_tok, n_head * head_dim), written by attn_combine),
    else None. paged: the keys through block tables (layer.k / layer.v the pool; n_kv at most the tables' width
    times the block size); with paged.seq_of the tokens may be of several sequences, each attending to its own
    keys (the decode kernel only: a prefill kernel's tile holds one sequence). splits: the prefill kernel's key
    splits (None: more than one only when its row tiles x KV heads are fewer than PREFILL_SPLIT_CTAS, up to
    target_ctas CTAs, PREFILL_SPLIT_MIN_KEYS keys a split at least). mma: the prefill kernel on the tensor cores
    (attn_mma_d*: f16 cache, head_dim in ATTM_D; None: uses_mma)."""
    import cupy  # noqa: PLC0415

    if not isinstance(q, cupy.ndarray) or q.dtype != cupy.float32 or q.ndim != 3:
        raise ValueError("attention: q must be a 3-D float32 cupy array (n_tok, n_head, head_dim)")
    q = cupy.ascontiguousarray(q)
    n_tok, n_head, d = q.shape
    if d != layer.head_dim_k or layer.head_dim_k != layer.head_dim_v:
        raise ValueError(f"attention: needs head_dim q == k == v, found {d}, {layer.head_dim_k}, {layer.head_dim_v}")
    if d % 32 or d // 32 not in ATT_E:
        raise ValueError(f"attention: head_dim must be 32 x {ATT_E}, found {d}")
    n_head_kv = layer.n_head_kv
    if n_head % n_head_kv:
        raise ValueError(f"attention: n_head ({n_head}) must be a multiple of n_head_kv ({n_head_kv})")
    n_ctx = layer.n_ctx if paged is None else paged.width * paged.block_size
    if not 0 <= n_kv <= n_ctx:
        raise ValueError(f"attention: n_kv must lie in [0, {n_ctx}], found {n_kv}")
    if sinks is None:
        sink_ptr = np.uint64(0)  # nullptr: the plain softmax
    else:
        sinks = cupy.ascontiguousarray(cupy.asarray(sinks, dtype=cupy.float32)).reshape(-1)
        if sinks.shape[0] != n_head:
            raise ValueError(f"attention: sinks must hold {n_head} values (one per query head), found {sinks.shape[0]}")
        sink_ptr = sinks
    if out is None:
        out = cupy.empty((n_tok, n_head, d), dtype=cupy.float32)
    if n_tok == 0:
        return out, None
    i32 = np.int32
    kc, vc = (layer.k, layer.v) if slots is None else (np.uint64(slots[0]), np.uint64(slots[1]))
    ragged = paged is not None and paged.seq_of is not None
    tables = NO_TABLES if paged is None else paged.args()
    if prefill is None:
        prefill = 0 < PREFILL_MIN_TOK <= n_tok and not dynamic and d in ATTP_D and not ragged
    elif prefill and (d not in ATTP_D or ragged):
        raise ValueError(f"attention: the prefill kernel needs head_dim in {ATTP_D} and one sequence, found {d}"
                         f"{' and a ragged batch' if ragged else ''}")
    if prefill:
        mma = uses_mma(d, layer.type_k, layer.type_v) if mma is None else mma
        if mma and not (d in ATTM_D and layer.type_k == layer.type_v == "f16"):
            raise ValueError(f"attention: the tensor-core prefill kernel needs head_dim in {ATTM_D} and an f16 cache, "
                             f"found {d}, {layer.type_k}/{layer.type_v}")
        fn, smem = _prefill_kernel(d, mma)
        group = n_head // n_head_kv
        n_tiles = -(-(n_tok * group) // ATTP_BQ)
        if splits is None:
            splits = 1
            if n_tiles * n_head_kv < PREFILL_SPLIT_CTAS:
                splits = max(1, min(-(-target_ctas // (n_tiles * n_head_kv)), n_kv // PREFILL_SPLIT_MIN_KEYS))
        part_ms, part_acc = _partials(n_tok * n_head, splits, d)
        if mma:
            fn((n_tiles, n_head_kv, splits), (ATTM_THREADS,),
               (q, kc, vc, positions, out, i32(n_tok), i32(n_head), i32(n_head_kv), i32(layer.k.shape[2]),
                i32(layer.v.shape[2]), i32(n_kv), np.float32(scale), i32(n_swa), i32(slots is not None), sink_ptr,
                tables[0], tables[3], i32(splits), part_ms, part_acc), shared_mem=smem)
        else:
            fn((n_tiles, n_head_kv, splits), (ATTP_THREADS,),
               (q, kc, vc, positions, out, i32(n_tok), i32(n_head), i32(n_head_kv), i32(kv_type_code(layer.type_k)),
                i32(kv_type_code(layer.type_v)), i32(layer.k.shape[2]), i32(layer.v.shape[2]), i32(n_kv),
                np.float32(scale), i32(n_swa), i32(slots is not None), sink_ptr, tables[0], tables[3], i32(splits),
                part_ms, part_acc), shared_mem=smem)
        n_splits = splits
    else:
        e = d // 32
        group = n_head // n_head_kv
        hpc = _heads_per_cta(group, e)
        gpk = (group + hpc - 1) // hpc
        ctas = n_tok * n_head_kv * gpk
        max_splits = max(1, -(-n_kv // min_chunk))
        n_splits = min(max_splits, max(1, -(-target_ctas // ctas)))
        if dynamic:
            chunk = -max(1, min(min_chunk, DYNAMIC_MIN_CHUNK))  # kernel: max(that, ceil(keys in use / n_splits))
        else:
            chunk = max(1, -(-n_kv // n_splits))
            n_splits = max(1, -(-n_kv // chunk))
        part_ms, part_acc = _partials(n_tok * n_head, n_splits, d)
        fn = get_kernel("attention", f"attn_e{e}_h{hpc}", (("ATT_E", e), ("ATT_HPC", hpc)))
        fn((n_splits, n_head_kv * gpk, n_tok), (ATT_THREADS,),
           (q, kc, vc, positions, out, part_ms, part_acc, i32(n_head), i32(n_head_kv),
            i32(kv_type_code(layer.type_k)), i32(kv_type_code(layer.type_v)), i32(layer.k.shape[2]),
            i32(layer.v.shape[2]), i32(n_kv), i32(chunk), i32(n_splits), np.float32(scale), i32(n_swa),
            i32(slots is not None), sink_ptr, *tables))
    if n_splits == 1:
        return out, None
    null = np.uint64(0)
    xq, xm = q8_empty(n_tok, n_head * d) if q8 else (null, null)
    get_kernel("attention", "attn_combine")((n_tok * n_head,), (d,), (part_ms, part_acc, out, i32(n_splits), i32(d),
                                                                     sink_ptr, i32(n_head), xq, xm))
    return out, ((xq, xm) if q8 else None)
