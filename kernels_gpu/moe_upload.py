"""Prefill of experts kept in host memory, on the tensor cores: the experts a batch uses are copied from their
page-locked pages into compact device slots, a chunk of used experts at a time, and each chunk's rows run the
resident experts' kernels (moe_mma.cu) with the chunk's slot as the expert tensor.

`plan_upload(ids, n_expert, capacity)` (numpy, on the host: one copy of the ids back sets the copies) groups the
(token, expert) pairs by expert as `moe.group` does on the device (rows in expert order, no padding, tiles of at most
MM_BM rows of one expert) and cuts the used experts, ascending, into chunks of at most `capacity`. In a chunk's slot
the used experts lie back to back; a tile names its expert by that place, and the copies are the chunk's runs of
consecutive used experts (one DMA a run and tensor). `prefill_uploaded` copies each chunk's gate, up and down on a
CopyRing's stream, ahead of the kernels (the ring's slots hold two chunks: the next chunk's copies run while this
one computes), launches gate+up with the GLU and down for the chunk's tiles, and adds the rows back with
`moe.combine`. The products are those of `moe.prefill_mma` on the same experts resident on the device, row for row.

With an expert cache (hybrid/backends/moe_cache), the used experts that sit in its slots need no copy: `resident`
(the layer's device table row, expert -> slot or -1) makes them one first chunk whose tiles name their slot and whose
kernels read the cache's pools (laid out as expert tensors at the same stride) in place of an upload slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MM_BM = 64  # moe_mma.cu's tile rows (as kernels_gpu.moe.MM_BM)


@dataclass(frozen=True)
class UploadChunk:
    experts: np.ndarray  # int64 (n,): the used experts whose weights share one slot, ascending (place j = index)
    runs: tuple[tuple[int, int, int], ...]  # (first expert, end expert, first place): consecutive experts, one copy
    tile0: int  # the chunk's first tile in UploadPlan.tiles
    n_tiles: int
    resident: bool = False  # the experts already on the device (an expert cache's slots): places are slots, no runs


@dataclass(frozen=True)
class UploadPlan:
    chunks: tuple[UploadChunk, ...]
    tiles: np.ndarray  # int32 (n_tiles, 4): (place in its chunk's slot, first row, rows <= MM_BM, 0), chunk by chunk
    src: np.ndarray  # int32 (pairs,): each row's token
    dest: np.ndarray  # int32 (pairs,): each (token, slot) pair's row


def plan_upload(ids: np.ndarray, n_expert: int, capacity: int, bm: int = MM_BM,
                resident: np.ndarray | None = None) -> UploadPlan:
    """The copies and tiles of a routed batch (ids int (n_tok, k) on the host) whose used experts are uploaded in
    chunks of at most `capacity` experts (see the module docstring). resident: int (n_expert,) each expert's slot on
    the device or -1; the used experts with a slot form a first chunk (resident=True) whose tiles name the slot."""
    if capacity < 1:
        raise ValueError(f"plan_upload: a slot must hold at least one expert, capacity {capacity}")
    flat = np.asarray(ids).reshape(-1).astype(np.int64)
    k = ids.shape[1] if np.ndim(ids) == 2 else 1
    if flat.size and (flat.min() < 0 or flat.max() >= n_expert):
        raise ValueError(f"plan_upload: expert ids outside [0, {n_expert})")
    counts = np.bincount(flat, minlength=n_expert)
    first_row = np.cumsum(counts) - counts
    order = np.argsort(flat, kind="stable")  # pairs by expert, in token order within: row r is order[r]'s pair
    src = (order // k).astype(np.int32)
    dest = np.empty(flat.size, dtype=np.int32)
    dest[order] = np.arange(flat.size, dtype=np.int32)
    used = np.flatnonzero(counts)
    chunks, tiles = [], []

    def add_tiles(experts, places) -> None:  # each expert's rows, at most bm a tile, named by its place
        for e, place in zip(experts.tolist(), places):
            n, row = int(counts[e]), int(first_row[e])
            tiles.extend((place, row + t, min(bm, n - t), 0) for t in range(0, n, bm))

    if resident is not None:
        slot = np.asarray(resident).reshape(-1)[used]
        here = used[slot >= 0]
        if here.size:
            add_tiles(here, slot[slot >= 0].tolist())
            chunks.append(UploadChunk(here, (), 0, len(tiles), resident=True))
        used = used[slot < 0]
    for c0 in range(0, used.size, capacity):
        experts = used[c0:c0 + capacity]
        tile0 = len(tiles)
        add_tiles(experts, range(experts.size))
        breaks = np.flatnonzero(np.diff(experts) != 1) + 1  # where a run of consecutive experts ends
        runs = tuple((int(experts[a]), int(experts[b - 1]) + 1, int(a))
                     for a, b in zip(np.r_[0, breaks], np.r_[breaks, experts.size]))
        chunks.append(UploadChunk(experts, runs, tile0, len(tiles) - tile0))
    return UploadPlan(tuple(chunks), np.asarray(tiles, dtype=np.int32).reshape(-1, 4), src, dest)


def expert_bytes(raw: np.ndarray) -> int:
    """Bytes of one expert of a host expert tensor (n_expert, n_out, row_bytes)."""
    return int(raw.shape[1]) * int(raw.shape[2]) * raw.itemsize


def why_not(experts: tuple, slot_bytes: int) -> str:
    """"" when prefill_uploaded runs these host experts ((raw numpy (n_expert, n_out, row_bytes), GGML type) for
    gate, up and down) through slots of slot_bytes, else why not: moe_mma's conditions (gate and up of one type and
    shape, quantized GPU types, even output sizes, inputs in whole 32-element groups, aligned experts) and a slot
    that holds one expert of each."""
    from .matmul import GPU_KERNELS  # noqa: PLC0415

    (g, tg), (u, tu), (d, td) = experts
    if tg != tu or g.shape != u.shape:
        return f"gate and up differ ({tg} {g.shape}, {tu} {u.shape})"
    for raw, type_name in ((g, tg), (d, td)):
        k = GPU_KERNELS.get(type_name)
        if k is None or k.is_float:
            return f"no tensor-core kernels for experts of {type_name}"
        n_out, row_bytes = int(raw.shape[1]), int(raw.shape[2]) * raw.itemsize
        if row_bytes % k.type_size or (n_out * row_bytes) % k.align:
            return f"experts of {type_name} ({n_out} rows of {row_bytes} bytes) are not whole aligned blocks"
        n_in = _n_in(raw, type_name)
        if n_out % 2 or n_in % 32:
            return f"expert of {n_out} x {n_in}: need an even output size and inputs a multiple of 32"
        if expert_bytes(raw) > slot_bytes:
            return f"an expert of {expert_bytes(raw)} bytes exceeds the upload slot of {slot_bytes}"
    return ""


def prefill_uploaded(h, ids, wts, experts: tuple, act: str, ring, biases: tuple = (None, None, None),
                     residual=None, cached=None):
    """The experts of a routed batch (h float32 (n_tok, n_embd), ids int32 and wts float32 (n_tok, k), on the
    device) whose tensors are in page-locked host memory (experts: (raw numpy, GGML type) for gate, up and down,
    why_not(experts, ring.slot_bytes) == ""), through `ring` (a kernels_gpu.transfer.CopyRing of at least 6 slots:
    each chunk takes three). biases: each projection's (n_expert, n_out) float32 rows on the device, or None.
    cached: (table row int32 (n_expert,) slot or -1, (gate, up, down) pools uint8 (n_slots + 1, n_out, row_bytes))
    on the device: an expert cache's, whose slots stand in for those experts' uploads (nothing may write them
    while this batch runs). Returns (out (n_tok, n_embd) float32 on the device, bytes copied)."""
    import cupy  # noqa: PLC0415

    from .moe import GLU_ACTS, MM_BN, MM_THREADS, _mma_kernel, combine  # noqa: PLC0415

    (g, tg), (u, _), (d, td) = experts
    if cached is not None and any(b is not None for b in biases):
        raise ValueError("moe upload: an expert cache holds experts without biases")
    n_tok = h.shape[0]
    n_ff, n_embd = int(g.shape[1]), _n_in(g, tg)
    if (int(d.shape[1]), _n_in(d, td)) != (n_embd, n_ff):
        raise ValueError(f"moe upload: down {d.shape} does not map gate's {g.shape} back")
    h = cupy.ascontiguousarray(h, dtype=cupy.float32)
    per = [expert_bytes(r) for r, _ in experts]
    capacity = ring.slot_bytes // max(per)
    n_expert = int(g.shape[0])
    if cached is None:
        plan = plan_upload(cupy.asnumpy(ids), n_expert, capacity)  # the one host synchronization
    else:  # the ids and the table row in one copy back
        both = cupy.asnumpy(cupy.concatenate([cupy.ascontiguousarray(ids, dtype=cupy.int32).reshape(-1),
                                              cached[0].astype(cupy.int32, copy=False)]))
        plan = plan_upload(both[:ids.size].reshape(ids.shape), n_expert, capacity, resident=both[ids.size:])
    sources = []
    for c, chunk in enumerate(plan.chunks):
        if chunk.resident:
            continue
        for name, (raw, _), pe in zip("gud", experts, per):
            base = int(raw.ctypes.data)
            sources.append(((name, c), [(base + e0 * pe, (e1 - e0) * pe) for e0, e1, _ in chunk.runs]))
    glu_fn, glu_smem = _mma_kernel(tg, True)
    down_fn, down_smem = _mma_kernel(td, False)
    i32, i64, null = np.int32, np.int64, np.uint64(0)
    n_rows = plan.src.shape[0]
    ring.start(sources)
    try:  # from here on a failure drops the ring's batch, so the next one can start
        counts = np.array([ch.n_tiles for ch in plan.chunks], dtype=np.int32)
        maps = cupy.asarray(np.concatenate([plan.src, plan.dest, plan.tiles.reshape(-1), counts]))
        src, dest = maps[:n_rows], maps[n_rows:2 * n_rows]
        tiles, n_tiles = maps[2 * n_rows:2 * n_rows + plan.tiles.size], maps[2 * n_rows + plan.tiles.size:]
        a16 = cupy.empty((n_rows, n_ff), dtype=cupy.float16)
        y = cupy.empty((n_rows, n_embd), dtype=cupy.float32)
        for c, chunk in enumerate(plan.chunks):
            t = tiles[4 * chunk.tile0:]
            cnt = n_tiles[c:c + 1]
            bg, bu, bd = (null if b is None else cupy.ascontiguousarray(b[cupy.asarray(chunk.experts)])
                          for b in biases)
            if chunk.resident:  # the cache's pools, indexed by slot
                (sg, vg), (su, vu), (sd, vd) = ((None, pool) for pool in cached[1])
            else:
                (sg, vg), (su, vu) = ring.take(("g", c)), ring.take(("u", c))
            glu_fn((-(-n_ff // MM_BN), chunk.n_tiles), (MM_THREADS,), (vg, vu, i64(per[0]), t, cnt, h, src,
                                                                      i32(n_embd), i32(n_ff), bg, bu,
                                                                      i32(GLU_ACTS[act]), a16), shared_mem=glu_smem)
            if not chunk.resident:
                ring.release(sg)
                ring.release(su)
                sd, vd = ring.take(("d", c))
            down_fn((-(-n_embd // MM_BN), chunk.n_tiles), (MM_THREADS,), (vd, i64(per[2]), t, cnt, a16, i32(n_ff),
                                                                          i32(n_embd), bd, y), shared_mem=down_smem)
            if not chunk.resident:
                ring.release(sd)
        copied = sum(n for _, pieces in sources for _, n in pieces)
    except BaseException:
        ring.reset()
        raise
    return combine(y, wts, n_tok, rows=dest, residual=residual), copied


def _n_in(raw: np.ndarray, type_name: str) -> int:
    """Values a row of a host expert tensor (n_expert, n_out, row_bytes) holds."""
    from .matmul import gpu_kernel  # noqa: PLC0415

    k = gpu_kernel(type_name)
    return int(raw.shape[2]) * raw.itemsize // k.type_size * k.block_size
