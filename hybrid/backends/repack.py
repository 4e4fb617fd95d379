"""CPU weight repacking, as llama.cpp's CPU_REPACK buffers (`--no-repack` keeps the file's layout): the Q4_0,
Q5_0, Q8_0, Q4_K, MXFP4 and IQ4_XS matrices of the layers the CPU runs are copied once, at load, into 8-row
interleaved groups (kernels_cpu.legacy_x8, q8_0_x8, q4_k_x8, mxfp4_x8, iq4_xs_x8), which its integer dots read at a
lower cost per byte.
The copy replaces the mapping's pages: each matrix's pages are released (MADV_DONTNEED) as soon as it is copied, so
the resident memory grows by at most the layout's extra bytes (Q4_K: 4 bytes a block, 2.8%; IQ4_XS: 2 bytes a
block, 1.5%; Q4_0/Q5_0/Q8_0/MXFP4: none), not by the matrices. Bytes a matrix shares with its neighbours' pages stay
mapped.

Matrices and MoE expert tensors (each expert's matrix on its own) are repacked, and nothing when op offload streams
the CPU layers' weights to a GPU as they are. An output on the CPU tied to the token embeddings is repacked where
the embedding lookup reads the layout in place (kernels_cpu.get_rows: Q8_0_X8), one copy for both: token_embd and
output stay one Weight.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from kernels_cpu import get_rows, iq4_xs_x8, legacy_x8, mxfp4_x8, q4_k_x8, q8_0_x8
from kernels_cpu.signatures import REPACK as _COMPILED_REPACKS

from hybrid.system.memlock import release_pages
from hybrid.model.weights import ModelWeights, Weight

# GGML type -> (the repacked layout's name in kernels_cpu.matmul.REPACKED, can this shape be repacked, repack)
LAYOUTS = {
    "Q4_0": ("Q4_0_X8", legacy_x8.repackable, legacy_x8.repack_q4_0),
    "Q5_0": ("Q5_0_X8", legacy_x8.repackable, legacy_x8.repack_q5_0),
    "Q8_0": ("Q8_0_X8", q8_0_x8.repackable, q8_0_x8.repack),
    "Q4_K": ("Q4_K_X8", q4_k_x8.repackable, q4_k_x8.repack),
    "MXFP4": ("MXFP4_X8", mxfp4_x8.repackable, mxfp4_x8.repack),
    "IQ4_XS": ("IQ4_XS_X8", iq4_xs_x8.repackable, iq4_xs_x8.repack),
}


BASE_TYPE = {name: base for base, (name, _, _) in LAYOUTS.items()}  # a repacked layout -> the GGML type it holds


@dataclass(frozen=True)
class RepackResult:
    n_matrices: int = 0
    n_bytes: int = 0  # bytes of the repacked copies
    released_bytes: int = 0  # bytes of the file's pages given back
    types: tuple[str, ...] = ()  # the GGML types repacked


def repack_weights(weights: ModelWeights, layers: Iterable[int], output: bool) -> RepackResult:
    """Repack, in place in `weights`, the matrices of the repeating layers `layers` and (output=True) the output
    matrix, where their type has a repacked layout. Returns what was done."""
    done: list[tuple[str, int, int]] = []  # (type, bytes copied, bytes released), one per matrix

    def repack(w: Weight) -> Weight:
        new = _repacked(w)
        if new is None:
            return w
        done.append((w.type_name, new.nbytes, release_pages(w.raw)))  # each one's pages as soon as it is copied
        return new

    for il in layers:
        lw = weights.layers[il]
        for key, w in list(lw.items()):
            lw[key] = repack(w)
    if output and weights.output is not weights.token_embd:
        weights.output = repack(weights.output)
    elif output and tied_repacks(weights.output):  # one copy, read by the lookup and the output matrix
        weights.token_embd = weights.output = repack(weights.output)
    return RepackResult(len(done), sum(d[1] for d in done), sum(d[2] for d in done),
                        tuple(sorted({d[0] for d in done})))


def tied_repacks(w: Weight) -> bool:
    """Whether an output tied to the token embeddings (w) is repacked: where the embedding lookup reads its layout."""
    return repacked_type(w) in get_rows.TYPES


def repacked_type(w: Weight) -> str | None:
    """The layout `repack_weights` gives w (a name in kernels_cpu.matmul.REPACKED), or None where it keeps w."""
    layout = LAYOUTS.get(w.type_name)
    # only the types whose repack kernel the ahead-of-time compile list names (backends/cpu_kernels.py looks it up
    # in kernels_cpu.signatures.REPACK for every matrix this function repacks)
    if (layout is None or w.type_name not in _COMPILED_REPACKS or not isinstance(w.raw, np.ndarray)
            or w.raw.ndim not in (2, 3)):
        return None
    name, repackable, _ = layout
    return name if repackable(w.shape[-2:]) else None


def _repacked(w: Weight) -> Weight | None:
    name = repacked_type(w)
    if name is None:
        return None
    repack = LAYOUTS[w.type_name][2]
    if w.raw.ndim == 2:
        return Weight(w.name, name, w.shape, repack(w.raw))
    first = repack(w.raw[0])  # MoE experts (n_expert, out, in): each expert's matrix on its own
    out = np.empty((w.raw.shape[0], *first.shape), dtype=np.uint8)
    out[0] = first
    for e in range(1, w.raw.shape[0]):
        out[e] = repack(w.raw[e])
    return Weight(w.name, name, w.shape, out)


@lru_cache(maxsize=None)
def byte_permutation(type_name: str) -> np.ndarray | None:
    """Where each byte of a group of 8 rows' blocks lands in the repacked layout, when the layout only moves bytes:
    int32 (8 * type_size,), entry r * type_size + j = the offset in a repacked 8-row block (8 * type_size bytes, at
    (group * n_blocks + block) * 8 * type_size) of byte j of row r's block. None for a layout that also rewrites
    bytes or adds some (Q5_0, Q4_K, IQ4_XS), or a type without one. Found by repacking probe matrices with the CPU's
    own repack (so the GPU's inverse, kernels_gpu.unrepack, follows it by construction) and checked on two blocks
    a row: every block of a group is moved alike."""
    layout = LAYOUTS.get(type_name)
    if layout is None:
        return None
    from kernels_cpu.matmul import _kernel  # noqa: PLC0415

    ts = _kernel(type_name).type_size
    n = 8 * ts
    if n > 255:
        return None
    inv = None
    for b in range(2):  # a 2-block row: block b carries the codes 1..n, the other zeros
        raw = np.zeros((8, 2 * ts), dtype=np.uint8)
        raw[:, b * ts:(b + 1) * ts] = np.arange(1, n + 1, dtype=np.uint8).reshape(8, ts)
        out = layout[2](raw).reshape(-1)[b * n:(b + 1) * n]
        if sorted(out.tolist()) != list(range(1, n + 1)):
            return None
        here = np.empty(n, dtype=np.int32)
        here[out.astype(np.int64) - 1] = np.arange(n, dtype=np.int32)
        if inv is not None and not np.array_equal(inv, here):
            return None
        inv = here
    inv.flags.writeable = False
    return inv


def unrepack(raw: np.ndarray, type_name: str) -> np.ndarray:
    """The file's layout of a repacked (n_rows, row_bytes) matrix of `type_name` (a permuting layout: see
    byte_permutation): numpy's form of kernels_gpu.unrepack, its tests' reference."""
    inv = byte_permutation(type_name)
    if inv is None:
        raise ValueError(f"{type_name}: its repacked layout is not a permutation of the file's bytes")
    n_rows, rb = raw.shape
    n = inv.shape[0]
    nb = rb * 8 // n
    blocks = raw.reshape(n_rows // 8, nb, n)  # (group, block, the 8 rows' bytes repacked)
    rows = blocks[:, :, inv].reshape(n_rows // 8, nb, 8, n // 8)  # (group, block, row, byte)
    return np.ascontiguousarray(rows.transpose(0, 2, 1, 3)).reshape(n_rows, rb)


def repack_host_experts(layers: Iterable[dict[str, Weight]], names: Iterable[str]) -> RepackResult:
    """Repack, in place, the expert tensors `names` of GPU layers whose routed experts stay in RAM, where the layout
    only moves bytes (byte_permutation): the CPU runs their decode on the repacked dots, and a big batch still
    uploads them by DMA (the GPU puts the bytes back in place, kernels_gpu.unrepack, before dequantizing)."""
    done: list[tuple[str, int, int]] = []
    for lw in layers:
        for key in names:
            w = lw.get(key)
            if w is None or byte_permutation(w.type_name) is None:
                continue
            new = _repacked(w)
            if new is not None:
                done.append((w.type_name, new.nbytes, release_pages(w.raw)))
                lw[key] = new
    return RepackResult(len(done), sum(d[1] for d in done), sum(d[2] for d in done),
                        tuple(sorted({d[0] for d in done})))
